"""PyTorch's own optimizer checks, written again for distopt's drop-ins.

torch 1.13's test/test_optim.py (TestOptim) runs every optimizer through the
same checks; this file runs them, in our own words, on distopt.torch.optim
against the installed torch (docs/python.md, "What torch's own tests
check"):

- each configuration of torch's test (its options, its two-group and
  one-group parameter lists, its schedulers), with and without maximize
  where torch's test passes it, and with foreach False and True:
  * ``state_dict``: 20 steps, a new optimizer on cloned parameters loads a
    deep copy of the state_dict and both go on 20 steps in lockstep; the
    loaded dict is not modified; the two state_dicts are equal; repeated
    groups look alike; a state_dict of an older format (groups without
    ``maximize``, then without ``foreach``) and one whose ``step`` is a
    number load and step; a deep copy has the same public attributes and
    goes on as the original;
  * basic: 200 steps with the schedulers bring the loss down (up when
    maximizing), on contiguous and on non-contiguous parameters;
  * against torch: 20 steps of torch's own class from the same parameters
    and gradients agree;
- complex parameters step as their real pairs, as torch's do;
- the constructor errors torch's test expects, at construction, in its words;
- steps with no gradients, duplicate parameters, a tensor for params;
- copies (deepcopy, pickle, torch.save), zero_grad both ways,
  add_param_group before and after steps, closures, and the torch-only
  flags (foreach, fused, capturable, differentiable) as the installed torch
  takes them or refused in one line;
- the rules torch lacks (Lion, LAMB, LARS, Adafactor, Muon, Shampoo,
  AdagradFull) through the same protocol with two parameter groups.
"""

import copy
import functools
import io
import pickle
import re
import warnings

import pytest
import torch
from torch.optim import lr_scheduler as S

import distopt.torch.optim as dopt

TORCH_1 = torch.__version__.startswith("1.")


def two_groups(weight, bias, **kw):  # torch's _build_params_dict
    return [{"params": [weight]}, dict(params=[bias], **kw)]


def bias_only(weight, bias, **kw):  # torch's _build_params_dict_single
    return [dict(params=bias, **kw)]


def both(weight, bias):
    return [weight, bias]


# (class, how the parameters are passed, options, schedulers, maximize in
# torch's test): the configurations of torch 1.13's test_optim.py.
def _configs():
    step10 = lambda o: S.StepLR(o, gamma=0.9, step_size=10)  # noqa: E731
    plateau = lambda o: S.ReduceLROnPlateau(o)  # noqa: E731
    exp9 = lambda o: S.ExponentialLR(o, gamma=0.9)  # noqa: E731
    linear = lambda o: S.LinearLR(o, start_factor=0.4, total_iters=4)  # noqa: E731
    const = lambda o: S.ConstantLR(o, factor=0.4, total_iters=4)  # noqa: E731
    poly = [lambda o: S.PolynomialLR(o, power=0.9, total_iters=4)] if hasattr(S, "PolynomialLR") else []
    g2 = lambda **kw: functools.partial(two_groups, **kw)  # noqa: E731
    g1 = lambda **kw: functools.partial(bias_only, **kw)  # noqa: E731
    c = []
    for params, kw, scheds in [
        (both, dict(lr=1e-3), []), (g2(lr=1e-2), dict(lr=1e-3), []), (g1(lr=1e-2), dict(lr=1e-3), []),
        (g1(lr=1e-2), dict(), []), (both, dict(lr=1e-3), [step10]),
        (both, dict(lr=1e-3), [lambda o: S.LinearLR(o, start_factor=0.4, end_factor=0.8, total_iters=4)]),
        (both, dict(lr=1e-3), [const]),
        (both, dict(lr=1e-3), [step10, lambda o: S.LinearLR(o, start_factor=0.4, end_factor=0.6, total_iters=4)]),
        (both, dict(lr=1e-3), [step10, plateau]),
        (both, dict(lr=1e-3), [lambda o: S.StepLR(o, gamma=0.99, step_size=10),
                               lambda o: S.ExponentialLR(o, gamma=0.99), plateau]),
        (both, dict(lr=1e-3, momentum=0.5), []), (both, dict(lr=1e-3, momentum=0.5, weight_decay=1), []),
        (both, dict(nesterov=True, lr=1e-3, momentum=0.5, weight_decay=1), []),
    ] + [(both, dict(lr=1e-3), poly)] * bool(poly):
        c.append(("SGD", params, kw, scheds, True))
    for params, kw, scheds in [
        (both, dict(lr=1e-3), []), (g2(lr=1e-2), dict(lr=1e-3), []), (both, dict(lr=1e-3, amsgrad=True), []),
        (both, dict(lr=1e-3, weight_decay=0.1), []), (g2(lr=1e-2), dict(lr=1e-3, amsgrad=True), []),
        (g2(lr=1e-2), dict(lr=1e-3), [exp9]), (g2(lr=1e-2), dict(lr=1e-3), [linear]),
        (g2(lr=1e-2), dict(lr=1e-3), [const]), (both, dict(lr=1e-3, amsgrad=True), [const, exp9]),
        (both, dict(lr=1e-3, amsgrad=True), [exp9, plateau]),
        (g2(lr=1e-2), dict(lr=1e-3, amsgrad=True), [step10, plateau]),
    ] + [(g2(lr=1e-2), dict(lr=1e-3), poly)] * bool(poly):
        c.append(("Adam", params, kw, scheds, True))
    for params, kw in [(both, dict(lr=1e-3)), (g2(lr=1e-2), dict(lr=1e-3)), (both, dict(lr=1e-3, weight_decay=1)),
                       (both, dict(lr=1e-3, weight_decay=1, amsgrad=True))]:
        c.append(("AdamW", params, kw, [], True))
    for params, kw, scheds in [(both, dict(), []), (g2(rho=0.95), dict(), []), (g2(rho=0.95), dict(), [step10, plateau]),
                               (both, dict(weight_decay=1), [])]:
        c.append(("Adadelta", params, kw, scheds, True))
    for params, kw, scheds in [(both, dict(lr=1e-3), []), (g2(lr=1e-2), dict(lr=1e-3), []),
                               (both, dict(lr=1e-3, weight_decay=0.1, momentum_decay=6e-3), []),
                               (both, dict(lr=1e-3, weight_decay=0.1, momentum_decay=6e-3), [exp9])]:
        c.append(("NAdam", params, kw, scheds, False))
    for params, kw, scheds in [(both, dict(lr=1e-1), []), (both, dict(lr=1e-1, initial_accumulator_value=0.1), []),
                               (g2(lr=1e-2), dict(lr=1e-1), []), (g2(lr=1e-2), dict(lr=1e-1), [plateau]),
                               (g2(lr=1e-2), dict(lr=1e-1), [plateau, lambda o: S.ExponentialLR(o, gamma=0.99)])]:
        c.append(("Adagrad", params, kw, scheds, True))
    for params, kw in [(both, dict(lr=1e-1)), (g2(lr=1e-2), dict(lr=1e-1)), (both, dict(lr=1e-1, weight_decay=1))]:
        c.append(("Adamax", params, kw, [], True))
    for params, kw, scheds in [(both, dict(lr=1e-3), []), (g2(lr=1e-2), dict(lr=1e-3), []),
                               (both, dict(lr=1e-3, weight_decay=0.1), []), (both, dict(lr=1e-3), [exp9, plateau])]:
        c.append(("RAdam", params, kw, scheds, False))
    for kw in [dict(lr=1e-2), dict(lr=1e-2, centered=True), dict(lr=1e-2, centered=True, momentum=0.1),
               dict(lr=1e-2, momentum=0.1), dict(lr=1e-2, momentum=0.1, weight_decay=1)]:
        c.append(("RMSprop", g2(lr=1e-3), kw, [], True))
    c.append(("RMSprop", both, dict(lr=1e-2), [], True))
    for params, kw in [(both, dict(lr=1e-3, t0=100)), (g2(lr=1e-2), dict(lr=1e-3, t0=100)),
                       (g2(lr=1e-2), dict(lr=1e-3, weight_decay=1))]:
        c.append(("ASGD", params, kw, [], True))
    for params, kw in [(both, dict(lr=2e-4)), (g2(lr=1e-2), dict(lr=2e-4))]:
        c.append(("Rprop", params, kw, [], True))
    return c


def weight_only(weight, bias):  # Muon: matrices only
    return [weight]


# The rules torch lacks, through the same protocol (no maximize or foreach:
# their references have none).
def _extra_configs():
    g2 = lambda **kw: functools.partial(two_groups, **kw)  # noqa: E731
    step10 = lambda o: S.StepLR(o, gamma=0.9, step_size=10)  # noqa: E731
    return [("Lion", both, dict(lr=1e-3), [], False), ("Lion", g2(lr=1e-2), dict(lr=1e-3, weight_decay=0.1), [], False),
            ("Lion", both, dict(lr=1e-3), [step10], False),
            ("LAMB", both, dict(lr=1e-2), [], False), ("LAMB", g2(weight_decay=0.0), dict(lr=1e-2), [], False),
            ("LAMB", both, dict(lr=1e-2, adam_w_mode=False), [step10], False),
            ("LARS", both, dict(lr=0.1, momentum=0.9, weight_decay=1e-4), [], False),
            ("LARS", g2(weight_decay=0.0), dict(lr=0.1, momentum=0.9, weight_decay=1e-4, nesterov=True), [], False),
            ("Adafactor", both, dict(), [], False),
            ("Adafactor", g2(weight_decay=0.0), dict(lr=1e-2, relative_step=False, beta1=0.9), [], False),
            ("Muon", weight_only, dict(lr=1e-2), [], False), ("Muon", weight_only, dict(lr=1e-2), [step10], False),
            ("Shampoo", both, dict(lr=1e-2), [], False), ("Shampoo", g2(lr=1e-3), dict(lr=1e-2, momentum=0.5), [], False),
            ("AdagradFull", both, dict(lr=1e-1), [], False),
            ("AdagradFull", g2(lr=1e-2), dict(lr=1e-1, block_size=5), [], False)]


CONFIGS = _configs()
EXTRA_CONFIGS = _extra_configs()


def _id(c):
    name, params, kw, scheds, _ = c
    groups = getattr(params, "func", params).__name__
    extra = getattr(params, "keywords", {})
    return f"{name}-{groups}{extra or ''}-{kw}-{len(scheds)}sched".replace(" ", "")


def _cases(configs=CONFIGS):
    out = []
    for c in configs:
        for maximize in (False, True) if c[4] else (False,):
            for foreach in (False, True) if c[0] in dopt.__all__[:11] else (False,):
                out.append(pytest.param(c, maximize, foreach, id=f"{_id(c)}-max{int(maximize)}-fe{int(foreach)}"))
    return out


def _make(lib, config, weight, bias, maximize, foreach):
    name, params, kw, _, accepts_maximize = config
    if name in dopt.__all__[:11]:
        kw = dict(kw, foreach=foreach)
    if accepts_maximize:
        kw["maximize"] = maximize
    return getattr(lib, name)(params(weight, bias), **kw)


def _data(seed=0, noncontiguous=False):
    g = torch.Generator().manual_seed(seed)
    if noncontiguous:
        weight = torch.randn(10, 5, 2, generator=g)[..., 0]
        bias = torch.randn(10, 2, generator=g)[..., 0]
    else:
        weight, bias = torch.randn(10, 5, generator=g), torch.randn(10, generator=g)
    return weight, bias, torch.randn(5, generator=g)


def _loss(optimizer, weight, bias, x):
    optimizer.zero_grad()
    loss = (weight.mv(x) + bias.reshape(-1)).pow(2).sum()
    loss.backward()
    return loss


def _equal(a, b):
    """torch.testing's assertEqual on nested state_dicts: same structure,
    tensors and numbers equal."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (a.keys(), getattr(b, "keys", lambda: b)())
        for k in a:
            _equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _equal(x, y)
    elif torch.is_tensor(a) or torch.is_tensor(b):
        torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), rtol=0, atol=0, check_dtype=False)
    else:
        assert a == b, (a, b)


@pytest.mark.parametrize("config,maximize,foreach", _cases() + _cases(EXTRA_CONFIGS))
def test_state_dict_protocol(config, maximize, foreach):
    w0, b0, x = _data()
    weight, bias = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    opt = _make(dopt, config, weight, bias, maximize, foreach)
    fn = functools.partial(_loss, opt, weight, bias, x)
    for _ in range(20):
        opt.step(fn)
    weight_c, bias_c = weight.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    opt_c = _make(dopt, config, weight_c, bias_c, maximize, foreach)
    fn_c = functools.partial(_loss, opt_c, weight_c, bias_c, x)
    state_dict = copy.deepcopy(opt.state_dict())
    state_dict_c = copy.deepcopy(opt.state_dict())
    opt_c.load_state_dict(state_dict_c)
    for _ in range(20):
        opt.step(fn)
        opt_c.step(fn_c)
        assert torch.equal(weight, weight_c) and torch.equal(bias, bias_c)
    _equal(state_dict, state_dict_c)  # loading did not modify the dict
    _equal(opt.state_dict(), opt_c.state_dict())
    twin = copy.deepcopy(opt)  # a copy goes on as the original
    assert {k for k in vars(opt) if not k.startswith("_")} == {k for k in vars(twin) if not k.startswith("_")}
    opt_c.param_groups.extend(opt_c.param_groups)
    _equal(opt.state_dict()["param_groups"][-1], opt_c.state_dict()["param_groups"][-1])

    for key in ("maximize", "foreach"):  # older formats
        sd = opt.state_dict()
        if key in sd["param_groups"][0]:
            for group in sd["param_groups"]:
                del group[key]
            opt.load_state_dict(sd)
            opt.step()
    sd = opt.state_dict()
    if "step" in sd["state"][0] and torch.is_tensor(sd["state"][0]["step"]):
        for entries in sd["state"].values():
            entries["step"] = entries["step"].item()
        opt.load_state_dict(sd)
        opt.step()


@pytest.mark.parametrize("config,maximize,foreach", [c for c in _cases() + _cases(EXTRA_CONFIGS) if not c.values[2]])
@pytest.mark.parametrize("noncontiguous", [False, True])
def test_basic_cases(config, maximize, foreach, noncontiguous):
    w0, b0, x = _data(noncontiguous=noncontiguous)
    weight, bias = w0.requires_grad_(), b0.requires_grad_()
    opt = _make(dopt, config, weight, bias, maximize, foreach)
    schedulers = [make(opt) for make in config[3]]
    repr(opt)
    fn = functools.partial(_loss, opt, weight, bias, x)
    initial = fn().item()
    for _ in range(200):
        for s in schedulers:
            s.step(fn()) if isinstance(s, S.ReduceLROnPlateau) else s.step()
        opt.step(fn)
    assert (fn().item() > initial) if maximize else (fn().item() < initial)


def _chaotic(config):
    """RMSprop with momentum amplifies last-bit differences (torch's own
    vector and scalar loops differ there: test_optim.py's
    test_centered_rmsprop_with_momentum_steps_as_torch_from_torchs_state):
    checked one step at a time from torch's state instead."""
    return config[0] == "RMSprop" and config[2].get("momentum", 0) > 0


@pytest.mark.parametrize("config,maximize,foreach", [c for c in _cases() if _chaotic(c.values[0])])
def test_each_step_from_torchs_state_agrees_with_torch(config, maximize, foreach):
    w0, b0, x = _data(seed=1)
    weight, bias = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    ref = _make(torch.optim, config, weight, bias, maximize, foreach)
    for _ in range(20):
        _loss(ref, weight, bias, x)
        w2, b2 = weight.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
        w2.grad, b2.grad = weight.grad.clone(), bias.grad.clone()
        ours = _make(dopt, config, w2, b2, maximize, foreach)
        if ref.state_dict()["state"]:
            ours.load_state_dict(copy.deepcopy(ref.state_dict()))
        ref.step()
        ours.step()
        torch.testing.assert_close(w2, weight, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b2, bias, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("config,maximize,foreach", [c for c in _cases() if not _chaotic(c.values[0])])
def test_twenty_steps_agree_with_torch(config, maximize, foreach):
    """Within 1e-5 of torch's single-tensor path, whatever ``foreach`` says
    (distopt has one path, torch's single-tensor math; torch's own two
    paths differ by up to 5e-5 in its test_multi_tensor_optimizers)."""
    w0, b0, x = _data(seed=1)
    tol = dict(rtol=1e-5, atol=1e-6)
    runs = []
    for lib in (dopt, torch.optim):
        weight, bias = w0.clone().requires_grad_(), b0.clone().requires_grad_()
        opt = _make(lib, config, weight, bias, maximize, foreach if lib is dopt else False)
        schedulers = [make(opt) for make in config[3]]
        fn = functools.partial(_loss, opt, weight, bias, x)
        for _ in range(20):
            for s in schedulers:
                s.step(fn()) if isinstance(s, S.ReduceLROnPlateau) else s.step()
            opt.step(fn)
        runs.append((weight.detach(), bias.detach(), opt.state_dict()))
    (w, b, sd), (tw, tb, tsd) = runs
    torch.testing.assert_close(w, tw, **tol)
    torch.testing.assert_close(b, tb, **tol)
    for i, entries in tsd["state"].items():
        ours = sd["state"].get(i, {})
        assert set(ours) == set(entries), (ours.keys(), entries.keys())
        for k, v in entries.items():
            if v is None:  # SGD's momentum_buffer without momentum
                assert ours[k] is None
                continue
            assert torch.is_tensor(sd["state"][i][k]) == torch.is_tensor(v), f"'{k}': torch keeps {type(v)}"
            torch.testing.assert_close(torch.as_tensor(sd["state"][i][k]).float(), torch.as_tensor(v).float(), **tol)


# ---- complex parameters (torch's _test_complex_optimizer, _test_complex_2d) ----
COMPLEX = [("SGD", dict(lr=0.001)), ("SGD", dict(lr=0.001, momentum=1)),
           ("SGD", dict(lr=0.001, momentum=1, weight_decay=1)),
           ("SGD", dict(lr=0.001, nesterov=True, momentum=1, weight_decay=1)),
           ("SGD", dict(lr=0.001, momentum=1, dampening=0.5, weight_decay=1)),
           ("Adadelta", dict()), ("Adadelta", dict(rho=0.95)), ("Adadelta", dict(rho=0.95, weight_decay=1)),
           ("Adagrad", dict(lr=1e-1)), ("Adagrad", dict(lr=1e-1, initial_accumulator_value=0.1)),
           ("RMSprop", dict()), ("RMSprop", dict(centered=True)), ("RMSprop", dict(momentum=0.1)),
           ("RMSprop", dict(maximize=True)), ("ASGD", dict()), ("ASGD", dict(maximize=True)),
           ("ASGD", dict(maximize=True, weight_decay=0.9)), ("ASGD", dict(weight_decay=0.9)),
           ("Rprop", dict(lr=0.001)), ("Rprop", dict(lr=0.001, maximize=True))]


@pytest.mark.parametrize("name,kw", COMPLEX, ids=[f"{n}-{k}".replace(" ", "") for n, k in COMPLEX])
def test_complex_parameters_step_as_their_real_pairs(name, kw):
    g = torch.Generator().manual_seed(0)
    z = torch.randn(5, 5, dtype=torch.complex64, generator=g).requires_grad_()
    r = torch.view_as_real(z).detach().clone().requires_grad_()
    oz, orr = getattr(dopt, name)([z], **kw), getattr(dopt, name)([r], **kw)
    for _ in range(3):
        z.grad = torch.randn(5, 5, dtype=torch.complex64, generator=g)
        r.grad = torch.view_as_real(z.grad).clone()
        oz.step()
        orr.step()
        assert torch.equal(torch.view_as_real(z), r)
    assert all(v.is_complex() for k, v in oz.state[z].items() if k != "step" and torch.is_tensor(v) and v.dim() > 0)


@pytest.mark.parametrize("name", ["Adam", "AdamW", "Adamax", "RMSprop", "Rprop"])
def test_a_complex_parameter_steps_as_its_real_and_imaginary_parts(name):
    def rosenbrock(t):
        x, y = t
        return (1 - x) ** 2 + 100 * (y - x ** 2) ** 2

    a1 = torch.randn(2, dtype=torch.complex64, generator=torch.Generator().manual_seed(3)).requires_grad_()
    re, im = a1.real.clone().detach().requires_grad_(), a1.imag.clone().detach().requires_grad_()
    o1, o2 = getattr(dopt, name)([a1]), getattr(dopt, name)([re, im])
    for _ in range(10):
        o1.zero_grad()
        o2.zero_grad()
        rosenbrock(a1).real.backward()
        rosenbrock(torch.complex(re, im)).real.backward()
        torch.testing.assert_close(a1.grad.real, re.grad)
        torch.testing.assert_close(a1.grad.imag, im.grad)
        o1.step()
        o2.step()
        torch.testing.assert_close(a1.real, re)
        torch.testing.assert_close(a1.imag, im)


# ---- constructor errors (torch's assertRaisesRegex cases) ----
ERRORS = [("SGD", dict(lr=1e-2, momentum=-0.5), "Invalid momentum value: -0.5"),
          ("Adam", dict(lr=1e-2, betas=(1.0, 0.0)), "Invalid beta parameter at index 0: 1.0"),
          ("Adam", dict(lr=1e-2, weight_decay=-1), "Invalid weight_decay value: -1"),
          ("AdamW", dict(lr=1e-2, weight_decay=-1), "Invalid weight_decay value: -1"),
          ("Adadelta", dict(lr=1e-2, rho=1.1), "Invalid rho value: 1.1"),
          ("NAdam", dict(lr=1e-2, betas=(1.0, 0.0)), "Invalid beta parameter at index 0: 1.0"),
          ("NAdam", dict(lr=1e-2, momentum_decay=-0.2), "Invalid momentum_decay value: -0.2"),
          ("Adagrad", dict(lr=1e-2, lr_decay=-0.5), "Invalid lr_decay value: -0.5"),
          ("Adamax", dict(lr=1e-2, betas=(0.0, 1.0)), "Invalid beta parameter at index 1: 1.0"),
          ("RAdam", dict(lr=1e-2, betas=(1.0, 0.0)), "Invalid beta parameter at index 0: 1.0"),
          ("RAdam", dict(lr=1e-2, weight_decay=-1), "Invalid weight_decay value: -1"),
          ("RMSprop", dict(lr=1e-2, momentum=-1.0), "Invalid momentum value: -1.0"),
          ("ASGD", dict(lr=1e-2, weight_decay=-0.5), "Invalid weight_decay value: -0.5"),
          ("Rprop", dict(lr=1e-2, etas=(1.0, 0.5)), "Invalid eta values: 1.0, 0.5")]
ERRORS += [(n, dict(lr=-1.0), "Invalid learning rate: -1.0") for n in dopt.__all__[:11]]
ERRORS += [(n, dict(lr=-1), "Invalid learning rate: -1$") for n in ("SGD", "Adam")]


@pytest.mark.parametrize("name,kw,message", ERRORS, ids=[f"{n}-{k}".replace(" ", "") for n, k, _ in ERRORS])
def test_constructor_errors_are_torchs_at_construction(name, kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as ours:
        getattr(dopt, name)(None, **kw)
    with pytest.raises(ValueError) as theirs:
        getattr(torch.optim, name)(None, **kw)
    assert str(ours.value) == str(theirs.value)


def test_a_tensor_for_params_duplicates_and_no_gradients_are_as_torchs():
    with pytest.raises(TypeError):
        dopt.SGD(torch.randn(5, 5), lr=3)
    param = torch.randn(5, 5)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        dopt.SGD([param, param], lr=0.1)
    assert len(w) == 1 and "a parameter group with duplicate parameters" in str(w[0].message)
    params = [torch.randn(5, 5, requires_grad=False) for _ in range(2)]
    for name in ("Adadelta", "AdamW", "Adam", "Adagrad", "Adamax", "RMSprop", "SGD", "ASGD"):
        getattr(dopt, name)(params, lr=0.1).step()  # no parameter has a gradient


# ---- the torch-only flags ----
def test_torch_only_flags_are_taken_as_the_installed_torch_takes_them():
    p = torch.nn.Parameter(torch.randn(3))
    for name in dopt.__all__[:11]:
        dopt_cls, torch_cls = getattr(dopt, name), getattr(torch.optim, name)
        dopt_cls([p], lr=0.01, foreach=True)  # torch acts (its multi-tensor path); distopt has one path
        for flag in ("fused", "capturable", "differentiable"):
            try:
                torch_cls([p], lr=0.01, **{flag: True})
                torch_error = None
            except Exception as e:  # noqa: BLE001 - whatever torch raises, distopt raises too
                torch_error = e
            if torch_error is not None:
                with pytest.raises(type(torch_error), match=re.escape(str(torch_error)[:30])):
                    dopt_cls([p], lr=0.01, **{flag: True})
            elif flag != "fused":  # accepted by torch: refused by distopt in one line, at construction
                with pytest.raises(ValueError, match=f"{name}: {flag}=True"):
                    dopt_cls([p], lr=0.01, **{flag: True})


# ---- copies ----
def _trained(name="AdamW", steps=3, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    opt = getattr(dopt, name)(model.parameters(), **kw)
    x = torch.randn(8, 4)
    for _ in range(steps):
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()
    return model, opt, x


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_a_copied_optimizer_steps_on_as_the_original(how):
    model, opt, x = _trained()
    if how == "deepcopy":
        model2, opt2 = copy.deepcopy((model, opt))
    elif how == "pickle":
        model2, opt2 = pickle.loads(pickle.dumps((model, opt)))
    else:
        buf = io.BytesIO()
        torch.save((model, opt), buf)
        buf.seek(0)
        model2, opt2 = torch.load(buf)
    for m, o in ((model, opt), (model2, opt2)):
        for _ in range(3):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    _equal(opt.state_dict(), opt2.state_dict())


TORCH_NAMED = [("SGD", dict(lr=0.1, momentum=0.9)), ("Adam", dict(lr=0.1)), ("AdamW", dict(lr=0.1)),
               ("Adamax", dict(lr=0.1)), ("Adadelta", dict()), ("Adagrad", dict(lr=0.1)), ("RMSprop", dict(lr=0.01)),
               ("NAdam", dict(lr=0.1)), ("RAdam", dict(lr=0.1)), ("Rprop", dict()), ("ASGD", dict(lr=0.1))]


@pytest.mark.parametrize("name,kw", TORCH_NAMED, ids=[n for n, _ in TORCH_NAMED])
def test_a_loaded_dict_without_a_parameters_entry_starts_it_afresh(name, kw):
    """torch's load_state_dict drops the state of a parameter the dict has no
    entry for, so its next step starts from step 0: a loaded optimizer that
    had stepped that parameter must forget its moments, as torch's does."""
    torch.manual_seed(0)
    a, b = torch.randn(6), torch.randn(4)
    grads = [(torch.randn(6), torch.randn(4)) for _ in range(6)]
    runs = []
    for module in (torch.optim, dopt):
        pa, pb = a.clone().requires_grad_(), b.clone().requires_grad_()
        opt = getattr(module, name)([pa, pb], **kw)
        donor = getattr(torch.optim, name)([pa.detach().clone().requires_grad_(),
                                            pb.detach().clone().requires_grad_()], **kw)
        donor.param_groups[0]["params"][0].grad = grads[0][0].clone()
        donor.step()  # only its first parameter has state
        for k, (ga, gb) in enumerate(grads):
            if k == 3:
                opt.load_state_dict(copy.deepcopy(donor.state_dict()))
                assert bool(opt.state.get(pb)) == (name == "Adagrad")  # torch's Adagrad: state from the start
            pa.grad, pb.grad = ga.clone(), gb.clone()
            opt.step()
        runs.append((pa.detach(), pb.detach(), opt.state_dict()))
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(runs[1][1], runs[0][1], rtol=1e-6, atol=1e-7)
    for key, value in runs[0][2]["state"][1].items():
        torch.testing.assert_close(torch.as_tensor(runs[1][2]["state"][1][key]).float(),
                                   torch.as_tensor(value).float(), rtol=1e-6, atol=1e-7)


def test_grad_scalers_protocol_unscales_in_place_and_skips_a_step_with_an_inf():
    """torch 2.x's GradScaler sets ``found_inf`` and ``grad_scale`` on an
    optimizer whose ``_step_supports_amp_scaling`` is True and calls
    ``step()``; simulated here on CPU parameters (torch 1.13's GradScaler
    runs on CUDA only: test_cuda.py drives the real one)."""
    assert dopt.AdamW._step_supports_amp_scaling and not dopt.CPUOffload._step_supports_amp_scaling
    torch.manual_seed(0)
    p = torch.randn(5, requires_grad=True)
    q = p.detach().clone().requires_grad_()
    ours, ref = dopt.AdamW([p], lr=0.1), dopt.AdamW([q], lr=0.1)
    for k in range(4):
        g = torch.randn(5)
        p.grad, q.grad = g * 1024, g.clone()
        ours.grad_scale, ours.found_inf = torch.tensor(1024.0), torch.tensor(float(k == 2))
        ours.step()
        del ours.grad_scale, ours.found_inf
        if k != 2:
            ref.step()
        assert torch.equal(p.grad, q.grad)  # unscaled in place, as torch's unscale_ does
    assert torch.equal(p, q) and float(ours.state[p]["step"]) == float(ref.state[q]["step"]) == 3
    with pytest.raises(TypeError, match="unexpected keyword argument 'foo'"):
        ours.step(foo=1)


def test_zero_grad_both_ways_closures_and_groups_added_before_and_after_steps():
    torch.manual_seed(0)
    a, b, c = (torch.nn.Parameter(torch.randn(4)) for _ in range(3))
    ours, theirs = dopt.Adam([a], lr=0.1), None
    ta, tb, tc = (p.detach().clone().requires_grad_() for p in (a, b, c))
    theirs = torch.optim.Adam([ta], lr=0.1)
    ours.add_param_group({"params": [b], "lr": 0.01})  # before any step
    theirs.add_param_group({"params": [tb], "lr": 0.01})
    for k in range(6):
        if k == 3:  # after steps
            ours.add_param_group({"params": [c], "weight_decay": 0.1})
            theirs.add_param_group({"params": [tc], "weight_decay": 0.1})
        for o, ps in ((ours, (a, b, c)), (theirs, (ta, tb, tc))):
            o.zero_grad(set_to_none=bool(k % 2))

            def closure(ps=ps):
                loss = sum((p * p).sum() * (i + 1) for i, p in enumerate(ps))
                loss.backward()
                return loss

            assert o.step(closure) is not None
    for p, q in zip((a, b, c), (ta, tb, tc)):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert all(p.grad is None for p in (a, b, c)) or all(p.grad is not None for p in (a, b, c))


# ---- the rules torch lacks: the same protocol, two parameter groups ----
EXTRA = [("Lion", dict(lr=1e-3), dict(weight_decay=0.0)), ("LAMB", dict(lr=1e-2), dict(weight_decay=0.0)),
         ("LARS", dict(lr=0.1, momentum=0.9, weight_decay=1e-4), dict(weight_decay=0.0)),
         ("Adafactor", dict(), dict(weight_decay=0.0)),
         ("Adafactor", dict(lr=1e-2, relative_step=False, beta1=0.9), dict(weight_decay=0.0)),
         ("Muon", dict(lr=1e-2), dict(momentum=0.9)), ("Shampoo", dict(lr=1e-2, momentum=0.5), dict(lr=1e-3)),
         ("AdagradFull", dict(lr=1e-2), dict(lr=1e-3))]


@pytest.mark.parametrize("name,kw,group", EXTRA, ids=[f"{n}-{k}".replace(" ", "") for n, k, _ in EXTRA])
def test_rules_torch_lacks_keep_the_protocol(name, kw, group):
    def make(weight, bias):
        return getattr(dopt, name)([{"params": [weight]}, dict(params=[bias], **group)], **kw)

    w0, b0, x = _data()
    if name == "Muon":  # matrices only: the bias as a column
        b0 = b0.reshape(10, 1)
    weight, bias = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    opt = make(weight, bias)
    assert opt.param_groups[1].keys() == opt.param_groups[0].keys()
    fn = functools.partial(_loss, opt, weight, bias, x)
    initial = fn().item()
    for _ in range(20):
        opt.step(fn)
    assert fn().item() < initial
    weight_c, bias_c = weight.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    opt_c = make(weight_c, bias_c)
    saved = copy.deepcopy(opt.state_dict())
    opt_c.load_state_dict(copy.deepcopy(saved))
    for _ in range(5):
        opt.step(fn)
        opt_c.step(functools.partial(_loss, opt_c, weight_c, bias_c, x))
        assert torch.equal(weight, weight_c) and torch.equal(bias, bias_c)
    _equal(opt.state_dict(), opt_c.state_dict())
    with pytest.raises(ValueError):
        getattr(dopt, name)(None, lr=-1.0)
