"""distopt's DDP communication hook (distopt.torch.ddp_comm_hooks; docs/python.md,
"DDP communication hooks"): under torch's DistributedDataParallel over gloo,
int8_hook returns, bucket by bucket and bit for bit, what a reference written
here in torch computes from every rank's bucket -- int8 packets with error
feedback, summed by each shard's owner in rank order and packed once more --
and the replicas stay equal."""

import os

import pytest
import torch

from distopt.torch import ddp_comm_hooks
from test_sharded import int8_packets, run_worker, same_bits

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "ddp_hook_worker.py")


def packets(v):
    """What an int8 packet delivers of v (a shard), and what it lost."""
    got = int8_packets(v)
    return got, v - got


@pytest.mark.parametrize("world,find_unused", [(2, False), (3, False), (2, True)])
def test_int8_hook_is_the_two_phase_int8_reduction(tmp_path, world, find_unused):
    """find_unused: DDP all-reduces its map of used parameters during
    backward, on its group, while the hook's phases run on the state's own."""
    out = run_worker(WORKER, str(tmp_path), "gloo", world, *(["--find-unused"] if find_unused else []))
    ranks = [torch.load(f"{out}.{r}") for r in range(world)]
    for r in range(1, world):
        for p, q in zip(ranks[0]["params"], ranks[r]["params"]):
            assert same_bits(p, q), f"rank {r}'s replica differs"
    residual, sums = {}, {}  # per bucket: each rank's, each owner's
    steps = len(ranks[0]["records"])
    compressed = 0
    for t in range(steps):
        buckets = [{rec["index"]: rec for rec in ranks[r]["records"][t]} for r in range(world)]
        assert all(b.keys() == buckets[0].keys() for b in buckets)
        for index in buckets[0]:
            ins = [buckets[r][index]["input"] for r in range(world)]
            size = ins[0].numel()
            if t < 2:  # the warm-up: the mean, uncompressed
                want = sum(x / world for x in ins)
                for r in range(world):
                    torch.testing.assert_close(buckets[r][index]["output"], want)
                continue
            compressed += 1
            shard = -(-size // world)
            if index not in residual or residual[index][0].numel() != world * shard:
                residual[index] = [torch.zeros(world * shard) for _ in range(world)]
                sums[index] = [torch.zeros(shard) for _ in range(world)]
            arrived = []
            for r in range(world):
                v = torch.zeros(world * shard)
                v[:size] = ins[r] / world
                v = v + residual[index][r]
                got, lost = zip(*(packets(v[d * shard:(d + 1) * shard]) for d in range(world)))
                arrived.append(got)
                residual[index][r] = torch.cat(lost)
            mean = []
            for d in range(world):
                total = arrived[0][d]
                for r in range(1, world):
                    total = total + arrived[r][d]
                got, sums[index][d] = packets(total + sums[index][d])
                mean.append(got)
            want = torch.cat(mean)[:size]
            for r in range(world):
                assert same_bits(buckets[r][index]["output"], want), f"step {t} bucket {index} rank {r}"
            assert not same_bits(want, sum(x / world for x in ins)), "the packets lost nothing"
    assert compressed >= 2 * (steps - 2)  # several buckets a step
    assert ranks[0]["losses"][-1] < ranks[0]["losses"][0]


def test_int8_state_refuses_a_start_before_the_buckets_are_rebuilt():
    for bad in (0, 1, 2.5, True):
        with pytest.raises(ValueError, match=r"^start_iter must be an integer of at least 2 \(got "):
            ddp_comm_hooks.Int8State(start_iter=bad)


def test_int8_hook_refuses_what_it_cannot_compress_in_one_line(tmp_path):
    """A bucket that is not float32 on the CPU: DDP's backward raises the
    hook's one-line TypeError (torch 1.13 wraps it in a RuntimeError whose
    first line it is; here at world 1, in this process)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = DDP(torch.nn.Linear(4, 3).double())
        model.register_comm_hook(ddp_comm_hooks.Int8State(), ddp_comm_hooks.int8_hook)
        with pytest.raises((TypeError, RuntimeError)) as e:
            model(torch.ones(2, 4, dtype=torch.float64)).sum().backward()
        assert str(e.value).splitlines()[0].removeprefix("TypeError: ") == (
            "int8_hook compresses float32 gradients on the CPU (got torch.float64 on cpu): keep torch's hooks for "
            "the others")
    finally:
        dist.destroy_process_group()
