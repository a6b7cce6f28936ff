#!/usr/bin/python3
"""Generate golden optimizer replay cases (format ``distopt-replay/1``) with PyTorch.

What it does
------------
For every torch optimizer the library mirrors (sgd, adam, adamw, adamax,
adadelta, adagrad, rmsprop, nadam, radam, rprop, asgd) this script builds a
set of small, deterministic trajectories:

* every combination of the optimizer's behavioural switches that the installed
  torch accepts (momentum / dampening / nesterov / weight_decay / maximize for
  SGD, amsgrad / weight_decay / maximize for Adam(W), centered / momentum for
  RMSprop, ...), with non-default scalar hyperparameters drawn from small pools;
* extra layouts: several param groups with per-group option overrides, `null`
  gradients (including a parameter whose very first gradient is `null`),
  whole-tensor zero gradients, 25-step runs, multi-dimensional shapes and a few
  1000-element tensors.

Initial parameters and gradients are float32 N(0,1) samples (gradients are
sometimes rescaled and have ~10% exactly-zero entries) drawn from a
``torch.Generator`` seeded from the case name and ``--seed-offset``. Torch is
run on the CPU with its default single-tensor path (``foreach`` is never
passed), in float32, one thread. Each case is written as one JSON file
``<optimizer>_<NNN>_<tags>.json`` whose ``expected`` member holds the
parameters after the last step and each group's lr after every step. Numbers
are the exact float32 values written via ``repr`` of the Python float, so they
round-trip exactly.

How to rerun
------------
Must be run with Debian's PyTorch (``/usr/bin/python3``; a pyenv python has no
torch)::

    /usr/bin/python3 scripts/gen_golden_optim.py                 # -> tests/golden/optim/
    /usr/bin/python3 scripts/gen_golden_optim.py --out DIR --seed-offset N
    /usr/bin/python3 scripts/gen_golden_optim.py --verify tests/golden/optim

``--seed-offset N`` (default 0) produces new, never-seen cases with the same
names and structure but different random data and different draws from the
hyperparameter pools, e.g. ``--out /tmp/unseen --seed-offset 1000``.
``--verify DIR`` loads every ``*.json`` in DIR, re-runs torch from the file's
own data with code independent of the generator, and compares bit for bit.

The output is deterministic: running the script twice gives byte-identical
files. Existing ``*.json`` files in the output directory are replaced.

Notes on torch 1.13 (what the golden files encode)
--------------------------------------------------
* ``SGD(lr=required)``: no default lr, so every SGD case passes ``lr``.
* NAdam and RAdam have no ``maximize`` / ``decoupled_weight_decay``.
* Adagrad initialises ``sum`` from the *constructor's*
  ``initial_accumulator_value`` for all groups, so the cases never override it
  per group.
* ASGD's averaged iterate ``ax`` does not affect the parameters, so it is not
  observable in ``expected``.
"""

import argparse
import glob
import json
import math
import os
import random
import struct
import sys
import zlib

import torch

FORMAT = "distopt-replay/1"
GENERATOR = "scripts/gen_golden_optim.py (torch %s)" % torch.__version__
PAIR_OPTIONS = ("betas", "etas", "step_sizes")

OPTIMIZERS = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "adamax": torch.optim.Adamax,
    "adadelta": torch.optim.Adadelta,
    "adagrad": torch.optim.Adagrad,
    "rmsprop": torch.optim.RMSprop,
    "nadam": torch.optim.NAdam,
    "radam": torch.optim.RAdam,
    "rprop": torch.optim.Rprop,
    "asgd": torch.optim.ASGD,
}

# Pools of non-default hyperparameter values (first entry of a pool is not
# special; defaults are obtained by omitting the option).
POOLS = {
    "sgd": {
        "lr": [0.1, 0.05, 0.01, 0.003],
        "momentum": [0.9, 0.5, 0.99],
        "dampening": [0.1, 0.5, 0.9],
        "weight_decay": [0.01, 0.001, 0.1],
    },
    "adam": {
        "lr": [0.001, 0.01, 0.03, 0.1],
        "betas": [[0.9, 0.999], [0.8, 0.99], [0.5, 0.9], [0.95, 0.9999]],
        "eps": [1e-08, 1e-06, 0.001],
        "weight_decay": [0.01, 0.1, 0.001],
    },
    "adamw": {
        "lr": [0.001, 0.01, 0.03, 0.1],
        "betas": [[0.9, 0.999], [0.8, 0.99], [0.5, 0.9], [0.95, 0.9999]],
        "eps": [1e-08, 1e-06, 0.001],
        "weight_decay": [0.01, 0.1, 0.5],
    },
    "adamax": {
        "lr": [0.002, 0.01, 0.05],
        "betas": [[0.9, 0.999], [0.8, 0.99], [0.5, 0.9]],
        "eps": [1e-08, 0.001, 0.1],
        "weight_decay": [0.01, 0.1],
    },
    "adadelta": {
        "lr": [1.0, 0.5, 2.0],
        "rho": [0.5, 0.95, 0.99],
        "eps": [0.001, 1e-08, 1e-05],
        "weight_decay": [0.01, 0.1],
    },
    "adagrad": {
        "lr": [0.01, 0.1, 0.05],
        "lr_decay": [0.01, 0.1, 0.5],
        "initial_accumulator_value": [0.1, 1.0, 0.5],
        "eps": [1e-06, 0.001, 1e-10],
        "weight_decay": [0.01, 0.1],
    },
    "rmsprop": {
        "lr": [0.01, 0.001, 0.003],
        "alpha": [0.9, 0.5, 0.999],
        "eps": [0.0001, 1e-06, 0.01],
        "momentum": [0.9, 0.5],
        "weight_decay": [0.01, 0.1],
    },
    "nadam": {
        "lr": [0.002, 0.01, 0.03],
        "betas": [[0.9, 0.999], [0.8, 0.99], [0.5, 0.9]],
        "eps": [1e-08, 1e-06, 0.001],
        "momentum_decay": [0.1, 0.01, 1.0],
        "weight_decay": [0.01, 0.1],
    },
    "radam": {
        "lr": [0.001, 0.01, 0.05],
        "betas": [[0.9, 0.999], [0.8, 0.99], [0.9, 0.9], [0.5, 0.5]],
        "eps": [1e-08, 1e-06, 0.001],
        "weight_decay": [0.01, 0.1],
    },
    "rprop": {
        "lr": [0.01, 0.1, 0.001],
        "etas": [[0.3, 1.5], [0.7, 1.1], [0.5, 2.0]],
        "step_sizes": [[0.001, 0.05], [0.0001, 1.0], [0.005, 0.02]],
    },
    "asgd": {
        "lr": [0.01, 0.1, 0.05],
        "lambd": [0.01, 0.1, 0.001],
        "alpha": [0.5, 1.0, 0.9],
        "t0": [3.0, 5.0, 1.0],
        "weight_decay": [0.01, 0.1],
    },
}

# Explicit default values, sometimes written out to exercise option parsing.
DEFAULTS = {
    "sgd": {"momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False, "maximize": False},
    "adam": {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-08, "weight_decay": 0.0, "amsgrad": False,
             "maximize": False},
    "adamw": {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-08, "weight_decay": 0.01, "amsgrad": False,
              "maximize": False},
    "adamax": {"lr": 0.002, "betas": [0.9, 0.999], "eps": 1e-08, "weight_decay": 0.0, "maximize": False},
    "adadelta": {"lr": 1.0, "rho": 0.9, "eps": 1e-06, "weight_decay": 0.0, "maximize": False},
    "adagrad": {"lr": 0.01, "lr_decay": 0.0, "weight_decay": 0.0, "initial_accumulator_value": 0.0,
                "eps": 1e-10, "maximize": False},
    "rmsprop": {"lr": 0.01, "alpha": 0.99, "eps": 1e-08, "weight_decay": 0.0, "momentum": 0.0,
                "centered": False, "maximize": False},
    "nadam": {"lr": 0.002, "betas": [0.9, 0.999], "eps": 1e-08, "weight_decay": 0.0, "momentum_decay": 0.004},
    "radam": {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-08, "weight_decay": 0.0},
    "rprop": {"lr": 0.01, "etas": [0.5, 1.2], "step_sizes": [1e-06, 50.0], "maximize": False},
    "asgd": {"lr": 0.01, "lambd": 0.0001, "alpha": 0.75, "t0": 1000000.0, "weight_decay": 0.0,
             "maximize": False},
}

# Options that may be overridden per param group (never initial_accumulator_value:
# torch 1.13 Adagrad initialises every group's `sum` from the constructor arg).
GROUP_OVERRIDABLE = {
    "sgd": ["lr", "momentum", "dampening", "weight_decay", "maximize"],
    "adam": ["lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"],
    "adamw": ["lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"],
    "adamax": ["lr", "betas", "eps", "weight_decay", "maximize"],
    "adadelta": ["lr", "rho", "eps", "weight_decay", "maximize"],
    "adagrad": ["lr", "lr_decay", "eps", "weight_decay", "maximize"],
    "rmsprop": ["lr", "alpha", "eps", "weight_decay", "momentum", "centered", "maximize"],
    "nadam": ["lr", "betas", "eps", "weight_decay", "momentum_decay"],
    "radam": ["lr", "betas", "eps", "weight_decay"],
    "rprop": ["lr", "etas", "step_sizes", "maximize"],
    "asgd": ["lr", "lambd", "alpha", "t0", "weight_decay", "maximize"],
}

# Behavioural switches per optimizer: every valid combination becomes a case.
# Each entry: tag -> function(options, rng) that sets the option(s).
SWITCHES = {
    "sgd": ["mom", "damp", "nest", "wd", "max"],
    "adam": ["ams", "wd", "max"],
    "adamw": ["ams", "wd", "max"],
    "adamax": ["wd", "max", "eps"],
    "adadelta": ["rho", "eps", "wd", "max"],
    "adagrad": ["lrdecay", "initacc", "wd", "max"],
    "rmsprop": ["centered", "mom", "wd", "max"],
    "nadam": ["mdecay", "wd", "betas"],
    "radam": ["wd", "betas", "eps"],
    "rprop": ["etas", "stepsizes", "max"],
    "asgd": ["t0", "lambd", "wd", "max"],
}

SWITCH_OPTION = {
    "mom": "momentum", "damp": "dampening", "nest": "nesterov", "wd": "weight_decay",
    "max": "maximize", "ams": "amsgrad", "rho": "rho", "eps": "eps", "lrdecay": "lr_decay",
    "initacc": "initial_accumulator_value", "centered": "centered", "mdecay": "momentum_decay",
    "betas": "betas", "etas": "etas", "stepsizes": "step_sizes", "t0": "t0", "lambd": "lambd",
}

SMALL_SHAPES = [[1], [7], [3, 4], [5], [2, 3], [4, 1], [33]]
MDIM_SHAPES = [[3, 4], [2, 3, 5], [33, 7], [1, 6], [2, 2, 2]]

# Layouts cycled over the switch combinations of each optimizer.
COMBO_LAYOUTS = ["small", "groups", "nulls", "shapes"]
# Extra cases per optimizer (layout names; also used as name tags).
EXTRA_LAYOUTS = ["long", "nullfirst", "zeros", "groups3"]
BIG_OPTIMIZERS = ["sgd", "adam", "adamw", "rmsprop", "adagrad"]


def valid_combo(opt, tags):
    if opt == "sgd":
        if ("damp" in tags or "nest" in tags) and "mom" not in tags:
            return False
        if "damp" in tags and "nest" in tags:
            return False
    return True


def combos(opt):
    sw = SWITCHES[opt]
    out = []
    for mask in range(1 << len(sw)):
        tags = [sw[i] for i in range(len(sw)) if mask >> i & 1]
        if valid_combo(opt, tags):
            out.append(tags)
    # Stable order: by number of switches, then by switch order.
    out.sort(key=lambda t: (len(t), [sw.index(x) for x in t]))
    return out


def case_plan():
    """List of (optimizer, tags, layout) in the order the files are numbered."""
    plan = []
    for opt in OPTIMIZERS:
        for i, tags in enumerate(combos(opt)):
            plan.append((opt, tags, COMBO_LAYOUTS[i % len(COMBO_LAYOUTS)]))
        for lay in EXTRA_LAYOUTS:
            plan.append((opt, None, lay))
        if opt in BIG_OPTIMIZERS:
            plan.append((opt, None, "big"))
    return plan


def stable_seed(text):
    return zlib.crc32(text.encode("utf-8")) & 0x7FFFFFFF


# ---------------------------------------------------------------------------
# Options


def set_switch(opt, tag, options, rng):
    pools = POOLS[opt]
    name = SWITCH_OPTION[tag]
    if tag in ("nest", "max", "ams", "centered"):
        options[name] = True
    elif opt == "asgd" and tag == "t0":
        options["t0"] = rng.choice(pools["t0"])
    elif opt == "adamw" and tag == "wd":
        # AdamW's default weight decay is already 1e-2; "wd" means an explicit
        # (non-default) value.
        options[name] = rng.choice(pools[name][1:])
    else:
        options[name] = rng.choice([v for v in pools[name] if v != DEFAULTS[opt].get(name)])


def base_options(opt, tags, rng):
    """Optimizer-level options for a switch combination (tags may be None)."""
    pools = POOLS[opt]
    options = {}
    if tags is None:
        # Extra layouts: random switches.
        sw = SWITCHES[opt]
        while True:
            tags = [t for t in sw if rng.random() < 0.5]
            if valid_combo(opt, tags):
                break
    # lr: SGD always needs one (torch 1.13: lr=required); others mostly set one.
    if opt == "sgd" or rng.random() < 0.75:
        options["lr"] = rng.choice(pools["lr"])
    for tag in tags:
        set_switch(opt, tag, options, rng)
    # Switched-off options: sometimes write the default explicitly.
    for tag in SWITCHES[opt]:
        name = SWITCH_OPTION[tag]
        if tag not in tags and name in DEFAULTS[opt] and rng.random() < 0.25:
            if opt == "adamw" and name == "weight_decay":
                options[name] = rng.choice([0.01, 0.0])
            else:
                options[name] = DEFAULTS[opt][name]
    if opt == "adamw" and "wd" not in tags and "weight_decay" not in options and rng.random() < 0.5:
        options["weight_decay"] = 0.0
    # Non-switch scalar hyperparameters: occasionally non-default.
    for name in pools:
        if name in options or name == "lr":
            continue
        if any(SWITCH_OPTION[t] == name for t in SWITCHES[opt]):
            continue
        if rng.random() < 0.35:
            options[name] = rng.choice(pools[name])
    return order_options(opt, options)


def order_options(opt, options):
    order = list(DEFAULTS[opt].keys())
    if "lr" not in order:
        order.insert(0, "lr")
    return {k: options[k] for k in sorted(options, key=lambda k: order.index(k))}


def group_override(opt, top, rng, n_keys):
    """Random per-group overrides valid with respect to the top-level options."""
    pools = POOLS[opt]
    keys = list(GROUP_OVERRIDABLE[opt])
    if opt == "sgd" and top.get("nesterov"):
        keys.remove("dampening")  # nesterov needs dampening == 0
    chosen = rng.sample(keys, min(n_keys, len(keys)))
    out = {}
    for k in chosen:
        if k in ("maximize", "amsgrad", "centered"):
            out[k] = not top.get(k, DEFAULTS[opt].get(k, False))
        elif k == "momentum" and opt == "sgd":
            out[k] = rng.choice(pools[k])
        elif k == "momentum" and opt == "rmsprop":
            out[k] = rng.choice(pools[k] + [0.0])
        elif k == "dampening" and opt == "sgd":
            out[k] = rng.choice(pools[k] + [0.0])
        elif k == "weight_decay":
            out[k] = rng.choice(pools[k] + [0.0])
        else:
            out[k] = rng.choice(pools[k])
    if opt == "sgd" and out.get("dampening", 0.0) != 0.0 and top.get("nesterov"):
        del out["dampening"]
    return order_options(opt, out)


# ---------------------------------------------------------------------------
# Data


def randn(shape, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float32)


def make_grad(shape, gen, rng, zero_frac=0.1, whole_zero=False):
    if whole_zero:
        return torch.zeros(shape, dtype=torch.float32)
    g = randn(shape, gen)
    scale = rng.choice([1.0, 1.0, 1.0, 1.0, 0.1, 0.001, 10.0])
    if scale != 1.0:
        g = g * torch.tensor(scale, dtype=torch.float32)
    mask = torch.rand(shape, generator=gen) < zero_frac
    g = torch.where(mask, torch.zeros((), dtype=torch.float32), g)
    return g


def build_layout(opt, layout, top, rng, gen):
    """Returns (shapes, groups, null_pattern[steps][params], zero_pattern)."""
    if layout == "small":
        n = rng.randint(1, 3)
        shapes = [rng.choice(SMALL_SHAPES) for _ in range(n)]
        n_groups = 1
        n_steps = rng.randint(3, 10)
        p_null = 0.1
    elif layout == "groups":
        n = rng.randint(2, 4)
        shapes = [rng.choice(SMALL_SHAPES) for _ in range(n)]
        n_groups = 2
        n_steps = rng.randint(4, 12)
        p_null = 0.1
    elif layout == "groups3":
        shapes = [rng.choice(SMALL_SHAPES) for _ in range(4)]
        n_groups = 3
        n_steps = rng.randint(6, 14)
        p_null = 0.15
    elif layout == "nulls":
        n = rng.randint(2, 3)
        shapes = [rng.choice(SMALL_SHAPES) for _ in range(n)]
        n_groups = rng.randint(1, 2)
        n_steps = rng.randint(5, 15)
        p_null = 0.3
    elif layout == "nullfirst":
        shapes = [[7], [3, 4], [1]]
        n_groups = 1
        n_steps = rng.randint(6, 12)
        p_null = 0.2
    elif layout == "shapes":
        shapes = [rng.choice(MDIM_SHAPES[:2] + MDIM_SHAPES[3:]), rng.choice([[33, 7], [2, 3, 5]])]
        n_groups = 1
        n_steps = rng.randint(3, 6)
        p_null = 0.05
    elif layout == "long":
        shapes = [[7], [1], [3, 4]]
        n_groups = rng.randint(1, 2)
        n_steps = 25
        p_null = 0.1
    elif layout == "zeros":
        shapes = [[5], [2, 3]]
        n_groups = 1
        n_steps = rng.randint(6, 10)
        p_null = 0.0
    elif layout == "big":
        shapes = [[1000], [33]]
        n_groups = 1
        n_steps = 3
        p_null = 0.0
    else:
        raise ValueError(layout)
    if opt == "radam" and layout not in ("shapes", "big"):
        # Make sure the rectified branch (rho_t > 5, t >= 6 or so) is reached.
        n_steps = max(n_steps, 9)
    n_params = len(shapes)
    n_groups = min(n_groups, n_params)

    # Assign params to groups: a random permutation split into non-empty runs,
    # so group membership is not always contiguous.
    perm = list(range(n_params))
    rng.shuffle(perm)
    cuts = sorted(rng.sample(range(1, n_params), n_groups - 1)) if n_groups > 1 else []
    bounds = [0] + cuts + [n_params]
    groups = []
    for gi in range(n_groups):
        members = sorted(perm[bounds[gi]:bounds[gi + 1]])
        group = {"params": members}
        if gi > 0 or (n_groups > 1 and rng.random() < 0.3):
            ov = group_override(opt, top, rng, rng.randint(1, 3))
            if ov:
                group["options"] = ov
        groups.append(group)

    nulls = [[rng.random() < p_null for _ in range(n_params)] for _ in range(n_steps)]
    if layout in ("nullfirst", "nulls"):
        nulls[0][0] = True
        if layout == "nullfirst":
            nulls[1][0] = True
            nulls[0][2] = False
            nulls[n_steps // 2][2] = True
    # Never a step where every param is null, except deliberately in "nullfirst".
    for k in range(n_steps):
        if all(nulls[k]):
            nulls[k][rng.randrange(n_params)] = False
    if layout == "nullfirst":
        nulls[n_steps - 2] = [True] * n_params
    # The final step has at least one gradient.
    if all(nulls[-1]):
        nulls[-1][0] = False

    zeros = [[False] * n_params for _ in range(n_steps)]
    if layout == "zeros":
        zeros[0][1] = True
        for k in range(1, n_steps):
            for i in range(n_params):
                zeros[k][i] = rng.random() < 0.3
    elif layout not in ("big",):
        for k in range(n_steps):
            for i in range(n_params):
                if rng.random() < 0.04:
                    zeros[k][i] = True
    return shapes, groups, nulls, zeros


def case_name(opt, idx, tags, layout):
    parts = [opt, "%03d" % idx]
    if tags is None:
        parts.append(layout)
    else:
        parts.extend(tags if tags else ["plain"])
        if layout != "small":
            parts.append(layout)
    return "_".join(parts)


def make_case(opt, idx, tags, layout, seed_offset):
    name = case_name(opt, idx, tags, layout)
    seed = stable_seed("%s:%d" % (name, seed_offset))
    rng = random.Random(seed)
    gen = torch.Generator()
    gen.manual_seed(seed)

    top = base_options(opt, tags, rng)
    shapes, groups, nulls, zeros = build_layout(opt, layout, top, rng, gen)

    params0 = []
    for shape in shapes:
        p = randn(shape, gen)
        if rng.random() < 0.3:
            p = p * torch.tensor(rng.choice([0.1, 3.0]), dtype=torch.float32)
        params0.append(p)

    steps = []
    for k in range(len(nulls)):
        grads = []
        for i, shape in enumerate(shapes):
            if nulls[k][i]:
                grads.append(None)
            else:
                grads.append(make_grad(shape, gen, rng, whole_zero=zeros[k][i]))
        steps.append(grads)

    case = {
        "format": FORMAT,
        "generator": GENERATOR,
        "optimizer": {"name": opt, "options": top},
        "param_groups": groups,
        "params": [{"shape": list(s), "data": flat(p)} for s, p in zip(shapes, params0)],
        "steps": [{"grads": [None if g is None else flat(g) for g in grads]} for grads in steps],
    }
    # Expected values come from replaying the serialisable description, so that
    # what is written is exactly what torch saw.
    final, lrs = run_torch(case)
    case["expected"] = {"params": final, "lr": lrs}
    check_finite(name, case)
    return name, case


def flat(t):
    return [float(x) for x in t.reshape(-1).tolist()]


def check_finite(name, case):
    for vec in case["expected"]["params"]:
        for x in vec:
            if not math.isfinite(x):
                raise RuntimeError("%s: non-finite expected value" % name)


def torch_options(options):
    return {k: (tuple(v) if k in PAIR_OPTIONS else v) for k, v in options.items()}


def run_torch(case, optimizers=OPTIMIZERS, options=torch_options):
    """Replays a case on torch: the final parameters and each group's lr after
    every step ("NaN" for an lr of None, as Adafactor's)."""
    opt = case["optimizer"]["name"]
    params = [torch.tensor(p["data"], dtype=torch.float32).reshape(p["shape"]) for p in case["params"]]
    groups = []
    for g in case["param_groups"]:
        d = {"params": [params[i] for i in g["params"]]}
        d.update(options(g.get("options", {})))
        groups.append(d)
    optimizer = optimizers[opt](groups, **options(case["optimizer"]["options"]))
    lrs = [[] for _ in optimizer.param_groups]
    for step in case["steps"]:
        for p, g, spec in zip(params, step["grads"], case["params"]):
            p.grad = None if g is None else torch.tensor(g, dtype=torch.float32).reshape(spec["shape"])
        optimizer.step()
        for gi, group in enumerate(optimizer.param_groups):
            lrs[gi].append("NaN" if group["lr"] is None else float(group["lr"]))
    return [flat(p) for p in params], lrs


# ---------------------------------------------------------------------------
# Writing


def dumps(x):
    return json.dumps(x, separators=(",", ":"), allow_nan=False)


def serialize(case):
    """Readable but compact JSON: one line per param, per step, per result."""
    lines = ["{"]
    lines.append('"format":%s,' % dumps(case["format"]))
    lines.append('"generator":%s,' % dumps(case["generator"]))
    lines.append('"optimizer":%s,' % dumps(case["optimizer"]))
    lines.append('"param_groups":%s,' % dumps(case["param_groups"]))
    if "scheduler" in case:  # scheduler cases (scripts/gen_golden_sched.py)
        lines.append('"scheduler":%s,' % dumps(case["scheduler"]))
    lines.append('"params":[')
    lines.append(",\n".join(dumps(p) for p in case["params"]))
    lines.append("],")
    lines.append('"steps":[')
    lines.append(",\n".join(dumps(s) for s in case["steps"]))
    lines.append("],")
    lines.append('"expected":{"params":[')
    lines.append(",\n".join(dumps(p) for p in case["expected"]["params"]))
    lines.append('],"lr":%s}' % dumps(case["expected"]["lr"]))
    lines.append("}")
    text = "\n".join(lines) + "\n"
    assert json.loads(text) == case
    return text


def generate(out_dir, seed_offset):
    torch.set_default_dtype(torch.float32)
    torch.set_num_threads(1)
    os.makedirs(out_dir, exist_ok=True)
    for old in glob.glob(os.path.join(out_dir, "*.json")):
        os.remove(old)
    counters = {}
    total = 0
    for opt, tags, layout in case_plan():
        idx = counters.get(opt, 0)
        counters[opt] = idx + 1
        name, case = make_case(opt, idx, tags, layout, seed_offset)
        text = serialize(case)
        with open(os.path.join(out_dir, name + ".json"), "w", encoding="ascii", newline="\n") as f:
            f.write(text)
        total += len(text)
    n = sum(counters.values())
    print("wrote %d cases (%d bytes) to %s" % (n, total, out_dir))
    for opt, c in counters.items():
        print("  %-9s %d" % (opt, c))


# ---------------------------------------------------------------------------
# Verification (independent of the generator code above)


def f32_bits(values):
    return struct.pack("<%df" % len(values), *values)


def verify_case(path):
    with open(path, "r", encoding="utf-8") as f:
        case = json.load(f)
    errors = []
    if case.get("format") != FORMAT:
        errors.append("bad format")
    opt_name = case["optimizer"]["name"]
    cls = {
        "sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW,
        "adamax": torch.optim.Adamax, "adadelta": torch.optim.Adadelta, "adagrad": torch.optim.Adagrad,
        "rmsprop": torch.optim.RMSprop, "nadam": torch.optim.NAdam, "radam": torch.optim.RAdam,
        "rprop": torch.optim.Rprop, "asgd": torch.optim.ASGD,
    }[opt_name]
    n = len(case["params"])
    seen = sorted(i for g in case["param_groups"] for i in g["params"])
    if seen != list(range(n)):
        errors.append("param indices %s do not partition 0..%d" % (seen, n - 1))
    if not 3 <= len(case["steps"]) <= 25:
        errors.append("%d steps" % len(case["steps"]))

    def conv(opts):
        out = {}
        for k, v in opts.items():
            if k in ("foreach", "capturable", "differentiable", "fused"):
                errors.append("forbidden option " + k)
            out[k] = tuple(v) if isinstance(v, list) else v
        return out

    tensors = []
    for p in case["params"]:
        numel = 1
        for d in p["shape"]:
            numel *= d
        if len(p["data"]) != numel:
            errors.append("data length mismatch")
        buf = bytearray(f32_bits(p["data"]))
        if struct.unpack("<%df" % numel, bytes(buf)) != tuple(p["data"]):
            errors.append("initial value is not float32")
        tensors.append(torch.frombuffer(buf, dtype=torch.float32).reshape(p["shape"]).clone())
    groups = [dict(params=[tensors[i] for i in g["params"]], **conv(g.get("options", {})))
              for g in case["param_groups"]]
    optimizer = cls(groups, **conv(case["optimizer"]["options"]))
    lrs = [[] for _ in groups]
    for step in case["steps"]:
        assert len(step["grads"]) == n
        for t, g in zip(tensors, step["grads"]):
            if g is None:
                t.grad = None
            else:
                buf = bytearray(f32_bits(g))
                if struct.unpack("<%df" % len(g), bytes(buf)) != tuple(g):
                    errors.append("grad value is not float32")
                t.grad = torch.frombuffer(buf, dtype=torch.float32).reshape(t.shape).clone()
        optimizer.step()
        for gi, group in enumerate(optimizer.param_groups):
            lrs[gi].append(group["lr"])
    exp = case["expected"]
    for i, (t, e) in enumerate(zip(tensors, exp["params"])):
        got = t.contiguous().view(-1).numpy().tobytes()
        if got != f32_bits(e):
            diff = sum(1 for a, b in zip(t.view(-1).tolist(), e) if struct.pack("<f", a) != struct.pack("<f", b))
            errors.append("param %d: %d of %d values differ" % (i, diff, len(e)))
    if len(exp["params"]) != n:
        errors.append("expected.params has %d entries" % len(exp["params"]))
    if lrs != exp["lr"]:
        errors.append("lr mismatch")
    return errors


def verify(directory):
    torch.set_default_dtype(torch.float32)
    torch.set_num_threads(1)
    files = sorted(glob.glob(os.path.join(directory, "*.json")))
    bad = 0
    for path in files:
        errs = verify_case(path)
        if errs:
            bad += 1
            print("FAIL %s: %s" % (os.path.basename(path), "; ".join(errs)))
    print("verified %d cases, %d failed" % (len(files), bad))
    return 1 if bad or not files else 0


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    default_out = os.path.normpath(os.path.join(here, "..", "tests", "golden", "optim"))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=default_out, help="output directory (default: tests/golden/optim)")
    ap.add_argument("--seed-offset", type=int, default=0,
                    help="0 for the checked-in cases; any other value gives new, unseen cases")
    ap.add_argument("--verify", metavar="DIR", help="re-run torch on every case in DIR and compare bitwise")
    args = ap.parse_args(argv)
    if args.verify:
        return verify(args.verify)
    generate(args.out, args.seed_offset)
    return 0


if __name__ == "__main__":
    sys.exit(main())
