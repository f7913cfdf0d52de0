"""A contiguous flash-attention forward: the yardstick of ``kvarena check --perf``.

Not used for serving. It is the plainest loop a tile can run: Q tile ``[BLOCK_M,
HEAD_DIM]`` against contiguous K/V of one head, online softmax in the exp2 domain, no
masks, no block table. ``kvarena check --perf`` compiles it at the same tile, warps and
stages as each block-table configuration and reports the block-table loop's SASS
instructions per iteration as a ratio to this one's, so the cost of gathering through
the block table and of the masks is a number, not a guess.

With ``KV_FP8`` the keys and values are fp8 (float8e4nv; uint8 bytes with the shift decode
where ``FP8_NATIVE`` is off, as on sm_80) with contiguous per-key fp32 scales, and the dots
run in fp16 as the block-table kernel's do: the yardstick of an fp8 cache's loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvarena.kernels.fp8 import _fp8e4m3_decode


@triton.jit
def _fp8_to_f16(x, NATIVE: tl.constexpr):
    if NATIVE:
        y = x.to(tl.float16)
    else:
        y = _fp8e4m3_decode(x)  # value / 256: the 256 is folded into the scales
    return y


@triton.jit
def _flash_reference_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, ks_ptr, vs_ptr,
    stride_qm, stride_km, stride_vm, stride_om,
    n_keys, scale_log2,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
):
    m0 = tl.program_id(0) * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    d = tl.arange(0, HEAD_DIM)  # [HEAD_DIM]
    n_off = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    q = tl.load(q_ptr + rows[:, None] * stride_qm + d[None, :])  # [BLOCK_M, HEAD_DIM]
    if KV_FP8:
        q = q.to(tl.float16)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in range(0, n_keys, BLOCK_N):
        keys = start + n_off
        kt = tl.load(k_ptr + keys[None, :] * stride_km + d[:, None])  # [HEAD_DIM, BLOCK_N]
        if KV_FP8:
            s = tl.dot(q, _fp8_to_f16(kt, FP8_NATIVE)) * (tl.load(ks_ptr + keys) * scale_log2)[None, :]
        else:
            s = tl.dot(q, kt) * scale_log2  # [BLOCK_M, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        pr = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        v = tl.load(v_ptr + keys[:, None] * stride_vm + d[None, :])  # [BLOCK_N, HEAD_DIM]
        if KV_FP8:
            acc = acc * alpha[:, None] + tl.dot((pr * tl.load(vs_ptr + keys)[None, :]).to(tl.float16),
                                                _fp8_to_f16(v, FP8_NATIVE))
        else:
            acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(o_ptr + rows[:, None] * stride_om + d[None, :], o.to(o_ptr.dtype.element_ty))


def flash_reference_fwd(q, k, v, out, *, block_m: int = 16, block_n: int = 16, k_scale=None, v_scale=None) -> None:
    """``out = softmax(q k^T / sqrt(D)) v`` for one head; ``q [M, D]``, ``k, v [N, D]``.

    M and N must be multiples of the tiles and D a power of two (a yardstick, not an op).
    ``k_scale``, ``v_scale`` (fp32 ``[N]``): ``k``, ``v`` are float8_e4m3fn and key n is
    ``k[n] * k_scale[n]`` (decoded from the bytes by shifting, as on sm_80).
    """
    m, d = q.shape
    grid = (triton.cdiv(m, block_m),)
    fp8 = k_scale is not None
    if fp8:  # the shift decode gives value / 256
        k, v = k.view(torch.uint8), v.view(torch.uint8)
        k_scale, v_scale = k_scale * 256.0, v_scale * 256.0
    _flash_reference_kernel[grid](
        q, k, v, out, k_scale, v_scale, q.stride(0), k.stride(0), v.stride(0), out.stride(0), k.shape[0],
        d**-0.5 * 1.4426950408889634, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, KV_FP8=fp8, FP8_NATIVE=False,
    )
