#!/usr/bin/env python3
"""Every documented command line that starts a run resumes it with --resume added.

The `distopt train` lines of the README and docs/*.md code blocks (backslash
continuations joined, comments dropped) that name a complete run are run as
documented, with their checkpoints in a folder of the test's, and stopped
as a preempted job is (SIGTERM after step 1: DISTOPT_FAULT=term:0:1, so the
run stops after step 2 and writes its checkpoint). The same line with
--resume added must then go on from step 2 (stopped again: term:0:3, so at
step 4). Lines with placeholders (S, DIR, ...), another launcher's (srun,
torchrun, a process per rank started by hand, --join), a GPU's (--device
cuda) and lines that print rather than train are listed as not runnable
here, with the reason.

  resume_documented_test.py DISTOPT_BIN REPO_ROOT [--list]
"""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

# Flags whose lines this test cannot run here, and why.
SKIP = {
    "--help": "prints help",
    "--print-config": "prints a configuration",
    "--resume": "already a resume",
    "--join": "joins another run",
    "--rendezvous": "a process per rank, started by a launcher",
    "--device": "needs a GPU",
    "--config": "reads a file made by another line",
}
# Flags given on every run, replacing the documented value.
CUT = {"--checkpoint-dir", "--progress", "--json"}


def documented_lines(root):
    """(file, line) of every `distopt train ...` in a fenced code block."""
    files = [os.path.join(root, "README.md")]
    docs = os.path.join(root, "docs")
    files += sorted(os.path.join(docs, f) for f in os.listdir(docs) if f.endswith(".md"))
    out = []
    for path in files:
        fenced = False
        pending = ""
        for raw in open(path, encoding="utf-8"):
            line = raw.rstrip("\n")
            if line.lstrip().startswith("```"):
                fenced = not fenced
                pending = ""
                continue
            if not fenced:
                continue
            text = pending + line.strip()
            if text.endswith("\\"):
                pending = text[:-1] + " "
                continue
            pending = ""
            text = re.sub(r"^\$\s*", "", text)
            if re.search(r"(^|\s)(\S*/)?distopt train(\s|$)", text):
                out.append((os.path.relpath(path, root), text))
    return out


def command_of(text):
    """(launcher, the arguments after `distopt`), or (None, why) when the line cannot run here."""
    text = text.split("  #")[0].split(" # ")[0].strip()
    if any(c in text for c in "$[{|>") or "..." in text:
        return None, "has a placeholder or shell syntax"
    words = shlex.split(text)
    at = next(i for i, w in enumerate(words) if w.endswith("distopt") and words[i + 1:i + 2] == ["train"])
    launcher, args = words[:at], words[at + 1:]
    if launcher and launcher[0] == "srun":
        return None, "a SLURM launcher's line (tests/slurm_test.sh runs srun's)"
    if launcher and not (launcher[0] == "mpirun" and len(launcher) == 3 and launcher[1] == "-np"):
        return None, "another launcher"
    if launcher and shutil.which("mpirun") is None:
        return None, "mpirun is not installed"
    for a in args:
        if a in SKIP:
            return None, SKIP[a]
    for a, b in zip(args, args[1:]):
        if a.startswith("--") and re.fullmatch(r"[A-Z]+", b):
            return None, "has a placeholder (" + b + ")"
    if launcher == [] and "--backend" in args:
        return None, "a process per rank, started by a launcher"
    if len(args) < 2:
        return None, "names no run"
    return launcher + ["distopt"] + args, ""


def cut(args, ckpt):
    """The documented arguments without the flags this test sets, then its own."""
    kept = []
    skip_value = False
    for a in args:
        if skip_value:
            skip_value = False
        elif a in CUT:
            skip_value = a != "--json"  # the others take a value
        else:
            kept.append(a)
    return kept + ["--checkpoint-dir", ckpt, "--progress", "none", "--json"]


def stopped(command, fault, env, cwd):
    """The JSON summary of `command` stopped by DISTOPT_FAULT=`fault` (SIGTERM after a step)."""
    done = subprocess.run(command, cwd=cwd, env=dict(env, DISTOPT_FAULT=fault), capture_output=True, text=True)
    if done.returncode == 0 or not done.stdout.strip():
        raise RuntimeError("%s with DISTOPT_FAULT=%s exited %d: %s" %
                           ("--resume" if "--resume" in command else "the run", fault, done.returncode,
                            done.stderr.strip()))
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    binary, root = sys.argv[1], sys.argv[2]
    listing = "--list" in sys.argv[3:]
    runs, skipped, failures = [], [], []
    seen = set()
    for where, text in documented_lines(root):
        args, why = command_of(text)
        if args is None:
            skipped.append((where, text, why))
            continue
        key = tuple(args)
        if key in seen:
            continue
        seen.add(key)
        runs.append((where, args))
    if listing:
        for where, words in runs:
            print("run ", where, " ".join(words))
        for where, text, why in skipped:
            print("skip", where, text, "--", why)
        return 0
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", OMPI_MCA_btl_vader_single_copy_mechanism="none")
    with tempfile.TemporaryDirectory(prefix="distopt-resume-doc-") as tmp:
        for k, (where, words) in enumerate(runs):
            ckpt = os.path.join(tmp, "ck%d" % k)
            line = " ".join(words)
            at = words.index("distopt")
            launcher, args = words[:at], words[at + 1:]
            began = time.monotonic()
            start = launcher + [binary] + cut(args, ckpt)
            again = start + ["--resume"]
            try:
                s1 = stopped(start, "term:0:1", env, tmp)
                s2 = stopped(again, "term:0:3", env, tmp)
            except RuntimeError as e:
                failures.append("%s: `%s`: %s" % (where, line, e))
                continue
            if s1["steps"] != 2 or s2["steps"] != 4 or not s1["interrupted"] or not s2["interrupted"]:
                failures.append("%s: `%s`: stopped at step %d, resumed and stopped at %d (2 and 4 expected)" %
                                (where, line, s1["steps"], s2["steps"]))
                continue
            print("resumed (%.1f s): %s: %s" % (time.monotonic() - began, where, line))
    print("%d documented command lines started and resumed, %d failed; %d lines not runnable here" %
          (len(runs) - len(failures), len(failures), len(skipped)))
    for f in failures:
        print("FAIL " + f)
    if not runs:
        print("FAIL no documented command line found")
        return 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
