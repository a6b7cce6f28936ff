#!/usr/bin/python3
"""distopt train against PyTorch on the same MLP workload, in one run.

For each thread count T: `distopt train` with T ranks on the threads backend
(ddp, one thread per rank: T threads in all) and bench/torch_train.py with T
threads, on the same Fashion-MNIST files, model, optimizer, batch
size and epochs. The two alternate for --rounds rounds; the medians of
samples/s and their ratio are reported (distopt / torch). For T > 1 torch
runs twice per round, with T OpenMP threads and with 1 (its GEMMs use T
OpenBLAS threads either way), and the faster run is its figure: the peer is
torch at its best on this machine.

Usage: /usr/bin/python3 bench/compare_torch_train.py [--threads 1,2] [--rounds 3] [--epochs 1] [--json]
"""
import argparse
import json
import statistics
import subprocess
import sys


def last_json(cmd):
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default="build/bin/distopt")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--optimizer", default="adamw")
    ap.add_argument("--lr", default="1e-3")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for t in (int(x) for x in args.threads.split(",")):
        ours, theirs = [], []
        for r in range(args.rounds):
            ours.append(last_json([args.binary, "train", "--model", "mlp", "--data", "fashion-mnist", "--optimizer",
                                   args.optimizer, "--lr", args.lr, "--batch-size", "128", "--epochs",
                                   str(args.epochs), "--world", str(t), "--seed", str(r), "--progress", "none",
                                   "--json"]))
            runs = [last_json([sys.executable, "bench/torch_train.py", "--threads", str(t), "--omp-threads",
                               str(omp), "--epochs", str(args.epochs), "--optimizer", args.optimizer, "--lr",
                               args.lr, "--seed", str(r)]) for omp in sorted({t, 1})]
            theirs.append(max(runs, key=lambda x: x["samples_per_s"]))
        o = statistics.median(x["samples_per_s"] for x in ours)
        p = statistics.median(x["samples_per_s"] for x in theirs)
        rows.append({"threads": t, "distopt_samples_per_s": round(o), "torch_samples_per_s": round(p),
                     "ratio": round(o / p, 2), "rounds": args.rounds, "epochs": args.epochs,
                     "distopt_test_accuracy": [x["test_accuracy"] for x in ours],
                     "torch_test_accuracy": [round(x["test_accuracy"], 4) for x in theirs],
                     "torch_omp_threads": [x["omp_threads"] for x in theirs], "torch": theirs[0]["framework"]})
    print(f"{'threads':>7} {'distopt/s':>10} {'torch/s':>9} {'ratio':>6}  accuracy (distopt | torch)")
    for r in rows:
        print(f"{r['threads']:>7} {r['distopt_samples_per_s']:>10} {r['torch_samples_per_s']:>9} {r['ratio']:>6}  "
              f"{r['distopt_test_accuracy']} | {r['torch_test_accuracy']}")
    if args.json:
        print(json.dumps({"results": rows}))


if __name__ == "__main__":
    main()
