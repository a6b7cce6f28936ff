"""What distopt's torch optimizers share: the drop-ins of ``optim.py`` and
the ``ShardedOptimizer`` of ``distributed.py`` (and, for the tensor checks,
the collectives of ``comm.py``).

- ``check_tensor``: the one-line errors for a tensor distopt cannot take
  (sparse, complex, a type it lacks, off the CPU, not contiguous);
- ``DistoptOptimizer``: a ``torch.optim.Optimizer`` with the parameter
  checks, the step preamble (the closure under ``enable_grad``) and the
  hand-over of changed group options to the C++ side.
"""

import torch

from .. import _core


def check_tensor(t, label, dtypes, what="distopt.torch steps", contiguous=True, devices=("cpu",),
                 device_kernels=True):
    """Raises the one-line TypeError or ValueError naming ``label`` when
    ``t`` is not a dense tensor of one of ``dtypes`` on one of ``devices``
    ("cpu", "cuda": with ``device_kernels``, a CUDA device this build can
    use; without, distopt only copies the tensor and torch's CUDA is
    enough), contiguous unless told otherwise."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{label}: expected a torch.Tensor, got {type(t).__name__}")
    names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
    if t.is_sparse:
        raise ValueError(f"{label} is sparse; {what} dense tensors")
    if t.is_complex() or t.dtype not in dtypes:
        raise TypeError(f"{label} is {'complex ' if t.is_complex() else ''}{t.dtype}; {what} {names}")
    if t.device.type not in devices:
        kinds = " and ".join("CUDA" if d == "cuda" else d.upper() for d in devices)
        raise ValueError(f"{label} is on {t.device}; {what} {kinds} tensors (CUDA: docs/gpu.md)")
    if t.device.type == "cuda" and device_kernels:
        why = _core.cuda_unavailable_reason()
        if why:
            raise ValueError(f"{label} is on {t.device}, but {why}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{label} is not contiguous; pass t.contiguous() (or a contiguous model)")


class DistoptOptimizer(torch.optim.Optimizer):
    """Base of distopt's torch optimizers. A subclass sets ``_dtypes`` (the
    parameter types it steps), ``_contiguous`` (False where it copies the
    parameters into a buffer of its own) and may extend ``_check_param``."""

    _dtypes = (torch.float32,)
    _contiguous = True
    _devices = ("cpu",)
    _device_kernels = True  # whether a CUDA parameter needs this build's CUDA (False: only copied)

    def _label(self, p, i):
        return f"{type(self).__name__}: parameter {i} (shape {tuple(p.shape)})"

    def _check_param(self, p, i):
        check_tensor(p, self._label(p, i), self._dtypes, contiguous=self._contiguous, devices=self._devices,
                     device_kernels=self._device_kernels)

    @staticmethod
    def _run_closure(closure):
        """The step's preamble: the closure's loss, computed with gradients
        on (``step`` itself runs under ``no_grad``), or None."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    @staticmethod
    def _send_changed_options(group, synced, send):
        """``send(name, value)`` for each option of ``group`` whose value
        differs from the one the C++ side has (``synced``), which records it
        once sent (a value the C++ side refuses stays unsent, and is refused
        again at the next step). Returns the names sent."""
        sent = []
        for k, old in synced.items():
            v = group[k]
            if v != old:
                send(k, v)
                synced[k] = v
                sent.append(k)
        return sent
