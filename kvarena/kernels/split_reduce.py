"""The split-KV reduce: a split attention launch's fp32 partials and their log2-sum-exp,
combined into the output (and its lse) in a fixed order (flash-decoding's second pass)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvarena.kernels._common import ROW_TILE_ELEMS, ROW_TILE_WARPS, head_dim_pad
from kvarena.kernels.arch import launch_arch
from kvarena.kernels.attn_plan import _MAX_SPLITS
from kvarena.kernels.widen import narrow

# ----------------------------------------------------------------------------- constants

# H100/H200 have 132 SMs: the reduce's default when no device or record says otherwise.
_DEFAULT_SM_COUNT = 132

# ----------------------------------------------------------------------------- kernel


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
    tl.store(o_ptr + o_off, narrow(x=o, dtype=o_ptr.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])
    if WRITE_LSE:
        lse = tl.where(has_key, (m_safe + tl.log2(tl.where(has_key, tot, 1.0))) * 0.6931471805599453, float("-inf"))
        # Written once per row: by the programs of the first head-dim block.
        tl.store(lse_ptr + tok * stride_lt + head * stride_lh, lse, mask=r_ok & (r * 0 + d0 == 0))


# ----------------------------------------------------------------------------- launcher


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


def split_reduce(part: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
                 sink_logits: torch.Tensor | None = None, *, deterministic: bool = False) -> None:
    """Merge ``[S, T, H, D]`` fp32 partials (unit head-dim stride) with their ``[S, T, H]``
    lse (log2 units, as the split kernel writes them; -inf: an empty split, whose partial is
    never read) into ``out`` ``[T, H, D]`` and (if not None) ``lse`` ``[T, H]`` (natural
    log); ``sink_logits`` ``[H]`` join each denominator once. The tile is
    :func:`_reduce_tile`'s (``deterministic``: the batch-invariant one)."""
    num_splits, total_q, h_q, head_dim = part.shape
    n_rows = total_q * h_q
    tile = _reduce_tile(n_rows, head_dim, num_splits, launch_arch(out).sm_count, deterministic=deterministic)
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
