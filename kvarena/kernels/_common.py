"""Constants and helpers shared by the kernel modules.

Kept here so that a value the kernels agree on (the int32 ceiling, the row-tile size of
the bandwidth-bound kernels, the padded head dim) is written once.
"""

from __future__ import annotations

import functools
import os

import triton

__all__ = ["I32_MAX", "LOG2E", "ROW_TILE_ELEMS", "ROW_TILE_WARPS", "head_dim_pad", "interpreting", "row_tile"]

I32_MAX = 2**31 - 1
# exp(x) = exp2(x * LOG2E): the attention kernels work in the exp2 domain.
LOG2E = 1.4426950408889634
# Bandwidth-bound row kernels (store, merge, split reduce): ~4096 elements per program,
# 32 per thread at 4 warps (16 bytes per thread per operand at bf16, D = 128): enough
# bytes in flight for a copy without register pressure.
ROW_TILE_ELEMS = 4096
ROW_TILE_WARPS = 4


@functools.lru_cache(maxsize=64)
def head_dim_pad(head_dim: int) -> int:
    """``head_dim`` padded to a power of two, at least 16 (the smallest MMA K). Memoized: the
    store's launch asks per layer, and ``triton.next_power_of_2`` is a jit callable (~5 us)."""
    return max(16, triton.next_power_of_2(head_dim))


def row_tile(head_dim: int) -> dict:
    """Tile of a row kernel at ``head_dim``: ``HEAD_DIM_PAD``, ``BLOCK_R``, ``num_warps``."""
    d_pad = head_dim_pad(head_dim)
    return dict(HEAD_DIM_PAD=d_pad, BLOCK_R=max(1, ROW_TILE_ELEMS // d_pad), num_warps=ROW_TILE_WARPS)


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (bf16 must be upcast inside kernels)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
