"""The one place that decides which backend runs a call, and whether it needs gradients."""

from __future__ import annotations

import os

import torch

from kvarena.attention.dtypes import KERNEL_DTYPES

__all__ = ["resolve_backend", "needs_grad"]


def _require_interpreter() -> None:
    """The interpreter is chosen when triton is imported: the flag must be set before."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise RuntimeError(
            "backend='triton' on CPU tensors runs the Triton interpreter: set TRITON_INTERPRET=1 "
            "in the environment before triton is imported (e.g. at the top of the script)"
        )


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype, needs_grad: bool,
                    what: str = "q", *, triton_grad: bool = False) -> str:
    """The backend that runs a call: ``"torch"`` or ``"triton"``.

    ``backend`` is an already validated name. ``triton_grad``: the call's gradients are
    ones the Triton backward computes (attention w.r.t. q and the keys given in the
    call, not w.r.t. a cache tensor). Raises before anything runs when the chosen backend
    cannot serve the call: ``"triton"`` under autograd it cannot differentiate, on a
    device other than CUDA/CPU, on CPU without the interpreter, or for a dtype the kernels
    do not take (``what`` names the tensor in the message).
    """
    if backend == "auto":
        return "triton" if device.type == "cuda" and (triton_grad or not needs_grad) else "torch"
    if backend == "triton":
        if needs_grad and not triton_grad:
            raise ValueError(
                f"backend: 'triton' has no backward for this call's gradient (w.r.t. {what}); the "
                "Triton backward covers attention w.r.t. q and the keys given in the call. Use "
                "backend='auto' or 'torch'"
            )
        if device.type == "cpu":
            _require_interpreter()
        elif device.type not in ("cuda", "meta"):  # meta: a dry run, allocations only
            raise ValueError(f"backend: 'triton' takes CUDA or CPU (interpreter) tensors, got device {device}")
        if dtype not in KERNEL_DTYPES:
            raise TypeError(f"{what}: the Triton kernels take float16, bfloat16 or float32, got {dtype}")
    return backend


def needs_grad(*tensors) -> bool:
    """Whether autograd would record a call on ``tensors`` (None entries skipped)."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:  # noqa: SIM110 (a plain loop is ~3x cheaper than any() over a generator)
        if t is not None and t.requires_grad:
            return True
    return False
