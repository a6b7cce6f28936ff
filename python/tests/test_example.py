"""The README's example: a torch.nn MLP on Fashion-MNIST with distopt's AdamW."""

import os
import pathlib
import subprocess
import sys

import pytest

from distopt.data import fashion_mnist

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_fashion_mnist_reader():
    x, y = fashion_mnist("test")
    assert tuple(x.shape) == (10000, 784) and tuple(y.shape) == (10000,)
    assert 0.0 <= x.min().item() and x.max().item() <= 1.0 and set(y.unique().tolist()) == set(range(10))
    with pytest.raises(ValueError, match="split must be"):
        fashion_mnist("validation")
    with pytest.raises(OSError):
        fashion_mnist("train", root="/nonexistent")


def test_example_trains_to_the_accuracy_torch_reaches():
    out = subprocess.run([sys.executable, str(ROOT / "examples/python/fashion_mnist_mlp.py"), "--epochs", "1"],
                         capture_output=True, text=True, check=True, env=os.environ)
    acc = float(out.stdout.split("test accuracy ")[1].split()[0])
    assert acc > 0.83, out.stdout
