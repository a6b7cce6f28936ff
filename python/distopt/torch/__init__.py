"""distopt for PyTorch: ``distopt.torch.optim`` (torch.optim drop-ins)."""

from . import optim  # noqa: F401
