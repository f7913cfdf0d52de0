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
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

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
from kvarena.kernels.arch import DEFAULT_ARCH, Arch, arch_for_device, arch_named, interpreter_arch
from kvarena.kernels.attn_configs import path_config as _path_config
from kvarena.kernels.attn_configs import pick_config
from kvarena.kernels.attn_configs import short_context_config as _short_context_config
from kvarena.kernels.fp8 import _f16_queries, _fp8e4m3_decode
from kvarena.kernels.key_range import row_bounds, sees, tile_key_range, virtual_tile
from kvarena.kernels.occupancy import ctas_per_sm, launch_kind
from kvarena.kernels.widen import narrow, to_fp32

# ----------------------------------------------------------------------------- constants

# H100/H200 have 132 SMs: the reduce's default when no device or record says otherwise.
_DEFAULT_SM_COUNT = 132
# Split-KV: from 1K keys on each split covers at least 32 keys (and one key tile), so that
# B = 1 fills a wave; the per-split fixed cost (q tile load, epilogue, 2 * D * 4 bytes of
# fp32 partial per row, read back by the reduce) is then the price of SMs not left idle.
# Shorter contexts split only into splits of at least 256 keys: there the fixed cost is
# not worth it (and the interpreter lane keeps its tiny cases' grids small).
_FULL_WAVE_MIN_KEYS = 1024
_FULL_WAVE_SPLIT_KEYS = 32
_MIN_SPLIT_KEYS = 256
# At most 64 splits: 132 SMs are filled by 64 splits of just 3 programs (e.g. B = 1, 3 kv
# heads); the fp32 scratch then holds 64 partial rows per query row.
_MAX_SPLITS = 64
# Split when the grid's last wave leaves more than 10% of the CTA slots idle.
_TARGET_WAVE_EFFICIENCY = 0.9
# Deterministic mode: fixed 4096 keys per split, whatever the batch, so a sequence's
# result never depends on which other sequences share the launch. 4096 keys keep the
# scratch at 1/16 of K/V bytes per query row at D = 128 ... and 32 splits at 128K keys.
_DET_SPLIT_KEYS = 4096
# The window passed for "no sliding window", and the cap of any window: row_lo = p - 2**30
# stays in int32 for every position p of a row, negative ones included (a row with more
# queries than keys, e.g. seq_len-0 padding), where p - (2**31 - 1) would wrap. A window of
# 2**30 keys or more selects every key of any sequence shorter than 2**30 tokens.
_NO_WINDOW = 1 << 30


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _tanh(x):
    # tl has no tanh in every supported Triton version; exp2 saturates cleanly:
    # x -> +inf gives 1 - 2/inf = 1, x -> -inf gives 1 - 2/1 = -1.
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


@triton.jit
def _scores(q, kt, kcol, scale_log2, softcap_inv, softcap_log2, HAS_SOFTCAP: tl.constexpr, FP8: tl.constexpr,
            FOLD: tl.constexpr, ROWS: tl.constexpr):
    # [BLOCK_M, BLOCK_N] fp32 scores in the exp2 domain (fp32 inputs: full IEEE dots).
    return _scale_scores(tl.dot(q, kt, input_precision="ieee"), kcol, scale_log2, softcap_inv, softcap_log2,
                         HAS_SOFTCAP, FP8, FOLD, ROWS)


@triton.jit
def _fp8_to(x, dtype: tl.constexpr, NATIVE: tl.constexpr):
    """An fp8 K or V tile in ``dtype`` (the dot's input type). ``NATIVE`` (sm_89+): the
    hardware conversion, 2 elements per instruction, giving the value itself; else (sm_80,
    which has no fp8 type, and the interpreter) the shift decode of uint8 bytes, giving the
    value / 256."""
    if NATIVE:
        y = x.to(dtype)
    else:
        y = _fp8e4m3_decode(x).to(dtype)
    return y


@triton.jit
def _rope_index(d, HEAD_DIM: tl.constexpr, ROPE: tl.constexpr):
    """Per head-dim index d: its rotation partner, frequency index and the partner term's sign.

    ROPE 1 (halves, GPT-NeoX / Llama): pairs (i, i + D/2); ROPE 2 (interleaved, GPT-J /
    Wan's complex pairs): pairs (2i, 2i + 1). ``rot(x)[d] = x[d] cos f(d) + sign(d)
    x[partner(d)] sin f(d)``, the standard rotation of each pair.
    """
    if ROPE == 1:
        lo = d < HEAD_DIM // 2
        pd = tl.where(lo, d + HEAD_DIM // 2, d - HEAD_DIM // 2)
        fi = tl.where(lo, d, d - HEAD_DIM // 2)
        sg = tl.where(lo, -1.0, 1.0)
    else:
        pd = d ^ 1
        fi = d // 2
        sg = tl.where((d % 2) == 0, -1.0, 1.0)
    return pd, fi, sg


@triton.jit
def _rotate(x, xp, pos, fi, sg, ok, cos_ptr, sin_ptr, stride_rp, n_pos):
    """fp32 rotation of tile ``x`` (partner values ``xp``) at table rows ``pos``; the index
    tiles broadcast over the tile. Rows are clamped into the table (the hosts validate
    positions; the clamp keeps a bad one from reading outside it)."""
    row = tl.minimum(tl.maximum(pos, 0), n_pos - 1).to(tl.int64) * stride_rp
    c = tl.load(cos_ptr + row + fi, mask=ok, other=0.0)
    sn = tl.load(sin_ptr + row + fi, mask=ok, other=0.0)
    return to_fp32(x) * c + sg * to_fp32(xp) * sn


@triton.jit
def _upcast(x, UPCAST: tl.constexpr):
    """``x`` widened to fp32 under ``UPCAST`` (the interpreter lane; False when compiled),
    exactly: bf16 subnormals through their bits (:func:`kernels.widen.to_fp32`); else ``x``."""
    if UPCAST:
        x = to_fp32(x)
    return x


@triton.jit
def _online_probs(s, m_i, l_i):
    """The online-softmax update of a score tile ``s``: the new row max, row sum, the
    rescale ``alpha`` of the old accumulator and the tile's probabilities ``pr``."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no visible key yet keeps m = -inf; subtracting 0 instead keeps
    # exp2(-inf - (-inf)) = NaN out of alpha and pr.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)  # [BLOCK_M]
    pr = tl.exp2(s - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
    return m_new, l_i * alpha + tl.sum(pr, 1), alpha, pr


@triton.jit
def _softmax_step(s, v, vcol, m_i, l_i, acc, bad_w, GUARD: tl.constexpr, guard_now, FP8: tl.constexpr):
    """One online-softmax step over masked scores ``s`` and values ``v``.

    ``GUARD`` (constexpr) and ``guard_now`` (this tile is a boundary tile): a key invisible to a row has pr = 0 there, but 0 * NaN (or inf) in the
    P.V dot is NaN, so the tile's non-finite values are zeroed and the rows that see
    such a key (pr > 0) accumulate weight in ``bad_w``, which turns their output to NaN
    as it would have been. Only boundary tiles need it (every row sees every key of an
    interior tile).
    """
    m_new, l_i, alpha, pr = _online_probs(s, m_i, l_i)
    if GUARD and guard_now:
        v_ok = tl.abs(v) < float("inf")  # [BLOCK_N, HEAD_DIM_PAD]; False for NaN
        key_bad = tl.max(tl.where(v_ok, 0.0, 1.0), 1)  # [BLOCK_N]
        if FP8:
            # A non-finite V scale (a NaN row, or a poisoned slot loaded for the tile) too.
            vcol_ok = tl.abs(vcol) < float("inf")
            key_bad = tl.maximum(key_bad, tl.where(vcol_ok, 0.0, 1.0))
            vcol = tl.where(vcol_ok, vcol, 0.0)
        bad_w += tl.sum(pr * key_bad[None, :], 1)
        v = tl.where(v_ok, v, 0.0)
    if FP8:
        # fp8 values: the per-key V scale (times 256 after the shift decode) goes on P's
        # columns, in fp32, before P is rounded to the dot's input dtype (as P alone is).
        acc = acc * alpha[:, None] + tl.dot((pr * vcol[None, :]).to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc, bad_w


@triton.jit
def _key_operand(kt, kp, kpos, fi, sg, rot_ok, dot_dtype: tl.constexpr, cos_ptr, sin_ptr, stride_rp, n_pos,
                 UPCAST: tl.constexpr, FP8: tl.constexpr, FP8_NATIVE: tl.constexpr, ROPE: tl.constexpr):
    """A loaded K^T tile ``[HEAD_DIM_PAD, BLOCK_N]`` as the Q.K^T dot's operand, for the page
    loop and the block loop alike: rotated (RoPE: in fp32 with the partner tile ``kp`` at
    positions ``kpos``, fp8 widened first, then rounded to the dot's dtype), else as
    :func:`_dot_operand` makes it."""
    if ROPE != 0:
        if FP8:
            kt, kp = _fp8_to(kt, tl.float32, FP8_NATIVE), _fp8_to(kp, tl.float32, FP8_NATIVE)
        kt = _rotate(kt, kp, kpos[None, :], fi[:, None], sg[:, None], rot_ok, cos_ptr, sin_ptr, stride_rp,
                     n_pos).to(dot_dtype)
    else:
        kt = _dot_operand(kt, dot_dtype, UPCAST, FP8, FP8_NATIVE)
    return kt


@triton.jit
def _dot_operand(x, dot_dtype: tl.constexpr, UPCAST: tl.constexpr, FP8: tl.constexpr, FP8_NATIVE: tl.constexpr):
    """A loaded K^T or V tile as a dot's operand: fp8 widened to the dot's dtype, or fp32
    under ``UPCAST``."""
    if FP8:
        x = _fp8_to(x, dot_dtype, FP8_NATIVE)
    else:
        x = _upcast(x, UPCAST=UPCAST)
    return x


@triton.jit
def _per_key(x, PAGES: tl.constexpr, BLOCK_N: tl.constexpr):
    """A per-page tensor ``[PAGES]`` broadcast to the tile's keys ``[BLOCK_N]`` (each page's
    ``BLOCK_N // PAGES`` keys are consecutive)."""
    return tl.reshape(tl.broadcast_to(x[:, None], [PAGES, BLOCK_N // PAGES]), [BLOCK_N])


@triton.jit
def _page_bases(head, blk, stride_b, PAGES: tl.constexpr, BLOCK_N: tl.constexpr):
    """Per key, the 64-bit pointer to its page's block, from the tile's page ids ``[PAGES]``.
    Ids are non-negative, so each is zero-extended (a 32 x 32 -> 64-bit multiply, no sign
    words); the key's int32 row offset joins its dims before the one 64-bit add (:func:`_rows`).
    Building the pointer once per page instead (a ``[PAGES]`` pointer broadcast to the keys)
    compiles to the same loop under Triton 3.9 and loses the K/V pipelining under 3.6."""
    return head + _per_key(blk, PAGES, BLOCK_N).to(tl.uint32).to(tl.int64) * stride_b


@triton.jit
def _rows(base, off, d, KEYS_LAST: tl.constexpr, PAGE_BASES: tl.constexpr):
    """Pointers to a key tile's rows: ``[keys, dims]`` or, with ``KEYS_LAST``, ``[dims, keys]``.
    ``base`` is the head's pointer, or with ``PAGE_BASES`` each key's page pointer (then the
    key's 32-bit row offset and the dim are summed before the one 64-bit add)."""
    if PAGE_BASES:
        if KEYS_LAST:
            ptrs = base[None, :] + (off[None, :] + d[:, None])
        else:
            ptrs = base[:, None] + (off[:, None] + d[None, :])
    else:
        if KEYS_LAST:
            ptrs = base + off[None, :] + d[:, None]
        else:
            ptrs = base + off[:, None] + d[None, :]
    return ptrs


@triton.jit
def _fp8_column_scales(ks_ptrs, vs_ptrs, key_ok, MASKED: tl.constexpr, FP8_NATIVE: tl.constexpr):
    """The per-key K and V scales ``[BLOCK_N]`` of an fp8 tile (times 256 after the shift
    decode, which gives value / 256); ``MASKED``: keys outside ``key_ok`` read 0."""
    if MASKED:
        kcol = tl.load(ks_ptrs, mask=key_ok, other=0.0)
        vcol = tl.load(vs_ptrs, mask=key_ok, other=0.0)
    else:
        kcol = tl.load(ks_ptrs)
        vcol = tl.load(vs_ptrs)
    if not FP8_NATIVE:
        kcol = kcol * 256.0
        vcol = vcol * 256.0
    return kcol, vcol


@triton.jit
def _load_tile(blk, rel, stride_t, d, d_ok, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, KT: tl.constexpr,
               UPCAST: tl.constexpr):
    """An unmasked K^T ``[HEAD_DIM_PAD, BLOCK_N]`` (``KT``) or V ``[BLOCK_N, HEAD_DIM_PAD]``
    tile at block rows ``rel`` (the head-dim padding masked off)."""
    if KT:
        ptrs = blk + rel[None, :] * stride_t + d[:, None]
    else:
        ptrs = blk + rel[:, None] * stride_t + d[None, :]
    if HEAD_DIM == HEAD_DIM_PAD:
        x = tl.load(ptrs)
    elif KT:
        x = tl.load(ptrs, mask=d_ok[:, None], other=0.0)
    else:
        x = tl.load(ptrs, mask=d_ok[None, :], other=0.0)
    return _upcast(x, UPCAST=UPCAST)


@triton.jit
def _scale_scores(s, kcol, scale_log2, softcap_inv, softcap_log2, HAS_SOFTCAP: tl.constexpr, FP8: tl.constexpr,
                  FOLD: tl.constexpr, ROWS: tl.constexpr):
    """Raw dot scores in the exp2 domain: the fp8 key scales on the columns, then softcap or scale.

    fp8 keys: the dot ran on the widened bytes (exact in its dtype; value / 256 after the
    shift decode) and the per-key scale ``kcol`` (times 256 there) multiplies each fp32 score
    column. ``FOLD`` (the page loop) multiplies by one factor per score, the key's scale
    times the softmax scale (or softcap's); the block loop keeps two multiplies, since
    folding spills the Wan chunk with an fp8 history beside its own keys (Triton 3.9: 16 B
    at 255 registers). ``ROWS``: ``scale_log2`` and ``softcap_inv`` are per query row
    ``[BLOCK_M]`` (the fp16 dots' row gains folded in, :func:`_f16_queries`), else scalars.
    """
    if ROWS:
        sc = scale_log2[:, None]
        ci = softcap_inv[:, None]
    else:
        sc = scale_log2
        ci = softcap_inv
    if FP8 and FOLD:
        if HAS_SOFTCAP:
            s = softcap_log2 * _tanh(s * (kcol[None, :] * ci))
        else:
            s = s * (kcol[None, :] * sc)
    else:
        if FP8:
            s = s * kcol[None, :]
        if HAS_SOFTCAP:
            s = softcap_log2 * _tanh(s * ci)
        else:
            s = s * sc
    return s


@triton.jit
def _interior_pipelined(q, k_blk, v_blk, j_lo, n_tiles, m_i, l_i, acc, stride_kt, stride_vt, scale_log2,
                        softcap_inv, softcap_log2, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                        BLOCK_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr):
    """``n_tiles`` interior tiles (every key visible to every row), software-pipelined.

    Each iteration runs tile j's softmax on raw scores computed one iteration earlier, then
    issues tile j+1's Q.K^T, then tile j's P.V: the exp2s of tile j run while the tensor
    cores finish tile j-1's P.V and start tile j+1's Q.K^T (wgmma is asynchronous), instead
    of after a full wait on tile j's own Q.K^T.
    """
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    n_off = tl.arange(0, BLOCK_N)
    rel = j_lo * BLOCK_N + n_off
    if n_tiles > 0:
        s_raw = tl.dot(q, _load_tile(k_blk, rel, stride_kt, d, d_ok, HEAD_DIM, HEAD_DIM_PAD, True, UPCAST),
                       input_precision="ieee")
        for _ in range(0, n_tiles - 1):
            s = _scale_scores(s_raw, None, scale_log2, softcap_inv, softcap_log2, HAS_SOFTCAP, False, False, False)
            m_i, l_i, alpha, pr = _online_probs(s, m_i, l_i)
            kt = _load_tile(k_blk, rel + BLOCK_N, stride_kt, d, d_ok, HEAD_DIM, HEAD_DIM_PAD, True, UPCAST)
            s_raw = tl.dot(q, kt, input_precision="ieee")
            v = _load_tile(v_blk, rel, stride_vt, d, d_ok, HEAD_DIM, HEAD_DIM_PAD, False, UPCAST)
            acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v, input_precision="ieee")
            rel += BLOCK_N
        s = _scale_scores(s_raw, None, scale_log2, softcap_inv, softcap_log2, HAS_SOFTCAP, False, False, False)
        m_i, l_i, alpha, pr = _online_probs(s, m_i, l_i)
        v = _load_tile(v_blk, rel, stride_vt, d, d_ok, HEAD_DIM, HEAD_DIM_PAD, False, UPCAST)
        acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v, input_precision="ieee")
    return m_i, l_i, acc


@triton.jit
def _block_tiles(
    q, k_blk, v_blk, ks_blk, vs_blk, blk_start, j_lo, n_tiles, gap_at, gap_len, m_i, l_i, acc, bad_w,
    key_lo, key_hi, row_hi, row_lo, sink_tokens,
    stride_kt, stride_vt, stride_kst, stride_vst, scale_log2, softcap_inv, softcap_log2,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    GUARD: tl.constexpr, HAS_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, FP8: tl.constexpr,
    FP8_NATIVE: tl.constexpr, cos_ptr, sin_ptr, stride_rp, n_pos, rshift, ROPE: tl.constexpr,
    ROWS: tl.constexpr, PIPELINE: tl.constexpr = True,
):
    """``n_tiles`` key tiles of one large block from tile ``j_lo``, at rows ``j * BLOCK_N``.

    Contiguous addressing from the block's base pointers (no block-table gather, no
    divide). ``MASKED=False`` is the interior loop: every key of every tile is visible
    to every row, so there is no mask code at all; ``MASKED=True`` handles the block's
    few boundary tiles, both ends in one loop: tiles from ``gap_at`` on skip ahead by
    ``gap_len`` (over the interior run). ``ROPE``: keys are rotated as loaded, key at
    block row ``r`` by table row ``blk_start + r + rshift``. ``PIPELINE``: an interior run
    of q-dtype keys (no fp8, no RoPE) at ``HEAD_DIM_PAD <= 128`` over key tiles of at least
    64 (the wgmma tiles of sm_90a; sm_80's chunk tiles are 16 keys) takes
    :func:`_interior_pipelined`; the others keep one tile after the other (the second live
    score tile spills there: fp8 beside the own keys under Triton 3.9, D = 256 and sm_80's
    MAGI tile under 3.6).
    """
    if PIPELINE and (not MASKED) and ROPE == 0 and not FP8 and HEAD_DIM_PAD <= 128 and BLOCK_N >= 64:
        m_i, l_i, acc = _interior_pipelined(q, k_blk, v_blk, j_lo, n_tiles, m_i, l_i, acc, stride_kt, stride_vt,
                                            scale_log2, softcap_inv, softcap_log2, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N,
                                            HAS_SOFTCAP, UPCAST)
    else:
        m_i, l_i, acc, bad_w = _block_tiles_loop(
            q, k_blk, v_blk, ks_blk, vs_blk, blk_start, j_lo, n_tiles, gap_at, gap_len, m_i, l_i, acc, bad_w,
            key_lo, key_hi, row_hi, row_lo, sink_tokens, stride_kt, stride_vt, stride_kst, stride_vst, scale_log2,
            softcap_inv, softcap_log2, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, MASKED, GUARD, HAS_SOFTCAP, UPCAST, FP8,
            FP8_NATIVE, cos_ptr, sin_ptr, stride_rp, n_pos, rshift, ROPE, ROWS)
    return m_i, l_i, acc, bad_w


@triton.jit
def _block_tiles_loop(
    q, k_blk, v_blk, ks_blk, vs_blk, blk_start, j_lo, n_tiles, gap_at, gap_len, m_i, l_i, acc, bad_w,
    key_lo, key_hi, row_hi, row_lo, sink_tokens,
    stride_kt, stride_vt, stride_kst, stride_vst, scale_log2, softcap_inv, softcap_log2,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    GUARD: tl.constexpr, HAS_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, FP8: tl.constexpr,
    FP8_NATIVE: tl.constexpr, cos_ptr, sin_ptr, stride_rp, n_pos, rshift, ROPE: tl.constexpr,
    ROWS: tl.constexpr,
):
    """:func:`_block_tiles`' loop, one tile after the other (masked tiles, fp8, RoPE)."""
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    n_off = tl.arange(0, BLOCK_N)
    pd, fi, sg = None, None, None  # RoPE's index tiles
    if ROPE != 0:
        pd, fi, sg = _rope_index(d, HEAD_DIM, ROPE)
    for jj in range(0, n_tiles):
        j = j_lo + jj
        if MASKED:
            j = tl.where(j >= gap_at, j + gap_len, j)
        rel = j * BLOCK_N + n_off  # [BLOCK_N] rows within the block
        t = blk_start + rel  # [BLOCK_N] logical key positions
        if MASKED:
            key_ok = (t >= key_lo) & (t < key_hi)
            kt = tl.load(k_blk + rel[None, :] * stride_kt + d[:, None], mask=key_ok[None, :] & d_ok[:, None], other=0.0)  # [HEAD_DIM_PAD, BLOCK_N]
        else:
            kt = _load_tile(k_blk, rel, stride_kt, d, d_ok, HEAD_DIM, HEAD_DIM_PAD, True, False)
        kp = None  # RoPE: the partner rows of the same keys (an L1 hit)
        k_ok = None
        if ROPE != 0:
            k_ok = d_ok[:, None] & (key_ok[None, :] if MASKED else (n_off >= 0)[None, :])
            kp = tl.load(k_blk + rel[None, :] * stride_kt + pd[:, None], mask=k_ok, other=0.0)
        kt = _key_operand(kt, kp, t + rshift, fi, sg, k_ok, q.dtype, cos_ptr, sin_ptr, stride_rp, n_pos,
                          UPCAST, FP8, FP8_NATIVE, ROPE)
        kcol = None  # the fp8 column scales (FP8 only)
        vcol = None
        if FP8:
            kcol, vcol = _fp8_column_scales(ks_blk + rel * stride_kst, vs_blk + rel * stride_vst,
                                            key_ok if MASKED else None, MASKED, FP8_NATIVE)
        s = _scores(q, kt, kcol, scale_log2, softcap_inv, softcap_log2, HAS_SOFTCAP, FP8, False, ROWS)
        if MASKED:
            s = tl.where(key_ok[None, :] & sees(t, row_hi, row_lo, sink_tokens), s, float("-inf"))
            v = tl.load(v_blk + rel[:, None] * stride_vt + d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, HEAD_DIM_PAD]
        else:
            v = _load_tile(v_blk, rel, stride_vt, d, d_ok, HEAD_DIM, HEAD_DIM_PAD, False, False)
        v = _dot_operand(v, q.dtype, UPCAST, FP8, FP8_NATIVE)
        m_i, l_i, acc, bad_w = _softmax_step(s, v, vcol, m_i, l_i, acc, bad_w, GUARD and MASKED, True, FP8)
    return m_i, l_i, acc, bad_w


@triton.jit
def _range_tiles(a, b, block_size, BLOCK_N: tl.constexpr):
    """Key tiles of the range ``[a, b)`` when tiles restart at every block start."""
    per_block = tl.cdiv(block_size, BLOCK_N)
    first = a // block_size
    last = (tl.maximum(b, a + 1) - 1) // block_size
    head = (a - first * block_size) // BLOCK_N
    same = tl.cdiv(b - first * block_size, BLOCK_N) - head
    apart = (per_block - head) + (last - first - 1) * per_block + tl.cdiv(b - last * block_size, BLOCK_N)
    return tl.where(b > a, tl.where(first == last, same, apart), 0)


@triton.jit
def _page_tiles(
    q, i_lo, n_tiles, gap_at, gap_len, n_sink, sink_base, main_base, kv_lo, sink_hi, lo, hi, hi_min, lo_max,
    sink_tokens, row_hi, row_lo, m_i, l_i, acc, bad_w, bt_row, kshift_row, k_head, v_head, ks_head, vs_head,
    stride_kb, stride_kt, stride_vb, stride_vt, stride_ksb, stride_kst, stride_vsb, stride_vst, block_size,
    scale_log2, softcap_inv, softcap_log2, cos_ptr, sin_ptr, stride_rp, n_pos,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr, SAME_KV_STRIDES: tl.constexpr, MASKED: tl.constexpr, GUARD: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, KV_FP8: tl.constexpr, FP8_NATIVE: tl.constexpr,
    ROPE: tl.constexpr, ROPE_K_SHIFT: tl.constexpr, F16_DOTS: tl.constexpr,
):
    """``n_tiles`` virtual key tiles from ``i_lo`` through the block table (the page loop).

    Virtual tiles run over the sink range ``[kv_lo, sink_hi)`` (the first ``n_sink``), then
    the main range ``[lo, hi)``; tile starts are multiples of ``BLOCK_N``. ``MASKED``: a key
    outside its tile's range reads the range's nearest key (a written slot of a real block,
    so the loads need no mask and table padding is never followed) and its score is
    masked, as are the keys a row does not see; tiles from ``gap_at`` on skip ahead by
    ``gap_len`` (over the interior run). ``MASKED=False``: main-range tiles that every row
    sees whole, with no clamp and no mask code.
    """
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    n_off = tl.arange(0, BLOCK_N)
    pd, fi, sg = None, None, None  # RoPE's index tiles
    if ROPE != 0:
        pd, fi, sg = _rope_index(d, HEAD_DIM, ROPE)
    # fp32 (FMA dots) loads K^T as such (the transposed tile spills at D = 256), and fp8 too
    # (its bytes widen in registers either way; the transposed load costs 9 SASS more per
    # tile under Triton 3.6, 2 fewer under 3.9); 16-bit K loads in V's [keys, dims] layout
    # and is transposed.
    K_AS_KT: tl.constexpr = k_head.dtype.element_ty == tl.float32 or KV_FP8
    # Power-of-two pages a key tile spans (tile starts are multiples of BLOCK_N).
    PAGES: tl.constexpr = BLOCK_N // PAGE_SIZE if PAGE_SIZE > 0 and PAGE_SIZE < BLOCK_N else 1
    # 64-bit addresses: a block pointer per key, 32-bit rows.
    PAGE_BASES: tl.constexpr = WIDE_OFFSETS and PAGE_SIZE > 0
    for ii in range(0, n_tiles):
        i = i_lo + ii
        if MASKED:
            i = tl.where(i >= gap_at, i + gap_len, i)
            t0, key_lo, key_hi = virtual_tile(i, n_sink, sink_base, main_base, kv_lo, sink_hi, lo, hi, BLOCK_N)
            t = t0 + n_off  # [BLOCK_N]
            key_ok = (t >= key_lo) & (t < key_hi)
            tc = tl.minimum(tl.maximum(t, key_lo), key_hi - 1)
        else:
            t0 = main_base + (i - n_sink) * BLOCK_N
            tc = t0 + n_off
        if PAGE_SIZE > 0:  # tc >= 0: as unsigned, // and % are a shift and a mask
            if MASKED:
                row_in_blk = (tc.to(tl.uint32) % PAGE_SIZE).to(tl.int32)
                # The tile's pages' block ids: one load per page, the page clamped into the
                # range's pages (the tile's keys fill its PAGES pages in order; clamping
                # commutes with page division). A tile exists only in a non-empty range:
                # key_hi - 1 >= key_lo >= 0, unsigned.
                pg_hi = ((key_hi - 1).to(tl.uint32) // PAGE_SIZE).to(tl.int32)
                pg = tl.minimum(tl.maximum(t0 // PAGE_SIZE + tl.arange(0, PAGES), key_lo // PAGE_SIZE), pg_hi)
            else:
                if PAGE_SIZE < BLOCK_N:  # whole pages: a key's row is its place in its page
                    row_in_blk = n_off % PAGE_SIZE
                else:
                    row_in_blk = (t0.to(tl.uint32) % PAGE_SIZE).to(tl.int32) + n_off
                pg = t0 // PAGE_SIZE + tl.arange(0, PAGES)
            ids = tl.load(bt_row + pg)  # [PAGES]
            blk = _per_key(ids, PAGES, BLOCK_N)
        else:
            blk_idx = tc // block_size
            row_in_blk = tc % block_size
            blk = tl.load(bt_row + blk_idx)  # [BLOCK_N]
        # K is loaded in V's [keys, dims] layout and transposed for the dot: one address per
        # 16-byte vector. When K and V share block and token strides (SAME_KV_STRIDES, the
        # arena's views) one offset per key serves both.
        if PAGE_BASES:
            k_base = _page_bases(k_head, ids, stride_kb, PAGES, BLOCK_N)
            k_off = row_in_blk * stride_kt
            if SAME_KV_STRIDES:
                v_base = _page_bases(v_head, ids, stride_kb, PAGES, BLOCK_N)
                v_off = k_off
            else:
                v_base = _page_bases(v_head, ids, stride_vb, PAGES, BLOCK_N)
                v_off = row_in_blk * stride_vt
        else:
            k_base = k_head
            v_base = v_head
            if WIDE_OFFSETS:  # the cache spans more than 2**31 elements (and maybe a block)
                blk = blk.to(tl.int64)
                row_in_blk = row_in_blk.to(tl.int64)
            k_off = blk * stride_kb + row_in_blk * stride_kt  # [BLOCK_N]
            if SAME_KV_STRIDES:
                v_off = k_off
            else:
                v_off = blk * stride_vb + row_in_blk * stride_vt
        if K_AS_KT:
            kt = tl.load(_rows(k_base, k_off, d, True, PAGE_BASES), mask=d_ok[:, None], other=0.0)
        elif HEAD_DIM == HEAD_DIM_PAD:
            kt = tl.trans(tl.load(_rows(k_base, k_off, d, False, PAGE_BASES)))  # [HEAD_DIM_PAD, BLOCK_N]
        else:
            kt = tl.trans(tl.load(_rows(k_base, k_off, d, False, PAGE_BASES), mask=d_ok[None, :], other=0.0))
        kp = None
        kpos = tc
        if ROPE != 0:
            if K_AS_KT:
                kp = tl.load(_rows(k_base, k_off, pd, True, PAGE_BASES), mask=d_ok[:, None], other=0.0)
            else:
                kp = tl.trans(tl.load(_rows(k_base, k_off, pd, False, PAGE_BASES), mask=d_ok[None, :], other=0.0))
            if ROPE_K_SHIFT:
                if PAGE_SIZE > 0:
                    kpos = tc + tl.load(kshift_row + (tc.to(tl.uint32) // PAGE_SIZE).to(tl.int32))
                else:
                    kpos = tc + tl.load(kshift_row + blk_idx)
        kt = _key_operand(kt, kp, kpos, fi, sg, d_ok[:, None], q.dtype, cos_ptr, sin_ptr, stride_rp, n_pos,
                          UPCAST, KV_FP8, FP8_NATIVE, ROPE)
        kcol = None  # the fp8 column scales (KV_FP8 only)
        vcol = None
        if KV_FP8:
            if PAGE_BASES:
                ks_keys = _page_bases(ks_head, ids, stride_ksb, PAGES, BLOCK_N) + row_in_blk * stride_kst
                if SAME_KV_STRIDES:  # the scales' strides agree too
                    vs_keys = _page_bases(vs_head, ids, stride_ksb, PAGES, BLOCK_N) + row_in_blk * stride_kst
                else:
                    vs_keys = _page_bases(vs_head, ids, stride_vsb, PAGES, BLOCK_N) + row_in_blk * stride_vst
            else:
                ks_off = blk * stride_ksb + row_in_blk * stride_kst
                if SAME_KV_STRIDES:  # the scales' strides agree too
                    vs_off = ks_off
                else:
                    vs_off = blk * stride_vsb + row_in_blk * stride_vst
                ks_keys = ks_head + ks_off
                vs_keys = vs_head + vs_off
            kcol, vcol = _fp8_column_scales(ks_keys, vs_keys, None, False, FP8_NATIVE)
        s = _scores(q, kt, kcol, scale_log2, softcap_inv, softcap_log2, HAS_SOFTCAP, KV_FP8, True, F16_DOTS)
        guard_now = False
        if MASKED:
            # A masked-loop tile that every row sees whole (a sink tile) skips the per-element
            # mask: ~8 integer ops per score, as many issue slots as the exp2/max/sum.
            t_end = t0 + BLOCK_N
            interior = (t0 >= key_lo) & (t_end <= key_hi) & (t_end <= hi_min)
            interior = interior & ((t0 >= lo_max) | (t_end <= sink_tokens))
            if not interior:
                s = tl.where(key_ok[None, :] & sees(t, row_hi, row_lo, sink_tokens), s, float("-inf"))
            guard_now = not interior
        if HEAD_DIM == HEAD_DIM_PAD:
            v = tl.load(_rows(v_base, v_off, d, False, PAGE_BASES))  # [BLOCK_N, HEAD_DIM_PAD]
        else:
            v = tl.load(_rows(v_base, v_off, d, False, PAGE_BASES), mask=d_ok[None, :], other=0.0)
        v = _dot_operand(v, q.dtype, UPCAST, KV_FP8, FP8_NATIVE)
        m_i, l_i, acc, bad_w = _softmax_step(s, v, vcol, m_i, l_i, acc, bad_w, GUARD, guard_now, KV_FP8)
    return m_i, l_i, acc, bad_w


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
    row_hi, row_lo = row_bounds(q_pos, seq_len, chunk_size, window_left, CAUSAL)

    # ---- key range of the whole tile (scalars): rows are monotone in q_pos
    q_pos_min = pos_base + m0 // GROUP
    q_pos_max = pos_base + (tl.minimum(m0 + BLOCK_M, n_rows) - 1) // GROUP
    lo, hi, sink_hi, hi_min, lo_max = tile_key_range(q_pos_min, q_pos_max, seq_len, kv_lo, chunk_size,
                                                     window_left, sink_tokens, CAUSAL)
    sink_base = (kv_lo // BLOCK_N) * BLOCK_N
    main_base = (lo // BLOCK_N) * BLOCK_N
    if LARGE_BLOCKS:
        # Tiles restart at every block start (no tile straddles two blocks).
        n_sink = _range_tiles(kv_lo, sink_hi, block_size, BLOCK_N)
        n_main = _range_tiles(lo, hi, block_size, BLOCK_N)
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
    pd, fi, sg = None, None, None  # RoPE's index tiles
    rope_q0 = seq_len  # rotary position of the sequence's first query (ROPE)
    if ROPE != 0:
        # Queries rotate once per program: row position = the first query's table row +
        # its index. Default: the bottom-right position (seq_len - q_len), or, in a launch
        # with own keys, right after the history (the own keys are the queries' tokens).
        if ROPE_Q_POS:
            rope_q0 = tl.load(qpos_ptr + b)
        elif not HAS_OWN:
            rope_q0 = seq_len - q_len
        pd, fi, sg = _rope_index(d, HEAD_DIM, ROPE)
        q_ok = row_ok[:, None] & d_ok[None, :]
        qp = tl.load(q_base + local[:, None] * stride_qt + head_in[:, None] * stride_qh + pd[None, :] * stride_qd,
                     mask=q_ok, other=0.0)
        q = _rotate(q, qp, (rope_q0 + pos_idx)[:, None], fi[None, :], sg[None, :], q_ok, cos_ptr, sin_ptr,
                    stride_rp, n_pos)
        q = q.to(tl.float32 if UPCAST else q_ptr.dtype.element_ty)
    else:
        q = _upcast(q, UPCAST=UPCAST)
    # fp8 caches under bf16 queries take fp16 dots (the fp8 tiles widen to fp16 at a quarter
    # of bf16's cost); the own keys are bf16, so a launch with them keeps bf16 dots.
    F16_DOTS: tl.constexpr = KV_FP8 and (not HAS_OWN) and q_ptr.dtype.element_ty == tl.bfloat16
    if F16_DOTS:  # the scales become per row [BLOCK_M]: each row's gain folded in
        q, q_gain = _f16_queries(q, UPCAST)
        scale_log2 = scale_log2 * q_gain
        softcap_inv = softcap_inv * q_gain
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
                    key_hi = tl.minimum(r_hi, bs0 + block_size)
                    # Boundary tiles [ja, f_a) and [f_b, jb), then the interior run [f_a, f_b).
                    m_i, l_i, acc, bad_w = _block_tiles(
                        q, k_blk, v_blk, ks_blk, vs_blk, bs0, ja, (f_a - ja) + (jb - f_b), f_a, f_b - f_a, m_i,
                        l_i, acc, bad_w, r_lo, key_hi, row_hi, row_lo, sink_tokens, stride_kt, stride_vt,
                        stride_kst, stride_vst, scale_log2, softcap_inv, softcap_log2,
                        HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, True, GUARD_NONFINITE, HAS_SOFTCAP, UPCAST, KV_FP8, FP8_NATIVE,
                        cos_ptr, sin_ptr, stride_rp, n_pos, rshift, ROPE, F16_DOTS)
                    m_i, l_i, acc, bad_w = _block_tiles(
                        q, k_blk, v_blk, ks_blk, vs_blk, bs0, f_a, f_b - f_a, 0, 0, m_i, l_i, acc,
                        bad_w, r_lo, key_hi, row_hi, row_lo, sink_tokens, stride_kt, stride_vt,
                        stride_kst, stride_vst, scale_log2, softcap_inv, softcap_log2,
                        HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, False, GUARD_NONFINITE, HAS_SOFTCAP, UPCAST, KV_FP8, FP8_NATIVE,
                        cos_ptr, sin_ptr, stride_rp, n_pos, rshift, ROPE, F16_DOTS)
        if HAS_OWN:
            # Same online softmax, second key source: full tiles unmasked, the last partial
            # tile masked to own_len rows (cum == tiles of the history here).
            ja = tl.maximum(0, i_begin - cum)
            jb = tl.minimum(tl.cdiv(own_len, BLOCK_N), i_end - cum)
            if jb > ja:
                k_blk = own_k_ptr + b.to(tl.int64) * stride_own_kb + kvh.to(tl.int64) * stride_own_kh
                v_blk = own_v_ptr + b.to(tl.int64) * stride_own_vb + kvh.to(tl.int64) * stride_own_vh
                f_b = tl.minimum(tl.maximum(own_len // BLOCK_N, ja), jb)
                all_rows_hi = tl.zeros_like(row_hi) + own_len
                no_lo = tl.zeros_like(row_lo) - 1
                # The own keys are given in q's dtype (never fp8).
                m_i, l_i, acc, bad_w = _block_tiles(
                    q, k_blk, v_blk, None, None, 0, ja, f_b - ja, 0, 0, m_i, l_i, acc,
                    bad_w, 0, own_len, all_rows_hi, no_lo, 0, stride_own_kt, stride_own_vt, 0, 0,
                    scale_log2, softcap_inv, softcap_log2,
                    HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, False, GUARD_NONFINITE, HAS_SOFTCAP, UPCAST, False, False,
                    cos_ptr, sin_ptr, stride_rp, n_pos, rope_q0, ROPE, False, False)  # a 2nd pipelined loop spills
                m_i, l_i, acc, bad_w = _block_tiles(
                    q, k_blk, v_blk, None, None, 0, f_b, jb - f_b, jb, 0, m_i, l_i, acc,
                    bad_w, 0, own_len, all_rows_hi, no_lo, 0, stride_own_kt, stride_own_vt, 0, 0,
                    scale_log2, softcap_inv, softcap_log2,
                    HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, True, GUARD_NONFINITE, HAS_SOFTCAP, UPCAST, False, False,
                    cos_ptr, sin_ptr, stride_rp, n_pos, rope_q0, ROPE, False)
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
        m_i, l_i, acc, bad_w = _page_tiles(
            q, i_begin, (ia - i_begin) + (i_end - ib), ia, ib - ia, n_sink, sink_base, main_base, kv_lo, sink_hi,
            lo, hi, hi_min, lo_max, sink_tokens, row_hi, row_lo, m_i, l_i, acc, bad_w, bt_row, kshift_row,
            k_head, v_head, ks_head, vs_head, stride_kb, stride_kt, stride_vb, stride_vt, stride_ksb, stride_kst,
            stride_vsb, stride_vst, block_size, scale_log2, softcap_inv, softcap_log2, cos_ptr, sin_ptr,
            stride_rp, n_pos, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, PAGE_SIZE, WIDE_OFFSETS, SAME_KV_STRIDES, True,
            GUARD_NONFINITE, HAS_SOFTCAP, UPCAST, KV_FP8, FP8_NATIVE, ROPE, ROPE_K_SHIFT, F16_DOTS)
        if PAGE_INTERIOR:
            m_i, l_i, acc, bad_w = _page_tiles(
                q, ia, ib - ia, ib, 0, n_sink, sink_base, main_base, kv_lo, sink_hi,
                lo, hi, hi_min, lo_max, sink_tokens, row_hi, row_lo, m_i, l_i, acc, bad_w, bt_row, kshift_row,
                k_head, v_head, ks_head, vs_head, stride_kb, stride_kt, stride_vb, stride_vt, stride_ksb,
                stride_kst, stride_vsb, stride_vst, block_size, scale_log2, softcap_inv, softcap_log2, cos_ptr,
                sin_ptr, stride_rp, n_pos, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, PAGE_SIZE, WIDE_OFFSETS,
                SAME_KV_STRIDES, False, GUARD_NONFINITE, HAS_SOFTCAP, UPCAST, KV_FP8, FP8_NATIVE, ROPE,
                ROPE_K_SHIFT, F16_DOTS)

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
    tl.store(o_base + o_off, narrow(o, o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
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
    sink_ptr,
    n_rows, num_heads, num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    HAS_SINK_LOGITS: tl.constexpr,
):
    # Rows r = token * num_heads + head, BLOCK_R of them per program; axis 1 takes
    # BLOCK_D of the head dim. The splits are read BLOCK_S at a time as one vector (one
    # chunk: every split at once), so a row costs two dependent loads, not two per split.
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    r_ok = r < n_rows
    tok = (r // num_heads).to(tl.int64)
    head = (r % num_heads).to(tl.int64)
    d0 = tl.program_id(1) * BLOCK_D
    d = d0 + tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    s = tl.arange(0, BLOCK_S)
    lse_off = (tok * stride_qt + head * stride_qh)[:, None] + s.to(tl.int64)[None, :] * stride_qs  # [R, S]
    p_off = (tok * stride_pt + head * stride_ph)[:, None, None] + s.to(tl.int64)[None, :, None] * stride_ps \
        + d[None, None, :]  # [R, S, D]
    rs_ok = r_ok[:, None] & (s[None, :] < num_splits)

    # Pass 1: the largest partial lse (log2 units) of each row. Chunks past the first
    # advance 64-bit pointers (s * stride may pass 2**31).
    ls0 = tl.load(part_lse_ptr + lse_off, mask=rs_ok, other=float("-inf"))  # [R, S]
    m = tl.max(ls0, axis=1)
    lse_p = part_lse_ptr + lse_off
    for s0 in range(BLOCK_S, num_splits, BLOCK_S):
        lse_p += BLOCK_S * stride_qs
        ls = tl.load(lse_p, mask=r_ok[:, None] & (s[None, :] < num_splits - s0), other=float("-inf"))
        m = tl.maximum(m, tl.max(ls, axis=1))
    if HAS_SINK_LOGITS:
        # The sink joins the denominator once, as a partial of value 0 (log2 domain).
        sink = tl.load(sink_ptr + head, mask=r_ok, other=0.0) * 1.4426950408889634  # [BLOCK_R]
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    # Pass 2: weighted sum. An empty split (lse = -inf) has weight 0 and its partial is
    # not even loaded, so nothing it holds can leak.
    w = tl.exp2(ls0 - m_safe[:, None])  # [R, S]
    live = (w > 0.0)[:, :, None] & d_ok[None, None, :]
    part = tl.load(part_ptr + p_off, mask=live, other=0.0)
    acc = tl.sum(part * w[:, :, None], axis=1)  # [R, D]
    tot = tl.sum(w, axis=1)
    lse_p = part_lse_ptr + lse_off
    part_p = part_ptr + p_off
    for s0 in range(BLOCK_S, num_splits, BLOCK_S):
        lse_p += BLOCK_S * stride_qs
        part_p += BLOCK_S * stride_ps
        ls = tl.load(lse_p, mask=r_ok[:, None] & (s[None, :] < num_splits - s0), other=float("-inf"))
        w = tl.exp2(ls - m_safe[:, None])
        live = (w > 0.0)[:, :, None] & d_ok[None, None, :]
        part = tl.load(part_p, mask=live, other=0.0)
        acc += tl.sum(part * w[:, :, None], axis=1)
        tot += tl.sum(w, axis=1)
    if HAS_SINK_LOGITS:
        tot += tl.exp2(sink - m_safe)
    has_key = tot != 0.0  # NaN (a partial that saw a NaN) stays NaN, as in the unsplit epilogue
    inv = tl.where(has_key, 1.0 / tl.where(has_key, tot, 1.0), 0.0)
    o = acc * inv[:, None]
    # int64 head_dim offsets: out may be a permuted view whose head_dim stride times D
    # passes 2**31 (the unsplit path copes through _tile_span; this path must itself).
    o_off = tok[:, None] * stride_ot + head[:, None] * stride_oh + d.to(tl.int64)[None, :] * stride_od
    tl.store(o_ptr + o_off, narrow(o, o_ptr.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])
    if WRITE_LSE:
        lse = tl.where(has_key, (m_safe + tl.log2(tl.where(has_key, tot, 1.0))) * 0.6931471805599453, float("-inf"))
        # Written once per row: by the programs of the first head-dim block.
        tl.store(lse_ptr + tok * stride_lt + head * stride_lh, lse, mask=r_ok & (r * 0 + d0 == 0))


# ----------------------------------------------------------------------------- launcher


def _pick_config(head_dim: int, group: int, elem_bytes: int, q_len_max: int | None, arch: Arch | str = DEFAULT_ARCH,
                 *, lean: bool = False, rope: bool = False, kv_fp8: bool = False, own: bool = False) -> dict:
    """:func:`kvarena.kernels.attn_configs.pick_config` on ``arch`` (a record or its name).
    The launch plan calls it through this module's global, so a test can pin a tile."""
    if isinstance(arch, str):
        arch = arch_named(arch)
    return pick_config(arch, head_dim, group, elem_bytes, q_len_max, lean=lean, rope=rope, kv_fp8=kv_fp8, own=own)


def _key_tiles(max_seqlen_k: int, block_n: int, has_sinks: bool) -> int:
    """Most key tiles one program visits on the page path: the sink and window phases may
    share a tile."""
    return triton.cdiv(max(max_seqlen_k, 1), block_n) + (1 if has_sinks else 0)


def _wants_short_tiles(cfg: dict, programs: int, max_seqlen_k: int, has_sinks: bool, sm_count: int,
                       ctas: int) -> bool:
    """Whether a decode launch (16-row tile over 64-key tiles) from 1K keys on cannot reach
    the target wave efficiency even at one split per key tile, so that 32-key tiles would."""
    if cfg["BLOCK_M"] != 16 or cfg["BLOCK_N"] != 64 or max_seqlen_k < _FULL_WAVE_MIN_KEYS:
        return False
    wave = sm_count * max(1, ctas)
    return programs * _key_tiles(max_seqlen_k, cfg["BLOCK_N"], has_sinks) < _TARGET_WAVE_EFFICIENCY * wave


def _arch(device_index: int | None) -> Arch:
    """The architecture record a launch on ``device_index`` plans for (None: the
    interpreter's, ``KVARENA_ARCH``, read per launch so a test may set it)."""
    return interpreter_arch() if device_index is None else _device_arch(device_index)


@functools.lru_cache(maxsize=16)
def _device_arch(device_index: int) -> Arch:
    """A CUDA/ROCm device's record, read from its properties once: launches run per layer."""
    return arch_for_device(device_index)


def _device_index(t: torch.Tensor) -> int | None:
    """The CUDA device index of ``t`` (None on CPU: the interpreter)."""
    if t.device.type != "cuda":
        return None
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def _pick_num_splits(programs: int, max_seqlen_k: int, sm_count: int, ctas: int = 1, tiles: int | None = None) -> int:
    """Split-KV count for an unsplit grid of ``programs`` (= B * H_kv * q tiles).

    A wave is ``sm_count * ctas`` programs, the CTAs per SM that the compiled
    kernel's registers and shared memory allow (``kvarena.kernels.occupancy``). Each split
    count s gives ``w = programs * s / wave`` waves with efficiency ``w / ceil(w)``. At most
    64 splits, ``tiles`` (the key tiles of the longest sequence) and one per 32 keys from 1K
    keys on (one per 256 keys below). An unsplit grid under one wave takes
    ``floor(wave / programs)`` splits, one full wave (as FA4's ``min(SMs / q-blocks, 128,
    kv-blocks)``), when that reaches 0.9; otherwise s = 1
    when it is already >= 0.9, else the smallest s that reaches 0.9 (else the best). A split
    costs an fp32 partial write and a reduce launch, small next to an idle tail. Examples on
    132 SMs at 2 CTAs/SM (decode, 8 kv heads, 64-key tiles): B=1 at 128K or 4K -> 8 programs
    -> 33 splits (1.0 of a wave), at 2K -> 32 (0.97, one per tile); B=16 -> 128 programs ->
    2 splits (0.97); B=64 -> 512 programs -> 1 (1.94 waves, 0.97). Wan-1.3B chunks at 1
    CTA/SM: 444 programs = 3.36 waves (0.84) -> 2 splits (6.73 waves, 0.96).
    """
    if programs <= 0:
        return 1
    wave = max(1, sm_count * max(1, ctas))
    per_split = _FULL_WAVE_SPLIT_KEYS if max_seqlen_k >= _FULL_WAVE_MIN_KEYS else _MIN_SPLIT_KEYS
    s_max = max(1, min(_MAX_SPLITS, max_seqlen_k // per_split, tiles if tiles is not None else _MAX_SPLITS))

    def efficiency(s: int) -> float:
        waves = programs * s / wave
        return waves / math.ceil(waves)

    full = min(s_max, wave // programs)
    if full > 1 and efficiency(full) >= _TARGET_WAVE_EFFICIENCY:
        return full
    if efficiency(1) >= _TARGET_WAVE_EFFICIENCY:
        return 1
    best = 1
    for s in range(2, s_max + 1):
        if efficiency(s) >= _TARGET_WAVE_EFFICIENCY:
            return s
        if efficiency(s) > efficiency(best):
            best = s
    return best


def _attn_constexprs(cfg: dict, group: int, head_dim: int, *, causal: bool, has_kv_start: bool,
                     write_lse: bool, split: bool, upcast: bool, guard: bool, softcap: bool,
                     block_size: int, elem_bytes: int, large_ok: bool = True, own: bool = False,
                     sink_logits: bool = False, kv_fp8: bool = False, arch: Arch, rope: int = 0,
                     rope_q_pos: bool = False, rope_k_shift: bool = False, wide_offsets: bool = False,
                     same_kv_strides: bool = True, wide_rows: bool = False) -> dict:
    """The constexpr arguments of ``_paged_attn_kernel`` (shared with ``kvarena check``).

    The block layout is specialized three ways: blocks of at least ``BLOCK_N`` rows
    (slabs) take the two-block contiguous path; smaller power-of-two pages pass their size
    as ``PAGE_SIZE`` (shifts, not divides); other page sizes divide at run time. The page
    path addresses keys with int32 offsets unless ``wide_offsets`` (a cache spanning more
    than 2**31 elements, :func:`_cache_addressing`: then a 64-bit block pointer per key and int32
    row offsets), and computes one offset per key for K and V when ``same_kv_strides``.
    Blocks whose own rows span 2**31 elements (``wide_rows``) take the run-time divide with
    64-bit rows. ``PAGE_INTERIOR``: the page path runs the tiles every row sees whole in an
    unmasked loop of their own.
    """
    large = _use_large_blocks(block_size, cfg["BLOCK_N"], large_ok, guard, elem_bytes)
    # The constexpr page path keeps a key's row offset in its block int32: blocks whose rows
    # span 2**31 elements (``wide_rows``) divide at run time, with 64-bit rows.
    page = block_size if not large and not wide_rows and block_size & (block_size - 1) == 0 else 0
    # The page loop's unmasked interior loop is a second copy of the loop body. It spills
    # with RoPE on read (96 B, decode on sm_80) and past the decode tile at head dim 256
    # (8 B for a guarded 64 x 32 chunk on sm_90a; 40 B for fp32 under Triton 3.6): those
    # launches run every tile through the masked loop.
    d256_ok = cfg["BLOCK_M"] <= 16 and elem_bytes < 4
    interior = not large and rope == 0 and (cfg["HEAD_DIM_PAD"] <= 128 or d256_ok)
    return dict(
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=cfg["HEAD_DIM_PAD"], BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"], CAUSAL=causal, HAS_KV_START=has_kv_start, WRITE_LSE=write_lse,
        SPLIT=split, UPCAST=upcast, GUARD_NONFINITE=guard, HAS_SOFTCAP=softcap, PAGE_SIZE=page,
        WIDE_OFFSETS=wide_offsets, SAME_KV_STRIDES=same_kv_strides,
        LARGE_BLOCKS=large, HAS_OWN=own and large, HAS_SINK_LOGITS=sink_logits, KV_FP8=kv_fp8,
        FP8_NATIVE=kv_fp8 and fp8_native(arch), ROPE=rope, ROPE_Q_POS=rope_q_pos and rope != 0,
        ROPE_K_SHIFT=rope_k_shift and rope != 0, PAGE_INTERIOR=interior,
    )


@dataclass(frozen=True)
class CacheAddressing:
    """How the page path addresses a K/V cache pair (host values: shapes and strides)."""

    wide_offsets: bool  # some key's offset from its head's base passes int32
    same_kv_strides: bool  # K and V (and their fp8 scales) share block and token strides: one offset per key
    wide_rows: bool = False  # a block's rows alone span 2**31 elements (its row offsets pass int32)


def _span(shape: tuple, stride: tuple) -> int:
    """Largest element offset within one head of a ``[blocks, block_size, H, D]`` cache view,
    plus one."""
    return (shape[0] - 1) * stride[0] + (shape[1] - 1) * stride[1] + (shape[3] - 1) * stride[3] + 1


def _cache_addressing(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scales=None) -> CacheAddressing:
    """:class:`CacheAddressing` of a cache pair and its fp8 scales (``[blocks, block_size, H]``
    or 0-dim; they span fewer elements than their K). Memoized on shapes and strides: it
    runs per launch."""
    sc = (kv_scales[0].stride()[:2], kv_scales[1].stride()[:2]) if kv_scales is not None else ((), ())
    return _addressing(k_cache.shape, k_cache.stride(), v_cache.shape, v_cache.stride(), sc[0] == sc[1])


@functools.lru_cache(maxsize=64)
def _addressing(k_shape: tuple, k_stride: tuple, v_shape: tuple, v_stride: tuple,
                same_scale_strides: bool) -> CacheAddressing:
    return CacheAddressing(
        wide_offsets=max(_span(k_shape, k_stride), _span(v_shape, v_stride)) > I32_MAX,
        same_kv_strides=k_stride[:2] == v_stride[:2] and same_scale_strides,
        wide_rows=k_shape[1] * max(k_stride[1], v_stride[1]) >= I32_MAX,
    )


def fp8_native(arch: Arch) -> bool:
    """Whether float8_e4m3fn K/V are loaded as Triton's float8e4nv and widened by the hardware
    (targets with OCP fp8: sm_89+, gfx950) rather than decoded from uint8 (sm_80, sm_86,
    gfx942, whose native fp8 is e4m3fnuz: the decode serves OCP e4m3fn caches there). The interpreter takes the decode too: its own
    widening reads the NaN byte 0x7F as 480, where the GPU's conversion and the decode give
    NaN (the native path runs there in tests that monkeypatch this, on finite data)."""
    return arch.fp8_native("float8_e4m3fn") and not interpreting()


def _use_large_blocks(block_size: int, block_n: int, large_ok: bool, guard: bool, elem_bytes: int) -> bool:
    """Whether a launch takes the contiguous large-block path.

    Blocks of at least one key tile (slabs, big pages) of fp16/bf16 qualify, unless the
    non-finite guard is compiled in: on this path it spills (8-20 bytes at 128 x 64 on
    sm_90a, since the sanitized V takes a register round trip in a loop that already holds
    ~234 registers), so guarded launches (multi-row tiles with causal or window masks) keep
    the page path. fp32 (IEEE FMA dots, no tensor cores, not a speed target) keeps it too:
    its D = 256 tile spilt 32-36 bytes here.
    """
    return large_ok and block_size >= block_n and not guard and elem_bytes < 4


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


@dataclass(frozen=True)
class ReduceTile:
    """The split reduce's tile and grid: ``BLOCK_R`` rows x ``BLOCK_D`` of the head dim per
    program, the splits read ``BLOCK_S`` at a time as one vector."""

    BLOCK_R: int
    BLOCK_D: int
    BLOCK_S: int
    grid: tuple[int, int]  # (row blocks, head-dim blocks)

    @property
    def programs(self) -> int:
        return self.grid[0] * self.grid[1]


def _reduce_tile(n_rows: int, head_dim: int, num_splits: int, sm_count: int = _DEFAULT_SM_COUNT,
                 deterministic: bool = False) -> ReduceTile:
    """Tile of the split reduce over ``n_rows`` rows (tokens x query heads) of ``num_splits``
    fp32 partials: a pure function of its args.

    The ``[BLOCK_R, BLOCK_S, BLOCK_D]`` partial tile holds at most ``ROW_TILE_ELEMS`` fp32
    (32 per thread at 4 warps). ``BLOCK_S`` covers every split (up to ``_MAX_SPLITS``; more
    loop in chunks), then up to 4 rows fill the rest; while the grid is under one program
    per SM (B = 1: 32 rows at 30 splits), rows and then the head dim (down to 16) are split
    across programs. ``deterministic``: one tile per head dim, whatever the batch or split
    count, so the order each row's partials are summed in never depends on the batch.
    """
    d_pad = head_dim_pad(head_dim)
    if deterministic:
        block_s = 16
        block_d = min(d_pad, ROW_TILE_ELEMS // block_s)
        block_r = max(1, min(4, ROW_TILE_ELEMS // (block_s * block_d)))
    else:
        block_s = min(triton.next_power_of_2(max(1, num_splits)), _MAX_SPLITS)
        block_d = min(d_pad, max(16, ROW_TILE_ELEMS // block_s))
        block_r = max(1, min(4, ROW_TILE_ELEMS // (block_s * block_d)))
        while triton.cdiv(n_rows, block_r) * triton.cdiv(head_dim, block_d) < sm_count:
            if block_r > 1:
                block_r //= 2
            elif block_d > 16:
                block_d //= 2
            else:
                break
    return ReduceTile(block_r, block_d, block_s, (triton.cdiv(n_rows, block_r), triton.cdiv(head_dim, block_d)))


@dataclass(frozen=True)
class LaunchPlan:
    """What one attention launch runs: tile config, grid and split (pure host data)."""

    cfg: dict
    num_q_tiles: int
    programs: int  # unsplit grid: q tiles x sequences x kv heads
    num_splits: int
    tiles_per_split: int
    ctas_per_sm: int
    guard: bool
    large_ok: bool
    own: bool  # the step's own keys are a second key source of this launch
    arch: Arch  # the target it was planned for (its SM count sizes the waves)

    def wave_efficiency(self) -> float:
        """CTAs / (ceil(waves) x SMs x CTAs per SM) of the split grid."""
        ctas = self.programs * self.num_splits
        slots = self.arch.sm_count * max(1, self.ctas_per_sm)
        return ctas / (math.ceil(ctas / slots) * slots)


def plan_launch(*, head_dim: int, group: int, elem_bytes: int, num_seqs: int, num_kv_heads: int,
                max_seqlen_q: int, max_seqlen_k: int, block_size: int, causal: bool, window_left, sink_tokens: int,
                softcap: bool, num_splits, deterministic: bool, arch: Arch | str = DEFAULT_ARCH,
                large_ok: bool = True, own_len: int = 0, rope: bool = False, kv_fp8: bool = False) -> LaunchPlan:
    """The launch a call gets, from host values only (no tensor, no compile, no device read).

    The launcher runs it for every call; ``kvarena check --perf`` runs it for the
    contract's workloads to report grids and waves, per target. ``arch`` is the target's
    record (or its name): on a GPU the device's, under the interpreter ``KVARENA_ARCH``'s
    (default sm_90a), so CPU tests get the grid that GPU would run.

    ``own_len > 0`` asks for a second key source of ``own_len`` rows per sequence (a
    denoising step's own keys, every query sees them): ``plan.own`` says whether this
    launch can take it (the large-block path, no causal mask, no window); else the caller
    attends to it in a launch of its own and merges.
    """
    if isinstance(arch, str):
        arch = arch_named(arch)
    sm_count = arch.sm_count
    guard = _needs_guard(max_seqlen_q, causal, window_left)
    # The deterministic pin ignores the batch: its config must not depend on max_seqlen_q,
    # and neither may its path (the guard, which depends on the batch's query lengths, keeps
    # a launch off the large-block path, whose tiles start at block starts): page path only.
    lean = not deterministic and not guard and not softcap
    large_ok = large_ok and not deterministic
    # own: the config of a launch that may take the own keys (the tile decides the path).
    own_ok = own_len > 0 and not causal and window_left is None
    cfg = _pick_config(head_dim, group, elem_bytes, None if deterministic else max_seqlen_q, arch, lean=lean,
                       rope=rope, kv_fp8=kv_fp8, own=own_ok)
    num_q_tiles = triton.cdiv(max_seqlen_q * group, cfg["BLOCK_M"])
    programs = num_q_tiles * num_seqs * num_kv_heads
    has_sinks = window_left is not None and sink_tokens > 0
    if num_splits is None and not deterministic and not rope and _wants_short_tiles(
            cfg, programs, max_seqlen_k, has_sinks, sm_count,
            ctas_per_sm(arch, cfg, elem_bytes, launch_kind(kv_fp8=kv_fp8, rope=rope, own=False))):
        cfg = _short_context_config(cfg)
    block_n = cfg["BLOCK_N"]
    # On the large-block path tiles restart at every block start (below).
    max_tiles = _key_tiles(max_seqlen_k, block_n, has_sinks)
    large = _use_large_blocks(block_size, block_n, large_ok, guard, elem_bytes)
    cfg = _path_config(cfg, large, arch, kv_fp8)
    if large:
        max_tiles = (triton.cdiv(max(max_seqlen_k, 1), block_size) + 1) * triton.cdiv(block_size, block_n)
    own = own_len > 0 and large and not causal and window_left is None
    if own:
        max_tiles += triton.cdiv(own_len, block_n)
        max_seqlen_k += own_len
    ctas = ctas_per_sm(arch, cfg, elem_bytes, launch_kind(kv_fp8=kv_fp8, rope=rope, own=own))
    tiles_per_split = 0  # 0: each program divides its own key tiles evenly over the splits
    if deterministic and num_splits != 1:
        # Fixed 4096 keys per split whatever the batch (an explicit count other than 1,
        # which would make the split size depend on max_seqlen_k, is not honoured).
        tiles_per_split = max(1, _DET_SPLIT_KEYS // block_n)
        num_splits = triton.cdiv(max_tiles, tiles_per_split)
    elif num_splits is None:
        num_splits = _pick_num_splits(programs, max_seqlen_k, sm_count, ctas, max_tiles)
    # More splits than key tiles would only add empty partials; 65535 is grid axis 1's cap.
    num_splits = max(1, min(num_splits, max_tiles, 65535))
    return LaunchPlan(cfg, num_q_tiles, programs, num_splits, tiles_per_split, ctas, guard, large_ok, own, arch)


@dataclass(frozen=True)
class LaunchShape:
    """The host values an attention launch is planned from: shapes and which optional
    operands it reads (no tensor; :func:`launch_shape` reads them off the call's tensors)."""

    head_dim: int
    group: int  # query heads per kv head
    elem_bytes: int  # of q (the dots' dtype)
    num_seqs: int
    num_kv_heads: int
    max_seqlen_q: int
    max_seqlen_k: int
    block_size: int
    own_len: int | None = None  # the step's own keys per sequence (None: none)
    has_kv_start: bool = False
    write_lse: bool = False
    kv_fp8: bool = False
    rope_q_pos: bool = False
    rope_k_shift: bool = False
    addressing: CacheAddressing = CacheAddressing(wide_offsets=False, same_kv_strides=True)


@dataclass(frozen=True)
class AttentionLaunch:
    """One ``_paged_attn_kernel`` launch, planned before any tensor is touched: the
    :class:`LaunchPlan` (target, tile, grid, splits), the kernel's constexprs, the pointer
    arguments they leave unread (passed as None) and the scalar mask arguments. The
    launcher, ``kvarena check`` and the tests read this object; nothing re-derives it."""

    plan: LaunchPlan
    meta: dict  # the constexprs of _paged_attn_kernel (_attn_constexprs)
    unused: frozenset[str]  # pointer arguments the constexprs leave unread: passed as None
    scale_log2: float
    softcap_inv: float
    softcap_log2: float
    causal_chunk: int  # chunk_size of the causal rule (1: plain causal or no causal mask)
    window: int  # window_left, capped at _NO_WINDOW (the cap when there is no window)
    sinks: int  # sink_tokens when there is a window, else 0

    @property
    def arch(self) -> Arch:
        return self.plan.arch

    @property
    def split(self) -> bool:
        return self.plan.num_splits > 1

    @property
    def grid(self) -> tuple[int, int]:
        return (self.plan.programs, self.plan.num_splits)


def launch_shape(q, k_cache, v_cache, *, num_seqs: int, max_seqlen_q: int, max_seqlen_k: int,
                 own_len: int | None, has_kv_start: bool, write_lse: bool, kv_scales, rope_q_pos: bool,
                 rope_k_shift: bool) -> LaunchShape:
    """The :class:`LaunchShape` of a call, read off its tensors' shapes and strides."""
    h_kv = k_cache.shape[2]
    return LaunchShape(
        head_dim=q.shape[2], group=q.shape[1] // h_kv, elem_bytes=q.element_size(), num_seqs=num_seqs,
        num_kv_heads=h_kv, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, block_size=k_cache.shape[1],
        own_len=own_len, has_kv_start=has_kv_start, write_lse=write_lse, kv_fp8=kv_scales is not None,
        rope_q_pos=rope_q_pos, rope_k_shift=rope_k_shift, addressing=_cache_addressing(k_cache, v_cache, kv_scales))


def plan_attention(shape: LaunchShape, spec, arch: Arch | str, *, upcast: bool | None = None) -> AttentionLaunch | None:
    """The one launch plan: (target, spec, shapes) -> :class:`AttentionLaunch`, a pure
    function of host values. None when the launch cannot take ``shape.own_len`` own keys per
    sequence (see :func:`plan_launch`); the caller then attends to them separately.
    ``upcast``: widen bf16/fp16 inside the kernel (the interpreter's need; default: whether
    the interpreter runs)."""
    if isinstance(arch, str):
        arch = arch_named(arch)
    causal, chunk_size, window_left, softcap = spec.causal, spec.chunk_size, spec.window_left, spec.softcap
    if causal and chunk_size is not None and chunk_size >= shape.max_seqlen_k:
        # Every position lies in chunk 0: block-causal is full attention (and the chunk
        # end (p // C + 1) * C could pass int32 for a huge C).
        causal = False
    addressing = shape.addressing
    plan = plan_launch(
        head_dim=shape.head_dim, group=shape.group, elem_bytes=shape.elem_bytes, num_seqs=shape.num_seqs,
        num_kv_heads=shape.num_kv_heads, max_seqlen_q=shape.max_seqlen_q, max_seqlen_k=shape.max_seqlen_k,
        block_size=shape.block_size, causal=causal, window_left=window_left, sink_tokens=spec.sink_tokens,
        softcap=bool(softcap), num_splits=spec.num_splits, deterministic=spec.deterministic, arch=arch,
        large_ok=not addressing.wide_rows, own_len=shape.own_len or 0, rope=bool(spec.rope_mode),
        kv_fp8=shape.kv_fp8,
    )
    if shape.own_len is not None and not plan.own:
        return None
    split = plan.num_splits > 1
    meta = _attn_constexprs(plan.cfg, shape.group, shape.head_dim, causal=causal, has_kv_start=shape.has_kv_start,
                            write_lse=shape.write_lse or split, split=split,
                            upcast=interpreting() if upcast is None else upcast,
                            guard=plan.guard, softcap=bool(softcap), block_size=shape.block_size,
                            elem_bytes=shape.elem_bytes, large_ok=plan.large_ok, own=plan.own,
                            sink_logits=spec.sink_logits is not None, kv_fp8=shape.kv_fp8,
                            arch=arch, rope=spec.rope_mode, rope_q_pos=shape.rope_q_pos,
                            rope_k_shift=shape.rope_k_shift, wide_offsets=addressing.wide_offsets,
                            same_kv_strides=addressing.same_kv_strides, wide_rows=addressing.wide_rows)
    scale = spec.scale_for(shape.head_dim)
    return AttentionLaunch(
        plan, meta, unused_pointers(meta), scale * LOG2E,
        softcap_inv=scale / softcap if softcap else 0.0, softcap_log2=softcap * LOG2E if softcap else 0.0,
        causal_chunk=(chunk_size if chunk_size is not None else 1) if causal else 1,
        window=_NO_WINDOW if window_left is None else min(window_left, _NO_WINDOW),
        sinks=spec.sink_tokens if window_left is not None else 0,
    )


@dataclass(frozen=True, eq=False)
class _Outputs:
    """Where the attention kernel writes: the split partials, or (unsplit) the caller's
    ``out`` / ``lse`` or, for a view whose rows pass the int32 tile offsets, a fresh copy."""

    o: torch.Tensor
    o_strides: tuple[int, ...]  # (split, token, head, dim)
    lse: torch.Tensor | None  # None when no lse is written
    lse_strides: tuple[int, ...]  # (split, token, head)
    lse_target: torch.Tensor | None  # unsplit: the lse written (None: none)


def _outputs(out: torch.Tensor, lse: torch.Tensor | None, fwd: AttentionLaunch, group: int) -> _Outputs:
    if fwd.split:
        part = torch.empty((fwd.plan.num_splits, *out.shape), dtype=torch.float32, device=out.device)
        part_lse = torch.empty((fwd.plan.num_splits, *out.shape[:2]), dtype=torch.float32, device=out.device)
        return _Outputs(part, part.stride(), part_lse, part_lse.stride(), None)
    block_m = fwd.plan.cfg["BLOCK_M"]
    out_k, lse_k = out, lse
    if _tile_span(out, block_m, group) > I32_MAX:
        out_k = torch.empty(out.shape, dtype=out.dtype, device=out.device)
    if lse is not None and _tile_span(lse, block_m, group) > I32_MAX:
        lse_k = torch.empty(lse.shape, dtype=lse.dtype, device=lse.device)
    if lse_k is None:  # never written when WRITE_LSE is False
        return _Outputs(out_k, (0, *out_k.stride()), None, (0, 0, 0), None)
    return _Outputs(out_k, (0, *out_k.stride()), lse_k, (0, *lse_k.stride()), lse_k)


@dataclass(frozen=True, eq=False)
class _RopeOperands:
    """The kernel's RoPE-on-read arguments (None where the launch reads none)."""

    cos: torch.Tensor | None
    sin: torch.Tensor | None
    q_pos: torch.Tensor | None
    k_shift: torch.Tensor | None
    stride_rp: int
    stride_rb: int
    n_pos: int


def _rope_operands(spec, rope_q_pos, rope_k_shift) -> _RopeOperands:
    on = bool(spec.rope_mode)
    cos, sin = (spec.rope_cos, spec.rope_sin) if on else (None, None)
    k_shift = rope_k_shift
    if rope_k_shift is not None and rope_k_shift.shape[1] > 1 and rope_k_shift.stride(1) != 1:
        k_shift = rope_k_shift.contiguous()
    return _RopeOperands(cos, sin, rope_q_pos.contiguous() if rope_q_pos is not None else None, k_shift,
                         stride_rp=cos.stride(0) if on else 0,
                         stride_rb=k_shift.stride(0) if rope_k_shift is not None else 0,
                         n_pos=cos.shape[0] if on else 1)


def unused_pointers(meta: dict) -> frozenset[str]:
    """The pointer arguments of ``_paged_attn_kernel`` that its constexprs ``meta`` leave
    unread: the launcher passes them as None (constexpr), and ``kvarena check`` compiles them
    so. Memoized on the flags that decide it: it runs per launch."""
    return _unused_pointers(meta["WRITE_LSE"], meta["HAS_KV_START"], meta["HAS_OWN"],
                            meta["HAS_SINK_LOGITS"] and not meta["SPLIT"],  # a split leaves the sink to the reduce
                            meta["KV_FP8"], bool(meta["ROPE"]), meta["ROPE_Q_POS"], meta["ROPE_K_SHIFT"])


@functools.lru_cache(maxsize=64)
def _unused_pointers(lse: bool, kv_start: bool, own: bool, sink: bool, fp8: bool, rope: bool, rope_q_pos: bool,
                     rope_k_shift: bool) -> frozenset[str]:
    read = {
        "lse_ptr": lse, "kv_start_ptr": kv_start, "own_k_ptr": own, "own_v_ptr": own, "sink_ptr": sink,
        "ks_ptr": fp8, "vs_ptr": fp8, "cos_ptr": rope, "sin_ptr": rope, "qpos_ptr": rope_q_pos,
        "kshift_ptr": rope_k_shift,
    }
    return frozenset(name for name, on in read.items() if not on)


def _launch_attention(fwd: AttentionLaunch, dst: _Outputs, q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q,
                      kv_start, sink, spec, own_k, own_v, kv_scales, rope_q_pos, rope_k_shift) -> None:
    """One ``_paged_attn_kernel`` launch of ``fwd`` into ``dst``."""
    # 1-D metadata is read with unit stride; .contiguous() is free when it already is.
    seq_lens, cu_seqlens_q = seq_lens.contiguous(), cu_seqlens_q.contiguous()
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    ks = vs = None
    sc_strides = (0,) * 6
    if kv_scales is not None:
        ks, vs = kv_scales
        if ks.dim():
            sc_strides = (*ks.stride(), *vs.stride())
        if not fwd.meta["FP8_NATIVE"]:
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    own = fwd.plan.own
    own_strides = (*own_k.stride()[-4:-1], *own_v.stride()[-4:-1]) if own else (0,) * 6
    rope = _rope_operands(spec, rope_q_pos, rope_k_shift)
    pointers = dict(
        q_ptr=q, k_ptr=k_cache, v_ptr=v_cache, o_ptr=dst.o, lse_ptr=dst.lse, block_table_ptr=block_table,
        seq_lens_ptr=seq_lens, cu_q_ptr=cu_seqlens_q,
        kv_start_ptr=kv_start.contiguous() if kv_start is not None else None, own_k_ptr=own_k, own_v_ptr=own_v,
        sink_ptr=sink, ks_ptr=ks, vs_ptr=vs, cos_ptr=rope.cos, sin_ptr=rope.sin, qpos_ptr=rope.q_pos,
        kshift_ptr=rope.k_shift,
    )
    for name in fwd.unused:
        pointers[name] = None
    cfg, plan = fwd.plan.cfg, fwd.plan
    _paged_attn_kernel[fwd.grid](
        *(pointers[name] for name in _POINTER_ARGS),
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *sc_strides,
        *own_strides,
        *dst.o_strides, *dst.lse_strides,
        block_table.stride(0), rope.stride_rp, rope.stride_rb,
        fwd.scale_log2, fwd.softcap_inv, fwd.softcap_log2,
        k_cache.shape[1], fwd.causal_chunk, fwd.window, fwd.sinks, own_k.shape[1] if own else 0,
        k_cache.shape[2], plan.num_q_tiles, plan.tiles_per_split, rope.n_pos,
        **fwd.meta, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], maxnreg=cfg["maxnreg"],
    )


# The kernel's pointer arguments, in order (the launch passes them by this list).
_POINTER_ARGS = tuple(name for name in _paged_attn_kernel.arg_names if name.endswith("_ptr"))


def _launch_reduce(fwd: AttentionLaunch, dst: _Outputs, out: torch.Tensor, lse: torch.Tensor | None, sink) -> None:
    """``_split_reduce_kernel``: the split partials of ``dst`` into ``out`` (and ``lse``)."""
    split_reduce(dst.o, dst.lse, out, lse, sink if fwd.meta["HAS_SINK_LOGITS"] else None,
                 deterministic=fwd.plan.tiles_per_split > 0)


def split_reduce(part: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
                 sink_logits: torch.Tensor | None = None, *, deterministic: bool = False) -> None:
    """Merge ``[S, T, H, D]`` fp32 partials (unit head-dim stride) with their ``[S, T, H]``
    lse (log2 units, as the split kernel writes them; -inf: an empty split, whose partial is
    never read) into ``out`` ``[T, H, D]`` and (if not None) ``lse`` ``[T, H]`` (natural
    log); ``sink_logits`` ``[H]`` join each denominator once. The tile is
    :func:`_reduce_tile`'s (``deterministic``: the batch-invariant one)."""
    num_splits, total_q, h_q, head_dim = part.shape
    n_rows = total_q * h_q
    tile = _reduce_tile(n_rows, head_dim, num_splits, _arch(_device_index(out)).sm_count, deterministic=deterministic)
    lse_strides = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
    _split_reduce_kernel[tile.grid](
        part, part_lse, out, lse,
        part.stride(0), part.stride(1), part.stride(2),
        part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        *lse_strides,
        sink_logits,
        n_rows, h_q, num_splits,
        HEAD_DIM=head_dim, BLOCK_D=tile.BLOCK_D, BLOCK_R=tile.BLOCK_R, BLOCK_S=tile.BLOCK_S,
        WRITE_LSE=lse is not None, HAS_SINK_LOGITS=sink_logits is not None, num_warps=ROW_TILE_WARPS,
    )


def paged_attention_fwd(
    q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, out, lse, *,
    spec, max_seqlen_q, max_seqlen_k, own_k=None, own_v=None, kv_scales=None, rope_q_pos=None, rope_k_shift=None,
) -> bool:
    """Launch block-table attention; writes ``out`` and (if not None) ``lse`` in place.

    Arguments are validated by ``kvarena.attention.ops``; ``spec`` is an
    ``AttentionSpec`` (its normalized fields are read here). No host read of device
    data: the grid comes from ``max_seqlen_q`` / ``max_seqlen_k`` alone.

    ``own_k``, ``own_v``, each ``[B, T, H_kv, D]`` (last dim contiguous): keys after each
    sequence's cached ones that every query sees (a denoising step's own keys), attended in
    the same launch and the same online softmax. Returns False, launching nothing, when
    this launch cannot take them (see :func:`plan_launch`); True otherwise.

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
    if q.shape[0] == 0 or seq_lens.shape[0] == 0 or max_seqlen_q == 0:
        return True  # no query row exists
    if not spec.rope_mode:
        rope_q_pos = rope_k_shift = None
    shape = launch_shape(q, k_cache, v_cache, num_seqs=seq_lens.shape[0], max_seqlen_q=max_seqlen_q,
                         max_seqlen_k=max_seqlen_k, own_len=None if own_k is None else own_k.shape[1],
                         has_kv_start=kv_start is not None, write_lse=lse is not None, kv_scales=kv_scales,
                         rope_q_pos=rope_q_pos is not None, rope_k_shift=rope_k_shift is not None)
    fwd = plan_attention(shape, spec, _arch(_device_index(q)))
    if fwd is None:
        return False
    group = q.shape[1] // k_cache.shape[2]
    sink = spec.sink_logits
    # The kernel addresses rows as an int64 tile base + int32 in-tile offsets; a view with a
    # row stride near 2**31 / BLOCK_M elements (never a real activation) goes via a copy.
    if _tile_span(q, fwd.plan.cfg["BLOCK_M"], group) > I32_MAX:
        q = q.contiguous()
    dst = _outputs(out, lse, fwd, group)
    _launch_attention(fwd, dst, q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, sink, spec,
                      own_k, own_v, kv_scales, rope_q_pos, rope_k_shift)
    if fwd.split:
        _launch_reduce(fwd, dst, out, lse, sink)
        return True
    if dst.o is not out:
        out.copy_(dst.o)
    if dst.lse_target is not lse:
        lse.copy_(dst.lse_target)
    return True
