"""Which keys a query row sees: the one rule the forward, dQ and dK/dV kernels share.

Query row at key-space position ``p`` (``seq_len - q_len + i``) sees key ``t`` when
``t < row_hi`` (causal: the end of ``p``'s chunk, capped at ``seq_len``; else ``seq_len``)
and ``t >= row_lo = p - window_left`` or ``t < sink_tokens``, and ``t >= kv_start``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_bounds(q_pos, seq_len, chunk_size, window_left, CAUSAL: tl.constexpr):
    """``(row_hi, row_lo)`` of rows at positions ``q_pos`` (chunk_size 1 is plain causal:
    ``t <= p``  <=>  ``t < (p // 1 + 1) * 1``)."""
    if CAUSAL:
        row_hi = tl.minimum((q_pos // chunk_size + 1) * chunk_size, seq_len)
    else:
        row_hi = tl.zeros_like(q_pos) + seq_len
    return row_hi, q_pos - window_left


@triton.jit
def sees(t, row_hi, row_lo, sink_tokens):
    """``[rows, keys]``: row sees key ``t`` by its bounds (``kv_start`` is the caller's)."""
    return (t[None, :] < row_hi[:, None]) & ((t[None, :] >= row_lo[:, None]) | (t[None, :] < sink_tokens))


@triton.jit
def tile_key_range(q_pos_min, q_pos_max, seq_len, kv_lo, chunk_size, window_left, sink_tokens,
                   CAUSAL: tl.constexpr):
    """The keys any row of a tile with positions ``[q_pos_min, q_pos_max]`` sees (rows are
    monotone in position), as scalars: the window range ``[lo, hi)``, the sink range
    ``[kv_lo, sink_hi)``, and the tightest row bounds ``hi_min`` / ``lo_max`` (a key tile
    inside ``[lo_max, hi_min)`` is visible to every row)."""
    if CAUSAL:
        hi = tl.minimum((q_pos_max // chunk_size + 1) * chunk_size, seq_len)
        hi_min = tl.minimum((q_pos_min // chunk_size + 1) * chunk_size, seq_len)
    else:
        hi = seq_len
        hi_min = seq_len
    lo = tl.maximum(kv_lo, q_pos_min - window_left)
    sink_hi = tl.minimum(tl.minimum(sink_tokens, lo), hi)
    return lo, hi, sink_hi, hi_min, q_pos_max - window_left


@triton.jit
def virtual_tile(i, n_sink, sink_base, main_base, kv_lo, sink_hi, lo, hi, BLOCK_N: tl.constexpr):
    """Key tile ``i`` of a query tile's two key ranges: the first ``n_sink`` tiles cover the
    sink range ``[kv_lo, sink_hi)`` from ``sink_base``, the rest the main range ``[lo, hi)``
    from ``main_base`` (both multiples of ``BLOCK_N``). Returns the tile's first key and its
    range's bounds ``(t0, key_lo, key_hi)``."""
    in_sink = i < n_sink
    t0 = tl.where(in_sink, sink_base + i * BLOCK_N, main_base + (i - n_sink) * BLOCK_N)
    key_lo = tl.where(in_sink, kv_lo, lo)
    key_hi = tl.where(in_sink, sink_hi, hi)
    return t0, key_lo, key_hi
