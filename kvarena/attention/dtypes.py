"""The dtype rules of the attention ops, in one place (the arena reads them without
importing any op)."""

from __future__ import annotations

import torch

__all__ = ["KERNEL_DTYPES", "TORCH_DTYPES", "FP8_CACHE_DTYPES", "MAX_HEAD_DIM", "accumulator_dtype"]

#: What the Triton kernels take for q / float caches (and what fp8 layouts take in).
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


TORCH_DTYPES = (*KERNEL_DTYPES, torch.float64)


FP8_CACHE_DTYPES = (torch.float8_e4m3fn,)


MAX_HEAD_DIM = 256


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """What attention accumulates (and its lse is) in for inputs of ``dtype``: fp64 for fp64, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
