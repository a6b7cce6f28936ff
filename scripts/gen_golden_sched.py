#!/usr/bin/python3
"""Generate golden scheduler replay cases (format ``distopt-replay/1``) with PyTorch.

Each case: a torch optimizer over two small float32 parameters (one or two
param groups), a torch.optim.lr_scheduler (or SWALR) built after it exactly
as in torch, 12-30 steps of random gradients; after every optimizer step
the scheduler steps once (ReduceLROnPlateau with the step's ``metric``).
``expected`` holds the final parameters and each group's lr after every
step (after the scheduler's step). At least three cases per scheduler, with
varied options and optimizers; CyclicLR and OneCycleLR also cycle SGD's
momentum and (OneCycleLR) Adam's beta1.

Output:
  tests/golden/sched/         cases `distopt replay --check` runs
  tests/golden/sched_lambda/  LambdaLR / MultiplicativeLR cases: their
      ``lr_lambda`` option names a function from LAMBDAS below (a comma
      list: one per group); tests/sched_test.cpp defines the same functions.

One case is not plain torch 1.13: ``cycliclr_*_adam_beta1``. Torch 1.13's
CyclicLR cycles only ``momentum``; torch >= 2.2 also cycles beta1 of
optimizers with ``betas``. That case runs torch 1.13's CyclicLR with
``cycle_momentum=False`` and writes beta1 with 1.13's own momentum formula
(class CyclicLRBeta1), the optimizer steps being torch's.

Run with Debian's PyTorch:
    /usr/bin/python3 scripts/gen_golden_sched.py [--out-dir tests/golden]
The output is deterministic (byte-identical on reruns).
"""

import argparse
import glob
import json
import os
import sys
import zlib

import torch
from torch.optim import lr_scheduler as L
from torch.optim.swa_utils import SWALR

from gen_golden_optim import serialize  # the same file layout as the optimizer cases

FORMAT = "distopt-replay/1"
GENERATOR = "scripts/gen_golden_sched.py (torch %s)" % torch.__version__

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "sgd_plain": (torch.optim.SGD, {"lr": 0.1}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.05}),
    "rmsprop": (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5}),
}

LAMBDAS = {
    "exp95": lambda e: 0.95 ** e,
    "inv": lambda e: 1.0 / (e + 1),
    "warmup5": lambda e: min(1.0, (e + 1) / 5),
    "const95": lambda e: 0.95,
    "alt": lambda e: 1.1 if e % 2 else 0.9,
    "decay": lambda e: 1.0 - 0.01 * e,
}


class CyclicLRBeta1(L.CyclicLR):
    """CyclicLR cycling beta1 as torch >= 2.2 does (see the module notes)."""

    def __init__(self, optimizer, base_momentum=0.8, max_momentum=0.9, **kw):
        for g in optimizer.param_groups:
            g["betas"] = (base_momentum, g["betas"][1])
        self.beta1_base = [base_momentum] * len(optimizer.param_groups)
        self.beta1_max = [max_momentum] * len(optimizer.param_groups)
        super().__init__(optimizer, cycle_momentum=False, **kw)

    def get_lr(self):
        lrs = super().get_lr()
        cycle = __import__("math").floor(1 + self.last_epoch / self.total_size)
        x = 1.0 + self.last_epoch / self.total_size - cycle
        scale_factor = x / self.step_ratio if x <= self.step_ratio else (x - 1) / (self.step_ratio - 1)
        for g, b, m in zip(self.optimizer.param_groups, self.beta1_base, self.beta1_max):
            arg = cycle if self.scale_mode == "cycle" else self.last_epoch
            g["betas"] = (m - (m - b) * scale_factor * self.scale_fn(arg), g["betas"][1])
        return lrs


def build(opt, spec):
    """A torch scheduler from a case's scheduler spec."""
    name, o = spec["name"], dict(spec.get("options", {}))
    if name == "sequentiallr":
        children = [build(opt, c) for c in spec["schedulers"]]
        return L.SequentialLR(opt, children, **o)
    if name == "chainedscheduler":
        return L.ChainedScheduler([build(opt, c) for c in spec["schedulers"]])
    if name in ("lambdalr", "multiplicativelr"):
        fns = [LAMBDAS[n] for n in o.pop("lr_lambda").split(",")]
        cls = L.LambdaLR if name == "lambdalr" else L.MultiplicativeLR
        return cls(opt, fns if len(fns) > 1 else fns[0], **o)
    if name == "cycliclr" and o.pop("emulate_beta1", False):
        return CyclicLRBeta1(opt, **o)
    if name == "swalr":
        return SWALR(opt, **o)
    classes = {c.__name__.lower(): c for c in (L.StepLR, L.MultiStepLR, L.ConstantLR, L.LinearLR, L.ExponentialLR,
                                               L.PolynomialLR, L.CosineAnnealingLR, L.CosineAnnealingWarmRestarts,
                                               L.CyclicLR, L.OneCycleLR, L.ReduceLROnPlateau)}
    return classes[name](opt, **o)


def s(name, **options):
    return {"name": name, "options": options}


# (scheduler spec, optimizer key, groups, steps, metrics kind)
PLAN = [
    (s("steplr", step_size=3, gamma=0.5), "sgd", 1, 12),
    (s("steplr", step_size=1, gamma=0.9), "adam", 2, 12),
    (s("steplr", step_size=5), "adamw", 1, 16),
    (s("multisteplr", milestones=[2, 5, 9], gamma=0.5), "sgd", 1, 12),
    (s("multisteplr", milestones=[3, 3, 7]), "adam", 2, 12),
    (s("multisteplr", milestones=[10, 4], gamma=0.3), "rmsprop", 1, 14),
    (s("constantlr"), "adam", 1, 10),
    (s("constantlr", factor=0.5, total_iters=3), "sgd", 2, 10),
    (s("constantlr", factor=0.25, total_iters=8), "adamw", 1, 12),
    (s("linearlr"), "sgd", 1, 10),
    (s("linearlr", start_factor=0.1, end_factor=1.0, total_iters=4), "adam", 2, 10),
    (s("linearlr", start_factor=1.0, end_factor=0.2, total_iters=6), "adamw", 1, 10),
    (s("exponentiallr", gamma=0.9), "sgd", 1, 12),
    (s("exponentiallr", gamma=0.8), "adam", 2, 12),
    (s("exponentiallr", gamma=1.05), "rmsprop", 1, 12),
    (s("polynomiallr"), "sgd", 1, 10),
    (s("polynomiallr", total_iters=8, power=2.0), "adam", 1, 12),
    (s("polynomiallr", total_iters=4, power=0.5), "adamw", 2, 8),
    (s("cosineannealinglr", T_max=5), "sgd", 1, 22),
    (s("cosineannealinglr", T_max=8, eta_min=0.001), "adam", 2, 20),
    (s("cosineannealinglr", T_max=3, eta_min=0.01), "rmsprop", 1, 16),
    (s("cosineannealingwarmrestarts", T_0=4), "sgd", 1, 14),
    (s("cosineannealingwarmrestarts", T_0=2, T_mult=2, eta_min=0.001), "adam", 1, 20),
    (s("cosineannealingwarmrestarts", T_0=3, T_mult=3), "adamw", 2, 16),
    (s("cycliclr", base_lr=0.01, max_lr=0.1, step_size_up=3), "sgd", 1, 16),
    (s("cycliclr", base_lr=[0.01, 0.02], max_lr=[0.1, 0.05], step_size_up=2, step_size_down=4,
       mode="triangular2", base_momentum=0.7, max_momentum=0.95), "sgd", 2, 20),
    (s("cycliclr", base_lr=0.001, max_lr=0.01, step_size_up=3, mode="exp_range", gamma=0.9,
       cycle_momentum=False), "adam", 1, 16),
    (s("cycliclr", base_lr=0.005, max_lr=0.02, step_size_up=4, mode="exp_range", gamma=0.95), "rmsprop", 1, 16),
    (s("cycliclr", base_lr=0.001, max_lr=0.01, step_size_up=3, base_momentum=0.8, max_momentum=0.95,
       emulate_beta1=True), "adam", 1, 14),
    (s("onecyclelr", max_lr=0.1, total_steps=20), "sgd", 1, 20),
    (s("onecyclelr", max_lr=[0.1, 0.05], epochs=4, steps_per_epoch=5, anneal_strategy="linear",
       three_phase=True), "sgd", 2, 20),
    (s("onecyclelr", max_lr=0.01, total_steps=15, pct_start=0.4), "adam", 1, 15),
    (s("onecyclelr", max_lr=0.01, total_steps=12, cycle_momentum=False, div_factor=10.0,
       final_div_factor=100.0), "adamw", 2, 12),
    (s("reducelronplateau", patience=2), "sgd", 1, 16),
    (s("reducelronplateau", mode="max", factor=0.5, patience=1, cooldown=2, threshold_mode="abs",
       threshold=0.01, min_lr=[0.001, 0.004]), "adam", 2, 20),
    (s("reducelronplateau", patience=0, factor=0.3, min_lr=0.02, eps=1e-3), "rmsprop", 1, 14),
    ({"name": "sequentiallr", "options": {"milestones": [3]},
      "schedulers": [s("linearlr", start_factor=0.1, total_iters=3), s("exponentiallr", gamma=0.9)]}, "sgd", 1, 12),
    ({"name": "sequentiallr", "options": {"milestones": [4, 10]},
      "schedulers": [s("constantlr", factor=0.5, total_iters=2), s("cosineannealinglr", T_max=6),
                     s("steplr", step_size=2, gamma=0.5)]}, "adam", 2, 16),
    ({"name": "sequentiallr", "options": {"milestones": [2]},
      "schedulers": [s("exponentiallr", gamma=0.5), s("linearlr")]}, "adamw", 1, 10),
    ({"name": "chainedscheduler",
      "schedulers": [s("constantlr", factor=0.1, total_iters=2), s("exponentiallr", gamma=0.9)]}, "sgd", 1, 10),
    ({"name": "chainedscheduler",
      "schedulers": [s("linearlr"), s("steplr", step_size=3, gamma=0.5), s("multisteplr", milestones=[5, 8])]},
     "adam", 2, 12),
    ({"name": "chainedscheduler",
      "schedulers": [s("cosineannealingwarmrestarts", T_0=3), s("constantlr", factor=0.5, total_iters=4)]},
     "adamw", 1, 12),
    ({"name": "chainedscheduler",
      "schedulers": [{"name": "sequentiallr", "options": {"milestones": [3]},
                      "schedulers": [s("constantlr", factor=0.2, total_iters=10), s("exponentiallr", gamma=0.8)]},
                     s("multisteplr", milestones=[6], gamma=0.5)]}, "sgd", 1, 12),
    (s("swalr", swa_lr=0.05, anneal_epochs=5), "sgd", 1, 10),
    (s("swalr", swa_lr=[0.001, 0.02], anneal_epochs=3, anneal_strategy="linear"), "adam", 2, 8),
    (s("swalr", swa_lr=0.001, anneal_epochs=0), "adamw", 1, 6),
    (s("lambdalr", lr_lambda="exp95"), "sgd", 1, 10),
    (s("lambdalr", lr_lambda="inv,warmup5"), "adam", 2, 10),
    (s("lambdalr", lr_lambda="warmup5"), "adamw", 1, 8),
    (s("multiplicativelr", lr_lambda="const95"), "sgd", 1, 10),
    (s("multiplicativelr", lr_lambda="alt"), "adam", 1, 10),
    (s("multiplicativelr", lr_lambda="decay,const95"), "rmsprop", 2, 12),
]


def metrics(n, gen):
    """A plateauing, noisy loss: improvements, stalls and small bumps."""
    out, v = [], 1.0
    for k in range(n):
        if k % 5 < 2:
            v *= 0.8
        noise = float(torch.rand(1, generator=gen)) * 0.002
        out.append(round(v + noise, 6))
    return out


def written_spec(spec):
    """The spec as distopt reads it: the emulation switch is the generator's."""
    out = json.loads(json.dumps(spec))
    out.get("options", {}).pop("emulate_beta1", None)
    if not out.get("options"):
        out.pop("options", None)
    return out


def make_case(spec, opt_key, groups, steps):
    name = spec["name"]
    gen = torch.Generator().manual_seed(zlib.crc32(json.dumps([spec, opt_key, groups, steps]).encode()))
    shapes = [[4], [2, 3]]
    params = [torch.randn(sh, generator=gen) for sh in shapes]
    cls, options = OPTIMIZERS[opt_key]
    if groups == 2:
        group_specs = [{"params": [0]}, {"params": [1], "options": {"lr": options["lr"] * 0.5}}]
    else:
        group_specs = [{"params": [0, 1]}]
    grads = [[torch.randn(sh, generator=gen) for sh in shapes] for _ in range(steps)]
    mets = metrics(steps, gen) if name == "reducelronplateau" else None
    # torch
    tparams = [p.clone() for p in params]
    tgroups = []
    for g in group_specs:
        d = {"params": [tparams[i] for i in g["params"]]}
        d.update(g.get("options", {}))
        tgroups.append(d)
    opt = cls(tgroups, **options)
    sched = build(opt, spec)
    lrs = [[] for _ in opt.param_groups]
    for k in range(steps):
        for p, g in zip(tparams, grads[k]):
            p.grad = g.clone()
        opt.step()
        if mets is not None:
            sched.step(mets[k])
        else:
            sched.step()
        for gi, grp in enumerate(opt.param_groups):
            lrs[gi].append(float(grp["lr"]))
    optimizer_name = cls.__name__.lower()
    case = {
        "format": FORMAT,
        "generator": GENERATOR,
        "optimizer": {"name": optimizer_name, "options": options},
        "param_groups": group_specs,
        "params": [{"shape": sh, "data": [float(x) for x in p.reshape(-1).tolist()]} for sh, p in zip(shapes, params)],
        "steps": [{"grads": [[float(x) for x in g.reshape(-1).tolist()] for g in grads[k]],
                   **({"metric": mets[k]} if mets is not None else {})} for k in range(steps)],
        "scheduler": written_spec(spec),
        "expected": {"params": [[float(x) for x in p.detach().reshape(-1).tolist()] for p in tparams], "lr": lrs},
    }
    return case


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default="tests/golden")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dirs = {False: os.path.join(args.out_dir, "sched"), True: os.path.join(args.out_dir, "sched_lambda")}
    for d in dirs.values():
        os.makedirs(d, exist_ok=True)
        for old in glob.glob(os.path.join(d, "*.json")):
            os.remove(old)
    counters = {}
    for spec, opt_key, groups, steps in PLAN:
        name = spec["name"]
        idx = counters.get(name, 0)
        counters[name] = idx + 1
        case = make_case(spec, opt_key, groups, steps)
        tag = opt_key + ("_groups" if groups == 2 else "")
        if spec.get("options", {}).get("emulate_beta1"):
            tag += "_beta1"
        lam = name in ("lambdalr", "multiplicativelr")
        path = os.path.join(dirs[lam], "%s_%03d_%s.json" % (name, idx, tag))
        with open(path, "w", encoding="ascii", newline="\n") as f:
            f.write(serialize(case))
    print("wrote %d cases:" % sum(counters.values()), ", ".join("%s %d" % kv for kv in counters.items()))


if __name__ == "__main__":
    sys.exit(main())
