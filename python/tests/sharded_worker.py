"""One rank of the sharded optimizer's tests (test_sharded.py), started as
users start it: ``mpirun -np N python3 sharded_worker.py OUT ...`` or
``python3 -m torch.distributed.run --nproc_per_node N sharded_worker.py OUT
--gloo ...``.

For every (rule, strategy) it trains the same model from the same global
batches, each rank on its slice, and rank 0 writes what the test compares
(torch.save to OUT): the parameters, the consolidated state_dict, each
rank's parameter bytes and optimizer-state bytes. ``--save DIR`` writes a
reshardable checkpoint after the last step; ``--load DIR`` starts from one
and records the state right after loading. ``--device cuda`` trains the
model on the GPU (the optimizer stages it through host memory);
``--staged`` stages CPU parameters the same way (the staged path where
there is no GPU). What is saved is on the CPU either way.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
torch.set_num_threads(1)

from conftest import batches, loss_of, mlp, replica_backward  # noqa: E402

import distopt.torch.comm as dcomm  # noqa: E402
from distopt.torch.distributed import ShardedOptimizer  # noqa: E402

OPTIONS = {
    "adamw": dict(lr=1e-2, weight_decay=0.1),
    "lamb": dict(lr=1e-2, weight_decay=0.01),
    "muon": dict(lr=2e-2),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--gloo", action="store_true")
    ap.add_argument("--rules", default="adamw,lamb,muon")
    ap.add_argument("--strategies", default="ddp,zero1,zero2")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--save")
    ap.add_argument("--load")
    ap.add_argument("--zero-redundancy", action="store_true", help="also torch's ZeroRedundancyOptimizer (gloo)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--staged", action="store_true", help="stage CPU parameters as device ones are")
    ap.add_argument("--state-dtype", default="f32",
                    help="the optimizer's state_dtype; not f32: a model whose first weight keeps quantized state")
    ap.add_argument("--compression", default="none", help="ShardedOptimizer's compression=")
    ap.add_argument("--powersgd-warmup", type=int, default=10, help="ShardedOptimizer's powersgd_warmup=")
    ap.add_argument("--onebit-warmup", type=int, default=100, help="ShardedOptimizer's onebit_warmup=")
    a = ap.parse_args()
    make = Staged if a.staged else ShardedOptimizer
    if a.gloo:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    comm = dcomm.world()
    rank, world = comm.rank, comm.size
    results = {"world": world, "backend": comm.backend, "runs": {}}
    data = batches(a.steps, seed=7)
    for rule in a.rules.split(","):
        for strategy in a.strategies.split(","):
            quantized = a.state_dtype != "f32"
            model = (large(seed=3) if quantized else mlp(seed=3)).to(a.device)
            options = dict(OPTIONS[rule], state_dtype=a.state_dtype) if quantized else OPTIONS[rule]
            low = {"powersgd_warmup": a.powersgd_warmup} if a.compression == "powersgd" else \
                {"onebit_warmup": a.onebit_warmup} if a.compression == "onebit" else {}
            opt = make(model.parameters(), rule, strategy, comm=comm, bucket_elements=64,
                       compression=a.compression, **low, **options)
            run = {}
            if a.load:
                run["loaded_step"] = opt.load(a.load)
                run["loaded_state"] = opt.state_dict()
                run["loaded_params"] = [p.detach().to("cpu", copy=True) for p in model.parameters()]
            in_backward = []  # zero2: were the gradients handed over during backward?
            for x, y in data:
                n = x.shape[0] // world
                opt.zero_grad()
                backward(model, x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n], a.device)
                in_backward.append(opt._core.hooked and opt._core.next_unit == -1 and
                                   all(p.grad is None for p in model.parameters()))
                opt.step()
            run["reduced_in_backward"] = all(in_backward)
            state = opt.state_dict()
            mine = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
            every = torch.empty(world * mine.numel())
            comm.all_gather(every, mine)
            mem = torch.tensor([float(opt.memory()["optimizer_state"])], dtype=torch.float64)
            mems = torch.empty(world, dtype=torch.float64)
            comm.all_gather(mems, mem)
            run.update(params=[p.detach().to("cpu", copy=True) for p in model.parameters()], state=state,
                       ranks_params=every.reshape(world, -1), state_bytes=mems.tolist())
            if a.save:
                run["saved_bytes"] = opt.save(os.path.join(a.save, f"{rule}-{strategy}"), a.steps)
            results["runs"][f"{rule}/{strategy}"] = run
            del opt
    results["comm"] = collectives(comm)
    if a.zero_redundancy:
        results["zero_redundancy"] = zero_redundancy(data, rank, world, comm)
    if rank == 0:
        torch.save(results, a.out)
    if a.gloo:
        # As torch asks: a gloo group left to the interpreter's exit can
        # abort it ("terminate called without an active exception"), its
        # threads still holding tensors while Python shuts down.
        dist.destroy_process_group()


def backward(model, x, y, device):
    """The loss's gradients into the model's .grad; for a model on a device,
    from a CPU replica of its parameters (conftest.replica_backward)."""
    if device == "cpu":
        loss_of(model, x, y).backward()
    else:
        replica_backward(model, x, y)


class Staged(ShardedOptimizer):
    _stage_cpu = True


def collectives(comm):
    """distopt.torch.comm's collectives and PushSum at this world; rank 0's
    results (and every rank's all-reduce, gathered)."""
    rank, world = comm.rank, comm.size
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(1000, generator=g)
    out = {"inputs": torch.empty(world * 1000)}
    comm.all_gather(out["inputs"], x)
    out["all_reduce"] = comm.all_reduce(x.clone())
    out["max"] = comm.all_reduce(x.clone(), op="max")
    out["reduce_scatter"] = comm.reduce_scatter(torch.empty(1000 // world), x[:1000 // world * world].clone())
    b = torch.full((5,), float(rank))
    out["broadcast"] = comm.broadcast(b, src=world - 1)
    comm.barrier()
    ps = dcomm.PushSum(comm, 1000)
    y = x.clone()
    out["push_sum"] = []
    for _ in range(4):
        ps.mix(y)
        out["push_sum"].append(y / ps.weight)
    return out


def wide(seed=3):
    """A model whose first layer holds most of the parameters."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))


def large(seed=3):
    """A model whose first weight (12 x 512: 6144 elements) is large enough
    to keep quantized state (4096 elements or more)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 512), torch.nn.Tanh(), torch.nn.Linear(512, 3))


def zero_redundancy(data, rank, world, comm):
    """The state bytes per rank of torch's ZeroRedundancyOptimizer (AdamW:
    torch has no LAMB; the same two moments per element) and of distopt's
    zero2 LAMB on a model whose largest layer dominates: torch gives each
    rank whole parameters, distopt equal shards."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    net = wide()
    ours = ShardedOptimizer(net.parameters(), "lamb", "zero2", comm=comm, **OPTIONS["lamb"])
    for x, y in data:
        n = x.shape[0] // world
        ours.zero_grad()
        torch.nn.functional.cross_entropy(net(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n]).backward()
        ours.step()
    mems = torch.empty(world, dtype=torch.float64)
    comm.all_gather(mems, torch.tensor([float(ours.memory()["optimizer_state"])], dtype=torch.float64))
    ours_bytes = mems.tolist()
    model = wide()
    ddp = DistributedDataParallel(model)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **OPTIONS["adamw"])
    for x, y in data:
        n = x.shape[0] // world
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n]).backward()
        opt.step()
    held = sum(t.numel() * t.element_size() for s in opt.optim.state.values() for t in s.values()
               if torch.is_tensor(t) and t.dim() > 0)
    mems = torch.empty(world, dtype=torch.float64)
    comm.all_gather(mems, torch.tensor([float(held)], dtype=torch.float64))
    return {"state_bytes": mems.tolist(), "ours_state_bytes": ours_bytes}


if __name__ == "__main__":
    main()
