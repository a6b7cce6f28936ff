#!/usr/bin/python3
"""Time torch's CPU optimizer step() as a baseline for `distopt bench optim`.

Runs Adam, AdamW and SGD(momentum=0.9) from Debian's PyTorch (run with
/usr/bin/python3) on float32 CPU tensors, default single-tensor path (foreach
is not passed), for

  * 16M:      one tensor of 16 * 2**20 elements
  * 1000x16K: 1000 tensors of 16 * 2**10 elements each

with torch.set_num_threads(1) and (2). Each configuration does 3 warm-up steps
and then times --steps (>= 10) individual step() calls; the median is reported.

gbps counts only the bytes a step must move at minimum (float32, 4 bytes):
  adam / adamw: read param, grad, exp_avg, exp_avg_sq; write param, exp_avg,
                exp_avg_sq -> 7 * 4 * numel
  sgd momentum: read param, grad, momentum_buffer; write param, buffer
                -> 5 * 4 * numel
gbps = bytes / seconds_per_step / 1e9.

Output: one JSON object per line, e.g.
  {"rule": "adam", "case": "16M", "threads": 1, "seconds_per_step": 0.05, "gbps": 9.4, ...}
With --json, progress goes to stderr and a single {"results": [...]} object is
printed as the last line of stdout.

Usage: /usr/bin/python3 bench/torch_optim_bench.py [--json] [--steps N]
       [--rules adam,adamw,sgd] [--cases 16M,1000x16K] [--threads 1,2]
"""

import argparse
import json
import statistics
import sys
import time

import torch

CASES = {
    "16M": (1, 16 * 1024 * 1024),
    "1000x16K": (1000, 16 * 1024),
}

# (constructor, arrays read + written per element)
RULES = {
    "adam": (lambda ps: torch.optim.Adam(ps, lr=1e-3), 7),
    "adamw": (lambda ps: torch.optim.AdamW(ps, lr=1e-3), 7),
    "sgd": (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9), 5),
}


def make_params(n_tensors, numel, seed):
    gen = torch.Generator().manual_seed(seed)
    params = []
    for _ in range(n_tensors):
        p = torch.randn(numel, generator=gen, dtype=torch.float32)
        p.grad = torch.randn(numel, generator=gen, dtype=torch.float32)
        params.append(p)
    return params


def bench_one(rule, case, threads, steps, warmup):
    torch.set_num_threads(threads)
    n_tensors, numel = CASES[case]
    ctor, arrays = RULES[rule]
    params = make_params(n_tensors, numel, seed=1234)
    opt = ctor(params)
    for _ in range(warmup):
        opt.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    sec = statistics.median(times)
    total = n_tensors * numel
    nbytes = arrays * 4 * total
    del opt, params
    return {
        "rule": rule,
        "case": case,
        "threads": threads,
        "seconds_per_step": sec,
        "gbps": nbytes / sec / 1e9,
        "numel": total,
        "tensors": n_tensors,
        "bytes_per_step": nbytes,
        "steps_timed": steps,
        "min_seconds": min(times),
        "torch": torch.__version__,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description="torch CPU optimizer step() baseline")
    ap.add_argument("--json", action="store_true", help="print one {\"results\": [...]} object as the last line")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per configuration (>= 10)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rules", default=",".join(RULES))
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args(argv)
    if args.steps < 10:
        ap.error("--steps must be >= 10")
    rules = [r for r in args.rules.split(",") if r]
    cases = [c for c in args.cases.split(",") if c]
    threads = [int(t) for t in args.threads.split(",") if t]
    for r in rules:
        if r not in RULES:
            ap.error("unknown rule %r" % r)
    for c in cases:
        if c not in CASES:
            ap.error("unknown case %r" % c)

    torch.set_default_dtype(torch.float32)
    results = []
    with torch.no_grad():
        for case in cases:
            for rule in rules:
                for t in threads:
                    res = bench_one(rule, case, t, args.steps, args.warmup)
                    results.append(res)
                    line = json.dumps(res)
                    if args.json:
                        print(line, file=sys.stderr, flush=True)
                    else:
                        print(line, flush=True)
    if args.json:
        print(json.dumps({"results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
