#!/usr/bin/env python3
"""The [gpu-torch] goals of the Python drop-ins on one GPU, each beside its
torch peer in the same process (docs/gpu.md, "From PyTorch"):

1. optimizer step alone, AdamW over GPT-2 small's parameter set (124M
   parameters in 148 tensors, fp32): torch's fused AdamW against distopt's
   drop-in. Goal: distopt <= 0.9x torch's time. Also checks that the
   drop-in's parameters after three steps equal distopt's CPU drop-in's
   (the same gradients) bit for bit.
2. a whole training step of a GPT-2 small (12 layers, 768 wide, 12 heads,
   vocabulary 50257, context --context, batch --batch, bf16 autocast)
   with the optimizer resident (torch's fused AdamW), offloaded with
   distopt's CPUOffload (--threads), and offloaded with torch's own fused
   CPU AdamW used the same way (gradients to pinned host memory, the step
   on fp32 masters there, the parameters copied back). Goals: CPUOffload
   <= 1.3x the resident step, and >= 1.5x faster than torch's CPU AdamW
   offload; the GPU memory each needs (peak allocated) beside it.

Each time is the median of --steps timings bracketed by
torch.cuda.synchronize(), after two warm-up steps.

Usage: python3 bench/torch_cuda_dropins.py [--steps 10] [--batch 8]
       [--context 1024] [--threads N] [--skip-train]
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import distopt.torch.optim as dopt


def timed(fn, steps):
    for _ in range(2):
        fn()
    out = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


class Block(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT2(torch.nn.Module):
    def __init__(self, vocab=50257, context=1024, d=768, layers=12, heads=12):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(vocab, d), torch.nn.Embedding(context, d)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(d)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.ln(x) @ self.wte.weight.t()  # tied head


class TorchCPUOffload:
    """torch's fused CPU AdamW used as an offload, as CPUOffload works."""

    def __init__(self, params, **kw):
        self.params = list(params)
        self.masters = [p.detach().float().cpu().pin_memory().requires_grad_() for p in self.params]
        for m in self.masters:
            m.grad = torch.empty_like(m).pin_memory()
        fused = {"fused": True} if "fused" in torch.optim.AdamW.__init__.__code__.co_varnames else {}
        self.opt = torch.optim.AdamW(self.masters, **kw, **fused)

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    def step(self):
        for p, m in zip(self.params, self.masters):
            m.grad.copy_(p.grad, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        self.opt.step()
        for p, m in zip(self.params, self.masters):
            p.data.copy_(m.detach(), non_blocking=True)


def step_alone(args):
    model = GPT2().cuda()
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    print(f"GPT-2 small parameter set: {n / 1e6:.1f}M parameters in {len(params)} tensors", file=sys.stderr)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    rows = []
    for name, make in (("torch fused AdamW", lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True)),
                       ("distopt AdamW drop-in", lambda ps: dopt.AdamW(ps, lr=1e-4))):
        opt = make(params)
        rows.append((name, timed(opt.step, args.steps)))
        del opt
    torch_s, ours_s = rows[0][1], rows[1][1]
    for name, s in rows:
        print(f"  {name:28s} {s * 1e3:8.3f} ms/step", file=sys.stderr)
    print(f"  distopt / torch fused: {ours_s / torch_s:.3f} (goal <= 0.9)", file=sys.stderr)
    # Bits: three steps on CUDA against the CPU drop-in on the same gradients.
    torch.manual_seed(0)
    small = [torch.randn(s, device="cuda", requires_grad=True) for s in ((768, 768), (50257, 64), (3,))]
    cpu = [p.detach().cpu().requires_grad_() for p in small]
    a, b = dopt.AdamW(small, lr=1e-3), dopt.AdamW(cpu, lr=1e-3)
    for _ in range(3):
        for p, q in zip(small, cpu):
            q.grad = torch.randn(q.shape)
            p.grad = q.grad.cuda()
        a.step()
        b.step()
    same = all(torch.equal(p.detach().cpu(), q.detach()) for p, q in zip(small, cpu))
    print(f"  CUDA drop-in == CPU drop-in after 3 steps: {same}", file=sys.stderr)


def one_setup(name, args, idx):
    """Time and peak GPU memory of a training step with optimizer `name`."""
    model = GPT2(context=args.context).cuda()
    params = list(model.parameters())
    if name.startswith("resident"):
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    elif "distopt" in name:
        opt = dopt.CPUOffload(params, optimizer="adamw", lr=1e-4, threads=args.threads,
                              overlap="no overlap" not in name)
    else:
        opt = TorchCPUOffload(params, lr=1e-4)

    def one():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(idx[:, :-1])
        F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1)).backward()
        opt.step()

    torch.cuda.reset_peak_memory_stats()
    s = timed(one, args.steps)
    return s, torch.cuda.max_memory_allocated()


def train(args):
    torch.manual_seed(0)
    idx = torch.randint(0, 50257, (args.batch, args.context), device="cuda")
    times = []
    for name in ("resident: torch fused AdamW", "offload: distopt CPUOffload", "offload: torch CPU AdamW",
                 "offload: CPUOffload no overlap"):
        s, peak = one_setup(name, args, idx)
        torch.cuda.empty_cache()
        times.append(s)
        print(f"  {name:32s} {s * 1e3:9.1f} ms/step  peak {peak / 2**30:6.2f} GiB", file=sys.stderr)
    resident, ours, theirs, _ = times
    print(f"  CPUOffload / resident: {ours / resident:.2f} (goal <= 1.3); torch CPU offload / CPUOffload: "
          f"{theirs / ours:.2f} (goal >= 1.5)", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--skip-train", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("torch_cuda_dropins.py: no CUDA device visible to torch")
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}; threads {args.threads}", file=sys.stderr)
    print("optimizer step alone:", file=sys.stderr)
    step_alone(args)
    if not args.skip_train:
        print(f"training step, batch {args.batch} x {args.context}:", file=sys.stderr)
        train(args)


if __name__ == "__main__":
    main()
