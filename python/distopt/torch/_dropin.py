"""The base of the drop-ins in optim.py: a torch.optim.Optimizer whose step
is one call of a C++ Optimizer over the parameters' own memory, with
torch's protocol around it (construction-time checks, state_dict formats,
copies, complex and non-contiguous parameters). docs/python.md."""

import contextlib
import functools
import inspect

import torch

from .. import _core
from ._base import DistoptOptimizer

_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
_TORCH_ONLY = ("foreach", "fused", "capturable", "differentiable")
# The drop-ins named after torch's classes: the installed torch's constructor
# checks their arguments.
_TORCH_NAMED = ("SGD", "Adam", "AdamW", "Adamax", "Adadelta", "Adagrad", "RMSprop", "NAdam", "RAdam", "Rprop",
                "ASGD")


def _torch_default(name, arg, otherwise):
    """The default of ``arg`` in the installed torch's ``torch.optim.<name>``
    (so a signature follows the torch at hand), or ``otherwise``."""
    cls = getattr(torch.optim, name, None)
    if cls is None:
        return otherwise
    p = inspect.signature(cls.__init__).parameters.get(arg)
    return otherwise if p is None or p.default is inspect.Parameter.empty else p.default


@functools.lru_cache(maxsize=None)
def _torch_keeps_int_step(name):
    """Whether the installed torch keeps ``state["step"]`` of
    ``torch.optim.<name>`` as a Python number (torch 1.13's Adadelta,
    RMSprop and Rprop) rather than a tensor: one step of torch's own
    optimizer on one element says, once, at the first state_dict()."""
    cls = getattr(torch.optim, name, None) if name in _TORCH_NAMED else None
    if cls is None:
        return False
    p = torch.zeros(1, requires_grad=True)
    p.grad = torch.ones(1)
    opt = cls([p], lr=1e-3)
    opt.step()
    return isinstance(opt.state[p].get("step"), (int, float))


def _floats(t):
    """A saved tensor as a flat float32 numpy array on the host."""
    return torch.as_tensor(t).detach().to(device="cpu", dtype=torch.float32).contiguous().reshape(-1).numpy()


# The element types of the C++ side's device views (python/src/module.cpp).
_TYPESTRS = {"<f4": torch.float32, "<i2": torch.int16, "|u1": torch.uint8}


class _DeviceArray:
    """Device memory of the C++ optimizer as torch takes it zero-copy
    (``__cuda_array_interface__``); holds the C++ optimizer, as the numpy
    base does for host state."""

    __slots__ = ("__cuda_array_interface__", "_owner")

    def __init__(self, address, shape, typestr, owner):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr, "data": (address, False),
                                         "strides": None, "version": 2}
        self._owner = owner


def _listed(params):
    """``params`` as a list whose groups' parameters are lists too, so that
    reading it twice finds them (a tensor, or None, as it is: torch's own
    errors name it)."""
    if params is None or isinstance(params, torch.Tensor):
        return params
    out = []
    for g in params:
        if isinstance(g, dict) and not isinstance(g.get("params"), (torch.Tensor, list, tuple)):
            g = dict(g, params=list(g["params"]))
        out.append(g)
    return out


class _DistoptOptimizer(DistoptOptimizer):
    """Base of the drop-ins: subclasses set ``_rule`` and call
    ``super().__init__(params, defaults)``."""

    _rule = None
    _dtypes = tuple(_DTYPES)
    _devices = ("cpu", "cuda")
    _contiguous = False  # a non-contiguous parameter steps through a contiguous copy (_storage)
    _none_state = ()  # state keys torch sets to None for a stepped parameter without state
    _step_supports_amp_scaling = True  # GradScaler hands found_inf (and the scale) to step(): _amp
    _threads = 1  # CPU threads of the C++ step

    def __init__(self, params, defaults):
        self._init_cpp_side()
        params = self._check_arguments(params, defaults)
        super().__init__(params, defaults)

    def _init_cpp_side(self):
        self._cpp = None  # the C++ optimizer, made at the first step
        self._params = []  # parameters in the C++ optimizer's order
        self._shapes = []  # (dtype, numel) of each, as the C++ optimizer has them
        self._synced = []  # per group: the option values the C++ side has
        self._unaliased = set()  # parameter indices whose state has no torch view yet
        self._staged = {}  # parameter index -> contiguous copy of a non-contiguous parameter
        self._found_inf = None  # GradScaler's flag the last device step read (kept alive for it)
        self._known = {name for name, _, _ in _core.rule_options(self._rule)}

    def _check_arguments(self, params, defaults):
        """The constructor's checks, before the parameters are looked at (as
        torch's): the installed torch's own class checks what it has (its
        ValueErrors and wording: "Invalid learning rate: -1.0"), the C++
        rule the rest; then what distopt cannot do is refused in one line.
        Returns ``params``, made a list where torch's checks read it."""
        name = type(self).__name__
        cls = getattr(torch.optim, name, None) if name in _TORCH_NAMED else None
        if cls is not None:
            accepted = inspect.signature(cls.__init__).parameters
            for flag in _TORCH_ONLY:  # the installed torch's implementation flags, as it takes them
                if defaults.get(flag) and flag not in accepted:
                    raise TypeError(f"{name}.__init__() got an unexpected keyword argument '{flag}'")
            kwargs = {k: v for k, v in defaults.items() if k in accepted}
            # torch's fused and capturable checks read the parameters; the
            # others do not, and a stand-in keeps the caller's iterator whole.
            if kwargs.get("fused") or kwargs.get("capturable"):
                probe = params = _listed(params)
            else:
                probe = [torch.zeros(1, requires_grad=True)]
            cls(probe, **kwargs)
        _core.check_options(self._rule, {k: v for k, v in defaults.items() if k in self._known})
        if defaults.get("differentiable"):
            raise ValueError(f"{name}: differentiable=True is not supported (distopt's step is one C++ call outside "
                             f"autograd); use torch.optim.{name} for a differentiable step")
        if defaults.get("capturable"):
            raise ValueError(f"{name}: capturable=True (a step inside a CUDA graph) is not supported: distopt's step "
                             "makes its coefficients on the host (docs/gpu.md)")
        return params

    # ---- copies: deepcopy, pickle, torch.save, load_state_dict ----
    def __getstate__(self):
        """torch's (defaults, state, param_groups) and every public attribute
        (LAMB's set_grad_none): a copy has what the original shows. The C++
        side stays behind (see __setstate__)."""
        self._settle()
        state = super().__getstate__()
        state.update({k: v for k, v in self.__dict__.items() if not k.startswith("_")})
        return state

    def __setstate__(self, state):
        """torch's, then every group gets the options an older state_dict
        (or torch's) lacks from the defaults (torch's classes do the same
        with setdefault). A copy (deepcopy, pickle) has no C++ side yet: it
        is made at the next step from the copied ``state``."""
        own = set(state.get("defaults", self.__dict__.get("defaults", {})))  # before torch adds 'differentiable'
        super().__setstate__(state)
        for group in self.param_groups:
            for k in own:
                group.setdefault(k, self.defaults[k])
        if "_cpp" not in self.__dict__:
            self._init_cpp_side()

    # ---- checks ----
    def _check_param(self, p, i):
        if p.dtype == torch.complex64 and not p.is_sparse:
            if _core.locality(self._rule) != "pointwise":
                raise TypeError(f"{self._label(p, i)} is complex; {self._rule} is not pointwise, so it steps only "
                                "real tensors (pass torch.view_as_real(p) if its pairs are what you mean)")
            p = torch.view_as_real(p)
        super()._check_param(p, i)
        if p.device.type == "cuda":
            why = _core.why_rule_cannot_run(self._rule, "cuda")
            if why:
                raise ValueError(f"{self._label(p, i)} is on {p.device}, but {why}")
        first = self._device()
        if p.device != first:
            raise ValueError(f"{self._label(p, i)} is on {p.device}, the first parameter on {first}; one optimizer "
                             "steps parameters on one device (make one per device)")

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
        if isinstance(param_group, dict) and "state_dtype" in param_group:  # refused before the group is added
            _core.check_options(self._rule, {"state_dtype": param_group["state_dtype"]})
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group.get("state_dtype") == "bf16" and any(p.is_complex() for p in group["params"]):
            self.param_groups.pop()
            raise ValueError(f"{type(self).__name__}: state_dtype bf16 with a complex parameter: its state would be "
                             "real bf16 pairs, which torch's optimizers cannot load (use state_dtype f32 for its group)")
        for k, p in enumerate(group["params"]):
            self._check_param(p, first + k)
        if self._cpp is not None:
            with self._on_device():
                self._wait_for_torch()  # a rule with eager state (Adagrad) reads the parameters now
                self._cpp.add_group(self._tuples(group["params"], first), self._options(group))
            self._track(group)

    # ---- the C++ side ----
    def _options(self, group):
        # state_dtype goes to the C++ side for every rule, which refuses a
        # quantized storage for a rule that keeps no quantizable state.
        # A group without it keeps fp32 state (torch's), whatever group 0 keeps.
        out = {k: v for k, v in group.items() if k in self._known or k == "state_dtype"}
        if "state_dtype" in self._known:
            out.setdefault("state_dtype", "f32")
        return out

    def _tuples(self, params, first):
        out = []
        for k, p in enumerate(params):
            t = self._storage(p, first + k)
            out.append((f"params[{first + k}]", t.data_ptr(), _DTYPES[t.dtype], list(t.shape), t.device.type))
        return out

    def _device(self):
        """The device of every parameter (checked as they are added; the
        CPU where there are none)."""
        first = next((p for g in self.param_groups for p in g["params"]), None)
        return torch.device("cpu") if first is None else first.device

    def _on_device(self):
        """Where the C++ side's calls run: on a CUDA parameter's device (its
        memory is allocated there), else nowhere in particular."""
        device = self._device()
        return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()

    def _wait_for_torch(self):
        """Before the C++ side makes state outside a step: torch's work on the
        parameters (and on the copies of non-contiguous ones) is done, since
        the state's first values are read from them on another stream."""
        if self._device().type == "cuda":
            torch.cuda.current_stream().synchronize()

    def _storage(self, p, i):
        """The memory the C++ step updates for parameter ``i``: ``p`` itself
        (a complex ``p`` as its real view, as torch's pointwise rules step
        it), or for a non-contiguous ``p`` (a view, as torch's tests make) a
        contiguous copy the step fills from ``p`` and writes back."""
        if p.is_contiguous():
            self._staged.pop(i, None)
            return torch.view_as_real(p) if p.is_complex() else p
        buf = self._staged.get(i)
        if buf is None or buf.shape != p.shape or buf.dtype != p.dtype or buf.device != p.device:
            buf = self._staged[i] = torch.empty(p.shape, dtype=p.dtype, device=p.device)
        with torch.no_grad():
            buf.copy_(p)
        return torch.view_as_real(buf) if buf.is_complex() else buf

    def _ensure_cpp(self, loaded=None):
        if self._cpp is None:
            with self._on_device():
                self._make_cpp(loaded)
        return self._cpp

    def _make_cpp(self, loaded):
        g0 = self.param_groups[0]
        self._wait_for_torch()
        self._cpp = _core.Optimizer(self._rule, self._tuples(g0["params"], 0), self._options(g0), self._threads)
        self._track(g0)
        for group in self.param_groups[1:]:
            self._cpp.add_group(self._tuples(group["params"], len(self._params)), self._options(group))
            self._track(group)
        if self.state:  # loaded, or a copy's: into the C++ optimizer's memory
            self._push_state(loaded)

    def _state_dtype(self, i):
        """The state_dtype of parameter ``i``'s group."""
        for group in self.param_groups:
            if any(q is self._params[i] for q in group["params"]):
                return group.get("state_dtype", "f32")
        return "f32"

    def _track(self, group):
        """Records a group the C++ side has just taken: its parameters in
        order, their (dtype, numel), its options as sent, and that their
        state has no torch view yet."""
        first = len(self._params)
        self._params.extend(group["params"])
        self._shapes.extend((p.dtype, p.numel(), p.device) for p in group["params"])
        self._synced.append(self._options(group))
        self._unaliased.update(range(first, len(self._params)))

    def _sync_options(self):
        relayout = False
        for g, group in enumerate(self.param_groups):
            sent = self._send_changed_options(self._options(group), self._synced[g],
                                              functools.partial(self._cpp.set_option, g))
            relayout = relayout or any(k != "lr" for k in sent)
        if relayout:  # a changed option may change which state tensors exist
            self._unaliased = set(range(len(self._params)))

    def _views(self, i):
        """Parameter i's C++ state as torch tensors viewing its memory (host
        or device), by torch key."""
        out = {}
        for k, v in self._cpp.state(i).items():
            if isinstance(v, tuple):  # device memory: (address, shape, typestr)
                address, shape, typestr = v
                device = self._params[i].device
                if 0 in shape:  # no memory (address 0, which torch before 2.1 refuses to view)
                    out[k] = torch.empty(shape, dtype=_TYPESTRS[typestr], device=device)
                else:
                    out[k] = torch.as_tensor(_DeviceArray(address, shape, typestr, self._cpp), device=device)
            else:
                out[k] = torch.from_numpy(v)
            if out[k].dtype == torch.int16:  # bf16 state: its bits
                out[k] = out[k].view(torch.bfloat16)
        return out

    def _alias(self, i):
        state = self._views(i)
        if not state:
            return False
        p = self._params[i]
        if p.is_complex():  # a complex parameter's state, complex as torch's (views of the real pairs)
            state = {k: torch.view_as_complex(v) if v.dim() > 0 and v.shape[-1] == 2 and v.numel() == 2 * p.numel()
                     and v.dtype == torch.float32 else v for k, v in state.items()}  # (bf16 state stays real)
        self.state[p] = state
        return True

    def _settle(self):
        """A step GradScaler skipped on the device, once its flag is read: its
        "step" and scalars put back, and the state it made gone again (as
        if it had not run, which is what torch shows)."""
        cpp = self.__dict__.get("_cpp")
        if cpp is None:
            return
        cpp.settle_skipped_step()
        for i, p in enumerate(self._params):
            if self.state.get(p) and not cpp.has_state(i):
                del self.state[p]
                self._unaliased.add(i)

    def _checked(self, i):
        """Parameter i and its gradient (or None), after the checks of every
        step: still what the optimizer took, a dense gradient."""
        p = self._params[i]
        if (p.dtype, p.numel(), p.device) != self._shapes[i]:
            raise ValueError(f"{self._label(p, i)} changed dtype, size or device since the optimizer took it "
                             f"(it has {self._shapes[i][1]} elements of {self._shapes[i][0]} on "
                             f"{self._shapes[i][2]}); make the optimizer after model.to(...)")
        g = p.grad
        if g is not None and g.is_sparse:
            raise ValueError(f"{type(self).__name__} does not support sparse gradients ({self._label(p, i)})")
        return p, g

    def _amp(self, scaler):
        """GradScaler's protocol (``_step_supports_amp_scaling``): the
        gradients unscaled as torch's ``unscale_`` unscales them (times the
        reciprocal of the scale, computed in float64), and found_inf, a
        float32 tensor that is not 0 when a gradient has an inf or NaN; None
        when no GradScaler drives this step. torch 1.13 passes itself as
        ``grad_scaler``; torch 2.x sets ``found_inf`` and ``grad_scale``
        (None once the user has unscaled) on the optimizer around the step."""
        if scaler is not None:
            state = scaler._per_optimizer_states[id(self)]
            if state["stage"].name == "READY":
                scaler.unscale_(self)
            found = None
            for f in state["found_inf_per_device"].values():
                found = f if found is None else found + f.to(found.device)
            return found
        found_inf = getattr(self, "found_inf", None)
        if not torch.is_tensor(found_inf):  # no scaler, or one that found no gradients (torch sums none to 0)
            return None
        scale = getattr(self, "grad_scale", None)
        if scale is None:
            return found_inf
        inv = scale.double().reciprocal().float()
        by_device = {}
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    by_device.setdefault(p.grad.device, []).append(p.grad)
        for device, grads in by_device.items():
            inv_here = inv.to(device)
            try:  # torch's own unscale (CUDA; CPU from torch 2.3)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, torch.zeros_like(inv_here), inv_here)
            except (RuntimeError, NotImplementedError):
                for grad in grads:
                    grad.mul_(inv_here)
        return found_inf

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        """One step of every parameter with a gradient (``closure``: as
        torch's). Under ``torch.cuda.amp.GradScaler`` (``scaler.step(opt)``)
        a step whose gradients hold an inf or NaN changes nothing, read on
        the device for CUDA parameters (no host synchronisation), as with
        torch's fused optimizers."""
        scaler = kwargs.pop("grad_scaler", None)
        if kwargs:
            raise TypeError(f"step() got an unexpected keyword argument '{next(iter(kwargs))}'")
        loss = self._run_closure(closure)
        found_inf = self._amp(scaler)
        cpp = self._ensure_cpp()
        self._sync_options()
        on_cuda = self._device().type == "cuda"
        if found_inf is not None and not on_cuda and found_inf.item():
            return loss  # on the CPU the flag costs nothing to read
        addresses, grads, keep = [], [], []
        for i in range(len(self._params)):
            p, g = self._checked(i)
            addresses.append(self._storage(p, i).data_ptr())
            if g is None:
                grads.append(0)
                continue
            if g.dtype != p.dtype or g.shape != p.shape:
                raise TypeError(f"{self._label(p, i)}: its gradient is {g.dtype} {tuple(g.shape)}")
            if not g.is_contiguous():  # handled as torch handles it: on a contiguous copy
                g = g.contiguous()
                keep.append(g)
            grads.append((torch.view_as_real(g) if g.is_complex() else g).data_ptr())
        with self._on_device():
            if on_cuda:  # enqueued on torch's stream, ordered with its kernels
                cpp.set_cuda_stream(torch.cuda.current_stream().cuda_stream)
                if found_inf is not None:  # read by the kernels, on the device
                    self._found_inf = found_inf.to(device=self._device(), dtype=torch.float32).reshape(())
                    cpp.skip_next_step_if(self._found_inf.data_ptr())
            cpp.step(addresses, grads)
        for i, buf in self._staged.items():
            self._params[i].copy_(buf)
        if self._unaliased:
            self._unaliased = {i for i in self._unaliased if not self._alias(i)}
            for i in self._unaliased:  # stepped without state: torch's entries (SGD's momentum_buffer None)
                if grads[i] and self._none_state and not self.state.get(self._params[i]):
                    self.state[self._params[i]] = dict.fromkeys(self._none_state)
        return loss

    # ---- state_dict ----
    def state_dict(self):
        """torch's; ``step`` a number where the installed torch keeps one."""
        self._settle()
        sd = super().state_dict()
        if _torch_keeps_int_step(type(self).__name__):
            sd["state"] = {k: dict(v) for k, v in sd["state"].items()}
            for entries in sd["state"].values():
                if torch.is_tensor(entries.get("step")):
                    entries["step"] = int(entries["step"].item())
        return sd

    def load_state_dict(self, state_dict):
        """torch's load (validation, group options; an older format's missing
        options from the defaults), then the saved state is copied into the
        C++ optimizer's own memory, which ``state`` views. The values copied
        are the saved ones as saved: torch's load casts them to the
        parameter's dtype, which for a bf16/f16 parameter would round its
        fp32 master weights and moments."""
        storage = [g.get("state_dtype") for g in self.param_groups]  # a group's storage is fixed: kept
        super().load_state_dict(state_dict)
        for group, kept in zip(self.param_groups, storage):
            if kept is None:
                group.pop("state_dtype", None)
            else:
                group["state_dtype"] = kept
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        originals = {p: state_dict["state"][i] for i, p in zip(saved, params) if i in state_dict["state"]}
        if self._cpp is None:
            self._ensure_cpp(originals)  # takes the loaded state
        else:
            with self._on_device():
                self._push_state(originals)

    def _push_state(self, loaded=None):
        loaded = dict(self.state) if loaded is None else loaded
        cpp = self._cpp
        self._sync_options()
        self._wait_for_torch()  # the C++ side fills new state on its own stream, from the parameters
        for i, p in enumerate(self._params):
            saved = loaded.get(p)
            if not saved:  # as torch: no entry, no state; the next step starts it afresh
                if cpp.has_state(i):
                    cpp.reset_state(i)
                    if not self._alias(i):  # an eager-state rule (Adagrad) has its fresh state now
                        self._unaliased.add(i)
                continue
            cpp.init_state(i)
            views = self._views(i)
            fresh = {}  # quantized state saved as fp32 values (torch's, a distopt f32 run's or sharded optimizer's)
            for key, view in views.items():
                base, _, part = key.rpartition(".")
                if view.dtype == torch.bfloat16 and saved.get(key) is not None:  # rounded by the C++ side, as a step
                    fresh[key] = None
                    continue
                if part in ("codes", "absmax") and saved.get(base + ".codes") is None and saved.get(base) is not None:
                    if part == "codes":  # with the saved scales, which quantize_state classifies
                        fresh[base] = saved.get(base + ".absmax")
                    continue
                if part == "codes":  # a quantized state's bytes, as saved
                    value = torch.as_tensor(saved[key]).detach() if saved.get(key) is not None else None
                    if value is None or value.dtype != torch.uint8 or value.numel() != view.numel():
                        raise ValueError(f"{self._label(p, i)}: loaded '{key}' must be {view.numel()} uint8 codes "
                                         f"of this group's state_dtype {self._state_dtype(i)} (got "
                                         f"{None if value is None else (value.dtype, value.numel())}; another "
                                         "state_dtype's state loads as fp32 values)")
                    view.copy_(value.reshape(view.shape))
                    continue
                if key not in saved or saved[key] is None:
                    if key == "master_param":  # saved by torch: the parameter itself is the value
                        view.copy_(p.detach().float().reshape(view.shape))
                        continue
                    if saved.get(key + ".codes") is not None:  # int8/int4 codes into bf16 storage
                        raise ValueError(f"{self._label(p, i)}: loaded '{key}' is another state_dtype's codes "
                                         f"('{key}.codes'); this group's state_dtype {self._state_dtype(i)} loads "
                                         "fp32 or bf16 values")
                    raise ValueError(f"{self._label(p, i)}: the loaded state lacks '{key}'")
                value = torch.as_tensor(saved[key]).detach()
                value = (torch.view_as_real(value) if value.is_complex() else value).to(torch.float32)
                if value.numel() != view.numel():
                    raise ValueError(f"{self._label(p, i)}: loaded '{key}' has {value.numel()} elements, "
                                     f"it needs {view.numel()}")
                view.copy_(value.reshape(view.shape))
            for key, scales in fresh.items():
                cpp.quantize_state(i, key, _floats(saved[key]), None if scales is None else _floats(scales))
            self._alias(i)
            self._unaliased.discard(i)
        cpp.state_written()  # LAMB's group step count follows the loaded "step"
