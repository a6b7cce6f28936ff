#!/usr/bin/python3
"""A PyTorch user's training loop with distopt's AdamW.

A torch.nn MLP (784-256-128-10) on Fashion-MNIST, read by distopt's reader,
trained with distopt.torch.optim.AdamW and torch's OneCycleLR; --torch runs
the same loop with torch.optim.AdamW for comparison. Prints the test
accuracy and the time per epoch.

  PYTHONPATH=build/python /usr/bin/python3 examples/python/fashion_mnist_mlp.py [--epochs 1] [--torch]
"""

import argparse
import time

import torch

from distopt.data import fashion_mnist
from distopt.torch import optim


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--torch", action="store_true", help="torch.optim.AdamW instead of distopt's")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    x, y = fashion_mnist("train")
    xt, yt = fashion_mnist("test")
    model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128),
                                torch.nn.ReLU(), torch.nn.Linear(128, 10))
    cls = torch.optim.AdamW if args.torch else optim.AdamW
    opt = cls(model.parameters(), lr=args.lr, weight_decay=1e-2)
    steps = args.epochs * ((len(x) + args.batch_size - 1) // args.batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=steps)
    for epoch in range(args.epochs):
        t0 = time.perf_counter()
        order = torch.randperm(len(x))
        for b in range(0, len(x), args.batch_size):
            idx = order[b:b + args.batch_size]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            sched.step()
        with torch.no_grad():
            acc = (model(xt).argmax(1) == yt).float().mean().item()
        print(f"epoch {epoch + 1}: test accuracy {acc:.4f} ({time.perf_counter() - t0:.1f} s, "
              f"{cls.__module__}.{cls.__name__})")


if __name__ == "__main__":
    main()
