#!/usr/bin/python3
"""Plots `distopt train --metrics` files: loss and test accuracy against step
and against wall time, one line per run, on one figure; for gossip runs
(whose epoch records carry consensus_distance) also the consensus distance
against wall time and a comparison of the runs (final test accuracy and
wall time per run, as the SGP project's per-algorithm figures compare
them). Prints one line per run: its label, steps, wall time, final test
accuracy and last consensus distance.

Usage: /usr/bin/python3 scripts/plot_metrics.py RUN.jsonl [RUN2.csv ...] -o FILE.png [--label NAME ...]
Needs Debian's python3-matplotlib (scripts/install-deps installs it).
Each run's label defaults to its file name; the training loss is smoothed
over --smooth steps (default 50) so that runs can be told apart.
"""
import argparse
import csv
import json
import os
import sys


def read_run(path):
    steps, epochs = [], []
    if path.endswith(".csv"):
        with open(path) as f:
            for row in csv.DictReader(f):
                rec = {k: (float(v) if v not in ("", None) and k != "kind" else v) for k, v in row.items()}
                (steps if row["kind"] == "step" else epochs).append(rec)
    else:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    sys.exit(f"plot_metrics: error: {path}:{n}: not a JSON line ({e.msg})")
                (steps if rec.get("kind") == "step" else epochs).append(rec)
    if not steps or not epochs:
        sys.exit(f"plot_metrics: error: {path} has no step or epoch records (is it a distopt train --metrics file?)")
    return steps, epochs


def consensus_of(epochs):
    """(wall time, consensus distance) of the epochs that carry one."""
    return [(e["wall_s"], float(e["consensus_distance"])) for e in epochs
            if e.get("consensus_distance") not in (None, "")]


def smooth(values, window):
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--label", action="append", default=[])
    ap.add_argument("--smooth", type=int, default=50)
    ap.add_argument("--title", default="distopt train")
    args = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot_metrics: error: matplotlib is missing: apt-get install python3-matplotlib")
    runs = [read_run(path) for path in args.runs]
    gossip = any(consensus_of(epochs) for _, epochs in runs)
    rows = 3 if gossip else 2
    fig, ax = plt.subplots(rows, 2, figsize=(11, 3.75 * rows))
    finals = []
    for i, (path, (steps, epochs)) in enumerate(zip(args.runs, runs)):
        label = args.label[i] if i < len(args.label) else os.path.basename(path)
        loss = smooth([s["loss"] for s in steps], args.smooth)
        line, = ax[0][0].plot([s["step"] for s in steps], loss, label=label, linewidth=1)
        ax[0][1].plot([s["wall_s"] for s in steps], loss, color=line.get_color(), linewidth=1)
        for col, x in ((0, "step"), (1, "wall_s")):
            ax[1][col].plot([e[x] for e in epochs], [e["test_accuracy"] for e in epochs], "o-",
                            color=line.get_color(), markersize=3)
        consensus = consensus_of(epochs)
        if consensus:
            ax[2][0].plot([w for w, _ in consensus], [c for _, c in consensus], "o-", color=line.get_color(),
                          markersize=3, label=label)
        last = epochs[-1]
        finals.append((label, line.get_color(), last["wall_s"], last["test_accuracy"]))
        print(f"plot_metrics: {label}: {int(steps[-1]['step'])} steps, {last['wall_s']:.2f} s, test accuracy "
              f"{last['test_accuracy']:.4f}, consensus distance "
              f"{consensus[-1][1]:.6g}" if consensus else
              f"plot_metrics: {label}: {int(steps[-1]['step'])} steps, {last['wall_s']:.2f} s, test accuracy "
              f"{last['test_accuracy']:.4f}")
    ax[0][0].set(ylabel=f"training loss ({args.smooth}-step mean)", xlabel="step", yscale="log")
    ax[0][1].set(xlabel="wall time (s)", yscale="log")
    ax[1][0].set(ylabel="test accuracy", xlabel="step")
    ax[1][1].set(xlabel="wall time (s)")
    if gossip:
        ax[2][0].set(ylabel="consensus distance (epoch ends)", xlabel="wall time (s)", yscale="log")
        labels = [f[0] for f in finals]
        ax[2][1].barh(labels, [f[2] for f in finals], color=[f[1] for f in finals])
        for k, f in enumerate(finals):
            ax[2][1].annotate(f" {f[3]:.3f}", (f[2], k), va="center", fontsize=8)
        ax[2][1].set(xlabel="wall time (s), final test accuracy at the bar's end")
        ax[2][1].invert_yaxis()
    for a in ax.flat:
        a.grid(alpha=0.3)
    ax[0][0].legend(fontsize=8)
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(f"plot_metrics: wrote {args.output}")


if __name__ == "__main__":
    main()
