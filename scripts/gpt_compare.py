#!/usr/bin/env python3
"""Trains distopt's model "gpt" and the identical PyTorch model
(scripts/gpt_torch.py) on the same bytes in the same order, from the same
initial weights, with the same optimizer and schedule, and compares the
validation loss and the training speed (docs/performance.md, "gpt").

    python3 scripts/gpt_compare.py --distopt build/bin/distopt            # the default run
    python3 scripts/gpt_compare.py --steps 50 --threads 1                 # a quick look

For each thread count T: PyTorch with torch.set_num_threads(T), and distopt
with T ranks (--world T, ddp on the threads backend; the global batch is
the same) or, with --parallel threads, one rank on T threads (--threads T).
--matmul-precision bf16 runs distopt's products in bfloat16 and PyTorch's
forward under torch.autocast("cpu", dtype=torch.bfloat16), each side's
bfloat16 at its best. Batches: distopt's BatchSampler order and text windows
(src/data/sampler.cpp, src/data/text.cpp), reimplemented here bit for bit
(xoshiro256**, Lemire's bounded integers, Fisher-Yates). Needs
python3-torch with OpenBLAS as the BLAS (libopenblas0-pthread) and
python3-numpy. Prints one JSON object per thread count and a table.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_torch import Gpt  # noqa: E402
from safetensors_np import read_safetensors  # noqa: E402

M64 = (1 << 64) - 1


def splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def rotl(x, k):
    return ((x << k) | (x >> (64 - k))) & M64


class Rng:
    """distopt::Rng (include/distopt/core/random.hpp)."""

    def __init__(self, seed, stream=0):
        x = splitmix64(seed) ^ splitmix64((stream + 0x632BE59BD9B4E019) & M64)
        self.s = []
        for _ in range(4):
            x = splitmix64(x)
            self.s.append(x)

    def next(self):
        s = self.s
        result = (rotl((s[1] * 5) & M64, 7) * 9) & M64
        t = (s[1] << 17) & M64
        s[2] ^= s[0]
        s[3] ^= s[1]
        s[1] ^= s[2]
        s[0] ^= s[3]
        s[2] ^= t
        s[3] = rotl(s[3], 45)
        return result

    def below(self, n):
        m = self.next() * n
        low = m & M64
        if low < n:
            threshold = ((1 << 64) - n) % n
            while low < threshold:
                m = self.next() * n
                low = m & M64
        return m >> 64


def splitmix64_raw(x):
    """distopt's splitmix64 as random.hpp writes it (the increment first)."""
    return splitmix64(x)


def fortunes(directory):
    files = sorted(f for f in os.listdir(directory)
                   if os.path.isfile(os.path.join(directory, f)) and not os.path.islink(os.path.join(directory, f))
                   and not f.endswith(".dat") and not f.endswith(".u8"))
    data = b"".join(open(os.path.join(directory, f), "rb").read() for f in files)
    val = len(data) // 10
    return np.frombuffer(data[:len(data) - val], dtype=np.uint8), np.frombuffer(data[len(data) - val:], dtype=np.uint8)


def epoch_order(size, seed, epoch):
    order = list(range(size))
    rng = Rng(seed, 0x5EED0000 + epoch)
    for i in range(size, 1, -1):
        j = rng.below(i)
        order[i - 1], order[j] = order[j], order[i - 1]
    return order


def window_start(seed, epoch, i, positions):
    return Rng(seed ^ 0x7E47, ((epoch << 32) ^ i) & M64).below(positions)


def batches(train, context, batch, seed, steps):
    """The token windows of distopt's first `steps` global batches."""
    size = len(train) // context
    per_epoch = (size + batch - 1) // batch
    positions = len(train) - context
    out, epoch, order = [], -1, None
    for k in range(steps):
        e = k // per_epoch
        if e != epoch:
            epoch, order = e, epoch_order(size, seed, e)
        idx = order[(k % per_epoch) * batch:(k % per_epoch + 1) * batch]
        starts = [window_start(seed, e, i, positions) for i in idx]
        out.append(np.stack([train[s:s + context + 1] for s in starts]).astype(np.int64))
    return out


def val_windows(val, context, count):
    n = min((len(val) - 1) // context, count)
    return np.stack([val[w * context:w * context + context + 1] for w in range(n)]).astype(np.int64)


def torch_run(args, init, train_batches, val, threads):
    """threads: torch.set_num_threads's value (OpenMP's and OpenBLAS's come
    from the environment the parent set)."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    bf16 = args.matmul_precision == "bf16"
    model = Gpt(args.layers, args.heads, args.dim, args.context)
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in init.items()})
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    w = args.warmup
    sched = torch.optim.lr_scheduler.SequentialLR(
        opt, [torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0 / w, end_factor=1.0, total_iters=max(w - 1, 1)),
              torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps - w, eta_min=0.0)], milestones=[w])
    losses = []
    start = time.perf_counter()
    for b in train_batches:
        x = torch.from_numpy(b)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            _, loss = model(x[:, :-1], x[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(val), args.batch):
            v = torch.from_numpy(val[i:i + args.batch])
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                _, loss = model(v[:, :-1], v[:, 1:])
            total += loss.item() * len(v)
            count += len(v)
    tokens = len(train_batches) * args.batch * args.context
    return {"val_loss": total / count, "train_loss_last": float(np.mean(losses[-20:])), "tokens_per_s": tokens / seconds,
            "seconds": seconds, "losses": losses}


def pinned(threads):
    """Runs a command on CPUs 0..threads-1 (both peers get the same cores)."""
    return ["taskset", "-c", f"0-{threads - 1}"]


def distopt_cmd(args, threads, steps, extra):
    world, per_rank = (threads, 1) if args.parallel == "ranks" else (1, threads)
    return pinned(threads) + [args.distopt, "train", "--model", "gpt", "--data", "fortunes", "--data-dir", args.fortunes,
            "--layers", str(args.layers), "--heads", str(args.heads), "--dim", str(args.dim), "--context", str(args.context),
            "--batch-size", str(args.batch), "--max-steps", str(steps), "--lr", str(args.lr),
            "--weight-decay", str(args.weight_decay), "--test-size", str(args.val_windows),
            "--seed", str(args.seed), "--world", str(world), "--threads", str(per_rank),
            "--matmul-precision", args.matmul_precision, "--progress", "none", "--json"] + extra


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--distopt", default="build/bin/distopt")
    p.add_argument("--fortunes", default=os.environ.get("DISTOPT_FORTUNES_DIR", "/usr/share/games/fortunes"))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--val-windows", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--matmul-precision", choices=["f32", "bf16"], default="f32")
    p.add_argument("--parallel", choices=["ranks", "threads"], default="ranks",
                   help="distopt at T threads: T ranks (default) or one rank on T threads")
    p.add_argument("--skip-torch", action="store_true")
    p.add_argument("--output", help="write the results, loss curves included, as JSON")
    p.add_argument("--plot", help="write the loss curves (1 thread) as a PNG")
    p.add_argument("--torch-child", help=argparse.SUPPRESS)  # internal: the PyTorch run, given the initial weights
    args = p.parse_args()
    train, val = fortunes(args.fortunes)
    if args.torch_child:
        init, _ = read_safetensors(args.torch_child)
        t = torch_run(args, init, batches(train, args.context, args.batch, args.seed, args.steps),
                      val_windows(val, args.context, args.val_windows), int(args.threads))
        print(json.dumps(t))
        return
    tmp = tempfile.mkdtemp()
    init_path = os.path.join(tmp, "init.safetensors")
    # The initial weights: one step at lr 0 leaves them as initialised.
    init_args = argparse.Namespace(**{**vars(args), "lr": 0.0, "val_windows": 1, "matmul_precision": "f32"})
    subprocess.run(distopt_cmd(init_args, 1, 1, ["--export-params", init_path]), check=True, stdout=subprocess.DEVNULL)
    results = []
    for threads in [int(t) for t in args.threads.split(",")]:
        metrics = os.path.join(tmp, f"metrics{threads}.jsonl")
        out = subprocess.run(distopt_cmd(args, threads, args.steps, ["--warmup-steps", str(args.warmup),
                                                                   "--metrics", metrics]), check=True,
                             stdout=subprocess.PIPE, text=True).stdout
        d = json.loads(out.strip().splitlines()[-1])
        row = {"threads": threads, "matmul_precision": args.matmul_precision, "parallel": args.parallel,
               "distopt_val_loss": d["val_loss"], "distopt_tokens_per_s": d["tokens_per_s"],
               "parameters": d["gpt"]["parameters"]}
        row["distopt_losses"] = [json.loads(l)["loss"] for l in open(metrics) if '"kind": "step"' in l]
        if not args.skip_torch:
            # PyTorch at its best on these cores: in a process of its own,
            # with OpenMP's, OpenBLAS's and torch's thread counts set before
            # it starts; at T > 1 the split that a 10-step probe finds
            # fastest (on 2 cores OpenBLAS's threads alone win).
            def torch_child(omp, blas, intra, steps):
                env = dict(os.environ, OMP_NUM_THREADS=str(omp), OPENBLAS_NUM_THREADS=str(blas))
                out = subprocess.run(pinned(threads) + [sys.executable, os.path.abspath(__file__), "--torch-child",
                                                        init_path] + sys.argv[1:] +
                                     ["--threads", str(intra), "--steps", str(steps)],
                                     env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
                return json.loads(out.strip().splitlines()[-1])
            splits = [(threads, threads, threads)]
            if threads > 1:
                splits += [(threads, 1, threads), (threads, threads, 1)]
            best = max(splits, key=lambda c: torch_child(*c, min(args.steps, 10))["tokens_per_s"]) \
                if len(splits) > 1 else splits[0]
            t = torch_child(*best, args.steps)
            row["torch_threads"] = {"OMP_NUM_THREADS": best[0], "OPENBLAS_NUM_THREADS": best[1],
                                    "set_num_threads": best[2]}
            row["torch_losses"] = t["losses"]
            row.update({"torch_val_loss": t["val_loss"], "torch_tokens_per_s": t["tokens_per_s"],
                        "val_loss_ratio": d["val_loss"] / t["val_loss"],
                        "speedup": d["tokens_per_s"] / t["tokens_per_s"]})
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("_losses")}), flush=True)
        results.append(row)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"args": vars(args), "results": results}, f)
    if args.plot and not args.skip_torch:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        r = results[0]
        smooth = lambda v: np.convolve(v, np.ones(20) / 20, mode="valid")  # noqa: E731
        ax.plot(smooth(r["torch_losses"]), label="PyTorch 1.13" + (" (autocast bf16)" if args.matmul_precision == "bf16" else ""), linewidth=1.5)
        ax.plot(smooth(r["distopt_losses"]), label="distopt" + (" (bf16 products)" if args.matmul_precision == "bf16" else ""), linewidth=1.0, linestyle="--")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (nats/byte, mean of 20 steps)")
        ax.set_title(f"gpt {args.layers}x{args.dim}, context {args.context}, fortunes, AdamW, warm-up + cosine")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
    print("\n| products | threads | distopt val loss | torch val loss | ratio | distopt tokens/s | torch tokens/s | speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['matmul_precision']} | {r['threads']} | {r['distopt_val_loss']:.4f} | {r.get('torch_val_loss', float('nan')):.4f} | "
              f"{r.get('val_loss_ratio', float('nan')):.4f} | {r['distopt_tokens_per_s']:.0f} | "
              f"{r.get('torch_tokens_per_s', float('nan')):.0f} | {r.get('speedup', float('nan')):.2f}x |")


if __name__ == "__main__":
    main()
