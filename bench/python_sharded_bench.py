#!/usr/bin/python3
"""ShardedOptimizer zero2 vs torch's ZeroRedundancyOptimizer at world 2
(docs/python.md, "The sharded optimizer": speed and memory).

The same model (an MLP, 784-2048-2048-2048-10, 10.5M parameters), the same
global batch cut over the ranks, AdamW. Each configuration runs in its own
launch so that its peak RSS is its own:

  torch    DistributedDataParallel + ZeroRedundancyOptimizer(AdamW), gloo
  gloo:S   distopt ShardedOptimizer, strategy S (zero2, zero1), over the
           same gloo process group
  mpi:S    the same over distopt's MPI communicator

Reports the median time of a training step (forward, backward, optimizer)
and of the optimizer's part, and each rank's peak RSS, rank 0's line per
configuration:

  PYTHONPATH=build/python /usr/bin/python3 bench/python_sharded_bench.py [--steps 30] [--world 2]
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


def model_of():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(784, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                               torch.nn.ReLU(), torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
                               torch.nn.Linear(2048, 10))


def worker(mode, steps, batch):
    import torch.distributed as dist

    from distopt.torch import comm as dcomm
    from distopt.torch.distributed import ShardedOptimizer

    torch.set_num_threads(1)
    transport, _, strategy = mode.partition(":")
    if transport != "mpi":
        dist.init_process_group("gloo")
    c = dcomm.world()
    rank, world = c.rank, c.size
    model = model_of()
    if mode == "torch":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    else:
        net = model
        opt = ShardedOptimizer(model.parameters(), "adamw", strategy, comm=c, lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 784, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    local = batch // world
    xs, ys = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
    step_s, opt_s = [], []
    for _ in range(steps):
        c.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(xs), ys).backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        step_s.append(t2 - t0)
        opt_s.append(t2 - t1)
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64)
    peaks = torch.empty(world, dtype=torch.float64)
    c.all_gather(peaks, peak)
    if rank == 0:
        skip = min(3, steps - 1)  # warm-up
        print(json.dumps({"mode": mode, "world": world, "step_ms": 1e3 * statistics.median(step_s[skip:]),
                          "optimizer_ms": 1e3 * statistics.median(opt_s[skip:]),
                          "peak_rss_mib": [round(v, 1) for v in peaks.tolist()]}))
    if transport != "mpi":
        dist.destroy_process_group()  # before exit, as torch asks


def launch(mode, world, steps, batch):
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", OMPI_MCA_btl_vader_single_copy_mechanism="none")
    args = [HERE, "--worker", mode, "--steps", str(steps), "--batch", str(batch)]
    with tempfile.TemporaryDirectory() as logs:  # torchrun's logs, removed after
        if mode.startswith("mpi"):
            cmd = [shutil.which("mpirun"), "-n", str(world), sys.executable, *args]
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            cmd = [sys.executable, "-m", "torch.distributed.run", *TORCHRUN_FIX, "--log_dir", logs, "--nnodes", "1",
                   "--nproc_per_node", str(world), "--master_addr", "127.0.0.1", "--master_port", str(port), *args]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    # torchrun's --tee prefixes the lines with "[default0]:".
    return json.loads([line[line.index("{"):] for line in out.splitlines() if '{"mode"' in line][-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=256, help="the global batch")
    ap.add_argument("--world", type=int, default=2)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker, a.steps, a.batch)
        return
    modes = ("torch", "gloo:zero2", "mpi:zero2", "gloo:zero1", "mpi:zero1")
    rows = [launch(m, a.world, a.steps, a.batch) for m in modes]
    base = rows[0]
    print(f"MLP 784-2048-2048-2048-10, AdamW, global batch {a.batch}, world {a.world}, one thread per rank")
    print(f"{'configuration':<44} {'step ms':>8} {'opt ms':>8} {'vs torch':>9} {'peak RSS MiB per rank':>24}")
    names = {"torch": "torch DDP + ZeroRedundancyOptimizer (gloo)"}
    for m in modes[1:]:
        transport, _, strategy = m.partition(":")
        names[m] = f"distopt ShardedOptimizer {strategy} ({'MPI' if transport == 'mpi' else 'gloo'})"
    for r in rows:
        print(f"{names[r['mode']]:<44} {r['step_ms']:8.1f} {r['optimizer_ms']:8.1f} "
              f"{base['step_ms'] / r['step_ms']:8.2f}x {', '.join(str(v) for v in r['peak_rss_mib']):>24}")


if __name__ == "__main__":
    main()
