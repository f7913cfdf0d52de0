"""Paged KV cache for autoregressive decode: fixed-size blocks in one arena region.

Each namespace (a request, or a fork of one) owns a list of block ids and a row of a
persistent device block table ``[max_seqs, max_blocks_per_seq]``. ``plan`` reserves
slots for one step's new tokens (all-or-nothing over the batch), writes only the table
entries that changed (one ``index_put_``), gathers the batch's rows and returns
:class:`PagedMetadata`; ``forward`` then stores each layer's new K/V and runs causal
(bottom-right aligned) block-table attention with it, with no host-device sync.

A layout with layer groups (``KVLayout(groups=...)``: Gemma 2/3's and gpt-oss's sliding
and full layers, or layers of other shapes) gets a block list and a table row per group
and namespace, all from the one allocator: a group's block holds that group's layers.

With ``free_out_of_window=True``, a group whose layers all slide returns each block whose
tokens no future query of its sequence can see (all older than the group's window, none
a sink token) to the allocator at plan time; its list entry becomes ``-1`` and its table
entry 0, which no kernel dereferences (the kernels only read blocks overlapping a row's
visible range). Full-attention groups keep their history.

Forks share blocks by reference count. A shared block that a namespace is about to
write into (the partial last block after a fork, or a full one after a ``truncate``)
is copied first (copy-on-write at plan time: a new block gets the whole
``[num_layers, 2, block_size, H_kv, D]`` contents and the old one is dereferenced).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

import torch

from kvarena.attention.batch import KeySet, OwnKeys, QueryRows
from kvarena.attention.checks import check_sink_logits
from kvarena.attention.dispatch import attend, store
from kvarena.attention.spec import check_bool
from kvarena.cache._meta import StaleMetadataError, as_device, next_version, region_of_arena, upload
from kvarena.cache._pool import KVPoolBase
from kvarena.cache.arena import BlockAllocator, CacheFullError, KVArena, KVLayout, _check_int

__all__ = ["PagedKVCache", "PagedMetadata"]

_FROM_META = "set by the pool from the plan's metadata; do not pass it to forward()"
_DEFAULT_MAX_SEQS = 256
_DEFAULT_MAX_BLOCKS = 512
#: A released (out-of-window) block in a sequence's block list.
FREED = -1


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
        padding and never read), in layer group 0.
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
    _owner: int = field(repr=False)
    _versions: tuple = field(repr=False)
    _epoch: int = field(repr=False)
    _graph_gen: int | None = field(default=None, repr=False)
    pad_to: int | None = None
    #: Decode context parallel: ``(own_table [B, max_q], own_lens [B])``, the step's own
    #: keys as one-token pages of the given k / v (None otherwise).
    cp_own: tuple | None = field(default=None, repr=False)
    #: The step's longest sequence (host int; a graph plan's ``max_seqlen_k`` is its
    #: capacity instead). None: ``max_seqlen_k``.
    _longest: int | None = field(default=None, repr=False)

    #: The typed key sets the forward hands ``attend``: one per layer group, and the query rows.
    keys: tuple = field(init=False, repr=False)
    rows: QueryRows = field(init=False, repr=False)

    def __post_init__(self) -> None:
        keys = tuple(KeySet(t, self.seq_lens, self.max_seqlen_k) for t in self.block_tables)
        object.__setattr__(self, "keys", keys)
        object.__setattr__(self, "rows", QueryRows(self.cu_seqlens_q, self.max_seqlen_q))

    @property
    def _max_seq_len(self) -> int:
        return self.max_seqlen_k if self._longest is None else self._longest


class _Seq:
    __slots__ = ("blocks", "seq_len", "row", "version", "released")

    def __init__(self, row: int, groups: int) -> None:
        self.blocks: list[list[int]] = [[] for _ in range(groups)]  # per layer group
        self.seq_len = 0
        self.row = row  # the same row of every group's table
        self.version = next_version()
        # free_out_of_window, per group: blocks [sink blocks, released) are FREED (one run,
        # since releases only ever extend it), so each plan scans only the newly dead blocks.
        self.released = [0] * groups


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PagedKVCache(KVPoolBase):
    """Arena-backed paged KV pool (AR decode), the ``PagedKVCache`` of the original ``cache_pools.py`` API made real.

    Parameters
    ----------
    policy : CachePolicy
        Of class ``"paged_kv"``. ``max_bytes`` is the budget (``total_blocks = max_bytes // block_bytes``);
        ``block_bytes`` is 0 (derived from ``layout``) or must equal
        ``layout.block_bytes(block_size)``. Without a layout it must be ``> 0`` and the
        pool does block bookkeeping only.
    layout : KVLayout, optional
        Per-token K/V shape; required for :meth:`forward`.
    block_size : int, optional
        Tokens per block (default 16; with ``arena``, the region's block size).
    device : torch.device or str, optional
        Device of the pool's own arena and metadata (default CPU; with ``arena``, the
        arena's device).
    arena : KVArena, optional
        A shared arena; the pool uses ``region`` of it (default: the only region, else
        the one named after ``policy.class_name``, else ``"paged_kv"``), and that
        region's block count is ``total_blocks``. Without one the pool makes its own.
    region : str, optional
        Region name inside ``arena``.
    max_seqs, max_blocks_per_seq : int, optional
        Initial size of the persistent device block table (defaults
        ``min(total_blocks, 256)`` and ``min(total_blocks, 512)``); both double when
        exceeded (a re-allocation between steps).
    graph_capacity : tuple, optional
        ``(max_batch, max_blocks)`` or ``(max_batch, max_blocks, q_per_seq)``: makes
        fixed persistent metadata buffers for CUDA-graph replay, filled by
        ``plan(..., graph=True)`` (see :meth:`plan`). ``q_per_seq`` defaults to 1
        (decode).
    attention : AttentionSpec, list of AttentionSpec, or mapping, optional
        The attention options of each layer (scale, softcap, window, sink tokens,
        block-causal chunking, backend, split policy, determinism), validated here
        once: one spec for every layer, a list with one per layer, or a mapping
        ``{layer or iterable of layers: spec}`` (unnamed layers take the default
        ``AttentionSpec()``). Default: ``AttentionSpec()`` everywhere.
    free_out_of_window : bool, default False
        Every layer group whose layers all slide (``window_left`` set) releases: at each
        :meth:`plan`, the group's blocks of a sequence that no future query can see (every
        token older than ``p - window_left`` for the step's first query ``p``, no token
        ``< sink_tokens``; the largest window and sinks over the group's layers) return to
        the allocator, so a long generation holds at most ``ceil(sinks / bs) + ceil((window
        + 1) / bs) + 1`` blocks per sequence in that group. Groups with a full-attention
        layer keep their history; at least one group must slide (an ungrouped layout: every
        layer). ``block_ids`` shows released blocks as ``-1``; ``truncate`` back past one is
        a ValueError; ``forward`` refuses a per-call ``window_left`` / ``sink_tokens`` that
        would see more.
    rollback_tokens : int, default 0
        With ``free_out_of_window``: blocks are kept until they are out of the window of
        a query ``rollback_tokens`` positions earlier too, so ``truncate`` to any length
        ``>= p - rollback_tokens`` always works, ``p`` the longest length a plan of the
        sequence started from (speculative decoding's rejected drafts). Released blocks
        never come back: a rollback does not renew the margin for the next one.
    context_parallel : kvarena.distributed.ContextParallel, optional
        ``mode="tokens"``: decode context parallel over the group's ranks (q, k, v and
        the output replicated; block ``j`` of a sequence stored only by rank ``j % N``);
        the constructor then makes a
        :class:`~kvarena.cache.paged_cp.ContextParallelPagedKVCache` (see there for what
        it does not serve).

    Attributes
    ----------
    total_blocks : int
    free : int
        Free blocks (an attribute of the original ``cache_pools.py`` API).
    used_bytes, free_bytes : int
    hits, misses : int
        Kept for the original ``cache_pools.py`` interface; always 0.
    group_used_blocks, group_used_bytes : tuple of int
        Blocks (and their bytes) this pool holds per layer group (one entry when ungrouped).
    allocator : BlockAllocator
    arena : KVArena or None
    layout : KVLayout or None
    """

    def __new__(cls, *args, context_parallel=None, **kwargs):
        if context_parallel is not None and cls is PagedKVCache:
            from kvarena.cache.paged_cp import ContextParallelPagedKVCache

            cls = ContextParallelPagedKVCache
        return object.__new__(cls)

    def __init__(
        self,
        policy,
        *,
        layout: KVLayout | None = None,
        block_size: int | None = None,
        device=None,
        arena: KVArena | None = None,
        region: str | None = None,
        max_seqs: int | None = None,
        max_blocks_per_seq: int | None = None,
        graph_capacity: tuple | None = None,
        attention=None,
        free_out_of_window: bool = False,
        rollback_tokens: int = 0,
        context_parallel=None,  # not None: __new__ made a ContextParallelPagedKVCache instead
    ) -> None:
        self._init_pool(policy, attention)
        own_budget = arena is None  # the pool sizes its arena from policy.max_bytes
        check_bool("free_out_of_window", free_out_of_window)
        self._rollback = _check_int("rollback_tokens", rollback_tokens, 0)
        if self._rollback and not free_out_of_window:
            raise ValueError("rollback_tokens: only meaningful with free_out_of_window=True")
        device = as_device(device)
        if block_size is not None:
            _check_int("block_size", block_size, 1)
        policy_bb = int(getattr(policy, "block_bytes", 0))
        if arena is not None:
            reg, layout = region_of_arena(
                arena, region, policy, "paged_kv", layout, "block_size", block_size, device
            )
            if policy_bb and policy_bb != reg.block_bytes:
                raise ValueError(
                    f"policy.block_bytes: {policy_bb} differs from the region's block bytes "
                    f"{reg.block_bytes} ({reg.layout}, block_size {reg.block_tokens})"
                )
            block_size = reg.block_tokens
        elif layout is not None:
            if not isinstance(layout, KVLayout):
                raise TypeError(f"layout: expected a KVLayout, got {type(layout).__name__}")
            if region is not None:
                raise ValueError("region: only meaningful together with arena=")
            block_size = 16 if block_size is None else block_size
            bb = layout.block_bytes(block_size)
            if policy_bb not in (0, bb):
                raise ValueError(
                    f"policy.block_bytes: expected 0 (derived) or {bb} = layout.block_bytes"
                    f"({block_size}), got {policy_bb}"
                )
            self._specs = self._bind_layout(layout, device or torch.device("cpu"))
            arena = KVArena.single("paged_kv", layout, block_size, policy.max_bytes, device=device)
            reg = arena["paged_kv"]
        else:
            if region is not None:
                raise ValueError("region: only meaningful together with arena=")
            if policy_bb <= 0:
                raise ValueError(
                    "policy.block_bytes: a PagedKVCache without a layout needs block_bytes > 0 "
                    "(or pass layout=KVLayout(...) to derive it)"
                )
            block_size = 16 if block_size is None else block_size
            reg = None
        if arena is not None and not self._specs:
            self._specs = self._bind_layout(layout, arena.device)
        self.arena = arena
        self.layout = layout
        self.block_size = block_size
        self._region = reg
        if reg is not None:
            self.allocator = reg.allocator
            self.block_bytes = reg.block_bytes
            self.device = arena.device
        else:
            self.block_bytes = policy_bb
            self.allocator = BlockAllocator(policy.max_bytes // policy_bb)
            self.device = device or torch.device("cpu")
        total = self.allocator.num_blocks
        groups = 1 if layout is None else len(layout.layer_groups)
        if own_budget and total < groups:  # not even one block (per layer group) for a first token
            per = f"{self.block_bytes} bytes" + (f" per layer group, {groups} groups" if groups > 1 else "")
            raise ValueError(
                f"policy.max_bytes: {policy.max_bytes} bytes cannot hold one block of block_size {block_size} "
                f"tokens ({per}); expected max_bytes >= {self.block_bytes * groups}"
            )
        self._slot_dtype = torch.int32 if total * block_size < 2**31 else torch.int64
        rows = _check_int("max_seqs", max_seqs, 1) if max_seqs is not None else None
        cols = (
            _check_int("max_blocks_per_seq", max_blocks_per_seq, 1)
            if max_blocks_per_seq is not None
            else None
        )
        rows = rows or max(1, min(total, _DEFAULT_MAX_SEQS))
        cols = cols or max(1, min(total, _DEFAULT_MAX_BLOCKS))
        # Layer groups: a block list per (namespace, group), a table [G, rows, cols].
        self._ngroups = 1 if layout is None else len(layout.layer_groups)
        self._layer_group = () if layout is None else tuple(layout.group_of(i)[0] for i in range(layout.num_layers))
        self._group_used = [0] * self._ngroups
        self._table = torch.zeros(self._ngroups, rows, cols, dtype=torch.int32, device=self.device)
        self._free_rows = list(range(rows - 1, -1, -1))
        self._pending: dict[tuple[int, int, int], int] = {}  # (group, row, col) -> block
        self._seqs: dict[Hashable, _Seq] = {}
        self._graph = None
        self._graph_gen = 0
        if graph_capacity is not None:
            self._graph = self._make_graph_buffers(graph_capacity)
        self._limits = self._windows_of(free_out_of_window)
        # What a release keeps per group: (window + rollback margin, sink tokens), or None.
        self._keep = [None if lim is None else (lim[0] + self._rollback, lim[1]) for lim in self._limits]
        self._releases = any(k is not None for k in self._keep)
        # Groups that release alike (same window, or none) stay alike: every operation
        # (plan, fork, copy-on-write, truncate, allocate) treats them the same way, so their
        # block lists have equal lengths, released runs and per-index reference counts, only
        # other ids. A plan decides for one group per class and applies to all.
        classes: dict = {}
        for g, keep in enumerate(self._keep):
            classes.setdefault(keep, []).append(g)
        self._classes = [(gs[0], len(gs), gs) for gs in classes.values()]

    def _windows_of(self, free: bool) -> list:
        """Per group: ``(window_left, sink_tokens)`` its blocks are released by (the widest
        over its layers), or None (it keeps every block)."""
        if not free:
            return [None] * self._ngroups
        if not self._specs:
            raise ValueError("free_out_of_window: needs a layout (the layers' attention specs)")
        out = []
        for grp in self.layout.layer_groups:
            specs = [self._specs[i] for i in grp.layers]
            full = [i for i, sp in zip(grp.layers, specs) if sp.window_left is None]
            out.append(None if full else (max(sp.window_left for sp in specs), max(sp.sink_tokens for sp in specs)))
        if all(lim is None for lim in out):
            full = next(i for i, sp in enumerate(self._specs) if sp.window_left is None)
            hint = ("no group of layout.groups has only sliding layers" if self.layout.groups is not None else
                    "group the layers (KVLayout(groups=kvarena.group_layers(...))) so the sliding ones release "
                    "on their own")
            raise ValueError(f"free_out_of_window: layer {full} sees the whole history (window_left None); {hint}")
        return out
    # ------------------------------------------------------------------ accounting
    def _blocks(self):
        return self.allocator, self.block_bytes

    @property
    def total_blocks(self) -> int:
        """int: blocks in the pool's budget."""
        return self.allocator.num_blocks

    @property
    def free(self) -> int:
        """int: free blocks."""
        return self.allocator.num_free

    @property
    def group_used_blocks(self) -> tuple[int, ...]:
        """tuple of int: blocks this pool holds per layer group."""
        return tuple(self._group_used)

    @property
    def group_used_bytes(self) -> tuple[int, ...]:
        """tuple of int: arena bytes of those blocks (``block_bytes`` each: a block of a
        smaller group still takes a whole block)."""
        return tuple(n * self.block_bytes for n in self._group_used)

    def stats(self) -> dict:
        """Accounting: ``used_bytes``, ``free_bytes``, ``max_bytes``, ``blocks_used``,
        ``blocks_total``, ``namespaces`` and per layer group ``groups`` (``layers``,
        ``window_left`` released by or None, ``blocks``, ``used_bytes``)."""
        with self._lock:
            layers = [tuple(range(len(self._specs)))] if self.layout is None else [
                g.layers for g in self.layout.layer_groups]
            return {
                "used_bytes": self.used_bytes, "free_bytes": self.free_bytes, "max_bytes": int(self.policy.max_bytes),
                "blocks_used": self.allocator.num_used, "blocks_total": self.total_blocks,
                "namespaces": len(self._seqs),
                "groups": [{"layers": lay, "window_left": None if lim is None else lim[0], "blocks": n,
                            "used_bytes": n * self.block_bytes}
                           for lay, lim, n in zip(layers, self._limits, self._group_used)],
            }

    # The pool's own block traffic is counted per group (the allocator may be shared):
    # takes add to _group_used where the plan / allocate hand the blocks out.
    def _drop(self, group: int, blocks: list[int]) -> None:
        if blocks:
            self._group_used[group] -= len(self.allocator.decref(blocks))

    def __contains__(self, namespace: object) -> bool:
        return namespace in self._seqs

    def namespaces(self) -> list:
        """The live namespaces, in creation order."""
        with self._lock:
            return list(self._seqs)

    def block_ids(self, namespace: Hashable, group: int = 0) -> list[int]:
        """A copy of ``namespace``'s block ids of layer group ``group`` in logical order
        (``KeyError`` if unknown); ``-1`` for a block released out of the window
        (``free_out_of_window``)."""
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < self._ngroups:
            raise ValueError(f"group: expected an int in [0, {self._ngroups}), got {group!r}")
        with self._lock:
            return list(self._get(namespace).blocks[group])

    def seq_len(self, namespace: Hashable) -> int:
        """Tokens held by ``namespace``.

        Raises
        ------
        KeyError
            Unknown namespace.
        """
        with self._lock:
            return self._get(namespace).seq_len

    def _get(self, namespace) -> _Seq:
        seq = self._seqs.get(namespace)
        if seq is None:
            raise KeyError(f"namespace {namespace!r} is not in this PagedKVCache")
        return seq

    # ------------------------------------------------------------------ table rows
    def _new_seq(self) -> _Seq:
        if not self._free_rows:
            old = self._table
            g, rows, cols = old.shape
            self._table = torch.zeros(g, 2 * rows, cols, dtype=torch.int32, device=self.device)
            self._table[:, :rows] = old
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return _Seq(self._free_rows.pop(), self._ngroups)

    def _ensure_cols(self, n_blocks: int) -> None:
        cols = self._table.shape[2]
        if n_blocks <= cols:
            return
        while cols < n_blocks:
            cols *= 2
        old = self._table
        self._table = torch.zeros(*old.shape[:2], cols, dtype=torch.int32, device=self.device)
        self._table[:, :, : old.shape[2]] = old

    def _set_entries(self, seq: _Seq, group: int, start: int) -> None:
        blocks = seq.blocks[group]
        for j in range(start, len(blocks)):
            self._pending[(group, seq.row, j)] = max(blocks[j], 0)  # a released block: entry 0, never read

    def _flush(self) -> None:
        if not self._pending:
            return
        keys = list(self._pending.items())
        self._pending.clear()
        packed = upload([[k[i] for k, _b in keys] for i in range(3)] + [[b for _k, b in keys]], torch.int64,
                        self.device)
        self._table.index_put_((packed[0], packed[1], packed[2]), packed[3].to(torch.int32))

    def _release(self, seq: _Seq) -> None:
        for g, blocks in enumerate(seq.blocks):
            self._drop(g, [b for b in blocks if b != FREED])
        seq.blocks = [[] for _ in range(self._ngroups)]
        self._free_rows.append(seq.row)

    # ------------------------------------------------------------------ cache_pools.py compatibility API
    def allocate(self, namespace: Hashable, n_blocks: int) -> bool:
        """Reserve ``n_blocks`` more blocks for ``namespace`` (created if new), in every
        layer group (``n_blocks * G`` blocks).

        Reserved blocks sit after the namespace's tokens and are used by its next
        ``plan`` calls before any new block is taken.

        Returns
        -------
        bool
            False (and nothing changes) when fewer blocks are free; ``n_blocks = 0`` is
            a no-op returning True.

        Raises
        ------
        ValueError
            ``n_blocks < 0``.
        """
        _check_int("n_blocks", n_blocks, 0)
        if n_blocks == 0:
            return True
        with self._lock:
            if n_blocks * self._ngroups > self.allocator.num_free:
                return False
            seq = self._seqs.get(namespace)
            created = seq is None
            if created:
                seq = self._new_seq()
            self._ensure_cols(max(len(b) for b in seq.blocks) + n_blocks)
            got = self.allocator.alloc(n_blocks * self._ngroups)  # one all-or-nothing call
            for g, blocks in enumerate(seq.blocks):
                start = len(blocks)
                blocks.extend(got[g * n_blocks : (g + 1) * n_blocks])
                self._group_used[g] += n_blocks
                self._set_entries(seq, g, start)
            if created:
                self._seqs[namespace] = seq
            return True

    def free_namespace(self, namespace: Hashable) -> None:
        """Release ``namespace``'s blocks (shared ones lose one reference). Unknown: no-op."""
        with self._lock:
            seq = self._seqs.pop(namespace, None)
            if seq is not None:
                self._release(seq)
                self._stamp()

    # ------------------------------------------------------------------ fork / truncate
    def fork(self, src: Hashable, dst: Hashable) -> None:
        """Make ``dst`` a copy of ``src`` that shares its blocks (by reference count).

        Only the blocks covering ``src``'s tokens are shared (not its reserved ones).
        Either side writing into a shared block later copies it first. Metadata planned
        earlier for ``src`` becomes stale: run its forward passes before forking.

        Raises
        ------
        KeyError
            Unknown ``src``.
        ValueError
            ``dst`` already exists.
        """
        with self._lock:
            s = self._get(src)
            if dst in self._seqs:
                raise ValueError(f"dst: namespace {dst!r} already exists")
            n = _cdiv(s.seq_len, self.block_size)
            self.allocator.incref([b for blocks in s.blocks for b in blocks[:n] if b != FREED])
            d = self._new_seq()
            d.blocks = [list(blocks[:n]) for blocks in s.blocks]
            d.seq_len = s.seq_len
            d.released = [min(r, len(b)) for r, b in zip(s.released, d.blocks)]
            self._seqs[dst] = d
            for g in range(self._ngroups):
                self._set_entries(d, g, 0)
            # src's outstanding metadata goes stale: its tokens not stored yet sit in blocks
            # now shared with dst, and dst's next plan may copy such a block (CoW) before
            # that forward writes them, leaving dst with garbage where src's last planned
            # tokens should be. Forward src's metadata first, then fork.
            s.version = self._stamp()

    def check_truncate(self, namespace: Hashable, n_tokens: int) -> None:
        """Raise exactly what :meth:`truncate` would for these arguments, changing nothing
        (so a caller rolling back several namespaces can check them all first)."""
        with self._lock:
            self._truncate_checked(namespace, n_tokens)

    def _truncate_checked(self, namespace, n_tokens) -> _Seq:
        seq = self._get(namespace)
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, int):
            raise TypeError(f"n_tokens: expected an int, got {n_tokens!r}")
        if not 0 <= n_tokens <= seq.seq_len:
            raise ValueError(f"n_tokens: expected 0 <= n_tokens <= seq_len ({seq.seq_len}), got {n_tokens}")
        keep = _cdiv(n_tokens, self.block_size)
        for g, lim in enumerate(self._limits):
            if lim is None or not n_tokens:
                continue
            # The next query (position n_tokens) needs its window and the sinks back; the
            # sink blocks are never released, the others were in one run.
            w, sinks = lim
            lo = max(0, n_tokens - w) // self.block_size
            first = max(lo, _cdiv(sinks, self.block_size))
            if first < min(keep, seq.released[g]):
                where = f" of layer group {g}" if self._ngroups > 1 else ""
                raise ValueError(
                    f"n_tokens: rolling back to {n_tokens} tokens needs block {first}{where} (tokens "
                    f"{first * self.block_size}..), released out of the window at an earlier plan; "
                    f"reachable lengths: {self._min_len(seq)} and on, or one whose window holds only "
                    "sink blocks")
        return seq

    def truncate(self, namespace: Hashable, n_tokens: int) -> None:
        """Roll ``namespace`` back to its first ``n_tokens`` tokens, freeing unneeded blocks.

        Blocks past ``ceil(n_tokens / block_size)`` (reserved ones included) are
        dereferenced. Metadata planned earlier for this namespace becomes stale.

        Raises
        ------
        KeyError
            Unknown namespace.
        ValueError
            ``n_tokens`` outside ``[0, seq_len]``.
        """
        with self._lock:
            seq = self._truncate_checked(namespace, n_tokens)
            keep = _cdiv(n_tokens, self.block_size)
            for g, blocks in enumerate(seq.blocks):
                if len(blocks) > keep:
                    self._drop(g, [b for b in blocks[keep:] if b != FREED])
                    del blocks[keep:]
                    seq.released[g] = min(seq.released[g], keep)
            seq.seq_len = n_tokens
            seq.version = self._stamp()

    def _min_len(self, seq: _Seq) -> int:
        """The shortest length past every group's released run that ``truncate`` can reach."""
        out = 0
        for g, lim in enumerate(self._limits):
            if lim is not None and seq.released[g] > _cdiv(lim[1], self.block_size):
                out = max(out, min(seq.seq_len, seq.released[g] * self.block_size + lim[0]))
        return out

    def _dead_blocks(self, seq: _Seq, group: int) -> tuple[list[int], int]:
        """``(indices, end)``: ``seq``'s live blocks of ``group`` no query at a position >=
        seq_len can see, among those not released yet (O(blocks that died since the last
        plan)), and the end of the group's released run once they are."""
        w, sinks = self._keep[group]
        bs = self.block_size
        blocks, released = seq.blocks[group], seq.released[group]
        end = min(max(0, seq.seq_len - w) // bs, len(blocks))  # blocks j < end: tokens < seq_len - w
        start = max(_cdiv(sinks, bs), released)
        return [j for j in range(start, end) if blocks[j] != FREED], max(released, end)

    # ------------------------------------------------------------------ plan
    def _make_graph_buffers(self, capacity) -> dict:
        if not isinstance(capacity, (tuple, list)) or len(capacity) not in (2, 3):
            raise TypeError(
                "graph_capacity: expected (max_batch, max_blocks) or "
                f"(max_batch, max_blocks, q_per_seq), got {capacity!r}"
            )
        max_batch = _check_int("graph_capacity[0] (max_batch)", capacity[0], 1)
        max_blocks = _check_int("graph_capacity[1] (max_blocks)", capacity[1], 1)
        q_per = _check_int("graph_capacity[2] (q_per_seq)", capacity[2], 1) if len(capacity) == 3 else 1
        dev = self.device
        return {
            "max_batch": max_batch,
            "max_blocks": max_blocks,
            "q_per_seq": q_per,
            "slot_mapping": torch.full((self._ngroups, max_batch * q_per), -1, dtype=self._slot_dtype, device=dev),
            "block_table": torch.zeros(self._ngroups, max_batch, max_blocks, dtype=torch.int32, device=dev),
            "seq_lens": torch.zeros(max_batch, dtype=torch.int32, device=dev),
            # Every row (padding included) owns q_per_seq query rows: constant offsets.
            "cu_seqlens_q": torch.arange(0, (max_batch + 1) * q_per, q_per, dtype=torch.int32, device=dev),
        }

    def _count(self, items) -> tuple:
        """What a plan of ``items`` needs, changing nothing (call under the lock):
        ``(blocks needed, blocks available once its releases are applied, the longest
        sequence's blocks, {(namespace, group): (dead indices, released end)}, namespaces
        that take blocks)``."""
        bs = self.block_size
        alloc = self.allocator
        refs = alloc._ref  # read-only here (the hot loop: a plan visits every row of every class)
        sliding = [c for c in self._classes if self._keep[c[0]] is not None]
        need = 0
        pending_drop: dict[int, int] = {}  # (the class representatives' block ids)
        max_blocks = 0
        dead: dict = {}  # (namespace, group) -> block indices out of the group's window
        drops: dict[int, int] = {}  # block id -> references those releases drop
        touched = set()  # namespaces that take blocks (new or copy-on-write)
        for ns, _n in items if sliding else ():
            seq = self._seqs.get(ns)
            if seq is None:
                continue
            for rep_g, _mult, gs in sliding:
                # Blocks j < end hold only tokens < seq_len - window: O(1) when none died.
                end = min((seq.seq_len - self._keep[rep_g][0]) // bs, len(seq.blocks[rep_g]))
                if end > seq.released[rep_g]:
                    for g in gs:
                        js, _end = dead[ns, g] = self._dead_blocks(seq, g)
                        for j in js:
                            b = seq.blocks[g][j]
                            drops[b] = drops.get(b, 0) + 1
        for ns, n in items:
            seq = self._seqs.get(ns)
            old = seq.seq_len if seq is not None else 0
            n_blocks = _cdiv(old + n, bs)
            max_blocks = max(max_blocks, n_blocks)
            first = old // bs
            before = need
            for rep_g, mult, _gs in self._classes:
                blocks = seq.blocks[rep_g] if seq is not None else ()
                have = len(blocks)
                if n_blocks > have:
                    need += mult * (n_blocks - have)
                for j in range(first, min(have, n_blocks)):
                    b = blocks[j]
                    # References after this plan's releases (a fork's dead copy of the block).
                    if refs.get(b, 0) - drops.get(b, 0) - pending_drop.get(b, 0) > 1:
                        need += mult
                        pending_drop[b] = pending_drop.get(b, 0) + 1
            if need > before or seq is None:
                touched.add(ns)
        # Dead blocks whose every reference this plan releases come back before the step
        # takes any (the releases are applied first).
        returning = sum(1 for b, c in drops.items() if refs.get(b, 0) == c)
        return need, alloc.num_free + returning, max_blocks, dead, touched

    def plan(self, batch: Mapping[Hashable, int], *, graph: bool = False, pad_to: int | None = None) -> PagedMetadata:
        """Reserve slots for this step's new tokens and build the step's metadata.

        Parameters
        ----------
        batch : mapping of namespace to int
            New tokens per namespace (``>= 1``; a prefill chunk or 1 for decode).
            Unknown namespaces are created. Rows follow the mapping's order.
        graph : bool, default False
            Write into the persistent buffers made by ``graph_capacity`` (their
            ``data_ptr`` never changes): rows past the batch are padding with
            ``seq_len`` 0 and ``q_per_seq`` queries each (out 0), padding slots are -1,
            and the host maxima are the capacity's (``max_seqlen_q = q_per_seq``,
            ``max_seqlen_k = max_blocks * block_size``), so one captured graph serves
            every step. Every namespace must add exactly ``q_per_seq`` tokens.
        pad_to : int, optional
            A padded batch: every row owns ``pad_to`` query rows (q, k, v and the output
            are ``[B * pad_to, H, D]``, i.e. ``[B, pad_to, H, D]`` flattened), its new
            tokens the last ones (left padding; ``0 <= n <= pad_to``). Padding rows are
            never stored (slot -1) and their outputs mean nothing (a padding row sits at a
            position before the row's new tokens: it sees the keys up to there, or none),
            so a padded model batch needs no pack / unpack per layer. Not under autograd
            for k/v (ValueError at forward).

        Returns
        -------
        PagedMetadata

        Raises
        ------
        CacheFullError
            Not enough free blocks for the whole batch (new blocks plus copy-on-write
            copies); nothing changed.
        TypeError, ValueError
            Bad counts, an empty batch, or a batch over the graph capacity.
        """
        check_bool("graph", graph)
        if not isinstance(batch, Mapping):
            raise TypeError(f"batch: expected a mapping of namespace -> n_new_tokens, got {type(batch).__name__}")
        if not batch:
            raise ValueError("batch: expected at least one namespace")
        if pad_to is not None:
            pad_to = _check_int("pad_to", pad_to, 1)
            if graph:
                raise ValueError("pad_to: not with graph=True (graph plans have their own fixed rows)")
        items = [(ns, _check_int(f"batch[{ns!r}]", n, 0 if pad_to else 1)) for ns, n in batch.items()]
        for ns, n in items:
            if pad_to is not None and n > pad_to:
                raise ValueError(f"batch[{ns!r}]: {n} new tokens do not fit pad_to = {pad_to} rows")
        bs = self.block_size
        g_cap = self._graph
        if graph:
            if g_cap is None:
                raise ValueError("graph: this PagedKVCache was made without graph_capacity=")
            if len(items) > g_cap["max_batch"]:
                raise ValueError(f"batch: {len(items)} namespaces exceed graph_capacity max_batch {g_cap['max_batch']}")
            for ns, n in items:
                if n != g_cap["q_per_seq"]:
                    raise ValueError(f"batch[{ns!r}]: graph plans take exactly q_per_seq = {g_cap['q_per_seq']} "
                                     f"tokens, got {n}")
        with self._lock:
            # 1. What the step needs, without changing anything.
            need, available, max_blocks, dead, touched = self._count(items)
            alloc = self.allocator
            refs = alloc._ref
            if graph and max_blocks > g_cap["max_blocks"]:
                raise ValueError(
                    f"batch: a sequence needs {max_blocks} blocks, over graph_capacity max_blocks {g_cap['max_blocks']}"
                )
            if need > available:
                raise CacheFullError(
                    f"plan needs {need} blocks, only {available} of {self.total_blocks} are free "
                    f"(block_size {self.block_size} tokens, {self.block_bytes} bytes a block, "
                    f"budget {self.policy.max_bytes} bytes)"
                )
            for (ns, g), (js, end) in dead.items():  # released even if a shared allocator refuses below
                seq = self._seqs[ns]
                if js:
                    blocks = seq.blocks[g]
                    self._drop(g, [blocks[j] for j in js])
                    for j in js:
                        blocks[j] = FREED
                        self._pending[(g, seq.row, j)] = 0
                    seq.version = self._stamp()
                seq.released[g] = end
            # 2. Apply: new namespaces, copy-on-write, new blocks. Every block is taken in
            # ONE allocator call before anything changes: the allocator may be shared with
            # another pool on the same arena region (its own lock, not ours), so blocks
            # counted free above can be gone by now; a per-block alloc could then raise
            # half-way through and leave the batch half applied.
            fresh = iter(alloc.alloc(need))
            self._ensure_cols(max_blocks)
            copies_src: list[int] = []
            copies_dst: list[int] = []
            old_lens = []
            for ns, n in items:
                seq = self._seqs.get(ns)
                if seq is None:
                    seq = self._seqs[ns] = self._new_seq()
                old = seq.seq_len
                n_blocks = _cdiv(old + n, bs)
                for g in range(self._ngroups) if ns in touched else ():
                    blocks = seq.blocks[g]
                    for j in range(old // bs, min(len(blocks), n_blocks)):
                        b = blocks[j]
                        if refs.get(b, 0) > 1:
                            nb = next(fresh)
                            self._group_used[g] += 1
                            alloc.decref([b])  # shared: never frees
                            copies_src.append(b)
                            copies_dst.append(nb)
                            blocks[j] = nb
                            self._pending[(g, seq.row, j)] = nb
                    start = len(blocks)
                    if n_blocks > start:
                        blocks.extend(next(fresh) for _ in range(n_blocks - start))
                        self._group_used[g] += n_blocks - start
                        self._set_entries(seq, g, start)
                old_lens.append(old)
                seq.seq_len = old + n
                seq.version = self._stamp()
            if copies_src and self._region is not None:
                src = upload(copies_src, torch.int64, self.device)
                dst = upload(copies_dst, torch.int64, self.device)
                self._region.copy_blocks(src, dst)
            self._flush()
            # 3. Metadata.
            return self._build_meta(items, old_lens, max_blocks, graph, pad_to)

    def _build_meta(self, items, old_lens, max_blocks, graph, pad_to=None) -> PagedMetadata:
        bs = self.block_size
        nseq = len(items)
        seqs = [self._seqs[ns] for ns, _n in items]
        cu = [0]
        for _ns, n in items:
            cu.append(cu[-1] + n)
        total_q = cu[-1]
        if pad_to is not None:
            return self._build_padded_meta(items, seqs, old_lens, max_blocks, pad_to)
        lens = [s.seq_len for s in seqs]
        # One upload: rows | seq_lens | old_lens | cu_seqlens_q.
        packed = upload([s.row for s in seqs] + lens + old_lens + cu, torch.int32, self.device)
        rows = packed[:nseq]
        seq_lens = packed[nseq : 2 * nseq]
        olds = packed[2 * nseq : 3 * nseq]
        cu_t = packed[3 * nseq :]
        table = self._table[:, :, :max_blocks].index_select(1, rows.long())  # [G, B, max_blocks]
        # Slot of every new token, on the device: token i of row b sits at position
        # old_len[b] + i - cu[b] and goes to block_table[g, b, pos // bs], row pos % bs.
        q_lens = cu_t[1:] - cu_t[:-1]
        dev = self.device
        row_of = torch.repeat_interleave(torch.arange(nseq, device=dev), q_lens, output_size=total_q)
        pos = torch.arange(total_q, device=dev) - cu_t[:-1].long()[row_of] + olds.long()[row_of]
        slots = table.long()[:, row_of, pos // bs] * bs + pos % bs  # [G, total_q]
        versions = tuple(s.version for s in seqs)
        namespaces = tuple(ns for ns, _n in items)
        if not graph:
            slots = slots.to(self._slot_dtype)
            return PagedMetadata(
                slot_mapping=slots[0],
                block_table=table[0],
                slot_mappings=tuple(slots),
                block_tables=tuple(table),
                seq_lens=seq_lens,
                cu_seqlens_q=cu_t,
                max_seqlen_q=max(n for _ns, n in items),
                max_seqlen_k=max(lens),
                total_q=total_q,
                num_seqs=nseq,
                namespaces=namespaces,
                num_tokens=total_q,
                _owner=self._cache_id,
                _versions=versions,
                _epoch=self._epoch,
            )
        g = self._graph
        g["slot_mapping"][:, :total_q].copy_(slots)
        g["slot_mapping"][:, total_q:].fill_(-1)
        g["block_table"][:, :nseq, : table.shape[2]].copy_(table)
        g["block_table"][:, nseq:].zero_()
        g["seq_lens"][:nseq].copy_(seq_lens)
        g["seq_lens"][nseq:].zero_()
        self._graph_gen += 1
        return PagedMetadata(
            slot_mapping=g["slot_mapping"][0],
            block_table=g["block_table"][0],
            slot_mappings=tuple(g["slot_mapping"]),
            block_tables=tuple(g["block_table"]),
            seq_lens=g["seq_lens"],
            cu_seqlens_q=g["cu_seqlens_q"],
            max_seqlen_q=g["q_per_seq"],
            max_seqlen_k=g["max_blocks"] * bs,
            _longest=max(s.seq_len for s in seqs),
            total_q=g["max_batch"] * g["q_per_seq"],
            num_seqs=g["max_batch"],
            namespaces=namespaces,
            num_tokens=total_q,
            _owner=self._cache_id,
            _versions=versions,
            _epoch=self._epoch,
            _graph_gen=self._graph_gen,
        )

    def _build_padded_meta(self, items, seqs, old_lens, max_blocks, pad_to: int) -> PagedMetadata:
        """Metadata of a padded batch: row b's ``pad_to`` queries, its new tokens last."""
        bs = self.block_size
        nseq = len(items)
        lens = [s.seq_len for s in seqs]
        news = [n for _ns, n in items]
        total_q = nseq * pad_to
        packed = upload([s.row for s in seqs] + lens + old_lens + news, torch.int32, self.device)
        rows, seq_lens = packed[:nseq], packed[nseq : 2 * nseq]
        olds, new_t = packed[2 * nseq : 3 * nseq].long(), packed[3 * nseq :].long()
        # At least one column: a batch of padding only (no row holds a token) still indexes it.
        max_blocks = max(max_blocks, 1)
        table = self._table[:, :, :max_blocks].index_select(1, rows.long())  # [G, B, max_blocks]
        dev = self.device
        j = torch.arange(pad_to, device=dev)[None, :]  # [1, S]
        first = pad_to - new_t[:, None]  # [B, 1]: the first real query row
        pos = olds[:, None] + j - first  # [B, S] token position; < old_len on padding rows
        real = j >= first
        col = (pos.clamp(min=0) // bs).clamp(max=max(max_blocks - 1, 0))  # [B, S]
        blk = table.long().gather(2, col.expand(table.shape[0], -1, -1).clamp(max=max_blocks - 1))  # [G, B, S]
        slots = torch.where(real, blk * bs + pos.clamp(min=0) % bs, torch.full_like(blk, -1))
        slots = slots.reshape(table.shape[0], -1).to(self._slot_dtype)  # [G, B * S]
        cu = torch.arange(0, (nseq + 1) * pad_to, pad_to, dtype=torch.int32, device=dev)
        return PagedMetadata(
            slot_mapping=slots[0], block_table=table[0], slot_mappings=tuple(slots), block_tables=tuple(table),
            seq_lens=seq_lens, cu_seqlens_q=cu,
            max_seqlen_q=pad_to, max_seqlen_k=max(lens), total_q=total_q, num_seqs=nseq,
            namespaces=tuple(ns for ns, _n in items), num_tokens=sum(news), _owner=self._cache_id,
            _versions=tuple(s.version for s in seqs), _epoch=self._epoch, pad_to=pad_to,
        )

    # ------------------------------------------------------------------ forward
    def check_metadata(self, meta: PagedMetadata) -> None:
        """Raise unless ``meta`` was planned by this cache and is still current.

        Raises
        ------
        TypeError
            Not a PagedMetadata.
        ValueError
            Planned by another cache.
        StaleMetadataError
            A namespace of it was planned again, truncated, forked (as the source) or
            freed since (or a later graph plan overwrote its buffers).
        """
        if not isinstance(meta, PagedMetadata):
            raise TypeError(f"meta: expected a PagedMetadata, got {type(meta).__name__}")
        if meta._owner != self._cache_id:
            raise ValueError("meta: this metadata was planned by another PagedKVCache")
        if meta._graph_gen is not None and meta._graph_gen != self._graph_gen:
            raise StaleMetadataError("meta: a later plan(graph=True) has overwritten its buffers")
        for ns, ver in zip(meta.namespaces, meta._versions):
            seq = self._seqs.get(ns)
            if seq is None or seq.version != ver:
                what = "freed" if seq is None else "planned again, truncated or forked"
                raise StaleMetadataError(f"meta: stale, namespace {ns!r} was {what} since this plan")

    CLASS_NAME = "paged_kv"
    META_TYPE = PagedMetadata
    FORWARD_OPTIONS = frozenset(
        ("backend", "scale", "softcap", "return_lse", "num_splits", "deterministic", "window_left",
         "sink_tokens", "chunk_size", "sink_logits")
    )
    NOT_FORWARD_OPTIONS = {
        "causal": "a layer's causality is part of its AttentionSpec: pass attention= to the constructor",
        "out": "forward() returns a new tensor; kvarena.paged_attention(..., out=) writes into a buffer",
        **{name: _FROM_META for name in ("kv_start", "cu_seqlens_q", "max_seqlen_q", "max_seqlen_k")},
    }

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: PagedMetadata,
        layer: int,
        **options,
    ):
        """Store one layer's new K/V, then attend (causal, bottom-right aligned).

        Everything is checked before the first write: a call that raises leaves the
        cache as it was.

        Parameters
        ----------
        q : Tensor ``[total_q, H_q, D]``
            Queries of the step's new tokens, rows as in ``meta`` (``H_q % H_kv == 0``).
        k, v : Tensor ``[total_q, H_kv, D]``
            The new tokens' keys/values (stored detached; under autograd the attention
            reads them from these tensors, so gradients reach them).
        meta : PagedMetadata
            From this cache's :meth:`plan`, not stale.
        layer : int
            Layer index in ``[0, num_layers)``.
        **options
            Per-call overrides of the layer's :class:`AttentionSpec`: ``backend``,
            ``scale``, ``softcap``, ``return_lse``, ``num_splits``, ``deterministic``,
            ``window_left``, ``sink_tokens``, ``chunk_size`` (validated; no cost when
            none is given). Any other keyword is a ``TypeError`` saying where it goes.

        Returns
        -------
        Tensor ``[total_q, H_q, D]`` (or ``(out, lse [total_q, H_q])`` with ``return_lse``).

        Examples
        --------
        >>> import torch
        >>> from kvarena import AttentionSpec, CachePolicy, KVLayout, PagedKVCache
        >>> layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype=torch.float32)
        >>> pool = PagedKVCache(CachePolicy("paged_kv", max_bytes=1 << 16), layout=layout,
        ...                     block_size=4, attention=AttentionSpec(window_left=3))
        >>> meta = pool.plan({"req0": 5})                 # a 5-token prefill
        >>> q, k, v = torch.randn(5, 2, 8), torch.randn(5, 1, 8), torch.randn(5, 1, 8)
        >>> pool.forward(q, k, v, meta, 0).shape
        torch.Size([5, 2, 8])
        >>> pool.forward(q, k, v, meta, 1, window_left=None).shape   # a per-call override
        torch.Size([5, 2, 8])
        """
        region = self._region
        if region is None:
            raise RuntimeError(
                "forward: this PagedKVCache has no layout (block bookkeeping only); "
                "construct it with layout=KVLayout(...) to store and attend"
            )
        self._require_current(meta)
        layer, spec, group, attn_backend, store_backend, kv_grad = self._check_call(
            q, k, v, layer, options, meta.total_q, meta.pad_to is not None)
        # The step's real longest sequence, not a graph plan's capacity: its last token is
        # the largest position any query or key of the step has.
        if spec.rope_mode and meta._max_seq_len > spec.rope_cos.shape[0]:
            raise ValueError(f"rope_cos: this step reaches position {meta._max_seq_len - 1}, past the "
                             f"{spec.rope_cos.shape[0]}-row rotary table of layer {layer}")
        cache = region.op_views(layer)
        store(k, v, cache, meta.slot_mappings[group], store_backend)
        return attend(q, cache, meta.keys[group], meta.rows, spec=spec, backend=attn_backend,
                      own=OwnKeys(k, v) if kv_grad else None)

    def _check_call(self, q, k, v, layer, options: dict, total_q: int | None = None, padded: bool = False):
        """What :meth:`forward` checks that needs no metadata, in its order: the layer, the
        per-call options, q/k/v (``total_q`` rows; None: ``q``'s), sink logits and the
        backends (``padded``: a ``pad_to`` plan). Changes nothing; an adapter calls it before
        it plans a step, so a step the forward would refuse plans nothing. Returns
        ``(layer, spec, group, attention backend, store backend, k/v need gradients)``."""
        layer = self._check_layer(layer)
        spec = self._call_spec(layer, options)
        group = self._layer_group[layer]
        lim = self._limits[group]
        if options and lim is not None:
            w, sinks = lim
            if spec.window_left is None or spec.window_left > w or spec.sink_tokens > sinks:
                raise ValueError(f"window_left/sink_tokens: this pool releases layer {layer}'s blocks outside "
                                 f"window_left={w}, sink_tokens={sinks} (free_out_of_window); a call cannot see more")
        if total_q is None:
            total_q = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() else 0
        self._check_qkv(q, k, v, (total_q,), "[total_q, H, D]", layer)
        if spec.sink_logits is not None:
            check_sink_logits(spec.sink_logits, q)
        attn_backend, store_backend, kv_grad = self._backends(spec, q, k, v)
        if kv_grad and padded:
            # The differentiable paths read each query row's own k/v at its position, which
            # for a padding row is a real older token's.
            raise ValueError("meta: a padded plan (pad_to) gives no gradient to k/v; plan the real tokens packed")
        return layer, spec, group, attn_backend, store_backend, kv_grad

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(blocks={self.total_blocks}, free={self.free}, block_size="
            f"{self.block_size}, namespaces={len(self._seqs)}, layout={self.layout})"
        )
