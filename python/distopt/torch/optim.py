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
views of the C++ optimizer's memory (zero-copy), with ``step`` a 0-dim
float32 tensor as torch 1.13 keeps it. Parameters must be contiguous CPU
tensors of float32, bfloat16 or float16 (bf16/f16 get fp32 master weights,
``state[p]["master_param"]``); anything else is a one-line TypeError or
ValueError naming the parameter.

Keyword arguments torch has for its own implementations (``foreach``,
``fused``, ``capturable``, ``differentiable``) are accepted, kept in the
groups as torch keeps them, and have no effect: distopt has one
implementation.
"""

import torch

from .. import _core
from ._base import DistoptOptimizer

_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
_TORCH_ONLY = ("foreach", "fused", "capturable", "differentiable")


class _DistoptOptimizer(DistoptOptimizer):
    """Base of the drop-ins: subclasses set ``_rule`` and call
    ``super().__init__(params, defaults)``."""

    _rule = None
    _dtypes = tuple(_DTYPES)

    def __init__(self, params, defaults):
        self._cpp = None  # the C++ optimizer, made at the first step
        self._params = []  # parameters in the C++ optimizer's order
        self._shapes = []  # (dtype, numel) of each, as the C++ optimizer has them
        self._synced = []  # per group: the option values the C++ side has
        self._unaliased = set()  # parameter indices whose state has no torch view yet
        known = {name for name, _, _ in _core.rule_options(self._rule)}
        self._known = known
        super().__init__(params, defaults)

    # ---- checks ----
    def _label(self, p, i=None):
        return super()._label(p, self._index_of(p) if i is None else i)

    def _index_of(self, p):
        for i, q in enumerate(self._params):
            if q is p:
                return i
        n = sum(len(g["params"]) for g in self.param_groups)
        return n

    def add_param_group(self, param_group):
        first = sum(len(g["params"]) for g in self.param_groups)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for k, p in enumerate(group["params"]):
            self._check_param(p, first + k)
        if self._cpp is not None:
            self._cpp.add_group(self._tuples(group["params"], first), self._options(group))
            self._params.extend(group["params"])
            self._shapes.extend((p.dtype, p.numel()) for p in group["params"])
            self._synced.append(self._options(group))

    # ---- the C++ side ----
    def _options(self, group):
        return {k: v for k, v in group.items() if k in self._known}

    def _tuples(self, params, first):
        return [(f"params[{first + k}]", p.data_ptr(), _DTYPES[p.dtype], list(p.shape)) for k, p in enumerate(params)]

    def _ensure_cpp(self):
        if self._cpp is None:
            g0 = self.param_groups[0]
            self._cpp = _core.Optimizer(self._rule, self._tuples(g0["params"], 0), self._options(g0))
            self._params = list(g0["params"])
            self._synced = [self._options(g0)]
            for group in self.param_groups[1:]:
                self._cpp.add_group(self._tuples(group["params"], len(self._params)), self._options(group))
                self._params.extend(group["params"])
                self._synced.append(self._options(group))
            self._unaliased = set(range(len(self._params)))
            self._shapes = [(p.dtype, p.numel()) for p in self._params]
        return self._cpp

    def _sync_options(self):
        relayout = False
        for g, group in enumerate(self.param_groups):
            for k, v in self._changed_options(group, self._synced[g]):
                self._cpp.set_option(g, k, v)
                relayout = relayout or k != "lr"
        if relayout:  # a changed option may change which state tensors exist
            self._unaliased = set(range(len(self._params)))

    def _alias(self, i):
        views = self._cpp.state(i)
        if not views:
            return False
        self.state[self._params[i]] = {k: torch.from_numpy(v) for k, v in views.items()}
        return True

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._run_closure(closure)
        cpp = self._ensure_cpp()
        self._sync_options()
        addresses, grads, keep = [], [], []
        for i, p in enumerate(self._params):
            if (p.dtype, p.numel()) != self._shapes[i] or not p.is_contiguous():
                raise ValueError(f"{self._label(p, i)} changed dtype, size or layout since the optimizer took it "
                                 f"(it has {self._shapes[i][1]} elements of {self._shapes[i][0]}); make the optimizer "
                                 "after model.to(...)")
            addresses.append(p.data_ptr())
            g = p.grad
            if g is None:
                grads.append(0)
                continue
            if g.is_sparse:
                raise ValueError(f"{type(self).__name__} does not support sparse gradients ({self._label(p, i)})")
            if g.dtype != p.dtype or g.shape != p.shape:
                raise TypeError(f"{self._label(p, i)}: its gradient is {g.dtype} {tuple(g.shape)}")
            if not g.is_contiguous():  # handled as torch handles it: on a contiguous copy
                g = g.contiguous()
                keep.append(g)
            grads.append(g.data_ptr())
        cpp.step(addresses, grads)
        if self._unaliased:
            self._unaliased = {i for i in self._unaliased if not self._alias(i)}
        return loss

    # ---- state_dict ----
    def load_state_dict(self, state_dict):
        """torch's load (validation, group options), then the saved state is
        copied into the C++ optimizer's own memory, which ``state`` views."""
        super().load_state_dict(state_dict)
        loaded = dict(self.state)
        cpp = self._ensure_cpp()
        self._sync_options()
        for i, p in enumerate(self._params):
            saved = loaded.get(p)
            if not saved:
                continue
            cpp.init_state(i)
            for key, view in cpp.state(i).items():
                if key not in saved or saved[key] is None:
                    if key == "master_param":  # saved by torch: the parameter itself is the value
                        view[...] = p.detach().float().numpy().reshape(view.shape)
                        continue
                    raise ValueError(f"{self._label(p, i)}: the loaded state lacks '{key}'")
                value = torch.as_tensor(saved[key]).detach().to(torch.float32)
                if value.numel() != view.size:
                    raise ValueError(f"{self._label(p, i)}: loaded '{key}' has {value.numel()} elements, it needs {view.size}")
                torch.from_numpy(view).copy_(value.reshape(view.shape))
            self._alias(i)
            self._unaliased.discard(i)
        cpp.state_written()  # LAMB's group step count follows the loaded "step"


class SGD(_DistoptOptimizer):
    _rule = "sgd"

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False, *, maximize=False,
                 foreach=None, differentiable=False, fused=None):
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                        nesterov=nesterov, maximize=maximize, foreach=foreach,
                                        differentiable=differentiable, fused=fused))


class Adam(_DistoptOptimizer):
    _rule = "adam"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False, fused=None,
                 decoupled_weight_decay=False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                                        maximize=maximize, foreach=foreach, capturable=capturable,
                                        differentiable=differentiable, fused=fused,
                                        decoupled_weight_decay=decoupled_weight_decay))


class AdamW(_DistoptOptimizer):
    _rule = "adamw"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                                        maximize=maximize, foreach=foreach, capturable=capturable,
                                        differentiable=differentiable, fused=fused))


class Adamax(_DistoptOptimizer):
    _rule = "adamax"

    def __init__(self, params, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, foreach=None, *,
                 maximize=False, differentiable=False, capturable=False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=foreach,
                                        maximize=maximize, differentiable=differentiable, capturable=capturable))


class Adadelta(_DistoptOptimizer):
    _rule = "adadelta"

    def __init__(self, params, lr=1.0, rho=0.9, eps=1e-6, weight_decay=0, foreach=None, *, maximize=False,
                 differentiable=False, capturable=False):
        super().__init__(params, dict(lr=lr, rho=rho, eps=eps, weight_decay=weight_decay, foreach=foreach,
                                        maximize=maximize, differentiable=differentiable, capturable=capturable))


class Adagrad(_DistoptOptimizer):
    _rule = "adagrad"

    def __init__(self, params, lr=1e-2, lr_decay=0, weight_decay=0, initial_accumulator_value=0, eps=1e-10,
                 foreach=None, *, maximize=False, differentiable=False, fused=None):
        super().__init__(params, dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                                        initial_accumulator_value=initial_accumulator_value, eps=eps,
                                        foreach=foreach, maximize=maximize, differentiable=differentiable,
                                        fused=fused))


class RMSprop(_DistoptOptimizer):
    _rule = "rmsprop"

    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0, centered=False,
                 foreach=None, maximize=False, differentiable=False, capturable=False):
        super().__init__(params, dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum,
                                        centered=centered, foreach=foreach, maximize=maximize,
                                        differentiable=differentiable, capturable=capturable))


class NAdam(_DistoptOptimizer):
    _rule = "nadam"

    def __init__(self, params, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, momentum_decay=4e-3,
                 foreach=None, *, decoupled_weight_decay=False, maximize=False, capturable=False,
                 differentiable=False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                        momentum_decay=momentum_decay, foreach=foreach,
                                        decoupled_weight_decay=decoupled_weight_decay, maximize=maximize,
                                        capturable=capturable, differentiable=differentiable))


class RAdam(_DistoptOptimizer):
    _rule = "radam"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, foreach=None, *,
                 decoupled_weight_decay=False, maximize=False, capturable=False, differentiable=False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=foreach,
                                        decoupled_weight_decay=decoupled_weight_decay, maximize=maximize,
                                        capturable=capturable, differentiable=differentiable))


class Rprop(_DistoptOptimizer):
    _rule = "rprop"

    def __init__(self, params, lr=1e-2, etas=(0.5, 1.2), step_sizes=(1e-6, 50), foreach=None, maximize=False, *,
                 capturable=False, differentiable=False):
        super().__init__(params, dict(lr=lr, etas=etas, step_sizes=step_sizes, foreach=foreach, maximize=maximize,
                                        capturable=capturable, differentiable=differentiable))


class ASGD(_DistoptOptimizer):
    _rule = "asgd"

    def __init__(self, params, lr=1e-2, lambd=1e-4, alpha=0.75, t0=1e6, weight_decay=0, foreach=None,
                 maximize=False, differentiable=False, capturable=False):
        super().__init__(params, dict(lr=lr, lambd=lambd, alpha=alpha, t0=t0, weight_decay=weight_decay,
                                        foreach=foreach, maximize=maximize, differentiable=differentiable,
                                        capturable=capturable))


class Lion(_DistoptOptimizer):
    """lion-pytorch's Lion (Chen et al. 2023)."""

    _rule = "lion"

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, maximize=False):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize))


class LAMB(_DistoptOptimizer):
    """apex's FusedLAMB (max_grad_norm is the optimizer's, as in apex)."""

    _rule = "lamb"

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
        # max_grad_norm is the optimizer's (apex reads self.defaults): the
        # first group carries it to the C++ side, the others may not.
        opts = super()._options(group)
        if group is not self.param_groups[0]:
            opts.pop("max_grad_norm", None)
        return opts


class LARS(_DistoptOptimizer):
    """timm's Lars."""

    _rule = "lars"

    def __init__(self, params, lr=1.0, momentum=0, dampening=0, weight_decay=0, nesterov=False, trust_coeff=0.001,
                 eps=1e-8, trust_clip=False, always_adapt=False):
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                        nesterov=nesterov, trust_coeff=trust_coeff, eps=eps, trust_clip=trust_clip,
                                        always_adapt=always_adapt))


class Adafactor(_DistoptOptimizer):
    """transformers' Adafactor."""

    _rule = "adafactor"

    def __init__(self, params, lr=None, eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8, beta1=None,
                 weight_decay=0.0, scale_parameter=True, relative_step=True, warmup_init=False):
        super().__init__(params, dict(lr=lr, eps=eps, clip_threshold=clip_threshold, decay_rate=decay_rate,
                                        beta1=beta1, weight_decay=weight_decay, scale_parameter=scale_parameter,
                                        relative_step=relative_step, warmup_init=warmup_init))


class Muon(_DistoptOptimizer):
    """torch.optim.Muon (torch 2.9): 2-D parameters only. ns_dtype:
    "float32" (distopt's default) or "bfloat16" (torch's rounding)."""

    _rule = "muon"

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=(3.4445, -4.775, 2.0315), eps=1e-7, ns_steps=5, adjust_lr_fn=None,
                 ns_dtype="float32"):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps,
                                        adjust_lr_fn=adjust_lr_fn or "original", ns_dtype=ns_dtype))


class Shampoo(_DistoptOptimizer):
    """torch-optimizer's Shampoo (max_precond_dim bounds the preconditioners)."""

    _rule = "shampoo"

    def __init__(self, params, lr=1e-1, momentum=0.0, weight_decay=0.0, epsilon=1e-4, update_freq=1,
                 max_precond_dim=4096):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, epsilon=epsilon,
                                        update_freq=update_freq, max_precond_dim=max_precond_dim))


__all__ = ["SGD", "Adam", "AdamW", "Adamax", "Adadelta", "Adagrad", "RMSprop", "NAdam", "RAdam", "Rprop", "ASGD",
           "Lion", "LAMB", "LARS", "Adafactor", "Muon", "Shampoo"]
