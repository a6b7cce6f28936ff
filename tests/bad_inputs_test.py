#!/usr/bin/env python3
"""Bad input, swept by class (docs/reliability.md): every numeric, choice
and path flag of `distopt train` and `replay` with values it must refuse,
plus malformed files. Each case must end with status 2 and exactly one
line on stderr, "distopt: error: ...", never an internal error (3) or a
signal, and leave no file behind. Usage: bad_inputs_test.py DISTOPT"""
import os
import subprocess
import sys
import tempfile

BIN = os.path.abspath(sys.argv[1])
SYN = ["train", "--data", "synthetic", "--train-size", "256", "--test-size", "64", "--progress", "none"]

cases = []  # (description, argv)

def add(args, why=""):
    cases.append((why or " ".join(args), args))

# Counts: negative, not a number, fractional, overflowing, empty.
for flag in ["--batch-size", "--seed", "--max-steps", "--train-size", "--test-size", "--epochs", "--world",
             "--swa-start", "--swa-anneal-epochs", "--growth-interval", "--hidden"]:
    for v in ["-1", "abc", "1.5", "99999999999999999999999", "", "0x"]:
        if flag in ("--train-size",) and v == "":
            continue
        add(SYN + [flag, v])
for flag, v in [("--epochs", "0"), ("--world", "0"), ("--batch-size", "0"), ("--hidden", "0"),
                ("--hidden", "100000000"), ("--train-size", "100000000"),
                ("--world", "100000"), ("--train-size", "0"), ("--swa-start", "-3")]:
    add(SYN + [flag, v])
# The live limits (zero3 takes all three).
for flag in ["--prefetch-units", "--max-live-params", "--max-buckets-in-flight"]:
    for v in ["-1", "abc", "1.5", "99999999999999999999999", "", "0x"]:
        add(SYN + ["--strategy", "zero3", flag, v])
add(SYN + ["--strategy", "zero3", "--max-buckets-in-flight", "0"])
add(SYN + ["--strategy", "zero3", "--max-live-params", "1"])
# Reals: not a number, non-finite, out of range.
for flag in ["--lr", "--weight-decay", "--eps", "--clip-grad-norm", "--clip-grad-value", "--ema-decay", "--swa-lr",
             "--init-scale", "--growth-factor", "--backoff-factor", "--bucket-cap-mb", "--comm-timeout",
             "--clip-norm-type"]:
    for v in ["abc", "nan", "inf", "1e999", "", "-1"]:
        extra = []
        if flag in ("--init-scale", "--growth-factor", "--backoff-factor"):
            extra = ["--loss-scale", "dynamic"]
        if flag == "--swa-lr":
            extra = ["--swa-start", "1"]
        if flag == "--clip-norm-type":
            if v == "inf":
                continue  # the max norm
            extra = ["--clip-grad-norm", "1"]
        add(SYN + extra + [flag, v])
for flag, v, extra in [("--ema-decay", "1.5", []), ("--growth-factor", "0.5", ["--loss-scale", "dynamic"]),
                       ("--backoff-factor", "1.5", ["--loss-scale", "dynamic"]), ("--init-scale", "1e39", ["--loss-scale", "dynamic"]),
                       ("--betas", "0.9", []), ("--betas", "0.9,abc", []), ("--betas", "a,b", []),
                       ("--momentum", "0.9", []), ("--amsgrad", "maybe", []), ("--lr", "-0.1", [])]:
    add(SYN + extra + [flag, v])
# Choices: unknown words, empty words.
for flag in ["--model", "--data", "--optimizer", "--strategy", "--backend", "--progress", "--param-dtype",
             "--loss-scale", "--on-nonfinite", "--swa-anneal-strategy", "--scheduler-interval", "--scheduler"]:
    for v in ["bogus", ""]:
        if flag == "--backend" and v == "":
            continue
        add(SYN + [flag, v])
# Schedulers.
for spec in ['{"name": "steplr"', '{"name": "steplr", "options": {"step_size": 1e999}}', '{"name": 3}',
             '{"name": "steplr", "options": {"step_size": -1}}', '{"name": "onecyclelr", "options": {"max_lr": 1}}',
             '{"name": "sequentiallr", "schedulers": []}', '[]', '{}']:
    add(SYN + ["--scheduler", spec])
for opts in [["step_size"], ["=3"], ["step_size=abc"], ["gamma=0.5"], ["milestones=1,,2"]]:
    add(SYN + ["--scheduler", "steplr", "--scheduler-option"] + opts)
add(SYN + ["--scheduler-option", "step_size=3"])
# Combinations that cannot work.
for args in [["--batch-size", "2", "--world", "4"], ["--swa-lr", "0.1"], ["--swa-start", "5", "--epochs", "2"],
             ["--swa-start", "1", "--ema-decay", "0.9"], ["--export-averaged", "a.st"], ["--init-scale", "8"],
             ["--drop-last", "--batch-size", "1000"], ["--test-size", "0", "--scheduler", "reducelronplateau"],
             ["--max-steps", "1", "--epochs", "3", "--swa-start", "2"], ["--strategy", "adpsgd", "--topology", "ring"],
             ["--strategy", "adpsgd", "--peers-per-iteration", "2"], ["--topology", "ring"],
             ["--optimizer", "adafactor", "--lr", "0.01"], ["--optimizer", "adafactor", "--relative-step", "false"],
             ["--optimizer", "lamb", "--max-grad-norm", "-1"], ["--optimizer", "lars", "--momentum", "-1"],
             ["--strategy", "sgp", "--synch-freq", "2"], ["--strategy", "sgp", "--topology", "hypercube"],
             ["--strategy", "dpsgd", "--world", "3"], ["--strategy", "sgp", "--param-dtype", "bf16"],
             ["--strategy", "slowmo", "--slowmo-momentum", "1"], ["--strategy", "slowmo", "--topology", "ring"],
             ["--strategy", "osgp", "--synch-freq", "-1"], ["--strategy", "slowmo", "--slowmo-base", "sgd"],
             ["--strategy", "sgp", "--topology", "exponential-k", "--peers-per-iteration", "2", "--world", "2"],
             ["--model", "linreg"], ["--backend", "mpi", "--world", "3"]]:
    add(SYN + args)
# Outputs: empty, a folder, a missing folder, the same file twice.
for flag in ["--metrics", "--export-params"]:
    for v in ["", ".", "missing/x", "/proc/distopt-cannot-write"]:
        add(SYN + [flag, v])
add(SYN + ["--metrics", "same", "--export-params", "same"])
# Unknown flags and stray words.
for args in [["--lrr", "0.1"], ["--world"], ["extra"], ["--json=maybe"], ["--progress"]]:
    add(SYN + args)
add(["frobnicate"])
add([])

# Files: replay and Fashion-MNIST inputs, written into the case's folder.
FILES = {
    "empty.json": b"",
    "truncated.json": b'{"optimizer": "adam", "params": [',
    "notjson.json": b"\x00\x01\x02garbage",
    "overflow.json": b'{"optimizer": "adam", "options": {"lr": 1e999}, "params": [], "steps": []}',
    "array.json": b"[1, 2, 3]",
    "deep.json": b"[" * 100000,
    "shape.json": (b'{"format": "distopt-replay/1", "optimizer": {"name": "sgd", "options": {"lr": 0.1}},'
                   b' "params": [{"shape": [3, 6148914691236517206], "data": [1, 2]}], "steps": []}'),
    "unknown_opt.json": b'{"format": "distopt-replay/1", "optimizer": {"name": "nadamw"}, "params": [], "steps": []}',
    "negative_shape.json": (b'{"format": "distopt-replay/1", "optimizer": {"name": "sgd", "options": {"lr": 0.1}},'
                            b' "params": [{"shape": [-2], "data": [1, 2]}], "steps": []}'),
    "wrong_count.json": (b'{"format": "distopt-replay/1", "optimizer": {"name": "sgd", "options": {"lr": 0.1}},'
                         b' "params": [{"shape": [3], "data": [1, 2]}], "steps": []}'),
}
for name in FILES:
    add(["replay", name], f"replay {name}")
    add(["replay", "--check", name], f"replay --check {name}")
add(["replay", "missing.json"])
add(["replay", "/dev/zero"])
add(["replay", "."])
add(["replay", "--check", "missing-folder"])
add(["replay", "--atol", "-1", "--check", "x.json"])
add(["replay", "--rtol", "abc", "--check", "x.json"])
IDX = {
    "short": b"\x00\x00\x08\x03\x01\x40\x00\x00\x00\x00\x00\x1c\x00\x00\x00\x1c" + b"\x00" * 84,
    "magic": b"\x01\x02\x08\x03" + b"\x00" * 96,
    "empty": b"",
}
for kind in IDX:
    add(SYN[:1] + ["--data", "fashion-mnist", "--data-dir", f"idx-{kind}", "--progress", "none"], f"fashion-mnist idx {kind}")
add(["train", "--data-dir", "no-such-folder", "--progress", "none"])
add(["bench", "bogus"])
add(["bench", "optim", "--sizes", "abc"])

failures = 0
with tempfile.TemporaryDirectory() as root:
    for i, (why, args) in enumerate(cases):
        d = os.path.join(root, str(i))
        os.mkdir(d)
        for name, data in FILES.items():
            with open(os.path.join(d, name), "wb") as f:
                f.write(data)
        for kind, data in IDX.items():
            os.mkdir(os.path.join(d, f"idx-{kind}"))
            for part in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
                         "t10k-labels-idx1-ubyte.gz"):
                with open(os.path.join(d, f"idx-{kind}", part), "wb") as f:
                    f.write(data)
        before = set(os.listdir(d))
        try:
            p = subprocess.run([BIN] + args, cwd=d, capture_output=True, timeout=60)
        except subprocess.TimeoutExpired:
            print(f"FAIL {why}: no answer within 60 s")
            failures += 1
            continue
        err = p.stderr.decode(errors="replace")
        lines = err.splitlines()
        problems = []
        if p.returncode != 2:
            problems.append(f"status {p.returncode}")
        # replay --check reports each case on its own line, "FAIL FILE: error".
        prefix = "FAIL " if "--check" in args and len(args) > 2 and args[1] == "--check" else "distopt: error: "
        if len(lines) != 1 or not lines[0].startswith(prefix):
            problems.append(f"stderr {err!r}")
        left = set(os.listdir(d)) - before
        if left:
            problems.append(f"left {sorted(left)}")
        if problems:
            failures += 1
            print(f"FAIL {why}: {'; '.join(problems)}")
print(f"bad inputs: {len(cases) - failures} of {len(cases)} refused cleanly")
sys.exit(1 if failures else 0)
