"""Exact merge of two partial attentions over disjoint key sets (split-KV, cascade, history + chunk).

``out = (w_a * out_a + w_b * out_b) / (w_a + w_b)`` with ``w = exp(lse - max(lse_a, lse_b))``
and ``lse = max + log(w_a + w_b)``. A part with ``lse = -inf`` (it saw no key) has weight
0 and its ``out`` is never loaded, so garbage (even NaN) there cannot leak; both empty ->
``out = 0``, ``lse = -inf``. Tile ``[BLOCK_R, HEAD_DIM_PAD]`` over rows ``n * H + h``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvarena.kernels._common import row_tile
from kvarena.kernels.widen import narrow, to_fp32


@triton.jit
def _merge_states_kernel(
    oa_ptr, la_ptr, ob_ptr, lb_ptr, o_ptr, l_ptr,
    stride_oan, stride_oah, stride_oad,
    stride_obn, stride_obh, stride_obd,
    stride_on, stride_oh, stride_od,
    stride_lan, stride_lah, stride_lbn, stride_lbh, stride_ln, stride_lh,
    n_rows, num_heads,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    r_ok = r < n_rows
    n = (r // num_heads).to(tl.int64)
    h = (r % num_heads).to(tl.int64)
    # lse may arrive as fp64 (the torch path's dtype for fp64 work): upcast/downcast here.
    la = tl.load(la_ptr + n * stride_lan + h * stride_lah, mask=r_ok, other=float("-inf")).to(tl.float32)
    lb = tl.load(lb_ptr + n * stride_lbn + h * stride_lbh, mask=r_ok, other=float("-inf")).to(tl.float32)
    m = tl.maximum(la, lb)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # both empty: avoid -inf - -inf = NaN
    wa = tl.exp2((la - m_safe) * 1.4426950408889634)  # [BLOCK_R]
    wb = tl.exp2((lb - m_safe) * 1.4426950408889634)
    tot = wa + wb
    has_key = tot != 0.0  # NaN (a part that saw a NaN) stays NaN
    inv = tl.where(has_key, 1.0 / tl.where(has_key, tot, 1.0), 0.0)
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = (d < HEAD_DIM)[None, :]
    # int64: a permuted view (e.g. of a [D, N, H] buffer) has a head_dim stride of N * H,
    # and D * stride passes 2**31 once N * H > 2**31 / D (8M rows at D = 256); in int32
    # the product wrapped and the access went out of bounds (found in review).
    d64 = d.to(tl.int64)
    a_live = (r_ok & (wa > 0.0))[:, None] & d_ok  # [BLOCK_R, HEAD_DIM_PAD]
    b_live = (r_ok & (wb > 0.0))[:, None] & d_ok
    oa = tl.load(oa_ptr + (n * stride_oan + h * stride_oah)[:, None] + d64[None, :] * stride_oad, mask=a_live, other=0.0)
    ob = tl.load(ob_ptr + (n * stride_obn + h * stride_obh)[:, None] + d64[None, :] * stride_obd, mask=b_live, other=0.0)
    o = (to_fp32(oa) * (wa * inv)[:, None]) + (to_fp32(ob) * (wb * inv)[:, None])  # exact, bf16 subnormals too
    o_off = (n * stride_on + h * stride_oh)[:, None] + d64[None, :] * stride_od
    tl.store(o_ptr + o_off, narrow(o, o_ptr.dtype.element_ty), mask=r_ok[:, None] & d_ok)
    lse = tl.where(has_key, m_safe + tl.log(tl.where(has_key, tot, 1.0)), float("-inf"))
    tl.store(l_ptr + n * stride_ln + h * stride_lh, lse, mask=r_ok)


def _pick_config(head_dim: int) -> dict:
    """Tile of one merge launch (pure; ``kvarena check`` compiles what it returns)."""
    return row_tile(head_dim)


def merge_attention_states_fwd(out_a, lse_a, out_b, lse_b, out, lse) -> None:
    """Merge two partial attentions into ``out [N, H, D]`` and ``lse [N, H]`` fp32 (in place)."""
    n, h, head_dim = out_a.shape
    if n == 0 or h == 0:
        return
    cfg = _pick_config(head_dim)
    n_rows = n * h
    grid = (triton.cdiv(n_rows, cfg["BLOCK_R"]),)
    _merge_states_kernel[grid](
        out_a, lse_a, out_b, lse_b, out, lse,
        *out_a.stride(), *out_b.stride(), *out.stride(),
        *lse_a.stride(), *lse_b.stride(), *lse.stride(),
        n_rows, h,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=cfg["HEAD_DIM_PAD"], BLOCK_R=cfg["BLOCK_R"],
        num_warps=cfg["num_warps"],
    )
