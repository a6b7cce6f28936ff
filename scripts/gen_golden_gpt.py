#!/usr/bin/env python3
"""Writes tests/golden/gpt/*.safetensors: PyTorch's loss and gradients of
distopt's model "gpt" (scripts/gpt_torch.py) for given weights and a batch,
which tests/gpt_test.cpp compares with distopt's forward and backward.

Each file holds param.<name> (the weights: GPT-2's initialisation, then
perturbed so that biases and LayerNorm weights are not trivial), grad.<name>
(d mean loss / d param), tokens (batch x (context + 1) byte values as
floats) and loss (0-d), with the shape in __metadata__. Needs Debian's
python3-torch; the tests never do.

    python3 scripts/gen_golden_gpt.py
"""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_torch import Gpt  # noqa: E402
from safetensors_np import write_safetensors  # noqa: E402

CASES = [
    # name, layers, heads, dim, context, batch
    ("tiny", 1, 2, 8, 5, 2),
    ("small", 2, 4, 32, 16, 3),
    ("wide", 2, 2, 64, 24, 2),
]


def main():
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden", "gpt")
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(1)
    for seed, (name, layers, heads, dim, context, batch) in enumerate(CASES):
        torch.manual_seed(100 + seed)
        model = Gpt(layers, heads, dim, context)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith(".bias") or "ln_" in pname:
                    p.add_(0.1 * torch.randn_like(p))
                else:
                    p.mul_(5.0)  # larger weights: attention and GELU away from their linear regime
        tokens = torch.randint(0, 256, (batch, context + 1))
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        tensors = {}
        for pname, p in model.named_parameters():
            tensors["param." + pname] = p.detach().numpy()
        for pname, p in model.named_parameters():
            tensors["grad." + pname] = p.grad.numpy()
        tensors["tokens"] = tokens.float().numpy()
        tensors["loss"] = np.array(loss.item(), dtype=np.float32)
        meta = {"layers": str(layers), "heads": str(heads), "dim": str(dim), "context": str(context),
                "batch": str(batch), "generator": "scripts/gen_golden_gpt.py, torch " + torch.__version__}
        path = os.path.join(out, name + ".safetensors")
        write_safetensors(path, tensors, meta)
        print(f"wrote {path}: loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
