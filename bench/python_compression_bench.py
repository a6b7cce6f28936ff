#!/usr/bin/python3
"""Compressed gradients from Python, side by side with torch's DDP hooks
(docs/performance.md, "Compression from Python against torch's DDP hooks").

The same model (bench/python_sharded_bench.py's torch.nn GPT, 8 layers of
width 256, sequence 64, byte vocabulary), the same global batches of
Debian's fortunes, AdamW, over one gloo process group per configuration,
each configuration its own torchrun launch:

  torch:none       torch's DistributedDataParallel (its fp32 all-reduce)
  torch:fp16       DDP + torch's fp16_compress_hook
  torch:powersgd   DDP + torch's powerSGD_hook (rank --rank, warm-up --warmup)
  hook:int8        DDP + distopt.torch.ddp_comm_hooks.int8_hook
  distopt:S        distopt's ShardedOptimizer ddp with compression S
                   (none, bf16, int8, powersgd at --rank, --warmup)

The torch rows step with torch.optim.AdamW, the distopt rows with
distopt's AdamW. Reports the median step (forward, backward, reduction,
optimizer) after the warm-up, tokens per second, the bytes a rank sends a
step after the warm-up (the loopback device's counter between two
barriers, over the world: every rank's traffic goes through it) and the
validation bits per byte after the last step.

--shape RATE runs the launches behind a token bucket on the loopback
device (`tc qdisc ... tbf rate RATE`, root needed), which shapes torch's
gloo traffic and distopt's alike (distopt's own --link-mbps emulator
cannot see torch's sockets); the rate is shared by all ranks.

  sudo PYTHONPATH=build/python /usr/bin/python3 bench/python_compression_bench.py \\
      --world 2 --steps 40 --shape 200mbit [--modes torch:none,distopt:powersgd,...]
"""

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from python_sharded_bench import GPT, TORCHRUN_FIX  # noqa: E402

HERE = os.path.abspath(__file__)
SEQ = 64


def fortunes(root="/usr/share/games/fortunes"):
    """Debian's fortunes as bytes, the last 10% held out (as --data fortunes)."""
    names = sorted(n for n in os.listdir(root) if not n.endswith((".dat", ".u8"))
                   and os.path.isfile(os.path.join(root, n)) and not os.path.islink(os.path.join(root, n)))
    data = b"".join(open(os.path.join(root, n), "rb").read() for n in names)
    cut = len(data) - len(data) // 10
    return torch.frombuffer(bytearray(data[:cut]), dtype=torch.uint8), torch.frombuffer(bytearray(data[cut:]),
                                                                                        dtype=torch.uint8)


def windows(text, starts):
    idx = starts[:, None] + torch.arange(SEQ + 1)[None, :]
    w = text[idx].long()
    return w[:, :-1], w[:, 1:]


def worker(mode, steps, batch, rank_r, warmup, lr):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from distopt.torch import comm as dcomm
    from distopt.torch import ddp_comm_hooks
    from distopt.torch.distributed import ShardedOptimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(256, vocab=256, seq=SEQ)
    kind, _, scheme = mode.partition(":")
    if kind in ("torch", "hook"):
        net = DistributedDataParallel(model)
        if scheme == "fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            net.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif scheme == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
            net.register_comm_hook(ps.PowerSGDState(process_group=None, matrix_approximation_rank=rank_r,
                                                    start_powerSGD_iter=warmup), ps.powerSGD_hook)
        elif scheme == "int8":
            net.register_comm_hook(ddp_comm_hooks.Int8State(start_iter=max(2, warmup)), ddp_comm_hooks.int8_hook)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        barrier = dist.barrier
    else:
        net = model
        extra = dict(powersgd_rank=rank_r, powersgd_warmup=warmup) if scheme == "powersgd" else {}
        c = dcomm.world()
        opt = ShardedOptimizer(model.parameters(), "adamw", "ddp", comm=c, lr=lr, compression=scheme, **extra)
        barrier = c.barrier
    train, val = fortunes()
    gen = torch.Generator().manual_seed(1)
    local = batch // world
    skip = min(max(warmup, 2) + 2, steps - 1)  # the uncompressed warm-up, and DDP's bucket rebuild
    step_s = []
    for k in range(steps):
        if k == skip:
            barrier()
            sent = lo_bytes()
        x, y = windows(train, torch.randint(0, train.numel() - SEQ - 1, (batch,), generator=gen))
        xs, ys = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
        barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(xs), ys.reshape(-1)).backward()
        opt.step()
        step_s.append(time.perf_counter() - t0)
    barrier()
    sent = lo_bytes() - sent  # every rank's, through the loopback device
    with torch.no_grad():
        x, y = windows(val, torch.arange(64) * ((val.numel() - SEQ - 1) // 64))
        bpb = torch.nn.functional.cross_entropy(model(x), y.reshape(-1)).item() / math.log(2)
    if rank == 0:
        print(json.dumps({"mode": mode, "step_ms": 1e3 * statistics.median(step_s[skip:]), "val_bpb": bpb,
                          "mib_per_step_per_rank": sent / world / (steps - skip) / 2**20}))
    dist.destroy_process_group()


def lo_bytes():
    with open("/sys/class/net/lo/statistics/tx_bytes") as f:
        return int(f.read())


def launch(mode, a):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = [HERE, "--worker", mode, "--steps", str(a.steps), "--batch", str(a.batch), "--rank", str(a.rank),
            "--warmup", str(a.warmup), "--lr", str(a.lr)]
    with tempfile.TemporaryDirectory() as logs, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        cmd = [sys.executable, "-m", "torch.distributed.run", *TORCHRUN_FIX, "--log_dir", logs, "--nnodes", "1",
               "--nproc_per_node", str(a.world), "--master_addr", "127.0.0.1", "--master_port", str(port), *args]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"{mode} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return json.loads([line[line.index("{"):] for line in r.stdout.splitlines() if '{"mode"' in line][-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=16, help="the global batch, sequences of 64 bytes")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rank", type=int, default=4, help="PowerSGD's rank")
    ap.add_argument("--warmup", type=int, default=10, help="PowerSGD's uncompressed steps (int8: max(2, this))")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--shape", help="a tc rate for the loopback device (e.g. 200mbit); root needed")
    ap.add_argument("--modes", default="torch:none,torch:fp16,torch:powersgd,hook:int8,distopt:none,distopt:bf16,"
                    "distopt:int8,distopt:powersgd")
    a = ap.parse_args()
    if a.worker:
        worker(a.worker, a.steps, a.batch, a.rank, a.warmup, a.lr)
        return
    if a.shape:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
        r = subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", a.shape, "burst", "512kb",
                            "latency", "200ms"], capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"--shape {a.shape}: tc could not shape the loopback device: {r.stderr.strip()}")
    try:
        rows = [launch(m, a) for m in a.modes.split(",")]
    finally:
        if a.shape:
            subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
    base = rows[0]
    blas = os.path.basename(os.path.dirname(os.path.realpath("/etc/alternatives/libblas.so.3-x86_64-linux-gnu")))
    print(f"torch.nn GPT 8 x 256 (seq 64, bytes), fortunes, AdamW lr {a.lr}, global batch {a.batch}, world "
          f"{a.world}, gloo, {a.steps} steps, PowerSGD rank {a.rank} after {a.warmup} steps, loopback "
          f"{'shaped to ' + a.shape if a.shape else 'unshaped'}, BLAS {blas}; speed vs the first row")
    print(f"{'configuration':<18} {'step ms':>9} {'tokens/s':>9} {'speed':>7} {'MiB/step/rank':>14} "
          f"{'val bits/byte':>14}")
    for r in rows:
        tokens = a.batch * SEQ / (r["step_ms"] / 1e3)
        print(f"{r['mode']:<18} {r['step_ms']:9.1f} {tokens:9.0f} {base['step_ms'] / r['step_ms']:6.2f}x "
              f"{r['mib_per_step_per_rank']:14.2f} {r['val_bpb']:14.4f}")


if __name__ == "__main__":
    main()
