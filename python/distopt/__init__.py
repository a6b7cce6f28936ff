"""distopt: distributed optimizers from C++, for PyTorch users.

``distopt.torch.optim`` has torch.optim drop-ins backed by distopt's C++
update rules (docs/python.md).
"""

from ._core import __version__  # noqa: F401
