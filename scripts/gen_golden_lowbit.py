#!/usr/bin/python3
"""Generate golden cases for quantized optimizer state with PyTorch.

Writes tests/golden/lowbit/lowbit.json:

- "codes": the four code books of distopt's quantized state, made with
  torch's float32 arithmetic as bitsandbytes and torchao make them
  (bitsandbytes/functional.py create_dynamic_map; torchao/optim
  subclass_4bit.py): int8 signed (the dynamic map, 7 exponent bits),
  int8 unsigned, int4 signed (the dynamic map with 3 exponent bits, 4 bits
  in all) and int4 unsigned (linspace(0, 1, 17)[1:]: no zero).
- "cases": torch.optim.Adam / AdamW / SGD run for a few steps with their
  state tensors kept quantized between steps: before each step the state
  is dequantized (code * absmax of its block) into the optimizer's state,
  torch's step runs in float32 (the parameter moves with the step's float32
  moments), then the new state is quantized block by block (absmax of the
  block, the nearest code of x / absmax, ties to the lower code; in the
  unsigned books a positive value never takes the code 0). Tensors under
  4096 elements keep float32 state. The parameters after the last step
  and the state's codes and absmax are recorded, and the first 1024 values
  of torch's float32 state of that step before they were quantized (the
  quantizer's exact check: torch's vectorized add fuses a multiply-add
  where distopt's kernels do not, so the steps agree to an ulp, not bit for
  bit, and an ulp can move a value to the next code). Parameters and gradients
  are made by a formula the test repeats (values(), integers divided by
  1000 in float32, gradients scaled by powers of two), so the file holds
  only torch's results.

Run with Debian's PyTorch:  /usr/bin/python3 scripts/gen_golden_lowbit.py
The output is deterministic.
"""
import sys

import torch

from golden_io import enc, write_cases

OUT = "tests/golden/lowbit/lowbit.json"
MIN_SIZE = 4096
BLOCK = {"int8": 256, "int4": 128}


def dynamic_map(signed, max_exponent_bits, total_bits):
    """bitsandbytes' create_dynamic_map, the unique values, sorted."""
    data = []
    non_sign_bits = total_bits - 1
    for i in range(max_exponent_bits):
        items = 2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed else \
            2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1
        boundaries = torch.linspace(0.1, 1, items)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    data += [0.0, 1.0]
    assert len(data) == 2 ** total_bits, len(data)
    return torch.tensor(sorted(data), dtype=torch.float32)


CODES = {
    ("int8", True): dynamic_map(True, 7, 8),
    ("int8", False): dynamic_map(False, 7, 8),
    ("int4", True): dynamic_map(True, 3, 4),
    ("int4", False): torch.linspace(0, 1, 17, dtype=torch.float32)[1:].contiguous(),
}


def quantize(x, dtype, signed):
    """(codes, absmax) of a flat float32 tensor, block by block."""
    code = CODES[(dtype, signed)]
    block = BLOCK[dtype]
    codes, absmax = [], []
    for b in range(0, x.numel(), block):
        xb = x[b:b + block]
        a = xb.abs().max()
        absmax.append(a)
        if a == 0:
            zero = int((code == 0).nonzero()[0]) if (code == 0).any() else 0
            codes.append(torch.full_like(xb, zero, dtype=torch.int64))
            continue
        q = xb / a
        hi = torch.searchsorted(code, q, right=True).clamp(1, code.numel() - 1)
        lo = hi - 1
        pick = torch.where((q - code[lo]) <= (code[hi] - q), lo, hi)
        pick = torch.where(q < code[0], torch.zeros_like(pick), pick)
        pick = torch.where(q > code[-1], torch.full_like(pick, code.numel() - 1), pick)
        if not signed and code[0] == 0:
            pick = torch.where((q > 0) & (pick == 0), torch.ones_like(pick), pick)
        codes.append(pick)
    return torch.cat(codes), torch.stack(absmax)


def dequantize(codes, absmax, dtype, signed):
    code = CODES[(dtype, signed)]
    block = BLOCK[dtype]
    scale = absmax.repeat_interleave(block)[:codes.numel()]
    return code[codes] * scale


# Quantized state of each rule: (torch key, signed).
KEYS = {
    "adam": [("exp_avg", True), ("exp_avg_sq", False), ("max_exp_avg_sq", False)],
    "adamw": [("exp_avg", True), ("exp_avg_sq", False), ("max_exp_avg_sq", False)],
    "sgd": [("momentum_buffer", True)],
}
OPT = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}

CASES = [
    ("adamw_int8", "adamw", "int8", {"lr": 1e-2, "weight_decay": 1e-2}),
    ("adam_int8_amsgrad_l2", "adam", "int8", {"lr": 3e-3, "amsgrad": True, "weight_decay": 1e-3}),
    ("adamw_int4", "adamw", "int4", {"lr": 1e-2, "betas": (0.8, 0.95)}),
    ("sgd_int8_nesterov", "sgd", "int8", {"lr": 5e-2, "momentum": 0.9, "nesterov": True}),
    ("sgd_int4_dampening", "sgd", "int4", {"lr": 5e-2, "momentum": 0.8, "dampening": 0.1}),
]
SHAPES = [(5000,), (40, 130), (300,)]  # a last block of 136 elements; 5200; under the threshold
FP32_KEPT = 1024  # torch's fp32 state before quantization, kept in the file for the quantizer's check
SCALES = [1.0, 2.0 ** -10, 32.0, 1.0, 2.0 ** -13]  # the gradients' scale at each step


def values(n, salt):
    """n float32 values in [-1, 1]: (h(i, salt) mod 2001 - 1000) / 1000, h a 32-bit hash."""
    ints = [((i * 2654435761 + salt * 40503) % 2 ** 32) % 2001 - 1000 for i in range(n)]
    return torch.tensor(ints, dtype=torch.float32) / 1000.0


def short(v):
    """A float32 as the fewest digits that read back to it."""
    return enc(float("%.9g" % v))


def run(name, rule, dtype, options, salt):
    params = [values(torch.Size(s).numel(), salt + k).view(s) for k, s in enumerate(SHAPES)]
    case = {"name": name, "rule": rule, "state_dtype": dtype, "shapes": [list(s) for s in SHAPES],
            "options": {k: (list(v) if isinstance(v, tuple) else v) for k, v in options.items()},
            "salt": salt, "scales": SCALES}
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = OPT[rule](ps, **options)
    saved = {}  # (param index, key) -> (codes, absmax)
    last = {}  # (param index, key) -> the first FP32_KEPT values of torch's fp32 state at the last step
    for step, scale in enumerate(SCALES):
        grads = [values(torch.Size(s).numel(), salt + 100 * (step + 1) + k).view(s) * scale
                 for k, s in enumerate(SHAPES)]
        for i, p in enumerate(ps):
            p.grad = grads[i].clone()
            for (key, signed) in KEYS[rule]:
                if (i, key) in saved:
                    codes, absmax = saved[(i, key)]
                    opt.state[p][key].copy_(dequantize(codes, absmax, dtype, signed).view_as(p))
        opt.step()
        for i, p in enumerate(ps):
            if p.numel() < MIN_SIZE:
                continue
            for (key, signed) in KEYS[rule]:
                if key in opt.state[p]:
                    saved[(i, key)] = quantize(opt.state[p][key].flatten(), dtype, signed)
                    last[(i, key)] = opt.state[p][key].flatten()[:FP32_KEPT]
    case["expected"] = [[short(v) for v in p.detach().flatten().tolist()] for p in ps]
    case["state"] = [{"param": i, "key": key, "codes": codes.tolist(), "absmax": [short(v) for v in absmax.tolist()],
                      "fp32": [short(v) for v in last[(i, key)].tolist()]}
                     for (i, key), (codes, absmax) in sorted(saved.items())]
    return case


def main():
    torch.set_num_threads(1)
    codes = {"%s_%s" % (d, "signed" if s else "unsigned"): [enc(v) for v in c.tolist()] for (d, s), c in CODES.items()}
    cases = [{"name": "codes", "codes": codes}]
    for k, (name, rule, dtype, options) in enumerate(CASES):
        cases.append(run(name, rule, dtype, options, 1000 * (k + 1)))
    write_cases(OUT, "scripts/gen_golden_lowbit.py", cases)
    return 0


if __name__ == "__main__":
    sys.exit(main())
