"""A contiguous flash-attention forward: the yardstick of ``kvarena check --perf``.

Not used for serving. It is the plainest loop a tile can run: Q tile ``[BLOCK_M,
HEAD_DIM]`` against contiguous K/V of one head, online softmax in the exp2 domain, no
masks, no block table. ``kvarena check --perf`` compiles it at the same tile, warps and
stages as each block-table configuration and reports the block-table loop's SASS
instructions per iteration as a ratio to this one's, so the cost of gathering through
the block table and of the masks is a number, not a guess.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _flash_reference_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,
    stride_qm, stride_km, stride_vm, stride_om,
    n_keys, scale_log2,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    m0 = tl.program_id(0) * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    d = tl.arange(0, HEAD_DIM)  # [HEAD_DIM]
    n_off = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    q = tl.load(q_ptr + rows[:, None] * stride_qm + d[None, :])  # [BLOCK_M, HEAD_DIM]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in range(0, n_keys, BLOCK_N):
        keys = start + n_off
        kt = tl.load(k_ptr + keys[None, :] * stride_km + d[:, None])  # [HEAD_DIM, BLOCK_N]
        s = tl.dot(q, kt) * scale_log2  # [BLOCK_M, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        pr = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        v = tl.load(v_ptr + keys[:, None] * stride_vm + d[None, :])  # [BLOCK_N, HEAD_DIM]
        acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(o_ptr + rows[:, None] * stride_om + d[None, :], o.to(o_ptr.dtype.element_ty))


def flash_reference_fwd(q, k, v, out, *, block_m: int = 16, block_n: int = 16) -> None:
    """``out = softmax(q k^T / sqrt(D)) v`` for one head; ``q [M, D]``, ``k, v [N, D]``.

    M and N must be multiples of the tiles and D a power of two (a yardstick, not an op).
    """
    m, d = q.shape
    grid = (triton.cdiv(m, block_m),)
    _flash_reference_kernel[grid](
        q, k, v, out, q.stride(0), k.stride(0), v.stride(0), out.stride(0), k.shape[0],
        d**-0.5 * 1.4426950408889634, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n,
    )
