"""Shared helpers of the Python front end's tests (python/tests/)."""

import os

import pytest
import torch

torch.set_num_threads(1)


def mlp(seed=0, dtype=torch.float32):
    """A small torch.nn MLP with a bias-free layer and a 1-D parameter, in float32."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8, bias=False), torch.nn.Tanh(),
        torch.nn.Linear(8, 3)).to(dtype)


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 12, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(n)]


def loss_of(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def replica_backward(model, x, y):
    """The loss's gradients into the .grad of ``model`` (an mlp(seed=3) on a
    device), computed on a CPU replica of its parameters: a GPU's forward
    and backward have other bits than the CPU's, and the optimizer is what
    the CUDA tests compare."""
    replica = mlp(seed=3)
    with torch.no_grad():
        for r, p in zip(replica.parameters(), model.parameters()):
            r.copy_(p)
    loss_of(replica, x, y).backward()
    for r, p in zip(replica.parameters(), model.parameters()):
        if p.grad is None:
            p.grad = r.grad.to(p.device)
        else:
            p.grad.copy_(r.grad)


@pytest.fixture
def distopt_bin():
    path = os.environ.get("DISTOPT_BIN")
    if not path:
        pytest.skip("DISTOPT_BIN is not set (ctest sets it)")
    return path
