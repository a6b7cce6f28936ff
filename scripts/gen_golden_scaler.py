#!/usr/bin/python3
"""Generate golden dynamic-loss-scaling cases with PyTorch's GradScaler.

Writes tests/golden/scaler/grad_scaler.json: a list of cases, each an
optimizer (sgd or adam) over a few float32 parameters, GradScaler options,
and steps. A step gives each parameter's raw (unscaled) gradient, which the
case multiplies by the current scale -- what backward of ``scaler.scale(loss)``
produces -- and says what the loop does:

  "unscale_clip": max_norm  scaler.unscale_(opt); clip_grad_norm_(..., max_norm)
  "new_scale": s            scaler.update(s) instead of scaler.update()

then scaler.step(opt) and scaler.update(). Recorded after each step:
whether the optimizer stepped, the scale and the growth tracker, and the
parameters; at the end, scaler.state_dict().

What is torch here and what is emulated, plainly: Debian's torch 1.13 is a
CPU build, and its GradScaler (torch.cuda.amp) runs only on CUDA -- it
disables itself without CUDA, asserts that tensors are CUDA tensors, and
its two kernels (_amp_foreach_non_finite_check_and_unscale_ and
_amp_update_scale_) have no CPU implementation in 1.13. This script runs
torch's own GradScaler Python code (the stages, the skip decision, the
found-inf bookkeeping, update(new_scale), state_dict) with Python's -O,
which drops the CUDA asserts -- and with them every other assert of that
code (growth_factor > 1, backoff_factor < 1, "No inf checks were
recorded ..."): the cases here never trip those, and tests/scaler_test.cpp
checks the C++ refusals on their own -- and supplies the two kernels as CPU
emulations written from the CUDA kernels of torch 1.13
(aten/src/ATen/native/cuda/AmpKernels.cu), which torch 2.x's CPU kernels
(AmpGradScalerKernels.cpp) repeat:

  unscale: found_inf = 1 if any element is not finite; g = g * inv_scale
           (in float) unless inv_scale == 1
  update:  found_inf: scale = float(scale * backoff) (a float times a
           double), tracker = 0; else tracker + 1 == interval ?
           (scale = float(scale * growth) if finite, tracker = 0) :
           tracker + 1

Run with Debian's PyTorch:  /usr/bin/python3 scripts/gen_golden_scaler.py
The output is deterministic.
"""
import math
import os
import sys

if __debug__:  # the GradScaler's is_cuda asserts go away under -O
    os.execv(sys.executable, [sys.executable, "-O"] + sys.argv)

import torch
import torch.cuda.amp.grad_scaler as grad_scaler_module

from golden_io import enc, write_cases

OUT = "tests/golden/scaler/grad_scaler.json"


def emulated_unscale(grads, found_inf, inv_scale):
    inv = float(inv_scale.item())
    for g in grads:
        if not bool(torch.isfinite(g).all()):
            found_inf.fill_(1.0)
        if inv != 1.0:
            g.mul_(inv_scale)  # float32 times the float32 inverse


def emulated_update_scale(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    s = float(scale.item())
    if float(found_inf.item()) != 0.0:
        scale.fill_(s * backoff_factor)  # double product, rounded to float32 by fill_
        tracker.fill_(0)
    else:
        successful = int(tracker.item()) + 1
        if successful == growth_interval:
            grown = torch.tensor(s * growth_factor, dtype=torch.float64).float()
            if bool(torch.isfinite(grown)):
                scale.copy_(grown)
            tracker.fill_(0)
        else:
            tracker.fill_(successful)
    return scale


torch._amp_foreach_non_finite_check_and_unscale_ = emulated_unscale
torch._amp_update_scale_ = emulated_update_scale
grad_scaler_module.amp_definitely_not_available = lambda: False




def enc9(x):
    # 9 significant digits round-trip a float32 exactly.
    return enc(float("%.9g" % x))


def flat(t):
    return [enc9(float(x)) for x in t.detach().reshape(-1).tolist()]


def main():
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(20261123)
    cases = []

    def add(name, optimizer, opt_options, scaler_options, nsteps, events=None, grad_scale=1.0):
        events = events or {}
        shapes = [[4], [2, 3]]
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
        initial = [flat(p) for p in params]
        opt = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[optimizer](params, **opt_options)
        scaler = torch.cuda.amp.GradScaler(**scaler_options)
        steps = []
        for k in range(nsteps):
            ev = events.get(k, {})
            raw = [torch.randn(s, generator=gen) * grad_scale for s in shapes]
            for where, value in ev.get("inject", []):
                raw[where[0]].view(-1)[where[1]] = value
            loss = scaler.scale(torch.ones(()))  # creates the scale on the first call
            for p, g in zip(params, raw):
                p.grad = g * scaler._scale if scaler.is_enabled() else g.clone()
            step = {"grads": [flat(g) for g in raw]}
            if "unscale_clip" in ev:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, ev["unscale_clip"])
                step["unscale_clip"] = ev["unscale_clip"]
            scaler.step(opt)
            if scaler.is_enabled():
                state = scaler._per_optimizer_states[id(opt)]
                step["expected_stepped"] = sum(v.item() for v in state["found_inf_per_device"].values()) == 0
            else:
                step["expected_stepped"] = True
            if "new_scale" in ev:
                scaler.update(ev["new_scale"])
                step["new_scale"] = ev["new_scale"]
            else:
                scaler.update()
            step["expected_scale"] = scaler.get_scale()
            step["expected_growth_tracker"] = scaler._get_growth_tracker()
            step["expected_params"] = [flat(p) for p in params]
            del loss
            steps.append(step)
        sd = scaler.state_dict()
        cases.append({"name": name, "optimizer": {"name": optimizer, "options": opt_options},
                      "scaler": scaler_options, "shapes": shapes, "params": initial, "steps": steps,
                      "expected_state_dict": {k: (enc9(v) if isinstance(v, float) else v) for k, v in sd.items()}})

    inf, nan = math.inf, math.nan
    sgd = {"lr": 0.1, "momentum": 0.9}
    adam = {"lr": 0.01}
    # Growth every 3 good steps, backoff on injected inf/NaN.
    add("grow_and_backoff_sgd", "sgd", sgd, {"init_scale": 1024.0, "growth_interval": 3}, 12,
        {4: {"inject": [((0, 1), inf)]}, 8: {"inject": [((1, 5), nan)]}, 9: {"inject": [((0, 0), -inf)]}})
    add("grow_and_backoff_adam", "adam", adam, {"init_scale": 1024.0, "growth_interval": 3}, 12,
        {2: {"inject": [((1, 0), nan)]}, 7: {"inject": [((0, 3), inf)]}})
    # Defaults: 2^16, x2 after 2000 good steps (never here), /2 on inf.
    add("defaults", "adam", adam, {}, 6, {1: {"inject": [((0, 2), inf)]}, 2: {"inject": [((0, 2), inf)]}})
    # Odd factors, so the float*double rounding of the scale matters.
    add("odd_factors", "sgd", sgd,
        {"init_scale": 3000.0, "growth_factor": 1.7, "backoff_factor": 0.37, "growth_interval": 2}, 14,
        {3: {"inject": [((1, 1), inf)]}, 4: {"inject": [((1, 2), nan)]}, 10: {"inject": [((0, 0), inf)]}})
    # Gradients that overflow float32 only once scaled: the real mechanism.
    add("overflow_from_scaling", "sgd", {"lr": 1e-38}, {"init_scale": 2.0 ** 24, "growth_interval": 1}, 12,
        grad_scale=1e31)
    # Growth stops short of infinity.
    add("growth_capped_at_float_max", "sgd", {"lr": 0.01}, {"init_scale": 2.0e38, "growth_interval": 1}, 4)
    # Explicit unscale_ then clipping, as torch's docs show; and update(new_scale).
    add("unscale_then_clip", "adam", adam, {"init_scale": 512.0, "growth_interval": 2}, 8,
        {0: {"unscale_clip": 0.5}, 1: {"unscale_clip": 0.5, "inject": [((0, 1), inf)]}, 3: {"unscale_clip": 10.0},
         5: {"new_scale": 77.5}})
    add("growth_interval_one", "sgd", sgd, {"init_scale": 1.0, "growth_interval": 1}, 7,
        {3: {"inject": [((1, 4), inf)]}})
    add("disabled", "sgd", sgd, {"enabled": False}, 4)

    write_cases(OUT, "scripts/gen_golden_scaler.py (torch %s; CUDA kernels emulated, see the script)" % torch.__version__, cases)


if __name__ == "__main__":
    sys.exit(main())
