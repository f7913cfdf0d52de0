"""Block-table gather attention (decode, chunked prefill, whole-chunk queries) and split-KV.

One kernel family serves the paged pool (16-token pages) and the slab pool (a slab is one
big page of up to ~12k tokens); ``block_size`` need not be a power of two nor divide the
key tile.

Key addressing
--------------
* Blocks of at least one key tile (slabs, 64-token pages at 16 bits) run contiguous
  inner loops from the block's base pointers: one block-table read per block.
* Smaller pages (the page loop): a power-of-two page size is a constexpr, so a key's page
  and row are a shift and a mask. The tile's pages' block ids are loaded once per page
  and broadcast to the page's keys; K is loaded in V's ``[keys, dims]`` layout
  and transposed for the dot, so when K and V share strides (``SAME_KV_STRIDES``, the
  arena's views) one offset per key serves both. Offsets are int32 unless the cache view
  spans more than ``2**31`` elements (``WIDE_OFFSETS``, e.g. any arena region past 4 GiB of
  bf16, since a layer's view spans the region): then each key gets its page's 64-bit block
  pointer (an unsigned 32 x 32 -> 64-bit multiply) and keeps an int32 row offset. Keys of a tile outside its key
  range read the range's nearest key (a written slot) instead of taking masked loads, and
  their scores are masked.

Tiles
-----
* Query tile ``[BLOCK_M, HEAD_DIM_PAD]``: its rows are *(query position, head-in-group)*
  pairs of ONE kv head, flattened as ``j = position * GROUP + head`` (GQA packing). A
  decode step of a 32/8-head model fills 4 rows of one tile per kv head and reads each K/V
  byte once for the 4 heads, instead of once per query head.
* Key tile ``[BLOCK_N]`` keys, aligned to absolute multiples of ``BLOCK_N`` (so the
  summation order of a row does not depend on which tile its query landed in). Only the
  tiles that the masks leave visible to at least one row are visited: the sink range
  ``[kv_start, sink_hi)`` first, then the window range ``[lo, hi)``.
* Online softmax in the exp2 domain, fp32 accumulation; fp16/bf16 dots take the input
  dtype (tensor cores) and fp32 dots are full IEEE fp32 (no TF32).

Grid: ``(q_tiles * B * H_kv, num_splits)``. Axis 0 enumerates q tiles fastest, heaviest
(last) tile first so that causal prefill's long tiles start early; a program whose tile
lies past its sequence's queries exits at once. Axis 1 splits the key range (flash-
decoding): each split writes a normalized fp32 partial and its log2-sum-exp to scratch and
``_split_reduce_kernel`` combines them.

The modules, by job: this one holds the kernel and its launcher; :mod:`attn_math` the
per-tile math (scores, online softmax, operands, RoPE); :mod:`attn_tiles` the key loops
(block loop, page loop, each run by stage); :mod:`attn_plan` the launch plan (tile, path,
splits, constexprs, which pointers are passed); :mod:`attn_configs` the tile per target;
:mod:`split_reduce` the split-KV reduce.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvarena.kernels.arch import launch_arch
from kvarena.kernels.attn_args import (
    LAYOUT_LIMIT,
    Outputs,
    layer_kwargs,
    layout_args,
    layout_key,
    outputs,
)
from kvarena.kernels.attn_math import (
    OnlineSoftmax,
    RopeTable,
    ScoreScale,
    _rope_index,
    _rotate,
    _upcast,
)
from kvarena.kernels.attn_plan import AttentionLaunch, launch_shape, plan_attention
from kvarena.kernels.attn_tiles import (
    STAGE_BOUNDARY,
    STAGE_INTERIOR,
    BlockKV,
    KeyRanges,
    PagedKV,
    RowBounds,
    TileSpan,
    _block_tiles,
    _page_tiles,
    _range_tiles,
)
from kvarena.kernels.fp8 import _f16_queries
from kvarena.kernels.key_range import row_bounds, tile_key_range
from kvarena.kernels.split_reduce import split_reduce
from kvarena.kernels.widen import narrow

# ----------------------------------------------------------------------------- kernel


@triton.jit
def _paged_attn_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
    block_table_ptr, seq_lens_ptr, cu_q_ptr, kv_start_ptr,
    own_k_ptr, own_v_ptr, sink_ptr, ks_ptr, vs_ptr, cos_ptr, sin_ptr, qpos_ptr, kshift_ptr,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ksb, stride_kst, stride_ksh,
    stride_vsb, stride_vst, stride_vsh,
    stride_own_kb, stride_own_kt, stride_own_kh,
    stride_own_vb, stride_own_vt, stride_own_vh,
    stride_os, stride_ot, stride_oh, stride_od,
    stride_ls, stride_lt, stride_lh,
    stride_bt, stride_rp, stride_rb,
    scale_log2, softcap_inv, softcap_log2,
    block_size, chunk_size, window_left, sink_tokens, own_len,
    num_kv_heads, num_q_tiles, tiles_per_split, n_pos,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KV_START: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    GUARD_NONFINITE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr,
    SAME_KV_STRIDES: tl.constexpr,
    LARGE_BLOCKS: tl.constexpr,
    HAS_OWN: tl.constexpr,
    HAS_SINK_LOGITS: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_Q_POS: tl.constexpr,
    ROPE_K_SHIFT: tl.constexpr,
    PAGE_INTERIOR: tl.constexpr,
):
    pid = tl.program_id(0)
    split_id = tl.program_id(1)
    num_splits = tl.num_programs(1)
    # Heaviest q tile (latest queries, most keys under causal) first.
    q_tile_idx = num_q_tiles - 1 - pid % num_q_tiles
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
    if HAS_KV_START:
        kv_lo = tl.load(kv_start_ptr + b)
    else:
        kv_lo = 0

    # ---- rows: (query position, head-in-group) pairs
    j = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_ok = j < n_rows
    pos_idx = j // GROUP
    # Row addresses = one int64 scalar base per tile + small int32 in-tile offsets: the
    # offsets stay 1 register per row through the key loop (int64 per-row offsets kept
    # alive until the epilogue cost ~80 registers and spilled at 128 x 128 on sm_80).
    # The launcher guarantees (BLOCK_M // GROUP + 1) * stride_t + GROUP * stride_h + D < 2**31.
    pos0 = m0 // GROUP
    local = pos_idx - pos0  # [BLOCK_M] in [0, BLOCK_M // GROUP]
    head_in = j % GROUP
    pos_base = seq_len - q_len
    q_pos = pos_base + pos_idx  # [BLOCK_M] key-space position of each row's query
    row_hi, row_lo = row_bounds(q_pos=q_pos, seq_len=seq_len, chunk_size=chunk_size, window_left=window_left,
                                CAUSAL=CAUSAL)

    # ---- key range of the whole tile (scalars): rows are monotone in q_pos
    q_pos_min = pos_base + m0 // GROUP
    q_pos_max = pos_base + (tl.minimum(m0 + BLOCK_M, n_rows) - 1) // GROUP
    lo, hi, sink_hi, hi_min, lo_max = tile_key_range(q_pos_min=q_pos_min, q_pos_max=q_pos_max, seq_len=seq_len,
                                                     kv_lo=kv_lo, chunk_size=chunk_size, window_left=window_left,
                                                     sink_tokens=sink_tokens, CAUSAL=CAUSAL)
    sink_base = (kv_lo // BLOCK_N) * BLOCK_N
    main_base = (lo // BLOCK_N) * BLOCK_N
    if LARGE_BLOCKS:
        # Tiles restart at every block start (no tile straddles two blocks).
        n_sink = _range_tiles(a=kv_lo, b=sink_hi, block_size=block_size, BLOCK_N=BLOCK_N)
        n_main = _range_tiles(a=lo, b=hi, block_size=block_size, BLOCK_N=BLOCK_N)
    else:
        n_sink = tl.where(sink_hi > kv_lo, tl.cdiv(sink_hi - sink_base, BLOCK_N), 0)
        n_main = tl.where(hi > lo, tl.cdiv(hi - main_base, BLOCK_N), 0)
    n_tiles = n_sink + n_main
    if HAS_OWN:
        # A denoising step's own keys (given, not stored) follow the history as one more
        # contiguous block of own_len rows per sequence, visible to every query.
        n_tiles += tl.cdiv(own_len, BLOCK_N)
    if SPLIT:
        # tiles_per_split > 0: fixed split size (deterministic); 0: divide evenly.
        tps = tl.where(tiles_per_split > 0, tiles_per_split, tl.cdiv(n_tiles, num_splits))
        i_begin = split_id * tps
        i_end = tl.minimum(i_begin + tps, n_tiles)
    else:
        i_begin = 0
        i_end = n_tiles

    # ---- query tile
    d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    d_ok = d < HEAD_DIM
    tok0 = (q_start + pos0).to(tl.int64)  # first query token of the tile
    head0 = (kvh * GROUP).to(tl.int64)  # first query head of the kv head's group
    q_base = q_ptr + tok0 * stride_qt + head0 * stride_qh
    q_off = local[:, None] * stride_qt + head_in[:, None] * stride_qh + d[None, :] * stride_qd
    q = tl.load(q_base + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, HEAD_DIM_PAD]
    rope = RopeTable(cos=cos_ptr, sin=sin_ptr, stride=stride_rp, n_pos=n_pos)
    rope_q0 = seq_len  # rotary position of the sequence's first query (ROPE)
    if ROPE != 0:
        # Queries rotate once per program: row position = the first query's table row +
        # its index. Default: the bottom-right position (seq_len - q_len), or, in a launch
        # with own keys, right after the history (the own keys are the queries' tokens).
        if ROPE_Q_POS:
            rope_q0 = tl.load(qpos_ptr + b)
        elif not HAS_OWN:
            rope_q0 = seq_len - q_len
        pd, fi, sg = _rope_index(d=d, HEAD_DIM=HEAD_DIM, ROPE=ROPE)
        q_ok = row_ok[:, None] & d_ok[None, :]
        qp = tl.load(q_base + local[:, None] * stride_qt + head_in[:, None] * stride_qh + pd[None, :] * stride_qd,
                     mask=q_ok, other=0.0)
        q = _rotate(x=q, xp=qp, pos=(rope_q0 + pos_idx)[:, None], fi=fi[None, :], sg=sg[None, :], ok=q_ok,
                    rope=rope)
        q = q.to(tl.float32 if UPCAST else q_ptr.dtype.element_ty)
    else:
        q = _upcast(x=q, UPCAST=UPCAST)
    # fp8 caches under bf16 queries take fp16 dots (the fp8 tiles widen to fp16 at a quarter
    # of bf16's cost); the own keys are bf16, so a launch with them keeps bf16 dots.
    F16_DOTS: tl.constexpr = KV_FP8 and (not HAS_OWN) and q_ptr.dtype.element_ty == tl.bfloat16
    if F16_DOTS:  # the scales become per row [BLOCK_M]: each row's gain folded in
        q, q_gain = _f16_queries(q=q, UPCAST=UPCAST)
        scale_log2 = scale_log2 * q_gain
        softcap_inv = softcap_inv * q_gain
    scale = ScoreScale(log2=scale_log2, softcap_inv=softcap_inv, softcap_log2=softcap_log2)
    rows = RowBounds(hi=row_hi, lo=row_lo, sink_tokens=sink_tokens)
    kshift_row = kshift_ptr
    if ROPE_K_SHIFT:
        kshift_row = kshift_ptr + b.to(tl.int64) * stride_rb

    bt_row = block_table_ptr + b.to(tl.int64) * stride_bt
    k_head = k_ptr + kvh.to(tl.int64) * stride_kh
    v_head = v_ptr + kvh.to(tl.int64) * stride_vh
    # fp8 caches: per-key scales at [block, row, head] (all strides 0 for a static scale).
    ks_head = ks_ptr
    vs_head = vs_ptr
    if KV_FP8:
        ks_head = ks_ptr + kvh.to(tl.int64) * stride_ksh
        vs_head = vs_ptr + kvh.to(tl.int64) * stride_vsh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    bad_w = tl.zeros([BLOCK_M], tl.float32)  # weight on visible non-finite values (GUARD_NONFINITE)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)

    if LARGE_BLOCKS:
        # block_size >= BLOCK_N (slabs: 2640-12150 rows): walk the block table in an outer
        # loop and run contiguous inner loops within each block: the boundary tiles masked,
        # the interior ones with no mask code (FlashAttention's split of masked and
        # unmasked iterations). Virtual tile numbers (for splits) run over the sink range,
        # then the main range, block by block.
        cum = n_tiles * 0
        for phase in range(2):  # 0: the sink range, 1: the main range
            r_lo = tl.where(phase == 0, kv_lo, lo)
            r_hi = tl.where(phase == 0, sink_hi, hi)
            # Sink keys are visible whatever the window: only the row ends bound them.
            fast_lo = tl.where(phase == 0, kv_lo, tl.maximum(lo, lo_max))
            fast_hi = tl.minimum(r_hi, hi_min)
            b_first = r_lo // block_size
            b_end = tl.where(r_hi > r_lo, (tl.maximum(r_hi, r_lo + 1) - 1) // block_size + 1, b_first)
            for blk in range(b_first, b_end):
                bs0 = blk * block_size
                j0 = (tl.maximum(r_lo, bs0) - bs0) // BLOCK_N
                j1 = tl.cdiv(tl.minimum(r_hi, bs0 + block_size) - bs0, BLOCK_N)
                # Tile j of this block is virtual tile cum + (j - j0): keep the split's share.
                ja = tl.maximum(j0, j0 + i_begin - cum)
                jb = tl.minimum(j1, j0 + i_end - cum)
                cum += j1 - j0
                if jb > ja:
                    bid = tl.load(bt_row + blk).to(tl.int64)
                    k_blk = k_head + bid * stride_kb
                    v_blk = v_head + bid * stride_vb
                    ks_blk = ks_head
                    vs_blk = vs_head
                    if KV_FP8:
                        ks_blk = ks_head + bid * stride_ksb
                        vs_blk = vs_head + bid * stride_vsb
                    rshift = 0
                    if ROPE_K_SHIFT:
                        rshift = tl.load(kshift_row + blk)
                    # Interior tiles: [fast_lo, min(fast_hi, block end)) in whole tiles.
                    f_lo = tl.cdiv(tl.maximum(fast_lo - bs0, 0), BLOCK_N)
                    f_hi = tl.maximum(tl.minimum(fast_hi, bs0 + block_size) - bs0, 0) // BLOCK_N
                    f_a = tl.minimum(tl.maximum(f_lo, ja), jb)
                    f_b = tl.minimum(tl.maximum(f_hi, f_a), jb)
                    kv = BlockKV(k=k_blk, v=v_blk, k_scale=ks_blk, v_scale=vs_blk, stride_k=stride_kt,
                                 stride_v=stride_vt, stride_ks=stride_kst, stride_vs=stride_vst, start=bs0,
                                 key_lo=r_lo, key_hi=tl.minimum(r_hi, bs0 + block_size), rope_shift=rshift)
                    span = TileSpan(first=ja, interior_lo=f_a, interior_hi=f_b, end=jb)
                    # The boundary tiles [ja, f_a) and [f_b, jb), then the interior run [f_a, f_b).
                    for STAGE in tl.static_range(STAGE_BOUNDARY, STAGE_INTERIOR + 1):
                        m_i, l_i, acc, bad_w = _block_tiles(
                            q=q, kv=kv, span=span, state=OnlineSoftmax(m_i, l_i, acc, bad_w), rows=rows, scale=scale,
                            rope=rope, HEAD_DIM=HEAD_DIM, HEAD_DIM_PAD=HEAD_DIM_PAD, BLOCK_N=BLOCK_N, STAGE=STAGE,
                            GUARD=GUARD_NONFINITE, HAS_SOFTCAP=HAS_SOFTCAP, UPCAST=UPCAST, FP8=KV_FP8,
                            FP8_NATIVE=FP8_NATIVE, ROPE=ROPE, ROWS=F16_DOTS)
        if HAS_OWN:
            # Same online softmax, second key source: full tiles unmasked, the last partial
            # tile masked to own_len rows (cum == tiles of the history here).
            ja = tl.maximum(0, i_begin - cum)
            jb = tl.minimum(tl.cdiv(own_len, BLOCK_N), i_end - cum)
            if jb > ja:
                own = BlockKV(k=own_k_ptr + b.to(tl.int64) * stride_own_kb + kvh.to(tl.int64) * stride_own_kh,
                              v=own_v_ptr + b.to(tl.int64) * stride_own_vb + kvh.to(tl.int64) * stride_own_vh,
                              k_scale=None, v_scale=None, stride_k=stride_own_kt, stride_v=stride_own_vt,
                              stride_ks=0, stride_vs=0, start=0, key_lo=0, key_hi=own_len, rope_shift=rope_q0)
                f_b = tl.minimum(tl.maximum(own_len // BLOCK_N, ja), jb)
                own_rows = RowBounds(hi=tl.zeros_like(row_hi) + own_len, lo=tl.zeros_like(row_lo) - 1, sink_tokens=0)
                # The full tiles [ja, f_b), then the last partial one [f_b, jb) masked (interior first:
                # no span serves both stages in this order without an extra select on the tile index).
                # The own keys are given in q's dtype (never fp8); a second pipelined loop spills.
                m_i, l_i, acc, bad_w = _block_tiles(
                    q=q, kv=own, span=TileSpan(first=ja, interior_lo=ja, interior_hi=f_b, end=jb),
                    state=OnlineSoftmax(m_i, l_i, acc, bad_w), rows=own_rows, scale=scale, rope=rope,
                    HEAD_DIM=HEAD_DIM, HEAD_DIM_PAD=HEAD_DIM_PAD, BLOCK_N=BLOCK_N, STAGE=STAGE_INTERIOR,
                    GUARD=GUARD_NONFINITE, HAS_SOFTCAP=HAS_SOFTCAP, UPCAST=UPCAST, FP8=False, FP8_NATIVE=False,
                    ROPE=ROPE, ROWS=False, PIPELINE=False)
                m_i, l_i, acc, bad_w = _block_tiles(
                    q=q, kv=own, span=TileSpan(first=f_b, interior_lo=jb, interior_hi=jb, end=jb),
                    state=OnlineSoftmax(m_i, l_i, acc, bad_w), rows=own_rows, scale=scale, rope=rope,
                    HEAD_DIM=HEAD_DIM, HEAD_DIM_PAD=HEAD_DIM_PAD, BLOCK_N=BLOCK_N, STAGE=STAGE_BOUNDARY,
                    GUARD=GUARD_NONFINITE, HAS_SOFTCAP=HAS_SOFTCAP, UPCAST=UPCAST, FP8=False, FP8_NATIVE=False,
                    ROPE=ROPE, ROWS=False)
    else:
        # Pages (block_size < BLOCK_N, or a guarded or fp32 launch): the main range's tiles
        # inside [fast_lo, fast_hi) see every key from every row and read no clamped slot;
        # they run in a loop of their own with no clamp and no mask (as the block loop's
        # interior). The rest (the sink range, both ends of the main range) run masked, in
        # one loop that skips over the interior run. Where a second loop spills
        # (PAGE_INTERIOR off, _attn_constexprs) every tile runs masked.
        ia = i_end
        ib = i_end
        if PAGE_INTERIOR:
            fast_lo = tl.maximum(lo, lo_max)
            fast_hi = tl.minimum(hi, hi_min)
            j_a = tl.cdiv(tl.maximum(fast_lo - main_base, 0), BLOCK_N)
            j_b = tl.maximum(tl.minimum(fast_hi - main_base, n_main * BLOCK_N), 0) // BLOCK_N
            ia = tl.minimum(tl.maximum(n_sink + j_a, i_begin), i_end)
            ib = tl.minimum(tl.maximum(n_sink + j_b, ia), i_end)
        kv = PagedKV(table=bt_row, k=k_head, v=v_head, k_scale=ks_head, v_scale=vs_head, stride_kb=stride_kb,
                     stride_kt=stride_kt, stride_vb=stride_vb, stride_vt=stride_vt, stride_ksb=stride_ksb,
                     stride_kst=stride_kst, stride_vsb=stride_vsb, stride_vst=stride_vst, block_size=block_size,
                     kshift=kshift_row)
        ranges = KeyRanges(n_sink=n_sink, sink_base=sink_base, main_base=main_base, kv_lo=kv_lo, sink_hi=sink_hi,
                           lo=lo, hi=hi, hi_min=hi_min, lo_max=lo_max)
        span = TileSpan(first=i_begin, interior_lo=ia, interior_hi=ib, end=i_end)
        LAST_STAGE: tl.constexpr = STAGE_INTERIOR if PAGE_INTERIOR else STAGE_BOUNDARY
        for STAGE in tl.static_range(STAGE_BOUNDARY, LAST_STAGE + 1):
            m_i, l_i, acc, bad_w = _page_tiles(
                q=q, span=span, ranges=ranges, rows=rows, state=OnlineSoftmax(m_i, l_i, acc, bad_w), kv=kv,
                scale=scale, rope=rope, HEAD_DIM=HEAD_DIM, HEAD_DIM_PAD=HEAD_DIM_PAD, BLOCK_N=BLOCK_N,
                PAGE_SIZE=PAGE_SIZE, WIDE_OFFSETS=WIDE_OFFSETS, SAME_KV_STRIDES=SAME_KV_STRIDES, STAGE=STAGE,
                GUARD=GUARD_NONFINITE, HAS_SOFTCAP=HAS_SOFTCAP, UPCAST=UPCAST, KV_FP8=KV_FP8, FP8_NATIVE=FP8_NATIVE,
                ROPE=ROPE, ROPE_K_SHIFT=ROPE_K_SHIFT, F16_DOTS=F16_DOTS)

    # ---- epilogue: rows that saw no key give 0 and lse = -inf
    if HAS_SINK_LOGITS and not SPLIT:
        # A learned sink (gpt-oss): one more key per query head, value 0, logit sink[h]. It
        # joins the denominator once, here (split partials leave it to the reduce).
        sink = tl.load(sink_ptr + (kvh * GROUP + head_in)) * 1.4426950408889634  # [BLOCK_M], log2 domain
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_new)  # 0 for a row that saw no key (m_i = -inf)
        l_i = l_i * alpha + tl.exp2(sink - m_new)
        acc = acc * alpha[:, None]
        m_i = m_new
    # l_i != 0 (not > 0): a visible NaN score makes l_i NaN, and the row must come out NaN
    # with a NaN lse (a split partial that reported lse = -inf would be dropped as empty).
    has_key = l_i != 0.0
    inv_l = tl.where(has_key, 1.0 / tl.where(has_key, l_i, 1.0), 0.0)
    o = acc * inv_l[:, None]  # [BLOCK_M, HEAD_DIM_PAD]
    if GUARD_NONFINITE:
        o = tl.where(bad_w[:, None] > 0.0, float("nan"), o)
    o_base = o_ptr + split_id.to(tl.int64) * stride_os + tok0 * stride_ot + head0 * stride_oh
    o_off = local[:, None] * stride_ot + head_in[:, None] * stride_oh + d[None, :] * stride_od
    tl.store(o_base + o_off, narrow(x=o, dtype=o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if WRITE_LSE:
        lse2 = tl.where(has_key, m_i + tl.log2(tl.where(has_key, l_i, 1.0)), float("-inf"))
        if not SPLIT:
            lse2 = lse2 * 0.6931471805599453  # natural log for the caller
        lse_base = lse_ptr + split_id.to(tl.int64) * stride_ls + tok0 * stride_lt + head0 * stride_lh
        tl.store(lse_base + local * stride_lt + head_in * stride_lh, lse2, mask=row_ok)



# ----------------------------------------------------------------------------- launcher


def _launch_attention(fwd: AttentionLaunch, q, k_cache, v_cache, metadata: tuple, out, lse, spec, own_k, own_v,
                      kv_scales) -> Outputs:
    """One ``_paged_attn_kernel`` launch of ``fwd``: the plan's :class:`LayoutArgs` for this
    call layout (built by the step's first such launch, kept by the plan), the layer's
    pointers; returns where it wrote."""
    key = layout_key(spec, q, k_cache, v_cache, metadata, out, lse, own_k, own_v, kv_scales)
    args = fwd.layouts.get(key)
    if args is None:
        args = layout_args(fwd, spec, q, k_cache, v_cache, metadata, out, lse, own_k, own_v, kv_scales)
        if args.reusable:
            if len(fwd.layouts) >= LAYOUT_LIMIT:
                fwd.layouts.clear()
            fwd.layouts[key] = args
    # The kernel addresses rows as an int64 tile base + int32 in-tile offsets; a view with a
    # row stride near 2**31 / BLOCK_M elements (never a real activation) goes via a copy.
    if args.copy_q:
        q = q.contiguous()
    dst = outputs(out, lse, fwd, args)
    _paged_attn_kernel[fwd.grid](**layer_kwargs(args, q, k_cache, v_cache, dst, own_k, own_v, kv_scales))
    return dst


def _launch_reduce(fwd: AttentionLaunch, dst: Outputs, out: torch.Tensor, lse: torch.Tensor | None, sink) -> None:
    """``_split_reduce_kernel``: the split partials of ``dst`` into ``out`` (and ``lse``)."""
    split_reduce(dst.o, dst.lse, out, lse, sink if fwd.meta["HAS_SINK_LOGITS"] else None,
                 deterministic=fwd.plan.tiles_per_split > 0)


def paged_attention_fwd(
    q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, out, lse, *,
    spec, max_seqlen_q, max_seqlen_k, own_k=None, own_v=None, kv_scales=None, rope_q_pos=None, rope_k_shift=None,
) -> None:
    """Launch block-table attention; writes ``out`` and (if not None) ``lse`` in place.

    Arguments are validated by ``kvarena.attention.ops``; ``spec`` is an
    ``AttentionSpec`` (its normalized fields are read here). No host read of device
    data: the grid comes from ``max_seqlen_q`` / ``max_seqlen_k`` alone.

    ``own_k``, ``own_v``, each ``[B, T, H_kv, D]`` (last dim contiguous): keys after each
    sequence's cached ones that every query sees (a denoising step's own keys), attended in
    the same launch and the same online softmax: only where
    :func:`~kvarena.kernels.attn_plan.takes_own_keys` says so (ValueError otherwise, before
    anything runs).

    ``kv_scales = (k_scale, v_scale)``: the caches are float8_e4m3fn, with per-key scales
    ``[num_blocks, block_size, H_kv]`` fp32 (any strides) or 0-dim static ones; the kernel
    decodes the bytes in registers and applies the scales to the score / probability
    columns in fp32. The tile config is the one of q's dtype (but under Triton < 3.9, see
    ``attn_configs.older_triton_config``).

    RoPE on read (``spec.rope_cos`` / ``rope_sin`` ``[P, D/2]`` fp32): queries and keys are
    rotated as loaded. Query i of sequence b takes table row ``rope_q_pos[b] + i`` (None:
    ``seq_len - q_len + i``, or ``seq_len + i`` with own keys); cached key t takes row ``t +
    rope_k_shift[b, t // block_size]`` (None: t); own key r takes row ``rope_q_pos[b] + r``.

    ``spec.num_splits``: split-KV count (None = ``_pick_num_splits``; 1 = never split).
    ``spec.deterministic``: the tile config ignores ``max_seqlen_q`` and each split covers a
    fixed 4096 keys, so a sequence's output is bitwise the same in any batch; only
    ``num_splits=1`` overrides it (no split, equally batch-invariant). Its fp32 scratch is
    ``ceil(max_seqlen_k / 4096) * total_q * H_q * (D + 1) * 4`` bytes: meant for decode
    batches, costly for long-context chunk prefill.
    """
    if _no_rows(q, seq_lens, max_seqlen_q):
        return
    if not spec.rope_mode:
        rope_q_pos = rope_k_shift = None
    shape = launch_shape(q, k_cache, v_cache, num_seqs=seq_lens.shape[0], max_seqlen_q=max_seqlen_q,
                         max_seqlen_k=max_seqlen_k, own_len=None if own_k is None else own_k.shape[1],
                         has_kv_start=kv_start is not None, write_lse=lse is not None, kv_scales=kv_scales,
                         rope_q_pos=rope_q_pos is not None, rope_k_shift=rope_k_shift is not None)
    fwd = plan_attention(shape, spec, launch_arch(q))
    launch_planned(fwd, q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, out, lse, spec=spec,
                   own_k=own_k, own_v=own_v, kv_scales=kv_scales, rope_q_pos=rope_q_pos, rope_k_shift=rope_k_shift)


def launch_planned(fwd: AttentionLaunch, q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, out,
                   lse, *, spec, own_k=None, own_v=None, kv_scales=None, rope_q_pos=None, rope_k_shift=None) -> None:
    """Launch a plan made before (:func:`plan_attention` on the call's shape): the attention
    kernel, and the split reduce when it splits. What :func:`paged_attention_fwd` does after
    planning; a caller that plans once per step (``kvarena.attention.plans``) calls it per
    layer, and the layers after the first reuse the plan's launch arguments
    (:mod:`attn_args`). ``rope_q_pos`` / ``rope_k_shift`` are read only under RoPE on read."""
    if not spec.rope_mode:
        rope_q_pos = rope_k_shift = None
    metadata = (block_table, seq_lens, cu_seqlens_q, kv_start, rope_q_pos, rope_k_shift)
    dst = _launch_attention(fwd, q, k_cache, v_cache, metadata, out, lse, spec, own_k, own_v, kv_scales)
    if fwd.split:
        _launch_reduce(fwd, dst, out, lse, spec.sink_logits)
        return
    if dst.o is not out:
        out.copy_(dst.o)
    if dst.lse_target is not lse:
        lse.copy_(dst.lse_target)


def _no_rows(q, seq_lens, max_seqlen_q) -> bool:
    """Whether a call has no query row (nothing to launch)."""
    return q.shape[0] == 0 or seq_lens.shape[0] == 0 or max_seqlen_q == 0

