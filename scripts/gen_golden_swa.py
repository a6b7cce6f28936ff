#!/usr/bin/python3
"""Generate golden weight-averaging cases with PyTorch (torch.optim.swa_utils).

Writes tests/golden/swa/averaged.json: a list of cases, each a model of a
few float32 parameters, a sequence of parameter values fed to
``AveragedModel.update_parameters`` and, after every update, torch's
averaged parameters and ``n_averaged``. The averaging functions are the
ones distopt names:

  swa       AveragedModel's default avg_fn (torch 1.13)
  swa_lerp  lerp(avg, p, 1 / (n + 1)), the default of torch >= 2.1
  ema       decay * avg + (1 - decay) * p  (torch 2.x get_ema_avg_fn)
  ema_lerp  lerp(avg, p, 1 - decay)        (torch 2.x get_ema_multi_avg_fn)
  custom    avg * 0.75 + p * 0.25 + 0.001 * n (a user's avg_fn; the test
            passes the same function)

Torch 1.13 has only the avg_fn form; the 2.x formulas are given to it as
avg_fn lambdas, written as torch 2.x writes them.

Run with Debian's PyTorch:  /usr/bin/python3 scripts/gen_golden_swa.py
The output is deterministic.
"""
import sys

import torch

from golden_io import write_cases
from torch.optim.swa_utils import AveragedModel

OUT = "tests/golden/swa/averaged.json"


class Params(torch.nn.Module):
    def __init__(self, shapes):
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s)) for s in shapes])


def avg_fn_of(kind, decay):
    if kind == "swa":
        return None
    if kind == "swa_lerp":
        return lambda a, p, n: torch.lerp(a, p, 1 / (n + 1))
    if kind == "ema":
        return lambda a, p, n: decay * a + (1 - decay) * p
    if kind == "ema_lerp":
        return lambda a, p, n: torch.lerp(a, p, 1 - decay)
    if kind == "custom":
        return lambda a, p, n: a * 0.75 + p * 0.25 + 0.001 * n
    raise ValueError(kind)


def flat(tensors):
    # 9 significant digits round-trip a float32 exactly.
    return [[float("%.9g" % x) for x in t.detach().reshape(-1).tolist()] for t in tensors]


def main():
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(20261122)
    cases = []

    def add(name, kind, shapes, updates, scale=1.0, decay=None, drift=0.0):
        model = Params(shapes)
        averaged = AveragedModel(model, avg_fn=avg_fn_of(kind, decay))
        seq, expected, counts = [], [], []
        base = [torch.randn(s, generator=gen) * scale for s in shapes]
        for k in range(updates):
            # Parameters that drift like a training run's, plus noise.
            values = [b + drift * k + 0.1 * scale * torch.randn(s, generator=gen) for b, s in zip(base, shapes)]
            with torch.no_grad():
                for p, v in zip(model.ps, values):
                    p.copy_(v)
            averaged.update_parameters(model)
            seq.append(flat(values))
            expected.append(flat(averaged.module.ps))
            counts.append(int(averaged.n_averaged))
        case = {"name": name, "kind": kind, "shapes": [list(s) for s in shapes], "updates": seq,
                "expected": expected, "expected_n_averaged": counts}
        if decay is not None:
            case["decay"] = decay
        cases.append(case)

    small = [[5], [3, 4], [1]]
    big = [[12, 9], [37]]
    for kind in ("swa", "swa_lerp"):
        add(kind + "_small", kind, small, 6)
        add(kind + "_long", kind, big, 40, drift=0.01)
        add(kind + "_large_values", kind, small, 9, scale=1e6)
    for kind in ("ema", "ema_lerp"):
        for decay in (0.999, 0.9, 0.5, 0.25, 0.0, 1.0):
            add("%s_decay_%g" % (kind, decay), kind, small, 7, decay=decay, drift=0.05)
        add(kind + "_long", kind, big, 30, decay=0.99, drift=0.01)
    add("custom_small", "custom", small, 6)
    add("custom_long", "custom", big, 12, drift=0.02)

    write_cases(OUT, "scripts/gen_golden_swa.py (torch %s)" % torch.__version__, cases)


if __name__ == "__main__":
    sys.exit(main())
