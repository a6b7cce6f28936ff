#!/usr/bin/env python3
"""The peer of `distopt bench optim --device cuda`: PyTorch's own optimizers
on the GPU, at the same shapes, against the same roofline, in one process.

For each case (256M: one tensor of 256 * 2**20 elements; 100x10M; 1000x256K)
it measures a device-to-device copy (torch.Tensor.copy_ of a buffer as large
as half the bytes a step moves) and torch's Adam, AdamW and SGD(momentum=0.9)
in each implementation torch offers on CUDA: the for-loop
(foreach=False), foreach (foreach=True) and fused (fused=True). Steps and
copies alternate; each figure is the median of --steps timings, each one
bracketed by torch.cuda.synchronize().

Bytes moved per element, as distopt counts them: f32 parameters read and
written, the gradient read, each state tensor read and written (Adam 7 x 4,
SGD with momentum 5 x 4); bf16 parameters (--dtype bf16, fused only as torch
keeps no fp32 master weights: state in bf16 too) count 2 bytes for the
parameter, the gradient and each state tensor.

Output: a table on stderr; with --json a single {"results": [...]} object on
the last line of stdout, each with rule, impl, case, gbps, roofline_gbps,
fraction.

Usage: python3 bench/torch_optim_cuda.py [--json] [--steps 20]
       [--cases 256M,100x10M,1000x256K] [--dtype f32|bf16]
"""

import argparse
import json
import statistics
import sys
import time

import torch

CASES = {"256M": (1, 256 << 20), "100x10M": (100, 10 << 20), "1000x256K": (1000, 256 << 10)}
RULES = {
    "adamw": (torch.optim.AdamW, {}, 2),
    "adam": (torch.optim.Adam, {}, 2),
    "sgd-momentum": (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9}, 1),
}


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cases", default="256M,100x10M,1000x256K")
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("torch_optim_cuda.py: no CUDA device visible to torch")
    dtype = torch.float32 if args.dtype == "f32" else torch.bfloat16
    es = 4 if args.dtype == "f32" else 2
    results = []
    print(f"{'rule':14} {'impl':8} {'case':10} {'GB/s':>10} {'roofline':>10} {'fraction':>9}", file=sys.stderr)
    for case in args.cases.split(","):
        tensors, elements = CASES[case]
        for rule, (cls, options, state) in RULES.items():
            impls = ["fused"] if args.dtype == "bf16" else ["forloop", "foreach", "fused"]
            for impl in impls:
                params = [torch.full((elements,), 0.5, device="cuda", dtype=dtype) for _ in range(tensors)]
                for p in params:
                    p.grad = torch.full_like(p, 0.01)
                kw = dict(options)
                kw["foreach"] = impl == "foreach"
                if impl == "fused":
                    kw["fused"] = True
                    kw["foreach"] = False
                opt = cls(params, **kw)
                opt.step()
                total = tensors * elements
                nbytes = total * es * (2 + 1 + 2 * state)
                src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
                dst = torch.empty_like(src)
                dst.copy_(src)
                t_rule, t_roof = [], []
                for _ in range(args.steps):
                    t_roof.append(timed(lambda: dst.copy_(src)))
                    t_rule.append(timed(opt.step))
                gbps = nbytes / statistics.median(t_rule) / 1e9
                roof = nbytes / statistics.median(t_roof) / 1e9
                r = {"rule": rule, "impl": impl, "case": case, "dtype": args.dtype, "gbps": gbps,
                     "roofline_gbps": roof, "fraction": gbps / roof}
                results.append(r)
                print(f"{rule:14} {impl:8} {case:10} {gbps:10.1f} {roof:10.1f} {gbps / roof:9.3f}", file=sys.stderr)
                del opt, params, src, dst
                torch.cuda.empty_cache()
    if args.json:
        print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}))


if __name__ == "__main__":
    main()
