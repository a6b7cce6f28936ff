"""distopt for PyTorch: ``distopt.torch.optim`` (torch.optim drop-ins),
``distopt.torch.distributed`` (the sharded optimizer),
``distopt.torch.ddp_comm_hooks`` (int8 gradients for torch's DDP) and
``distopt.torch.comm`` (communicators on torch tensors)."""

from . import comm, ddp_comm_hooks, distributed, optim  # noqa: F401
