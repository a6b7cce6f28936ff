"""The drop-ins on CUDA parameters (docs/gpu.md, "From PyTorch").

Every test but the first two needs a CUDA device that both the installed
torch and this build of distopt can use, and skips with the reason
otherwise (the project's machines have nvcc and no GPU; the GPU test
machine runs them through scripts/bench_gpu under its torch 2.x).

The reference is the same drop-in on CPU copies of the same parameters and
gradients: the device step runs each rule's CPU source per element, so
parameters and state agree bit for bit.
"""

import copy

import pytest
import torch

import distopt._core as _core
import distopt.torch.optim as dopt

WHY = _core.cuda_unavailable_reason() or ("" if torch.cuda.is_available() else "the installed torch has no CUDA")
needs_cuda = pytest.mark.skipif(bool(WHY), reason=f"no CUDA here: {WHY}")

# The rules with CUDA kernels, one option set each that exercises their state.
POINTWISE = [("SGD", dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)), ("SGD", dict(lr=0.1)),
             ("Adam", dict(lr=0.01, amsgrad=True)), ("AdamW", dict(lr=0.01)), ("Adamax", dict(lr=0.01)),
             ("Adadelta", dict(weight_decay=0.1)), ("Adagrad", dict(lr=0.1, initial_accumulator_value=0.1)),
             ("RMSprop", dict(lr=0.01, centered=True, momentum=0.5)), ("NAdam", dict(lr=0.01)),
             ("RAdam", dict(lr=0.01)), ("Rprop", dict()), ("ASGD", dict(lr=0.01)), ("Lion", dict(lr=1e-3))]
SHAPES = [(0,), (1,), (7, 3), (70001,), (64, 65)]


def test_a_device_distopt_does_not_step_is_one_line():
    p = torch.empty(3, device="meta", requires_grad=True)
    with pytest.raises(ValueError, match=r"^Adam: parameter 0 \(shape \(3,\)\) is on meta; distopt.torch steps CPU "
                                         r"and CUDA tensors \(CUDA: docs/gpu.md\)$"):
        dopt.Adam([p])


def test_the_reason_cuda_cannot_be_used_is_one_line():
    why = _core.cuda_unavailable_reason()
    assert "\n" not in why
    assert why == "" or why.startswith(("this build has no CUDA", "no CUDA device"))


def _params(device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).to(device).requires_grad_() for s in SHAPES]


def _run(name, kw, device, dtype, steps=6, stream=None):
    params = _params(device, dtype)
    opt = getattr(dopt, name)(params, **kw)
    g = torch.Generator().manual_seed(1)
    grads = [[torch.randn(p.shape, generator=g).to(dtype) for p in params] for _ in range(steps)]
    for k in range(steps):
        if stream is None:
            for p, gr in zip(params, grads[k]):
                p.grad = gr.to(device)
            opt.step()
            continue
        # The user's side stream (non-blocking, as torch makes them): it is
        # busy for about 0.1 s, then the gradients land; the step, enqueued
        # there, must follow them, and step() must return before they land
        # (but the first, which makes the state from the parameters, waits).
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            torch.cuda._sleep(200_000_000)
            for p, gr in zip(params, grads[k]):
                p.grad = gr.to(device)
            opt.step()
            assert k == 0 or not stream.query(), "step() waited for the stream"
        torch.cuda.current_stream().wait_stream(stream)
    return params, opt


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name,kw", POINTWISE, ids=[f"{n}-{i}" for i, (n, _) in enumerate(POINTWISE)])
def test_cuda_parameters_step_with_the_cpu_bits(name, kw, dtype):
    ours, opt = _run(name, kw, "cuda", dtype)
    ref, ref_opt = _run(name, kw, "cpu", dtype)
    for k, (p, q) in enumerate(zip(ours, ref)):
        assert p.device.type == "cuda"
        assert torch.equal(p.detach().cpu(), q.detach()), f"parameter {k}"
        for key, value in ref_opt.state[q].items():
            mine = opt.state[p][key]
            if torch.is_tensor(value):
                assert mine.device == (p.device if value.dim() > 0 else torch.device("cpu")), key
                assert torch.equal(mine.cpu(), value), f"parameter {k}, state {key}"


# Quantized state (docs/optimizers.md, "Quantized state"): the device keeps
# codes and block scales as the CPU does, so the parameters, the codes, the
# scales and bf16 state agree bit for bit; the state_dict moves to the CPU.
QUANTIZED = [("AdamW8bit", dict(lr=0.01)), ("AdamW4bit", dict(lr=0.01, weight_decay=0.1)),
             ("Adam8bit", dict(lr=0.01, amsgrad=True)), ("SGD", dict(lr=0.1, momentum=0.9, state_dtype="int8")),
             ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True, state_dtype="int4")),
             ("AdamW", dict(lr=0.01, state_dtype="bf16")), ("Lion", dict(lr=1e-3, state_dtype="int8"))]


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name,kw", QUANTIZED, ids=[f"{n}-{i}" for i, (n, _) in enumerate(QUANTIZED)])
def test_quantized_state_on_cuda_has_the_cpu_bits(name, kw, dtype):
    ours, opt = _run(name, kw, "cuda", dtype)
    ref, ref_opt = _run(name, kw, "cpu", dtype)
    quantized = 0
    for k, (p, q) in enumerate(zip(ours, ref)):
        assert torch.equal(p.detach().cpu(), q.detach()), f"parameter {k}"
        for key, value in ref_opt.state[q].items():
            mine = opt.state[p][key]
            if torch.is_tensor(value):
                quantized += value.dtype in (torch.uint8, torch.bfloat16)
                assert mine.dtype == value.dtype, key
                assert torch.equal(mine.cpu(), value), f"parameter {k}, state {key}"
    assert quantized > 0
    again = getattr(dopt, name)([q.detach().clone().requires_grad_() for q in ref], **kw)
    again.load_state_dict(copy.deepcopy(opt.state_dict()))  # the device's state, onto the CPU
    for o, ps in ((again, again.param_groups[0]["params"]), (ref_opt, ref)):
        for p in ps:
            p.grad = torch.ones_like(p)
        o.step()
    for p, q in zip(again.param_groups[0]["params"], ref):
        assert torch.equal(p, q)


@needs_cuda
@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW4bit"])
def test_quantized_state_stepped_on_a_side_stream_has_the_cpu_bits(name):
    ours, opt = _run(name, dict(lr=0.01), "cuda", torch.float32, stream=torch.cuda.Stream())
    ref, ref_opt = _run(name, dict(lr=0.01), "cpu", torch.float32)
    for k, (p, q) in enumerate(zip(ours, ref)):
        assert torch.equal(p.detach().cpu(), q.detach()), f"parameter {k}"
        for key, value in ref_opt.state[q].items():
            if torch.is_tensor(value):
                assert torch.equal(opt.state[p][key].cpu(), value), f"parameter {k}, state {key}"


# The rules with norms (tensor_stats): the device sums them in another order
# than the CPU, so parameters agree within 1e-6 of their largest magnitude
# (one rounding of a bf16 parameter) rather than bit for bit.
STATS = [("LAMB", dict(lr=0.01)), ("LAMB", dict(lr=0.01, adam_w_mode=False, weight_decay=0.1, max_grad_norm=0.5)),
         ("LARS", dict(lr=0.1, weight_decay=1e-4, momentum=0.9)), ("LARS", dict(lr=0.1)),
         ("Adafactor", dict()), ("Adafactor", dict(lr=0.01, relative_step=False, beta1=0.9, weight_decay=0.01))]


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name,kw", STATS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(STATS)])
def test_rules_with_norms_step_cuda_parameters_as_on_the_cpu(name, kw, dtype):
    ours, opt = _run(name, kw, "cuda", dtype)
    ref, ref_opt = _run(name, kw, "cpu", dtype)
    ulp = 0.0 if dtype == torch.float32 else 2.0 ** -7
    for k, (p, q) in enumerate(zip(ours, ref)):
        assert p.device.type == "cuda"
        big = q.detach().float().abs().max().item() if q.numel() else 0.0
        diff = (p.detach().cpu().float() - q.detach().float()).abs().max().item() if q.numel() else 0.0
        assert diff <= (1e-6 + ulp) * big, f"parameter {k}: {diff} against {big}"
        for key, value in ref_opt.state[q].items():
            if torch.is_tensor(value) and value.dim() > 0:
                mine = opt.state[p][key].cpu()
                assert mine.shape == value.shape, key
                torch.testing.assert_close(mine, value, rtol=1e-5, atol=1e-5 * value.abs().max().item(), msg=key)
            else:
                assert float(opt.state[p][key]) == float(value), key


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kw", [dict(lr=0.02), dict(lr=0.02, nesterov=False, adjust_lr_fn="match_rms_adamw"),
                                dict(lr=0.03, ns_steps=7)], ids=["default", "plain-rms", "odd-steps"])
def test_muon_steps_cuda_parameters_on_cublas_as_on_the_cpu(kw, dtype):
    """Newton-Schulz on cuBLAS: the products in another order than the
    CPU's, so within 1e-5 of each parameter's largest magnitude; the
    momentum buffer (the CPU's per-element math on the same gradients) bit
    for bit."""
    shapes = [(300, 70), (70, 300), (64, 64), (1, 513)]
    runs = []
    for device in ("cuda", "cpu"):
        g = torch.Generator().manual_seed(0)
        params = [torch.randn(s, generator=g).to(dtype).to(device).requires_grad_() for s in shapes]
        opt = dopt.Muon(params, **kw)
        gg = torch.Generator().manual_seed(1)
        for _ in range(4):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gg).to(dtype).to(device)
            opt.step()
        runs.append((params, opt))
    (ours, opt), (ref, ref_opt) = runs
    ulp = 0.0 if dtype == torch.float32 else 2.0 ** -7
    for k, (p, q) in enumerate(zip(ours, ref)):
        assert p.device.type == "cuda"
        big = q.detach().float().abs().max().item()
        diff = (p.detach().cpu().float() - q.detach().float()).abs().max().item()
        assert diff <= (1e-5 + ulp) * big, f"parameter {k}: {diff} against {big}"
        assert torch.equal(opt.state[p]["momentum_buffer"].cpu(), ref_opt.state[q]["momentum_buffer"])


@needs_cuda
def test_the_step_runs_on_torchs_current_stream():
    stream = torch.cuda.Stream()
    ours, _ = _run("AdamW", dict(lr=0.01), "cuda", torch.float32, stream=stream)
    torch.cuda.synchronize()
    ref, _ = _run("AdamW", dict(lr=0.01), "cpu", torch.float32)
    for p, q in zip(ours, ref):
        assert torch.equal(p.detach().cpu(), q.detach())


@needs_cuda
def test_state_dict_interchanges_with_torchs_optimizer_on_cuda():
    params, opt = _run("Adam", dict(lr=0.01), "cuda", torch.float32)
    theirs = [p.detach().clone().requires_grad_() for p in params]
    ref = torch.optim.Adam(theirs, lr=0.01)
    ref.load_state_dict(copy.deepcopy(opt.state_dict()))
    again = dopt.Adam([p.detach().clone().requires_grad_() for p in params], lr=0.01)
    again.load_state_dict(copy.deepcopy(ref.state_dict()))
    for o, ps in ((ref, theirs), (again, again.param_groups[0]["params"]), (opt, params)):
        for p in ps:
            p.grad = torch.ones_like(p)
        o.step()
    for p, q, r in zip(params, theirs, again.param_groups[0]["params"]):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert torch.equal(p, r)


@needs_cuda
def test_non_contiguous_cuda_parameters_step_through_a_copy():
    base = torch.randn(10, 5, 2, device="cuda")
    p = base[..., 0].requires_grad_()
    q = p.detach().cpu().requires_grad_()
    for o, t in ((dopt.Adam([p], lr=0.1), p), (dopt.Adam([q], lr=0.1), q)):
        t.grad = torch.ones(t.shape, device=t.device)
        o.step()
    assert torch.equal(p.detach().cpu(), q.detach())


@needs_cuda
def test_mixed_devices_and_rules_without_a_kernel_are_refused_at_construction():
    a = torch.zeros(3, device="cuda", requires_grad=True)
    b = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match=r"parameter 1 .* is on cpu, parameter 0 on cuda:0; one optimizer steps "
                                         r"parameters on one device"):
        dopt.Adam([a, b])
    with pytest.raises(ValueError, match=r"^Shampoo: parameter 0 \(shape \(3,\)\) is on cuda:0, but shampoo has no "
                                         r"CUDA kernel yet"):
        dopt.Shampoo([a])
    with pytest.raises(ValueError, match="capturable=True"):
        dopt.Adam([a], capturable=True)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_offload_of_cuda_parameters_has_the_cpu_bits_and_no_device_state(dtype):
    ours = _params("cuda", dtype)
    ref = _params("cpu", dtype)
    opt, ref_opt = dopt.CPUOffload(ours, lr=0.01, threads=2), dopt.AdamW(ref, lr=0.01)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        for p, q in zip(ours, ref):
            q.grad = torch.randn(q.shape, generator=g).to(dtype)
            p.grad = q.grad.cuda()
        opt.step()
        ref_opt.step()
    torch.cuda.synchronize()
    for p, q in zip(ours, ref):
        assert torch.equal(p.detach().cpu(), q.detach())
        assert all(t.device.type == "cpu" for t in opt.state[p].values())
        assert p.numel() == 0 or opt.state[p]["master_param"].is_pinned()


@needs_cuda
@pytest.mark.parametrize("clip", [False, True], ids=["as-produced", "clipped-after"])
def test_cpu_offload_copies_gradients_during_backward_with_the_same_bits(clip):
    """The hooks' copies (a side stream, during backward) and the step's own
    (a gradient changed after backward) give the bits of overlap=False."""
    results = []
    for overlap in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).cuda()
        opt = dopt.CPUOffload(model.parameters(), lr=0.01, overlap=overlap)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(32, 64, generator=g).cuda()).pow(2).mean().backward()
            if overlap:
                assert len(opt._copied) == 4
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
        torch.cuda.synchronize()
        results.append([p.detach().cpu() for p in model.parameters()])
    for p, q in zip(*results):
        assert torch.equal(p, q)


def _grad_scaler():
    amp = getattr(torch, "amp", None)
    return amp.GradScaler("cuda") if hasattr(amp, "GradScaler") else torch.cuda.amp.GradScaler()


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grad_scaler_drives_the_drop_in_on_the_device_as_on_its_standard_path(dtype):
    """GradScaler through _step_supports_amp_scaling (found_inf read by the
    kernels, the skipped step's "step" put back) gives the bits of its
    standard path (unscale_, found_inf read on the host, step() not called),
    with steps that have an inf gradient: the first (which would make the
    state), one in the middle and the last (put back only when state_dict
    reads the flag)."""
    runs = []
    for protocol in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)).cuda().to(dtype)
        opt = dopt.AdamW(model.parameters(), lr=1e-3)
        opt._step_supports_amp_scaling = protocol
        scaler = _grad_scaler()
        for k in range(6):
            opt.zero_grad()
            x = torch.randn(4, 16, device="cuda", dtype=dtype)
            scaler.scale(model(x).float().pow(2).mean()).backward()
            if k in (0, 2, 5):
                model[0].weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
        sd = opt.state_dict()
        runs.append(([p.detach().clone() for p in model.parameters()], sd["state"], scaler.get_scale()))
    assert [float(s["step"]) for s in runs[0][1].values()] == [3.0] * 4
    assert runs[0][2] == runs[1][2]
    assert runs[0][1].keys() == runs[1][1].keys()
    for a, b in zip(runs[0][1].values(), runs[1][1].values()):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(torch.as_tensor(a[key]).cpu(), torch.as_tensor(b[key]).cpu()), key
    for p, q in zip(runs[0][0], runs[1][0]):
        assert torch.equal(p, q)


# ---- ShardedOptimizer over CUDA parameters: staged through host memory,
# so torch's CUDA is enough (this build of distopt needs none of its own).
TORCH_WHY = "" if torch.cuda.is_available() else "the installed torch has no CUDA"
needs_torch_cuda = pytest.mark.skipif(bool(TORCH_WHY), reason=f"no CUDA here: {TORCH_WHY}")


@needs_torch_cuda
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2"])
@pytest.mark.parametrize("rule,kw", [("adamw", dict(lr=1e-2, weight_decay=0.1)), ("lamb", dict(lr=1e-2)),
                                     ("muon", dict(lr=2e-2))], ids=["adamw", "lamb", "muon"])
def test_sharded_optimizer_steps_cuda_parameters_with_the_cpu_bits(rule, kw, strategy):
    from conftest import batches, mlp, replica_backward
    import distopt.torch.comm as dcomm
    from distopt.torch.distributed import ShardedOptimizer

    # The gradients come from a CPU replica of the parameters (a GPU's
    # forward and backward have other bits): the optimizer is what is compared.
    runs = []
    for device in ("cpu", "cuda"):
        model = mlp(seed=3).to(device)
        storages = [p.data_ptr() for p in model.parameters()]
        opt = ShardedOptimizer(model.parameters(), rule, strategy, comm=dcomm.single(), max_grad_norm=1.0, **kw)
        for x, y in batches(5, seed=7):
            opt.zero_grad()
            replica_backward(model, x, y)
            opt.step()
        if device == "cuda":
            assert [p.data_ptr() for p in model.parameters()] == storages
            assert all(p.is_cuda and p.grad.is_cuda for p in model.parameters())
        runs.append(([p.detach().cpu() for p in model.parameters()], opt.state_dict()["state"]))
    for a, b in zip(runs[0][0], runs[1][0]):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    for i in runs[0][1]:
        for key in runs[0][1][i]:
            assert torch.equal(runs[0][1][i][key], runs[1][1][i][key]), f"state {i}.{key}"


@needs_torch_cuda
def test_sharded_optimizer_on_cuda_over_gloo_at_world_2_has_the_cpu_runs_bits(tmp_path):
    """Two processes on one GPU (gloo carries the host buffers): the same
    bits as the same launch on the CPU, every rule and strategy (the
    worker's gradients come from a CPU replica either way)."""
    from test_sharded import assert_same_run, launch_gloo

    cpu = launch_gloo(str(tmp_path), 2)
    gpu = launch_gloo(str(tmp_path), 2, "--device", "cuda")
    assert gpu["runs"].keys() == cpu["runs"].keys()
    for key in cpu["runs"]:
        assert_same_run(gpu["runs"][key], cpu["runs"][key], f"{key}: cuda vs cpu")


NCCL_WORLD_ONE = """
import sys, torch, torch.distributed as dist
import distopt.torch.comm as dcomm
from distopt.torch.distributed import ShardedOptimizer
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
torch.cuda.set_device(0)
c = dcomm.world()
assert c.backend == "torch" and c.size == 1, (c.backend, c.size)
t = torch.ones(4, device="cuda")
dist.all_reduce(t)  # the NCCL group still works beside the gloo one
model = torch.nn.Linear(4, 2).cuda()
opt = ShardedOptimizer(model.parameters(), "adamw", "zero2")
model(torch.randn(3, 4, device="cuda")).sum().backward()
opt.step()
assert opt.comm is c
dist.destroy_process_group()
print("ok")
"""


@needs_torch_cuda
def test_an_nccl_default_group_gets_a_gloo_group_beside_it():
    import subprocess
    import sys

    from test_sharded import _env, _free_port

    if not torch.distributed.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    r = subprocess.run([sys.executable, "-c", NCCL_WORLD_ONE, str(_free_port())], env=_env(), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
