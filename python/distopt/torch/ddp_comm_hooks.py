"""DDP communication hooks for users of ``torch.nn.parallel.DistributedDataParallel``
(docs/python.md, "DDP communication hooks"): distopt's int8 gradients with
error feedback, as ``--grad-compression int8`` sends them under ddp.

    from distopt.torch import ddp_comm_hooks
    state = ddp_comm_hooks.Int8State(process_group=None)
    model.register_comm_hook(state, ddp_comm_hooks.int8_hook)

Per bucket of DDP's flattened gradients g (fp32, on the CPU), at n ranks:

1. each rank sends v = g / n + e (e: what its last packets of this bucket
   lost) as n int8 packets, one per shard of ceil(len / n) elements: an
   fp32 scale per block of 256 elements (max |v| / 127 over the block's
   finite values), then one code an element, v / scale rounded half to
   even; a non-finite value travels as the code -128 and arrives as NaN;
2. the packets go to their shards' owners (``all_to_all_single``), and
   each owner sums its n packets in fp32 in rank order;
3. the owner packs its sums again, with a residual of its own, and the
   packets are all-gathered into every rank's averaged gradient.

About 0.254 of the bytes of DDP's fp32 all-reduce. Every rank ends with
the same gradient, so the replicas stay equal; the result is not the
uncompressed one (the residuals carry what each step's packets lost into
the next step). The first ``start_iter`` iterations (at least 2: DDP
rebuilds its buckets after the first) are averaged uncompressed, as
torch's ``powerSGD_hook`` does before ``start_powerSGD_iter``.
"""

import queue
import threading
import warnings

import torch
import torch.distributed as dist

from .. import _core

__all__ = ["Int8State", "int8_hook"]


class Int8State:
    """What ``int8_hook`` keeps between iterations: the process group
    (None: the default group), the residuals of every bucket (each rank's
    of its packets, the owners' of their sums, with the bucket's parameter
    shapes) and the iteration count. Pass it to ``register_comm_hook`` with
    the hook.

    The compressed phases run on a group of their own, made here over the
    group's ranks (``dist.new_group``: every process of the job constructs
    its state, in the same order as its other groups), so that they cannot
    interleave with DDP's own collectives on the group (with
    ``find_unused_parameters=True`` DDP all-reduces its map of used
    parameters during backward)."""

    def __init__(self, process_group=None, start_iter=2):
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 2:
            raise ValueError(f"start_iter must be an integer of at least 2 (got {start_iter!r}): DDP rebuilds its "
                             "buckets after the first iteration, so the residuals start after it")
        self.process_group = process_group
        self.start_iter = start_iter
        self.iter = 0
        self.residuals = {}  # bucket index -> (parameter shapes, this rank's residual [n * shard], the owner's [shard])
        self._private = _private_group(process_group)
        self._jobs = None  # the buckets for the state's thread, started with the first compressed one
        self._failed = None  # the first bucket's failure: the state communicates no more

    def __getstate__(self):  # the groups, the thread and a failure do not travel
        return {k: v for k, v in self.__dict__.items() if k not in ("process_group", "_private", "_jobs", "_failed")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        warnings.warn("Int8State restored: it runs on the default process group (a group cannot be pickled)")
        self.process_group = None
        self._private = _private_group(None)
        self._jobs = None
        self._failed = None

    def __del__(self):
        if getattr(self, "_jobs", None) is not None:
            self._jobs.put(None)


def _private_group(group):
    if not dist.is_initialized():
        raise RuntimeError("Int8State needs torch.distributed initialized (init_process_group) before it is made")
    ranks = None if group is None else dist.get_process_group_ranks(group)
    return dist.new_group(ranks=ranks, backend=dist.get_backend(group))


def _pack(values, residual, shard, out):
    _core.int8_pack(values.data_ptr(), residual.data_ptr(), shard, out.data_ptr())


def _unpack(packet, shard, to, add):
    _core.int8_unpack(packet.data_ptr(), shard, to.data_ptr(), add)


def _failed(state):
    return RuntimeError(f"int8_hook: an earlier bucket failed ({state._failed}); the state communicates no more")


def _serve(state, jobs):
    """The state's thread: each bucket's two phases, in the order DDP
    handed the buckets over (the same on every rank). After a failure the
    buckets still queued fail without communicating (the other ranks may
    not come), and so does every later one."""
    while True:
        job = jobs.get()
        if job is None:
            return
        fut, work = job
        try:
            if state._failed is not None:
                raise _failed(state)
            result = work()
        except BaseException as e:  # noqa: B902 -- DDP's backward raises it
            if state._failed is None:
                state._failed = e
            try:
                fut.set_exception(e)
            except Exception:  # noqa: BLE001 -- a future already done: the thread must go on
                pass
            continue
        try:
            fut.set_result(result)
        except Exception:  # noqa: BLE001
            pass


def _reduce(state, n, g, index, shapes):
    """Bucket `index`'s gradient g, in place: the two int8 phases, on the
    state's own group."""
    group = state._private
    size = g.numel()
    shard = -(-size // n)
    packet = _core.int8_packet_bytes(shard)
    kept, mine, sums = state.residuals.get(index, (None, None, None))
    if kept != shapes:  # a new bucket (or one rebuilt with other parameters): nothing owed yet
        mine, sums = torch.zeros(n * shard), torch.zeros(shard)
        state.residuals[index] = (shapes, mine, sums)
    v = torch.zeros(n * shard)
    torch.div(g, n, out=v[:size])
    out = torch.empty(n * packet, dtype=torch.uint8)
    for d in range(n):
        _pack(v[d * shard:], mine[d * shard:], shard, out[d * packet:])
    received = torch.empty_like(out)
    dist.all_to_all_single(received, out, group=group)
    total = torch.empty(shard)
    for s in range(n):
        _unpack(received[s * packet:], shard, total, s > 0)
    own = torch.empty(packet, dtype=torch.uint8)
    _pack(total, sums, shard, own)
    gathered = torch.empty(n * packet, dtype=torch.uint8)
    dist.all_gather(list(gathered.chunk(n)), own, group=group)
    mean = torch.empty(n * shard)
    for s in range(n):
        _unpack(gathered[s * packet:], shard, mean[s * shard:], False)
    g.copy_(mean[:size])
    return g


def int8_hook(state, bucket):
    """DDP's communication hook for int8 gradients (see the module's doc):
    ``model.register_comm_hook(Int8State(), int8_hook)``."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    n = dist.get_world_size(group)
    g = bucket.buffer()
    if g.dtype != torch.float32 or g.device.type != "cpu":
        raise TypeError(f"int8_hook compresses float32 gradients on the CPU (got {g.dtype} on {g.device}): "
                        "keep torch's hooks for the others")
    compressed = state.iter >= state.start_iter
    if bucket.is_last():
        state.iter += 1
    if not compressed:  # warm-up (and the bucket rebuild): the mean, uncompressed
        g.div_(n)
        return dist.all_reduce(g, group=group, async_op=True).get_future().then(lambda f: f.value()[0])
    # The second phase needs the first's sums, so the collectives of a
    # bucket cannot all start here; issued from the futures' callbacks
    # they would reach the ranks in different orders. One thread per state
    # runs the buckets one after another, in DDP's order, while backward
    # goes on.
    if state._failed is not None:
        raise _failed(state)
    if state._jobs is None:
        state._jobs = queue.SimpleQueue()
        threading.Thread(target=_serve, args=(state, state._jobs), daemon=True, name="distopt-int8-hook").start()
    fut = torch.futures.Future()
    index, shapes = bucket.index(), [tuple(p.shape) for p in bucket.parameters()]
    state._jobs.put((fut, lambda: _reduce(state, n, g, index, shapes)))
    return fut
