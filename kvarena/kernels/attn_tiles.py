"""The forward attention kernel's key loops: the block loop (blocks of at least one key tile:
slabs, big pages) and the page loop (through the block table, a few keys per page).

Each loop runs one *stage* of a run of key tiles (cf. the ``STAGE`` of Triton's
fused-attention tutorial): ``STAGE_BOUNDARY``, the tiles at either end of a
:class:`TileSpan` that some row sees only in part (masked; the interior run skipped over),
or ``STAGE_INTERIOR``, the tiles in between that every row sees whole (no mask code; the
block loop software-pipelines them where that pays). The kernel runs both stages of a span
from one call site (``tl.static_range`` over the stages).
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from kvarena.kernels.attn_math import (
    OnlineSoftmax,
    RopeTable,
    ScoreScale,
    _dot_operand,
    _fp8_column_scales,
    _key_operand,
    _online_probs,
    _rope_index,
    _scale_scores,
    _scores,
    _softmax_step,
    _upcast,
)
from kvarena.kernels.key_range import sees, virtual_tile

#: The stages of a span of key tiles (constexprs; the kernel loops over them in this order).
STAGE_BOUNDARY: tl.constexpr = tl.constexpr(1)
STAGE_INTERIOR: tl.constexpr = tl.constexpr(2)

# ----------------------------------------------------------------------------- records


class TileSpan(NamedTuple):
    """Key tiles ``[first, end)`` of which ``[interior_lo, interior_hi)`` every row sees whole."""

    first: object
    interior_lo: object
    interior_hi: object
    end: object


class RowBounds(NamedTuple):
    """Which keys each query row sees (:func:`kvarena.kernels.key_range.sees`)."""

    hi: object  # [BLOCK_M] exclusive end of each row's keys
    lo: object  # [BLOCK_M] inclusive start of each row's window (before it: only sinks)
    sink_tokens: object


class BlockKV(NamedTuple):
    """One large block's keys for the block loop: K/V (and fp8 scale) pointers to the block's
    row 0 of the kv head, their token strides, the block's first key position ``start``,
    the key range ``[key_lo, key_hi)`` its boundary tiles mask to, and ``rope_shift``: key
    at block row r takes rotary table row ``start + r + rope_shift``."""

    k: object
    v: object
    k_scale: object  # None unless fp8
    v_scale: object
    stride_k: object
    stride_v: object
    stride_ks: object
    stride_vs: object
    start: object
    key_lo: object
    key_hi: object
    rope_shift: object


class PagedKV(NamedTuple):
    """A sequence's keys for the page loop: its block-table row, K/V (and fp8 scale) pointers
    to the kv head in block 0, their block and token strides, the block size, and its RoPE
    key-shift row (ROPE_K_SHIFT)."""

    table: object
    k: object
    v: object
    k_scale: object
    v_scale: object
    stride_kb: object
    stride_kt: object
    stride_vb: object
    stride_vt: object
    stride_ksb: object
    stride_kst: object
    stride_vsb: object
    stride_vst: object
    block_size: object
    kshift: object


class KeyRanges(NamedTuple):
    """A query tile's key ranges as the page loop numbers its virtual tiles: the sink range
    ``[kv_lo, sink_hi)`` (``n_sink`` tiles from ``sink_base``), then the main range ``[lo, hi)``
    (from ``main_base``); ``hi_min`` / ``lo_max``: the bounds every row of the tile sees."""

    n_sink: object
    sink_base: object
    main_base: object
    kv_lo: object
    sink_hi: object
    lo: object
    hi: object
    hi_min: object
    lo_max: object


# ----------------------------------------------------------------------------- addressing


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
    return head + _per_key(x=blk, PAGES=PAGES, BLOCK_N=BLOCK_N).to(tl.uint32).to(tl.int64) * stride_b


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
    return _upcast(x=x, UPCAST=UPCAST)


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
def _stage_run(span: TileSpan, STAGE: tl.constexpr):
    """The tiles one stage of ``span`` runs: ``(first, count, gap_at, gap_len)``. The boundary
    stage runs both ends in one loop: its tiles from ``gap_at`` on skip ahead by ``gap_len``
    (over the interior run); the interior stage has no gap."""
    if STAGE == STAGE_BOUNDARY:
        first = span.first
        count = (span.interior_lo - span.first) + (span.end - span.interior_hi)
        gap_at = span.interior_lo
        gap_len = span.interior_hi - span.interior_lo
    else:
        first = span.interior_lo
        count = span.interior_hi - span.interior_lo
        gap_at = 0
        gap_len = 0
    return first, count, gap_at, gap_len


# ----------------------------------------------------------------------------- the block loop


@triton.jit
def _interior_pipelined(q, kv: BlockKV, j_lo, n_tiles, m_i, l_i, acc, scale: ScoreScale, HEAD_DIM: tl.constexpr,
                        HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                        UPCAST: tl.constexpr):
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
        s_raw = tl.dot(q, _load_tile(blk=kv.k, rel=rel, stride_t=kv.stride_k, d=d, d_ok=d_ok, HEAD_DIM=HEAD_DIM,
                                     HEAD_DIM_PAD=HEAD_DIM_PAD, KT=True, UPCAST=UPCAST),
                       input_precision="ieee")
        for _ in range(0, n_tiles - 1):
            s = _scale_scores(s=s_raw, kcol=None, scale=scale, HAS_SOFTCAP=HAS_SOFTCAP, FP8=False, FOLD=False,
                              ROWS=False)
            m_i, l_i, alpha, pr = _online_probs(s=s, m_i=m_i, l_i=l_i)
            kt = _load_tile(blk=kv.k, rel=rel + BLOCK_N, stride_t=kv.stride_k, d=d, d_ok=d_ok, HEAD_DIM=HEAD_DIM,
                            HEAD_DIM_PAD=HEAD_DIM_PAD, KT=True, UPCAST=UPCAST)
            s_raw = tl.dot(q, kt, input_precision="ieee")
            v = _load_tile(blk=kv.v, rel=rel, stride_t=kv.stride_v, d=d, d_ok=d_ok, HEAD_DIM=HEAD_DIM,
                           HEAD_DIM_PAD=HEAD_DIM_PAD, KT=False, UPCAST=UPCAST)
            acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v, input_precision="ieee")
            rel += BLOCK_N
        s = _scale_scores(s=s_raw, kcol=None, scale=scale, HAS_SOFTCAP=HAS_SOFTCAP, FP8=False, FOLD=False,
                          ROWS=False)
        m_i, l_i, alpha, pr = _online_probs(s=s, m_i=m_i, l_i=l_i)
        v = _load_tile(blk=kv.v, rel=rel, stride_t=kv.stride_v, d=d, d_ok=d_ok, HEAD_DIM=HEAD_DIM,
                       HEAD_DIM_PAD=HEAD_DIM_PAD, KT=False, UPCAST=UPCAST)
        acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v, input_precision="ieee")
    return m_i, l_i, acc


@triton.jit
def _block_tiles(
    q, kv: BlockKV, span: TileSpan, state: OnlineSoftmax, rows: RowBounds, scale: ScoreScale, rope: RopeTable,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, STAGE: tl.constexpr,
    GUARD: tl.constexpr, HAS_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, FP8: tl.constexpr,
    FP8_NATIVE: tl.constexpr, ROPE: tl.constexpr, ROWS: tl.constexpr, PIPELINE: tl.constexpr = True,
):
    """One stage of ``span``'s key tiles of one large block, at block rows ``j * BLOCK_N``.

    Contiguous addressing from the block's base pointers (no block-table gather, no
    divide). ``STAGE_INTERIOR``: every key of every tile is visible to every row, so there is
    no mask code at all; ``STAGE_BOUNDARY``: the span's few boundary tiles, both ends in one
    loop. ``ROPE``: keys are rotated as loaded (``kv.rope_shift``). ``PIPELINE``: an interior
    run of q-dtype keys (no fp8, no RoPE) at ``HEAD_DIM_PAD <= 128`` over key tiles of at
    least 64 (the wgmma tiles of sm_90a; sm_80's chunk tiles are 16 keys) takes
    :func:`_interior_pipelined`; the others keep one tile after the other (the second live
    score tile spills there: fp8 beside the own keys under Triton 3.9, D = 256 and sm_80's
    MAGI tile under 3.6).
    """
    j_lo, n_tiles, gap_at, gap_len = _stage_run(span=span, STAGE=STAGE)
    m_i, l_i, acc, bad_w = state
    if PIPELINE and STAGE == STAGE_INTERIOR and ROPE == 0 and not FP8 and HEAD_DIM_PAD <= 128 and BLOCK_N >= 64:
        m_i, l_i, acc = _interior_pipelined(q=q, kv=kv, j_lo=j_lo, n_tiles=n_tiles, m_i=m_i, l_i=l_i, acc=acc,
                                            scale=scale, HEAD_DIM=HEAD_DIM, HEAD_DIM_PAD=HEAD_DIM_PAD,
                                            BLOCK_N=BLOCK_N, HAS_SOFTCAP=HAS_SOFTCAP, UPCAST=UPCAST)
    else:
        m_i, l_i, acc, bad_w = _block_tiles_loop(
            q=q, kv=kv, j_lo=j_lo, n_tiles=n_tiles, gap_at=gap_at, gap_len=gap_len, state=OnlineSoftmax(m_i, l_i, acc, bad_w),
            rows=rows, scale=scale, rope=rope, HEAD_DIM=HEAD_DIM, HEAD_DIM_PAD=HEAD_DIM_PAD, BLOCK_N=BLOCK_N,
            MASKED=STAGE == STAGE_BOUNDARY, GUARD=GUARD, HAS_SOFTCAP=HAS_SOFTCAP, UPCAST=UPCAST, FP8=FP8,
            FP8_NATIVE=FP8_NATIVE, ROPE=ROPE, ROWS=ROWS)
    return OnlineSoftmax(m_i, l_i, acc, bad_w)


@triton.jit
def _block_tiles_loop(
    q, kv: BlockKV, j_lo, n_tiles, gap_at, gap_len, state: OnlineSoftmax, rows: RowBounds, scale: ScoreScale,
    rope: RopeTable, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    GUARD: tl.constexpr, HAS_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, FP8: tl.constexpr,
    FP8_NATIVE: tl.constexpr, ROPE: tl.constexpr, ROWS: tl.constexpr,
):
    """:func:`_block_tiles`' loop, one tile after the other (masked tiles, fp8, RoPE)."""
    m_i, l_i, acc, bad_w = state
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    n_off = tl.arange(0, BLOCK_N)
    pd, fi, sg = None, None, None  # RoPE's index tiles
    if ROPE != 0:
        pd, fi, sg = _rope_index(d=d, HEAD_DIM=HEAD_DIM, ROPE=ROPE)
    for jj in range(0, n_tiles):
        j = j_lo + jj
        if MASKED:
            j = tl.where(j >= gap_at, j + gap_len, j)
        rel = j * BLOCK_N + n_off  # [BLOCK_N] rows within the block
        t = kv.start + rel  # [BLOCK_N] logical key positions
        if MASKED:
            key_ok = (t >= kv.key_lo) & (t < kv.key_hi)
            kt = tl.load(kv.k + rel[None, :] * kv.stride_k + d[:, None], mask=key_ok[None, :] & d_ok[:, None],
                         other=0.0)  # [HEAD_DIM_PAD, BLOCK_N]
        else:
            kt = _load_tile(blk=kv.k, rel=rel, stride_t=kv.stride_k, d=d, d_ok=d_ok, HEAD_DIM=HEAD_DIM,
                            HEAD_DIM_PAD=HEAD_DIM_PAD, KT=True, UPCAST=False)
        kp = None  # RoPE: the partner rows of the same keys (an L1 hit)
        k_ok = None
        if ROPE != 0:
            k_ok = d_ok[:, None] & (key_ok[None, :] if MASKED else (n_off >= 0)[None, :])
            kp = tl.load(kv.k + rel[None, :] * kv.stride_k + pd[:, None], mask=k_ok, other=0.0)
        kt = _key_operand(kt=kt, kp=kp, kpos=t + kv.rope_shift, fi=fi, sg=sg, rot_ok=k_ok, rope=rope,
                          dot_dtype=q.dtype, UPCAST=UPCAST, FP8=FP8, FP8_NATIVE=FP8_NATIVE, ROPE=ROPE)
        kcol = None  # the fp8 column scales (FP8 only)
        vcol = None
        if FP8:
            kcol, vcol = _fp8_column_scales(ks_ptrs=kv.k_scale + rel * kv.stride_ks,
                                            vs_ptrs=kv.v_scale + rel * kv.stride_vs,
                                            key_ok=key_ok if MASKED else None, MASKED=MASKED, FP8_NATIVE=FP8_NATIVE)
        s = _scores(q=q, kt=kt, kcol=kcol, scale=scale, HAS_SOFTCAP=HAS_SOFTCAP, FP8=FP8, FOLD=False, ROWS=ROWS)
        if MASKED:
            s = tl.where(key_ok[None, :] & sees(t=t, row_hi=rows.hi, row_lo=rows.lo, sink_tokens=rows.sink_tokens), s, float("-inf"))
            v = tl.load(kv.v + rel[:, None] * kv.stride_v + d[None, :], mask=key_ok[:, None] & d_ok[None, :],
                        other=0.0)  # [BLOCK_N, HEAD_DIM_PAD]
        else:
            v = _load_tile(blk=kv.v, rel=rel, stride_t=kv.stride_v, d=d, d_ok=d_ok, HEAD_DIM=HEAD_DIM,
                           HEAD_DIM_PAD=HEAD_DIM_PAD, KT=False, UPCAST=False)
        v = _dot_operand(x=v, dot_dtype=q.dtype, UPCAST=UPCAST, FP8=FP8, FP8_NATIVE=FP8_NATIVE)
        m_i, l_i, acc, bad_w = _softmax_step(s=s, v=v, vcol=vcol, m_i=m_i, l_i=l_i, acc=acc, bad_w=bad_w,
                                             GUARD=GUARD and MASKED, guard_now=True, FP8=FP8)
    return m_i, l_i, acc, bad_w


# ----------------------------------------------------------------------------- the page loop


@triton.jit
def _page_tiles(
    q, span: TileSpan, ranges: KeyRanges, rows: RowBounds, state: OnlineSoftmax, kv: PagedKV, scale: ScoreScale,
    rope: RopeTable, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, WIDE_OFFSETS: tl.constexpr, SAME_KV_STRIDES: tl.constexpr, STAGE: tl.constexpr,
    GUARD: tl.constexpr, HAS_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, KV_FP8: tl.constexpr,
    FP8_NATIVE: tl.constexpr, ROPE: tl.constexpr, ROPE_K_SHIFT: tl.constexpr, F16_DOTS: tl.constexpr,
):
    """One stage of ``span``'s virtual key tiles, through the block table (the page loop).

    Virtual tiles run over the sink range (the first ``ranges.n_sink``), then the main
    range; tile starts are multiples of ``BLOCK_N``. ``STAGE_BOUNDARY``: a key outside its
    tile's range reads the range's nearest key (a written slot of a real block, so the
    loads need no mask and table padding is never followed) and its score is masked, as
    are the keys a row does not see. ``STAGE_INTERIOR``: main-range tiles that every row
    sees whole, with no clamp and no mask code.
    """
    MASKED: tl.constexpr = STAGE == STAGE_BOUNDARY
    i_lo, n_tiles, gap_at, gap_len = _stage_run(span=span, STAGE=STAGE)
    m_i, l_i, acc, bad_w = state
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    n_off = tl.arange(0, BLOCK_N)
    pd, fi, sg = None, None, None  # RoPE's index tiles
    if ROPE != 0:
        pd, fi, sg = _rope_index(d=d, HEAD_DIM=HEAD_DIM, ROPE=ROPE)
    # fp32 (FMA dots) loads K^T as such (the transposed tile spills at D = 256), and fp8 too
    # (its bytes widen in registers either way; the transposed load costs 9 SASS more per
    # tile under Triton 3.6, 2 fewer under 3.9); 16-bit K loads in V's [keys, dims] layout
    # and is transposed.
    K_AS_KT: tl.constexpr = kv.k.dtype.element_ty == tl.float32 or KV_FP8
    # Power-of-two pages a key tile spans (tile starts are multiples of BLOCK_N).
    PAGES: tl.constexpr = BLOCK_N // PAGE_SIZE if PAGE_SIZE > 0 and PAGE_SIZE < BLOCK_N else 1
    # 64-bit addresses: a block pointer per key, 32-bit rows.
    PAGE_BASES: tl.constexpr = WIDE_OFFSETS and PAGE_SIZE > 0
    for ii in range(0, n_tiles):
        i = i_lo + ii
        if MASKED:
            i = tl.where(i >= gap_at, i + gap_len, i)
            t0, key_lo, key_hi = virtual_tile(i=i, n_sink=ranges.n_sink, sink_base=ranges.sink_base,
                                              main_base=ranges.main_base, kv_lo=ranges.kv_lo, sink_hi=ranges.sink_hi,
                                              lo=ranges.lo, hi=ranges.hi, BLOCK_N=BLOCK_N)
            t = t0 + n_off  # [BLOCK_N]
            key_ok = (t >= key_lo) & (t < key_hi)
            tc = tl.minimum(tl.maximum(t, key_lo), key_hi - 1)
        else:
            t0 = ranges.main_base + (i - ranges.n_sink) * BLOCK_N
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
            ids = tl.load(kv.table + pg)  # [PAGES]
            blk = _per_key(x=ids, PAGES=PAGES, BLOCK_N=BLOCK_N)
        else:
            blk_idx = tc // kv.block_size
            row_in_blk = tc % kv.block_size
            blk = tl.load(kv.table + blk_idx)  # [BLOCK_N]
        # K is loaded in V's [keys, dims] layout and transposed for the dot: one address per
        # 16-byte vector. When K and V share block and token strides (SAME_KV_STRIDES, the
        # arena's views) one offset per key serves both.
        if PAGE_BASES:
            k_base = _page_bases(head=kv.k, blk=ids, stride_b=kv.stride_kb, PAGES=PAGES, BLOCK_N=BLOCK_N)
            k_off = row_in_blk * kv.stride_kt
            if SAME_KV_STRIDES:
                v_base = _page_bases(head=kv.v, blk=ids, stride_b=kv.stride_kb, PAGES=PAGES, BLOCK_N=BLOCK_N)
                v_off = k_off
            else:
                v_base = _page_bases(head=kv.v, blk=ids, stride_b=kv.stride_vb, PAGES=PAGES, BLOCK_N=BLOCK_N)
                v_off = row_in_blk * kv.stride_vt
        else:
            k_base = kv.k
            v_base = kv.v
            if WIDE_OFFSETS:  # the cache spans more than 2**31 elements (and maybe a block)
                blk = blk.to(tl.int64)
                row_in_blk = row_in_blk.to(tl.int64)
            k_off = blk * kv.stride_kb + row_in_blk * kv.stride_kt  # [BLOCK_N]
            if SAME_KV_STRIDES:
                v_off = k_off
            else:
                v_off = blk * kv.stride_vb + row_in_blk * kv.stride_vt
        if K_AS_KT:
            kt = tl.load(_rows(base=k_base, off=k_off, d=d, KEYS_LAST=True, PAGE_BASES=PAGE_BASES),
                         mask=d_ok[:, None], other=0.0)
        elif HEAD_DIM == HEAD_DIM_PAD:  # [HEAD_DIM_PAD, BLOCK_N]
            kt = tl.trans(tl.load(_rows(base=k_base, off=k_off, d=d, KEYS_LAST=False, PAGE_BASES=PAGE_BASES)))
        else:
            kt = tl.trans(tl.load(_rows(base=k_base, off=k_off, d=d, KEYS_LAST=False, PAGE_BASES=PAGE_BASES),
                                  mask=d_ok[None, :], other=0.0))
        kp = None
        kpos = tc
        if ROPE != 0:
            if K_AS_KT:
                kp = tl.load(_rows(base=k_base, off=k_off, d=pd, KEYS_LAST=True, PAGE_BASES=PAGE_BASES),
                             mask=d_ok[:, None], other=0.0)
            else:
                kp = tl.trans(tl.load(_rows(base=k_base, off=k_off, d=pd, KEYS_LAST=False, PAGE_BASES=PAGE_BASES),
                                      mask=d_ok[None, :], other=0.0))
            if ROPE_K_SHIFT:
                if PAGE_SIZE > 0:
                    kpos = tc + tl.load(kv.kshift + (tc.to(tl.uint32) // PAGE_SIZE).to(tl.int32))
                else:
                    kpos = tc + tl.load(kv.kshift + blk_idx)
        kt = _key_operand(kt=kt, kp=kp, kpos=kpos, fi=fi, sg=sg, rot_ok=d_ok[:, None], rope=rope, dot_dtype=q.dtype,
                          UPCAST=UPCAST, FP8=KV_FP8, FP8_NATIVE=FP8_NATIVE, ROPE=ROPE)
        kcol = None  # the fp8 column scales (KV_FP8 only)
        vcol = None
        if KV_FP8:
            if PAGE_BASES:
                ks_keys = _page_bases(head=kv.k_scale, blk=ids, stride_b=kv.stride_ksb, PAGES=PAGES,
                                      BLOCK_N=BLOCK_N) + row_in_blk * kv.stride_kst
                if SAME_KV_STRIDES:  # the scales' strides agree too
                    vs_keys = _page_bases(head=kv.v_scale, blk=ids, stride_b=kv.stride_ksb, PAGES=PAGES,
                                          BLOCK_N=BLOCK_N) + row_in_blk * kv.stride_kst
                else:
                    vs_keys = _page_bases(head=kv.v_scale, blk=ids, stride_b=kv.stride_vsb, PAGES=PAGES,
                                          BLOCK_N=BLOCK_N) + row_in_blk * kv.stride_vst
            else:
                ks_off = blk * kv.stride_ksb + row_in_blk * kv.stride_kst
                if SAME_KV_STRIDES:  # the scales' strides agree too
                    vs_off = ks_off
                else:
                    vs_off = blk * kv.stride_vsb + row_in_blk * kv.stride_vst
                ks_keys = kv.k_scale + ks_off
                vs_keys = kv.v_scale + vs_off
            kcol, vcol = _fp8_column_scales(ks_ptrs=ks_keys, vs_ptrs=vs_keys, key_ok=None, MASKED=False,
                                            FP8_NATIVE=FP8_NATIVE)
        s = _scores(q=q, kt=kt, kcol=kcol, scale=scale, HAS_SOFTCAP=HAS_SOFTCAP, FP8=KV_FP8, FOLD=True, ROWS=F16_DOTS)
        guard_now = False
        if MASKED:
            # A masked-loop tile that every row sees whole (a sink tile) skips the per-element
            # mask: ~8 integer ops per score, as many issue slots as the exp2/max/sum.
            t_end = t0 + BLOCK_N
            interior = (t0 >= key_lo) & (t_end <= key_hi) & (t_end <= ranges.hi_min)
            interior = interior & ((t0 >= ranges.lo_max) | (t_end <= rows.sink_tokens))
            if not interior:
                s = tl.where(key_ok[None, :] & sees(t=t, row_hi=rows.hi, row_lo=rows.lo, sink_tokens=rows.sink_tokens),
                             s, float("-inf"))
            guard_now = not interior
        if HEAD_DIM == HEAD_DIM_PAD:  # [BLOCK_N, HEAD_DIM_PAD]
            v = tl.load(_rows(base=v_base, off=v_off, d=d, KEYS_LAST=False, PAGE_BASES=PAGE_BASES))
        else:
            v = tl.load(_rows(base=v_base, off=v_off, d=d, KEYS_LAST=False, PAGE_BASES=PAGE_BASES),
                        mask=d_ok[None, :], other=0.0)
        v = _dot_operand(x=v, dot_dtype=q.dtype, UPCAST=UPCAST, FP8=KV_FP8, FP8_NATIVE=FP8_NATIVE)
        m_i, l_i, acc, bad_w = _softmax_step(s=s, v=v, vcol=vcol, m_i=m_i, l_i=l_i, acc=acc, bad_w=bad_w, GUARD=GUARD,
                                             guard_now=guard_now, FP8=KV_FP8)
    return OnlineSoftmax(m_i, l_i, acc, bad_w)
