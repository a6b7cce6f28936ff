#!/usr/bin/python3
"""Decentralised training of a torch.nn MLP on Fashion-MNIST with
Stochastic Gradient Push (or any of distopt's gossip strategies, DiLoCo
included) through GossipDataParallel.

Every rank holds its own model and draws its own batches; after each step
it pushes a share of its model to its peers on the topology (sgp:
push-sum on the time-varying exponential graph) instead of all-reducing
gradients. The ranks' models stay close, not equal: the consensus distance
says how close, and the test accuracy is measured on their average. Start
it as an MPI job, or with torch's launcher and gloo:

  PYTHONPATH=build/python mpirun -np 4 /usr/bin/python3 examples/python/fashion_mnist_gossip.py
  PYTHONPATH=build/python /usr/bin/python3 -m torch.distributed.run --nproc_per_node 4 \\
      examples/python/fashion_mnist_gossip.py --gloo
  ... fashion_mnist_gossip.py --strategy diloco --optimizer adamw --lr 3e-3 --sync-every 50

The bits are distopt's C++ strategy's on the same gradients (over either
transport), and --checkpoint DIR saves every rank's own state each epoch
and resumes from the latest.
"""

import argparse
import os
import time

import torch

from distopt.data import fashion_mnist
from distopt.torch import comm
from distopt.torch.distributed import GOSSIP_STRATEGIES, GossipDataParallel


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=32, help="each rank's own batch")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--optimizer", default="sgd", help="the inner rule: sgd (momentum 0.9), adamw, lamb, ...")
    ap.add_argument("--strategy", default="sgp", choices=GOSSIP_STRATEGIES)
    ap.add_argument("--topology", help="the gossip graph (default: the strategy's)")
    ap.add_argument("--sync-every", type=int, help="diloco: inner steps between outer steps")
    ap.add_argument("--max-steps", type=int, help="stop an epoch after this many steps (a quick look)")
    ap.add_argument("--checkpoint", help="a folder: saved after every epoch, resumed from when it holds one")
    ap.add_argument("--gloo", action="store_true", help="a torch.distributed gloo process group (torchrun)")
    args = ap.parse_args()
    if args.gloo:
        torch.distributed.init_process_group("gloo")
    c = comm.world()
    rank, world = c.rank, c.size
    torch.manual_seed(0)
    torch.set_num_threads(1)
    x, y = fashion_mnist("train")
    xt, yt = fashion_mnist("test")
    model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128),
                                torch.nn.ReLU(), torch.nn.Linear(128, 10))
    options = dict(lr=args.lr)
    if args.optimizer == "sgd":
        options["momentum"] = 0.9
    if args.topology:
        options["topology"] = args.topology
    if args.sync_every:
        options["sync_every"] = args.sync_every
    model = GossipDataParallel(model, args.strategy, optimizer=args.optimizer, comm=c, **options)
    opt = model.optimizer
    steps_per_epoch = len(x) // (args.batch_size * world)  # each rank sees 1/world of an epoch's samples
    if args.max_steps:
        steps_per_epoch = min(steps_per_epoch, args.max_steps)
    first_epoch = 0
    if args.checkpoint and os.path.isdir(args.checkpoint) and os.listdir(args.checkpoint):
        first_epoch = opt.load(args.checkpoint) // steps_per_epoch
        if rank == 0:
            print(f"resumed from {args.checkpoint} after epoch {first_epoch}")
    for epoch in range(first_epoch, args.epochs):
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(1000 * epoch + rank)  # each rank its own order
        order = torch.randperm(len(x), generator=g)
        model.train()
        for k in range(steps_per_epoch):
            idx = order[k * args.batch_size:(k + 1) * args.batch_size]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
        consensus = model.consensus_distance()
        model.eval()
        with model.averaged(), torch.no_grad():
            acc = (model(xt).argmax(1) == yt).float().mean().item()
        if args.checkpoint:
            opt.save(args.checkpoint, opt.steps)
        if rank == 0:
            print(f"epoch {epoch + 1}: test accuracy {acc:.4f} of the ranks' average, consensus distance "
                  f"{consensus:.3g} ({time.perf_counter() - t0:.1f} s, {world} ranks over {c.backend}, "
                  f"{args.strategy} with {args.optimizer}; {model.bytes_sent / 1e6:.1f} MB sent by rank 0)")
    del model, opt  # rounds still in flight end over the group, before it goes
    if args.gloo:
        torch.distributed.destroy_process_group()  # before exit, as torch asks


if __name__ == "__main__":
    main()
