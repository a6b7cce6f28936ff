"""CPUOffload: ZeRO-Offload's optimizer (DeepSpeed's offload, torchao's
CPUOffloadOptimizer) with distopt's CPU rules. docs/python.md, "CPU offload".

The parameters and their gradients stay where the model has them (a GPU);
each parameter's fp32 master copy and its optimizer state live in host
memory (pinned where the parameter is on CUDA). Each gradient is copied to
the host as backward produces it (a hook on the parameter's gradient
accumulator; on CUDA, on a side stream, so the copies overlap the rest of
backward); the step checks that each gradient is still the one copied
(same tensor, same version: clipping or GradScaler's unscale_ after
backward change it, and it is copied again), runs the C++ rule over the
master copies (with ``threads`` threads), and copies the masters back into
the parameters in their dtype, enqueued on torch's stream without waiting.
The GPU holds no optimizer state at all.
"""

import weakref

import torch

_BUMPS = {}  # device -> whether the in-place ops below bump a gradient's version there


def _versions_bump(device):
    """Whether the in-place ops that change gradients after backward bump
    their version counter on ``device``: the foreach scaling of
    ``clip_grad_norm_`` and GradScaler's unscale. The hooks' copies are
    trusted only where they do (elsewhere the step copies every gradient,
    as with overlap=False)."""
    if device not in _BUMPS:
        t = torch.ones(2, device=device)
        bumps = True
        for op in ("mul", "unscale"):
            before = t._version
            try:
                if op == "mul":
                    torch._foreach_mul_([t], 0.5)
                else:
                    torch._amp_foreach_non_finite_check_and_unscale_([t], torch.zeros(1, device=device),
                                                                     torch.ones(1, device=device))
            except (AttributeError, RuntimeError, NotImplementedError):
                continue  # not on this device: nothing changes gradients with it here
            bumps = bumps and t._version != before
        _BUMPS[device] = bumps
    return _BUMPS[device]

from .. import _core
from ._base import DistoptOptimizer
from ._dropin import _DistoptOptimizer


class CPUOffload(_DistoptOptimizer):
    """Any distopt rule over fp32 master weights in host memory, for
    parameters on the GPU (or anywhere): ZeRO-Offload's optimizer.

    ``CPUOffload(params, optimizer="adamw", threads=1, **options)``: the
    rule by its distopt name (``distopt.torch.optim`` classes' rules:
    "sgd", "adam", "adamw", "lion", "lamb", ...; ``_core.rules()`` lists
    them) and its options with the rule's defaults (``lr=1e-3``,
    ``weight_decay=...`` as the matching class takes them). ``threads``: the
    CPU threads of one step.

    Each step: the gradients are copied to pinned host buffers (fp32), the
    rule steps the fp32 masters there, and the parameters take the masters'
    values (rounded to their dtype as ``Tensor.copy_`` rounds). The same bits
    as the rule on fp32 parameters with those gradients; for bf16/f16
    parameters, the same bits as the drop-in on them (which keeps the same
    fp32 masters). ``state[p]`` holds the rule's state and
    ``"master_param"``, all host tensors; ``state_dict`` carries them, so a
    resume continues from the fp32 masters.

    ``overlap=True``: each gradient is copied to the host as backward
    produces it (see the module's docstring); the step copies again any
    gradient changed since (the same bits either way). ``overlap=False``:
    every copy at the step. A change the version counter does not see --
    in place through ``p.grad.data`` -- is missed with overlap=True.

    The masters are taken from the parameters at the first step (or
    ``load_state_dict``) and are the truth from then on: change the
    parameters only through a state_dict loaded into the optimizer too.
    """

    _rule = None
    _overlap = True  # (a CPUOffload pickled before the option had it on)
    _step_supports_amp_scaling = False  # GradScaler unscales and skips itself (its standard path)

    def __init__(self, params, optimizer="adamw", threads=1, overlap=True, **options):
        if optimizer not in _core.rules():
            raise ValueError(f"CPUOffload: unknown optimizer '{optimizer}' (distopt's rules: "
                             f"{', '.join(_core.rules())})")
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise ValueError(f"CPUOffload: threads must be a positive integer, got {threads!r}")
        if not isinstance(overlap, bool):
            raise ValueError(f"CPUOffload: overlap must be True or False, got {overlap!r}")
        self._rule = optimizer
        self._threads = threads
        self._overlap = overlap
        known = {name: default for name, default, _ in _core.rule_options(optimizer)}
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise TypeError(f"CPUOffload: {optimizer} has no option {', '.join(map(repr, unknown))} "
                            f"(its options: {', '.join(known)})")
        super().__init__(params, dict(known, **options))
        self._hook_all()

    def _init_cpp_side(self):
        super()._init_cpp_side()
        self._masters = {}  # parameter index -> fp32 master in host memory
        self._host_grads = {}  # parameter index -> fp32 gradient buffer in host memory
        self._hooks = {}  # parameter index -> (hook handle, the accumulator it is on, kept alive)
        self._copied = {}  # parameter index -> (weakref to the gradient, its version, CUDA event or None) a hook copied
        self._copy_streams = {}  # CUDA device -> the side stream of the hooks' copies
        self._put_back = {}  # CUDA device -> event after the last step's copies into the parameters

    def __getstate__(self):  # a copy steps the same rule with as many threads (and hooks its own parameters)
        return dict(super().__getstate__(), _rule=self._rule, _threads=self._threads, _overlap=self._overlap)

    def __setstate__(self, state):
        super().__setstate__(state)
        self._hook_all()

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        self._hook_all()

    def _all_params(self):
        return [p for group in self.param_groups for p in group["params"]]

    def _hook_all(self):
        """A hook on each parameter's gradient accumulator that copies the
        gradient to the host once backward has accumulated it."""
        if not self._overlap or "_hooks" not in self.__dict__:  # (torch's __init__ adds the groups first)
            return
        me = weakref.ref(self)  # the hooks keep neither the optimizer nor the parameter alive
        for i, p in enumerate(self._all_params()):
            if i in self._hooks or not p.requires_grad:
                continue

            def ready(*_, i=i, param=weakref.ref(p)):
                opt, p = me(), param()
                if opt is not None and p is not None:
                    opt._grad_ready(i, p)

            if hasattr(p, "register_post_accumulate_grad_hook"):  # torch >= 2.1
                handle, accumulator = p.register_post_accumulate_grad_hook(ready), None
            else:  # torch 1.13: the accumulator node, which the parameter holds only weakly
                with torch.enable_grad():
                    accumulator = p.expand_as(p).grad_fn.next_functions[0][0]
                handle = accumulator.register_hook(ready)
            self._hooks[i] = (handle, accumulator)
            weakref.finalize(self, handle.remove)  # a dropped optimizer leaves no hook behind

    def zero_grad(self, *args, **kwargs):
        # No copy outlives the gradients it was made from (a copy still in
        # flight is waited for: the step may write the same buffer).
        for _, _, event in self._copied.values():
            if event is not None:
                event.synchronize()
        self._copied.clear()
        return super().zero_grad(*args, **kwargs)

    def _grad_ready(self, i, p):
        g = p.grad
        if g is None or g.is_sparse or g.shape != p.shape or g.device != p.device or not _versions_bump(g.device):
            return  # the step's checks say what is wrong, or copies it
        host = self._host_grads.get(i)
        if host is None:
            host = self._host_grads[i] = self._host(p)
        event = None
        if g.is_cuda:
            stream = self._copy_streams.get(g.device)
            if stream is None:
                stream = self._copy_streams[g.device] = torch.cuda.Stream(g.device)
            stream.wait_stream(torch.cuda.current_stream(g.device))  # backward wrote g there
            with torch.cuda.stream(stream):
                host.copy_(g, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            g.record_stream(stream)  # g's memory is not reused before the copy is done
        else:
            host.copy_(g)
        self._copied[i] = (weakref.ref(g), g._version, event)

    def _check_param(self, p, i):  # any rule runs on the CPU, for parameters on any devices
        DistoptOptimizer._check_param(self, p, i)

    def _host(self, p):
        return torch.empty(p.shape, dtype=torch.float32, pin_memory=p.is_cuda)

    def _storage(self, p, i):
        """The fp32 master the C++ step updates for parameter ``i``, made
        from ``p`` the first time."""
        master = self._masters.get(i)
        if master is None:
            master = self._masters[i] = self._host(p)
            master.copy_(p.detach())
            if i not in self._host_grads:
                self._host_grads[i] = self._host(p)
        return master

    def _alias(self, i):
        if not super()._alias(i):
            return False
        self.state[self._params[i]]["master_param"] = self._masters[i]
        return True

    def _push_state(self, loaded=None):
        for event in self._put_back.values():  # the last copies into the parameters read the masters
            event.synchronize()
        loaded = dict(self.state) if loaded is None else loaded
        super()._push_state({p: {k: v for k, v in s.items() if k != "master_param"} for p, s in loaded.items()})
        for i, p in enumerate(self._params):
            master = (loaded.get(p) or {}).get("master_param")
            self._masters[i].copy_(p.detach() if master is None else torch.as_tensor(master).reshape(p.shape))
            if self.state.get(p):
                self.state[p]["master_param"] = self._masters[i]

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._run_closure(closure)
        cpp = self._ensure_cpp()
        self._sync_options()
        # The last step's copies into the parameters are done before the
        # masters change again.
        for event in self._put_back.values():
            event.synchronize()
        masters, grads, events, again = [], [], [], []
        for i in range(len(self._params)):
            p, g = self._checked(i)
            masters.append(self._storage(p, i).data_ptr())
            copied = self._copied.pop(i, None)
            if copied is not None and copied[2] is not None:
                events.append(copied[2])  # done before the buffer is read, or written again
            if g is None:
                grads.append(0)
                continue
            if copied is None or copied[0]() is not g or copied[1] != g._version:
                again.append(i)  # no hook copied it, or it changed since (clipping, unscale_)
            grads.append(self._host_grads[i].data_ptr())
        self._copied.clear()
        for event in events:
            event.synchronize()
        for i in again:
            self._host_grads[i].copy_(self._params[i].grad, non_blocking=True)
        for device in {self._params[i].device for i in again if self._params[i].is_cuda}:
            torch.cuda.current_stream(device).synchronize()
        cpp.step(masters, grads)
        for i, p in enumerate(self._params):
            if grads[i]:
                p.copy_(self._masters[i], non_blocking=p.is_cuda)
        self._put_back = {}
        for device in {p.device for i, p in enumerate(self._params) if grads[i] and p.is_cuda}:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._put_back[device] = event
        if self._unaliased:
            self._unaliased = {i for i in self._unaliased if not self._alias(i)}
        return loss
