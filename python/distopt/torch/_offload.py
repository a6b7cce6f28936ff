"""CPUOffload: ZeRO-Offload's optimizer (DeepSpeed's offload, torchao's
CPUOffloadOptimizer) with distopt's CPU rules. docs/python.md, "CPU offload".

The parameters and their gradients stay where the model has them (a GPU);
each parameter's fp32 master copy and its optimizer state live in host
memory (pinned where the parameter is on CUDA). A step copies the gradients
to the host, runs the C++ rule over the master copies (with ``threads``
threads), and copies the masters back into the parameters in their dtype.
The GPU holds no optimizer state at all.
"""

import torch

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

    The masters are taken from the parameters at the first step (or
    ``load_state_dict``) and are the truth from then on: change the
    parameters only through a state_dict loaded into the optimizer too.
    """

    _rule = None
    _step_supports_amp_scaling = False  # GradScaler unscales and skips itself (its standard path)

    def __init__(self, params, optimizer="adamw", threads=1, **options):
        if optimizer not in _core.rules():
            raise ValueError(f"CPUOffload: unknown optimizer '{optimizer}' (distopt's rules: "
                             f"{', '.join(_core.rules())})")
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise ValueError(f"CPUOffload: threads must be a positive integer, got {threads!r}")
        self._rule = optimizer
        self._threads = threads
        known = {name: default for name, default, _ in _core.rule_options(optimizer)}
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise TypeError(f"CPUOffload: {optimizer} has no option {', '.join(map(repr, unknown))} "
                            f"(its options: {', '.join(known)})")
        super().__init__(params, dict(known, **options))

    def _init_cpp_side(self):
        super()._init_cpp_side()
        self._masters = {}  # parameter index -> fp32 master in host memory
        self._host_grads = {}  # parameter index -> fp32 gradient buffer in host memory

    def __getstate__(self):  # a copy steps the same rule with as many threads
        return dict(super().__getstate__(), _rule=self._rule, _threads=self._threads)

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
            self._host_grads[i] = self._host(p)
        return master

    def _alias(self, i):
        if not super()._alias(i):
            return False
        self.state[self._params[i]]["master_param"] = self._masters[i]
        return True

    def _push_state(self, loaded=None):
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
        masters, grads = [], []
        for i in range(len(self._params)):
            p, g = self._checked(i)
            masters.append(self._storage(p, i).data_ptr())
            if g is None:
                grads.append(0)
                continue
            self._host_grads[i].copy_(g, non_blocking=True)
            grads.append(self._host_grads[i].data_ptr())
        # The gradients, and the last step's copies into the parameters, complete.
        for device in {p.device for p in self._params if p.is_cuda}:
            torch.cuda.current_stream(device).synchronize()
        cpp.step(masters, grads)
        for i, p in enumerate(self._params):
            if grads[i]:
                p.copy_(self._masters[i], non_blocking=p.is_cuda)
        if self._unaliased:
            self._unaliased = {i for i in self._unaliased if not self._alias(i)}
        return loss
