"""distopt.torch.distributed.GossipOptimizer and GossipDataParallel
(docs/python.md, "Gossip and DiLoCo").

Each launch (gossip_worker.py) trains the mlp with sgp, dpsgd and diloco,
each rank on batches of its own, and every rank records the gradients
torch computed and the parameters it ended with. The reference is the C++
strategy itself (``_core.replay_strategy``: the threads backend, one
thread per rank, stepped with those gradients): every rank's parameters
must have its bits, under mpirun and under torchrun with a gloo group, at
worlds 2, 3 and 4.
"""

import os

import pytest
import torch

import distopt.torch.comm as dcomm
import distopt.torch.optim as dopt
from distopt import _core
from distopt.torch.distributed import GOSSIP_STRATEGIES, GossipDataParallel, GossipOptimizer, _gossip_kwargs

from conftest import loss_of, mlp
from test_sharded import run_worker, same_bits

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "gossip_worker.py")


def _read(out, n):
    return [torch.load(f"{out}.r{r}") for r in range(n)]


def launch(tmp, how, n, *args):
    out = run_worker(WORKER, tmp, how, n, *args)
    return _read(out, n)


def replay(ranks, name):
    """Every rank's model after every step (out[rank][step]) from the C++
    strategy on the ranks' recorded gradients."""
    runs = [rk["runs"][name] for rk in ranks]
    first = runs[0]
    gossip, options = _gossip_kwargs(dict(first["options"]))
    specs = [(f"params[{i}]", shape) for i, shape in enumerate(first["shapes"])]
    grads = [[run["grads"][s].numpy() for run in runs] for s in range(len(first["grads"]))]
    out = _core.replay_strategy(first["strategy"], first["rule"], specs, first["initial"].numpy(), options, gossip,
                                grads)
    return [[torch.tensor(m) for m in steps] for steps in out]


def assert_replayed(ranks, name, what):
    """Every forward ran on the C++ strategy's model of that step, and the
    last step left its parameters (so a gradient taken at the wrong model,
    which the replay would take over, still fails)."""
    expected = replay(ranks, name)
    for r, (rk, models) in enumerate(zip(ranks, expected)):
        run = rk["runs"][name]
        assert same_bits(run["seen"][0], run["initial"]), f"{what} {name}: rank {r}'s first forward"
        for s, (got, e) in enumerate(zip(run["seen"][1:] + [run["params"]], models)):
            assert same_bits(got, e), f"{what} {name}: rank {r} after step {s + 1} differs from the C++ strategy " \
                                      f"(max |diff| {(got - e).abs().max().item():.3g})"


@pytest.mark.parametrize("how", ["mpi", "gloo"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_gossip_gives_the_cpp_strategys_bits(tmp_path, how, world):
    ranks = launch(str(tmp_path), how, world)
    for name in ("sgp", "dpsgd", "diloco"):
        assert_replayed(ranks, name, f"{how} world {world}")
        runs = [rk["runs"][name] for rk in ranks]
        # The ranks trained on batches of their own, so their models differ
        # -- but sgp's round at two ranks averages exactly, and DiLoCo's ranks
        # end synced (step 6 of H 2) -- the consensus distance says by how
        # much (the same on every rank), and the mean is the same bits
        # everywhere. (dpsgd steps after its exchange: never synced.)
        differ = not all(same_bits(runs[0]["params"], r["params"]) for r in runs[1:])
        assert differ == {"sgp": world > 2, "dpsgd": True, "diloco": False}[name], name
        assert (runs[0]["consensus"] > 1e-9) == differ, name  # (a synced mean over 3 ranks may round)
        assert all(r["consensus"] == runs[0]["consensus"] for r in runs)
        assert all(same_bits(r["averaged"], runs[0]["averaged"]) for r in runs)
        assert all(r["bytes_sent"] > 0 for r in runs), name
        mean = torch.stack([r["params"] for r in runs]).double().mean(0)
        assert torch.allclose(runs[0]["averaged"].double(), mean, atol=1e-6)


@pytest.mark.parametrize("how", ["mpi", "gloo"])
def test_every_gossip_strategy_and_streaming_diloco(tmp_path, how):
    """osgp, slowmo and streaming DiLoCo (fragments, bf16 pseudo-gradients
    with error feedback; fragments whose averages land a step late) at
    world 4: the C++ strategy's bits. adpsgd, whose bits depend on timing,
    trains (its gossip thread, like the late averages, runs on a
    communicator split off: over torch, a group from new_group)."""
    names = ("osgp", "slowmo", "diloco-streaming", "diloco-delayed")
    ranks = launch(str(tmp_path), how, 4, "--runs", ",".join(names + ("adpsgd",)), "--steps", "8")
    for name in names:
        assert_replayed(ranks, name, f"{how} world 4")
    for rk in ranks:
        run = rk["runs"]["adpsgd"]
        assert run["steps"] == 8 and torch.isfinite(run["params"]).all() and run["bytes_sent"] > 0


@pytest.mark.parametrize("how", ["mpi", "gloo"])
def test_checkpoint_resumes_every_rank_where_it_was(tmp_path, how):
    """Saved after 3 steps and resumed in new processes: the bits of the
    run that never stopped (the push-sum weights and DiLoCo's outer state
    included)."""
    tmp = str(tmp_path)
    runs = "sgp,dpsgd,diloco"
    whole = launch(tmp, how, 2, "--runs", runs)
    ckpt = os.path.join(tmp, "ckpt")
    launch(tmp, how, 2, "--runs", runs, "--save", ckpt, "--save-at", "3")
    resumed = launch(tmp, how, 2, "--runs", runs, "--load", ckpt)
    for name in runs.split(","):
        for r in range(2):
            assert resumed[r]["runs"][name]["first"] == 3
            assert resumed[r]["runs"][name]["steps"] == 6
            assert same_bits(resumed[r]["runs"][name]["params"], whole[r]["runs"][name]["params"]), f"{name} rank {r}"


def test_one_rank_and_bad_input():
    model = mlp(seed=0)
    with pytest.raises(ValueError, match="strategy 'zero1': the gossip optimizer runs sgp"):
        GossipOptimizer(model.parameters(), "sgd", "zero1", lr=0.1)
    with pytest.raises(ValueError, match="sync_every: --sync-every applies to --strategy diloco, not sgp"):
        GossipOptimizer(model.parameters(), "sgd", "sgp", lr=0.1, sync_every=3)
    with pytest.raises(TypeError, match="sgd has no option 'syncevery'"):
        GossipOptimizer(model.parameters(), "sgd", "diloco", lr=0.1, syncevery=3)
    with pytest.raises(ValueError, match="sync_every must be a whole number"):
        GossipOptimizer(model.parameters(), "sgd", "diloco", lr=0.1, sync_every=2.5)
    with pytest.raises(ValueError, match="topology"):
        GossipOptimizer(model.parameters(), "sgd", "sgp", lr=0.1, topology="moebius")
    with pytest.raises(ValueError, match="gossip options apply to the gossip strategies"):
        _core.Sharded(_core.single(), "ddp", "sgd", [("w", [2])], torch.zeros(2).numpy(), {}, 8, {"topology": "ring"})
    assert set(GOSSIP_STRATEGIES) >= {"sgp", "osgp", "dpsgd", "slowmo", "diloco"}


def test_wrapper_trains_one_rank_like_the_drop_in_sgd():
    """At one rank there is nobody to mix with: sgp is distopt's SGD drop-in."""
    torch.manual_seed(0)
    ours, ref = mlp(seed=0), mlp(seed=0)
    wrapped = GossipDataParallel(ours, "sgp", optimizer="sgd", comm=dcomm.single(), lr=0.1, momentum=0.9)
    ref_opt = dopt.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        x, y = torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)
        wrapped.optimizer.zero_grad()
        loss_of(wrapped, x, y).backward()
        wrapped.optimizer.step()
        ref_opt.zero_grad()
        loss_of(ref, x, y).backward()
        ref_opt.step()
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert same_bits(p.detach(), q.detach())
    assert wrapped.consensus_distance() == 0.0
    with wrapped.averaged():
        mean = {n: p.detach().clone() for n, p in ours.named_parameters()}
    for n, p in ours.named_parameters():
        assert same_bits(mean[n], p.detach())
    assert set(wrapped.average_parameters()) == {n for n, _ in ours.named_parameters()}


def _one_step(model, opt, seed=5):
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    loss_of(model, torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)).backward()
    opt.step()


def test_parameters_written_between_steps_are_refused():
    """The strategy's model is what a gossip rank steps: a value written
    into the parameters (or a step inside averaged()) is one line, not lost."""
    model = mlp(seed=0)
    wrapped = GossipDataParallel(model, "sgp", optimizer="sgd", comm=dcomm.single(), lr=0.1)
    _one_step(wrapped, wrapped.optimizer)
    kept = model[0].bias.detach().clone()
    with torch.no_grad():
        model[0].bias.add_(1.0)
    with pytest.raises(ValueError, match=r"params\[1\] was written since the last step .* load\(\)"):
        _one_step(wrapped, wrapped.optimizer)
    with torch.no_grad():
        model[0].bias.copy_(kept)  # back to the strategy's values: steps again
    _one_step(wrapped, wrapped.optimizer)
    with pytest.raises(ValueError, match="was written since the last step"), wrapped.averaged():
        model[0].weight.data.mul_(2)
        _one_step(wrapped, wrapped.optimizer)


def test_a_checkpoint_of_another_strategy_resumes_from_the_mean_with_a_warning(tmp_path):
    a = mlp(seed=0)
    oa = GossipOptimizer(a.parameters(), "sgd", "sgp", comm=dcomm.single(), lr=0.1, momentum=0.9)
    for k in range(3):
        _one_step(a, oa, seed=k)
    oa.save(str(tmp_path), oa.steps)
    b = mlp(seed=1)
    ob = GossipOptimizer(b.parameters(), "sgd", "osgp", comm=dcomm.single(), lr=0.1, momentum=0.9)
    with pytest.warns(UserWarning, match="resuming the sgp checkpoint of 1 ranks as osgp at 1"):
        assert ob.load(str(tmp_path)) == 3
    for p, q in zip(a.parameters(), b.parameters()):
        assert same_bits(p.detach(), q.detach())
    assert ob.steps == 3
