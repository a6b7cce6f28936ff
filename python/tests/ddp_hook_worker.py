"""One rank of the DDP communication hooks' tests (test_ddp_hooks.py),
started under torchrun with a gloo group: ``python3 -m torch.distributed.run
--nproc_per_node N ddp_hook_worker.py OUT --gloo``.

A small MLP under torch's DistributedDataParallel, in several buckets of
uneven sizes, with distopt's int8_hook registered through a wrapper that
records what each bucket held before the hook and what the hook returned.
Each rank writes OUT.<rank> (torch.save): those records per iteration, the
parameters at the end and the losses.
"""

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from distopt.torch import ddp_comm_hooks

torch.set_num_threads(1)


class WithUnused(torch.nn.Module):
    """The model and a layer its forward never uses."""

    def __init__(self, body):
        super().__init__()
        self.body = body
        self.unused = torch.nn.Linear(5, 5)

    def forward(self, x):
        return self.body(x)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--gloo", action="store_true", help="what the tests' launcher passes (the group is gloo's)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--find-unused", action="store_true",
                    help="DDP's find_unused_parameters, with a layer forward never uses (DDP then all-reduces its "
                    "map of used parameters during backward, beside the hook's collectives)")
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 300), torch.nn.ReLU(), torch.nn.Linear(300, 1001), torch.nn.ReLU(),
                                torch.nn.Linear(1001, 77), torch.nn.ReLU(), torch.nn.Linear(77, 5))
    # Buckets of about 64K elements once DDP rebuilds them (its first holds
    # 1 MB): several, of uneven sizes.
    if a.find_unused:
        model = WithUnused(model)
    ddp = DDP(model, bucket_cap_mb=0.25, find_unused_parameters=a.find_unused)
    state = ddp_comm_hooks.Int8State()
    records = []

    def recording(st, bucket):
        mine = {"index": bucket.index(), "input": bucket.buffer().clone()}
        records[-1].append(mine)

        def keep(fut):
            mine["output"] = fut.value().clone()
            return fut.value()

        return ddp_comm_hooks.int8_hook(st, bucket).then(keep)

    ddp.register_comm_hook(state, recording)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(16, 20, generator=gen)  # one batch a rank, every step: the loss falls
    y = torch.randint(0, 5, (16,), generator=gen)
    losses = []
    for _ in range(a.steps):
        records.append([])
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    torch.save({"records": records, "params": [p.detach().clone() for p in model.parameters()], "losses": losses},
               f"{a.out}.{rank}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
