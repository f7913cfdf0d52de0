"""Scatter new K/V rows into a paged/slab cache: token i -> block s // block_size, row s % block_size.

Tile ``[BLOCK_R, HEAD_DIM_PAD]`` over rows ``r = token * H_kv + head``, so one program
moves several tokens' heads at once whatever H_kv is (decode writes B x H_kv rows of D
elements: at B = 8, H_kv = 8, D = 128 that is 64 rows, a couple of programs). A slot < 0
masks its row's loads and stores, so padded tokens of a CUDA-graph batch touch nothing.
All cache offsets are int64: ``block * stride`` passes 2**31 in an arena of a few GiB.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvarena.kernels._common import row_tile

# ----------------------------------------------------------------------------- kernels


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_cb, stride_ct, stride_ch,
    stride_db, stride_dt, stride_dh,
    n_rows, num_heads, block_size,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    r_ok = r < n_rows
    tok = r // num_heads
    head = (r % num_heads).to(tl.int64)
    slot = tl.load(slot_ptr + tok, mask=r_ok, other=-1).to(tl.int64)  # int32 or int64 slots
    live = r_ok & (slot >= 0)
    slot = tl.where(live, slot, 0)
    blk = slot // block_size
    row = slot % block_size
    d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    mask = live[:, None] & (d < HEAD_DIM)[None, :]  # [BLOCK_R, HEAD_DIM_PAD]
    tok64 = tok.to(tl.int64)
    k = tl.load(k_ptr + (tok64 * stride_kn + head * stride_kh)[:, None] + d[None, :], mask=mask)
    v = tl.load(v_ptr + (tok64 * stride_vn + head * stride_vh)[:, None] + d[None, :], mask=mask)
    k_dst = blk * stride_cb + row * stride_ct + head * stride_ch  # [BLOCK_R] int64
    v_dst = blk * stride_db + row * stride_dt + head * stride_dh
    tl.store(k_cache_ptr + k_dst[:, None] + d[None, :], k, mask=mask)
    tl.store(v_cache_ptr + v_dst[:, None] + d[None, :], v, mask=mask)


# ----------------------------------------------------------------------------- launcher


def _pick_config(head_dim: int) -> dict:
    """Tile of one store launch (pure; ``kvarena check`` compiles what it returns)."""
    return row_tile(head_dim)


def store_kv_fwd(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Write ``k, v [N, H_kv, D]`` into the caches at ``slot_mapping`` (validated by ops)."""
    n, h_kv, head_dim = k.shape
    if n == 0 or h_kv == 0:
        return
    cfg = _pick_config(head_dim)
    slots = slot_mapping.contiguous()  # read with unit stride; free when already contiguous
    n_rows = n * h_kv
    grid = (triton.cdiv(n_rows, cfg["BLOCK_R"]),)
    _store_kv_kernel[grid](
        k, v, k_cache, v_cache, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        n_rows, h_kv, k_cache.shape[1],
        HEAD_DIM=head_dim, HEAD_DIM_PAD=cfg["HEAD_DIM_PAD"], BLOCK_R=cfg["BLOCK_R"],
        num_warps=cfg["num_warps"],
    )
