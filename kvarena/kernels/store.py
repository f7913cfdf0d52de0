"""Scatter new K/V rows into a paged/slab cache: token i -> block s // block_size, row s % block_size.

Tile ``[BLOCK_R, HEAD_DIM_PAD]`` over rows ``r = token * H_kv + head``, so one program
moves several tokens' heads at once whatever H_kv is (decode writes B x H_kv rows of D
elements: at B = 8, H_kv = 8, D = 128 that is 64 rows, a couple of programs). A slot < 0
masks its row's loads and stores, so padded tokens of a CUDA-graph batch touch nothing.
All cache offsets are int64: ``block * stride`` passes 2**31 in an arena of a few GiB.

fp8 caches (``QUANT``): 1 = per-(token, kv head) scales, computed here from the row's
amax (``max(amax * fp32(1/448), 2**-126)``, NaN for a row holding a NaN) and stored beside
the bytes; 2 = one static scale read from a 0-dim tensor. Values are divided by the scale
(IEEE division) and rounded by ``kernels.fp8``'s explicit helper, bit-equal to torch's
cast of the clamped quotient. Under the interpreter bf16 rows are widened to fp32 through
their bits (its own cast is wrong for subnormals: ``kernels.widen``); compiled kernels cast
as before.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvarena.kernels._common import row_tile
from kvarena.kernels.fp8 import _fp8e4m3_bits
from kvarena.kernels.widen import to_fp32 as _to_fp32

# What a store does to the values (QUANT): copy them, or quantize to fp8 with per-(token,
# kv head) scales computed here, or with one static scale. The scale rule's constants
# (fp32(1/448), 2**-126) are kvarena.attention.fp8's, so both paths store equal bytes.
QUANT_NONE, QUANT_TOKEN, QUANT_STATIC = 0, 1, 2


@triton.jit
def _quantize_rows(x, live, sc_ptr, sc_off, QUANT: tl.constexpr):
    """fp8 bytes of rows ``x [BLOCK_R, HEAD_DIM_PAD]`` (padding columns hold 0)."""
    x = _to_fp32(x)
    if QUANT == 1:
        nan = x != x
        amax = tl.max(tl.where(nan, 0.0, tl.abs(x)), 1)  # [BLOCK_R]
        scale = tl.maximum(amax * 0.002232142857142857, 1.1754943508222875e-38)  # fp32(1/448), 2**-126
        scale = tl.where(tl.max(nan.to(tl.int32), 1) > 0, float("nan"), scale)
        tl.store(sc_ptr + sc_off, scale, mask=live)
        y = tl.fdiv(x, scale[:, None], ieee_rounding=True)
    else:
        y = tl.fdiv(x, tl.load(sc_ptr), ieee_rounding=True)
    return _fp8e4m3_bits(y)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, ks_ptr, vs_ptr,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_cb, stride_ct, stride_ch,
    stride_db, stride_dt, stride_dh,
    stride_sb, stride_st, stride_sh,
    stride_wb, stride_wt, stride_wh,
    n_rows, num_heads, block_size,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    QUANT: tl.constexpr,
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
    if QUANT != 0:
        # [BLOCK_R] offsets of the rows' K and V scales (read-only when static).
        k = _quantize_rows(k, live, ks_ptr, blk * stride_sb + row * stride_st + head * stride_sh, QUANT)
        v = _quantize_rows(v, live, vs_ptr, blk * stride_wb + row * stride_wt + head * stride_wh, QUANT)
    tl.store(k_cache_ptr + k_dst[:, None] + d[None, :], k, mask=mask)
    tl.store(v_cache_ptr + v_dst[:, None] + d[None, :], v, mask=mask)


def _pick_config(head_dim: int) -> dict:
    """Tile of one store launch (pure; ``kvarena check`` compiles what it returns)."""
    return row_tile(head_dim)


@dataclass(frozen=True)
class _StoreLaunch:
    """The grid and every argument of a store launch but its pointers (:func:`_store_launch`)."""

    grid: tuple[int]
    kwargs: dict


@functools.lru_cache(maxsize=256)
def _store_launch(n_rows: int, h_kv: int, head_dim: int, k_strides: tuple, v_strides: tuple, c_strides: tuple,
                  d_strides: tuple, block_size: int, quant: int, sk: tuple, sv: tuple) -> _StoreLaunch:
    """The launch of storing ``n_rows`` (token, kv head) rows into caches of these strides:
    a pure function of host values, memoized (every layer of a step stores alike)."""
    cfg = _pick_config(head_dim)
    return _StoreLaunch((triton.cdiv(n_rows, cfg["BLOCK_R"]),), dict(
        stride_kn=k_strides[0], stride_kh=k_strides[1], stride_vn=v_strides[0], stride_vh=v_strides[1],
        stride_cb=c_strides[0], stride_ct=c_strides[1], stride_ch=c_strides[2],
        stride_db=d_strides[0], stride_dt=d_strides[1], stride_dh=d_strides[2],
        stride_sb=sk[0], stride_st=sk[1], stride_sh=sk[2], stride_wb=sv[0], stride_wt=sv[1], stride_wh=sv[2],
        n_rows=n_rows, num_heads=h_kv, block_size=block_size,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=cfg["HEAD_DIM_PAD"], BLOCK_R=cfg["BLOCK_R"], QUANT=quant,
        num_warps=cfg["num_warps"],
    ))


def store_kv_fwd(k, v, k_cache, v_cache, slot_mapping, kv_scales=None) -> None:
    """Write ``k, v [N, H_kv, D]`` into the caches at ``slot_mapping`` (validated by ops).

    ``kv_scales = (k_scale, v_scale)`` for fp8 caches: ``[num_blocks, block_size, H_kv]``
    fp32 (written) or 0-dim static scales (read).
    """
    n, h_kv, head_dim = k.shape
    if n == 0 or h_kv == 0:
        return
    quant, ks, vs = QUANT_NONE, None, None  # no scale pointers without QUANT
    sk = sv = (0, 0, 0)
    if kv_scales is not None:
        ks, vs = kv_scales
        quant = QUANT_TOKEN if ks.dim() else QUANT_STATIC
        if quant == QUANT_TOKEN:
            sk, sv = ks.stride(), vs.stride()
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    slots = slot_mapping.contiguous()  # read with unit stride; free when already contiguous
    launch = _store_launch(n * h_kv, h_kv, head_dim, k.stride(), v.stride(), k_cache.stride(), v_cache.stride(),
                           k_cache.shape[1], quant, sk, sv)
    _store_kv_kernel[launch.grid](k_ptr=k, v_ptr=v, k_cache_ptr=k_cache, v_cache_ptr=v_cache, slot_ptr=slots,
                                  ks_ptr=ks, vs_ptr=vs, **launch.kwargs)
