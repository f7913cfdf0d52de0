"""Block-table gather attention (decode, chunked prefill, whole-chunk queries) and split-KV.

One kernel family serves the paged pool (16-token pages) and the slab pool (a slab is one
big page of up to ~12k tokens); ``block_size`` need not be a power of two nor divide the
key tile, so every key finds its block with ``t // block_size`` and a gathered block id.

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
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from kvarena.kernels._common import (
    I32_MAX,
    LOG2E,
    ROW_TILE_ELEMS,
    ROW_TILE_WARPS,
    head_dim_pad,
    interpreting,
)

# ----------------------------------------------------------------------------- constants

# H100/H200 have 132 SMs; read from the device on CUDA, assumed on CPU (interpreter).
_DEFAULT_SM_COUNT = 132
# Split-KV: each split covers at least 256 keys. Below that, the per-split fixed cost
# (q tile load, epilogue, 2 * D * 4 bytes of fp32 partial per row) stops being small
# next to the 256 * 2 * D * 2 bytes of K/V the split reads (4x at D = 128, bf16).
_MIN_SPLIT_KEYS = 256
# At most 64 splits: 132 SMs are filled by 64 splits of just 3 programs (e.g. B = 1, 3 kv
# heads); the fp32 scratch then holds 64 partial rows per query row.
_MAX_SPLITS = 64
# Split only if the unsplit grid is below 2 waves of programs; then pick the smallest
# split count whose wave efficiency is within 85% of the best (FlashAttention-2's rule).
_SPLIT_WAVE_EFFICIENCY = 0.85
# Deterministic mode: fixed 4096 keys per split, whatever the batch, so a sequence's
# result never depends on which other sequences share the launch. 4096 keys keep the
# scratch at 1/16 of K/V bytes per query row at D = 128 ... and 32 splits at 128K keys.
_DET_SPLIT_KEYS = 4096
_MAXNREG = 255
# The sentinel window for "no sliding window": row_lo = p - (2**31 - 1) < 0 for any int32
# position p (AttentionSpec clamps every window to this too).
_NO_WINDOW = I32_MAX


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _tanh(x):
    # tl has no tanh in every supported Triton version; exp2 saturates cleanly:
    # x -> +inf gives 1 - 2/inf = 1, x -> -inf gives 1 - 2/1 = -1.
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


@triton.jit
def _paged_attn_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
    block_table_ptr, seq_lens_ptr, cu_q_ptr, kv_start_ptr,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_os, stride_ot, stride_oh, stride_od,
    stride_ls, stride_lt, stride_lh,
    stride_bt,
    scale_log2, softcap_inv, softcap_log2,
    block_size, chunk_size, window_left, sink_tokens,
    num_kv_heads, num_q_tiles, tiles_per_split,
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
    if CAUSAL:
        # chunk_size = 1 is plain causal: t <= q_pos  <=>  t < (q_pos // 1 + 1) * 1.
        row_hi = tl.minimum((q_pos // chunk_size + 1) * chunk_size, seq_len)
    else:
        row_hi = tl.zeros_like(q_pos) + seq_len
    row_lo = q_pos - window_left  # window: t >= q_pos - window_left (or t < sink_tokens)

    # ---- key range of the whole tile (scalars): rows are monotone in q_pos
    q_pos_min = pos_base + m0 // GROUP
    q_pos_max = pos_base + (tl.minimum(m0 + BLOCK_M, n_rows) - 1) // GROUP
    if CAUSAL:
        hi = tl.minimum((q_pos_max // chunk_size + 1) * chunk_size, seq_len)
    else:
        hi = seq_len
    lo = tl.maximum(kv_lo, q_pos_min - window_left)
    # The tightest row bounds of the tile (for the interior-tile test below).
    if CAUSAL:
        hi_min = tl.minimum((q_pos_min // chunk_size + 1) * chunk_size, seq_len)
    else:
        hi_min = seq_len
    lo_max = q_pos_max - window_left
    sink_hi = tl.minimum(tl.minimum(sink_tokens, lo), hi)
    sink_base = (kv_lo // BLOCK_N) * BLOCK_N
    main_base = (lo // BLOCK_N) * BLOCK_N
    n_sink = tl.where(sink_hi > kv_lo, tl.cdiv(sink_hi - sink_base, BLOCK_N), 0)
    n_main = tl.where(hi > lo, tl.cdiv(hi - main_base, BLOCK_N), 0)
    n_tiles = n_sink + n_main
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
    if UPCAST:
        q = q.to(tl.float32)

    bt_row = block_table_ptr + b.to(tl.int64) * stride_bt
    k_head = k_ptr + kvh.to(tl.int64) * stride_kh
    v_head = v_ptr + kvh.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    bad_w = tl.zeros([BLOCK_M], tl.float32)  # weight on visible non-finite values (GUARD_NONFINITE)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    n_off = tl.arange(0, BLOCK_N)  # [BLOCK_N]

    for i in range(i_begin, i_end):
        in_sink = i < n_sink
        t0 = tl.where(in_sink, sink_base + i * BLOCK_N, main_base + (i - n_sink) * BLOCK_N)
        key_lo = tl.where(in_sink, kv_lo, lo)
        key_hi = tl.where(in_sink, sink_hi, hi)
        t = t0 + n_off  # [BLOCK_N]
        key_ok = (t >= key_lo) & (t < key_hi)
        # Straddling tiles: each key gathers its own block id. The id load is masked to
        # keys below seq_len, so table padding (possibly garbage ids) is never followed.
        blk = tl.load(bt_row + t // block_size, mask=key_ok, other=0).to(tl.int64)
        row_in_blk = (t % block_size).to(tl.int64)
        k_off = blk * stride_kb + row_in_blk * stride_kt  # [BLOCK_N] int64
        v_off = blk * stride_vb + row_in_blk * stride_vt
        kt = tl.load(k_head + k_off[None, :] + d[:, None], mask=key_ok[None, :] & d_ok[:, None], other=0.0)  # [HEAD_DIM_PAD, BLOCK_N]
        if UPCAST:
            kt = kt.to(tl.float32)
        s = tl.dot(q, kt, input_precision="ieee")  # [BLOCK_M, BLOCK_N] fp32
        if softcap_log2 > 0:
            s = softcap_log2 * _tanh(s * softcap_inv)
        else:
            s = s * scale_log2
        # Interior tiles (every key visible to every row) skip the per-element mask: at
        # 128 x 64 it is ~8 integer ops per score, as many issue slots as the exp2/max/sum.
        t_end = t0 + BLOCK_N
        interior = (t0 >= key_lo) & (t_end <= key_hi) & (t_end <= hi_min)
        interior = interior & ((t0 >= lo_max) | (t_end <= sink_tokens))
        if not interior:
            vis = key_ok[None, :] & (t[None, :] < row_hi[:, None])
            vis = vis & ((t[None, :] >= row_lo[:, None]) | (t[None, :] < sink_tokens))
            s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet keeps m = -inf; subtracting 0 instead
        # keeps exp2(-inf - (-inf)) = NaN out of alpha and pr.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)  # [BLOCK_M]
        pr = tl.exp2(s - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(pr, 1)
        v = tl.load(v_head + v_off[:, None] + d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, HEAD_DIM_PAD]
        if UPCAST:
            v = v.to(tl.float32)
        if GUARD_NONFINITE:  # noqa: SIM102 - a constexpr branch: no code at all when off
            if not interior:
                # A key invisible to a row has pr = 0 there, but 0 * NaN (or inf) in the
                # P.V dot is NaN: a boundary tile's non-finite values are zeroed, and the
                # rows that see such a key (pr > 0) are marked to give NaN, as they would
                # have. Interior tiles need neither (every row sees every key).
                v_ok = tl.abs(v) < float("inf")  # [BLOCK_N, HEAD_DIM_PAD]; False for NaN
                key_bad = tl.max(tl.where(v_ok, 0.0, 1.0), 1)  # [BLOCK_N]
                bad_w += tl.sum(pr * key_bad[None, :], 1)
                v = tl.where(v_ok, v, 0.0)
        acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    # ---- epilogue: rows that saw no key give 0 and lse = -inf
    has_key = l_i > 0.0
    inv_l = tl.where(has_key, 1.0 / tl.where(has_key, l_i, 1.0), 0.0)
    o = acc * inv_l[:, None]  # [BLOCK_M, HEAD_DIM_PAD]
    if GUARD_NONFINITE:
        o = tl.where(bad_w[:, None] > 0.0, float("nan"), o)
    o_base = o_ptr + split_id.to(tl.int64) * stride_os + tok0 * stride_ot + head0 * stride_oh
    o_off = local[:, None] * stride_ot + head_in[:, None] * stride_oh + d[None, :] * stride_od
    tl.store(o_base + o_off, o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if WRITE_LSE:
        lse2 = tl.where(has_key, m_i + tl.log2(tl.where(has_key, l_i, 1.0)), float("-inf"))
        if not SPLIT:
            lse2 = lse2 * 0.6931471805599453  # natural log for the caller
        lse_base = lse_ptr + split_id.to(tl.int64) * stride_ls + tok0 * stride_lt + head0 * stride_lh
        tl.store(lse_base + local * stride_lt + head_in * stride_lh, lse2, mask=row_ok)


@triton.jit
def _split_reduce_kernel(
    part_ptr, part_lse_ptr, o_ptr, lse_ptr,
    stride_ps, stride_pt, stride_ph,
    stride_qs, stride_qt, stride_qh,
    stride_ot, stride_oh, stride_od,
    stride_lt, stride_lh,
    n_rows, num_heads, num_splits,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    # Rows r = token * num_heads + head, BLOCK_R of them per program.
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    r_ok = r < n_rows
    tok = (r // num_heads).to(tl.int64)
    head = (r % num_heads).to(tl.int64)
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    lse_off = tok * stride_qt + head * stride_qh  # [BLOCK_R]
    p_off = tok[:, None] * stride_pt + head[:, None] * stride_ph + d[None, :]  # [BLOCK_R, HEAD_DIM_PAD]

    # Pass 1: the largest partial lse (log2 units) of each row.
    # Split s is reached by advancing 64-bit pointers (s * stride may pass 2**31).
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    lse_p = part_lse_ptr + lse_off  # [BLOCK_R] pointers
    for _ in range(0, num_splits):
        ls = tl.load(lse_p, mask=r_ok, other=float("-inf"))
        m = tl.maximum(m, ls)
        lse_p += stride_qs
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    # Pass 2: weighted sum. An empty split (lse = -inf) has weight 0 and its partial is
    # not even loaded, so nothing it holds can leak.
    acc = tl.zeros([BLOCK_R, HEAD_DIM_PAD], tl.float32)
    tot = tl.zeros([BLOCK_R], tl.float32)
    lse_p = part_lse_ptr + lse_off
    part_p = part_ptr + p_off  # [BLOCK_R, HEAD_DIM_PAD] pointers
    for _ in range(0, num_splits):
        ls = tl.load(lse_p, mask=r_ok, other=float("-inf"))
        w = tl.exp2(ls - m_safe)  # [BLOCK_R]
        live = w > 0.0
        part = tl.load(part_p, mask=(r_ok & live)[:, None] & d_ok[None, :], other=0.0)
        acc += part * w[:, None]
        tot += w
        lse_p += stride_qs
        part_p += stride_ps
    has_key = tot > 0.0
    inv = tl.where(has_key, 1.0 / tl.where(has_key, tot, 1.0), 0.0)
    o = acc * inv[:, None]
    # int64 head_dim offsets: out may be a permuted view whose head_dim stride times D
    # passes 2**31 (the unsplit path copes through _tile_span; this path must itself).
    o_off = tok[:, None] * stride_ot + head[:, None] * stride_oh + d.to(tl.int64)[None, :] * stride_od
    tl.store(o_ptr + o_off, o.to(o_ptr.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])
    if WRITE_LSE:
        lse = tl.where(has_key, (m_safe + tl.log2(tl.where(has_key, tot, 1.0))) * 0.6931471805599453, float("-inf"))
        tl.store(lse_ptr + tok * stride_lt + head * stride_lh, lse, mask=r_ok)


# ----------------------------------------------------------------------------- launcher


def _pick_config(head_dim: int, group: int, elem_bytes: int, q_len_max: int | None,
                 capability: int = 90) -> dict:
    """Tile sizes, warps and stages of one attention launch: a pure function of its args.

    ``q_len_max=None`` means "any": the deterministic mode pins one config per
    (head_dim, group, dtype, GPU) so a sequence's rounding never depends on its batch.
    ``capability`` is 10 * major + minor (80 = A100, 90 = H100/H200; 90 on CPU).
    ``kvarena check`` compiles exactly the configs this returns, per target.

    Register budget (255 per thread, no spills): the fp32 accumulator alone takes
    ``BLOCK_M * HEAD_DIM_PAD / (32 * num_warps)`` registers, the score tile
    ``BLOCK_M * BLOCK_N / (32 * num_warps)``; on sm_80 the q tile (the MMA A operand) also
    lives in registers (``BLOCK_M * HEAD_DIM_PAD * 2 / (4 * 32 * num_warps)``), where
    sm_90a's wgmma reads it from shared memory. Shared memory: K and V tiles per stage
    plus the q tile, <= 100 KiB everywhere here (163 KiB on sm_80, 227 KiB on sm_90a).
    """
    d_pad = head_dim_pad(head_dim)
    rows = None if q_len_max is None else max(1, q_len_max) * group
    decode = rows is not None and rows <= 16
    hopper = capability >= 90

    def cfg(bm, bn, warps, stages, maxnreg=_MAXNREG):
        # maxnreg = 255 (the hardware ceiling) stated explicitly for the tensor-core
        # configs: without it ptxas may cap a 256-thread program at 128 registers to fit a
        # second one per SM and spill 8-12 bytes (BLOCK_M = 32/64, GQA 5-7, sm_80).
        return dict(BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM_PAD=d_pad, num_warps=warps, num_stages=stages,
                    maxnreg=maxnreg)

    if elem_bytes >= 4:
        # fp32 dots are IEEE FMA loops with both operands in registers (no tensor cores).
        # ptxas is erratic here: any explicit maxnreg makes it fill the cap and spill, and
        # left alone it sometimes caps 256 threads at 64/128 registers and spills. Found by
        # sweeping every flag variant on both targets: 16 x 32 over 8 warps at D <= 128
        # (~50-65 registers), 32 x 16 over 8 warps at D = 256 (~115-160); no spills.
        return cfg(16, 32, 8, 2, maxnreg=None) if d_pad <= 128 else cfg(32, 16, 8, 2, maxnreg=None)
    if decode:
        # Decode: 16 rows is the smallest MMA tile (a 32q/8kv step fills 4 of them).
        # Memory-bound: 3 stages let the block ids run two tiles ahead and K/V one tile
        # (64 keys x D x 2 bytes each) ahead. ~160-200 registers: 2 programs per SM.
        return cfg(16, 64 if d_pad <= 128 else 32, 4, 3)
    if d_pad >= 256:
        # sm_90a: 64 x 256 fp32 accumulator over 8 warps = 64 registers; ~210-230 in all
        # for GQA groups up to 8. sm_80 (q in registers too) spills there: 32 x 32.
        return cfg(64, 32, 8, 2) if hopper else cfg(32, 32, 8, 2)
    if hopper and (rows is None or rows > 64):
        # Chunk / prefill on sm_90a: 128 x 128 accumulator over 8 warps = 64 registers
        # (~200-215 in all); K+V 2 stages x 32 KiB + the 32 KiB q tile = 96 KiB shared.
        return cfg(128, 64, 8, 2)
    # Short chunks (<= 64 rows), the deterministic pin, and every prefill on sm_80, where
    # 128 x 64 spills (255 registers + 60-116 bytes with GQA groups 3-5): 64 x 64, 8
    # warps, ~175-185 registers.
    return cfg(64, 64, 8, 2)


@functools.lru_cache(maxsize=16)
def _capability(device_index: int | None) -> int:
    if device_index is None or not torch.cuda.is_available():
        return 90  # the interpreter: any config runs; use the one H100/H200 get
    major, minor = torch.cuda.get_device_capability(device_index)
    return 10 * major + minor


@functools.lru_cache(maxsize=16)
def _sm_count(device_index: int | None) -> int:
    if device_index is None or not torch.cuda.is_available():
        return _DEFAULT_SM_COUNT
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _pick_num_splits(programs: int, max_seqlen_k: int, sm_count: int) -> int:
    """Split-KV count for an unsplit grid of ``programs`` (= B * H_kv * q tiles).

    Splitting pays only when the grid leaves SMs idle: at >= 2 waves (264 programs on an
    H100/H200) the tail wave costs at most a third, and a split adds a partial write plus
    a reduce launch. Below that, each split count s gives ``w = programs * s / SMs`` waves
    with efficiency ``w / ceil(w)``; take the smallest s within 85% of the best, with at
    least 256 keys per split and at most 64 splits. Examples on 132 SMs, decode with 8 kv
    heads at 32K keys: B=1 -> 8 programs -> 15 splits (120 programs of ~2200 keys); B=4 ->
    32 programs -> 4 splits (128 programs: 0.97 of a wave); B=16 -> 128 programs -> 1
    (0.97 of a wave already); B=25 -> 200 programs -> 3 splits (600 programs, 4.5 waves:
    the tail wave idles 9% of the SMs instead of 24%).
    """
    if programs <= 0 or programs >= 2 * sm_count:
        return 1
    s_max = min(_MAX_SPLITS, max_seqlen_k // _MIN_SPLIT_KEYS)
    if s_max <= 1:
        return 1
    eff = []
    for s in range(1, s_max + 1):
        waves = programs * s / sm_count
        eff.append(waves / math.ceil(waves))
    best = max(eff)
    for s, e in enumerate(eff, start=1):
        if e >= _SPLIT_WAVE_EFFICIENCY * best:
            return s
    return 1  # pragma: no cover - the best itself always qualifies


def _attn_constexprs(cfg: dict, group: int, head_dim: int, *, causal: bool, has_kv_start: bool,
                     write_lse: bool, split: bool, upcast: bool, guard: bool) -> dict:
    """The constexpr arguments of ``_paged_attn_kernel`` (shared with ``kvarena check``)."""
    return dict(
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=cfg["HEAD_DIM_PAD"], BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"], CAUSAL=causal, HAS_KV_START=has_kv_start, WRITE_LSE=write_lse,
        SPLIT=split, UPCAST=upcast, GUARD_NONFINITE=guard,
    )


def _needs_guard(max_seqlen_q: int, causal: bool, window_left: int | None) -> bool:
    """Whether rows of one tile can see different keys of one key tile.

    Only then can an invisible key share a tile with a visible one for some row and leak
    a non-finite value through ``0 * NaN``. With one query position per sequence
    (decode) every row of a tile sees the same keys, and the tile-level key range masks
    the loads exactly; without causal masks or a window (the slab pool) every row sees
    every loaded key. The guard costs registers and a V register round trip on boundary
    tiles, so it is compiled in only where it can matter.
    """
    return max_seqlen_q > 1 and (causal or window_left is not None)


def _tile_span(t: torch.Tensor, block_m: int, group: int) -> int:
    """Largest in-tile element offset of a [tokens, heads(, D)] tensor (int32 bound)."""
    span = (block_m // group + 1) * t.stride(0) + group * t.stride(1)
    if t.dim() == 3:
        span += t.shape[2] * t.stride(2)
    return span


def _reduce_block_rows(d_pad: int) -> int:
    # The reduce is a row kernel: it streams num_splits fp32 partial rows per output row.
    return max(1, ROW_TILE_ELEMS // d_pad)


def paged_attention_fwd(
    q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, out, lse, *,
    spec, max_seqlen_q, max_seqlen_k,
) -> None:
    """Launch block-table attention; writes ``out`` and (if not None) ``lse`` in place.

    Arguments are validated by ``kvarena.attention.ops``; ``spec`` is an
    ``AttentionSpec`` (its normalized fields are read here). No host read of device
    data: the grid comes from ``max_seqlen_q`` / ``max_seqlen_k`` alone.

    ``spec.num_splits``: split-KV count (None = ``_pick_num_splits``; 1 = never split).
    ``spec.deterministic``: the tile config ignores ``max_seqlen_q`` and each split covers a
    fixed 4096 keys, so a sequence's output is bitwise the same in any batch; only
    ``num_splits=1`` overrides it (no split, equally batch-invariant). Its fp32 scratch is
    ``ceil(max_seqlen_k / 4096) * total_q * H_q * (D + 1) * 4`` bytes: meant for decode
    batches, costly for long-context chunk prefill.
    """
    total_q, h_q, head_dim = q.shape
    b_count = seq_lens.shape[0]
    h_kv = k_cache.shape[2]
    group = h_q // h_kv
    if total_q == 0 or b_count == 0 or max_seqlen_q == 0:
        return  # no query row exists
    num_splits, deterministic = spec.num_splits, spec.deterministic
    scale = spec.scale_for(head_dim)
    causal, chunk_size, window_left = spec.causal, spec.chunk_size, spec.window_left
    sink_tokens, softcap = spec.sink_tokens, spec.softcap
    if causal and chunk_size is not None and chunk_size >= max_seqlen_k:
        # Every position lies in chunk 0: block-causal is full attention (and the chunk
        # end (p // C + 1) * C could pass int32 for a huge C).
        causal = False
    dev = None
    if q.device.type == "cuda":
        dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
    cfg = _pick_config(head_dim, group, q.element_size(), None if deterministic else max_seqlen_q,
                       _capability(dev))
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    num_q_tiles = triton.cdiv(max_seqlen_q * group, block_m)
    programs = num_q_tiles * b_count * h_kv

    has_sinks = window_left is not None and sink_tokens > 0
    # Most key tiles one program can visit: the sink and window phases may share a tile.
    max_tiles = triton.cdiv(max(max_seqlen_k, 1), block_n) + (1 if has_sinks else 0)
    tiles_per_split = 0  # 0: each program divides its own key tiles evenly over the splits
    if deterministic and num_splits != 1:
        # Fixed 4096 keys per split whatever the batch (an explicit count other than 1,
        # which would make the split size depend on max_seqlen_k, is not honoured).
        tiles_per_split = max(1, _DET_SPLIT_KEYS // block_n)
        num_splits = triton.cdiv(max_tiles, tiles_per_split)
    elif num_splits is None:
        num_splits = _pick_num_splits(programs, max_seqlen_k, _sm_count(dev))
    # More splits than key tiles would only add empty partials; 65535 is grid axis 1's cap.
    num_splits = max(1, min(num_splits, max_tiles, 65535))

    if softcap:
        softcap_inv, softcap_log2 = scale / softcap, softcap * LOG2E
    else:
        softcap_inv, softcap_log2 = 0.0, 0.0
    causal_chunk = (chunk_size if chunk_size is not None else 1) if causal else 1
    window = _NO_WINDOW if window_left is None else window_left
    sinks = sink_tokens if window_left is not None else 0
    split = num_splits > 1
    write_lse = lse is not None or split
    upcast = interpreting()
    meta = _attn_constexprs(cfg, group, head_dim, causal=causal, has_kv_start=kv_start is not None,
                            write_lse=write_lse, split=split, upcast=upcast,
                            guard=_needs_guard(max_seqlen_q, causal, window_left))
    # 1-D metadata is read with unit stride; .contiguous() is free when it already is.
    seq_lens, cu_seqlens_q = seq_lens.contiguous(), cu_seqlens_q.contiguous()
    kv_start_arg = kv_start.contiguous() if kv_start is not None else seq_lens  # else never read
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        block_table = block_table.contiguous()

    # The kernel addresses rows as an int64 tile base + int32 in-tile offsets; a view with a
    # row stride near 2**31 / BLOCK_M elements (never a real activation) goes via a copy.
    if _tile_span(q, block_m, group) > I32_MAX:
        q = q.contiguous()
    out_k, lse_k = out, lse
    if not split and _tile_span(out, block_m, group) > I32_MAX:
        out_k = torch.empty(out.shape, dtype=out.dtype, device=out.device)
    if not split and lse is not None and _tile_span(lse, block_m, group) > I32_MAX:
        lse_k = torch.empty(lse.shape, dtype=lse.dtype, device=lse.device)

    if split:
        part = torch.empty((num_splits, total_q, h_q, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_splits, total_q, h_q), dtype=torch.float32, device=q.device)
        o_arg, lse_arg = part, part_lse
        o_strides = (part.stride(0), part.stride(1), part.stride(2), part.stride(3))
        l_strides = part_lse.stride()
    else:
        o_arg = out_k
        o_strides = (0, out_k.stride(0), out_k.stride(1), out_k.stride(2))
        lse_arg = lse_k if lse_k is not None else out_k  # never written when WRITE_LSE is False
        l_strides = (0, lse_k.stride(0), lse_k.stride(1)) if lse_k is not None else (0, 0, 0)

    grid = (programs, num_splits)
    _paged_attn_kernel[grid](
        q, k_cache, v_cache, o_arg, lse_arg,
        block_table, seq_lens, cu_seqlens_q, kv_start_arg,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *o_strides, *l_strides,
        block_table.stride(0),
        scale * LOG2E, softcap_inv, softcap_log2,
        k_cache.shape[1], causal_chunk, window, sinks,
        h_kv, num_q_tiles, tiles_per_split,
        **meta, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], maxnreg=cfg["maxnreg"],
    )
    if not split:
        if out_k is not out:
            out.copy_(out_k)
        if lse_k is not lse:
            lse.copy_(lse_k)
        return
    block_r = _reduce_block_rows(cfg["HEAD_DIM_PAD"])
    n_rows = total_q * h_q
    lse_out = lse if lse is not None else part_lse  # dummy pointer when not written
    lse_strides = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
    _split_reduce_kernel[(triton.cdiv(n_rows, block_r),)](
        part, part_lse, out, lse_out,
        part.stride(0), part.stride(1), part.stride(2),
        part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        *lse_strides,
        n_rows, h_q, num_splits,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=cfg["HEAD_DIM_PAD"], BLOCK_R=block_r,
        WRITE_LSE=lse is not None, num_warps=ROW_TILE_WARPS,
    )
