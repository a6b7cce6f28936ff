"""CPUOffload (docs/python.md, "CPU offload"): its bookkeeping, on CPU
tensors here; on CUDA parameters in test_cuda.py.

The reference is distopt's own drop-in of the same rule on the same
parameters and gradients: the offload steps fp32 masters with the same C++
rule, so parameters and state agree bit for bit.
"""

import copy
import gc
import io
import weakref

import pytest
import torch

import distopt.torch.optim as dopt

CASES = [("adamw", "AdamW", dict(lr=0.01, weight_decay=0.1)), ("adam", "Adam", dict(lr=0.01, amsgrad=True)),
         ("sgd", "SGD", dict(lr=0.1, momentum=0.9)), ("lion", "Lion", dict(lr=1e-3)), ("lamb", "LAMB", dict(lr=0.01)),
         ("adafactor", "Adafactor", dict())]


def _model(dtype, seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    return m.to(dtype)


def _train(model, opt, steps, seed=1, start=0):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(4, 6, generator=g) for _ in range(start + steps)]
    for x in xs[start:]:
        opt.zero_grad()
        model(x.to(next(model.parameters()).dtype)).float().pow(2).sum().backward()
        opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rule,cls,kw", CASES, ids=[c[0] for c in CASES])
def test_the_offloaded_step_has_the_drop_ins_bits(rule, cls, kw, dtype):
    a, b = _model(dtype), _model(dtype)
    ours = dopt.CPUOffload(a.parameters(), optimizer=rule, **kw)
    ref = getattr(dopt, cls)(b.parameters(), **kw)
    _train(a, ours, 6)
    _train(b, ref, 6)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
        for key, value in ref.state[q].items():
            assert torch.equal(torch.as_tensor(ours.state[p][key]), torch.as_tensor(value)), key
        assert ours.state[p]["master_param"].dtype == torch.float32


def test_threads_change_no_bit_and_a_parameter_without_a_gradient_is_left_alone():
    a, b = _model(torch.float32), _model(torch.float32)
    frozen = list(a.parameters())[0]
    before = frozen.detach().clone()
    one = dopt.CPUOffload(list(a.parameters()), lr=0.01)
    four = dopt.CPUOffload(list(b.parameters()), lr=0.01, threads=4)
    for model, opt in ((a, one), (b, four)):
        _train(model, opt, 3)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    frozen.grad = None
    c = _model(torch.float32)
    opt = dopt.CPUOffload(c.parameters(), lr=0.01)
    first = list(c.parameters())[0]
    first.requires_grad_(False)
    _train(c, opt, 2)
    assert torch.equal(first, _model(torch.float32)[0].weight) and first not in opt.state
    assert not torch.equal(before, frozen)  # it did train in the first run


@pytest.mark.parametrize("how", ["state_dict", "deepcopy", "torch.save"])
def test_a_resume_continues_from_the_fp32_masters(how):
    a, b = _model(torch.bfloat16), _model(torch.bfloat16)
    opt = dopt.CPUOffload(a.parameters(), lr=0.01)
    _train(a, opt, 4)
    if how == "state_dict":
        b.load_state_dict(a.state_dict())
        opt_b = dopt.CPUOffload(b.parameters(), lr=0.01)
        opt_b.load_state_dict(copy.deepcopy(opt.state_dict()))
    elif how == "deepcopy":
        b, opt_b = copy.deepcopy((a, opt))
    else:
        buf = io.BytesIO()
        torch.save((a, opt), buf)
        buf.seek(0)
        b, opt_b = torch.load(buf)
    _train(a, opt, 3, start=4)
    _train(b, opt_b, 3, start=4)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["master_param"], opt_b.state[q]["master_param"])


def test_a_torch_state_dict_loads_with_masters_from_the_parameters():
    a, b = _model(torch.float32), _model(torch.float32)
    theirs = torch.optim.AdamW(a.parameters(), lr=0.01)
    _train(a, theirs, 3)
    b.load_state_dict(a.state_dict())
    ours = dopt.CPUOffload(b.parameters(), lr=0.01)
    ours.load_state_dict(copy.deepcopy(theirs.state_dict()))
    _train(a, theirs, 3, start=3)
    _train(b, ours, 3, start=3)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


def test_schedulers_and_groups_work_as_with_torchs_optimizers():
    a, b = _model(torch.float32), _model(torch.float32)
    groups = lambda m: [{"params": [m[0].weight]}, {"params": [m[0].bias, m[2].weight, m[2].bias], "lr": 0.1}]  # noqa: E731
    ours, ref = dopt.CPUOffload(groups(a), lr=0.01), dopt.AdamW(groups(b), lr=0.01)
    s1 = torch.optim.lr_scheduler.OneCycleLR(ours, max_lr=0.05, total_steps=10)
    s2 = torch.optim.lr_scheduler.OneCycleLR(ref, max_lr=0.05, total_steps=10)
    for k in range(6):
        _train(a, ours, 1, start=k)
        _train(b, ref, 1, start=k)
        s1.step()
        s2.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_bad_arguments_are_one_line():
    p = [torch.zeros(3, requires_grad=True)]
    with pytest.raises(ValueError, match=r"^CPUOffload: unknown optimizer 'adamz' \(distopt's rules: .*adamw"):
        dopt.CPUOffload(p, optimizer="adamz")
    with pytest.raises(TypeError, match=r"^CPUOffload: sgd has no option 'betas' \(its options: lr, "):
        dopt.CPUOffload(p, optimizer="sgd", betas=(0.9, 0.99))
    with pytest.raises(ValueError, match=r"threads must be a positive integer, got 0"):
        dopt.CPUOffload(p, threads=0)
    with pytest.raises(ValueError, match="Invalid learning rate|lr"):
        dopt.CPUOffload(p, lr=-1.0)
    with pytest.raises(TypeError, match=r"is torch.float64"):
        dopt.CPUOffload([torch.zeros(3, dtype=torch.float64, requires_grad=True)])


def _grads_after_backward(model, opt, x):
    opt.zero_grad()
    model(x).pow(2).sum().backward()


def test_backward_copies_each_gradient_to_the_host_as_it_is_produced():
    model = _model(torch.float32)
    opt = dopt.CPUOffload(model.parameters(), lr=0.01)
    _grads_after_backward(model, opt, torch.randn(4, 6))
    params = list(model.parameters())
    assert sorted(opt._copied) == list(range(len(params)))  # every gradient, before step() is called
    for i, p in enumerate(params):
        assert torch.equal(opt._host_grads[i], p.grad)
    opt.step()
    assert not opt._copied


@pytest.mark.parametrize("between", ["nothing", "clip", "scale", "accumulate", "zero_one"])
def test_a_gradient_changed_after_backward_is_copied_again(between):
    """The same bits with and without the hooks' copies, whatever happens to
    the gradients between backward and step."""
    results = []
    for overlap in (True, False):
        model = _model(torch.float32)
        opt = dopt.CPUOffload(model.parameters(), lr=0.01, overlap=overlap)
        g = torch.Generator().manual_seed(3)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 6, generator=g)).pow(2).sum().backward()
            if between == "clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            elif between == "scale":
                for p in model.parameters():
                    p.grad.mul_(0.5)
            elif between == "accumulate":  # a second micro-batch
                model(torch.randn(4, 6, generator=g)).pow(2).sum().backward()
            elif between == "zero_one":
                next(model.parameters()).grad = None
            opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for p, q in zip(*results):
        assert torch.equal(p, q)


def test_copies_and_added_groups_have_their_own_hooks_and_a_dropped_optimizer_none():
    model = _model(torch.float32)
    first, rest = list(model.parameters())[:2], list(model.parameters())[2:]
    opt = dopt.CPUOffload(first, lr=0.01)
    opt.add_param_group({"params": rest})
    _grads_after_backward(model, opt, torch.randn(4, 6))
    assert sorted(opt._copied) == [0, 1, 2, 3]
    opt.step()
    twin = copy.deepcopy(opt)  # its own copies of the parameters, hooked
    twin_params = [p for group in twin.param_groups for p in group["params"]]
    sum((p * p).sum() for p in twin_params).backward()
    assert sorted(twin._copied) == [0, 1, 2, 3]
    twin.step()
    gone = weakref.ref(opt)
    del opt, twin
    gc.collect()
    assert gone() is None  # the hooks hold no reference to their optimizer
    other = dopt.SGD(model.parameters(), lr=0.1)
    _grads_after_backward(model, other, torch.randn(4, 6))  # the dead optimizer's hooks are gone
    other.step()


def test_overlap_must_be_a_bool():
    with pytest.raises(ValueError, match=r"^CPUOffload: overlap must be True or False, got 1$"):
        dopt.CPUOffload(_model(torch.float32).parameters(), overlap=1)


def test_an_optimizer_made_under_no_grad_still_hooks_its_parameters():
    model = _model(torch.float32)
    with torch.no_grad():
        opt = dopt.CPUOffload(model.parameters(), lr=0.01)
    _grads_after_backward(model, opt, torch.randn(4, 6))
    assert len(opt._copied) == 4
