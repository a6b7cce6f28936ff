"""distopt for PyTorch: ``distopt.torch.optim`` (torch.optim drop-ins),
``distopt.torch.distributed`` (the sharded optimizer) and
``distopt.torch.comm`` (communicators on torch tensors)."""

from . import comm, distributed, optim  # noqa: F401
