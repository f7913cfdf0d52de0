"""Exact widening to fp32 inside kernels, the interpreter lane included.

Triton's interpreter widens bf16 to fp32 wrongly below 2**-126 (subnormals come out as
other values), so under it bf16 values are widened through their bits: the 16 bits are
the top half of the fp32, exactly what a GPU's conversion gives. Compiled kernels
(``_BF16_BITS`` is False there) keep the plain cast. The one home of that rule: the
store's fp8 quantization and the attention kernels' ``UPCAST`` lane both widen here.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvarena.kernels._common import interpreting

__all__ = ["to_fp32"]

_BF16_BITS = tl.constexpr(interpreting())


@triton.jit
def to_fp32(x):
    """``x`` widened to fp32 exactly (bf16 subnormals included, also in the interpreter)."""
    if _BF16_BITS:  # noqa: SIM102 - two static branches (constexprs), kept apart for the compiler
        if x.dtype == tl.bfloat16:
            x = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)
