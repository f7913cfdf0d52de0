"""float8_e4m3fn encode/decode helpers shared by the store and attention kernels.

Both conversions are written out in integer ops instead of Triton's ``.to(tl.float8e4nv)``:

* Encoding: Triton 3.9's interpreter rounds fp32 -> float8e4nv wrongly (about 1 value in
  40 comes out halved, and 500 saturates to 256), and sm_80 has no fp8 conversion
  instruction at all. The helper below rounds to nearest-even and saturates at +-448
  exactly like ``torch``'s own cast of the clamped value, on the GPU and in the
  interpreter alike; the tests compare the stored bytes with torch's bit for bit.
* Decoding: ``float8e4nv`` is not a Triton type on sm_80 (its fp8 types there are e5m2
  and e4b15), so caches are passed as uint8. A byte ``s eeee mmm`` moved into an fp16
  ``s 0eeee mmm0000000`` is the same number times 2**-8 (exponent bias 15 against 7),
  subnormals included: one AND/shift/OR per element, no table, no branch. The 2**8 goes
  into the per-key scale the kernel multiplies anyway. 0x7F / 0xFF (NaN) map to an fp16
  NaN, so a NaN stored under a static scale still poisons the rows that see it.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP8_MAX = 448.0
# Decoded fp16 values are the fp8 value / 256 (see the module docstring).
FP8_DECODE_SCALE = 256.0


@triton.jit
def _fp8e4m3_bits(y):
    """fp32 ``y`` -> float8_e4m3fn bits (uint8): saturating at +-448, nearest-even."""
    nan = y != y
    a = tl.where(nan, 0.0, tl.minimum(tl.abs(y), 448.0))
    u = a.to(tl.int32, bitcast=True)
    # Normal results (a >= 2**-6): round the fp32 mantissa to 3 bits, nearest-even, then
    # rebias the exponent from 127 to 7; a carry out of the mantissa bumps the exponent.
    r = (u + 0x7FFFF + ((u >> 20) & 1)) & -1048576  # -1048576 = 0xFFF00000
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    # Subnormal results: a * 512 in [0, 8) is the mantissa (8 rounds up into 2**-6).
    t = a * 512.0
    i = t.to(tl.int32)  # t >= 0: truncation is floor
    frac = t - i.to(tl.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((i & 1) == 1))
    sub = i + up.to(tl.int32)
    bits = tl.where(a >= 0.015625, normal, sub)
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
    bits = tl.where(nan, 0x7F, bits) | (sign << 7)  # NaN keeps its sign: 0x7F / 0xFF, as torch's cast
    return bits.to(tl.uint8)


@triton.jit
def _fp8e4m3_decode(b):
    """float8_e4m3fn bits (uint8) -> fp16 holding the value / 256 (exact; NaN stays NaN)."""
    x = b.to(tl.uint16)
    bits = ((x & 0x80) << 8) | ((x & 0x7F) << 7)
    bits = tl.where((x & 0x7F) == 0x7F, 0x7E00, bits)
    return bits.to(tl.float16, bitcast=True)


@triton.jit
def _f16_queries(q, UPCAST: tl.constexpr):
    """A query tile for fp16 dots against fp8 keys, and the per-row gains that undo its scaling.

    e4m3 values (and their shift decode) are exact in fp16, whose conversion takes one
    instruction per two elements where bf16's takes about four. bf16 queries may lie outside
    fp16's range, so each row is scaled by the power of two that puts its largest finite
    magnitude in [2**14, 2**15): in range, with 2**38 below it before fp16's subnormals end.
    Row by row, so rows of very different sizes (the heads of a GQA group, the tokens of a
    chunk) each keep their bits, and a row holding inf or NaN moves no other row. The
    scores of row m are its raw dots times ``gain[m]`` (exact: a power of two, within
    2**+-126, which covers every finite bf16 and fp32 value). Under ``UPCAST`` (the
    interpreter) the rounded tile is widened back to fp32.
    """
    qf = q.to(tl.float32)
    a = tl.abs(qf)
    amax = tl.max(tl.where(a < float("inf"), a, 0.0), 1)  # [BLOCK_M], finite values only (NaN: False)
    ex = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2(amax)), normal amax
    sh = tl.minimum(tl.maximum(ex - 14, -126), 126)
    down = ((127 - sh) << 23).to(tl.float32, bitcast=True)  # 2**-sh
    gain = ((127 + sh) << 23).to(tl.float32, bitcast=True)  # 2**sh
    q16 = (qf * down[:, None]).to(tl.float16)
    if UPCAST:
        q16 = q16.to(tl.float32)
    return q16, gain
