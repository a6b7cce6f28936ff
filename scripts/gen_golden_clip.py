#!/usr/bin/python3
"""Generate golden gradient-clipping cases with PyTorch (torch.nn.utils).

Writes tests/golden/clip/clip_grad.json: a list of cases, each a set of
float32 gradients (shapes and row-major data), the call
(``clip_grad_norm_`` with max_norm, norm_type, or ``clip_grad_value_``
with clip_value) and torch's result: the returned total norm (norm cases)
and the gradients afterwards. Non-finite values are written as the strings
"NaN", "Infinity", "-Infinity".

Run with Debian's PyTorch:  /usr/bin/python3 scripts/gen_golden_clip.py
The output is deterministic.
"""
import math
import sys

import torch

from golden_io import enc, write_cases

OUT = "tests/golden/clip/clip_grad.json"




def tensors(gen, shapes, scale=1.0):
    return [torch.randn(s, generator=gen) * scale for s in shapes]


def main():
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(20261122)
    cases = []
    shapes_small = [[4], [3, 5], [1]]
    shapes_many = [[16, 33], [129], [7, 7, 3], [300]]

    def add_norm(name, grads, max_norm, norm_type):
        params = [torch.zeros_like(g, requires_grad=True) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        before = [[enc(float(x)) for x in g.reshape(-1).tolist()] for g in grads]
        total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
        cases.append({"name": name, "op": "norm", "max_norm": max_norm, "norm_type": enc(norm_type),
                      "shapes": [list(g.shape) for g in grads], "grads": before,
                      "expected_total": enc(float(total)),
                      "expected": [[enc(float(x)) for x in p.grad.reshape(-1).tolist()] for p in params]})

    def add_value(name, grads, clip_value):
        params = [torch.zeros_like(g, requires_grad=True) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        before = [[enc(float(x)) for x in g.reshape(-1).tolist()] for g in grads]
        torch.nn.utils.clip_grad_value_(params, clip_value)
        cases.append({"name": name, "op": "value", "clip_value": clip_value,
                      "shapes": [list(g.shape) for g in grads], "grads": before,
                      "expected": [[enc(float(x)) for x in p.grad.reshape(-1).tolist()] for p in params]})

    for p in (2.0, 1.0, math.inf, 3.0, 0.5):
        add_norm("clips_p%s" % p, tensors(gen, shapes_small), 0.5, p)
        add_norm("no_clip_p%s" % p, tensors(gen, shapes_small, 1e-3), 10.0, p)
        add_norm("many_p%s" % p, tensors(gen, shapes_many, 0.1), 1.0, p)
    add_norm("max_norm_zero", tensors(gen, shapes_small), 0.0, 2.0)
    add_norm("huge_values", tensors(gen, shapes_small, 1e15), 1.0, 2.0)
    with_inf = tensors(gen, shapes_small)
    with_inf[1][0, 2] = math.inf
    add_norm("inf_gradient", with_inf, 1.0, 2.0)
    with_nan = tensors(gen, shapes_small)
    with_nan[0][1] = math.nan
    add_norm("nan_gradient_inf_norm", with_nan, 1.0, math.inf)
    add_value("value_clamps", tensors(gen, shapes_small), 0.5)
    add_value("value_many", tensors(gen, shapes_many), 0.05)
    nan_value = tensors(gen, shapes_small)
    nan_value[2][0] = math.nan
    add_value("value_keeps_nan", nan_value, 0.3)

    write_cases(OUT, "scripts/gen_golden_clip.py (torch %s)" % torch.__version__, cases)


if __name__ == "__main__":
    sys.exit(main())
