#!/usr/bin/python3
"""fashion_mnist_mlp.py's loop on several processes with distopt's
ShardedOptimizer (data parallel, optimizer state sharded).

Every rank holds the model; each global batch of 128 is cut into one slice
per rank; ShardedOptimizer reduces the gradients in distopt's fixed rank
order, steps this rank's shard of every tensor and gathers the parameters
back. Start it as an MPI job, or with torch's launcher and gloo:

  PYTHONPATH=build/python mpirun -np 2 /usr/bin/python3 examples/python/fashion_mnist_sharded.py
  PYTHONPATH=build/python /usr/bin/python3 -m torch.distributed.run --nproc_per_node 2 \\
      examples/python/fashion_mnist_sharded.py --gloo

The same seed gives the same bits over either transport and under ddp,
zero1 or zero2 (--strategy).
"""

import argparse
import time

import torch

from distopt.data import fashion_mnist
from distopt.torch import comm
from distopt.torch.distributed import ShardedOptimizer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=128, help="the global batch, cut over the ranks")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--optimizer", default="adamw", help="a distopt rule: adamw, lamb, lars, adafactor, muon, ...")
    ap.add_argument("--strategy", default="zero1", choices=("ddp", "zero1", "zero2"))
    ap.add_argument("--gloo", action="store_true", help="a torch.distributed gloo process group (torchrun)")
    args = ap.parse_args()
    if args.gloo:
        torch.distributed.init_process_group("gloo")
    c = comm.world()
    rank, world = c.rank, c.size
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} does not divide over {world} ranks")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    x, y = fashion_mnist("train")
    xt, yt = fashion_mnist("test")
    model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128),
                                torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = ShardedOptimizer(model.parameters(), args.optimizer, args.strategy, comm=c, lr=args.lr, weight_decay=1e-2)
    steps = args.epochs * (len(x) // args.batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=steps)
    local = args.batch_size // world
    for epoch in range(args.epochs):
        t0 = time.perf_counter()
        order = torch.randperm(len(x))  # the same on every rank (same seed)
        for b in range(0, len(x) - args.batch_size + 1, args.batch_size):
            idx = order[b + rank * local:b + (rank + 1) * local]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            sched.step()
        with torch.no_grad():
            acc = (model(xt).argmax(1) == yt).float().mean().item()
        if rank == 0:
            print(f"epoch {epoch + 1}: test accuracy {acc:.4f} ({time.perf_counter() - t0:.1f} s, {world} ranks over "
                  f"{c.backend}, {args.optimizer} {args.strategy}; optimizer state {opt.memory()['optimizer_state']} "
                  "bytes per rank)")
    if args.gloo:
        torch.distributed.destroy_process_group()  # before exit, as torch asks


if __name__ == "__main__":
    main()
