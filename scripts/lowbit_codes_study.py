#!/usr/bin/python3
"""Which code and block size for 8-bit optimizer state: measured with PyTorch.

The [lowbit] issue asks that the int8 state's code and block size be chosen
by measurement (docs/performance.md, "Quantized optimizer state: the code
and the block"). This script trains the Fashion-MNIST MLP of
`scripts/bench_lowbit --part mnist` (784-256-128-10, ReLU, AdamW lr 1e-3,
weight decay 1e-2, batch 128) with torch.optim.AdamW whose two moments are
kept quantized between steps, exactly as scripts/gen_golden_lowbit.py
defines distopt's quantized state (after each step the state is replaced by
code * absmax of its block; tensors under 4096 elements keep fp32), for
each candidate:

  code     dynamic   bitsandbytes' dynamic map (distopt's int8 books)
           fp        a float-like code: sign + 4 exponent + 3 mantissa bits
                     for the first moment, 4 + 4 for the second
                     (bench/quant_codes.cpp's, which needs no table)
           linear    256 evenly spaced codes on [-1, 1] ([1/256, 1] unsigned)
  block    the elements sharing one absmax scale

and prints the test accuracy per seed, and the quantization error of the
moments at the end of training (mean |dequant(quant(x)) - x| / mean |x|, on
the first and on the second moment, and the fraction of second-moment
elements whose value reads back 0 while the first moment's does not).

  /usr/bin/python3 scripts/lowbit_codes_study.py [--epochs 15] [--seeds 1 2 3]
      [--candidates f32 dynamic:256 dynamic:64 ...]

It is a study, not a test: the results are in docs/performance.md.
"""
import argparse
import gzip
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_golden_lowbit as REF  # noqa: E402  (distopt's code books and quantizer, in torch)

DATA = "/usr/share/datasets/fashion-mnist"


def float_code(signed, mantissa_bits, min_exponent):
    """The magnitudes of a float-like code (subnormals below 2^min_exponent), at most 1, sorted."""
    m = 2 ** mantissa_bits
    values = [c * 2.0 ** (min_exponent - mantissa_bits) for c in range(m)]
    e = min_exponent
    while True:
        row = [2.0 ** e * (1 + f / m) for f in range(m)]
        values += [v for v in row if v <= 1.0]
        if row[-1] >= 1.0 or any(v > 1.0 for v in row):
            break
        e += 1
    if 1.0 not in values:
        values.append(1.0)
    values = sorted(set(values))
    if signed:
        values = sorted(set([-v for v in values] + values))
    return torch.tensor(values, dtype=torch.float32)


CODES = {
    "dynamic": (REF.CODES[("int8", True)], REF.CODES[("int8", False)]),
    "fp": (float_code(True, 3, -14), float_code(False, 4, -14)),
    "linear": (torch.linspace(-1, 1, 255, dtype=torch.float32),
               torch.linspace(0, 1, 257, dtype=torch.float32)[1:].contiguous()),
}


TABLES = {}


def order_key(f):
    """float32 bits as int64 keys in the floats' order (as src/optim/quant.cpp's)."""
    u = f.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(u >= 2 ** 31, 0xFFFFFFFF - u, u + 2 ** 31)


def table_of(code):
    """The decision points of a code (the codes' midpoints in float32; ties
    to the lower code) and, for each bucket of floats sharing their key's
    top 16 bits, the number of points below the bucket: a point count is the
    nearest code, as src/optim/quant.cpp's Book counts it."""
    if id(code) not in TABLES:
        mid = ((code[:-1] + code[1:]) / 2).contiguous()
        keys = torch.arange(2 ** 16, dtype=torch.int64) << 16
        def from_key(k):
            u = torch.where(k >= 2 ** 31, k - 2 ** 31, 0xFFFFFFFF - k)
            return (u - ((u >= 2 ** 31).to(torch.int64) << 32)).to(torch.int32).view(torch.float32)
        lo, hi = from_key(keys), from_key(keys + (2 ** 16 - 1))
        ok = ~(torch.isnan(lo) | torch.isnan(hi))
        first = torch.bucketize(lo, mid)
        steps = int((torch.bucketize(hi, mid) - first)[ok].max())
        TABLES[id(code)] = (torch.cat([mid, torch.tensor([float("inf")])]), first, steps)
    return TABLES[id(code)]


def roundtrip(x, code, block):
    """x (flat) quantized block by block to the code nearest x / absmax and
    read back. The decision points are the codes' midpoints in float32
    (ties to the lower code): distopt's exact thresholds differ from them
    only for values within an ulp of a midpoint, which a study of accuracy
    cannot see; the bucket table makes it fast enough to train with."""
    mid, first, steps = table_of(code)
    n = x.numel()
    pad = (-n) % block
    xb = torch.cat([x, x.new_zeros(pad)]).view(-1, block)
    a = xb.abs().amax(dim=1, keepdim=True)
    q = (xb / torch.where(a == 0, torch.ones_like(a), a)).reshape(-1)
    pick = first[order_key(q) >> 16]
    for _ in range(steps):
        pick += mid[pick] < q
    if code[0] == 0:  # unsigned with a zero: a positive value never reads 0
        pick = torch.where((q > 0) & (pick == 0), torch.ones_like(pick), pick)
    return (code[pick].view(-1, block) * a).reshape(-1)[:n]


def load_split(kind):
    def read(name, offset):
        with gzip.open(os.path.join(DATA, name)) as f:
            return torch.frombuffer(bytearray(f.read()[offset:]), dtype=torch.uint8)
    x = read(f"{kind}-images-idx3-ubyte.gz", 16).view(-1, 784).float() / 255.0
    y = read(f"{kind}-labels-idx1-ubyte.gz", 8).long()
    return x, y


def run(candidate, seed, epochs, train, test):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128),
                                torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
    quantized = None
    if candidate != "f32":
        name, block = candidate.split(":")
        quantized = (CODES[name], int(block))
    x, y = train
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(x.shape[0], generator=g)
        for b in range(0, x.shape[0], 128):
            idx = order[b:b + 128]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            if quantized is None:
                continue
            (signed, unsigned), block = quantized
            for p in model.parameters():
                if p.numel() < REF.MIN_SIZE:
                    continue
                st = opt.state[p]
                st["exp_avg"].copy_(roundtrip(st["exp_avg"].reshape(-1), signed, block).view_as(p))
                st["exp_avg_sq"].copy_(roundtrip(st["exp_avg_sq"].reshape(-1), unsigned, block).view_as(p))
    with torch.no_grad():
        acc = (model(test[0]).argmax(dim=1) == test[1]).float().mean().item()
    # The codes' error on this run's final moments (fp32 values of the last step, before any rounding here).
    errors = {}
    for name, (signed, unsigned) in CODES.items():
        for block in (64, 256, 2048):
            em = ev = mm = mv = 0.0
            lost = total = 0
            for p in model.parameters():
                if p.numel() < REF.MIN_SIZE:
                    continue
                m, v = opt.state[p]["exp_avg"].reshape(-1), opt.state[p]["exp_avg_sq"].reshape(-1)
                rm, rv = roundtrip(m, signed, block), roundtrip(v, unsigned, block)
                em += (rm - m).abs().sum().item()
                ev += (rv - v).abs().sum().item()
                mm += m.abs().sum().item()
                mv += v.abs().sum().item()
                lost += ((rv == 0) & (rm != 0)).sum().item()
                total += m.numel()
            errors[f"{name}:{block}"] = (em / mm, ev / mv, lost / total)
    return acc, errors


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--candidates", nargs="+",
                    default=["f32", "dynamic:256", "dynamic:64", "linear:256", "fp:256"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    train, test = load_split("train"), load_split("t10k")
    print(f"Fashion-MNIST MLP, AdamW, {args.epochs} epochs, seeds {args.seeds}; torch {torch.__version__}", flush=True)
    means = {}
    for candidate in args.candidates:
        accs = []
        for seed in args.seeds:
            t = time.time()
            acc, errors = run(candidate, seed, args.epochs, train, test)
            accs.append(acc)
            print(f"{candidate:>14} seed {seed}: test accuracy {acc:.4f} ({time.time() - t:.0f} s)", flush=True)
            if candidate == "f32" and seed == args.seeds[0]:
                print("   quantization error of fp32 AdamW's final moments "
                      "(exp_avg, exp_avg_sq relative; exp_avg_sq read as 0 where exp_avg is not):")
                for k, (a, b, c) in errors.items():
                    print(f"   {k:>14}: {a:.4f} {b:.4f} {c:.2e}")
        means[candidate] = sum(accs) / len(accs)
        print(f"{candidate:>14} mean {means[candidate]:.4f}", flush=True)
    if "f32" in means:
        for c, m in means.items():
            print(f"{c:>14}: {m:.4f} ({100 * (m - means['f32']):+.2f} pp against f32)")


if __name__ == "__main__":
    main()
