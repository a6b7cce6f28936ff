"""One rank of FullyShardedDataParallel's tests (test_fsdp.py), started as
users start it: ``mpirun -np N python3 fsdp_worker.py OUT ...`` or under
torchrun with ``--gloo``.

For every rule of ``--rules`` it trains the same small transformer-shaped
model (a root unit of embedding and head around wrapped blocks) twice, each
rank on batches of its own: with ``ShardedOptimizer(strategy="ddp")`` and
with ``FullyShardedDataParallel`` (zero3), and writes (torch.save to
OUT.r<rank>) both full state_dicts after every step. ``--checkpointing``
runs the blocks under torch.utils.checkpoint in the zero3 model;
``--save DIR`` saves the zero3 run after step ``--save-at``, and a fresh
wrapper loads it and runs on to ``--steps``; ``--save-only`` and
``--load-from DIR`` record the state saved and loaded, to compare across
world sizes.
"""

import argparse
import os
import sys

import torch
import torch.utils.checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
torch.set_num_threads(1)

import distopt.torch.comm as dcomm  # noqa: E402
from distopt.torch.distributed import FullyShardedDataParallel, ShardedOptimizer  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, 2 * d)
        self.down = torch.nn.Linear(2 * d, d, bias=False)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Net(torch.nn.Module):
    def __init__(self, checkpointing=False, seed=0, width=16):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Linear(12, width)
        self.blocks = torch.nn.ModuleList([Block(width) for _ in range(3)])
        self.head = torch.nn.Linear(width, 3)
        self.checkpointing = checkpointing

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = torch.utils.checkpoint.checkpoint(b, h) if self.checkpointing else b(h)
        return self.head(h)


def batches(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


OPTIONS = {"adamw": dict(lr=1e-2, weight_decay=0.1), "lamb": dict(lr=1e-2), "muon": dict(lr=2e-2),
           "adafactor": {}}


def full(sd):
    return {k: v.detach().clone() for k, v in sd.items()}


def train(model, step, data):
    out = []
    for x, y in data:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        step()
        out.append(full(model.state_dict()))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--gloo", action="store_true")
    ap.add_argument("--rules", default="adamw,lamb,muon,adafactor")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--policy", default="class", choices=["class", "size", "list", "none"])
    ap.add_argument("--prefetch", type=int, default=1)
    ap.add_argument("--save")
    ap.add_argument("--save-at", type=int, default=2)
    ap.add_argument("--save-only", action="store_true", help="save after --save-at steps and record the state")
    ap.add_argument("--load-from", help="record the state a fresh wrapper (and a ddp optimizer) loads from here")
    ap.add_argument("--width", type=int, default=16, help="the blocks' width (48: up and down hold 4608 elements)")
    ap.add_argument("--state-dtype", help="the optimizers' state_dtype (int8, int4, bf16)")
    a = ap.parse_args()
    if a.state_dtype:
        for o in OPTIONS.values():
            o["state_dtype"] = a.state_dtype
    if a.gloo:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    comm = dcomm.world()
    data = batches(a.steps, seed=11 + comm.rank)
    results = {"world": comm.size, "rank": comm.rank, "runs": {}}
    for rule in a.rules.split(","):
        if a.save_only or a.load_from:
            results["runs"][rule] = reshard(a, rule, comm, data)
            continue
        ref = Net(width=a.width)
        opt = ShardedOptimizer(ref.parameters(), rule, "ddp", comm=comm, **OPTIONS[rule])

        def ddp_step():
            opt.step()
            opt.zero_grad()

        expected = train(ref, ddp_step, data)
        net = Net(a.checkpointing, width=a.width)
        wrap = {"class": dict(wrap=Block), "size": dict(min_num_params=1000), "none": {},
                "list": dict(wrap=[net.blocks[0], net.blocks[2]])}[a.policy]
        model = FullyShardedDataParallel(net, optimizer=rule, comm=comm, prefetch_units=a.prefetch, **wrap,
                                         **OPTIONS[rule])

        def step():
            model.optimizer.step()
            model.optimizer.zero_grad()

        if a.save:
            got = train(model, step, data[:a.save_at])
            model.optimizer.save(a.save + "/" + rule, a.save_at)
            model = FullyShardedDataParallel(Net(a.checkpointing, seed=5), optimizer=rule, comm=comm,
                                             prefetch_units=a.prefetch, **wrap, **OPTIONS[rule])
            assert model.optimizer.load(a.save + "/" + rule) == a.save_at
            got += train(model, step, data[a.save_at:])
        else:
            got = train(model, step, data)
        plain = Net(width=a.width)
        plain.load_state_dict(got[-1])  # torch's own module takes the full state_dict
        state = model.optimizer.state_dict()["state"]
        results["runs"][rule] = {"expected": expected, "got": got, "units": model.units,
                                 "memory": model.memory(), "plain_out": plain(data[0][0]).detach(),
                                 "state_keys": sorted({k for st in state.values() for k in st})}
    torch.save(results, f"{a.out}.r{comm.rank}")
    if a.save_only or a.load_from:
        return
    # Exit with zero3's prefetch of the first unit in flight: the strategies
    # end before the communicators do.
    torch.nn.functional.cross_entropy(model(data[0][0]), data[0][1]).backward()
    model.optimizer.step()


def reshard(a, rule, comm, data):
    """The state saved (--save-only) or loaded (--load-from), to compare
    across world sizes."""
    model = FullyShardedDataParallel(Net(seed=5 if a.load_from else 0), optimizer=rule, comm=comm, wrap=Block,
                                     **OPTIONS[rule])
    if a.save_only:
        train(model, lambda: (model.optimizer.step(), model.optimizer.zero_grad()), data[:a.save_at])
        model.optimizer.save(a.save + "/" + rule, a.save_at)
        return {"model": full(model.state_dict()), "optimizer": model.optimizer.state_dict()}
    assert model.optimizer.load(a.load_from + "/" + rule) == a.save_at
    ref = Net(seed=6)
    named = dict(ref.named_parameters())  # in the checkpoint's order: its optimizer state follows it
    opt = ShardedOptimizer([(n, named[n]) for n in model.parameter_names], rule, "ddp", comm=comm, **OPTIONS[rule])
    opt.load(a.load_from + "/" + rule)
    return {"model": full(model.state_dict()), "optimizer": model.optimizer.state_dict(),
            "ddp_model": full(ref.state_dict())}


if __name__ == "__main__":
    main()
