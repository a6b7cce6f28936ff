#!/usr/bin/python3
"""distopt.torch.optim's step from Python against torch's own, same process.

Cases: one 16M-element tensor and 1000 tensors of 16K elements (float32,
CPU, one thread: torch.set_num_threads(1), distopt's optimizer on one
thread), and 1000 tensors of 1 element for the per-call overhead. For
Adam, AdamW and SGD(momentum=0.9): torch's for-loop (foreach=False) and
foreach (foreach=True) implementations and distopt's drop-in, steps
alternating, median of --steps timings each. Reports seconds per step,
distopt's speed-up over torch's best, and for the 1000 x 1 case the time
per parameter in microseconds (the binding's overhead: nothing to compute).

--train: a whole training step of examples/python/fashion_mnist_mlp.py's
model (784-256-128-10, batch 128, AdamW) with torch's AdamW (for-loop and
foreach) and distopt's: the step's time and the optimizer's share of it.

Run with Debian's interpreter and the build's package:
  PYTHONPATH=build/python /usr/bin/python3 bench/python_optim_bench.py [--json] [--steps 15] [--train]
"""

import argparse
import json
import statistics
import sys
import time

import torch

from distopt.torch import optim as dopt

CASES = {"16M": (1, 16 << 20), "1000x16K": (1000, 16 << 10), "1000x1": (1000, 1)}
RULES = {"adam": ("Adam", {}), "adamw": ("AdamW", {}), "sgd-momentum": ("SGD", {"lr": 0.01, "momentum": 0.9})}


def make(impl, cls_name, kw, tensors, elements):
    params = [torch.full((elements,), 0.5, requires_grad=True) for _ in range(tensors)]
    for p in params:
        p.grad = torch.full_like(p, 0.01)
    if impl == "distopt":
        return getattr(dopt, cls_name)(params, **kw)
    return getattr(torch.optim, cls_name)(params, foreach=(impl == "foreach"), **kw)


def train_share(steps):
    """Median seconds of a whole step and of its opt.step(), per optimizer."""
    torch.manual_seed(0)
    x, y = torch.rand(128, 784), torch.randint(0, 10, (128,))
    runs = {}
    for impl in ["forloop", "foreach", "distopt"]:
        model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128),
                                    torch.nn.ReLU(), torch.nn.Linear(128, 10))
        opt = (dopt.AdamW(model.parameters(), lr=1e-3) if impl == "distopt"
               else torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=(impl == "foreach")))
        runs[impl] = (model, opt, [], [])
    for _ in range(steps):
        for impl, (model, opt, total, inner) in runs.items():
            t0 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            total.append(t2 - t0)
            inner.append(t2 - t1)
    out = []
    print(f"{'AdamW':8} {'step ms':>9} {'opt.step ms':>12} {'share':>7}", file=sys.stderr)
    for impl, (_, _, total, inner) in runs.items():
        t, o = statistics.median(total), statistics.median(inner)
        out.append({"impl": impl, "step_s": t, "optimizer_s": o, "optimizer_share": o / t})
        print(f"{impl:8} {t * 1e3:9.3f} {o * 1e3:12.3f} {o / t:7.3f}", file=sys.stderr)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--train", action="store_true", help="only the whole training step's optimizer share")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.train:
        results = train_share(max(args.steps, 50))
        if args.json:
            print(json.dumps({"torch": torch.__version__, "train": results}))
        return
    impls = ["forloop", "foreach", "distopt"]
    results = []
    print(f"{'rule':13} {'case':9} {'forloop s':>10} {'foreach s':>10} {'distopt s':>10} {'speed-up':>9}", file=sys.stderr)
    for case, (tensors, elements) in CASES.items():
        for rule, (cls_name, kw) in RULES.items():
            opts = {i: make(i, cls_name, kw, tensors, elements) for i in impls}
            for o in opts.values():
                o.step()
            times = {i: [] for i in impls}
            for _ in range(args.steps):
                for i in impls:
                    t0 = time.perf_counter()
                    opts[i].step()
                    times[i].append(time.perf_counter() - t0)
            med = {i: statistics.median(t) for i, t in times.items()}
            best = min(med["forloop"], med["foreach"])
            r = {"rule": rule, "case": case, **{f"{i}_s": med[i] for i in impls},
                 "speedup_vs_best_torch": best / med["distopt"]}
            if case == "1000x1":
                r["distopt_us_per_param"] = med["distopt"] / tensors * 1e6
            results.append(r)
            print(f"{rule:13} {case:9} {med['forloop']:10.5f} {med['foreach']:10.5f} {med['distopt']:10.5f} "
                  f"{best / med['distopt']:9.2f}" + (f"   {r['distopt_us_per_param']:.2f} us/param" if case == "1000x1" else ""),
                  file=sys.stderr)
    if args.json:
        print(json.dumps({"torch": torch.__version__, "results": results}))


if __name__ == "__main__":
    main()
