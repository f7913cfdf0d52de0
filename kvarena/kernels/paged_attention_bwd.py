"""Backward of block-table attention (FlashAttention-2 style: recompute, no score buffer).

The forward saved ``out`` and its fp32 ``lse``; the backward recomputes the probabilities
tile by tile from them, so nothing of size ``[queries x keys]`` is ever stored.

Two kernels, no atomics (deterministic by construction):

* ``_attn_bwd_dq_kernel``: one program per (q tile, sequence, kv head), the forward's
  GQA row packing (rows ``j = position * GROUP + head``). It walks every key the tile's
  rows can see (the sink range, then the window range, through the block table, then the
  step's own keys when they are a second source) and accumulates
  ``dQ = scale * sum_keys dS K`` with ``dS = P * (dP - Delta)``, ``dP = dO V^T``.
* ``_attn_bwd_dkdv_kernel``: one program per (key tile, sequence, kv head) of the step's
  own keys, the tensors given in the call (the history read from the arena is a
  constant). It walks the sequence's query rows of the kv head's whole group and
  accumulates ``dV = P^T dO`` and ``dK = scale * dS^T Q``. The own keys are placed
  (:mod:`kvarena.kernels.placement`) either at the query rows (stored at the rows'
  positions ``L - q_len + i``: the paged pool's new tokens, a slab chunk committed in the
  same call) or after the history (a denoising step's own keys, visible to every query).

``Delta = rowsum(dO * O) - dlse`` (a gradient on the returned lse adds ``P * dlse`` to
``dS``: ``d lse / d s = P``). Softcap multiplies ``dS`` by ``1 - tanh^2``. A row that saw
no key (``lse = -inf``) has ``P = 0`` everywhere: zero gradient, no NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvarena.kernels._common import LOG2E, head_dim_pad, interpreting
from kvarena.kernels.arch import Arch, launch_arch
from kvarena.kernels.attn_math import _tanh, _upcast
from kvarena.kernels.attn_plan import _NO_WINDOW
from kvarena.kernels.key_range import row_bounds, sees, tile_key_range, virtual_tile
from kvarena.kernels.placement import OWN_AFTER_HISTORY, OWN_AT_QUERIES
from kvarena.kernels.widen import narrow


@triton.jit
def _probs(q, kt, lse2, vis, scale_log2, softcap_inv, softcap_log2, HAS_SOFTCAP: tl.constexpr):
    """Recomputed probabilities ``P`` [BLOCK_M, BLOCK_N] and the softcap's ``tanh`` (or 0)."""
    s = tl.dot(q, kt, input_precision="ieee")  # [BLOCK_M, BLOCK_N]
    if HAS_SOFTCAP:
        th = _tanh(s * softcap_inv)
        s2 = softcap_log2 * th
    else:
        th = s * 0.0
        s2 = s * scale_log2
    p = tl.where(vis, tl.exp2(s2 - lse2[:, None]), 0.0)
    return p, th


@triton.jit
def _dscores(p, th, do, vt, delta, HAS_SOFTCAP: tl.constexpr):
    """``dS`` [BLOCK_M, BLOCK_N] w.r.t. the scaled scores (before ``scale``)."""
    dp = tl.dot(do, vt, input_precision="ieee")  # [BLOCK_M, BLOCK_N]
    ds = p * (dp - delta[:, None])
    if HAS_SOFTCAP:
        ds = ds * (1.0 - th * th)
    return ds


@triton.jit
def _load_rows(q_ptr, do_ptr, lse_ptr, delta_ptr, j, n_rows, q_start, kvh, num_kv_heads, stride_qt, stride_qh,
               d, d_ok, GROUP: tl.constexpr, UPCAST: tl.constexpr):
    """A tile of packed (position, head-in-group) rows ``j`` of kv head ``kvh``: q and dO
    ``[BLOCK_M, HEAD_DIM_PAD]``, the exp2-domain lse and Delta ``[BLOCK_M]``, and the rows'
    validity, position index and element offsets (q, dO and dQ share one layout)."""
    row_ok = j < n_rows
    pos_idx = j // GROUP
    tok = (q_start + pos_idx).to(tl.int64)
    head = (kvh * GROUP + j % GROUP).to(tl.int64)
    row_off = tok * stride_qt + head * stride_qh  # [BLOCK_M]
    lm = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + row_off[:, None] + d[None, :], mask=lm, other=0.0)
    do = tl.load(do_ptr + row_off[:, None] + d[None, :], mask=lm, other=0.0)
    q, do = _upcast(q, UPCAST=UPCAST), _upcast(do, UPCAST=UPCAST)
    stat_off = tok * (num_kv_heads * GROUP) + head  # into the contiguous [total_q, H_q] lse / Delta
    lse = tl.load(lse_ptr + stat_off, mask=row_ok, other=float("-inf"))
    # A row that saw no key: lse = -inf; +inf makes every recomputed P exactly 0.
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(delta_ptr + stat_off, mask=row_ok, other=0.0)
    return row_ok, pos_idx, row_off, q, do, lse2, delta


@triton.jit
def _attn_bwd_dq_kernel(
    q_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
    k_ptr, v_ptr, block_table_ptr, seq_lens_ptr, cu_q_ptr, kv_start_ptr,
    own_k_ptr, own_v_ptr,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_own_b, stride_own_t, stride_own_h,
    stride_bt,
    scale, scale_log2, softcap_inv, softcap_log2,
    block_size, chunk_size, window_left, sink_tokens, own_len,
    num_kv_heads, num_q_tiles,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KV_START: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
    HAS_OWN: tl.constexpr,
):
    pid = tl.program_id(0)
    q_tile_idx = pid % num_q_tiles
    bh = pid // num_q_tiles
    b = bh // num_kv_heads
    kvh = bh % num_kv_heads

    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    m0 = q_tile_idx * BLOCK_M
    n_rows = q_len * GROUP
    if m0 >= n_rows:
        return
    kv_lo = tl.load(kv_start_ptr + b) if HAS_KV_START else 0

    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    j = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M] (position, head-in-group) rows
    row_ok, pos_idx, row_off, q, do, lse2, delta = _load_rows(
        q_ptr, do_ptr, lse_ptr, delta_ptr, j, n_rows, q_start, kvh, num_kv_heads, stride_qt, stride_qh, d, d_ok,
        GROUP, UPCAST)
    pos_base = seq_len - q_len
    q_pos = pos_base + pos_idx  # [BLOCK_M]
    row_hi, row_lo = row_bounds(q_pos, seq_len, chunk_size, window_left, CAUSAL)

    q_pos_min = pos_base + m0 // GROUP
    q_pos_max = pos_base + (tl.minimum(m0 + BLOCK_M, n_rows) - 1) // GROUP
    lo, hi, sink_hi, _, _ = tile_key_range(q_pos_min, q_pos_max, seq_len, kv_lo, chunk_size, window_left,
                                           sink_tokens, CAUSAL)
    sink_base = (kv_lo // BLOCK_N) * BLOCK_N
    main_base = (lo // BLOCK_N) * BLOCK_N
    n_sink = tl.where(sink_hi > kv_lo, tl.cdiv(sink_hi - sink_base, BLOCK_N), 0)
    n_main = tl.where(hi > lo, tl.cdiv(hi - main_base, BLOCK_N), 0)

    bt_row = block_table_ptr + b.to(tl.int64) * stride_bt
    k_head = k_ptr + kvh.to(tl.int64) * stride_kh
    v_head = v_ptr + kvh.to(tl.int64) * stride_vh
    n_off = tl.arange(0, BLOCK_N)
    dq = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for i in range(0, n_sink + n_main):
        t0, key_lo, key_hi = virtual_tile(i, n_sink, sink_base, main_base, kv_lo, sink_hi, lo, hi, BLOCK_N)
        t = t0 + n_off  # [BLOCK_N]
        key_ok = (t >= key_lo) & (t < key_hi)
        blk = tl.load(bt_row + t // block_size, mask=key_ok, other=0).to(tl.int64)
        row_in_blk = (t % block_size).to(tl.int64)
        k_off = blk * stride_kb + row_in_blk * stride_kt  # [BLOCK_N]
        v_off = blk * stride_vb + row_in_blk * stride_vt
        km = key_ok[None, :] & d_ok[:, None]
        kt = tl.load(k_head + k_off[None, :] + d[:, None], mask=km, other=0.0)  # [HEAD_DIM_PAD, BLOCK_N]
        vt = tl.load(v_head + v_off[None, :] + d[:, None], mask=km, other=0.0)
        kt, vt = _upcast(kt, UPCAST=UPCAST), _upcast(vt, UPCAST=UPCAST)
        vis = key_ok[None, :] & sees(t, row_hi, row_lo, sink_tokens)
        p, th = _probs(q, kt, lse2, vis, scale_log2, softcap_inv, softcap_log2, HAS_SOFTCAP)
        ds = _dscores(p, th, do, vt, delta, HAS_SOFTCAP)
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision="ieee")
    if HAS_OWN:
        own_k_head = own_k_ptr + b.to(tl.int64) * stride_own_b + kvh.to(tl.int64) * stride_own_h
        own_v_head = own_v_ptr + b.to(tl.int64) * stride_own_b + kvh.to(tl.int64) * stride_own_h
        for t0 in range(0, own_len, BLOCK_N):
            t = t0 + n_off
            key_ok = t < own_len
            km = key_ok[None, :] & d_ok[:, None]
            off = t.to(tl.int64) * stride_own_t
            kt = tl.load(own_k_head + off[None, :] + d[:, None], mask=km, other=0.0)
            vt = tl.load(own_v_head + off[None, :] + d[:, None], mask=km, other=0.0)
            kt, vt = _upcast(kt, UPCAST=UPCAST), _upcast(vt, UPCAST=UPCAST)
            vis = key_ok[None, :] & row_ok[:, None]
            p, th = _probs(q, kt, lse2, vis, scale_log2, softcap_inv, softcap_log2, HAS_SOFTCAP)
            ds = _dscores(p, th, do, vt, delta, HAS_SOFTCAP)
            dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision="ieee")
    dq = dq * scale
    tl.store(dq_ptr + row_off[:, None] + d[None, :], narrow(dq, dq_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _attn_bwd_dkdv_kernel(
    q_ptr, do_ptr, lse_ptr, delta_ptr,
    own_k_ptr, own_v_ptr, dk_ptr, dv_ptr,
    seq_lens_ptr, cu_q_ptr, kv_start_ptr,
    stride_qt, stride_qh,
    stride_own_b, stride_own_t, stride_own_h,
    scale, scale_log2, softcap_inv, softcap_log2,
    chunk_size, window_left, sink_tokens, own_len,
    num_kv_heads, num_k_tiles,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KV_START: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
    OWN_PLACEMENT: tl.constexpr,
):
    pid = tl.program_id(0)
    k_tile_idx = pid % num_k_tiles
    bh = pid // num_k_tiles
    b = bh // num_kv_heads
    kvh = bh % num_kv_heads

    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    n0 = k_tile_idx * BLOCK_N
    if OWN_PLACEMENT == 0:
        # OWN_AT_QUERIES, the rows' own keys: key i sits at position L - q_len + i, packed like q.
        k_len = q_len
        key_base = q_start.to(tl.int64) * stride_own_t
        kpos0 = seq_len - q_len
    else:
        # OWN_AFTER_HISTORY: a second source of own_len keys after the history, visible to
        # every query.
        k_len = own_len
        key_base = b.to(tl.int64) * stride_own_b
        kpos0 = seq_len
    if n0 >= k_len:
        return
    kv_lo = tl.load(kv_start_ptr + b) if HAS_KV_START else 0

    n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key index in the own keys
    key_ok = n < k_len
    t = kpos0 + n  # [BLOCK_N] key positions
    if OWN_PLACEMENT == 0:
        key_ok = key_ok & (t >= kv_lo)
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    key_off = key_base + n.to(tl.int64) * stride_own_t + kvh.to(tl.int64) * stride_own_h  # [BLOCK_N]
    km = key_ok[None, :] & d_ok[:, None]
    kt = tl.load(own_k_ptr + key_off[None, :] + d[:, None], mask=km, other=0.0)  # [HEAD_DIM_PAD, BLOCK_N]
    vt = tl.load(own_v_ptr + key_off[None, :] + d[:, None], mask=km, other=0.0)
    kt, vt = _upcast(kt, UPCAST=UPCAST), _upcast(vt, UPCAST=UPCAST)

    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_PAD], tl.float32)
    n_rows = q_len * GROUP
    m_off = tl.arange(0, BLOCK_M)
    for m0 in range(0, n_rows, BLOCK_M):
        row_ok, pos_idx, _, q, do, lse2, delta = _load_rows(
            q_ptr, do_ptr, lse_ptr, delta_ptr, m0 + m_off, n_rows, q_start, kvh, num_kv_heads, stride_qt,
            stride_qh, d, d_ok, GROUP, UPCAST)
        vis = row_ok[:, None] & key_ok[None, :]
        if OWN_PLACEMENT == 0:
            row_hi, row_lo = row_bounds(seq_len - q_len + pos_idx, seq_len, chunk_size, window_left, CAUSAL)
            vis = vis & sees(t, row_hi, row_lo, sink_tokens)
        p, th = _probs(q, kt, lse2, vis, scale_log2, softcap_inv, softcap_log2, HAS_SOFTCAP)
        ds = _dscores(p, th, do, vt, delta, HAS_SOFTCAP)
        dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision="ieee")  # [BLOCK_N, HEAD_DIM_PAD]
        dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision="ieee")
    dk = dk * scale
    out_off = key_off[:, None] + d[None, :]
    # Every own key gets a row, zeros for one no query sees (a seq_len-0 padding row of a
    # CUDA-graph batch, a key below kv_start): dk/dv are allocated uninitialized.
    om = (n < k_len)[:, None] & d_ok[None, :]
    tl.store(dk_ptr + out_off, narrow(dk, dk_ptr.dtype.element_ty), mask=om)
    tl.store(dv_ptr + out_off, narrow(dv, dv_ptr.dtype.element_ty), mask=om)


def pick_bwd_config(head_dim: int, elem_bytes: int, arch: Arch | None = None) -> dict:
    """Tiles and warps of both backward kernels (a pure function; ``kvarena check`` compiles it).

    The dQ program keeps q, dO and the fp32 dQ accumulator ``[BLOCK_M, HEAD_DIM_PAD]`` in
    registers plus two fp32 ``[BLOCK_M, BLOCK_N]`` tiles (P, dS); the dK/dV program two
    fp32 ``[BLOCK_N, HEAD_DIM_PAD]`` accumulators and the K/V tile. Found by compiling for
    sm_80 and sm_90a with every mask flag on (0 spills everywhere): fp16/bf16 at D <= 128
    32 x 32 over 4 warps (177-209 registers; 64 x 32 spills 56 bytes in dK/dV on sm_90a);
    D = 256 32 x 32 over 8 warps (176-251); fp32 (IEEE FMA dots) 16 x 16 over 8 warps
    (60-75). On AMD (``arch.is_amd``) D = 256 takes 32 x 16 over 8 waves (148-154 VGPRs): 32 x 32
    spilt 100-420 B on gfx942 and gfx950. Under the interpreter 16 x 16 keeps CPU tests fast.
    """
    d_pad = head_dim_pad(head_dim)
    maxnreg = 255  # stated for the tensor-core configs: left alone, ptxas capped dK/dV at
    # 168 registers (3 CTAs per SM) on sm_80 and spilt 4 bytes; fp32 keeps ptxas's choice.
    if interpreting():
        bm, bn, warps, stages, maxnreg = 16, 16, 4, 1, None
    elif elem_bytes >= 4:  # sm_100a: capped at 128 (ptxas's own 64 spilt 4 B in dK/dV)
        bm, bn, warps, stages = 16, 16, 8, 1
        maxnreg = 128 if arch is not None and arch.mma == "tcgen05" else None
    elif d_pad > 128 and arch is not None and arch.is_amd:
        bm, bn, warps, stages, maxnreg = 32, 16, 8, 1, None
    elif d_pad > 128:
        bm, bn, warps, stages = 32, 32, 8, 1
    else:
        bm, bn, warps, stages = 32, 32, 4, 2
    return dict(BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM_PAD=d_pad, num_warps=warps, num_stages=stages, maxnreg=maxnreg)


@dataclass(frozen=True)
class _BackwardLaunch:
    """The host half of both backward launches: tiles, constexprs and scalar arguments."""

    cfg: dict  # pick_bwd_config
    constexprs: dict  # shared by both kernels, num_warps / num_stages / maxnreg included
    scale: float
    softcap_inv: float
    softcap_log2: float
    chunk: int  # chunk_size of the causal rule, capped (1: plain causal)
    window: int  # window_left, capped at _NO_WINDOW (the cap when there is no window)


def _plan_backward(q: torch.Tensor, h_kv: int, has_kv_start: bool, spec) -> _BackwardLaunch:
    d = q.shape[2]
    cfg = pick_bwd_config(d, q.element_size(), launch_arch(q))
    scale = spec.scale_for(d)
    softcap = spec.softcap
    constexprs = dict(GROUP=q.shape[1] // h_kv, HEAD_DIM=d, HEAD_DIM_PAD=cfg["HEAD_DIM_PAD"],
                      BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], CAUSAL=spec.causal, HAS_KV_START=has_kv_start,
                      HAS_SOFTCAP=bool(softcap), UPCAST=interpreting() and q.dtype != torch.float32,
                      num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if cfg["maxnreg"] is not None:
        constexprs["maxnreg"] = cfg["maxnreg"]
    return _BackwardLaunch(
        cfg, constexprs, scale,
        softcap_inv=scale / softcap if softcap else 0.0, softcap_log2=softcap * LOG2E if softcap else 0.0,
        chunk=1 if spec.chunk_size is None else min(spec.chunk_size, _NO_WINDOW),
        window=_NO_WINDOW if spec.window_left is None else min(spec.window_left, _NO_WINDOW),
    )


def paged_attention_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_start: torch.Tensor | None,
    *,
    spec,
    max_seqlen_q: int,
    own_k: torch.Tensor | None = None,
    own_v: torch.Tensor | None = None,
    placement: int = OWN_AT_QUERIES,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(dq, dk, dv)`` of block-table attention; ``dk, dv`` for the own keys only.

    Parameters
    ----------
    do, q, out : ``[total_q, H_q, D]``; ``lse``, ``dlse`` : fp32 ``[total_q, H_q]``.
    k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start
        As the forward (already validated; the cache holds the history and, with
        ``OWN_AT_QUERIES``, the own keys at the rows' positions).
    own_k, own_v : Tensor or None
        The step's own keys, given in the call (None: none, dk and dv are None), placed as
        ``placement`` says (:mod:`kvarena.kernels.placement`): ``OWN_AT_QUERIES``
        ``[total_q, H_kv, D]``, key i of sequence b at position ``L - q_len + i``;
        ``OWN_AFTER_HISTORY`` ``[B, T, H_kv, D]`` after the history (a second key source
        of the forward, visible to every query).
    """
    b_count, h_kv = seq_lens.shape[0], k_cache.shape[2]
    bwd = _plan_backward(q, h_kv, kv_start is not None, spec)
    q_c, do_c = q.contiguous(), do.contiguous()
    delta = (do_c.float() * out.float()).sum(-1)  # [total_q, H_q]
    if dlse is not None:
        delta = delta - dlse.float()
    lse_c = lse.float().contiguous()
    dq = torch.empty_like(q_c)
    if own_k is not None:
        own_k, own_v = own_k.contiguous(), own_v.contiguous()
    after = own_k is not None and placement == OWN_AFTER_HISTORY
    own_len = own_k.shape[1] if after else 0
    dq_k, dq_v = (own_k, own_v) if after else (None, None)  # no own-key pointers without HAS_OWN
    own_k_strides = own_k.stride()[:3] if after else (0, 0, 0)
    num_q_tiles = triton.cdiv(max(max_seqlen_q, 1) * bwd.constexprs["GROUP"], bwd.cfg["BLOCK_M"])
    run = q.device.type != "meta"  # meta: a dry run (the allocations, no kernel)
    if run:
        _attn_bwd_dq_kernel[(num_q_tiles * b_count * h_kv,)](
            q_c, do_c, lse_c, delta, dq,
            k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start,
            dq_k, dq_v,
            q_c.stride(0), q_c.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            *own_k_strides,
            block_table.stride(0),
            bwd.scale, bwd.scale * LOG2E, bwd.softcap_inv, bwd.softcap_log2,
            k_cache.shape[1], bwd.chunk, bwd.window, spec.sink_tokens, own_len,
            h_kv, num_q_tiles,
            HAS_OWN=after, **bwd.constexprs,
        )
    if own_k is None:
        return dq, None, None
    dk, dv = torch.empty_like(own_k), torch.empty_like(own_v)
    # Strides of the own keys as (sequence, key, head): packed rows at the queries have no
    # sequence stride.
    own_strides = own_k.stride()[:3] if after else (0, own_k.stride(0), own_k.stride(1))
    num_k_tiles = triton.cdiv(max(own_len if after else max_seqlen_q, 1), bwd.cfg["BLOCK_N"])
    if run:
        _attn_bwd_dkdv_kernel[(num_k_tiles * b_count * h_kv,)](
            q_c, do_c, lse_c, delta,
            own_k, own_v, dk, dv,
            seq_lens, cu_seqlens_q, kv_start,
            q_c.stride(0), q_c.stride(1),
            *own_strides,
            bwd.scale, bwd.scale * LOG2E, bwd.softcap_inv, bwd.softcap_log2,
            bwd.chunk, bwd.window, spec.sink_tokens, own_len,
            h_kv, num_k_tiles,
            OWN_PLACEMENT=OWN_AFTER_HISTORY if after else OWN_AT_QUERIES, **bwd.constexprs,
        )
    return dq, dk, dv
