"""Slab KV cache for chunked video-DiT / world-model rollouts, recycled in place.

One *slab* holds one chunk's K/V for every layer: a block of ``slab_tokens`` tokens of
an arena region, ``[num_layers, 2, slab_tokens, H_kv, D]``. Per namespace (a rollout,
one CFG branch, one expert) the pool keeps a logical slab table: the sink chunks
``0 .. sinks-1`` (kept forever) then the last ``window`` chunks. When chunk ``c`` is
planned for the first time past ``sinks + window`` chunks, the oldest non-sink chunk
(which ``c`` no longer sees) is evicted and ``c`` takes over its slot: no retained byte
moves, and the memory of a rollout is flat once its window is full.

Chunk ``c`` sees the chunks ``0 .. min(sinks, c+1)-1`` and ``max(sinks, c-window+1) .. c``
(never a later one); inside the chunk attention is full (block-causal overall).

Per denoising step, one :meth:`SlabKVCache.plan` for a batch of rollouts returns
:class:`SlabMetadata` reused by every layer; :meth:`SlabKVCache.forward` then either
commits the chunk's clean K/V and attends (``commit=True``), or attends over the cached
history plus the given K/V, merged by log-sum-exp, writing nothing (``commit=False``,
differentiable w.r.t. q, k, v).

Commit bookkeeping (host only, so ``forward`` never syncs): a chunk counts as committed
*at a layer* once ``forward(commit=True)`` (or ``append``) wrote it at that layer;
attending to a history chunk not committed at the layer being run raises.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvarena.attention.ops import attend, attend_history_and_own, store
from kvarena.attention.spec import AttentionSpec, check_bool
from kvarena.cache._meta import (
    StaleMetadataError,
    as_device,
    check_forward_tensor,
    next_version,
    region_of_arena,
    upload,
)
from kvarena.cache._pool import KVPoolBase
from kvarena.cache.arena import ArenaRegion, CacheFullError, KVArena, KVLayout, _check_int

__all__ = ["Slab", "SlabKVCache", "SlabMetadata", "SlabSnapshot"]

_UNBOUNDED_WINDOW = 1 << 30
_VISIBILITY = (
    "the slab pool's visibility is whole chunks, set by CachePolicy per_component "
    "{'sinks': n, 'window': m}; it cannot be changed per layer or per call"
)


# The per_component keys a slab pool reads (CachePolicy is shared by every cache class).
_SLAB_COMPONENTS = frozenset({"window", "sinks", "slab_tokens"})


def _op_specs(spec: AttentionSpec) -> tuple[AttentionSpec, AttentionSpec]:
    """What a slab forward passes to the op for a layer spec: ``(spec, spec with lse)``.

    The block tables list only visible chunks, so the op runs non-causal (full
    attention over them, block-causal overall). Made once per layer at construction,
    and per call only for a call with overrides.
    """
    op = spec.replace(causal=False)
    return op, op.replace(return_lse=True)


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
    __slots__ = ("index", "slot", "n_tokens", "committed")

    def __init__(self, index: int, slot: int, n_tokens: int, num_layers: int) -> None:
        self.index = index
        self.slot = slot
        self.n_tokens = n_tokens
        # committed[l]: written at layer l. One list item per layer, so that marking a
        # layer is a single atomic store (forward takes no lock) that dynamo can trace.
        self.committed = [False] * num_layers


class _Rollout:
    __slots__ = ("chunks", "last", "version")

    def __init__(self) -> None:
        self.chunks: dict[int, _Chunk] = {}  # ascending chunk index = logical order
        self.last = -1
        self.version = next_version()


@dataclass(frozen=True, eq=False)
class SlabMetadata:
    """One denoising step of a batch of rollouts, from :meth:`SlabKVCache.plan`.

    ``B`` rollouts, each planning one chunk of ``T`` tokens (``n_tokens``); ``W`` is the
    most chunks any row sees (``<= sinks + window``). Reused by every layer.

    Attributes
    ----------
    namespaces, chunk_indices : tuple
        Per row, in the order of the mapping given to ``plan``.
    n_tokens, num_seqs : int
        ``T`` and ``B``.
    block_table : Tensor, int32 ``[B, W]``
        Slots of the visible chunks in logical order, the current chunk last.
    seq_lens : Tensor, int32 ``[B]``
        ``visible_chunks * slab_tokens``.
    kv_start : Tensor, int32 ``[B]``
        Hides the unfilled head of a short chunk 0 (stored right-aligned); else 0.
    hist_block_table, hist_seq_lens, hist_kv_start : Tensor, int32
        The same without the current chunk (``[B, max(W-1, 1)]``, ``[B]``, ``[B]``);
        ``hist_seq_lens`` is 0 for a rollout's first chunk.
    cu_seqlens_q : Tensor, int32 ``[B + 1]``
        ``arange(B + 1) * T``.
    slot_mapping : Tensor, int32 (int64 past 2**31 slots) ``[B * T]``
        Where ``commit=True`` writes the chunk's tokens (right-aligned in the slab).
    dense_block_table, dense_seq_lens : Tensor, int32 ``[B, 1]``, ``[B]``
        Attend over the given K/V viewed as a ``[B, T, H_kv, D]`` cache.
    max_seqlen_q, max_seqlen_k, hist_max_seqlen_k : int
        Host maxima.
    has_kv_start, hist_has_kv_start : bool
        Whether any row needs its ``kv_start``.
    """

    namespaces: tuple
    chunk_indices: tuple
    n_tokens: int
    num_seqs: int
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    kv_start: torch.Tensor
    hist_block_table: torch.Tensor
    hist_seq_lens: torch.Tensor
    hist_kv_start: torch.Tensor
    cu_seqlens_q: torch.Tensor
    slot_mapping: torch.Tensor
    dense_block_table: torch.Tensor
    dense_seq_lens: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    hist_max_seqlen_k: int
    has_kv_start: bool
    hist_has_kv_start: bool
    _owner: int = field(repr=False)
    _versions: tuple = field(repr=False)
    _epoch: int = field(repr=False)
    _current: tuple = field(repr=False)  # _Chunk per row
    _history: tuple = field(repr=False)  # (namespace, _Chunk) of every history chunk

    def __deepcopy__(self, memo) -> SlabMetadata:
        # The chunk records are the pool's own bookkeeping, not data of the plan: a copy
        # must mark commits on the pool's records, or a commit through it would write the
        # slab and leave the chunk uncommitted.
        fields = {k: copy.deepcopy(v, memo) for k, v in vars(self).items() if k not in ("_current", "_history")}
        return SlabMetadata(**fields, _current=self._current, _history=self._history)


@dataclass(frozen=True, eq=False)
class SlabSnapshot:
    """Opaque rollback point of one namespace (from :meth:`SlabKVCache.snapshot`)."""

    namespace: Hashable
    _owner: int = field(repr=False)
    _chunks: tuple = field(repr=False)  # (index, _Chunk) in logical order
    _last: int = field(repr=False)


class SlabKVCache(KVPoolBase):
    """Arena-backed chunk-KV slabs with in-place sliding-window recycling.

    Parameters
    ----------
    policy : CachePolicy
        Of class ``"slab_kv"``. ``max_bytes // slab_bytes`` is the number of slabs (slots) of the pool's own
        arena; ``block_bytes`` is 0 or ``layout.block_bytes(slab_tokens)``;
        ``per_component``: ``"window"`` (chunks attended and kept, the current one
        included; default unbounded), ``"sinks"`` (default 0), optionally
        ``"slab_tokens"``; ``training_mode_disables_recycle`` keeps every slab.
    layout : KVLayout, optional
        Without it (and without ``arena``), the arena is made on the first
        :meth:`append` from that K/V (layout, dtype, device).
    slab_tokens : int, optional
        Tokens per slab (= per chunk); default ``per_component["slab_tokens"]``, else the
        first appended chunk's length. Required with ``layout`` unless in the policy.
    device : torch.device or str, optional
        Device of the pool's own arena (default CPU).
    arena : KVArena, optional
        A shared arena; the pool uses ``region`` of it (default: the only region, else
        the one named after ``policy.class_name``, else ``"slab_kv"``).
    region : str, optional
    attention : AttentionSpec, list of AttentionSpec, or mapping, optional
        Per-layer attention options (as :class:`PagedKVCache`): ``scale``, ``softcap``,
        ``backend``, ``num_splits``, ``deterministic``, ``return_lse``. Visibility is
        the pool's (sinks + window chunks, block-causal), so ``window_left``,
        ``sink_tokens``, ``chunk_size`` and ``causal`` keep their defaults.

    Attributes
    ----------
    window, sinks : int
    training_mode : bool
    slab_tokens : int or None
    layout : KVLayout or None
    arena : KVArena or None
    used_bytes, free_bytes : int
    hits, misses : int
        The seed's counters; always 0.
    """

    def __init__(
        self,
        policy,
        *,
        layout: KVLayout | None = None,
        slab_tokens: int | None = None,
        device=None,
        arena: KVArena | None = None,
        region: str | None = None,
        attention=None,
    ) -> None:
        self._init_pool(policy, attention)
        device = as_device(device)
        per = policy.per_component
        unknown = sorted(set(per) - _SLAB_COMPONENTS)
        if unknown:  # a misspelt "window" would silently mean an unbounded window
            raise ValueError(
                f"policy.per_component: unknown key {unknown[0]!r} for a slab pool; expected "
                f"{', '.join(repr(k) for k in sorted(_SLAB_COMPONENTS))}"
            )
        self.window = max(1, int(per.get("window", _UNBOUNDED_WINDOW)))
        self.sinks = int(per.get("sinks", 0))
        self.training_mode = bool(policy.training_mode_disables_recycle)
        self._rollouts: dict[Hashable, _Rollout] = {}
        if slab_tokens is not None:
            _check_int("slab_tokens", slab_tokens, 1)
        elif "slab_tokens" in per:
            slab_tokens = _check_int('policy.per_component["slab_tokens"]', per["slab_tokens"], 1)
        self.slab_tokens = slab_tokens
        self.arena: KVArena | None = None
        self.layout: KVLayout | None = None
        self._region: ArenaRegion | None = None
        self._device_arg = device
        if arena is not None:
            reg, layout = region_of_arena(
                arena, region, policy, "slab_kv", layout, "slab_tokens", slab_tokens, device
            )
            self._check_block_bytes(reg.block_bytes, reg.layout, reg.block_tokens)
            self._attach(arena, reg, self._bind_layout(reg.layout, arena.device))
        elif region is not None:
            raise ValueError("region: only meaningful together with arena=")
        elif layout is not None:
            if not isinstance(layout, KVLayout):
                raise TypeError(f"layout: expected a KVLayout, got {type(layout).__name__}")
            if slab_tokens is None:
                raise ValueError(
                    'slab_tokens: required with layout= (or set per_component["slab_tokens"])'
                )
            self._materialize(layout, slab_tokens, device)

    # ------------------------------------------------------------------ arena
    def _check_block_bytes(self, bb: int, layout: KVLayout, slab_tokens: int) -> None:
        given = int(getattr(self.policy, "block_bytes", 0))
        if given not in (0, bb):
            raise ValueError(
                f"policy.block_bytes: expected 0 (derived) or {bb} = layout.block_bytes"
                f"({slab_tokens}) for {layout}, got {given}"
            )

    def _materialize(self, layout: KVLayout, slab_tokens: int, device) -> None:
        bb = layout.block_bytes(slab_tokens)
        self._check_block_bytes(bb, layout, slab_tokens)
        specs = self._bind_layout(layout, device or torch.device("cpu"))
        arena = KVArena.single("slab_kv", layout, slab_tokens, self.policy.max_bytes, device=device)
        self._attach(arena, arena["slab_kv"], specs)

    def _check_spec(self, spec: AttentionSpec, where: str) -> None:
        for name, default in (("window_left", None), ("sink_tokens", 0), ("chunk_size", None), ("causal", True)):
            if getattr(spec, name) != default:
                raise ValueError(f"{where}.{name}: must stay {default!r}: {_VISIBILITY}")

    def _attach(self, arena: KVArena, reg: ArenaRegion, specs: tuple) -> None:
        self._specs = specs
        self._op_pairs = tuple(_op_specs(s) for s in specs)
        self.arena = arena
        self._region = reg
        self.layout = reg.layout
        self.slab_tokens = reg.block_tokens
        self.device = arena.device
        self.slab_bytes = reg.block_bytes
        nslots = reg.num_blocks * reg.block_tokens
        self._slot_dtype = torch.int32 if nslots < 2**31 else torch.int64

    def _require_arena(self, what: str) -> ArenaRegion:
        if self._region is None:
            raise RuntimeError(
                f"{what}: this SlabKVCache has no layout yet; pass layout= and slab_tokens= "
                "at construction, or append() a first slab"
            )
        return self._region

    # ------------------------------------------------------------------ accounting
    def _blocks(self):
        return None if self._region is None else (self._region.allocator, self.slab_bytes)

    @property
    def num_slots(self) -> int:
        """int: slabs the budget holds (0 before the arena exists)."""
        return 0 if self._region is None else self._region.num_blocks

    def __contains__(self, namespace: object) -> bool:
        return namespace in self._rollouts

    def chunk_indices(self, namespace: Hashable) -> list[int]:
        """Chunk indices ``namespace`` holds, in logical order (``[]`` if unknown)."""
        with self._lock:
            r = self._rollouts.get(namespace)
            return [] if r is None else list(r.chunks)

    # ------------------------------------------------------------------ visibility
    def visible_chunks(self, chunk_index: int) -> list[int]:
        """Chunk indices chunk ``chunk_index`` attends to, in logical order (itself last)."""
        c = chunk_index
        sinks = list(range(min(self.sinks, c + 1)))
        if c < self.sinks:
            return sinks
        return sinks + list(range(max(self.sinks, c - self.window + 1), c + 1))

    # ------------------------------------------------------------------ planning
    def _parse(self, ns, spec) -> tuple[int, int | None]:
        if isinstance(spec, tuple):
            if len(spec) != 2:
                raise ValueError(
                    f"batch[{ns!r}]: expected chunk_index or (chunk_index, n_tokens), got {spec!r}"
                )
            c = _check_int(f"batch[{ns!r}] chunk_index", spec[0], 0)
            return c, _check_int(f"batch[{ns!r}] n_tokens", spec[1], 1)
        return _check_int(f"batch[{ns!r}] chunk_index", spec, 0), None

    def _reserve(self, batch: Mapping) -> tuple[list, int]:
        """Validate a batch and claim its slots (all-or-nothing). Caller holds the lock.

        Returns ``([(namespace, rollout_or_None, chunk or None, index, n_tokens)], T)``
        after applying it.
        """
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"batch: expected a mapping of namespace -> chunk_index or (chunk_index, "
                f"n_tokens), got {type(batch).__name__}"
            )
        if not batch:
            raise ValueError("batch: expected at least one namespace")
        st = self.slab_tokens
        rows = []
        t_common = None
        new_slots = 0
        for ns, spec in batch.items():
            c, n = self._parse(ns, spec)
            r = self._rollouts.get(ns)
            known = r.chunks.get(c) if r is not None else None
            if known is not None:
                if n is not None and n != known.n_tokens:
                    raise ValueError(
                        f"batch[{ns!r}]: chunk {c} was planned with {known.n_tokens} tokens; "
                        f"re-planning it with {n} is not allowed"
                    )
                n = known.n_tokens
                missing = [i for i in self.visible_chunks(c) if i not in r.chunks]
                if missing:
                    raise ValueError(
                        f"batch[{ns!r}]: chunk {c} sees chunks {missing} that were already "
                        "recycled; it cannot be planned again"
                    )
            else:
                last = -1 if r is None else r.last
                if c != last + 1:
                    if r is not None and c <= last:
                        raise ValueError(
                            f"batch[{ns!r}]: chunk {c} was already recycled (namespace holds "
                            f"chunks {list(r.chunks)})"
                        )
                    raise ValueError(
                        f"batch[{ns!r}]: the next new chunk of this namespace is {last + 1}, got {c}"
                    )
                if n is None:
                    n = st
                if n > st:
                    raise ValueError(
                        f"batch[{ns!r}]: n_tokens {n} is longer than a slab ({st} slab_tokens)"
                    )
                if n < st and c != 0:
                    raise ValueError(
                        f"batch[{ns!r}]: only chunk 0 may be shorter than slab_tokens ({st}); "
                        f"chunk {c} has {n} tokens"
                    )
                if self._needs_slot(r, c):
                    new_slots += 1
            if t_common is None:
                t_common = n
            elif n != t_common:
                raise ValueError(
                    f"batch[{ns!r}]: every rollout of one plan shares one T; got {n} tokens "
                    f"after {t_common} (plan a short first chunk in a batch of its own)"
                )
            rows.append((ns, c, n, known))
        alloc = self._region.allocator
        if new_slots > alloc.num_free:
            raise CacheFullError(
                f"plan needs {new_slots} new slabs, only {alloc.num_free} of {alloc.num_blocks} "
                f"are free ({self.slab_bytes} bytes each, budget {self.policy.max_bytes})"
            )
        # Every new slab in ONE allocator call before anything changes: the allocator may
        # be shared with another pool on the same arena region (its own lock, not ours),
        # so a per-row alloc could fail half-way and leave the batch half applied.
        fresh = iter(alloc.alloc(new_slots))
        out = []
        for ns, c, n, known in rows:
            r = self._rollouts.get(ns)
            if r is None:
                r = self._rollouts[ns] = _Rollout()
            if known is None:
                if self._needs_slot(r, c):
                    slot = next(fresh)
                else:  # recycle the oldest non-sink chunk in place
                    oldest = next(i for i in r.chunks if i >= self.sinks)
                    slot = r.chunks.pop(oldest).slot
                    r.version = self._stamp()
                known = r.chunks[c] = _Chunk(c, slot, n, self.layout.num_layers)
                r.last = c
            out.append((ns, r, known))
        return out, t_common

    def _needs_slot(self, r: _Rollout | None, c: int) -> bool:
        if r is None or self.training_mode or c < self.sinks:
            return True
        held_sinks = min(self.sinks, r.last + 1)
        return len(r.chunks) - held_sinks < self.window

    def plan(self, batch: Mapping[Hashable, Any]) -> SlabMetadata:
        """Claim (or find) each rollout's chunk slot and build the step's metadata.

        Parameters
        ----------
        batch : mapping of namespace to ``chunk_index`` or ``(chunk_index, n_tokens)``
            One chunk per rollout, all of one length ``T``. A new chunk must be the
            namespace's next one (the first is 0); ``n_tokens`` defaults to
            ``slab_tokens`` for a new chunk and to the recorded length for a known one;
            only chunk 0 may be shorter. Re-planning a known chunk reuses its slot and
            never advances or evicts; a new chunk past ``sinks + window`` recycles the
            oldest non-sink slab in place (never in training mode).

        Returns
        -------
        SlabMetadata

        Raises
        ------
        CacheFullError
            The batch needs more new slabs than are free; nothing changed.
        ValueError, TypeError
            A malformed batch, a chunk out of order, a chunk longer than a slab, a
            short chunk other than 0, mixed T, a different length for a known chunk, or
            a chunk whose window was (partly) recycled; nothing changed.
        RuntimeError
            No layout yet.
        """
        self._require_arena("plan")
        with self._lock:
            rows, t = self._reserve(batch)
            return self._build_meta(rows, t)

    def _build_meta(self, rows, t: int) -> SlabMetadata:
        st = self.slab_tokens
        b = len(rows)
        vis_rows, hist_rows, starts, hist_starts, history = [], [], [], [], []
        for ns, r, cur in rows:
            chunks = [r.chunks[i] for i in self.visible_chunks(cur.index)]
            first = chunks[0]
            start = st - first.n_tokens if first.index == 0 else 0
            vis_rows.append([ch.slot for ch in chunks])
            hist_rows.append([ch.slot for ch in chunks[:-1]])
            starts.append(start)
            hist_starts.append(start if len(chunks) > 1 else 0)
            history.extend((ns, ch) for ch in chunks[:-1])
        w = max(len(x) for x in vis_rows)
        wh = max(1, w - 1)
        lens = [len(x) * st for x in vis_rows]
        hist_lens = [len(x) * st for x in hist_rows]
        flat: list[int] = []
        for x in vis_rows:
            flat += x + [0] * (w - len(x))
        for x in hist_rows:
            flat += x + [0] * (wh - len(x))
        cur_slots = [cur.slot for _ns, _r, cur in rows]
        flat += lens + hist_lens + starts + hist_starts + [i * t for i in range(b + 1)]
        flat += cur_slots + list(range(b)) + [t] * b
        packed = upload(flat, torch.int32, self.device)
        o = 0

        def take(n: int) -> torch.Tensor:
            nonlocal o
            o += n
            return packed[o - n : o]

        block_table = take(b * w).view(b, w)
        hist_table = take(b * wh).view(b, wh)
        seq_lens, hist_seq_lens = take(b), take(b)
        kv_start, hist_kv_start = take(b), take(b)
        cu = take(b + 1)
        slots_t, dense_rows, dense_lens = take(b), take(b), take(b)
        offsets = torch.arange(st - t, st, device=self.device, dtype=torch.int64)
        slot_mapping = (slots_t.long()[:, None] * st + offsets[None, :]).reshape(-1)
        return SlabMetadata(
            namespaces=tuple(ns for ns, _r, _c in rows),
            chunk_indices=tuple(c.index for _ns, _r, c in rows),
            n_tokens=t,
            num_seqs=b,
            block_table=block_table,
            seq_lens=seq_lens,
            kv_start=kv_start,
            hist_block_table=hist_table,
            hist_seq_lens=hist_seq_lens,
            hist_kv_start=hist_kv_start,
            cu_seqlens_q=cu,
            slot_mapping=slot_mapping.to(self._slot_dtype),
            dense_block_table=dense_rows.view(b, 1),
            dense_seq_lens=dense_lens,
            max_seqlen_q=t,
            max_seqlen_k=max(lens),
            hist_max_seqlen_k=max(hist_lens),
            has_kv_start=any(starts),
            hist_has_kv_start=any(hist_starts),
            _owner=self._cache_id,
            _versions=tuple(r.version for _ns, r, _c in rows),
            _epoch=self._epoch,
            _current=tuple(c for _ns, _r, c in rows),
            _history=tuple(history),
        )

    # ------------------------------------------------------------------ forward
    def check_metadata(self, meta: SlabMetadata) -> None:
        """Raise unless ``meta`` comes from this cache and none of its slabs was recycled.

        Raises
        ------
        TypeError
            Not a SlabMetadata.
        ValueError
            Planned by another cache.
        StaleMetadataError
            A namespace of it was cleared, restored or recycled a slab since the plan.
        """
        if not isinstance(meta, SlabMetadata):
            raise TypeError(f"meta: expected a SlabMetadata, got {type(meta).__name__}")
        if meta._owner != self._cache_id:
            raise ValueError("meta: this metadata was planned by another SlabKVCache")
        for ns, ver in zip(meta.namespaces, meta._versions):
            r = self._rollouts.get(ns)
            if r is None or r.version != ver:
                raise StaleMetadataError(
                    f"meta: stale, namespace {ns!r} was cleared, restored or recycled a slab "
                    "since this plan"
                )

    CLASS_NAME = "slab_kv"
    FORWARD_OPTIONS = frozenset(("backend", "scale", "softcap", "return_lse", "num_splits", "deterministic"))
    NOT_FORWARD_OPTIONS = {
        **{name: _VISIBILITY for name in ("window_left", "sink_tokens", "chunk_size", "causal")},
        "kv_start": "set by the pool from the plan's metadata (a short first chunk); do not pass it",
        "out": "forward() returns a new tensor; kvarena.paged_attention(..., out=) writes into a buffer",
        **{name: "set by the pool from the plan's metadata; do not pass it"
           for name in ("cu_seqlens_q", "max_seqlen_q", "max_seqlen_k")},
    }

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: SlabMetadata,
        layer: int,
        *,
        commit: bool = True,
        **options,
    ):
        """Attend one layer's chunk queries over sinks + window (block-causal chunks).

        Everything is checked before the first write: a call that raises leaves the
        cache (slab bytes and commit flags) as it was.

        Parameters
        ----------
        q : Tensor ``[B, T, H_q, D]``
        k, v : Tensor ``[B, T, H_kv, D]``
            The chunk's keys/values at this layer. Under autograd, gradients reach
            ``q``, ``k`` and ``v`` for either value of ``commit`` (the cached history is a
            constant).
        meta : SlabMetadata
            From this cache's :meth:`plan`, not stale.
        layer : int
        commit : bool, default True
            True (the clean pass): write detached ``k, v`` into the chunk's slab, then
            attend over the visible slabs. False (a denoising step): write nothing;
            attend over the committed history and the given ``k, v`` (merged by LSE).
            Both give the same result for the same inputs.
        **options
            Per-call overrides of the layer's :class:`AttentionSpec`: ``backend``,
            ``scale``, ``softcap``, ``return_lse``, ``num_splits``, ``deterministic``.
            Any other keyword is a ``TypeError`` saying where it goes.

        Returns
        -------
        Tensor ``[B, T, H_q, D]`` (and the fp32 lse ``[B, T, H_q]`` with ``return_lse``).

        Raises
        ------
        RuntimeError
            A history chunk was planned but never committed at this layer.

        Examples
        --------
        >>> import torch
        >>> from kvarena import CachePolicy, KVLayout, SlabKVCache
        >>> layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32)
        >>> policy = CachePolicy("slab_kv", max_bytes=1 << 16, per_component={"window": 2})
        >>> pool = SlabKVCache(policy, layout=layout, slab_tokens=3)
        >>> q, k, v = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8)
        >>> meta = pool.plan({"video0": 0})                         # chunk 0 of one rollout
        >>> noisy = pool.forward(q, k, v, meta, 0, commit=False)    # a denoising step
        >>> clean = pool.forward(q, k, v, meta, 0, commit=True)     # the clean pass stores
        >>> torch.allclose(noisy, clean, atol=1e-6), pool.chunk_indices("video0")
        (True, [0])
        """
        region = self._require_arena("forward")
        # Host-side freshness (O(1) unless a plan moved the epoch). Skipped while torch.compile
        # traces: dynamo would guard on the epoch and recompile after every plan.
        fresh = torch.compiler.is_compiling() or (
            type(meta) is SlabMetadata and meta._owner == self._cache_id and meta._epoch == self._epoch
        )
        if not fresh:
            self.check_metadata(meta)  # raises unless still current
        check_bool("commit", commit)
        layer = self._check_layer(layer)
        spec = self._call_spec(layer, options)
        b, t = meta.num_seqs, meta.n_tokens
        h_q = self._check_qkv(q, k, v, (b, t), "[B, T, H, D]")
        h_kv, d = self.layout.num_kv_heads, self.layout.head_dim
        attn_backend, store_backend, kv_grad = self._backends(spec, q, k, v)
        for ns, ch in meta._history:
            if not ch.committed[layer]:
                raise RuntimeError(
                    f"forward: chunk {ch.index} of namespace {ns!r} is in the history but was "
                    f"never committed at layer {layer} (run forward(..., commit=True) for it)"
                )
        op_spec, op_spec_lse = _op_specs(spec) if options else self._op_pairs[layer]
        kc, vc = region.k(layer), region.v(layer)
        qf = q.reshape(b * t, h_q, d)
        kf, vf = k.reshape(b * t, h_kv, d), v.reshape(b * t, h_kv, d)
        if commit:
            store(kf, vf, kc, vc, meta.slot_mapping, store_backend)
            for ch in meta._current:  # host-only bookkeeping: single stores, no lock, traceable
                ch.committed[layer] = True
            res = attend(
                qf, kc, vc, meta.block_table, meta.seq_lens, meta.cu_seqlens_q,
                meta.kv_start if meta.has_kv_start else None, spec=op_spec, max_seqlen_q=t,
                max_seqlen_k=meta.max_seqlen_k, backend=attn_backend, new_kv=(kf, vf) if kv_grad else None,
            )
            out, lse = res if spec.return_lse else (res, None)
        else:
            kd = k if k.stride(-1) == 1 else k.contiguous()
            vd = v if v.stride(-1) == 1 else v.contiguous()
            hist_kv_start = meta.hist_kv_start if meta.hist_has_kv_start else None
            out, lse = attend_history_and_own(
                qf, kc, vc, meta.hist_block_table, meta.hist_seq_lens, meta.cu_seqlens_q, hist_kv_start, (kd, vd),
                own_table=meta.dense_block_table, own_lens=meta.dense_seq_lens, spec=op_spec, spec_lse=op_spec_lse,
                max_seqlen_q=t, max_seqlen_k=meta.hist_max_seqlen_k, backend=attn_backend,
            )
        out = out.reshape(b, t, h_q, d)
        return (out, lse.reshape(b, t, h_q)) if spec.return_lse else out

    # ------------------------------------------------------------------ seed API
    def append(self, namespace: Hashable, slab: Slab) -> None:
        """Store a whole chunk (all layers) in one call: ``plan`` + write every layer.

        Parameters
        ----------
        namespace : hashable
        slab : Slab
            ``k, v [num_layers, T, H_kv, D]``; the first append of a pool made from a
            policy alone creates the arena from it.

        Raises
        ------
        CacheFullError, ValueError, TypeError
            As :meth:`plan`, or K/V not matching the layout; nothing changed.
        """
        if not isinstance(slab, Slab):
            raise TypeError(f"slab: expected a Slab, got {type(slab).__name__}")
        k, v = slab.k, slab.v
        for name, x in (("slab.k", k), ("slab.v", v)):
            if not isinstance(x, torch.Tensor) or x.dim() != 4:
                shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"{name}: expected a [num_layers, T, H_kv, D] tensor, got {shape}")
        if v.shape != k.shape:
            raise ValueError(f"slab.v: expected slab.k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
        t = int(k.shape[1])
        with self._lock:
            fresh = self._region is None
            if fresh:
                prev_st = self.slab_tokens
                layout = KVLayout.from_kv(k)
                st = self.slab_tokens if self.slab_tokens is not None else t
                self._materialize(layout, st, k.device if self._device_arg is None else self._device_arg)

            try:
                lay = self.layout
                shape = (lay.num_layers, t, lay.num_kv_heads, lay.head_dim)
                for name, x in (("slab.k", k), ("slab.v", v)):
                    check_forward_tensor(name, x, shape, lay.dtype, self.device, "[num_layers, T, H_kv, D] of the layout")
                rows, _t = self._reserve({namespace: (_check_int("slab.chunk_index", slab.chunk_index, 0), t)})
            except BaseException:
                if fresh:  # a failed first append leaves the pool as it was: no arena
                    self.arena = self._region = self.layout = None
                    self.slab_tokens = prev_st
                    self._specs = ()
                raise
            (_ns, _r, ch) = rows[0]
            st = self.slab_tokens
            data = self._region.data[ch.slot]  # [L, 2, st, H, D]
            with torch.no_grad():
                data[:, 0, st - t :].copy_(k)
                data[:, 1, st - t :].copy_(v)
            ch.committed = [True] * lay.num_layers

    def get(self, namespace: Hashable) -> list[Slab]:
        """The namespace's chunks committed at every layer, in logical order.

        Returns
        -------
        list of Slab
            Sinks, then the oldest to the newest chunk; ``k, v [num_layers, n, H_kv, D]``
            are views into the arena of the chunk's ``n`` real tokens. ``[]`` for an
            unknown namespace.
        """
        with self._lock:
            r = self._rollouts.get(namespace)
            if r is None or self._region is None:
                return []
            st = self.slab_tokens
            data = self._region.data
            return [
                Slab(i, data[ch.slot, :, 0, st - ch.n_tokens :], data[ch.slot, :, 1, st - ch.n_tokens :])
                for i, ch in r.chunks.items()
                if all(ch.committed)
            ]

    def clear_namespace(self, namespace: Hashable) -> None:
        """Free every slab of ``namespace`` (unknown: no-op)."""
        with self._lock:
            r = self._rollouts.pop(namespace, None)
            if r is not None:
                self._stamp()
            if r is not None and r.chunks:
                self._region.allocator.decref(
                    [ch.slot for ch in sorted(r.chunks.values(), key=lambda c: -c.index)]
                )

    # ------------------------------------------------------------------ rollback
    def snapshot(self, namespace: Hashable) -> SlabSnapshot:
        """A rollback point of ``namespace`` (``KeyError`` if unknown)."""
        with self._lock:
            r = self._rollouts.get(namespace)
            if r is None:
                raise KeyError(f"namespace {namespace!r} is not in this SlabKVCache")
            return SlabSnapshot(namespace, self._cache_id, tuple(r.chunks.items()), r.last)

    def restore(self, namespace: Hashable, snap: SlabSnapshot) -> None:
        """Roll ``namespace`` back to ``snap``, freeing the slabs claimed after it.

        Chunks kept keep their slab contents. Metadata planned before becomes stale.

        Raises
        ------
        KeyError
            Unknown namespace.
        ValueError
            ``snap`` is of another namespace or cache, or a chunk it holds was recycled
            or cleared since (its bytes are gone); nothing changed.
        """
        with self._lock:
            r = self._rollouts.get(namespace)
            if r is None:
                raise KeyError(f"namespace {namespace!r} is not in this SlabKVCache")
            if not isinstance(snap, SlabSnapshot):
                raise TypeError(f"snap: expected a SlabSnapshot, got {type(snap).__name__}")
            if snap._owner != self._cache_id or snap.namespace != namespace:
                raise ValueError(
                    f"snap: taken of namespace {snap.namespace!r} of another cache or "
                    f"namespace, not {namespace!r} of this one"
                )
            for i, ch in snap._chunks:
                if r.chunks.get(i) is not ch:
                    raise ValueError(
                        f"snap: chunk {i} of namespace {namespace!r} was recycled or cleared "
                        "since the snapshot; cannot restore"
                    )
            kept = {i for i, _ch in snap._chunks}
            extra = sorted((ch for i, ch in r.chunks.items() if i not in kept), key=lambda c: -c.index)
            if extra:
                self._region.allocator.decref([ch.slot for ch in extra])
            r.chunks = dict(snap._chunks)
            r.last = snap._last
            r.version = self._stamp()

    def __repr__(self) -> str:
        return (
            f"SlabKVCache(slots={self.num_slots}, used={self.used_bytes}, window={self.window}, "
            f"sinks={self.sinks}, slab_tokens={self.slab_tokens}, training={self.training_mode})"
        )
