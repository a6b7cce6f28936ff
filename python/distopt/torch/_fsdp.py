"""ZeRO-3 for a torch.nn.Module: ``FullyShardedDataParallel``
(docs/python.md, "ZeRO-3 for a module"), exported by
``distopt.torch.distributed``.

The module's trained parameters are cut into units -- the submodules the
user wraps (a list of them, module classes, or FSDP's size policy), and the
root for what none holds -- and handed to distopt's C++ zero3 strategy,
which keeps each rank's shard of every unit (and of the optimizer state).
Each unit's parameters view one flat torch tensor whose storage exists
only while the unit runs:

- a forward-pre hook on the unit's module gathers it (``gather_start``:
  the all-gather of the strategy's shards straight into the storage; the
  next units of the pass started as ``prefetch_units``/``max_live_params``
  allow) and a forward hook frees it;
- a hook on the unit's outputs gathers it again when backward reaches them;
  under activation checkpointing, the recomputed forward gathers it and
  keeps it for the backward that follows;
- a hook on each parameter's gradient accumulator counts the unit's
  gradients; once all are in, the storage is freed and the gradient goes to
  the strategy in backward order (last unit first; one that is ready early
  waits), which reduce-scatters each bucket as it fills;
- ``optimizer.step()`` steps the shards with the exact rule (statistics
  reduced, matrices gathered), so the bits are ddp's.

The root unit is gathered when the root's forward starts and kept until
its gradients are in.
"""

import contextlib
import math

import torch

from .. import _core
from .distributed import ShardedOptimizer

GATHERING_STRATEGIES = tuple(_core.gathering_strategies())  # zero3


def _free(flat):
    flat.storage().resize_(0)


def _alloc(flat, n):
    storage = flat.storage()
    if storage.size() != n:
        storage.resize_(n)


def _tensors(value):
    """The tensors in a module's output (tensors, tuples, lists, dicts)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _wrapped(module, wrap, min_num_params):
    """The set of submodules that become units of their own."""
    if wrap is not None and min_num_params is not None:
        raise ValueError("FullyShardedDataParallel: give wrap or min_num_params, not both")
    if wrap is None and min_num_params is None:
        return set()  # one unit: the root, as FSDP without an auto-wrap policy
    subs = [m for _, m in module.named_modules() if m is not module]
    if wrap is not None:
        if isinstance(wrap, type) or (isinstance(wrap, (tuple, set, frozenset)) and wrap
                                      and all(isinstance(w, type) for w in wrap)):
            classes = tuple(wrap) if not isinstance(wrap, type) else (wrap,)
            return {id(m) for m in subs if isinstance(m, classes)}
        ids = {id(m) for m in subs}
        out = set()
        for m in wrap:
            if not isinstance(m, torch.nn.Module):
                raise TypeError(f"FullyShardedDataParallel: wrap holds a {type(m).__name__}, not a submodule "
                                "(give submodules or module classes)")
            if id(m) not in ids:
                raise ValueError(f"FullyShardedDataParallel: wrap names a {type(m).__name__} that is not a "
                                 "submodule of the model")
            out.add(id(m))
        return out
    if not (isinstance(min_num_params, int) and min_num_params > 0):
        raise ValueError(f"min_num_params must be a positive integer (got {min_num_params!r})")
    out = set()

    def left(m):  # the trained elements m holds that no wrapped submodule below it took
        n = sum(p.numel() for p in m.parameters(recurse=False) if p.requires_grad)
        n += sum(left(c) for c in m.children())
        if m is not module and n >= min_num_params:
            out.add(id(m))
            return 0
        return n

    left(module)
    return out


def _units(module, wrapped):
    """[(name, submodule or None for the root, [(fqn, parameter), ...])]:
    the root first, then the wrapped submodules in the order the model
    registers them (the order their forwards are expected in)."""
    root = ("", None, [])
    units, owner, seen = [root], {}, set()

    def visit(m, prefix, unit):
        if id(m) in seen:
            return
        seen.add(id(m))
        if m is not module and id(m) in wrapped:
            unit = (prefix.rstrip("."), m, [])
            units.append(unit)
        for name, p in m.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            if id(p) in owner:
                if owner[id(p)] is not unit:
                    raise ValueError(f"FullyShardedDataParallel: parameter {prefix}{name} is shared with "
                                     f"{owner[id(p)][0] or 'the root'}'s; keep tied parameters in one unit "
                                     "(wrap the module that holds both)")
                continue
            owner[id(p)] = unit
            unit[2].append((prefix + name, p))
        for name, c in m.named_children():
            visit(c, f"{prefix}{name}.", unit)

    visit(module, "", root)
    return [u for u in units if u[2]]


class _UnitOptimizer(ShardedOptimizer):
    """The optimizer of a ``FullyShardedDataParallel``: a ShardedOptimizer
    over the C++ zero3 strategy whose parameters are gathered per unit (see
    the module's comment). Step it, schedule its ``lr``, save and load it."""

    _strategies = GATHERING_STRATEGIES
    _what = "FullyShardedDataParallel"

    def __init__(self, units, optimizer, strategy, *, comm, bucket_elements, max_grad_norm, norm_type,
                 strategy_options, **options):
        self._unit_list = units
        self._prefetch_units = strategy_options["prefetch_units"]
        self._max_live = strategy_options["max_live_params"]
        params = [p for _, _, ps in units for _, p in ps]
        self._names = [n for _, _, ps in units for n, _ in ps]
        super().__init__(params, optimizer, strategy, comm=comm, bucket_elements=bucket_elements,
                         max_grad_norm=max_grad_norm, norm_type=norm_type,
                         _units=[(name or "root", len(ps)) for name, _, ps in units],
                         _strategy_options=strategy_options, _param_names=self._names, **options)

    @torch.no_grad()
    def _initial_values(self, ps):
        """The values, one flat array, while each unit's parameters move
        to views of its flat tensor, freed at once: the model's own storage
        goes unit by unit, so a rank never holds two copies of it besides
        the array (which the strategy leaves once it has its shard)."""
        self._unit_hooks = ShardedOptimizer._hook_grads(self)  # (before the storages go: they read them)
        # The strategy's layout: a unit's tensors of 4096 or more elements
        # start on multiples of 256 of it (quantized state's blocks), zeros between.
        offsets, lengths = _core.unit_offsets([(n, list(p.shape)) for n, p in zip(self._names, ps)],
                                              [(name or "root", len(unit)) for name, _, unit in self._unit_list])
        initial = torch.zeros(sum(lengths))
        self._flats, self._live, self._unit_of, self._left, self._first = [], [], [], [], []
        begin = 0
        for u, (_, _, unit) in enumerate(self._unit_list):
            self._first.append(len(self._unit_of))  # the unit's parameters: [first, first + len(unit))
            flat = torch.empty(lengths[u])
            for _, p in unit:
                n, off = p.numel(), offsets[len(self._unit_of)]
                initial[begin + off:begin + off + n].copy_(p.detach().reshape(-1))
                p.data = flat[off:off + n].view(p.shape)
                self._unit_of.append(u)
            begin += lengths[u]
            _free(flat)
            self._flats.append(flat)
            self._live.append(0)
            self._left.append(len(unit))
        return initial.numpy()

    def _attach(self):
        """The parameters view the units' flat tensors already (made by
        _initial_values, kept across load)."""
        self._grads = [None] * len(self._all())
        self._values = [None] * len(self._all())

    # A unit's storage: 0 freed, 1 being gathered into, 2 holding the values.
    def _start(self, u):
        _alloc(self._flats[u], self._padded[u])
        # Straight into torch's storage, without a version bump: the views
        # autograd saved stay valid.
        self._core.gather_start(u, self._flats[u].data_ptr())
        self._live[u] = 1

    def _gather(self, u, backward):
        """Unit u's values in its storage; the next units of the pass
        (backward: the ones before it) prefetched as the options allow."""
        if self._live[u] == 0:
            self._start(u)
        if self._live[u] == 1:
            self._core.gather_wait(u)
            self._live[u] = 2
        v = u
        for _ in range(self._prefetch_units):
            v = v - 1 if backward else v + 1
            if not 0 <= v < len(self._flats):
                break
            if self._live[v]:
                continue
            if self._max_live and self._padded[v] + sum(n for n, live in zip(self._padded, self._live) if live) > \
                    self._max_live:
                break
            self._start(v)

    def _release(self, u):
        if self._live[u] == 1:
            self._core.gather_wait(u)  # (its buffer is being written)
        if self._live[u]:
            _free(self._flats[u])
            self._live[u] = 0

    def _release_all(self):
        for u in range(len(self._flats)):
            self._release(u)

    def _hook_grads(self):
        self._ready = [False] * len(self._flats)  # per unit
        self._got = [False] * len(self._all())
        self._padded = [self._core.unit_padded(u) for u in range(len(self._flats))]
        return self._unit_hooks

    def _on_grad(self, i):
        if self._got[i]:
            return
        self._got[i] = True
        u = self._unit_of[i]
        self._left[u] -= 1
        if self._left[u] > 0:
            return
        self._unit_done(u)

    def _reset_unit(self, u):
        """Unit u's gradient marks back to none come, its storage freed."""
        n = len(self._unit_list[u][2])
        self._got[self._first[u]:self._first[u] + n] = [False] * n
        self._left[u] = n
        self._release(u)

    def _unit_done(self, u):
        """Every gradient of unit u is in: free it, hand it over in turn."""
        self._reset_unit(u)
        if not self._sync:
            return
        if u > self._core.next_unit:
            self._twice = self._twice if self._twice is not None else u
            return
        self._ready[u] = True
        while self._core.next_unit >= 0 and self._ready[self._core.next_unit]:
            self._deliver(self._core.next_unit)

    def _deliver(self, u):
        ps = [p for _, p in self._unit_list[u][2]]
        with torch.no_grad():
            self._core.deliver_parts(u, [torch.zeros(p.numel()).numpy() if p.grad is None else
                                         p.grad.detach().to("cpu", torch.float32).reshape(-1).numpy() for p in ps])
        for p in ps:
            p.grad = None
        self._ready[u] = False

    def _gather_grads(self):
        pass  # every gradient goes through the hooks (or the step's deliveries)

    def _put_back(self):
        pass

    def zero_grad(self, set_to_none=True):
        for p in self._all():
            p.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._run_closure(closure)
        self._sync_options()
        if self._twice is not None:
            u, self._twice = self._twice, None
            raise RuntimeError(f"FullyShardedDataParallel: unit {self._unit_list[u][0] or 'root'}'s gradients "
                               "came twice in one step: they are reduced as backward produces them, so "
                               "accumulate over several backwards under `with model.no_sync():`")
        # Units whose gradients did not all come (parameters the forward did
        # not use), in backward order; the strategy then steps the shards.
        for u in range(len(self._flats)):
            if self._left[u] != len(self._unit_list[u][2]):
                self._reset_unit(u)
        while self._core.next_unit >= 0:
            self._deliver(self._core.next_unit)
        self._release_all()
        norm = self._core.step(self.max_grad_norm or 0.0, self.norm_type)
        self.last_grad_norm = None if math.isnan(norm) else norm
        if self._prefetch_units > 0:
            self._start(0)  # the next forward's first unit, gathered while the caller goes on
        return loss

    def load(self, root):
        self._release_all()  # gathered from the strategy being replaced
        step = super().load(root)
        self._ready = [False] * len(self._flats)
        self._got = [False] * len(self._all())
        return step


class FullyShardedDataParallel(torch.nn.Module):
    """``FullyShardedDataParallel(module, *, optimizer="adamw", comm=None,
    wrap=None, min_num_params=None, prefetch_units=1, max_live_params=0,
    bucket_elements=32768, max_grad_norm=None, **options)``

    ZeRO-3 for a torch model with distopt's exact rules: each rank keeps its
    shard of the parameters and of the optimizer state, gathers a unit's
    parameters just before its forward and again before its backward, frees
    them after, and reduce-scatters each unit's gradient as backward
    produces it. ``self.optimizer`` (a ``torch.optim.Optimizer``: step it,
    schedule its ``lr``, ``save``/``load`` it) steps the shards with
    ``optimizer``'s exact rule -- adamw, lamb, muon, adafactor, shampoo, any
    of ``distopt._core.rules()`` -- so the parameters are bitwise those of
    ``ShardedOptimizer(..., strategy="ddp")`` on the same batches, where
    torch's FSDP, flattening and cutting tensors, changes every rule that
    looks past one element.

    Units: ``wrap`` is a list of submodules, or a module class (or tuple of
    classes: FSDP's transformer policy) whose instances each become a unit;
    ``min_num_params`` is FSDP's size policy (a submodule holding at least
    that many trained elements not already in a unit below it). The rest
    belongs to the root unit, gathered for the whole forward and backward.
    Neither given: one unit, the whole model (as FSDP without a policy).
    ``prefetch_units`` units are gathered ahead of the one running, while
    they fit under ``max_live_params`` elements (0: no limit), as the
    command line's ``--prefetch-units`` and ``--max-live-params``.

    Call ``backward`` on the local mean loss (as with DDP); accumulate over
    several backwards under ``with model.no_sync():``. Between steps the
    parameters hold no storage: read them inside ``with
    model.summon_full_params():``; ``state_dict()`` is the full model
    (collective), loadable by the plain module.
    """

    def __init__(self, module, *, optimizer="adamw", strategy="zero3", comm=None, wrap=None, min_num_params=None,
                 prefetch_units=1, max_live_params=0, max_buckets_in_flight=2, bucket_elements=1 << 15,
                 max_grad_norm=None, norm_type=2.0, **options):
        super().__init__()
        self.module = module
        units = _units(module, _wrapped(module, wrap, min_num_params))
        if not units:
            raise ValueError("FullyShardedDataParallel: the module has no trained parameters")
        self._unit_names = [name or "root" for name, _, _ in units]
        self.optimizer = _UnitOptimizer(units, optimizer, strategy, comm=comm, bucket_elements=bucket_elements,
                                        max_grad_norm=max_grad_norm, norm_type=norm_type,
                                        strategy_options={"prefetch_units": int(prefetch_units),
                                                          "max_live_params": int(max_live_params),
                                                          "max_buckets_in_flight": int(max_buckets_in_flight)},
                                        **options)
        self._in_backward = False
        self._handles = []
        opt = self.optimizer
        has_root = units[0][1] is None
        self._root_unit = 0 if has_root else None
        self._handles.append(module.register_forward_pre_hook(lambda m, args: self._root_pre()))
        self._handles.append(module.register_forward_hook(lambda m, args, out: self._root_post(out)))
        for u, (_, sub, _) in enumerate(units):
            if sub is None:
                continue
            self._handles.append(sub.register_forward_pre_hook(lambda m, args, u=u: self._unit_pre(u)))
            self._handles.append(sub.register_forward_hook(lambda m, args, out, u=u: self._unit_post(u, out)))
        self._opt = opt

    @property
    def units(self):
        """The units' names in the layout's order (the root's is "root")."""
        return list(self._unit_names)

    @property
    def parameter_names(self):
        """The trained parameters' names in the layout's order: the order of
        the optimizer's state in its checkpoints and state_dict (a
        ShardedOptimizer loading them lists its parameters in it)."""
        return list(self._opt._names)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # ---- the hooks ----
    def _root_pre(self):
        self._in_backward = False
        if self._root_unit is not None:
            self._opt._gather(self._root_unit, False)

    def _root_post(self, out):
        grads = [t for t in _tensors(out) if t.requires_grad]
        if not grads:  # evaluation (no_grad): nothing comes back for the parameters
            if not torch.is_grad_enabled():
                self._opt._release_all()
            return
        for t in grads:
            t.register_hook(self._backward_starts)

    def _backward_starts(self, grad):
        self._in_backward = True
        return grad

    def _unit_pre(self, u):
        self._opt._gather(u, self._in_backward)

    def _unit_post(self, u, out):
        if self._in_backward:  # a recomputation (activation checkpointing): kept for the backward that follows
            return
        if torch.is_grad_enabled():
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(lambda g, u=u: self._unit_backward(u, g))
        self._opt._release(u)

    def _unit_backward(self, u, grad):
        self._in_backward = True
        self._opt._gather(u, True)
        return grad

    # ---- what FSDP users reach for ----
    @contextlib.contextmanager
    def no_sync(self):
        with self._opt.no_sync():
            yield

    @contextlib.contextmanager
    def summon_full_params(self):
        """Every unit gathered (collective on entry): the parameters hold
        the current values for reading; writes are not kept."""
        for u in range(len(self._opt._flats)):
            self._opt._gather(u, False)
        try:
            yield self
        finally:
            self._opt._release_all()

    def state_dict(self, *args, **kwargs):
        """The full model, as the plain module's ``state_dict()`` names it
        (collective: every rank gathers every parameter)."""
        with self.summon_full_params():
            return {k: v.detach().clone() for k, v in self.module.state_dict(*args, **kwargs).items()}

    def memory(self):
        return self._opt.memory()

    @property
    def bytes_sent(self):
        return self._opt.bytes_sent
