"""distopt.torch.distributed.FullyShardedDataParallel: ZeRO-3 for a
torch.nn.Module (docs/python.md, "ZeRO-3 for a module").

Each launch (fsdp_worker.py) trains one small transformer-shaped model with
``ShardedOptimizer(strategy="ddp")`` and the same model wrapped in
``FullyShardedDataParallel``, each rank on batches of its own: after every
step the wrapper's full state_dict must have ddp's bits, for adamw, lamb,
muon and adafactor, under mpirun and under torchrun with a gloo group, at
worlds 2 to 4; with the blocks under torch.utils.checkpoint; across a save
and a load into a fresh wrapper.
"""

import os
import sys

import pytest
import torch

from distopt.torch.distributed import GATHERING_STRATEGIES, FullyShardedDataParallel

from test_sharded import run_worker, same_bits

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "fsdp_worker.py")
sys.path.insert(0, HERE)
from fsdp_worker import Block, Net, batches  # noqa: E402


def launch(tmp, how, n, *args):
    out = run_worker(WORKER, tmp, how, n, *args)
    return [torch.load(f"{out}.r{r}") for r in range(n)]


def assert_ddp_bits(ranks, what):
    for rk in ranks:
        for rule, run in rk["runs"].items():
            assert len(run["got"]) == len(run["expected"])
            for s, (got, exp) in enumerate(zip(run["got"], run["expected"])):
                assert got.keys() == exp.keys()
                for k in exp:
                    assert same_bits(got[k], exp[k]), \
                        f"{what} {rule}: rank {rk['rank']} {k} after step {s + 1} differs from ddp " \
                        f"(max |diff| {(got[k] - exp[k]).abs().max().item():.3g})"


@pytest.mark.parametrize("how,world", [("mpi", 2), ("gloo", 2), ("mpi", 3), ("gloo", 4)])
def test_zero3_gives_ddps_bits_for_every_rule(tmp_path, how, world):
    ranks = launch(str(tmp_path), how, world)
    assert_ddp_bits(ranks, f"{how} world {world}")
    run = ranks[0]["runs"]["adamw"]
    assert run["units"] == ["root", "blocks.0", "blocks.1", "blocks.2"]
    # The plain module took the full state_dict and runs.
    assert torch.isfinite(run["plain_out"]).all()


@pytest.mark.parametrize("how,world,dtype", [("mpi", 3, "int8"), ("gloo", 2, "int4")])
def test_zero3_with_quantized_state_gives_ddps_bits(tmp_path, how, world, dtype):
    # Width 48: each block's up and down weights (4608 elements) keep
    # quantized state and follow tensors of 96 and 48 elements in their
    # unit: the layout places them on 256-element multiples.
    ranks = launch(str(tmp_path), how, world, "--rules", "adamw", "--width", "48", "--state-dtype", dtype)
    assert_ddp_bits(ranks, f"{how} world {world} {dtype}")
    assert "exp_avg.absmax" in ranks[0]["runs"]["adamw"]["state_keys"]


@pytest.mark.parametrize("how", ["mpi", "gloo"])
def test_checkpointed_activations_other_policies_and_resume(tmp_path, how):
    ranks = launch(str(tmp_path), how, 2, "--rules", "adamw,muon", "--checkpointing", "--prefetch", "2",
                   "--save", str(tmp_path / "ck"))
    assert_ddp_bits(ranks, f"{how} checkpointing, save and load")
    ranks = launch(str(tmp_path), how, 2, "--rules", "lamb", "--policy", "size")
    assert_ddp_bits(ranks, f"{how} size policy")
    assert ranks[0]["runs"]["lamb"]["units"] == ["root", "blocks.0", "blocks.1", "blocks.2"]


@pytest.mark.parametrize("how,saved,loaded", [("mpi", 2, 3), ("gloo", 3, 2)])
def test_a_checkpoint_reshards_to_another_world(tmp_path, how, saved, loaded):
    """Saved at one world size, loaded at another: the same full model and
    optimizer state; ddp loads it too."""
    ck = str(tmp_path / "ck")
    before = launch(str(tmp_path), how, saved, "--rules", "adamw,muon", "--save-only", "--save", ck)[0]["runs"]
    for rk in launch(str(tmp_path), how, loaded, "--rules", "adamw,muon", "--load-from", ck):
        for rule, run in rk["runs"].items():
            for k, v in before[rule]["model"].items():
                assert same_bits(run["model"][k], v), f"{rule}: {k} after the load at world {loaded}"
                assert same_bits(run["ddp_model"][k], v), f"{rule}: ddp's {k} after the load"
            b, g = before[rule]["optimizer"], run["optimizer"]
            assert b["state"].keys() == g["state"].keys() and b["state"]
            for i in b["state"]:
                for key, v in b["state"][i].items():
                    assert same_bits(torch.as_tensor(g["state"][i][key]), torch.as_tensor(v)), f"{rule} state {i}.{key}"


def test_one_rank_units_state_dict_and_bad_input():
    net = Net()
    model = FullyShardedDataParallel(net, wrap=[net.blocks[0], net.blocks[2]], lr=1e-2)
    assert model.units == ["root", "blocks.0", "blocks.2"]
    assert GATHERING_STRATEGIES == ("zero3",)
    # Between steps the parameters hold no storage; summon_full_params gathers them.
    assert all(p.storage().size() == 0 for p in net.parameters())
    with model.summon_full_params():
        assert same_bits(net.embed.weight, Net().embed.weight)
    (x, y), = batches(1, seed=3)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    assert all(p.grad is None for p in net.parameters())  # handed to the strategy during backward
    model.optimizer.step()
    with torch.no_grad():
        model(x)  # evaluation gathers and frees again
    assert all(p.storage().size() == 0 for p in net.parameters())
    plain = Net(seed=4)
    plain.load_state_dict(model.state_dict())
    torch.nn.functional.cross_entropy(model(x), y).backward()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="came twice in one step"):
        model.optimizer.step()
    with pytest.raises(ValueError, match="give wrap or min_num_params, not both"):
        FullyShardedDataParallel(Net(), wrap=Block, min_num_params=10)
    with pytest.raises(ValueError, match="not a submodule"):
        FullyShardedDataParallel(Net(), wrap=[Block(4)])
    tied = Net()
    tied.blocks[1].up.weight = tied.blocks[0].up.weight
    with pytest.raises(ValueError, match="blocks.1.up.weight is shared with blocks.0's"):
        FullyShardedDataParallel(tied, wrap=Block)
    with pytest.raises(ValueError, match="prefetch_units must be at least 0"):
        FullyShardedDataParallel(Net(), wrap=Block, prefetch_units=-1)
    with pytest.raises(ValueError, match="max live parameters 10 is below"):
        FullyShardedDataParallel(Net(), wrap=Block, max_live_params=10)


@pytest.mark.parametrize("blocks_live", [1, 2])
def test_prefetch_keeps_under_the_live_limit(blocks_live):
    """Every unit's storage counted while each block runs: never past
    max_live_params; with room for two blocks, the next one is prefetched."""
    net = Net()
    unit = sum(p.numel() for p in net.blocks[0].parameters())
    root = sum(p.numel() for n, p in net.named_parameters() if not n.startswith("blocks"))
    limit = root + blocks_live * unit + 64  # (each unit padded to 16 elements)
    model = FullyShardedDataParallel(net, wrap=Block, max_live_params=limit, lr=1e-2)
    storages = [net.embed.weight] + [b.norm.weight for b in net.blocks]  # a parameter of each unit
    seen = []
    for b in net.blocks:  # registered after the wrapper's hooks: they run once the block is gathered
        b.register_forward_pre_hook(lambda m, args: seen.append(sum(p.storage().size() for p in storages)))
    (x, y), = batches(1, seed=3)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    model.optimizer.step()
    assert len(seen) == 3 and max(seen) <= limit
    assert max(seen) > root + unit + 64 if blocks_live == 2 else max(seen) <= root + unit + 64


def test_no_sync_accumulates_like_one_bigger_batch():
    (x, y), = batches(1, seed=3)
    a, b = Net(), Net()
    ma = FullyShardedDataParallel(a, wrap=Block, optimizer="lamb", lr=1e-2)
    mb = FullyShardedDataParallel(b, wrap=Block, optimizer="lamb", lr=1e-2)
    torch.nn.functional.cross_entropy(ma(x), y, reduction="sum").backward()
    ma.optimizer.step()
    with mb.no_sync():
        torch.nn.functional.cross_entropy(mb(x[:4]), y[:4], reduction="sum").backward()
    torch.nn.functional.cross_entropy(mb(x[4:]), y[4:], reduction="sum").backward()
    mb.optimizer.step()
    sa, sb = ma.state_dict(), mb.state_dict()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=1e-5, atol=1e-6)
