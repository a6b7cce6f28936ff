"""Quantized optimizer state from Python (docs/optimizers.md, "Quantized
state"; docs/python.md): Adam8bit, AdamW8bit, AdamW4bit and ``state_dtype=``
against torch.optim with its state quantized between steps as bitsandbytes
and torchao keep it (the quantizer of scripts/gen_golden_lowbit.py, in
torch), state that is the C++ optimizer's own memory, state_dict round trips
and interchange with torch, and the sharded optimizer's ddp/zero1/zero2
bits under MPI and gloo."""

import copy
import importlib.util
import os
import sys

import pytest
import torch

from distopt.torch import optim as dopt
from test_sharded import assert_same_run, launch_gloo, launch_mpi

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
ATOL = 1e-6  # the optimizer goldens' tolerance (an ulp of torch's fused multiply-add)


def reference():
    """scripts/gen_golden_lowbit.py: torch's quantize/dequantize."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    spec = importlib.util.spec_from_file_location("gen_golden_lowbit", os.path.join(ROOT, "scripts",
                                                                                     "gen_golden_lowbit.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REF = reference()
SHAPES = [(40, 130), (300,)]  # 5200 elements (a last block of 80 in both storages); under 4096: fp32 state


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def grads(step, seed=1):
    g = torch.Generator().manual_seed(seed + 100 * step)
    return [torch.randn(s, generator=g) * (2.0 ** -(step % 3 * 5)) for s in SHAPES]


CASES = [
    ("AdamW8bit", dict(lr=1e-2), torch.optim.AdamW, dict(lr=1e-2), "int8", "adamw"),
    ("AdamW4bit", dict(lr=1e-2, betas=(0.8, 0.95)), torch.optim.AdamW, dict(lr=1e-2, betas=(0.8, 0.95)), "int4",
     "adamw"),
    ("Adam8bit", dict(lr=3e-3, amsgrad=True, weight_decay=1e-3), torch.optim.Adam,
     dict(lr=3e-3, amsgrad=True, weight_decay=1e-3), "int8", "adam"),
    ("SGD", dict(lr=5e-2, momentum=0.9, nesterov=True, state_dtype="int4"), torch.optim.SGD,
     dict(lr=5e-2, momentum=0.9, nesterov=True), "int4", "sgd"),
]


def torch_quantized(cls, kw, dtype, rule, steps):
    """torch's optimizer with its state dequantized before and quantized
    after every step (gen_golden_lowbit.py's run)."""
    ps = make_params()
    opt = cls(ps, **kw)
    saved = {}
    for step in range(steps):
        for i, (p, g) in enumerate(zip(ps, grads(step))):
            p.grad = g.clone()
            for key, signed in REF.KEYS[rule]:
                if (i, key) in saved:
                    opt.state[p][key].copy_(REF.dequantize(*saved[(i, key)], dtype, signed).view_as(p))
        opt.step()
        for i, p in enumerate(ps):
            if p.numel() >= REF.MIN_SIZE:
                for key, signed in REF.KEYS[rule]:
                    if key in opt.state[p]:
                        saved[(i, key)] = REF.quantize(opt.state[p][key].flatten(), dtype, signed)
    return ps, saved


def ours(name, kw, steps, opt=None, ps=None):
    ps = ps or make_params()
    opt = opt or getattr(dopt, name)(ps, **kw)
    for step in range(steps):
        for p, g in zip(ps, grads(step)):
            p.grad = g.clone()
        opt.step()
    return ps, opt


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_steps_match_torch_with_quantized_state(case):
    name, kw, cls, torch_kw, dtype, rule = case
    expect, saved = torch_quantized(cls, torch_kw, dtype, rule, 5)
    got, opt = ours(name, kw, 5)
    for a, b in zip(got, expect):
        assert torch.allclose(a, b, atol=ATOL, rtol=0), (a - b).abs().max()
    # The large tensor's state is codes and scales, in the C++ optimizer's
    # memory; the small one's fp32, as torch keeps it.
    big, small = opt.state[got[0]], opt.state[got[1]]
    for key, signed in REF.KEYS[rule]:
        if (0, key) not in saved:
            continue
        codes, absmax = big[key + ".codes"], big[key + ".absmax"]
        assert key not in big and codes.dtype == torch.uint8 and absmax.dtype == torch.float32
        assert codes.numel() == (5200 if dtype == "int8" else 2600), codes.shape
        assert absmax.numel() == len(saved[(0, key)][1])
        assert small[key].dtype == torch.float32 and small[key].shape == got[1].shape
        # Torch's scales to an ulp of its fused multiply-add; its codes nearly all.
        assert torch.allclose(absmax, saved[(0, key)][1], rtol=1e-5, atol=0)
        if dtype == "int8":
            mine = codes.long()
        else:
            mine = torch.stack([codes & 15, codes >> 4], 1).reshape(-1).long()
        agree = (mine == saved[(0, key)][0]).float().mean().item()
        assert agree > 0.99, f"{key}: {agree} of the codes are torch's"


def test_state_is_the_optimizers_memory_and_a_quarter_of_fp32s():
    ps, opt = ours("AdamW8bit", {}, 2)
    before = opt.state[ps[0]]["exp_avg.codes"].clone()
    ours("AdamW8bit", {}, 1, opt=opt, ps=ps)
    assert not torch.equal(before, opt.state[ps[0]]["exp_avg.codes"]), "a view, updated by the step"
    nbytes = {}
    for name in ("AdamW", "AdamW8bit", "AdamW4bit"):
        p = [torch.nn.Parameter(torch.zeros(1024, 1024))]
        o = getattr(dopt, name)(p)
        p[0].grad = torch.ones(1024, 1024)
        o.step()
        nbytes[name] = sum(t.numel() * t.element_size() for t in o.state[p[0]].values() if t.dim() > 0)
    assert nbytes["AdamW8bit"] / nbytes["AdamW"] <= 0.27 and nbytes["AdamW4bit"] / nbytes["AdamW"] <= 0.15, nbytes


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW4bit"])
def test_state_dict_round_trips_and_takes_torchs(name):
    ps, opt = ours(name, {}, 3)
    sd = copy.deepcopy(opt.state_dict())
    assert sd["param_groups"][0]["state_dtype"] == ("int8" if name == "AdamW8bit" else "int4")
    again = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    other = getattr(dopt, name)(again)
    other.load_state_dict(sd)
    for key, value in opt.state[ps[0]].items():
        assert torch.equal(other.state[again[0]][key], value), key
    ours(name, {}, 2, opt=opt, ps=ps)
    ours(name, {}, 2, opt=other, ps=again)
    for a, b in zip(ps, again):
        assert torch.equal(a, b)
    # torch's fp32 state loads, quantized afresh; the small tensor's as it is.
    tp = [torch.nn.Parameter(p.detach().clone()) for p in make_params()]
    topt = torch.optim.AdamW(tp)
    for p, g in zip(tp, grads(0)):
        p.grad = g
    topt.step()
    mine = [torch.nn.Parameter(p.detach().clone()) for p in tp]
    q = getattr(dopt, name)(mine)
    q.load_state_dict(copy.deepcopy(topt.state_dict()))
    dtype = "int8" if name == "AdamW8bit" else "int4"
    codes, absmax = REF.quantize(topt.state[tp[0]]["exp_avg"].flatten(), dtype, True)
    assert torch.equal(q.state[mine[0]]["exp_avg.absmax"], absmax)
    assert torch.equal(q.state[mine[1]]["exp_avg_sq"], topt.state[tp[1]]["exp_avg_sq"])
    with pytest.raises(ValueError, match=r"loaded .exp_avg.codes. must be \d+ uint8 codes"):
        bad = copy.deepcopy(sd)
        bad["state"][0]["exp_avg.codes"] = bad["state"][0]["exp_avg.codes"].float()
        getattr(dopt, name)([torch.nn.Parameter(p.detach().clone()) for p in ps]).load_state_dict(bad)


def test_a_group_keeps_its_own_storage_and_bad_input_is_one_line():
    big, emb = torch.nn.Parameter(torch.randn(64, 128)), torch.nn.Parameter(torch.randn(64, 128))
    opt = dopt.AdamW([{"params": [big], "state_dtype": "int8"}, {"params": [emb]}])
    big.grad, emb.grad = torch.randn(64, 128), torch.randn(64, 128)
    opt.step()
    assert "exp_avg.codes" in opt.state[big] and opt.state[emb]["exp_avg"].dtype == torch.float32
    with pytest.raises(ValueError, match="adagrad keeps no state that can be quantized"):
        dopt.Adagrad([torch.nn.Parameter(torch.zeros(3))]).add_param_group(
            {"params": [torch.nn.Parameter(torch.zeros(3))], "state_dtype": "int8"})
    with pytest.raises(ValueError, match="unknown state_dtype 'int3'"):
        dopt.AdamW([big], state_dtype="int3")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("lowbit"))
    return {("mpi", 3, "int8"): launch_mpi(tmp, 3, "--rules", "adamw", "--state-dtype", "int8"),
            ("torch", 2, "int4"): launch_gloo(tmp, 2, "--rules", "adamw", "--state-dtype", "int4")}


def test_the_sharded_optimizer_gives_ddps_bits_with_quantized_state(sharded):
    for (how, world, dtype), r in sharded.items():
        assert r["world"] == world and r["backend"] == how  # "torch": a gloo group of torch.distributed
        for s in ("zero1", "zero2"):
            assert_same_run(r["runs"][f"adamw/{s}"], r["runs"]["adamw/ddp"], f"{how} {world} {dtype} {s} vs ddp", 4)
        state = r["runs"]["adamw/zero2"]["state"]["state"]
        assert state[0]["exp_avg.absmax"].numel() == 6144 // (256 if dtype == "int8" else 128)
        assert "exp_avg.absmax" not in state[1], "a bias keeps fp32 state"


def test_a_load_keeps_the_groups_storage_and_takes_the_sharded_optimizers_codes():
    from distopt.torch.distributed import ShardedOptimizer

    ps, opt8 = ours("AdamW8bit", {}, 3)
    sd8 = copy.deepcopy(opt8.state_dict())
    q = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    o4 = dopt.AdamW4bit(q)
    with pytest.raises(ValueError, match="must be 2600 uint8 codes of this group's state_dtype int4"):
        o4.load_state_dict(sd8)  # int8 codes into int4 storage
    assert o4.param_groups[0]["state_dtype"] == "int4", "a load keeps the group's storage"
    # The sharded optimizer's state_dict (values and their scales) into a drop-in: the same codes.
    sp = make_params()
    so = ShardedOptimizer(sp, "adamw", "ddp", state_dtype="int8")
    for step in range(3):
        so.zero_grad()
        sum((p * g).sum() for p, g in zip(sp, grads(step))).backward()
        so.step()
    ssd = so.state_dict()
    assert "exp_avg.absmax" in ssd["state"][0] and "exp_avg.codes" not in ssd["state"][0]
    d = dopt.AdamW8bit([torch.nn.Parameter(p.detach().clone()) for p in sp])
    d.load_state_dict(copy.deepcopy(ssd))
    mine = d.state[d.param_groups[0]["params"][0]]
    assert torch.equal(mine["exp_avg.absmax"], ssd["state"][0]["exp_avg.absmax"])
    back = REF.dequantize(mine["exp_avg.codes"].long(), mine["exp_avg.absmax"], "int8", True)
    assert torch.equal(back, ssd["state"][0]["exp_avg"].flatten())
    tampered = copy.deepcopy(ssd)
    tampered["state"][0]["exp_avg"].view(-1)[5] += 1e-3
    with pytest.raises(ValueError, match=r"loaded 'exp_avg' is not int8 codes times its scales \(block 0\)"):
        dopt.AdamW8bit([torch.nn.Parameter(p.detach().clone()) for p in sp]).load_state_dict(tampered)
    # The sharded optimizer's int8 scales into int4 storage: quantized afresh; scales of a size no storage has: refused.
    d4 = dopt.AdamW4bit([torch.nn.Parameter(p.detach().clone()) for p in sp])
    d4.load_state_dict(copy.deepcopy(ssd))
    mine4 = d4.state[d4.param_groups[0]["params"][0]]
    fresh = REF.quantize(ssd["state"][0]["exp_avg"].flatten(), "int4", True)
    assert torch.equal(mine4["exp_avg.absmax"], fresh[1])
    misfit = copy.deepcopy(ssd)
    misfit["state"][0]["exp_avg.absmax"] = misfit["state"][0]["exp_avg.absmax"][:-1]
    with pytest.raises(ValueError, match=r"loaded 'exp_avg.absmax' has \d+ scales, it needs \d+ \(int8 blocks of 256\)"):
        dopt.AdamW8bit([torch.nn.Parameter(p.detach().clone()) for p in sp]).load_state_dict(misfit)


@pytest.mark.parametrize("case", [("AdamW", dict(lr=1e-2), torch.optim.AdamW, ("exp_avg", "exp_avg_sq")),
                                  ("SGD", dict(lr=5e-2, momentum=0.9), torch.optim.SGD, ("momentum_buffer",))],
                         ids=["AdamW", "SGD"])
def test_bf16_state_is_torchs_step_with_its_state_rounded_to_bf16(case):
    name, kw, cls, keys = case
    tp = make_params()
    topt = cls(tp, **kw)
    for step in range(5):
        for p, g in zip(tp, grads(step)):
            p.grad = g.clone()
        topt.step()
        for p in tp:  # torch's state kept as bfloat16 between steps (round to nearest even)
            for key in keys:
                topt.state[p][key].copy_(topt.state[p][key].to(torch.bfloat16).float())
    got, opt = ours(name, dict(kw, state_dtype="bf16"), 5)
    for a, b in zip(got, tp):
        assert torch.allclose(a, b, atol=ATOL, rtol=0), (a - b).abs().max()
    for p, t in zip(got, tp):  # every tensor, the small one too, keeps bf16 state under torch's key
        for key in keys:
            mine = opt.state[p][key]
            assert mine.dtype == torch.bfloat16 and mine.shape == p.shape, (key, mine.dtype, mine.shape)
            agree = (mine.float() == topt.state[t][key]).float().mean().item()
            assert agree > 0.99, f"{key}: {agree} of the values are torch's"
    # state_dict round-trips bit for bit; torch's optimizer loads it; it loads torch's (rounded).
    sd = copy.deepcopy(opt.state_dict())
    again = [torch.nn.Parameter(p.detach().clone()) for p in got]
    other = getattr(dopt, name)(again, **dict(kw, state_dtype="bf16"))
    other.load_state_dict(sd)
    for key in keys:
        assert torch.equal(other.state[again[0]][key], opt.state[got[0]][key])
    ours(name, {}, 2, opt=opt, ps=got)
    ours(name, {}, 2, opt=other, ps=again)
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    plain = cls([torch.nn.Parameter(p.detach().clone()) for p in got], **kw)
    plain.load_state_dict(copy.deepcopy(sd))
    fresh = getattr(dopt, name)([torch.nn.Parameter(p.detach().clone()) for p in tp], **dict(kw, state_dtype="bf16"))
    fresh.load_state_dict(copy.deepcopy(topt.state_dict()))
    st = fresh.state[fresh.param_groups[0]["params"][0]]
    assert torch.equal(st[keys[0]], topt.state[tp[0]][keys[0]].to(torch.bfloat16))


def test_bf16_state_is_half_of_fp32s_and_int8_codes_do_not_load_into_it():
    nbytes = {}
    for dtype in ("f32", "bf16"):
        p = [torch.nn.Parameter(torch.zeros(1024, 1024))]
        o = dopt.AdamW(p, state_dtype=dtype)
        p[0].grad = torch.ones(1024, 1024)
        o.step()
        nbytes[dtype] = sum(t.numel() * t.element_size() for t in o.state[p[0]].values() if t.dim() > 0)
    assert nbytes["bf16"] * 2 == nbytes["f32"], nbytes
    ps, opt8 = ours("AdamW8bit", {}, 2)
    with pytest.raises(ValueError, match=r"loaded 'exp_avg' is another state_dtype's codes \('exp_avg.codes'\)"):
        dopt.AdamW([torch.nn.Parameter(p.detach().clone()) for p in ps],
                   state_dtype="bf16").load_state_dict(copy.deepcopy(opt8.state_dict()))


def test_bf16_state_refuses_complex_parameters_and_loads_nans_as_the_cpp_side_rounds():
    with pytest.raises(ValueError, match="state_dtype bf16 with a complex parameter"):
        dopt.AdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))], state_dtype="bf16")
    ps, opt = ours("AdamW", dict(state_dtype="bf16"), 1)
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["exp_avg"] = sd["state"][0]["exp_avg"].float()
    sd["state"][0]["exp_avg"].view(-1)[:16] = float("nan")  # fp32 NaNs: rounded by the C++ side to 0x7FC0
    other = dopt.AdamW([torch.nn.Parameter(p.detach().clone()) for p in ps], state_dtype="bf16")
    other.load_state_dict(sd)
    bits = other.state[other.param_groups[0]["params"][0]]["exp_avg"].view(torch.int16).view(-1)[:16]
    assert (bits == 0x7FC0).all(), bits
