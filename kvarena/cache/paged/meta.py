"""The paged pool's step metadata and the persistent buffers of CUDA-graph plans."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvarena.attention.batch import KeySet, QueryRows
from kvarena.attention.route import Route
from kvarena.cache.arena import _check_int

__all__ = ["GraphBuffers", "PagedMetadata"]


@dataclass(frozen=True, eq=False)
class PagedMetadata:
    """One step's batch, as built by :meth:`PagedKVCache.plan`; reused by every layer.

    Attributes
    ----------
    slot_mapping : Tensor, int32 (int64 past 2**31 slots) ``[total_q]``
        Cache slot of each new token (``block * block_size + row``; ``-1`` = padding), in
        layer group 0.
    block_table : Tensor, int32 ``[num_seqs, max_blocks]``
        Blocks of each sequence in logical order (entries past a sequence's blocks are
        padding and never read), in layer group 0. Read-only: when the rows were planned in
        the order their namespaces were made it is a view of the pool's persistent table
        (row stride ``table.shape[2]``), which later plans write in place in their own
        namespaces' rows only.
    slot_mappings, block_tables : tuple of Tensor
        The same per layer group (views of one ``[G, ...]`` tensor each; one entry for an
        ungrouped layout, ``slot_mapping`` / ``block_table`` themselves).
    seq_lens : Tensor, int32 ``[num_seqs]``
        Tokens of each sequence after this step (0 for padding rows).
    cu_seqlens_q : Tensor, int32 ``[num_seqs + 1]``
        Query offsets; a sequence's queries are its newest tokens.
    max_seqlen_q, max_seqlen_k, total_q, num_seqs : int
        Host bounds / sizes (under CUDA-graph capacity: the fixed capacity values).
    namespaces : tuple
        The rows' namespaces, in the order of the mapping given to ``plan``.
    num_tokens : int
        Real new tokens (``total_q`` minus padding).
    pad_to : int or None
        Query rows per sequence of a padded plan (``plan(..., pad_to=)``).
    keys : tuple of KeySet
        The key set of each layer group (its ``block_tables`` entry, ``seq_lens``,
        ``max_seqlen_k``), as ``forward`` hands it to the attention.
    rows : QueryRows
        The query rows (``cu_seqlens_q``, ``max_seqlen_q``).
    own_keys : KeySet or None
        Decode context parallel: the step's own keys as one-token pages of the given k / v
        (``[num_seqs, max_seqlen_q]`` table, the rows' new-token counts); None otherwise.
    """

    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    slot_mappings: tuple
    block_tables: tuple
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    total_q: int
    num_seqs: int
    namespaces: tuple
    num_tokens: int
    keys: tuple = field(repr=False)
    rows: QueryRows = field(repr=False)
    _owner: int = field(repr=False)
    _versions: tuple = field(repr=False)
    _epoch: int = field(repr=False)
    _graph_gen: int | None = field(default=None, repr=False)
    pad_to: int | None = None
    own_keys: KeySet | None = field(default=None, repr=False)
    #: The step's longest sequence (host int; a graph plan's ``max_seqlen_k`` is its
    #: capacity instead). None: ``max_seqlen_k``.
    _longest: int | None = field(default=None, repr=False)

    @property
    def _max_seq_len(self) -> int:
        return self.max_seqlen_k if self._longest is None else self._longest


@dataclass(frozen=True, eq=False)
class GraphBuffers:
    """The fixed buffers ``plan(graph=True)`` fills (their ``data_ptr`` never changes)."""

    max_batch: int
    max_blocks: int
    q_per_seq: int
    slot_mapping: torch.Tensor  # [G, max_batch * q_per_seq]
    block_table: torch.Tensor  # [G, max_batch, max_blocks]
    seq_lens: torch.Tensor  # [max_batch]
    cu_seqlens_q: torch.Tensor  # [max_batch + 1]: every row (padding included) owns q_per_seq rows
    #: The key sets (one per layer group) and query rows every graph plan hands out.
    keys: tuple
    rows: QueryRows

    @classmethod
    def make(cls, capacity, groups: int, block_size: int, slot_dtype: torch.dtype,
             device: torch.device) -> GraphBuffers:
        """The buffers of ``graph_capacity=(max_batch, max_blocks[, q_per_seq])`` (checked)."""
        if not isinstance(capacity, (tuple, list)) or len(capacity) not in (2, 3):
            raise TypeError(
                "graph_capacity: expected (max_batch, max_blocks) or "
                f"(max_batch, max_blocks, q_per_seq), got {capacity!r}"
            )
        max_batch = _check_int("graph_capacity[0] (max_batch)", capacity[0], 1)
        max_blocks = _check_int("graph_capacity[1] (max_blocks)", capacity[1], 1)
        q_per = _check_int("graph_capacity[2] (q_per_seq)", capacity[2], 1) if len(capacity) == 3 else 1
        table = torch.zeros(groups, max_batch, max_blocks, dtype=torch.int32, device=device)
        seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        cu = torch.arange(0, (max_batch + 1) * q_per, q_per, dtype=torch.int32, device=device)
        return cls(
            max_batch, max_blocks, q_per,
            slot_mapping=torch.full((groups, max_batch * q_per), -1, dtype=slot_dtype, device=device),
            block_table=table, seq_lens=seq_lens, cu_seqlens_q=cu,
            keys=tuple(KeySet(t, seq_lens, max_blocks * block_size) for t in table),
            rows=QueryRows(cu, q_per),
        )


@dataclass(frozen=True)
class CallCheck:
    """What :meth:`PagedKVCache._check_call` resolved for one layer's call."""

    layer: int
    spec: object  # AttentionSpec: the layer's, per-call overrides applied
    group: int  # the layer's group
    route: Route  # the call's (kvarena.attention.route)
