"""The slab pool's records: host bookkeeping of rollouts and chunks, and what the pool gives out.

:class:`Slab` is what :meth:`~kvarena.cache.slab.SlabKVCache.append` takes and
:meth:`~kvarena.cache.slab.SlabKVCache.get` returns; :class:`SlabSnapshot` a rollback point;
:class:`ChunkInfo` and :class:`RolloutInfo` read-only views of the bookkeeping
(:meth:`~kvarena.cache.slab.SlabKVCache.rollout_info`). ``_Chunk`` and ``_Rollout`` are the
pool's own mutable records.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from kvarena.cache._meta import next_version

__all__ = ["ChunkInfo", "RolloutInfo", "Slab", "SlabSnapshot"]


@dataclass
class Slab:
    """One chunk's K/V, as appended and as returned by :meth:`SlabKVCache.get`.

    Attributes
    ----------
    chunk_index : int
    k, v : Tensor ``[num_layers, T, H_kv, D]``
        From :meth:`SlabKVCache.get`: views into the arena of the chunk's real tokens.
    """

    chunk_index: int
    k: Any
    v: Any


class _Chunk:
    __slots__ = ("index", "slot", "n_tokens", "committed", "serial")

    def __init__(self, index: int, slot: int, n_tokens: int, num_layers: int) -> None:
        self.index = index
        self.slot = slot
        self.n_tokens = n_tokens
        # committed[l]: written at layer l. One list item per layer, so that marking a
        # layer is a single atomic store (forward takes no lock) that dynamo can trace.
        self.committed = [False] * num_layers
        self.serial = next_version()  # process-unique: tells a re-created record from the old one

    def info(self) -> ChunkInfo:
        return ChunkInfo(self.index, self.slot, self.n_tokens, tuple(self.committed), self.serial)


class _Rollout:
    __slots__ = ("chunks", "last", "version", "n0", "retired")

    def __init__(self, n0: int) -> None:
        self.chunks: dict[int, _Chunk] = {}  # ascending chunk index = logical order
        self.last = -1
        self.version = next_version()
        self.n0 = n0  # tokens of chunk 0 (stored right-aligned in its slab)
        # Chunks a multi-chunk run evicted while still reading them: held (and re-plannable
        # runs still see them) until a plan of the namespace no longer reads them, then freed.
        self.retired: dict[int, _Chunk] = {}

    def records(self) -> dict[int, _Chunk]:
        """Every chunk record the rollout holds, retired ones included, by index."""
        return {**self.retired, **self.chunks}


@dataclass(frozen=True)
class ChunkInfo:
    """One chunk a rollout holds (a read-only copy of the pool's record).

    Attributes
    ----------
    index : int
        The chunk index.
    slot : int
        The arena slab holding it.
    n_tokens : int
        Its tokens (right-aligned in the slab).
    committed : tuple of bool
        Per layer: whether its K/V were written there (``forward(commit=True)`` or ``append``).
    serial : int
        Process-unique id of the record: a chunk planned again after being recycled or
        restored away gets a new one.
    """

    index: int
    slot: int
    n_tokens: int
    committed: tuple
    serial: int


@dataclass(frozen=True)
class RolloutInfo:
    """One namespace's bookkeeping, from :meth:`SlabKVCache.rollout_info`.

    Attributes
    ----------
    first_chunk_tokens : int
        Tokens of chunk 0.
    last_chunk : int
        The newest chunk planned.
    version : int
        Moves whenever metadata planned for the namespace goes stale.
    chunks : tuple of ChunkInfo
        The resident chunks, in logical order.
    retired : tuple of ChunkInfo
        Chunks a multi-chunk run evicted while still reading them (held until the
        namespace's next plan that no longer reads them).
    """

    first_chunk_tokens: int
    last_chunk: int
    version: int
    chunks: tuple
    retired: tuple


def rollout_info(r: _Rollout) -> RolloutInfo:
    return RolloutInfo(r.n0, r.last, r.version, tuple(ch.info() for ch in r.chunks.values()),
                       tuple(ch.info() for ch in r.retired.values()))


@dataclass(frozen=True, eq=False)
class SlabSnapshot:
    """Opaque rollback point of one namespace (from :meth:`SlabKVCache.snapshot`)."""

    namespace: Hashable
    _owner: int = field(repr=False)
    _chunks: tuple = field(repr=False)  # (index, _Chunk) in logical order
    _last: int = field(repr=False)
    _retired: tuple = field(repr=False, default=())  # (index, _Chunk) retired by a run, still held
