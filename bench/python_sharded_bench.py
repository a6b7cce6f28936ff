#!/usr/bin/python3
"""distopt's sharded optimizers from Python vs torch's DDP +
ZeroRedundancyOptimizer (docs/python.md, "Speed and memory against
ZeroRedundancyOptimizer"; docs/performance.md).

The same model, the same global batch cut over the ranks, AdamW. Models:
``mlp`` (784-2048-2048-2048-10, 10.5M parameters), ``transformer`` (a
torch.nn GPT of distopt's gpt shape: 8 pre-norm layers of width 256, 4
heads, sequence 64, 6.4M parameters) and ``transformer-wide`` (width 512,
8 heads: 25.3M). Each configuration runs in its own launch so that its
peak RSS is its own:

  torch    DistributedDataParallel + ZeroRedundancyOptimizer(AdamW), gloo
  gloo:S   distopt over the same gloo process group: ShardedOptimizer with
           strategy S (zero1, zero2), or FullyShardedDataParallel (zero3,
           one unit per layer)
  mpi:S    the same over distopt's MPI communicator

Reports the median time of a training step (forward, backward, optimizer)
and of the optimizer's part, and each rank's peak RSS, whole and above the
RSS the rank had before it made the model (torch and the communicator
loaded), rank 0's line per configuration:

  PYTHONPATH=build/python /usr/bin/python3 bench/python_sharded_bench.py \
      [--model mlp|transformer|transformer-wide] [--steps 30] [--world 2] [--modes torch,mpi:zero1,...]

Run it with OpenBLAS as the BLAS alternative (scripts/install-deps
--golden): Debian's generic BLAS slows both sides' matrix products.
"""

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

# Debian's torch 1.13 launcher under Python 3.11 fails on its default
# --redirects 0 / --tee 0 (its Std.from_str finds no flag of value 0; fixed
# in torch 2.0): name stdout for both, which keeps it on the console.
TORCHRUN_FIX = ("--redirects", "1", "--tee", "1") if torch.__version__.startswith("1.") else ()

HERE = os.path.abspath(__file__)
MMAP = 0  # --mmap-threshold


class GPT(torch.nn.Module):
    """A decoder-only transformer of torch.nn layers (pre-norm, causal)."""

    def __init__(self, width, layers=8, heads=None, vocab=96, seq=64):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.pos = torch.nn.Parameter(torch.zeros(seq, width))
        self.blocks = torch.nn.ModuleList([
            torch.nn.TransformerEncoderLayer(width, heads or width // 64, 4 * width, dropout=0.0, batch_first=True,
                                             norm_first=True) for _ in range(layers)])
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1))

    def forward(self, idx):
        h = self.embed(idx) + self.pos
        for b in self.blocks:
            h = b(h, src_mask=self.mask)
        return self.head(self.norm(h)).flatten(0, 1)


def model_of(kind):
    torch.manual_seed(0)
    if kind == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(784, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                                   torch.nn.ReLU(), torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
                                   torch.nn.Linear(2048, 10))
    return GPT(256 if kind == "transformer" else 512)


def batch_of(kind, n):
    g = torch.Generator().manual_seed(1)
    if kind == "mlp":
        return torch.randn(n, 784, generator=g), torch.randint(0, 10, (n,), generator=g)
    tokens = torch.randint(0, 96, (n, 65), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(kind, mode, steps, batch):
    import torch.distributed as dist

    from distopt.torch import comm as dcomm
    from distopt.torch.distributed import FullyShardedDataParallel, ShardedOptimizer

    torch.set_num_threads(1)
    transport, _, strategy = mode.partition(":")
    if transport != "mpi":
        dist.init_process_group("gloo")
    c = dcomm.world()
    rank, world = c.rank, c.size
    base = rss_mib()
    model = model_of(kind)
    if mode == "torch":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    elif strategy == "zero3":
        wrap = dict(min_num_params=1 << 20) if kind == "mlp" else dict(wrap=torch.nn.TransformerEncoderLayer)
        net = FullyShardedDataParallel(model, optimizer="adamw", comm=c, lr=1e-3, **wrap)
        opt = net.optimizer
    else:
        net = model
        opt = ShardedOptimizer(model.parameters(), "adamw", strategy, comm=c, lr=1e-3)
    x, y = batch_of(kind, batch)
    local = batch // world
    xs, ys = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
    step_s, opt_s = [], []
    for _ in range(steps):
        c.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(xs), ys.reshape(-1)).backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        step_s.append(t2 - t0)
        opt_s.append(t2 - t1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    mine = torch.tensor([peak, peak - base], dtype=torch.float64)
    peaks = torch.empty(2 * world, dtype=torch.float64)
    c.all_gather(peaks, mine)
    if rank == 0:
        skip = min(3, steps - 1)  # warm-up
        print(json.dumps({"mode": mode, "world": world, "step_ms": 1e3 * statistics.median(step_s[skip:]),
                          "optimizer_ms": 1e3 * statistics.median(opt_s[skip:]),
                          "peak_rss_mib": [round(v, 1) for v in peaks.tolist()[0::2]],
                          "above_start_mib": [round(v, 1) for v in peaks.tolist()[1::2]]}))
    if transport != "mpi":
        dist.destroy_process_group()  # before exit, as torch asks


def launch(kind, mode, world, steps, batch):
    env = dict(os.environ, OMP_NUM_THREADS="1", **({"MALLOC_MMAP_THRESHOLD_": str(MMAP)} if MMAP else {}), OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", OMPI_MCA_btl_vader_single_copy_mechanism="none")
    args = [HERE, "--worker", mode, "--model", kind, "--steps", str(steps), "--batch", str(batch)]
    with tempfile.TemporaryDirectory() as logs:  # torchrun's logs, removed after
        if mode.startswith("mpi"):
            cmd = [shutil.which("mpirun"), "-n", str(world), sys.executable, *args]
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            cmd = [sys.executable, "-m", "torch.distributed.run", *TORCHRUN_FIX, "--log_dir", logs, "--nnodes", "1",
                   "--nproc_per_node", str(world), "--master_addr", "127.0.0.1", "--master_port", str(port), *args]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"{mode} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        out = r.stdout
    # torchrun's --tee prefixes the lines with "[default0]:".
    return json.loads([line[line.index("{"):] for line in out.splitlines() if '{"mode"' in line][-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--model", default="mlp", choices=["mlp", "transformer", "transformer-wide"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=None, help="the global batch (mlp: 256 rows, transformers: 16 "
                    "sequences of 64)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--mmap-threshold", type=int, default=0,
                    help="glibc's M_MMAP_THRESHOLD in bytes for every rank (0: glibc's dynamic one, which "
                    "keeps freed blocks of up to 32 MiB in the heap, so RSS grows with each step's "
                    "transient tensors)")
    ap.add_argument("--modes", default="torch,gloo:zero1,gloo:zero2,gloo:zero3,mpi:zero1,mpi:zero2,mpi:zero3")
    a = ap.parse_args()
    batch = a.batch or (256 if a.model == "mlp" else 16)
    if a.worker:
        worker(a.model, a.worker, a.steps, batch)
        return
    global MMAP
    MMAP = a.mmap_threshold
    modes = a.modes.split(",")
    rows = [launch(a.model, m, a.world, a.steps, batch) for m in modes]
    base = rows[0]
    blas = os.path.basename(os.path.dirname(os.path.realpath("/etc/alternatives/libblas.so.3-x86_64-linux-gnu")))
    shape = {"mlp": "MLP 784-2048-2048-2048-10", "transformer": "torch.nn GPT 8 x 256 (seq 64)",
             "transformer-wide": "torch.nn GPT 8 x 512 (seq 64)"}[a.model]
    print(f"{shape}, AdamW, global batch {batch}, world {a.world}, one thread per rank, "
          f"BLAS {blas}, {'M_MMAP_THRESHOLD ' + str(MMAP) if MMAP else 'glibc malloc defaults'}; "
          "speed vs the first row")
    print(f"{'configuration':<46} {'step ms':>8} {'opt ms':>8} {'speed':>7} {'peak RSS MiB per rank':>30} "
          f"{'above start':>24}")
    names = {"torch": "torch DDP + ZeroRedundancyOptimizer (gloo)"}
    for m in modes:
        transport, _, strategy = m.partition(":")
        if m != "torch":
            what = "FullyShardedDataParallel" if strategy == "zero3" else f"ShardedOptimizer {strategy}"
            names[m] = f"distopt {what} ({'MPI' if transport == 'mpi' else 'gloo'})"
    for r in rows:
        print(f"{names[r['mode']]:<46} {r['step_ms']:8.1f} {r['optimizer_ms']:8.1f} "
              f"{base['step_ms'] / r['step_ms']:6.2f}x {', '.join(str(v) for v in r['peak_rss_mib']):>30} "
              f"{', '.join(str(v) for v in r['above_start_mib']):>24}")


if __name__ == "__main__":
    main()
