"""Datasets through distopt's C++ readers, as torch tensors."""

import torch

from . import _core


def fashion_mnist(split="train", root=None):
    """Fashion-MNIST from Debian's dataset-fashion-mnist (or ``root``, or
    $DISTOPT_FASHION_MNIST_DIR): ``(images, labels)`` with images a float32
    tensor of shape (n, 784) in [0, 1] (torchvision's ToTensor, flattened)
    and labels an int64 tensor; split "train" (60,000) or "test" (10,000)."""
    if split not in ("train", "test"):
        raise ValueError(f"fashion_mnist: split must be 'train' or 'test', not {split!r}")
    x, y = _core.fashion_mnist(root or "")[split]
    return torch.from_numpy(x), torch.from_numpy(y)
