"""distopt.torch.optim against torch.optim and against distopt's C++
optimizer: numbers, torch's protocols, state_dict interchange, bad input."""

import copy
import json
import subprocess

import pytest
import torch

from conftest import batches, loss_of, mlp
from distopt.torch import optim as dopt

# The rules torch 1.13 has, with options that exercise their branches.
TORCH_CASES = [
    ("SGD", dict(lr=0.05)),
    ("SGD", dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-2, nesterov=False)),
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True, maximize=True)),
    ("Adam", dict()),
    ("Adam", dict(lr=1e-2, amsgrad=True, weight_decay=0.1)),
    ("AdamW", dict(lr=1e-2)),
    ("AdamW", dict(lr=1e-2, amsgrad=True, maximize=True)),
    ("Adamax", dict(weight_decay=1e-2)),
    ("Adadelta", dict(weight_decay=1e-2)),
    ("Adagrad", dict(lr_decay=1e-2, initial_accumulator_value=0.1)),
    ("RMSprop", dict()),
    ("RMSprop", dict(centered=True, weight_decay=1e-2)),
    ("NAdam", dict(weight_decay=1e-2)),
    ("RAdam", dict(weight_decay=1e-2)),
    ("Rprop", dict()),
    ("ASGD", dict(t0=10, weight_decay=1e-2)),
]
ALL_RULES = [
    ("Lion", dict(lr=1e-3, weight_decay=0.1)),
    ("LAMB", dict(lr=1e-2)),
    ("LARS", dict(lr=0.1, momentum=0.9, weight_decay=1e-4)),
    ("Adafactor", dict()),
    ("Shampoo", dict(lr=0.05, momentum=0.5)),
] + TORCH_CASES
# The golden tolerance of `distopt replay --check` (docs/optimizers.md).
ATOL, RTOL = 1e-6, 1e-5


def train(make_opt, steps=50, model=None):
    model = model or mlp()
    opt = make_opt(model.parameters())
    for x, y in batches(steps):
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
    return model, opt


def case_id(case):
    return case[0] + "-" + "-".join(f"{k}={v}" for k, v in case[1].items())


@pytest.mark.parametrize("case", TORCH_CASES, ids=case_id)
def test_fifty_steps_match_torch(case):
    name, kw = case
    ours, _ = train(lambda p: getattr(dopt, name)(p, **kw))
    theirs, _ = train(lambda p: getattr(torch.optim, name)(p, **kw))
    for (n, a), b in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name} {n}: {m}")


def test_centered_rmsprop_with_momentum_steps_as_torch_from_torchs_state():
    """Centered RMSprop with momentum amplifies last-bit differences
    chaotically (sqrt(v - g_avg^2) near 0): torch's own vectorized
    `param.add_(buf, alpha=-lr)` fuses the multiply-add where its scalar tail
    does not, so two runs 50 steps apart cannot agree to 1e-6. The math is
    checked step by step instead: at each of 50 steps along torch's
    trajectory, distopt's step from torch's state (loaded through
    load_state_dict) equals torch's within the golden tolerance."""
    kw = dict(lr=1e-2, centered=True, momentum=0.9, weight_decay=1e-2)
    model = mlp()
    ref = torch.optim.RMSprop(model.parameters(), **kw)
    for x, y in batches(50):
        ref.zero_grad()
        loss_of(model, x, y).backward()
        twin = copy.deepcopy(model)
        for a, b in zip(twin.parameters(), model.parameters()):
            a.grad = b.grad.clone()
        ours = dopt.RMSprop(twin.parameters(), **kw)
        sd = ref.state_dict()
        if sd["state"]:
            ours.load_state_dict(copy.deepcopy(sd))
        ref.step()
        ours.step()
        for a, b in zip(twin.parameters(), model.parameters()):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)
        for p, q in zip(twin.parameters(), model.parameters()):
            for key in ("square_avg", "grad_avg", "momentum_buffer"):
                torch.testing.assert_close(ours.state[p][key], ref.state[q][key], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("case", ALL_RULES, ids=case_id)
def test_bitwise_equal_to_the_cpp_optimizer(case, tmp_path, distopt_bin):
    """The same gradients through `distopt replay` (the C++ Optimizer over
    its own buffers) give the drop-in's parameters bit for bit."""
    name, kw = case
    model = mlp()
    opt = getattr(dopt, name)(model.parameters(), **kw)
    params = [p.detach().clone() for p in model.parameters()]
    steps = []
    for x, y in batches(12):
        opt.zero_grad()
        loss_of(model, x, y).backward()
        steps.append({"grads": [p.grad.flatten().tolist() for p in model.parameters()]})
        opt.step()
    options = {k: (list(v) if isinstance(v, tuple) else v) for k, v in opt.defaults.items()
               if k in opt._known and v is not None}
    case_json = {"format": "distopt-replay/1", "optimizer": {"name": opt._rule, "options": options},
                 "param_groups": [{"params": list(range(len(params)))}],
                 "params": [{"shape": list(p.shape), "data": p.flatten().tolist()} for p in params],
                 "steps": steps}
    path = tmp_path / "case.json"
    path.write_text(json.dumps(case_json))
    out = subprocess.run([distopt_bin, "replay", str(path), "--json"], capture_output=True, text=True, check=True)
    replayed = json.loads(out.stdout.strip().splitlines()[-1])["params"]
    for (n, p), r in zip(model.named_parameters(), replayed):
        assert torch.equal(p.detach().flatten(), torch.tensor(r, dtype=torch.float32)), f"{name} {n}"


def test_state_is_torch_tensors_updated_in_place():
    model = mlp()
    opt = dopt.AdamW(model.parameters(), lr=1e-2)
    x, y = batches(1)[0]
    loss_of(model, x, y).backward()
    opt.step()
    p = next(model.parameters())
    st = opt.state[p]
    assert set(st) == {"step", "exp_avg", "exp_avg_sq"}
    assert st["step"].dim() == 0 and st["step"].dtype == torch.float32 and st["step"].item() == 1.0
    before = st["exp_avg"].clone()
    ptr = st["exp_avg"].data_ptr()
    opt.step()
    assert opt.state[p]["exp_avg"].data_ptr() == ptr  # the same memory, updated by the C++ rule
    assert not torch.equal(opt.state[p]["exp_avg"], before)
    assert opt.state[p]["step"].item() == 2.0


@pytest.mark.parametrize("name", ["AdamW", "Adam", "SGD", "RMSprop", "Adagrad"])
def test_state_dict_interchanges_with_torch(name):
    kw = {"SGD": dict(lr=1e-2, momentum=0.9), "RMSprop": dict(lr=1e-2, centered=True)}.get(name, dict(lr=1e-2))
    data = batches(20)

    def run(first, second, switch=10):
        model = mlp()
        opt = first(model.parameters())
        for i, (x, y) in enumerate(data):
            if i == switch:
                sd = copy.deepcopy(opt.state_dict())
                opt = second(model.parameters())
                opt.load_state_dict(sd)
            opt.zero_grad()
            loss_of(model, x, y).backward()
            opt.step()
        return model

    torch_cls, our_cls = getattr(torch.optim, name), getattr(dopt, name)
    reference = run(lambda p: torch_cls(p, **kw), lambda p: torch_cls(p, **kw))
    for first, second in [(our_cls, torch_cls), (torch_cls, our_cls)]:
        model = run(lambda p: first(p, **kw), lambda p: second(p, **kw))
        for a, b in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", ["LAMB", "AdamW"])
def test_state_dict_round_trip_goes_on_bitwise(name):
    """A drop-in's state_dict loaded into a new drop-in goes on with the
    same bits (LAMB counts its steps per group: the count follows the
    loaded "step")."""
    data = batches(8, seed=2)
    cls = getattr(dopt, name)
    straight = mlp(seed=3)
    opt = cls(straight.parameters(), lr=1e-2)
    resumed = mlp(seed=3)
    first = cls(resumed.parameters(), lr=1e-2)
    for i, (x, y) in enumerate(data):
        if i == 3:
            second = cls(resumed.parameters(), lr=1e-2)
            second.load_state_dict(copy.deepcopy(first.state_dict()))
            first = second
        for model, o in ((straight, opt), (resumed, first)):
            o.zero_grad()
            loss_of(model, x, y).backward()
            o.step()
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


SCHEDULERS = [
    ("StepLR", lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5)),
    ("OneCycleLR", lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=30)),
    ("CosineAnnealingWarmRestarts", lambda o: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=7)),
    ("LambdaLR", lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (1 + e))),
]


@pytest.mark.parametrize("sched", SCHEDULERS, ids=[s[0] for s in SCHEDULERS])
@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_schedulers_drive_it_as_they_drive_torch(sched, name):
    kw = dict(lr=0.01, momentum=0.9) if name == "SGD" else dict(lr=0.01)

    def run(cls):
        model = mlp()
        opt = cls(model.parameters(), **kw)
        s = sched[1](opt)
        lrs, moms = [], []
        for x, y in batches(30):
            opt.zero_grad()
            loss_of(model, x, y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            s.step()
            lrs.append(opt.param_groups[0]["lr"])
            moms.append(opt.param_groups[0].get("betas", opt.param_groups[0].get("momentum")))
        return model, lrs, moms

    ours, lr_a, mom_a = run(getattr(dopt, name))
    theirs, lr_b, mom_b = run(getattr(torch.optim, name))
    assert lr_a == lr_b and mom_a == mom_b  # momentum cycling included (OneCycleLR)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


def test_plateau_zero_grad_closure_and_added_groups():
    def run(cls):
        model = mlp()
        layers = list(model.children())
        opt = cls(layers[0].parameters(), lr=0.05, momentum=0.9)
        sched = None
        for i, (x, y) in enumerate(batches(16)):
            if i == 4:
                opt.add_param_group({"params": list(layers[2].parameters()) + list(layers[4].parameters()),
                                     "lr": 0.02, "nesterov": True})
            opt.zero_grad(set_to_none=(i % 2 == 0))

            def closure():
                opt.zero_grad()
                loss = loss_of(model, x, y)
                loss.backward()
                return loss

            loss = opt.step(closure)
            if i == 5:  # (torch's schedulers take the groups there are when they are made)
                sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=1, factor=0.5)
            if sched is not None:
                sched.step(1.0)  # a flat metric: the lrs halve on a plateau
        return model, [g["lr"] for g in opt.param_groups], loss

    (ours, lr_a, loss_a), (theirs, lr_b, loss_b) = run(dopt.SGD), run(torch.optim.SGD)
    assert lr_a == lr_b
    assert loss_a.item() == pytest.approx(loss_b.item(), rel=1e-5)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


def test_signatures_and_defaults_are_torchs():
    import inspect

    from torch.optim.optimizer import required
    for name, _ in TORCH_CASES:
        ours = inspect.signature(getattr(dopt, name).__init__).parameters
        theirs = inspect.signature(getattr(torch.optim, name).__init__).parameters
        for arg, p in theirs.items():
            assert arg in ours, f"{name} lacks torch's argument {arg}"
            # torch 1.13's SGD has no default lr (torch 2.x's: 1e-3, which distopt's has).
            if p.default not in (inspect.Parameter.empty, required) and arg not in ("foreach", "fused"):
                assert ours[arg].default == p.default, f"{name}({arg}) defaults to {ours[arg].default}, torch {p.default}"
        assert issubclass(getattr(dopt, name), torch.optim.Optimizer)


def test_bad_parameters_are_one_line_errors():
    w = torch.nn.Parameter(torch.zeros(3, 4, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"AdamW: parameter 0 \(shape \(3, 4\)\) is torch.float64"):
        dopt.AdamW([w])
    z = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex128))
    with pytest.raises(TypeError, match="is complex"):
        dopt.Adam([torch.nn.Parameter(torch.zeros(2)), z])
    with pytest.raises(TypeError, match="lamb is not pointwise"):  # complex64 steps as real pairs where pointwise
        dopt.LAMB([torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))])
    with pytest.raises(ValueError, match="Invalid learning rate: -1.0"):
        dopt.Adam([torch.nn.Parameter(torch.zeros(2))], lr=-1.0)
    e = torch.nn.Embedding(10, 4, sparse=True)
    opt = dopt.Adam(e.parameters())
    e(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="does not support sparse gradients"):
        opt.step()


def test_a_parameter_changed_under_the_optimizer_is_refused():
    model = torch.nn.Linear(3, 2)
    opt = dopt.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    model.double()  # the parameters' storage is now float64
    model(torch.randn(4, 3, dtype=torch.float64)).sum().backward()
    with pytest.raises(ValueError, match="changed dtype, size or device since the optimizer took it"):
        opt.step()


def test_bf16_parameters_keep_fp32_master_weights():
    model = mlp(dtype=torch.bfloat16)
    opt = dopt.AdamW(model.parameters(), lr=1e-2)
    x, y = batches(1)[0]
    loss_of(model, x.bfloat16(), y).backward()
    opt.step()
    p = next(model.parameters())
    master = opt.state[p]["master_param"]
    assert master.dtype == torch.float32
    assert torch.equal(master.bfloat16(), p.detach())


def test_a_loaded_bf16_state_keeps_its_fp32_values():
    """torch's load_state_dict casts saved state to the parameter's dtype;
    the fp32 master weights and moments of a bf16 parameter are copied in
    as saved, not rounded to bf16."""
    p = torch.nn.Parameter(torch.randn(8).to(torch.bfloat16))
    opt = dopt.AdamW([p], lr=1e-3)
    for _ in range(3):
        p.grad = torch.randn(8).to(torch.bfloat16)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    q = torch.nn.Parameter(p.detach().clone())
    loaded = dopt.AdamW([q], lr=1e-3)
    loaded.load_state_dict(copy.deepcopy(saved))
    for key in ("master_param", "exp_avg", "exp_avg_sq"):
        assert saved["state"][0][key].dtype == torch.float32
        assert torch.equal(loaded.state[q][key], saved["state"][0][key]), key


def test_a_refused_option_is_refused_at_every_step():
    w = torch.nn.Parameter(torch.randn(3))
    opt = dopt.Adam([w])
    w.grad = torch.ones(3)
    opt.step()
    opt.param_groups[0]["betas"] = (1.5, 0.9)
    for _ in range(2):  # not recorded as sent: the C++ side never took it
        with pytest.raises(ValueError, match="Invalid beta parameter at index 0: 1.5"):
            opt.step()
    opt.param_groups[0]["betas"] = (0.8, 0.9)
    opt.step()
