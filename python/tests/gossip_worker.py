"""One rank of the gossip optimizer's tests (test_gossip.py), started as
users start it: ``mpirun -np N python3 gossip_worker.py OUT ...`` or
``python3 -m torch.distributed.run --nproc_per_node N gossip_worker.py OUT
--gloo ...``.

For every strategy of ``--runs`` it trains the same model, each rank on
batches of its own, with ``GossipOptimizer``, and each rank writes
(torch.save to OUT.r<rank>) what the test compares: the flat gradient
torch computed at every step (what the C++ reference steps with), the
parameters every forward ran on and those after the last step, the consensus distance and the bytes sent.
``--save DIR`` writes a checkpoint after step ``--save-at`` and stops there;
``--load DIR`` resumes from it and runs to ``--steps``.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
torch.set_num_threads(1)

from conftest import batches, loss_of, mlp  # noqa: E402

import distopt.torch.comm as dcomm  # noqa: E402
from distopt.torch.distributed import GossipOptimizer  # noqa: E402


def run_config(name, world):
    """(strategy, rule, options) of a named run: the rule's and the strategy's options together."""
    sgd = dict(lr=0.05, momentum=0.9)
    if name == "sgp":
        return "sgp", "sgd", sgd
    if name == "osgp":
        return "osgp", "sgd", dict(sgd, synch_freq=1)
    if name == "dpsgd":  # bipartite-exponential, its default, needs an even world
        return "dpsgd", "sgd", sgd if world % 2 == 0 else dict(sgd, topology="ring")
    if name == "slowmo":
        return "slowmo", "sgd", dict(sgd, localsgd_frequency=2, slowmo_frequency=3)
    if name == "diloco":
        return "diloco", "adamw", dict(lr=1e-2, sync_every=2, outer_lr=0.7)
    if name == "diloco-streaming":
        return "diloco", "adamw", dict(lr=1e-2, sync_every=4, fragments=2, fragment_alpha=0.25, outer_dtype="bf16",
                                       outer_error_feedback=True)
    if name == "diloco-delayed":  # the averages run a step behind training: a communicator split off
        return "diloco", "adamw", dict(lr=1e-2, sync_every=4, fragments=2, sync_delay=1, fragment_carry=True)
    if name == "adpsgd":  # a gossip thread on a communicator split off; its bits depend on timing
        return "adpsgd", "sgd", sgd
    raise SystemExit(f"unknown run {name}")


def flat_grads(params):
    return torch.cat([p.grad.detach().reshape(-1).clone() for p in params])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--gloo", action="store_true")
    ap.add_argument("--runs", default="sgp,dpsgd,diloco")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--save")
    ap.add_argument("--save-at", type=int, default=3)
    ap.add_argument("--load")
    a = ap.parse_args()
    if a.gloo:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    comm = dcomm.world()
    rank, world = comm.rank, comm.size
    data = batches(a.steps, seed=11 + rank)  # each rank its own batches
    results = {"world": world, "backend": comm.backend, "rank": rank, "runs": {}}
    for name in a.runs.split(","):
        strategy, rule, options = run_config(name, world)
        model = mlp(seed=0)
        initial = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
        params = list(model.parameters())
        opt = GossipOptimizer(params, rule, strategy, comm=comm, **options)
        first = 0
        if a.load:
            first = opt.load(os.path.join(a.load, name))
        last = a.save_at if a.save else a.steps
        grads, seen = [], []
        for x, y in data[first:last]:
            opt.zero_grad()
            seen.append(torch.cat([p.detach().reshape(-1).clone() for p in params]))  # what this forward runs on
            loss_of(model, x, y).backward()
            grads.append(flat_grads(params))
            opt.step()
        if a.save:
            opt.save(os.path.join(a.save, name), opt.steps)
        results["runs"][name] = {
            "strategy": strategy, "rule": rule, "options": options, "initial": initial, "grads": grads, "seen": seen,
            "first": first, "steps": opt.steps,
            "params": torch.cat([p.detach().reshape(-1).clone() for p in params]),
            "shapes": [list(p.shape) for p in params],
            "consensus": opt.consensus_distance(), "bytes_sent": opt.bytes_sent,
            "averaged": torch.cat([t.reshape(-1) for t in opt.averaged_parameters()]),
        }
    torch.save(results, f"{a.out}.r{rank}")


if __name__ == "__main__":
    main()
