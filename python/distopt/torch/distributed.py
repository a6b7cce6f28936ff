"""The sharded optimizer: ddp, zero1 and zero2 for a torch model, exact for
every rule (docs/python.md, "The sharded optimizer"); and gossip and DiLoCo
for a torch model: ``GossipOptimizer`` and ``GossipDataParallel``
(docs/python.md, "Gossip and DiLoCo").

``ShardedOptimizer(model.parameters(), optimizer="lamb", strategy="zero2")``
runs distopt's C++ strategy over the model's parameters, one unit per
parameter:

- the parameters' values move into the strategy's buffer (each parameter
  becomes a view of it) and every rank starts from rank 0's values;
- under ddp and zero1 their gradients live in the strategy's own gradient
  buffer, which each ``.grad`` views (as DDP's ``gradient_as_bucket_view``);
  ``zero_grad`` zeroes it in place. After a step ``.grad`` holds what the
  reduction left there (ddp: the averaged gradient; zero1: only this rank's
  shard is the reduced one), so call ``zero_grad`` before each backward;
- under zero2 (whose strategy keeps only its shard) a hook on each
  parameter's gradient accumulator hands the gradient over as backward
  produces it, in backward order, and frees ``.grad``: each bucket is
  reduce-scattered during backward, and a rank holds its gradient shard
  and the buckets in flight, not the whole gradient. ``.grad`` is None
  after backward (clip with ``max_grad_norm``, not torch's
  ``clip_grad_norm_``); accumulate several backwards under ``with
  opt.no_sync():`` and step after the last;
- ``step()`` hands the gradients, divided by the world size as DDP divides
  them, to the strategy: they are reduced in distopt's fixed rank order,
  each rank steps its shard with the exact rule (LAMB/LARS/Adafactor's
  statistics reduced, Muon's and Shampoo's matrices gathered), and the
  parameters are all-gathered back into their views.

So ddp, zero1 and zero2 give the same bits at a world size, over MPI and
over a torch.distributed (gloo) process group alike.

Parameters on a CUDA device (or any other off the CPU) are staged through
host memory, as ZeRO-Offload keeps its masters: they keep their own device
storage and ``.grad``; the strategy's buffers (values, gradients, this
rank's shard of the state) stay in host memory; ``step()`` copies each
gradient into the host buffer, runs the strategy there over the host
communicator (MPI, or a gloo group -- under an NCCL default group
``comm.world()`` makes a gloo one beside it) and copies the stepped values
back into the parameters. The same bits as the CPU run on the same
gradients; the collectives are the host's, not NCCL's. Use it in place of both
DistributedDataParallel and the optimizer: the model is not wrapped, and
under ddp and zero1 the backward pass is not overlapped with communication
(the reductions run in ``step``).

``state_dict()`` is consolidated (collective: every rank calls it) and
loads into torch's optimizer of the same rule; ``save(dir)`` writes distopt's
reshardable checkpoint, which ``load(dir)`` reads at any world size and
strategy.
"""

import atexit
import contextlib
import math
import warnings

import torch

from .. import _core
from . import comm as _comm
from ._base import DistoptOptimizer

STRATEGIES = tuple(_core.sharded_strategies())  # from the library's registry: ddp, zero1, zero2
GOSSIP_STRATEGIES = tuple(_core.gossip_strategies())  # sgp, osgp, dpsgd, adpsgd, slowmo, diloco
GOSSIP_OPTIONS = tuple(_core.gossip_option_names())  # the command line's gossip flags, with underscores


def memory_per_rank(params, strategy, world):
    """The bytes one rank holds for ``params`` (tensors or element counts)
    under ``strategy`` at ``world`` ranks: parameters, gradients and up to
    three float32 state tensors as the strategy's registry entry shards
    them, with the largest parameter as the unit in flight. The model the
    command line's preflight checks a run against; not a measurement
    (``ShardedOptimizer.memory()`` is)."""
    numels = [p if isinstance(p, int) else p.numel() for p in params]
    m = _core.strategy_memory(strategy, int(world))
    return int(4 * (sum(numels) * m["floats_per_param"] + max(numels, default=0) * m["largest_units"]))


_exit_registered = []


def _retire_at_exit():
    """At exit, the strategies end before the communicators do (atexit runs
    this before the handlers registered earlier: MPI's finalize, a process
    group's destroy): what they have in flight completes while it can."""
    if not _exit_registered:
        atexit.register(_core.retire_sharded)
        _exit_registered.append(True)


class ShardedOptimizer(DistoptOptimizer):
    """``ShardedOptimizer(params, optimizer="adamw", strategy="zero1", *
    comm=None, bucket_elements=32768, max_grad_norm=None, compression="none", **options)``

    ``params`` may be ``model.named_parameters()``: distopt's checkpoints
    (``save``) then name each parameter as the model does, so that
    ``FullyShardedDataParallel`` and the command line's ``checkpoint
    export`` see the same names. ``optimizer`` is a distopt rule (``distopt._core.rules()``: adamw, lamb,
    lars, adafactor, muon, ...) and ``options`` its torch-named options (lr,
    betas, weight_decay, ...); the rule's defaults fill the rest. ``comm``:
    a ``distopt.torch.comm.Communicator`` (default ``comm.world()``).
    ``max_grad_norm`` clips the gradients' global norm before each update
    (the reduced gradient's; ``last_grad_norm`` holds the norm).
    ``compression`` ("bf16", "fp16") sends the gradients in half precision,
    summed in fp32 in rank order: the strategies still agree bit for bit,
    not with the uncompressed run. "int8" sends blocks of 256 codes with a
    scale each and carries what they lose into the next step (error
    feedback): zero1 and zero2 agree bit for bit, ddp (which packs its sums
    again) has its own. "powersgd" sends each matrix's gradient at rank
    ``powersgd_rank`` (torch's powerSGD_hook: warm start, error feedback,
    vectors sent whole) after ``powersgd_warmup`` uncompressed steps; every
    strategy agrees bit for bit. "onebit" is 1-bit Adam (optimizer "adam" or
    "adamw"; strategies ddp, zero1, zero2): ``onebit_warmup`` (default 100) steps of Adam,
    then the variance frozen and each rank's first moment averaged as signs
    with error feedback; the strategies agree bit for bit, and no
    ``max_grad_norm``. Muon's 1-D parameters take AdamW, as
    distopt's command line does.
    """

    _contiguous = False  # the values move into the strategy's buffer
    _devices = ("cpu", "cuda")  # CUDA parameters are staged through host memory
    _device_kernels = False  # so this build of distopt needs no CUDA of its own for them
    _stage_cpu = False  # stage CPU parameters too (tests: the staged path on a machine without a GPU)

    _strategies = STRATEGIES

    @staticmethod
    def _compression_options(compression, rank, warmup, onebit_warmup=None):
        if compression != "onebit" and onebit_warmup is not None:
            raise ValueError(f"onebit_warmup applies to compression='onebit' (not '{compression}')")
        if compression == "onebit":
            if (rank, warmup) != (1, 10):
                raise ValueError("powersgd_rank and powersgd_warmup apply to compression='powersgd' (not 'onebit')")
            return {"grad_compression": compression,
                    "onebit_warmup": 100 if onebit_warmup is None else int(onebit_warmup)}
        if compression != "powersgd":
            if (rank, warmup) != (1, 10):
                raise ValueError(f"powersgd_rank and powersgd_warmup apply to compression='powersgd' "
                                 f"(not '{compression}')")
            return {} if compression == "none" else {"grad_compression": compression}
        return {"grad_compression": compression, "powersgd_rank": int(rank), "powersgd_warmup": int(warmup)}
    _what = "the sharded optimizer"
    _load_hint = "load values with p.copy_(...)"

    def __init__(self, params, optimizer="adamw", strategy="zero1", *, comm=None, bucket_elements=1 << 15,
                 max_grad_norm=None, norm_type=2.0, compression="none", powersgd_rank=1, powersgd_warmup=10,
                 onebit_warmup=None, _gossip=None, _units=(),
                 _strategy_options=None, _param_names=None, **options):
        name = type(self).__name__
        params = list(params)
        if any(isinstance(p, dict) for p in params):
            raise TypeError(f"{name} takes one list of parameters (one group)")
        if params and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in params):
            _param_names = [n for n, _ in params]  # model.named_parameters(): the checkpoints' names
            params = [p for _, p in params]
        if strategy not in self._strategies:
            hint = " (gossip strategies: GossipOptimizer)" if strategy in GOSSIP_STRATEGIES and \
                self._strategies is STRATEGIES else ""
            raise ValueError(f"strategy '{strategy}': {self._what} runs {', '.join(self._strategies)}{hint}")
        rule_options = _core.rule_options(optimizer)  # ValueError for an unknown rule
        known = {name: default for name, default, _ in rule_options}
        for k in options:
            if k not in known:
                raise TypeError(f"{name}: {optimizer} has no option '{k}' (it has {', '.join(sorted(known))})")
        if compression not in _core.grad_compressions():
            raise ValueError(f"compression '{compression}': {self._what} sends gradients as "
                             f"{', '.join(_core.grad_compressions())}")
        if max_grad_norm is not None and not (max_grad_norm > 0 and math.isfinite(max_grad_norm)):
            raise ValueError(f"max_grad_norm must be a positive number (got {max_grad_norm})")
        if compression == "onebit" and max_grad_norm is not None:
            raise ValueError("max_grad_norm with compression='onebit': after its warm-up the step takes the ranks' "
                             "averaged moment, not a gradient that could be clipped")
        defaults = dict(known)
        defaults.update(options)
        super().__init__(params, defaults)
        seen = set()
        for i, p in enumerate(self._all()):
            self._check_param(p, i)
            if id(p) in seen:
                raise ValueError(f"{name}: parameter {i} appears twice (pass each tensor once)")
            seen.add(id(p))
        self.comm = comm if comm is not None else _comm.world()
        self.rule = optimizer
        self.strategy = strategy
        self.max_grad_norm = max_grad_norm
        self.norm_type = float(norm_type)
        self.last_grad_norm = None
        self._known = known
        ps = self._all()
        initial = self._initial_values(ps)
        group = self.param_groups[0]
        self._synced = {k: group[k] for k in known}
        names = _param_names or [f"params[{i}]" for i in range(len(ps))]
        self._core = _core.Sharded(self.comm._c, strategy, optimizer,
                                   [(n, list(p.shape)) for n, p in zip(names, ps)], initial,
                                   dict(self._synced), int(bucket_elements), dict(_gossip or {}), list(_units),
                                   dict(_strategy_options or {}, **self._compression_options(
                                       compression, powersgd_rank, powersgd_warmup, onebit_warmup)))
        _retire_at_exit()
        self._attach()
        self._sync = True  # no_sync() turns the hooks' deliveries off
        self._twice = None  # a parameter whose gradient came again after it was handed over
        self._hooks = self._hook_grads() if self._core.hooked else []

    # ---- parameters and gradients ----
    def _all(self):
        return self.param_groups[0]["params"]

    @torch.no_grad()
    def _initial_values(self, ps):
        """The parameters' values, one flat float32 array (rank 0's go to
        every rank)."""
        return torch.cat([p.detach().reshape(-1).cpu() for p in ps]).numpy()

    def _check_param(self, p, i):
        super()._check_param(p, i)  # dense float32 on the CPU or a CUDA device
        label = self._label(p, i)
        if p.numel() == 0:
            raise ValueError(f"{label} has no elements")
        if not p.requires_grad:
            raise ValueError(f"{label} does not require a gradient; pass only the trained parameters "
                             "([p for p in model.parameters() if p.requires_grad])")

    def _staged(self, p):
        return p.device.type != "cpu" or self._stage_cpu

    def _attach(self):
        """Each parameter becomes a view of the strategy's buffer and its
        gradient a view of the flat gradient buffer; a staged one takes the
        buffer's values and keeps its own storage and gradient."""
        self._grads, self._values = [], []
        with torch.no_grad():
            for i, p in enumerate(self._all()):
                g = None if self._core.hooked else torch.from_numpy(self._core.grad(i))
                if self._staged(p):
                    p.copy_(torch.from_numpy(self._core.param(i)))
                else:
                    p.data = torch.from_numpy(self._core.param(i))
                    if g is not None:
                        p.grad = g
                self._grads.append(g)
                self._values.append(p.data_ptr())

    # ---- zero2: gradients reduced as backward produces them ----
    def _hook_grads(self):
        """A hook on each parameter's gradient accumulator (it runs once the
        gradient is accumulated into ``.grad``, as DDP's do): the gradient
        goes to the strategy, in backward order (one that comes early waits
        for those before it), and ``.grad`` is freed."""
        handles = []
        with torch.enable_grad():
            for i, p in enumerate(self._all()):
                acc = p.expand_as(p).grad_fn.next_functions[0][0]  # the parameter's AccumulateGrad
                handles.append((acc, acc.register_hook(lambda *_, i=i: self._on_grad(i))))
        self._ready = [False] * len(self._all())
        return handles

    def _on_grad(self, i):
        if not self._sync:
            return
        if i > self._core.next_unit:
            # Raised by the step: an exception inside backward's hook leaves
            # torch 1.13's autograd holding the graph until the process ends
            # (whose exit then waits for the GIL forever).
            self._twice = self._twice if self._twice is not None else i
            return
        self._ready[i] = True
        while self._core.next_unit >= 0 and self._ready[self._core.next_unit]:
            self._deliver(self._core.next_unit)

    def _deliver(self, u):
        p = self._all()[u]
        with torch.no_grad():
            g = p.grad
            if g is None:
                g = torch.zeros(p.shape)
            elif g.is_sparse:
                raise ValueError(f"{type(self).__name__}: parameter {u} has a sparse gradient")
            self._core.deliver(u, g.detach().to("cpu", torch.float32).contiguous().numpy())
        p.grad = None  # its reduce-scatter has it: each rank keeps its shard only
        self._ready[u] = False

    @contextlib.contextmanager
    def no_sync(self):
        """``with opt.no_sync():`` backwards inside accumulate into ``.grad``
        and are not reduced; the first backward after it reduces the sum
        (zero2; under ddp and zero1, which reduce in ``step``, it changes
        nothing)."""
        was, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = was

    def _put_back(self):
        """The stepped values into the staged parameters."""
        for i, p in enumerate(self._all()):
            if self._staged(p):
                p.copy_(torch.from_numpy(self._core.param(i)))

    def add_param_group(self, param_group):
        if self.param_groups:
            raise ValueError("ShardedOptimizer has one parameter group (its layout is fixed when it is made)")
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none=False):
        """Zeroes the flat gradient buffer in place; each ``.grad`` stays its
        view (``set_to_none`` is accepted and has no effect, as with DDP's
        ``gradient_as_bucket_view``). A staged parameter's own ``.grad`` is
        zeroed in place, or set to None with ``set_to_none=True``."""
        self._core.zero_grads()
        for p, g in zip(self._all(), self._grads):
            if self._staged(p) or g is None:  # (zero2: torch's own .grad, usually freed already)
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()
            elif p.grad is not g:
                p.grad = g

    def _gather_grads(self):
        # A .grad replaced by the user (or set to None) goes back into the buffer.
        with torch.no_grad():
            for i, (p, g) in enumerate(zip(self._all(), self._grads)):
                if p.data_ptr() != self._values[i]:
                    raise ValueError(f"{type(self).__name__}: parameter {i}'s storage was replaced (model.to(...), "
                                     "p.data = ..., load_state_dict(assign=True)); the optimizer steps its own "
                                     f"buffer, so make the optimizer after moving the model and {self._load_hint}")
                if self._staged(p):  # its values, which the user may have changed, are the step's start
                    torch.from_numpy(self._core.param(i)).copy_(p.detach())
                if g is None:  # zero2: delivered by the hooks, or below
                    continue
                if p.grad is g:
                    continue
                if p.grad is None:
                    g.zero_()
                else:
                    if p.grad.is_sparse:
                        raise ValueError(f"{type(self).__name__}: parameter {i} has a sparse gradient")
                    g.copy_(p.grad)  # a staged parameter's: from its device
                if not self._staged(p):
                    p.grad = g

    def _sync_options(self):
        self._send_changed_options(self.param_groups[0], self._synced, self._core.set_option)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._run_closure(closure)
        self._sync_options()
        self._gather_grads()
        if self._twice is not None:
            i, self._twice = self._twice, None
            raise RuntimeError(f"{type(self).__name__}: parameter {i}'s gradient came twice in one step: "
                               f"{self.strategy} reduces each gradient as backward produces it, so accumulate "
                               "over several backwards under `with opt.no_sync():` and step after the last")
        if self._core.hooked:  # the gradients backward did not produce (unused parameters, .grad set by hand)
            while self._core.next_unit >= 0:
                self._deliver(self._core.next_unit)
        norm = self._core.step(self.max_grad_norm or 0.0, self.norm_type)
        self._put_back()
        self.last_grad_norm = None if math.isnan(norm) else norm
        return loss

    # ---- state ----
    def state_dict(self):
        """torch's format, consolidated (collective): every parameter's whole
        state, loadable by torch's optimizer of the same rule."""
        wholes = self._core.consolidated()
        state = {}
        prefix = "state."
        for name, array in wholes.items():
            if not name.startswith(prefix):
                continue
            index, key = name[len(prefix):].split(".", 1)
            t = torch.from_numpy(array)
            state.setdefault(int(index), {})[key] = t
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        group["params"] = list(range(len(self._all())))
        return {"state": state, "param_groups": [group]}

    def load_state_dict(self, state_dict):
        """A state_dict of this class or of torch's optimizer of the same rule
        (collective): each rank takes its shard."""
        groups = state_dict["param_groups"]
        n = len(self._all())
        indices = [i for g in groups for i in g["params"]]
        if len(indices) != n:
            raise ValueError(f"the state_dict has {len(indices)} parameters, this optimizer {n}")
        order = {saved: k for k, saved in enumerate(indices)}
        wholes = {}
        for saved, entries in state_dict["state"].items():
            i = order.get(saved)
            if i is None:
                raise ValueError(f"the state_dict's state names parameter {saved}, which no group holds")
            for key, value in entries.items():
                wholes[f"state.{i}.{key}"] = torch.as_tensor(value).detach().to(torch.float32).contiguous().numpy()
        self._core.load_consolidated(wholes)
        group = self.param_groups[0]
        for k, v in groups[0].items():
            if k not in ("params", "state_dtype") and k in group:  # the storage stays what it was made with
                group[k] = v
        self._sync_options()

    def save(self, root, step, keep=3):
        """distopt's reshardable checkpoint of the parameters and the
        optimizer state under ``root/step-<step>`` (collective; crash-safe:
        complete once its manifest is written). Returns the bytes written."""
        return self._core.save(str(root), int(step), int(keep))

    def load(self, root):
        """The latest checkpoint under ``root``, saved at any world size and
        by any of ddp/zero1/zero2 (collective): the parameters take its
        values, the optimizer its state and options. Returns its step."""
        step = self._core.load(str(root))
        if self._core.hooked:
            self._ready = [False] * len(self._all())
        if self._core.load_warning:
            warnings.warn(self._core.load_warning, stacklevel=2)
        self._attach()
        group = self.param_groups[0]
        for k, v in self._core.group_options().items():
            if k in group:
                group[k] = v
        self._synced = {k: group[k] for k in self._known}
        return step

    def memory(self):
        """Bytes this rank holds: params, grads, master_params, optimizer_state."""
        return self._core.memory()

    @property
    def bytes_sent(self):
        return self._core.bytes_sent


def _gossip_kwargs(options):
    """Splits keyword options into the gossip strategy's (topology,
    sync_every, outer_lr, ...: GOSSIP_OPTIONS) and the update rule's."""
    gossip = {k: options.pop(k) for k in list(options) if k in GOSSIP_OPTIONS}
    return gossip, options


class GossipOptimizer(ShardedOptimizer):
    """``GossipOptimizer(params, optimizer="sgd", strategy="sgp", *,
    comm=None, max_grad_norm=None, **options)``

    Decentralised training of a torch model with distopt's C++ gossip
    strategies (docs/gossip.md): ``sgp`` (push-sum, Assran et al. 2019),
    ``osgp`` (overlapped), ``dpsgd`` (Lian et al. 2017), ``adpsgd``
    (asynchronous pairs), ``slowmo`` and ``diloco`` (Douillard et al. 2023,
    streaming fragments and compressed pseudo-gradients included).
    Each rank keeps its own model and optimizer state and steps with its own
    gradient (the mean over its own batch: call ``backward`` on the local
    mean loss, as with DDP), then mixes with its peers.

    ``options`` are the rule's torch-named options (``lr``, ``momentum``,
    ...) and the strategy's, named as the command line's flags with
    underscores (``GOSSIP_OPTIONS``): ``topology``, ``peers_per_iteration``,
    ``synch_freq``, ``slowmo_*``, ``localsgd_frequency``, ``sync_every``,
    ``outer_optimizer``, ``outer_lr``, ``outer_momentum``, ``fragments``,
    ``sync_delay``, ``fragment_alpha``, ``fragment_carry``, ``outer_dtype``,
    ``outer_error_feedback``; one the strategy does not read is a
    ValueError. The bits are the C++ strategy's on the same gradients
    (``distopt train --strategy sgp ...``), over MPI and over a
    torch.distributed gloo group alike.

    The parameters view a buffer of this optimizer that each ``step``
    refills with the model the next forward runs on (sgp's de-biased
    ``x / w``): a value written into them between steps is overwritten (load
    values with ``load``, or make the optimizer after loading them). Call
    ``zero_grad`` before each backward. ``consensus_distance()``,
    ``averaged_parameters()`` and ``bytes_sent`` report the run;
    ``save(dir, step)`` writes every rank's own state, which ``load(dir)``
    resumes rank by rank (at another world size or strategy: from the
    ranks' mean, with a warning). ``state_dict()`` is the ranks' mean
    optimizer state in torch's format (collective; every rank's whole state
    is gathered on every rank), for torch's optimizer of the same rule;
    ``load_state_dict`` gives every rank that one state.
    """

    _strategies = GOSSIP_STRATEGIES
    _what = "the gossip optimizer"
    _load_hint = "load values with load(), or make the optimizer after loading them"

    def __init__(self, params, optimizer="sgd", strategy="sgp", *, comm=None, max_grad_norm=None, norm_type=2.0,
                 **options):
        gossip, rule = _gossip_kwargs(dict(options))
        if strategy in GOSSIP_STRATEGIES:
            _core.gossip_options(strategy, gossip)  # an unknown or misfit option, before the parameters' broadcast
        super().__init__(params, optimizer, strategy, comm=comm, max_grad_norm=max_grad_norm, norm_type=norm_type,
                         _gossip=gossip, **rule)
        self.gossip_options = gossip

    def consensus_distance(self):
        """(1/n) sum_i |z_i - z_mean|^2 over the ranks' models (collective)."""
        return self._core.consensus_distance()

    def averaged_parameters(self):
        """The mean of the ranks' models, one new tensor per parameter in
        the optimizer's order (collective): what to evaluate or export."""
        return [torch.from_numpy(a) for a in self._core.averaged()]

    @property
    def steps(self):
        """Steps taken (carried by ``save`` and ``load``)."""
        return self._core.steps


class GossipDataParallel(torch.nn.Module):
    """``GossipDataParallel(module, strategy="sgp", *, optimizer="sgd",
    comm=None, **options)``: the SGP project's wrapper on distopt's
    strategies. ``module``'s trained parameters go to a ``GossipOptimizer``
    (``self.optimizer``: step it, schedule its lr, save it) with ``options``
    (the rule's and the strategy's, as ``GossipOptimizer`` takes them); the
    wrapper runs the module's forward unchanged. Where the SGP project's
    wrapper takes flags, this one takes a strategy: its ``push_sum=True``
    is ``strategy="sgp"`` (with ``overlap=True``: ``"osgp"``),
    ``push_sum=False`` is ``"dpsgd"``.

    ``with model.averaged():`` runs the module on the ranks' mean model (for
    evaluation; collective on entry) and puts each rank's own back on exit;
    do not step inside it (the step refuses parameters written since the
    last one). Buffers (BatchNorm's running statistics) stay each rank's own.
    """

    def __init__(self, module, strategy="sgp", *, optimizer="sgd", comm=None, **options):
        super().__init__()
        self.module = module
        self._trained = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.optimizer = GossipOptimizer([p for _, p in self._trained], optimizer, strategy, comm=comm, **options)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def consensus_distance(self):
        return self.optimizer.consensus_distance()

    @property
    def bytes_sent(self):
        return self.optimizer.bytes_sent

    def average_parameters(self):
        """The ranks' mean model as {name: tensor} (collective)."""
        return {n: a for (n, _), a in zip(self._trained, self.optimizer.averaged_parameters())}

    @contextlib.contextmanager
    def averaged(self):
        mean = self.optimizer.averaged_parameters()
        own = []
        with torch.no_grad():
            for (_, p), m in zip(self._trained, mean):
                own.append(p.detach().clone())
                p.copy_(m)
        try:
            yield self
        finally:
            with torch.no_grad():
                for (_, p), o in zip(self._trained, own):
                    p.copy_(o)


from ._fsdp import GATHERING_STRATEGIES, FullyShardedDataParallel  # noqa: E402,F401 (it builds on ShardedOptimizer)

