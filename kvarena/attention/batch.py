"""The typed seam between a pool's plan and an attention launch.

A pool's ``plan`` builds these once per step; every layer's ``forward`` hands the same
objects to :func:`kvarena.attention.dispatch.attend`, which reads them and flattens them
only where a kernel or a ``torch.library`` op takes plain tensors. The step's query rows
also carry the step's Triton launch plans (:mod:`kvarena.attention.plans`): plan once per
step, launch per layer.

* :class:`CacheView`: one layer's key/value storage (and fp8 scales).
* :class:`KeySet`: which of those keys each sequence's query rows see.
* :class:`QueryRows`: where each sequence's query rows are.
* :class:`OwnKeys`: the step's own keys and values, given as tensors next to the cache.

All are frozen and compare by identity (they hold tensors).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["CacheView", "KeySet", "QueryRows", "OwnKeys"]


@dataclass(frozen=True, eq=False)
class CacheView:
    """One layer's keys and values as the kernels read them.

    Attributes
    ----------
    k, v : Tensor ``[num_blocks, block_size, H_kv, D]``
        Any strides with a contiguous last dim; float, float8_e4m3fn, or (from an arena)
        the uint8 view of fp8 bytes.
    scales : (Tensor, Tensor) or None
        fp8 caches: ``(k_scale, v_scale)``, fp32 per-(token, kv head) or 0-dim static
        (possibly uint8 views); None for float caches.
    """

    k: torch.Tensor
    v: torch.Tensor
    scales: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def block_size(self) -> int:
        return self.k.shape[1]


@dataclass(frozen=True, eq=False)
class KeySet:
    """The keys each sequence's query rows see, read through a block table.

    Attributes
    ----------
    block_table : Tensor, int32 ``[B, max_blocks]``
        Key ``t`` of sequence ``b`` is row ``t % block_size`` of block
        ``block_table[b, t // block_size]``.
    seq_lens : Tensor, int32 ``[B]``
        Keys ``0 .. seq_lens[b] - 1``.
    max_seqlen_k : int
        Host bound of ``seq_lens``.
    kv_start : Tensor, int32 ``[B]``, or None
        Keys ``t < kv_start[b]`` are invisible (None: all from 0).
    rope_k_shift : Tensor, int32 ``[B, max_blocks]``, or None
        RoPE on read: key ``t`` takes table row ``t + rope_k_shift[b, t // block_size]``
        (None: row ``t``).
    """

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    max_seqlen_k: int
    kv_start: torch.Tensor | None = None
    rope_k_shift: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class QueryRows:
    """Where each sequence's query rows are.

    Attributes
    ----------
    cu_seqlens_q : Tensor, int32 ``[B + 1]``
        Rows ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1`` of q are sequence b's, at
        positions ``seq_lens[b] - q_len .. seq_lens[b] - 1`` (bottom-right aligned).
    max_seqlen_q : int
        Host bound of the rows per sequence.
    rope_q_pos : Tensor, int32 ``[B]``, or None
        RoPE on read: table row of each sequence's first query (None: its position).
    launches : dict
        The step's Triton launch plans, made by the first layer that launches each key set
        and read by every other layer of the step (:mod:`kvarena.attention.plans`; empty
        when made).
    """

    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int
    rope_q_pos: torch.Tensor | None = None
    launches: dict = field(default_factory=dict, repr=False)


@dataclass(frozen=True, eq=False)
class OwnKeys:
    """The step's own keys and values, given as tensors beside the cache.

    Three placements, one name:

    * ``keys`` None: the query rows' own keys ``[total_q, H_kv, D]``, already stored in the
      cache at the rows' positions. A differentiable path reads them from ``k``/``v``
      (gradients reach them); a forward-only path reads the cache.
    * ``keys`` given, ``paged`` False: ``k``/``v`` ``[B, T, H_kv, D]``, sequence b's T keys
      placed after its cached ones and visible to all its query rows (a denoising step).
      ``keys`` lists them as one T-token block per sequence, for the two-launch form.
    * ``keys`` given, ``paged`` True: ``k``/``v`` are pages ``[P, page, H_kv, D]`` read
      through ``keys`` (a multi-chunk step, where each chunk sees part of the run).
    """

    k: torch.Tensor
    v: torch.Tensor
    keys: KeySet | None = None
    paged: bool = False

    @property
    def at_queries(self) -> bool:
        return self.keys is None
