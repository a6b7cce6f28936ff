#!/usr/bin/python3
"""Generate golden replay cases (format ``distopt-replay/1``) for the
non-pointwise optimizers, from reference implementations written here in torch.

The references
--------------
torch has no LARS, LAMB or (in 1.13) Adafactor, so this script implements
them as ``torch.optim.Optimizer`` subclasses, op for op in float32, after the
code distopt names as the reference (spec/optimizers.md §3):

* ``RefLars``: timm's ``Lars`` (timm/optim/lars.py): the LARS trust ratio
  trust_coeff*||p|| / (||g|| + wd*||p|| + eps) when weight_decay != 0 or
  always_adapt (1 if either norm is 0; trust_clip: min(ratio/lr, 1)), applied
  to g + wd*p, then torch SGD's momentum, dampening and Nesterov update.
* ``RefLamb``: NVIDIA apex's ``FusedLAMB`` (apex/optimizers/fused_lamb.py and
  csrc/multi_tensor_lamb.cu, stages 1 and 2): the global gradient norm over
  every group clipped to the optimizer-level max_grad_norm, Adam moments with
  grad_averaging, bias corrections 1 - beta^t in double from float betas
  (std::pow(float, int)), the update (m/bc1)/(sqrt(v/bc2)+eps) (+ wd*p in
  adam_w_mode; L2 on the scaled gradient otherwise; p read as 0 when wd is 0),
  and the trust ratio lr*||p||/||u|| when wd != 0 or use_nvlamb and both norms
  are non-zero. The step count is the group's (apex's group["step"]), which
  advances on every step() whether or not a parameter has a gradient.
* ``RefAdafactor``: transformers' ``Adafactor`` (src/transformers/
  optimization.py, fairseq's math): relative or fixed step size scaled by the
  parameter's RMS, factored second moments (row and column averages of
  g^2 + eps1) for tensors of two or more dimensions, the update's RMS clipped
  to clip_threshold, optional first moment (beta1) and lr-scaled weight decay.
  lr and beta1 default to None (written as null in the cases; the expected
  lr is then "NaN").

Cases
-----
At least ten per optimizer: every option switched on and off, non-default
scalars, two parameter groups with per-group overrides, null gradients
(including a parameter whose first gradient is null), whole-tensor zero
gradients, a parameter tensor of zeros, multi-dimensional shapes and a
25-step run. Data are float32 N(0,1) samples from a generator seeded from the
case name, as in gen_golden_optim.py, whose helpers this script uses.

Run with Debian's PyTorch::

    /usr/bin/python3 scripts/gen_golden_nonpointwise.py     # -> tests/golden/nonpointwise/

The output is deterministic; existing ``*.json`` files there are replaced.
"""

import argparse
import glob
import math
import os
import random
import struct
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_golden_optim as base  # noqa: E402

GENERATOR = "scripts/gen_golden_nonpointwise.py (torch %s)" % torch.__version__


def f32(x):
    """x rounded to float32, as a Python float."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def t32(x):
    """A float32 0-dim tensor: scalars then combine in float32, as in the CUDA kernels."""
    return torch.tensor(x, dtype=torch.float32)


class RefLars(torch.optim.Optimizer):
    """timm/optim/lars.py, written anew from its formulas."""

    def __init__(self, params, lr=1.0, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
                 trust_coeff=0.001, eps=1e-8, trust_clip=False, always_adapt=False):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, trust_coeff=trust_coeff, eps=eps, trust_clip=trust_clip,
                        always_adapt=always_adapt)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            wd = group["weight_decay"]
            mu = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if wd != 0 or group["always_adapt"]:
                    w_norm = p.norm(2.0)
                    g_norm = g.norm(2.0)
                    ratio = group["trust_coeff"] * w_norm / (g_norm + w_norm * wd + group["eps"])
                    ratio = torch.where(w_norm > 0, torch.where(g_norm > 0, ratio, t32(1.0)), t32(1.0))
                    if group["trust_clip"]:
                        ratio = torch.clamp(ratio / group["lr"], max=1.0)
                    g = g.add(p, alpha=wd).mul_(ratio)
                if mu != 0:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        buf = state["momentum_buffer"] = torch.clone(g).detach()
                    else:
                        buf = state["momentum_buffer"]
                        buf.mul_(mu).add_(g, alpha=1.0 - group["dampening"])
                    g = g.add(buf, alpha=mu) if group["nesterov"] else buf
                p.add_(g, alpha=-group["lr"])


class RefLamb(torch.optim.Optimizer):
    """apex FusedLAMB (fused_lamb.py + multi_tensor_lamb.cu), on the CPU in float32."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6,
                 weight_decay=0.01, adam_w_mode=True, grad_averaging=True, max_grad_norm=1.0,
                 use_nvlamb=False):
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode
        self.use_nvlamb = use_nvlamb

    @torch.no_grad()
    def step(self):
        grads = [p.grad.reshape(-1) for g in self.param_groups for p in g["params"] if p.grad is not None]
        global_norm = torch.cat(grads).norm(2.0) if grads else t32(0.0)
        max_norm = t32(self.defaults["max_grad_norm"])  # the optimizer's, not the group's
        clip = global_norm / max_norm if global_norm > max_norm else t32(1.0)
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            t = group["step"]
            b1, b2 = f32(group["betas"][0]), f32(group["betas"][1])
            bc1 = t32(1.0 - b1 ** t) if group["bias_correction"] else t32(1.0)
            bc2 = t32(1.0 - b2 ** t) if group["bias_correction"] else t32(1.0)
            beta3 = t32(1.0) - t32(b1) if group["grad_averaging"] else t32(1.0)
            one_minus_b2 = t32(1.0) - t32(b2)
            decay = t32(group["weight_decay"])
            lr = t32(group["lr"])
            eps = t32(group["eps"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                param_norm = p.norm(2.0)  # before stage 1
                pd = p if group["weight_decay"] != 0 else torch.zeros_like(p)
                g = p.grad / clip
                if not self.adam_w_mode:
                    g = g + decay * pd
                m.copy_(m * t32(b1) + beta3 * g)
                v.copy_(v * t32(b2) + one_minus_b2 * g * g)
                u = (m / bc1) / (torch.sqrt(v / bc2) + eps)
                if self.adam_w_mode:
                    u = u + decay * pd
                ratio = lr
                if self.use_nvlamb or group["weight_decay"] != 0:
                    update_norm = u.norm(2.0)
                    if update_norm != 0 and param_norm != 0:
                        ratio = lr * (param_norm / update_norm)
                p.copy_(p - ratio * u)


class RefAdafactor(torch.optim.Optimizer):
    """transformers' Adafactor (src/transformers/optimization.py; fairseq's math), in float32."""

    def __init__(self, params, lr=None, eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8, beta1=None,
                 weight_decay=0.0, scale_parameter=True, relative_step=True, warmup_init=False):
        defaults = dict(lr=lr, eps=eps, clip_threshold=clip_threshold, decay_rate=decay_rate, beta1=beta1,
                        weight_decay=weight_decay, scale_parameter=scale_parameter, relative_step=relative_step,
                        warmup_init=warmup_init)
        super().__init__(params, defaults)

    @staticmethod
    def rms(t):
        return t.norm(2) / (t.numel() ** 0.5)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                factored = g.dim() >= 2
                if not state:
                    state["step"] = 0
                    if group["beta1"] is not None:
                        state["exp_avg"] = torch.zeros_like(g)
                    if factored:
                        state["row"] = torch.zeros(g.shape[:-1])
                        state["col"] = torch.zeros(g.shape[:-2] + g.shape[-1:])
                    else:
                        state["exp_avg_sq"] = torch.zeros_like(g)
                state["step"] += 1
                t = state["step"]
                rms = self.rms(p)  # before the update
                # The step size: relative, then scaled by the parameter's RMS
                # (Python's max of a float and a 0-dim tensor, as transformers).
                rho = group["lr"]
                if group["relative_step"]:
                    rho = min(1e-6 * t if group["warmup_init"] else 1e-2, 1.0 / math.sqrt(t))
                scale = max(group["eps"][1], rms) if group["scale_parameter"] else 1.0
                lr = scale * rho
                beta2t = 1.0 - math.pow(t, group["decay_rate"])
                q = g ** 2 + group["eps"][0]
                if factored:
                    row, col = state["row"], state["col"]
                    row.mul_(beta2t).add_(q.mean(dim=-1), alpha=1.0 - beta2t)
                    col.mul_(beta2t).add_(q.mean(dim=-2), alpha=1.0 - beta2t)
                    r_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
                    c_factor = col.unsqueeze(-2).rsqrt()
                    u = torch.mul(r_factor, c_factor).mul_(g)
                else:
                    v = state["exp_avg_sq"]
                    v.mul_(beta2t).add_(q, alpha=1.0 - beta2t)
                    u = v.rsqrt().mul_(g)
                u.div_((self.rms(u) / group["clip_threshold"]).clamp_(min=1.0))
                u.mul_(lr)
                if group["beta1"] is not None:
                    m = state["exp_avg"]
                    m.mul_(group["beta1"]).add_(u, alpha=1 - group["beta1"])
                    u = m
                if group["weight_decay"] != 0:
                    p.add_(p, alpha=(-group["weight_decay"] * lr))
                p.add_(-u)


class RefMuon(torch.optim.Optimizer):
    """torch.optim.Muon (torch/optim/_muon.py, torch 2.9; torch 1.13 has none), with distopt's
    ns_dtype: the Newton-Schulz iteration in float32 (distopt's default) or bfloat16 (torch's)."""

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=(3.4445, -4.7750, 2.0315), eps=1e-7, ns_steps=5, adjust_lr_fn="original",
                 ns_dtype="float32"):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                        ns_dtype=ns_dtype)
        super().__init__(params, defaults)

    @staticmethod
    def newton_schulz(u, coefficients, steps, eps, dtype):
        a, b, c = coefficients
        x = u.to(dtype)
        if u.size(0) > u.size(1):
            x = x.T
        x = x / x.norm().clamp(min=eps)
        for _ in range(int(steps)):
            gram = x @ x.T
            update = b * gram + c * gram @ gram
            x = a * x + update @ x
        if u.size(0) > u.size(1):
            x = x.T
        return x.float()

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
            dtype = torch.bfloat16 if group["ns_dtype"] == "bfloat16" else torch.float32
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mu)
                u = p.grad.lerp(buf, mu) if group["nesterov"] else buf
                o = self.newton_schulz(u, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)
                rows, cols = p.shape[:2]
                if group["adjust_lr_fn"] == "match_rms_adamw":
                    ratio = 0.2 * math.sqrt(max(rows, cols))
                else:
                    ratio = math.sqrt(max(1, rows / cols))
                p.mul_(1 - lr * wd)
                p.add_(o, alpha=-lr * ratio)


REFERENCES = {"lars": RefLars, "lamb": RefLamb, "adafactor": RefAdafactor, "muon": RefMuon}

# Per optimizer: (top-level options, layout) for each case. Layouts: "small"
# (two tensors), "groups" (two groups, overrides), "nulls", "zeros" (zero
# gradients and a zero parameter tensor), "shapes" (3-D, 1000 elements),
# "long" (25 steps).
PLAN = {
    "lars": [
        ({"lr": 0.1}, "small"),
        ({"lr": 0.1, "weight_decay": 1e-3}, "small"),
        ({"lr": 0.5, "weight_decay": 1e-2, "momentum": 0.9}, "groups"),
        ({"lr": 0.2, "always_adapt": True, "momentum": 0.9, "nesterov": True}, "nulls"),
        ({"lr": 0.3, "weight_decay": 5e-4, "momentum": 0.8, "dampening": 0.1}, "zeros"),
        ({"lr": 2.0, "weight_decay": 1e-3, "trust_clip": True}, "small"),
        ({"lr": 0.01, "weight_decay": 1e-3, "trust_clip": True, "momentum": 0.9}, "shapes"),
        ({"lr": 0.1, "weight_decay": 1e-4, "trust_coeff": 0.02, "eps": 1e-3}, "groups"),
        ({"lr": 1.0, "always_adapt": True, "trust_coeff": 0.01}, "zeros"),
        ({"lr": 0.05, "weight_decay": 1e-3, "momentum": 0.9, "nesterov": True, "always_adapt": True}, "long"),
        ({"weight_decay": 1e-2}, "nulls"),
        ({"lr": 0.1, "momentum": 0.5}, "shapes"),
    ],
    "lamb": [
        ({}, "small"),
        ({"lr": 0.01, "max_grad_norm": 0.1}, "small"),
        ({"lr": 0.01, "adam_w_mode": False, "weight_decay": 0.05}, "groups"),
        ({"lr": 0.005, "bias_correction": False}, "nulls"),
        ({"lr": 0.01, "grad_averaging": False, "max_grad_norm": 100.0}, "zeros"),
        ({"lr": 0.02, "weight_decay": 0.0, "use_nvlamb": True}, "small"),
        ({"lr": 0.02, "weight_decay": 0.0}, "shapes"),
        ({"lr": 0.01, "betas": [0.8, 0.99], "eps": 1e-4, "max_grad_norm": 0.5}, "groups"),
        ({"lr": 0.003, "adam_w_mode": False, "use_nvlamb": True, "weight_decay": 0.0}, "zeros"),
        ({"lr": 0.001, "max_grad_norm": 2.0}, "long"),
        ({"lr": 0.01, "adam_w_mode": False, "bias_correction": False, "grad_averaging": False}, "nulls"),
        ({"lr": 0.05, "weight_decay": 0.1, "max_grad_norm": 0.0}, "shapes"),
    ],
}

PLAN["adafactor"] = [
    ({}, "small"),
    ({}, "shapes"),
    ({"lr": 0.01, "relative_step": False}, "small"),
    ({"lr": 0.005, "relative_step": False, "scale_parameter": False, "beta1": 0.9}, "groups"),
    ({"warmup_init": True}, "nulls"),
    ({"clip_threshold": 0.5, "decay_rate": -0.5, "weight_decay": 0.01}, "zeros"),
    ({"beta1": 0.8, "eps": [1e-20, 1e-2]}, "shapes"),
    ({"lr": 0.02, "relative_step": False, "weight_decay": 0.1, "clip_threshold": 2.0}, "groups"),
    ({"scale_parameter": False}, "long"),
    ({"lr": 0.001, "relative_step": False, "beta1": 0.5, "scale_parameter": False}, "zeros"),
    ({"decay_rate": -0.9, "weight_decay": 0.001}, "nulls"),
    ({"eps": [1e-30, 1e-1]}, "small"),
]

PLAN["muon"] = [
    ({}, "small"),
    ({"lr": 0.02}, "shapes"),
    ({"lr": 0.02, "nesterov": False, "momentum": 0.9}, "small"),
    ({"lr": 0.01, "weight_decay": 0.0, "adjust_lr_fn": "match_rms_adamw"}, "groups"),
    ({"lr": 0.02, "ns_steps": 3, "eps": 1e-5}, "nulls"),
    ({"lr": 0.02, "momentum": 0.3}, "zeros"),
    ({"lr": 0.02, "ns_coefficients": [2.0, -1.5, 0.5]}, "shapes"),
    ({"lr": 0.05, "weight_decay": 0.05, "adjust_lr_fn": "match_rms_adamw"}, "groups"),
    ({"lr": 0.01}, "long"),
    ({"lr": 0.02, "ns_steps": 0, "nesterov": False}, "zeros"),
    ({"lr": 0.02, "momentum": 0.0}, "nulls"),
    ({"lr": 0.03, "ns_steps": 8}, "small"),
]

GROUP_OVERRIDES = {
    "lars": [{"lr": 0.05, "weight_decay": 0.0}, {"momentum": 0.0, "trust_coeff": 0.005}],
    "lamb": [{"lr": 0.002, "weight_decay": 0.0}, {"betas": [0.95, 0.98], "eps": 1e-5}],
    "adafactor": [{"clip_threshold": 0.3, "weight_decay": 0.01}, {"decay_rate": -0.6, "beta1": 0.7}],
    "muon": [{"lr": 0.005, "weight_decay": 0.0}, {"momentum": 0.8, "ns_steps": 4}],
}


def layout_of(opt, kind, rng):
    """(shapes, groups, nulls[step][param], zero grads[step][param], zero params)."""
    steps = 25 if kind == "long" else 5
    if opt == "muon":  # 2-D parameters only
        shapes = {"shapes": [(20, 30), (30, 20), (10, 3)], "groups": [(4, 5), (5, 3), (3, 3), (7, 2)]}.get(
            kind, [(3, 4), (6, 2), (5, 5)])
    elif kind == "shapes":
        shapes = [(2, 3, 4), (1000,), (10, 3)]
    elif kind == "groups":
        shapes = [(4, 5), (5,), (3, 3), (7,)]
    else:
        shapes = [(3, 4), (7,), (6, 2)]
    n = len(shapes)
    groups = [{"params": list(range(n))}]
    if kind == "groups":
        over = GROUP_OVERRIDES[opt][rng.randrange(2)]
        groups = [{"params": [0, 1]}, {"params": [2, 3], "options": over}]
    nulls = [[False] * n for _ in range(steps)]
    zeros = [[False] * n for _ in range(steps)]
    zero_params = [False] * n
    if kind == "nulls":
        nulls[0][1] = True  # a parameter whose first gradient is null
        nulls[2][0] = True
        nulls[3] = [True] * n  # a step without any gradient
    if kind == "zeros":
        zeros[1][0] = True
        zeros[2] = [True] * n
        zero_params[2] = True
    return shapes, groups, nulls, zeros, zero_params


def make_case(opt, idx, top, kind):
    name = "%s_%03d_%s" % (opt, idx, kind)
    seed = base.stable_seed(name)
    rng = random.Random(seed)
    gen = torch.Generator()
    gen.manual_seed(seed)
    shapes, groups, nulls, zeros, zero_params = layout_of(opt, kind, rng)
    params0 = []
    for shape, zero in zip(shapes, zero_params):
        p = torch.zeros(shape) if zero else base.randn(shape, gen)
        params0.append(p)
    steps = []
    for k in range(len(nulls)):
        steps.append([None if nulls[k][i] else base.make_grad(shape, gen, rng, whole_zero=zeros[k][i])
                      for i, shape in enumerate(shapes)])
    case = {
        "format": base.FORMAT,
        "generator": GENERATOR,
        "optimizer": {"name": opt, "options": top},
        "param_groups": groups,
        "params": [{"shape": list(s), "data": base.flat(p)} for s, p in zip(shapes, params0)],
        "steps": [{"grads": [None if g is None else base.flat(g) for g in grads]} for grads in steps],
    }
    final, lrs = run_reference(case)
    case["expected"] = {"params": final, "lr": lrs}
    base.check_finite(name, case)
    return name, case


def options_for_torch(options):
    return {k: (tuple(v) if k in ("betas", "ns_coefficients") else v) for k, v in options.items()}


def run_reference(case):
    return base.run_torch(case, REFERENCES, options_for_torch)


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    default_out = os.path.normpath(os.path.join(here, "..", "tests", "golden", "nonpointwise"))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=default_out, help="output directory (default: tests/golden/nonpointwise)")
    ap.add_argument("--bf16-out", help="also write Muon cases with ns_dtype bfloat16 here (not checked in)")
    args = ap.parse_args(argv)
    torch.set_default_dtype(torch.float32)
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    for old in glob.glob(os.path.join(args.out, "*.json")):
        os.remove(old)
    for opt, plan in PLAN.items():
        for idx, (top, kind) in enumerate(plan):
            name, case = make_case(opt, idx, top, kind)
            with open(os.path.join(args.out, name + ".json"), "w", encoding="ascii", newline="\n") as f:
                f.write(base.serialize(case))
        print("%-6s %d cases" % (opt, len(plan)))
    # Muon with ns_dtype "bfloat16" is not written: distopt's emulation of
    # torch's bfloat16 Newton-Schulz is not yet closer to torch than float32
    # (docs/optimizers.md). --bf16-out DIR writes such cases for study.
    if args.bf16_out:
        os.makedirs(args.bf16_out, exist_ok=True)
        for idx, (top, kind) in enumerate(PLAN["muon"][:6]):
            name, case = make_case("muon", idx, dict(top, ns_dtype="bfloat16"), kind)
            with open(os.path.join(args.bf16_out, name + "_bf16.json"), "w", encoding="ascii", newline="\n") as f:
                f.write(base.serialize(case))
    return 0


if __name__ == "__main__":
    sys.exit(main())
