#!/usr/bin/python3
"""The `distopt train` MLP workload in PyTorch, for a same-run comparison.

The identical model (784-256-128-10 nn.Linear + ReLU, torch's default
initialization), softmax cross-entropy, the same optimizer and options, the
same global batch size with the last partial batch kept, pixels scaled to
[0, 1], read from the same Debian dataset-fashion-mnist files. The training
data lives in one tensor and batches are gathered by index, so no
DataLoader overhead is counted against torch.

Threads: Debian's torch runs its GEMMs in OpenBLAS, whose threads
torch.set_num_threads does not govern, and its other ops on OpenMP threads.
--threads T sets both to T; --omp-threads overrides the OpenMP count (on
this 2-core machine torch is fastest with 1 OpenMP and 2 OpenBLAS threads:
OpenMP's spinning workers otherwise compete with OpenBLAS's). The script
re-executes itself with OMP_NUM_THREADS, MKL_NUM_THREADS and
OPENBLAS_NUM_THREADS set.

Prints one JSON line: samples_per_s (training only, evaluation excluded, as
distopt counts), test_accuracy and test_loss after the last epoch.
Usage: /usr/bin/python3 bench/torch_train.py [--epochs 1] [--threads 1] [--optimizer adamw] [--lr 1e-3]
"""
import argparse
import gzip
import json
import os
import sys
import time

DATA = os.environ.get("DISTOPT_FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--omp-threads", type=int, default=0, help="OpenMP threads (default: --threads)")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd"])
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    omp = str(args.omp_threads or args.threads)
    want = {"OMP_NUM_THREADS": omp, "MKL_NUM_THREADS": omp, "OPENBLAS_NUM_THREADS": str(args.threads)}
    if any(os.environ.get(k) != v for k, v in want.items()):
        os.execve(sys.executable, [sys.executable] + sys.argv, dict(os.environ, **want))

    import numpy as np
    import torch

    torch.set_num_threads(int(omp))
    torch.manual_seed(args.seed)

    def idx(name, offset):
        return np.frombuffer(gzip.open(os.path.join(DATA, name)).read(), dtype=np.uint8, offset=offset)

    xtr = torch.from_numpy(idx("train-images-idx3-ubyte.gz", 16).reshape(-1, 784).astype(np.float32) / 255.0)
    ytr = torch.from_numpy(idx("train-labels-idx1-ubyte.gz", 8).astype(np.int64))
    xte = torch.from_numpy(idx("t10k-images-idx3-ubyte.gz", 16).reshape(-1, 784).astype(np.float32) / 255.0)
    yte = torch.from_numpy(idx("t10k-labels-idx1-ubyte.gz", 8).astype(np.int64))

    model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128),
                                torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[args.optimizer](
        model.parameters(), lr=args.lr)
    loss_fn = torch.nn.CrossEntropyLoss()
    n, b = xtr.shape[0], args.batch_size
    train_time = 0.0
    samples = 0
    for epoch in range(args.epochs):
        perm = torch.randperm(n)
        t0 = time.perf_counter()
        for k in range(0, n, b):
            i = perm[k:k + b]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(xtr[i]), ytr[i])
            loss.backward()
            opt.step()
            samples += i.numel()
        train_time += time.perf_counter() - t0
    with torch.no_grad():
        logits = model(xte)
        test_loss = loss_fn(logits, yte).item()
        acc = (logits.argmax(1) == yte).float().mean().item()
    print(json.dumps({"framework": "torch " + torch.__version__, "threads": args.threads, "omp_threads": int(omp), "epochs": args.epochs,
                      "samples_per_s": samples / train_time, "test_accuracy": acc, "test_loss": test_loss}))


if __name__ == "__main__":
    main()
