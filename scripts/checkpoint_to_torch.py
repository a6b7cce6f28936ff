#!/usr/bin/env python3
"""Loads parameters exported by `distopt checkpoint export` into the
equivalent PyTorch model and evaluates it on Fashion-MNIST's test set.

    distopt train --epochs 1 --checkpoint-dir ck --json
    distopt checkpoint export ck -o params.safetensors
    python3 scripts/checkpoint_to_torch.py params.safetensors

The safetensors file is read with numpy alone (8-byte little-endian header
length, JSON header, raw little-endian float32 data), not with the
safetensors package. Prints {"test_accuracy", "test_loss"}, to compare with
distopt train's summary (docs/formats.md).
"""
import argparse
import gzip
import json
import os
import struct
import sys

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from safetensors_np import read_safetensors  # noqa: E402


def read_idx(path):
    raw = gzip.open(path, "rb").read()
    dims = raw[3]
    shape = struct.unpack(">" + "I" * dims, raw[4:4 + 4 * dims])
    return np.frombuffer(raw[4 + 4 * dims:], dtype=np.uint8).reshape(shape)


class Mlp(nn.Module):
    """distopt's mlp: Linear-ReLU layers named fc1, fc2, ..., as torch names them."""

    def __init__(self, widths):
        super().__init__()
        self.names = []
        for i, (a, b) in enumerate(zip(widths[:-1], widths[1:]), start=1):
            setattr(self, f"fc{i}", nn.Linear(a, b))
            self.names.append(f"fc{i}")

    def forward(self, x):
        for k, name in enumerate(self.names):
            x = getattr(self, name)(x)
            if k + 1 < len(self.names):
                x = torch.relu(x)
        return x


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file")
    p.add_argument("--data-dir", default=os.environ.get("DISTOPT_FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist"))
    args = p.parse_args()
    tensors, meta = read_safetensors(args.file)
    weights = sorted((k for k in tensors if k.startswith("fc") and k.endswith(".weight")), key=lambda k: int(k[2:-7]))
    widths = [tensors[weights[0]].shape[1]] + [tensors[w].shape[0] for w in weights]
    model = Mlp(widths)
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in tensors.items() if k.startswith("fc")})
    x = read_idx(os.path.join(args.data_dir, "t10k-images-idx3-ubyte.gz")).reshape(-1, widths[0]).astype(np.float32) / 255.0
    y = read_idx(os.path.join(args.data_dir, "t10k-labels-idx1-ubyte.gz")).astype(np.int64)
    with torch.no_grad():
        logits = model(torch.from_numpy(x))
        loss = nn.functional.cross_entropy(logits, torch.from_numpy(y)).item()
        accuracy = (logits.argmax(1).numpy() == y).mean()
    print(json.dumps({"test_accuracy": round(float(accuracy), 4), "test_loss": loss, "model": meta.get("model"),
                      "step": meta.get("step")}))


if __name__ == "__main__":
    main()
