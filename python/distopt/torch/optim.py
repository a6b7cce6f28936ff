"""torch.optim drop-ins whose step is distopt's C++ update rule.

Each class has torch's name, constructor signature and defaults (the rules
torch lacks follow the libraries the C++ rules follow: Lion as
lion-pytorch, LAMB as apex's FusedLAMB, LARS as timm, Adafactor as
transformers, Muon as torch 2.9, Shampoo as torch-optimizer) and is a
``torch.optim.Optimizer``: ``param_groups`` and ``state`` are torch's,
schedulers, ``clip_grad_norm_``, ``zero_grad``, ``add_param_group``,
``step(closure)`` and ``state_dict``/``load_state_dict`` work as with
torch's own optimizers, and a state_dict loads into torch's optimizer of the
same name and the other way round (docs/python.md).

One C++ call steps every parameter (``step``): the parameters are updated in
place in their own memory, and the state tensors of ``optimizer.state`` are
views of the C++ optimizer's memory (zero-copy). Parameters are CPU or CUDA
tensors (CUDA: the pointwise rules, one launch per group on torch's current
stream; docs/gpu.md) of float32, bfloat16 or float16 (bf16/f16 get fp32 master weights,
``state[p]["master_param"]``); complex64 ones step as their real pairs, as
torch's pointwise rules step them, and non-contiguous ones through a
contiguous copy; anything else is a one-line TypeError or ValueError naming
the parameter.

Arguments are checked at construction, as torch checks them (the installed
torch's own class for the arguments it has). torch's implementation flags
follow the installed torch: ``foreach`` changes nothing (one
implementation), ``fused`` does what torch does with CPU tensors,
``differentiable=True`` and ``capturable=True`` are refused in one line.
Copies (deepcopy, pickle, torch.save) step on as the original
(docs/python.md, "What torch's own tests check").
"""

from ._dropin import _DistoptOptimizer, _torch_default
from ._offload import CPUOffload  # noqa: F401


def _stored(defaults, state_dtype):
    """``defaults`` with ``state_dtype`` where it is not torch's fp32 (so that
    an fp32 optimizer's param_groups are torch's); a group may set its own."""
    if state_dtype != "f32":
        defaults["state_dtype"] = state_dtype
    return defaults


class SGD(_DistoptOptimizer):
    """SGD with momentum (torch.optim.SGD): ``g += wd*p``; with momentum
    ``b = mu*b + (1-dampening)*g`` (``b = g`` at the first step), ``g = g + mu*b``
    (nesterov) or ``b``; ``p -= lr*g``.

    Arguments as torch's: lr (default 1e-3, torch 2.x's), momentum, dampening,
    weight_decay (L2), nesterov, maximize; and ``state_dtype`` ("f32";
    "bf16", "int8" or "int4" keep the momentum quantized: Adam8bit's docstring).

    Differs from torch: CPU tensors only; ``foreach`` and ``fused`` have no effect (one fused C++ step);
    ``differentiable=True`` and ``capturable=True`` are refused at construction.
    """

    _rule = "sgd"
    _none_state = ("momentum_buffer",)

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False, *, maximize=False,
                 foreach=None, differentiable=False, fused=None, state_dtype="f32"):
        super().__init__(params, _stored(dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                                nesterov=nesterov, maximize=maximize, foreach=foreach,
                                                differentiable=differentiable, fused=fused), state_dtype))


class Adam(_DistoptOptimizer):
    """Adam (torch.optim.Adam): ``m = b1*m + (1-b1)*g``, ``v = b2*v + (1-b2)*g^2``,
    ``p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)``; ``amsgrad`` uses the running
    maximum of ``v``.

    Arguments as torch's: lr, betas, eps, weight_decay (L2, or decoupled as
    AdamW with ``decoupled_weight_decay=True``, torch 2.x's), amsgrad, maximize;
    and ``state_dtype`` ("f32"; "bf16", "int8" or "int4": Adam8bit's docstring).

    Differs from torch: CPU tensors only; ``foreach`` and ``fused`` have no effect (one fused C++ step);
    ``differentiable=True`` and ``capturable=True`` are refused at construction.
    """

    _rule = "adam"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False,
                 fused=_torch_default("Adam", "fused", None), decoupled_weight_decay=False, state_dtype="f32"):
        super().__init__(params, _stored(dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                                                maximize=maximize, foreach=foreach, capturable=capturable,
                                                differentiable=differentiable, fused=fused,
                                                decoupled_weight_decay=decoupled_weight_decay), state_dtype))


class AdamW(_DistoptOptimizer):
    """AdamW (torch.optim.AdamW): Adam with decoupled weight decay,
    ``p *= 1 - lr*wd`` before the Adam update.

    Arguments as torch's: lr, betas, eps, weight_decay (default 1e-2),
    amsgrad, maximize; and ``state_dtype`` ("f32"; "bf16", "int8" or "int4":
    Adam8bit's docstring).

    Differs from torch: CPU tensors only; ``foreach`` and ``fused`` have no effect (one fused C++ step);
    ``differentiable=True`` and ``capturable=True`` are refused at construction.
    """

    _rule = "adamw"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None, state_dtype="f32"):
        super().__init__(params, _stored(dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                                                maximize=maximize, foreach=foreach, capturable=capturable,
                                                differentiable=differentiable, fused=fused), state_dtype))


class Adamax(_DistoptOptimizer):
    """Adamax (torch.optim.Adamax): ``m = b1*m + (1-b1)*g``,
    ``u = max(b2*u, |g| + eps)``, ``p -= lr/bc1 * m/u``.

    Arguments as torch's: lr (2e-3), betas, eps, weight_decay (L2), maximize.

    Differs from torch: CPU tensors only; ``foreach`` and ``fused`` have no effect (one fused C++ step);
    ``differentiable=True`` and ``capturable=True`` are refused at construction.
    """

    _rule = "adamax"

    def __init__(self, params, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, foreach=None, *,
                 maximize=False, differentiable=False, capturable=False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=foreach,
                                        maximize=maximize, differentiable=differentiable, capturable=capturable))


class Adadelta(_DistoptOptimizer):
    """Adadelta (torch.optim.Adadelta): ``v = rho*v + (1-rho)*g^2``,
    ``d = sqrt(u + eps)/sqrt(v + eps) * g``, ``u = rho*u + (1-rho)*d^2``,
    ``p -= lr*d``.

    Arguments as torch's: lr (1.0), rho, eps, weight_decay (L2), maximize.

    Differs from torch: CPU tensors only; ``foreach`` and ``fused`` have no effect (one fused C++ step);
    ``differentiable=True`` and ``capturable=True`` are refused at construction.
    """

    _rule = "adadelta"

    def __init__(self, params, lr=1.0, rho=0.9, eps=1e-6, weight_decay=0, foreach=None, *, maximize=False,
                 differentiable=False, capturable=False):
        super().__init__(params, dict(lr=lr, rho=rho, eps=eps, weight_decay=weight_decay, foreach=foreach,
                                        maximize=maximize, differentiable=differentiable, capturable=capturable))


class Adagrad(_DistoptOptimizer):
    """Adagrad (torch.optim.Adagrad): ``s += g^2``,
    ``p -= lr/(1 + (t-1)*lr_decay) * g/(sqrt(s) + eps)``.

    Arguments as torch's: lr, lr_decay, weight_decay (L2),
    initial_accumulator_value, eps, maximize. Its state is made at the
    first step or load (torch's exists from construction).

    Differs from torch: CPU tensors only; ``foreach`` and ``fused`` have no effect (one fused C++ step);
    ``differentiable=True`` and ``capturable=True`` are refused at construction.
    Sparse gradients are refused (torch's Adagrad takes them).
    """

    _rule = "adagrad"

    def __init__(self, params, lr=1e-2, lr_decay=0, weight_decay=0, initial_accumulator_value=0, eps=1e-10,
                 foreach=None, *, maximize=False, differentiable=False, fused=None):
        super().__init__(params, dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                                        initial_accumulator_value=initial_accumulator_value, eps=eps,
                                        foreach=foreach, maximize=maximize, differentiable=differentiable,
                                        fused=fused))


class RMSprop(_DistoptOptimizer):
    """RMSprop (torch.optim.RMSprop): ``v = alpha*v + (1-alpha)*g^2``; centered
    subtracts the squared mean gradient; ``p -= lr * g/(sqrt(v) + eps)``, through
    a momentum buffer when momentum > 0.

    Arguments as torch's: lr, alpha, eps, weight_decay (L2), momentum,
    centered, maximize.

    Differs from torch: CPU tensors only; ``foreach`` and ``fused`` have no effect (one fused C++ step);
    ``differentiable=True`` and ``capturable=True`` are refused at construction.
    """

    _rule = "rmsprop"

    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0, centered=False,
                 foreach=None, maximize=False, differentiable=False, capturable=False):
        super().__init__(params, dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum,
                                        centered=centered, foreach=foreach, maximize=maximize,
                                        differentiable=differentiable, capturable=capturable))


class NAdam(_DistoptOptimizer):
    """NAdam (torch.optim.NAdam): Adam with Nesterov momentum on the schedule
    ``mu_t = b1*(1 - 0.5*0.96^(t*momentum_decay))``.

    Arguments as torch's: lr (2e-3), betas, eps, weight_decay,
    momentum_decay; decoupled_weight_decay and maximize as torch 2.x.

    Differs from torch: CPU tensors only; ``foreach`` and ``fused`` have no effect (one fused C++ step);
    ``differentiable=True`` and ``capturable=True`` are refused at construction.
    """

    _rule = "nadam"

    def __init__(self, params, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, momentum_decay=4e-3,
                 foreach=None, *, decoupled_weight_decay=False, maximize=False, capturable=False,
                 differentiable=False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                        momentum_decay=momentum_decay, foreach=foreach,
                                        decoupled_weight_decay=decoupled_weight_decay, maximize=maximize,
                                        capturable=capturable, differentiable=differentiable))


class RAdam(_DistoptOptimizer):
    """RAdam (torch.optim.RAdam): Adam whose adaptive step is rectified by
    ``r_t`` once the variance is tractable (``rho_t > 5``), plain momentum SGD
    before.

    Arguments as torch's: lr, betas, eps, weight_decay; decoupled_weight_decay
    and maximize as torch 2.x.

    Differs from torch: CPU tensors only; ``foreach`` and ``fused`` have no effect (one fused C++ step);
    ``differentiable=True`` and ``capturable=True`` are refused at construction.
    """

    _rule = "radam"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, foreach=None, *,
                 decoupled_weight_decay=False, maximize=False, capturable=False, differentiable=False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=foreach,
                                        decoupled_weight_decay=decoupled_weight_decay, maximize=maximize,
                                        capturable=capturable, differentiable=differentiable))


class Rprop(_DistoptOptimizer):
    """Rprop (torch.optim.Rprop): each element's step size grows by eta+ while
    the gradient keeps its sign and shrinks by eta- when it flips (within
    step_sizes); ``p -= sign(g) * step``.

    Arguments as torch's: lr (the initial step), etas, step_sizes, maximize.

    Differs from torch: CPU tensors only; ``foreach`` and ``fused`` have no effect (one fused C++ step);
    ``differentiable=True`` and ``capturable=True`` are refused at construction.
    """

    _rule = "rprop"

    def __init__(self, params, lr=1e-2, etas=(0.5, 1.2), step_sizes=(1e-6, 50), foreach=None, maximize=False, *,
                 capturable=False, differentiable=False):
        super().__init__(params, dict(lr=lr, etas=etas, step_sizes=step_sizes, foreach=foreach, maximize=maximize,
                                        capturable=capturable, differentiable=differentiable))


class ASGD(_DistoptOptimizer):
    """Averaged SGD (torch.optim.ASGD): ``p *= 1 - lambd*eta``, ``p -= eta*g``, and
    the average ``ax`` of the iterates from step t0 on; eta and mu follow
    torch's schedules.

    Arguments as torch's: lr, lambd, alpha, t0, weight_decay (L2), maximize.

    Differs from torch: CPU tensors only; ``foreach`` and ``fused`` have no effect (one fused C++ step);
    ``differentiable=True`` and ``capturable=True`` are refused at construction.
    """

    _rule = "asgd"

    def __init__(self, params, lr=1e-2, lambd=1e-4, alpha=0.75, t0=1e6, weight_decay=0, foreach=None,
                 maximize=False, differentiable=False, capturable=False):
        super().__init__(params, dict(lr=lr, lambd=lambd, alpha=alpha, t0=t0, weight_decay=weight_decay,
                                        foreach=foreach, maximize=maximize, differentiable=differentiable,
                                        capturable=capturable))


class Lion(_DistoptOptimizer):
    """Lion (Chen et al. 2023, as lion-pytorch): ``p *= 1 - lr*wd``,
    ``p -= lr * sign(b1*m + (1-b1)*g)``, ``m = b2*m + (1-b2)*g``.

    Arguments: lr (1e-4), betas ((0.9, 0.99)), weight_decay (decoupled),
    maximize, state_dtype ("f32"; "bf16", "int8" or "int4" keep the momentum
    quantized: Adam8bit's docstring). No torch counterpart.
    """

    _rule = "lion"

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, maximize=False, state_dtype="f32"):
        super().__init__(params, _stored(dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize),
                                         state_dtype))


class LAMB(_DistoptOptimizer):
    """LAMB (You et al. 2020, as apex's FusedLAMB): the gradients' global norm
    clipped to max_grad_norm, Adam's moments, and each tensor's update scaled
    by the trust ratio ``||p|| / ||update||``.

    Arguments as apex's: lr, bias_correction, betas, eps, weight_decay (0.01;
    decoupled in adam_w_mode, else L2), amsgrad (refused, as apex),
    adam_w_mode, grad_averaging, set_grad_none, max_grad_norm, use_nvlamb.
    max_grad_norm, adam_w_mode and use_nvlamb are the optimizer's (as in
    apex): every parameter group uses the constructor's values.
    """

    _rule = "lamb"
    _OPTIMIZER_LEVEL = ("max_grad_norm", "adam_w_mode", "use_nvlamb")

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
                 amsgrad=False, adam_w_mode=True, grad_averaging=True, set_grad_none=True, max_grad_norm=1.0,
                 use_nvlamb=False):
        if amsgrad:
            raise RuntimeError("FusedLAMB does not support the AMSGrad variant.")
        self.set_grad_none = set_grad_none
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                                        weight_decay=weight_decay, grad_averaging=grad_averaging,
                                        max_grad_norm=max_grad_norm, adam_w_mode=adam_w_mode,
                                        use_nvlamb=use_nvlamb))

    def _options(self, group):
        # max_grad_norm, adam_w_mode and use_nvlamb are the optimizer's (apex
        # keeps them out of the groups): the first group carries them to the
        # C++ side; the others inherit them and may not set their own.
        opts = super()._options(group)
        if group is not self.param_groups[0]:
            for k in self._OPTIMIZER_LEVEL:
                opts.pop(k, None)
        return opts


class LARS(_DistoptOptimizer):
    """LARS (You et al. 2017, as timm's Lars): each tensor's gradient (plus
    ``wd*p``) scaled by ``trust_coeff * ||p|| / (||g|| + wd*||p|| + eps)``
    (trust_clip: at most lr), then SGD with momentum.

    Arguments as timm's: lr (1.0), momentum, dampening, weight_decay,
    nesterov, trust_coeff, eps, trust_clip, always_adapt.
    """

    _rule = "lars"

    def __init__(self, params, lr=1.0, momentum=0, dampening=0, weight_decay=0, nesterov=False, trust_coeff=0.001,
                 eps=1e-8, trust_clip=False, always_adapt=False):
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                        nesterov=nesterov, trust_coeff=trust_coeff, eps=eps, trust_clip=trust_clip,
                                        always_adapt=always_adapt))


class Adafactor(_DistoptOptimizer):
    """Adafactor (Shazeer & Stern 2018, as transformers'): the second moment of
    a matrix kept as its row and column means, the update's RMS clipped to
    clip_threshold, relative step sizes by default.

    Arguments as transformers': lr (None: relative steps), eps, clip_threshold,
    decay_rate, beta1 (None: no first moment), weight_decay, scale_parameter,
    relative_step, warmup_init.
    """

    _rule = "adafactor"

    def __init__(self, params, lr=None, eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8, beta1=None,
                 weight_decay=0.0, scale_parameter=True, relative_step=True, warmup_init=False):
        super().__init__(params, dict(lr=lr, eps=eps, clip_threshold=clip_threshold, decay_rate=decay_rate,
                                        beta1=beta1, weight_decay=weight_decay, scale_parameter=scale_parameter,
                                        relative_step=relative_step, warmup_init=warmup_init))


class Muon(_DistoptOptimizer):
    """Muon (torch.optim.Muon of torch 2.9): momentum, then the update
    orthogonalized by ns_steps Newton-Schulz iterations, scaled by
    adjust_lr_fn; decoupled weight decay. 2-D parameters only.

    Arguments as torch 2.9's: lr, weight_decay (0.1), momentum (0.95),
    nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn ("original" or
    "match_rms_adamw"); ns_dtype is distopt's: "float32" (the default) or
    "bfloat16" (torch's rounding, emulated).
    """

    _rule = "muon"

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=(3.4445, -4.775, 2.0315), eps=1e-7, ns_steps=5, adjust_lr_fn=None,
                 ns_dtype="float32"):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps,
                                        adjust_lr_fn=adjust_lr_fn or "original", ns_dtype=ns_dtype))


class Shampoo(_DistoptOptimizer):
    """Shampoo (Gupta et al. 2018, as torch-optimizer's): one preconditioner per
    dimension, ``L += G G^T``, the update ``L^(-1/2k) G R^(-1/2k)``, the inverse
    roots recomputed every update_freq steps.

    Arguments as torch-optimizer's: lr (0.1), momentum, weight_decay (L2),
    epsilon, update_freq; max_precond_dim is distopt's (dimensions above it
    are not preconditioned).
    """

    _rule = "shampoo"

    def __init__(self, params, lr=1e-1, momentum=0.0, weight_decay=0.0, epsilon=1e-4, update_freq=1,
                 max_precond_dim=4096):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, epsilon=epsilon,
                                        update_freq=update_freq, max_precond_dim=max_precond_dim))


class AdagradFull(_DistoptOptimizer):
    """Full-matrix Adagrad: ``G += g g^T`` over each block of the flattened
    tensor, ``p -= lr/(1 + (t-1)*lr_decay) * (G^(1/2) + eps*I)^-1 g``.

    Arguments: lr, lr_decay, weight_decay (L2), initial_accumulator_value,
    eps, block_size (0: the whole tensor), max_size, update_freq. No torch
    counterpart.
    """

    _rule = "adagrad_full"

    def __init__(self, params, lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10,
                 block_size=0, max_size=4096, update_freq=1):
        super().__init__(params, dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                                        initial_accumulator_value=initial_accumulator_value, eps=eps,
                                        block_size=block_size, max_size=max_size, update_freq=update_freq))


class Adam8bit(_DistoptOptimizer):
    """Adam with 8-bit state (bitsandbytes' ``Adam8bit``): ``Adam(...,
    state_dtype="int8")``. Both moments of every tensor of 4096 or more
    elements are kept as one byte per element (bitsandbytes' dynamic code)
    and one fp32 scale per block of 256 (docs/optimizers.md, "Quantized
    state"); smaller tensors keep fp32 state, as bitsandbytes'
    ``min_8bit_size``. ``state[p]`` holds ``exp_avg.codes`` (uint8) and
    ``exp_avg.absmax`` (float32) in place of ``exp_avg``, zero-copy;
    ``state_dict`` round-trips them, and a torch fp32 state_dict loads
    (quantized afresh). A group may set ``state_dtype`` ("f32" for an
    embedding, as bitsandbytes users do).

    ``state_dtype="bf16"`` (on Adam, AdamW, SGD, Lion) keeps every state
    tensor of the rule, whatever its size, as bfloat16 under its own key
    (``state[p]["exp_avg"].dtype == torch.bfloat16``): the step runs in fp32
    from those values and rounds the new state to nearest-even, as torch's
    ``.to(torch.bfloat16)``; torch's optimizers load such a state_dict.

    Arguments as torch's Adam: lr, betas, eps, weight_decay (L2), amsgrad,
    maximize. CPU tensors only.
    """

    _rule = "adam"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, *,
                 maximize=False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                                        maximize=maximize, state_dtype="int8"))


class AdamW8bit(_DistoptOptimizer):
    """AdamW with 8-bit state (bitsandbytes' ``AdamW8bit``, torchao's
    ``AdamW8bit``): ``AdamW(..., state_dtype="int8")``, blocks of 256; as
    Adam8bit otherwise. Arguments as torch's AdamW (weight_decay 1e-2)."""

    _rule = "adamw"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                                        maximize=maximize, state_dtype="int8"))


class AdamW4bit(_DistoptOptimizer):
    """AdamW with 4-bit state (torchao's ``AdamW4bit``): ``AdamW(...,
    state_dtype="int4")``: two codes per byte, blocks of 128, the first
    moment on the 4-bit dynamic code and the second on k/16 (no zero, so
    ``sqrt(v)`` never vanishes); as Adam8bit otherwise. Arguments as
    torch's AdamW (weight_decay 1e-2)."""

    _rule = "adamw"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                                        maximize=maximize, state_dtype="int4"))


__all__ = ["SGD", "Adam", "AdamW", "Adamax", "Adadelta", "Adagrad", "RMSprop", "NAdam", "RAdam", "Rprop", "ASGD",
           "Lion", "LAMB", "LARS", "Adafactor", "Muon", "Shampoo", "AdagradFull", "Adam8bit", "AdamW8bit", "AdamW4bit",
           "CPUOffload"]
