"""distopt's communicators on torch tensors (docs/python.md, "Communicators").

Three transports, one contract: every reduction sums the ranks in order
0, 1, ..., n-1, so the same program gives the same bits over each of them.

- ``mpi_world()``: distopt's MPI communicator, for ``mpirun -np N python3 ...``.
- ``from_process_group(group=None)``: over a torch.distributed process group
  (gloo), built from its point-to-point messages: for ``torchrun``.
- ``single()``: one rank, no communication.

``world()`` picks one: the process group when torch.distributed is
initialized, MPI under mpirun, else a single rank.

The collectives (``all_reduce``, ``reduce_scatter``, ``all_gather``,
``broadcast``, ``barrier``) take contiguous CPU tensors of float32, float64,
bfloat16, float16, int32, int64 or uint8 and work in place where torch's
do; ``PushSum`` is distopt's gossip averager (push-sum, Kempe et al. 2003;
docs/gossip.md) over a topology.
"""

import atexit
import datetime
import os

import torch

from .. import _core
from ._base import check_tensor

_TYPES = {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16", torch.float16: "f16",
          torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8"}


def _address(t, what):
    check_tensor(t, f"{what}: the tensor", tuple(_TYPES), "distopt.torch.comm communicates")
    return t.data_ptr()


class Communicator:
    """A distopt communicator: ``rank``, ``size``, ``backend`` and the
    collectives on torch tensors."""

    def __init__(self, core):
        self._c = core

    rank = property(lambda self: self._c.rank)
    size = property(lambda self: self._c.size)
    backend = property(lambda self: self._c.backend)
    bytes_sent = property(lambda self: self._c.bytes_sent, doc="bytes this rank has sent")

    def set_timeout(self, seconds):
        """Every wait fails with TimeoutError naming the operation after this long."""
        self._c.set_timeout(float(seconds))

    def all_reduce(self, tensor, op="sum"):
        """In place: the reduction over the ranks in rank order (sum, avg, max, min)."""
        self._c.all_reduce(_address(tensor, "all_reduce"), tensor.numel(), _TYPES[tensor.dtype], op)
        return tensor

    def reduce_scatter(self, output, input, op="sum"):
        """``output`` (n elements) = the reduction of piece ``rank`` of ``input`` (size * n elements)."""
        self._check_pair(output, input, "reduce_scatter", input.numel() == output.numel() * self.size)
        self._c.reduce_scatter(_address(input, "reduce_scatter input"), _address(output, "reduce_scatter output"),
                               output.numel(), _TYPES[output.dtype], op)
        return output

    def all_gather(self, output, input):
        """``output`` (size * n elements) = every rank's ``input`` (n elements) in rank order."""
        self._check_pair(output, input, "all_gather", output.numel() == input.numel() * self.size)
        self._c.all_gather(_address(input, "all_gather input"), _address(output, "all_gather output"), input.numel(),
                           _TYPES[input.dtype])
        return output

    def broadcast(self, tensor, src=0):
        self._c.broadcast(_address(tensor, "broadcast"), tensor.numel(), _TYPES[tensor.dtype], int(src))
        return tensor

    def barrier(self):
        self._c.barrier()

    def _check_pair(self, output, input, what, sizes_fit):
        if output.dtype != input.dtype:
            raise TypeError(f"{what}: input is {input.dtype}, output {output.dtype}")
        if not sizes_fit:
            raise ValueError(f"{what}: input of {input.numel()} and output of {output.numel()} elements do not fit "
                             f"a world of {self.size}")


class _TorchOps:
    """What distopt's C++ communicator calls to move bytes over a
    torch.distributed process group (with the GIL taken)."""

    def __init__(self, group, ranks=None):
        import torch.distributed as dist

        self._dist = dist
        self._group = group
        self._ranks = ranks  # each rank of this communicator's global rank (None: the default group's own)
        if group is not None and ranks is None:
            from torch.distributed import distributed_c10d as c10d

            global_rank = getattr(dist, "get_global_rank", None) or c10d._get_global_rank  # public from torch 2.0
            self._ranks = [global_rank(group, r) for r in range(dist.get_world_size(group))]

    def _peer(self, r):
        return r if self._ranks is None else self._ranks[r]

    def isend(self, view, peer, tag):
        t = torch.frombuffer(view, dtype=torch.uint8)
        return (self._dist.isend(t, self._peer(peer), group=self._group, tag=tag), t)

    def irecv(self, view, peer, tag):
        t = torch.frombuffer(view, dtype=torch.uint8)
        return (self._dist.irecv(t, self._peer(peer), group=self._group, tag=tag), t)

    @staticmethod
    def wait(work, seconds):
        work[0].wait(datetime.timedelta(seconds=seconds))

    def cannot_split(self):
        """Why Communicator.split cannot run here ("" when it can): torch's
        new_group is collective over the default group, so only a
        communicator of every process splits."""
        if self._group is not None and self._dist.get_world_size(self._group) != self._dist.get_world_size():
            return ("the torch.distributed transport splits only a communicator of every process "
                    "(torch's new_group needs them all); this one has "
                    f"{self._dist.get_world_size(self._group)} of {self._dist.get_world_size()}")
        return ""

    def split(self, groups, mine):
        """Communicator.split over torch: ``groups`` (lists of this
        communicator's ranks in their new order, every process the same)
        become process groups of this one's backend, made in order by every
        process (torch's new_group is collective over the default group);
        the one at index ``mine`` is this process's (-1: none). The new
        communicator's ranks are the list's order, not torch's (new_group
        sorts its ranks)."""
        backend = self._dist.get_backend(self._group)
        made = [self._dist.new_group([self._peer(r) for r in g], backend=backend) for g in groups]
        if mine < 0:
            return None
        return _TorchOps(made[mine], [self._peer(r) for r in groups[mine]])


_groups = {}


def from_process_group(group=None):
    """A communicator over a torch.distributed process group (the default
    one when None; one communicator per group, made once). Its collectives
    are distopt's, built from the group's point-to-point messages: the same
    bits as over MPI. The group must carry CPU tensors (gloo or mpi)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized (call torch.distributed.init_process_group first)")
    key = id(group) if group is not None else None
    if key not in _groups:
        backend = dist.get_backend(group)
        if not _carries_cpu_tensors(backend):
            raise ValueError(f"the process group's backend is {backend}; distopt.torch.comm moves CPU tensors, "
                             "so it needs gloo (init_process_group('gloo'), or a gloo group from new_group)")
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("this process is not a member of the process group")
        _groups[key] = (group, Communicator(_core.torch_comm(rank, dist.get_world_size(group), _TorchOps(group))))
    return _groups[key][1]


_mpi = None


def mpi_world():
    """distopt's MPI communicator over MPI_COMM_WORLD (the process must run
    under mpirun). MPI is initialized once and finalized at exit."""
    global _mpi
    if _mpi is None:
        if not _core.mpi_built():
            raise RuntimeError("this build of distopt has no MPI (install libopenmpi-dev and rebuild)")
        # Open MPI's plugins resolve libmpi's symbols globally.
        import ctypes

        for name in ("libmpi.so.40", "libmpi.so"):
            try:
                ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
                break
            except OSError:
                continue
        _mpi = Communicator(_core.mpi_world())
    return _mpi


# Registered at import, so it runs after the exit handlers registered later
# (which may still communicate); a no-op when MPI was never started.
atexit.register(_core.mpi_finalize)


def single():
    """A communicator of one rank."""
    return Communicator(_core.single())


_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


_beside = {}  # default group -> the gloo group made beside it (one that moves no CPU tensors: NCCL)


def _carries_cpu_tensors(backend):
    return backend == "mpi" or "gloo" in str(backend)  # "gloo", or "cpu:gloo,cuda:nccl"


def _host_group():
    """None (the default group) where it carries CPU tensors; else a gloo
    group over the same ranks, made once per default group (collective, as
    the first ``world()`` call is on every rank)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if _carries_cpu_tensors(dist.get_backend()):
        return None
    default = c10d._get_default_group()
    key = id(default)
    if key not in _beside or _beside[key][0] is not default:
        _beside[key] = (default, dist.new_group(backend="gloo"))
    return _beside[key][1]


def world():
    """The process group's communicator when torch.distributed is
    initialized (under an NCCL default group, that of a gloo group made
    beside it over the same ranks); MPI's under mpirun; under torchrun (RANK and WORLD_SIZE
    set, with MASTER_ADDR and MASTER_PORT) torch's own gloo group,
    initialized here from those variables (env://: torch's store on
    MASTER_PORT, never a second one) and destroyed at exit; otherwise a
    single rank. RANK and WORLD_SIZE without the other two, or a group
    that cannot form, is a one-line RuntimeError, never a silent single
    rank. Under srun (a SLURM job step of several tasks), a gloo group
    from SLURM_PROCID and SLURM_STEP_NUM_TASKS, torch's store on the step's
    first node (docs/cluster.md). (A program that wants an NCCL default
    group initialises it itself, before this.)"""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return from_process_group(_host_group())
    if _core.launched_by_mpirun():
        return mpi_world()
    given = [v for v in _TORCHRUN_VARS if os.environ.get(v)]
    if os.environ.get("RANK") and os.environ.get("WORLD_SIZE"):
        missing = [v for v in _TORCHRUN_VARS if v not in given]
        if missing:
            raise RuntimeError(f"{', '.join(given)} set but not {', '.join(missing)}: a torchrun launch sets all four "
                               "(or call torch.distributed.init_process_group yourself)")
        if not dist.is_available():
            raise RuntimeError("torchrun's variables are set but this torch has no torch.distributed")
        return _gloo_world(dist, f"from RANK={os.environ['RANK']} WORLD_SIZE={os.environ['WORLD_SIZE']} "
                                 f"MASTER_ADDR={os.environ['MASTER_ADDR']} MASTER_PORT={os.environ['MASTER_PORT']}",
                           init_method="env://")
    launched = _core.launch_env()  # ValueError, in one line, for malformed variables
    if launched is not None and launched["launcher"] == "srun" and launched["world"] > 1:
        return _srun_world(dist, launched)
    return single()


def _srun_world(dist, launched):
    """A gloo process group for a SLURM job step's tasks: rank and world
    from SLURM_PROCID and SLURM_STEP_NUM_TASKS, torch's TCP store at
    MASTER_ADDR (default: the step's first node) and MASTER_PORT (default:
    _core.slurm_port of the step), destroyed at exit."""
    if not dist.is_available():
        raise RuntimeError("srun's variables are set but this torch has no torch.distributed")
    addr, port = launched["master_addr"], launched["master_port"]
    if not addr:
        raise RuntimeError("under srun, SLURM_STEP_NODELIST (or MASTER_ADDR) names the host of rank 0; neither is set")
    return _gloo_world(dist, f"under srun (rank {launched['rank']} of {launched['world']}, store at {addr}:{port}; "
                             "set MASTER_PORT for another)",
                       init_method=f"tcp://{addr}:{port}", rank=launched["rank"], world_size=launched["world"])


def _gloo_world(dist, launch, **init):
    """The default group's communicator after init_process_group('gloo',
    **init); its failure is one RuntimeError line naming ``launch``. The
    group is destroyed at exit, before the interpreter tears down: a gloo
    group left to it can abort the process ("terminate called without an
    active exception")."""
    try:
        dist.init_process_group("gloo", **init)
    except Exception as e:  # noqa: BLE001 - one line naming the launch, whatever torch raised
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RuntimeError(f"torch.distributed.init_process_group('gloo') {launch} failed: {first}") from e
    atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    return from_process_group()


class PushSum:
    """Push-sum gossip averaging of a float32 tensor over a topology
    (exponential, ring, ...; docs/gossip.md): each ``mix(x)`` sends shares of
    (x, w) to this round's peers and adds what arrives; ``x / weight``
    approaches the ranks' average."""

    def __init__(self, comm, numel, topology="exponential", peers_per_iteration=1):
        self._comm = comm
        self._numel = int(numel)
        self._c = _core.PushSum(comm._c, topology, self._numel, int(peers_per_iteration))
        self.weight = 1.0

    def mix(self, x):
        if x.dtype != torch.float32 or x.numel() != self._numel:
            raise ValueError(f"PushSum.mix: expected {self._numel} float32 elements, got {x.numel()} of {x.dtype}")
        self.weight = self._c.mix(_address(x, "PushSum.mix"), self._numel, self.weight)
        return x
