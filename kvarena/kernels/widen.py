"""Exact bf16 <-> fp32 conversions inside kernels, the interpreter lane included.

Triton's interpreter widens bf16 to fp32 wrongly below 2**-126 (subnormals come out as
other values), and narrows fp32 to bf16 by truncation (subnormals again far off). Under it
bf16 values go through their bits: widening puts the 16 bits on top of the fp32, narrowing
rounds the fp32's bits to nearest-even, exactly what a GPU's conversions give. Compiled
kernels (``_BF16_BITS`` is False there) keep the plain casts. The one home of that rule:
the store's fp8 quantization, the attention kernels' ``UPCAST`` lane and the merge kernel
convert here.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvarena.kernels._common import interpreting

__all__ = ["narrow", "to_fp32"]

_BF16_BITS = tl.constexpr(interpreting())


@triton.jit
def to_fp32(x):
    """``x`` widened to fp32 exactly (bf16 subnormals included, also in the interpreter)."""
    if _BF16_BITS:  # noqa: SIM102 - two static branches (constexprs), kept apart for the compiler
        if x.dtype == tl.bfloat16:
            x = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def narrow(x, dtype: tl.constexpr):
    """fp32 ``x`` as ``dtype``, rounded to nearest-even (bf16 subnormals included, also in
    the interpreter); NaN stays NaN."""
    y = x.to(dtype)
    if _BF16_BITS:  # noqa: SIM102 - two static branches (constexprs), kept apart for the compiler
        if dtype == tl.bfloat16:
            b = x.to(tl.uint32, bitcast=True)
            r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
            r = tl.where(x != x, 0x7FC0, r)
            y = r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return y
