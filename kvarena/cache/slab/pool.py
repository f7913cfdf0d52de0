"""The slab pool: construction, accounting, planning entry, the per-layer forward's entry
and the public seam (``check_forward``, ``block_table``, ``attend``).

A step is planned once (:meth:`SlabKVCache.plan`, into :class:`SlabMetadata` whose seam
objects every layer reads as they are); :meth:`SlabKVCache.forward` hands the call to the
steps the pool holds (:class:`~kvarena.cache.slab.local.LocalSteps`, or under context
parallel the wrappers of :mod:`kvarena.cache.slab.cp`), which follow the pools' template:
check, store (a commit, its chunks marked committed), attend.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

import torch

from kvarena.argcheck import is_int
from kvarena.attention.batch import CacheView
from kvarena.attention.spec import AttentionSpec
from kvarena.cache._meta import StaleMetadataError, as_device, region_of_arena, upload
from kvarena.cache._pool import KVPoolBase
from kvarena.cache.arena import ArenaRegion, KVArena, KVLayout, _check_int
from kvarena.cache.slab.compat import SlabCompat
from kvarena.cache.slab.cp import parallel_share
from kvarena.cache.slab.meta import SlabMetadata
from kvarena.cache.slab.pages import page_views
from kvarena.cache.slab.planner import parse_entry
from kvarena.cache.slab.records import RolloutInfo, _Rollout, rollout_info
from kvarena.cache.slab.rollback import SlabRollback
from kvarena.cache.slab.visibility import Visibility

__all__ = ["SlabKVCache"]

_VISIBILITY = (
    "the slab pool's visibility is set by CachePolicy per_component {'sinks': n, 'window': m} "
    "(chunks) or {'sink_tokens': S, 'window_tokens': W}; it cannot be changed per layer or per call"
)
_NO_SINK_LOGITS = (
    "not served by the slab pool: its denoising steps merge partial attentions by LSE, where a "
    "learned sink would join the denominator twice; use PagedKVCache or paged_attention"
)


def _op_spec(spec: AttentionSpec) -> AttentionSpec:
    """What a slab forward passes to the op for a layer spec.

    The block tables list only visible chunks, so the op runs non-causal (full
    attention over them, block-causal overall). Made once per layer at construction,
    and per call only for a call with overrides.
    """
    return spec.replace(causal=False)


class SlabKVCache(SlabCompat, SlabRollback, KVPoolBase):
    """Arena-backed chunk-KV slabs with in-place sliding-window recycling.

    Parameters
    ----------
    policy : CachePolicy
        Of class ``"slab_kv"``. ``max_bytes // slab_bytes`` is the number of slabs (slots) of the pool's own
        arena; ``block_bytes`` is 0 or ``layout.block_bytes(slab_tokens)``;
        ``per_component``: either ``"window"`` (chunks attended and kept, the current one
        included; default unbounded) and ``"sinks"`` (default 0), or ``"window_tokens"``
        (default unbounded, at least ``slab_tokens``) and ``"sink_tokens"`` (default 0);
        optionally ``"slab_tokens"``; ``training_mode_disables_recycle`` keeps every slab.
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
        the pool's (sinks + window, block-causal), so ``window_left``,
        ``sink_tokens``, ``chunk_size`` and ``causal`` keep their defaults.
    context_parallel : kvarena.distributed.ContextParallel, optional
        Shard one rollout over the ranks of a process group. Every rank makes the pool
        with the same (global) ``policy``, ``layout`` and ``slab_tokens`` and calls
        ``plan`` with the same arguments (no collective there); ``forward`` takes the
        rank's contiguous shard of the step's rows (``cp.split_sizes(T)``) of q, k, v
        with every head and returns that shard of the output, equal to the
        single-process pool on the whole tensors. ``mode="heads"`` (Ulysses): the pool
        stores this rank's ``H_kv / N`` heads in an arena of ``max_bytes / N`` (the group
        size must divide ``num_kv_heads``). ``mode="tokens"``: it stores the rank's rows
        of every chunk (whole-chunk sinks / window only, one chunk per rollout and step,
        chunks of at least ``N`` rows), queries all-gathered, partial attentions merged.
        ``layout`` / ``policy`` / ``slab_tokens`` are then the rank's; ``append`` /
        ``get`` work on its share; ``arena=`` is not taken.

    Attributes
    ----------
    window, sinks : int or None
        The chunk form (None in the token form).
    sink_tokens, window_tokens : int or None
        The token form (None in the chunk form; ``window_tokens`` None: unbounded).
    training_mode : bool
    slab_tokens : int or None
    layout : KVLayout or None
    arena : KVArena or None
    used_bytes, free_bytes : int
    """

    CLASS_NAME = "slab_kv"
    META_TYPE = SlabMetadata
    ROPE_POSITIONS = ("absolute", "virtual")
    FORWARD_OPTIONS = frozenset(("backend", "scale", "softcap", "return_lse", "num_splits", "deterministic"))
    NOT_FORWARD_OPTIONS = {
        **{name: _VISIBILITY for name in ("window_left", "sink_tokens", "chunk_size", "causal")},
        "kv_start": "set by the pool from the plan's metadata (a short first chunk); do not pass it",
        "sink_logits": _NO_SINK_LOGITS,
        "out": "forward() returns a new tensor; kvarena.paged_attention(..., out=) writes into a buffer",
        **{name: "set by the pool from the plan's metadata; do not pass it"
           for name in ("cu_seqlens_q", "max_seqlen_q", "max_seqlen_k")},
    }

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
        context_parallel=None,
    ) -> None:
        self._init_pool(policy, attention)
        share = parallel_share(context_parallel, policy, layout, arena, slab_tokens, attention)
        self._cp = context_parallel
        self._steps = share.steps(self)
        policy, layout, slab_tokens = share.policy, share.layout, share.slab_tokens
        self.policy = policy  # under context parallel: this rank's share of the budget
        device = as_device(device)
        per = policy.per_component
        self._vis = vis = Visibility.from_components(per)
        self.sinks, self.window = vis.sinks, vis.window
        self.sink_tokens, self.window_tokens = vis.sink_tokens, vis.window_tokens
        self._page_views: dict = {}
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
            self._check_slab(reg.block_bytes, reg.layout, reg.block_tokens)
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

    @property
    def context_parallel(self):
        """The pool's :class:`~kvarena.distributed.ContextParallel`, or None."""
        return self._cp

    def _check_slab(self, bb: int, layout: KVLayout, slab_tokens: int) -> None:
        if layout.groups is not None:
            raise ValueError("layout.groups: a slab holds every layer of a chunk and is recycled whole; layer "
                             "groups are for PagedKVCache (pass a layout without groups)")
        if self.window_tokens is not None and self.window_tokens < slab_tokens:
            raise ValueError(
                f'policy.per_component["window_tokens"]: expected >= slab_tokens ({slab_tokens}): a '
                f"chunk's queries see their whole chunk, got {self.window_tokens}"
            )
        self._check_block_bytes(bb, slab_tokens, layout)

    def _materialize(self, layout: KVLayout, slab_tokens: int, device) -> None:
        self._check_slab(layout.block_bytes(slab_tokens), layout, slab_tokens)
        arena = self._own_arena(layout, slab_tokens, device)
        self._attach(arena, arena[self.CLASS_NAME], self._specs)

    def _attend_spec(self, spec: AttentionSpec) -> AttentionSpec:
        return _op_spec(spec)

    def _check_spec(self, spec: AttentionSpec, where: str) -> None:
        for name, default in (("window_left", None), ("sink_tokens", 0), ("chunk_size", None), ("causal", True)):
            if getattr(spec, name) != default:
                raise ValueError(f"{where}.{name}: must stay {default!r}: {_VISIBILITY}")
        if spec.sink_logits is not None:
            raise ValueError(f"{where}.sink_logits: {_NO_SINK_LOGITS}")

    def _attach(self, arena: KVArena, reg: ArenaRegion, specs: tuple) -> None:
        self._specs = specs
        op_of: dict = {}  # one op spec per layer spec: layers sharing a spec share the step's plans
        for s in specs:
            if id(s) not in op_of:
                op_of[id(s)] = _op_spec(s)
        self._op_specs = tuple(op_of[id(s)] for s in specs)
        self._rope_modes = tuple(sorted({s.rope_positions for s in specs if s.rope_mode}))
        self.arena = arena
        self._region = reg
        self.layout = reg.layout
        self.slab_tokens = reg.block_tokens
        self.device = arena.device
        self.slab_bytes = reg.block_bytes
        self._page_views = {}
        nslots = reg.num_blocks * reg.block_tokens
        self._slot_dtype = torch.int32 if nslots < 2**31 else torch.int64

    def _require_arena(self, what: str) -> ArenaRegion:
        if self._region is None:
            raise RuntimeError(
                f"{what}: this SlabKVCache has no layout yet; pass layout= and slab_tokens= "
                "at construction, or append() a first slab"
            )
        return self._region

    def _blocks(self):
        return None if self._region is None else (self._region.allocator, self.slab_bytes)

    @property
    def num_slots(self) -> int:
        """int: slabs the budget holds (0 before the arena exists)."""
        return 0 if self._region is None else self._region.num_blocks

    def __contains__(self, namespace: object) -> bool:
        return namespace in self._rollouts

    def namespaces(self) -> list:
        """The namespaces the pool holds, in the order they were first planned."""
        with self._lock:
            return list(self._rollouts)

    def chunk_indices(self, namespace: Hashable) -> list[int]:
        """Chunk indices ``namespace`` holds, in logical order (``[]`` if unknown)."""
        with self._lock:
            r = self._rollouts.get(namespace)
            return [] if r is None else list(r.chunks)

    def block_table(self, namespaces, group: int = 0) -> torch.Tensor:
        """The slab table of ``namespaces``: int32 ``[len(namespaces), cols]`` on the pool's
        device, row ``i`` the slabs of the chunks ``namespaces[i]`` holds
        (:meth:`chunk_indices`) in logical order, 0 past them (``cols`` the most chunks any of
        them holds, at least 1). A slab is a block of ``slab_tokens`` tokens (a short chunk 0
        stored right-aligned in its slab). With :meth:`attend`: the keys of rows the step's
        metadata does not describe. ``group`` is 0 (a slab holds every layer);
        ``KeyError`` for an unknown namespace."""
        self._require_arena("block_table")
        if not is_int(group) or group != 0:
            raise ValueError(f"group: a SlabKVCache has one layer group (0), got {group!r}")
        with self._lock:
            rows = []
            for ns in namespaces:
                r = self._rollouts.get(ns)
                if r is None:
                    raise KeyError(f"namespace {ns!r} is not in this SlabKVCache")
                rows.append([r.chunks[i].slot for i in sorted(r.chunks)])
        cols = max([1, *map(len, rows)])
        flat = [x for row in rows for x in row + [0] * (cols - len(row))]
        return upload(flat, torch.int32, self.device).view(len(rows), cols)

    def rollout_info(self, namespace: Hashable) -> RolloutInfo | None:
        """A read-only copy of ``namespace``'s bookkeeping: its chunks' slots, token counts and
        per-layer commit flags (None if unknown)."""
        with self._lock:
            r = self._rollouts.get(namespace)
            return None if r is None else rollout_info(r)

    def chunks_for_tokens(self, namespace: Hashable, current_start: int, n_tokens: int) -> tuple[range, int]:
        """The :meth:`plan` entry for tokens ``[current_start, current_start + n_tokens)``.

        What a model that counts tokens (Self-Forcing's ``current_start``) needs: the chunk
        range those tokens cover, ``(range(c0, c1), n_tokens)``. A namespace with no chunk
        yet starts at 0, and its chunk 0 takes what whole later chunks leave (1 to
        ``slab_tokens`` tokens: an image-to-video first frame).

        Raises
        ------
        ValueError
            ``current_start`` or the end is not a chunk boundary of the namespace.
        """
        self._require_arena("chunks_for_tokens")
        start = _check_int("current_start", current_start, 0)
        n = _check_int("n_tokens", n_tokens, 1)
        with self._lock:
            sizes = self._steps.chunk_sizes(namespace, self._rollouts.get(namespace))
        st, n0 = sizes.slab_tokens, sizes.first_chunk_tokens
        if n0 is None:
            if start != 0:
                raise ValueError(f"current_start: namespace {namespace!r} holds no chunk yet, so its first call starts "
                                 f"at token 0, got {start}")
            return range(0, -(-n // st)), n

        def chunk_at(t: int, what: str) -> int:
            if t == 0:
                return 0
            if t < n0 or (t - n0) % st:
                raise ValueError(f"{what}: token {t} is not a chunk boundary of namespace {namespace!r} (chunk 0 "
                                 f"holds {n0} tokens, the others {st})")
            return 1 + (t - n0) // st

        return range(chunk_at(start, "current_start"), chunk_at(start + n, "current_start + n_tokens")), n

    def slabs_per_rollout(self, first_chunk_tokens: int | None = None, run_chunks: int = 1) -> int | None:
        """The most slabs one rollout holds at once (None: unbounded window or training mode).

        ``first_chunk_tokens``: chunk 0's length (default a full slab); ``run_chunks``: the
        longest multi-chunk step (each extra chunk may hold one more slab during it).
        At most ``ceil(S / T) + ceil(W / T) + 2 + run_chunks - 1``; what is needed for
        exactly the rollouts a budget must hold.
        """
        self._require_arena("slabs_per_rollout")
        first_chunk_tokens = self._steps.first_chunk_share(first_chunk_tokens)
        if self._vis.unbounded or self.training_mode:
            return None
        st = self.slab_tokens
        n0 = _check_int("first_chunk_tokens", first_chunk_tokens or st, 1)
        if n0 > st:
            raise ValueError(f"first_chunk_tokens: expected 1 to slab_tokens ({st}), got {n0}")
        return self._vis.rule(n0, st).slabs_held() + _check_int("run_chunks", run_chunks, 1) - 1

    def visible_chunks(self, chunk_index: int, namespace: Hashable | None = None) -> list[int]:
        """Chunk indices chunk ``chunk_index`` attends to (at least one token of), ascending.

        With token sinks/window the answer depends on the length of the rollout's chunk
        0: that of ``namespace`` if it is known, else a full one.
        """
        c = _check_int("chunk_index", chunk_index, 0)
        if self.sink_tokens is not None:
            self._require_arena("visible_chunks")
        r = self._rollouts.get(namespace) if namespace is not None else None
        st = self.slab_tokens or 1  # chunk visibility does not depend on it
        return self._vis.rule(r.n0 if r is not None else st, st).chunks_seen(c)

    def plan(self, batch: Mapping[Hashable, Any]) -> SlabMetadata:
        """Claim (or find) each rollout's chunk slots and build the step's metadata.

        Parameters
        ----------
        batch : mapping of namespace to a chunk or a run of chunks
            ``chunk_index`` or ``(chunk_index, n_tokens)``: one chunk. ``range(c0, c1)``
            or ``(range(c0, c1), n_tokens)``: the consecutive chunks ``c0 .. c1-1`` in ONE
            step (conditioning prefill, a recache of the window), ``n_tokens`` the run's
            total (needed only when a new chunk 0 in it is short). Every rollout of one
            plan has the same number of tokens ``T``. A new chunk must be the namespace's
            next one (the first is 0); only chunk 0 may be shorter than ``slab_tokens``.
            Re-planning a known chunk reuses its slot; a new chunk takes over, in place,
            the slot of a chunk no later query can see (no sink token and every token
            older than the window; never in training mode).

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
        return self._steps.plan(batch)

    def _pages_of(self, layer: int, g: int) -> CacheView:
        """Layer ``layer``'s K and V as pages of ``g`` rows (:func:`page_views`), made once per
        ``(layer, g)``."""
        if g == self.slab_tokens:
            return self._region.op_views(layer)
        views = self._page_views.get((layer, g))
        if views is None:
            views = self._page_views[(layer, g)] = page_views(self._region, layer, g)
        return views

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
        self._check_meta_owner(meta)
        for ns in self._stale_namespaces(meta, self._rollouts):
            raise StaleMetadataError(
                f"meta: stale, namespace {ns!r} was cleared, restored or recycled a slab since this plan"
            )

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
            attend over the committed history and the given ``k, v`` (merged by LSE; on
            an fp8 layout ``k, v`` quantized and read back as the commit stores them).
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
        return self._steps.forward(q, k, v, meta, layer, options, commit)


    def check_forward(self, batch: Mapping, q, k, v, layer: int, *, commit: bool = True, **options) -> None:
        """Raise what :meth:`forward` would raise for these arguments with the metadata of a
        :meth:`plan` of ``batch``, before planning it (a plan may recycle a slab in place):
        ``commit``, ``layer``, the options, q/k/v ``[len(batch), T, H, D]`` and the commit
        state of the history the plan would read. Changes nothing; what the plan itself
        would refuse is left to it. For adapters that plan at a model's first call."""
        t = q.shape[1] if isinstance(q, torch.Tensor) and q.dim() == 4 else 0
        layer = self._steps.check_call(q, k, v, layer, commit, options, (len(batch), t)).layer
        self._check_committed(self._history_of(batch), layer)

    @staticmethod
    def _check_committed(history: Mapping, layer: int) -> None:
        """``history``: ``(namespace, index) -> chunk record`` of the chunks a step reads; each
        must be committed at ``layer``."""
        for (ns, _i), ch in history.items():
            if not ch.committed[layer]:
                raise RuntimeError(
                    f"forward: chunk {ch.index} of namespace {ns!r} is in the history but was "
                    f"never committed at layer {layer} (run forward(..., commit=True) for it)"
                )

    def _history_of(self, batch: Mapping) -> dict:
        """The history a plan of ``batch`` would read, as the plan's metadata lists it,
        changing nothing; chunks the plan would refuse (recycled) are left to the plan's own error."""
        out = {}
        with self._lock:
            for ns, spec in batch.items():
                r = self._rollouts.get(ns)
                if r is None:
                    continue  # a new rollout: no history
                req = parse_entry(ns, spec)
                records = r.records()
                rule = self._vis.rule(r.n0, self.slab_tokens)
                for c in range(req.c0, req.c1):
                    for i in rule.chunks_seen(c):
                        if i < req.c0 and i in records:
                            out[(ns, i)] = records[i]
        return out

    def __repr__(self) -> str:
        vis = (f"window={self.window}, sinks={self.sinks}" if self.sink_tokens is None
               else f"window_tokens={self.window_tokens}, sink_tokens={self.sink_tokens}")
        return (
            f"SlabKVCache(slots={self.num_slots}, used={self.used_bytes}, {vis}, "
            f"slab_tokens={self.slab_tokens}, training={self.training_mode})"
        )
