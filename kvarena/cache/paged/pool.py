"""The paged KV pool for autoregressive decode: fixed-size blocks in one arena region.

Each namespace (a request, or a fork of one) owns a block list per layer group and a row
of the persistent device block table; forks share blocks by reference count. A layout
with layer groups (``KVLayout(groups=...)``: sliding and full layers, or layers of other
shapes) gets a block list and a table row per group, all from the one allocator. With
``free_out_of_window=True`` a group whose layers all slide returns the blocks no future
query can see at plan time (list entry ``-1``, table entry 0, never read by a kernel).

The pool's steps (``plan`` / ``forward``, following the pools' template
:class:`~kvarena.cache._pool.PoolSteps`, and what a namespace's length counts) are an
object chosen at construction: :class:`~kvarena.cache.paged.local.LocalSteps`, or
:class:`~kvarena.cache.paged.cp.DecodeContextParallel` under ``context_parallel=``; the
block changes of a plan, a fork and a truncate are :mod:`~kvarena.cache.paged.claim`'s.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import torch

from kvarena.argcheck import check_bool, is_int
from kvarena.attention.spec import AttentionSpec
from kvarena.cache._meta import StaleMetadataError, as_device, region_of_arena, upload
from kvarena.cache._pool import KVPoolBase
from kvarena.cache.arena import BlockAllocator, KVArena, KVLayout, _check_int
from kvarena.cache.paged.claim import fork_blocks
from kvarena.cache.paged.cp import DecodeContextParallel, local_policy
from kvarena.cache.paged.local import LocalSteps
from kvarena.cache.paged.meta import GraphBuffers, PagedMetadata
from kvarena.cache.paged.planner import WindowRules
from kvarena.cache.paged.table import FREED, BlockTable, SeqRecord

__all__ = ["PagedKVCache"]

_FROM_META = "set by the pool from the plan's metadata; do not pass it to forward()"
_DEFAULT_MAX_SEQS = 256
_DEFAULT_MAX_BLOCKS = 512


class PagedKVCache(KVPoolBase):
    """Arena-backed paged KV pool (AR decode).

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
        the output replicated; block ``j`` of a sequence stored only by rank ``j % N``):
        the pool's steps are then :class:`~kvarena.cache.paged.cp.DecodeContextParallel`
        (see there for what it does not serve), ``policy.max_bytes`` is the global
        budget (each rank gets ``ceil(blocks / N)`` blocks of it) and ``seq_len`` counts
        all ranks' tokens.

    Attributes
    ----------
    total_blocks : int
    free : int
        Free blocks (an attribute of the original ``cache_pools.py`` API).
    used_bytes, free_bytes : int
    hits, misses : int
        Kept for the original ``cache_pools.py`` interface; always 0.
    context_parallel : ContextParallel or None
    table : Tensor
        The persistent device block table (see :attr:`table`).
    group_used_blocks, group_used_bytes : tuple of int
        Blocks (and their bytes) this pool holds per layer group (one entry when ungrouped).
    allocator : BlockAllocator
    arena : KVArena or None
    layout : KVLayout or None
    """

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
        context_parallel=None,
    ) -> None:
        cp = context_parallel
        if cp is not None:
            block_size = 16 if block_size is None else block_size
            policy = local_policy(cp, policy, layout, block_size, {
                "arena": arena, "region": region, "graph_capacity": graph_capacity,
                "free_out_of_window": free_out_of_window, "rollback_tokens": rollback_tokens})
        self._init_pool(policy, attention)
        check_bool("free_out_of_window", free_out_of_window)
        self._rollback = _check_int("rollback_tokens", rollback_tokens, 0)
        if self._rollback and not free_out_of_window:
            raise ValueError("rollback_tokens: only meaningful with free_out_of_window=True")
        device = as_device(device)
        if block_size is not None:
            _check_int("block_size", block_size, 1)
        own_budget = arena is None  # the pool sizes its arena from policy.max_bytes
        self._bind_storage(layout, block_size, device, arena, region)
        self._init_blocks(device, own_budget)
        self._init_table(max_seqs, max_blocks_per_seq)
        self._graph_gen = 0
        self._graph = None if graph_capacity is None else GraphBuffers.make(
            graph_capacity, self._ngroups, self.block_size, self._slot_dtype, self.device)
        limits = WindowRules.of(free_out_of_window, self.layout, self._specs, self._ngroups)
        self._windows = WindowRules(limits, self._rollback, self.block_size)
        self._limits = self._windows.limits  # per group: (window_left, sink_tokens) released by, or None
        self._steps = LocalSteps(self) if cp is None else DecodeContextParallel(self, cp)

    def _bind_storage(self, layout, block_size, device, arena, region) -> None:
        """The pool's arena, region, layout and block size (its own arena when none is given;
        none at all without a layout: block bookkeeping only)."""
        policy_bb = int(getattr(self.policy, "block_bytes", 0))
        if arena is not None:
            reg, layout = region_of_arena(
                arena, region, self.policy, self.CLASS_NAME, layout, "block_size", block_size, device
            )
            if policy_bb and policy_bb != reg.block_bytes:
                raise ValueError(
                    f"policy.block_bytes: {policy_bb} differs from the region's block bytes "
                    f"{reg.block_bytes} ({reg.layout}, block_size {reg.block_tokens})"
                )
            block_size = reg.block_tokens
            self._specs = self._bind_layout(layout, arena.device)
        else:
            if layout is not None and not isinstance(layout, KVLayout):
                raise TypeError(f"layout: expected a KVLayout, got {type(layout).__name__}")
            if region is not None:
                raise ValueError("region: only meaningful together with arena=")
            block_size = 16 if block_size is None else block_size
            if layout is not None:
                self._check_block_bytes(layout.block_bytes(block_size), block_size)
                arena = self._own_arena(layout, block_size, device)
                reg = arena[self.CLASS_NAME]
            elif policy_bb <= 0:
                raise ValueError(
                    "policy.block_bytes: a PagedKVCache without a layout needs block_bytes > 0 "
                    "(or pass layout=KVLayout(...) to derive it)"
                )
            else:
                reg = None
        self.arena = arena
        self.layout = layout
        self.block_size = block_size
        self._region = reg

    def _init_blocks(self, device, own_budget: bool) -> None:
        """The allocator, block bytes and device (the region's, or a bookkeeping allocator)."""
        policy = self.policy
        reg = self._region
        if reg is not None:
            self.allocator = reg.allocator
            self.block_bytes = reg.block_bytes
            self.device = self.arena.device
        else:
            self.block_bytes = int(policy.block_bytes)
            self.allocator = BlockAllocator(policy.max_bytes // self.block_bytes)
            self.device = device or torch.device("cpu")
        total = self.allocator.num_blocks
        groups = 1 if self.layout is None else len(self.layout.layer_groups)
        if own_budget and total < groups:  # not even one block (per layer group) for a first token
            per = f"{self.block_bytes} bytes" + (f" per layer group, {groups} groups" if groups > 1 else "")
            raise ValueError(
                f"policy.max_bytes: {policy.max_bytes} bytes cannot hold one block of block_size {self.block_size} "
                f"tokens ({per}); expected max_bytes >= {self.block_bytes * groups}"
            )
        self._slot_dtype = torch.int32 if total * self.block_size < 2**31 else torch.int64

    def _init_table(self, max_seqs, max_blocks_per_seq) -> None:
        """The block table and the namespaces' records (a block list per namespace and group)."""
        total = self.allocator.num_blocks
        rows = _check_int("max_seqs", max_seqs, 1) if max_seqs is not None else None
        cols = _check_int("max_blocks_per_seq", max_blocks_per_seq, 1) if max_blocks_per_seq is not None else None
        rows = rows or max(1, min(total, _DEFAULT_MAX_SEQS))
        cols = cols or max(1, min(total, _DEFAULT_MAX_BLOCKS))
        layout = self.layout
        self._ngroups = 1 if layout is None else len(layout.layer_groups)
        self._layer_group = () if layout is None else tuple(layout.group_of(i)[0] for i in range(layout.num_layers))
        self._group_used = [0] * self._ngroups
        self._table = BlockTable(self._ngroups, rows, cols, self.device)
        self._seqs: dict[Hashable, SeqRecord] = {}

    @property
    def context_parallel(self):
        """The pool's :class:`~kvarena.distributed.ContextParallel`, or None."""
        return self._steps.context_parallel

    @property
    def table(self) -> torch.Tensor:
        """The persistent device block table, int32 ``[G, rows, cols]`` (``G`` layer groups):
        row :meth:`table_row` of a namespace holds its block ids of each group (0 for a
        released block; entries changed since the last :meth:`plan` are written at the next
        one). It keeps its address between steps unless a namespace needs more rows or
        columns (both double). For inspection: writing it bypasses the pool."""
        return self._table.data

    def table_row(self, namespace: Hashable) -> int:
        """``namespace``'s row of :attr:`table` (``KeyError`` if unknown)."""
        with self._lock:
            return self._get(namespace).row

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
                           for lay, lim, n in zip(layers, self._windows.limits, self._group_used)],
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
        if not is_int(group) or not 0 <= group < self._ngroups:
            raise ValueError(f"group: expected an int in [0, {self._ngroups}), got {group!r}")
        with self._lock:
            return list(self._get(namespace).blocks[group])

    def seq_len(self, namespace: Hashable) -> int:
        """Tokens held by ``namespace`` (under context parallel: all ranks' together).

        Raises
        ------
        KeyError
            Unknown namespace.
        """
        with self._lock:
            return self._steps.seq_len(namespace)

    def _get(self, namespace) -> SeqRecord:
        seq = self._seqs.get(namespace)
        if seq is None:
            raise KeyError(f"namespace {namespace!r} is not in this PagedKVCache")
        return seq

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
            ``n_blocks < 0``, or a context-parallel pool (it plans tokens only).
        """
        self._steps.check_allocate()
        _check_int("n_blocks", n_blocks, 0)
        if n_blocks == 0:
            return True
        with self._lock:
            if n_blocks * self._ngroups > self.allocator.num_free:
                return False
            seq = self._seqs.get(namespace)
            created = seq is None
            if created:
                seq = self._table.new_seq()
            self._table.ensure_cols(max(len(b) for b in seq.blocks) + n_blocks)
            got = self.allocator.alloc(n_blocks * self._ngroups)  # one all-or-nothing call
            for g, blocks in enumerate(seq.blocks):
                start = len(blocks)
                blocks.extend(got[g * n_blocks : (g + 1) * n_blocks])
                self._group_used[g] += n_blocks
                self._table.set_entries(seq, g, start)
            if created:
                self._seqs[namespace] = seq
            return True

    def free_namespace(self, namespace: Hashable) -> None:
        """Release ``namespace``'s blocks (shared ones lose one reference). Unknown: no-op."""
        with self._lock:
            seq = self._seqs.pop(namespace, None)
            if seq is not None:
                for g, blocks in enumerate(seq.blocks):
                    self._drop(g, [b for b in blocks if b != FREED])
                self._table.free_row(seq)
                self._stamp()
            self._steps.forget(namespace)

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
            fork_blocks(self, src, dst)
            self._steps.forked(src, dst)

    def check_truncate(self, namespace: Hashable, n_tokens: int) -> None:
        """Raise exactly what :meth:`truncate` would for these arguments, changing nothing
        (so a caller rolling back several namespaces can check them all first)."""
        with self._lock:
            self._steps.check_truncate(namespace, n_tokens)

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
            self._steps.truncate(namespace, n_tokens)

    # ------------------------------------------------------------------ plan
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
        return self._steps.plan(batch, graph, pad_to)

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
        self._check_meta_owner(meta)
        if meta._graph_gen is not None and meta._graph_gen != self._graph_gen:
            raise StaleMetadataError("meta: a later plan(graph=True) has overwritten its buffers")
        for ns in self._stale_namespaces(meta, self._seqs):
            what = "freed" if ns not in self._seqs else "planned again, truncated or forked"
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
        return self._steps.forward(q, k, v, meta, layer, options)

    def check_forward(self, batch: Mapping[Hashable, int], q, k, v, layer: int, *, pad_to: int | None = None,
                      **options) -> None:
        """Raise what :meth:`forward` would raise for these arguments with the metadata of
        ``plan(batch, pad_to=pad_to)``, before planning it: the batch as the plan checks it,
        the layer, the options, q/k/v (the plan's ``total_q`` rows), sink logits and the
        route. Changes nothing (what only the plan can know, a full pool, is left to it).
        For adapters that plan at a model's first layer call: a step the forward would
        refuse plans nothing."""
        self._steps.check_forward(batch, q, k, v, layer, pad_to, options)

    def block_table(self, namespaces, group: int = 0) -> torch.Tensor:
        """The block table of ``namespaces`` in layer group ``group``: int32 ``[len(namespaces),
        cols]`` on the pool's device, row ``i`` the blocks of ``namespaces[i]`` in logical
        order (as :attr:`table`'s rows: 0 for a released block and past a namespace's
        blocks; ``cols`` the most blocks any of them holds, at least 1). A new tensor,
        gathered from the persistent device table (an upload of the row indices, no host
        sync); with :meth:`attend`, the keys of rows the step's metadata does not describe.
        Under context parallel: this rank's blocks. ``KeyError`` for an unknown namespace."""
        if not is_int(group) or not 0 <= group < self._ngroups:
            raise ValueError(f"group: expected an int in [0, {self._ngroups}), got {group!r}")
        with self._lock:
            seqs = [self._get(ns) for ns in namespaces]
            self._table.flush()  # entries queued since the last plan (a fork's)
            cols = max([1, *(len(s.blocks[group]) for s in seqs)])
            rows = upload([s.row for s in seqs], torch.int64, self.device)
            return self._table.data[group, :, :cols].index_select(0, rows)

    def _call_spec(self, layer: int, overrides: dict) -> AttentionSpec:
        if not overrides:  # the layer's own spec (within any release limits by construction)
            return self._specs[layer]
        spec = super()._call_spec(layer, overrides)
        lim = self._limits[self._layer_group[layer]]
        if lim is not None and (spec.window_left is None or spec.window_left > lim[0] or spec.sink_tokens > lim[1]):
            raise ValueError(f"window_left/sink_tokens: this pool releases layer {layer}'s blocks outside "
                             f"window_left={lim[0]}, sink_tokens={lim[1]} (free_out_of_window); a call cannot see more")
        return spec

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(blocks={self.total_blocks}, free={self.free}, block_size="
            f"{self.block_size}, namespaces={len(self._seqs)}, layout={self.layout})"
        )
