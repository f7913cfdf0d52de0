"""Slab KV cache for chunked video-DiT / world-model rollouts, recycled in place.

One *slab* holds one chunk's K/V for every layer: a block of ``slab_tokens`` tokens of
an arena region, ``[num_layers, 2, slab_tokens, H_kv, D]``. Per namespace (a rollout,
one CFG branch, one expert) the pool keeps a logical slab table of the chunks that a
query can still see.

Visibility is a rule on logical tokens (``t`` counts from the rollout's first token; only
chunk 0 may be short, stored right-aligned): a query of the chunk covering ``[s, e)``
sees ``t < e`` with ``t < S`` (sinks) or ``t >= e - W`` (window), ``S`` and ``W`` given in
tokens (``sink_tokens`` / ``window_tokens``) or in whole chunks (``sinks`` / ``window``).
Inside a chunk attention is full (block-causal overall). A slab holding a sink token is
kept forever; a new chunk takes over, in place, the slab of a chunk no later query can
see, so no retained byte moves and a rollout's memory is flat once its window is full.
The kernels read each chunk's visible tokens as ``[kv_start, seq_len)`` of a list of
pages (whole slabs, or equal slices of them where a sink/window edge falls inside one).

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
import dataclasses
import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvarena.attention.backend import resolve_backend
from kvarena.attention.batch import CacheView, KeySet, OwnKeys, QueryRows
from kvarena.attention.dispatch import attend, merge_partials, store
from kvarena.attention.fp8 import (
    as_bytes,
    dequantize_fp8,
    fp8_round_trip,
    fp8_row_scales,
    quantize_fp8,
)
from kvarena.attention.spec import INT_LIMIT, AttentionSpec, check_bool
from kvarena.cache._meta import (
    StaleMetadataError,
    as_device,
    check_forward_tensor,
    next_version,
    region_of_arena,
    upload,
)
from kvarena.cache._pool import KVPoolBase, layer_specs
from kvarena.cache.arena import ArenaRegion, CacheFullError, KVArena, KVLayout, _check_int

__all__ = ["Slab", "SlabKVCache", "SlabMetadata", "SlabSnapshot"]

_UNBOUNDED_WINDOW = 1 << 30
_VISIBILITY = (
    "the slab pool's visibility is set by CachePolicy per_component {'sinks': n, 'window': m} "
    "(chunks) or {'sink_tokens': S, 'window_tokens': W}; it cannot be changed per layer or per call"
)


_NO_SINK_LOGITS = (
    "not served by the slab pool: its denoising steps merge partial attentions by LSE, where a "
    "learned sink would join the denominator twice; use PagedKVCache or paged_attention"
)

# The per_component keys a slab pool reads (CachePolicy is shared by every cache class).
_SLAB_COMPONENTS = frozenset({"window", "sinks", "sink_tokens", "window_tokens", "slab_tokens"})


def _op_spec(spec: AttentionSpec) -> AttentionSpec:
    """What a slab forward passes to the op for a layer spec.

    The block tables list only visible chunks, so the op runs non-causal (full
    attention over them, block-causal overall). Made once per layer at construction,
    and per call only for a call with overrides.
    """
    return spec.replace(causal=False)


def _chunk_start(c: int, n0: int, st: int) -> int:
    """First logical token of chunk ``c`` (chunk 0 has ``n0`` tokens, the others ``st``)."""
    return 0 if c == 0 else n0 + (c - 1) * st


def _chunk_end(c: int, n0: int, st: int) -> int:
    return n0 + c * st


def _chunk_len(c: int, n0: int, st: int) -> int:
    return n0 if c == 0 else st


def _clip(intervals: list, lo: int, hi: int) -> list:
    """``intervals`` cut to ``[lo, hi)``, empty pieces dropped."""
    out = [(max(a, lo), min(b, hi)) for a, b in intervals]
    return [(a, b) for a, b in out if b > a]


def _page_shifts(intervals: list, g: int, base: int) -> list[int]:
    """Per page of :func:`_pages`'s table: ``logical position - kernel position`` of its rows.

    Buffer row ``x`` of an interval is logical token ``x - base``; page p of the table
    holds kernel rows ``k * g ..``, so key t of that page has logical position ``t + shift``.
    """
    out: list[int] = []
    for a, b in intervals:
        for p in range(a // g, -(-b // g)):
            out.append(p * g - base - len(out) * g)
    return out


def _pages(intervals: list, g: int, page_id) -> tuple[list, int, int]:
    """One kernel sequence over buffer ``intervals`` in pages of ``g`` rows.

    Returns ``(page ids, kv_start, seq_len)``: the pages covering each interval in order,
    the first interval's offset in its first page as ``kv_start`` and the last one's
    end as ``seq_len``. Every interval but the first starts, and every one but the last
    ends, on a page edge (the caller picks ``g`` so), so the visible keys are exactly
    ``[kv_start, seq_len)`` of the concatenation.
    """
    ids: list[int] = []
    start = length = 0
    for n, (a, b) in enumerate(intervals):
        p0, p1 = a // g, -(-b // g)
        if n == 0:
            start = a - p0 * g
        ids.extend(page_id(p) for p in range(p0, p1))
        length = len(ids) * g - (p1 * g - b)
    return ids, start, length


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
    __slots__ = ("chunks", "last", "version", "n0", "retired")

    def __init__(self, n0: int) -> None:
        self.chunks: dict[int, _Chunk] = {}  # ascending chunk index = logical order
        self.last = -1
        self.version = next_version()
        self.n0 = n0  # tokens of chunk 0 (stored right-aligned in its slab)
        # Chunks a multi-chunk run evicted while still reading them: held (and re-plannable
        # runs still see them) until a plan of the namespace no longer reads them, then freed.
        self.retired: dict[int, _Chunk] = {}


@dataclass(frozen=True, eq=False)
class SlabMetadata:
    """One step of a batch of rollouts, from :meth:`SlabKVCache.plan`. Reused by every layer.

    ``B`` rollouts, each planning a run of consecutive chunks (usually one) of ``T``
    tokens in all (``n_tokens``). The kernels see one *sequence* per planned chunk
    (``N = num_chunks`` of them, rollout-major): its queries are the chunk's tokens, its
    keys the visible tokens, listed through a table of *pages* (``page_tokens`` rows of a
    slab; a whole slab unless token sinks/windows or a short chunk 0 need a junction
    inside one).

    Attributes
    ----------
    namespaces : tuple
        Per rollout, in the order of the mapping given to ``plan``.
    chunk_indices : tuple of int
        Per rollout, the run's last (newest) chunk.
    chunk_ranges : tuple of range
        Per rollout, the planned chunks.
    n_tokens, num_seqs, num_chunks : int
        ``T``, ``B`` and ``N``.
    page_tokens : int
        Rows per page of the arena tables (divides ``slab_tokens``).
    block_table, seq_lens, kv_start : Tensor, int32 ``[N, W]``, ``[N]``, ``[N]``
        The visible keys of each chunk's queries (sinks part, then window part ending at
        the chunk itself): exactly ``[kv_start, seq_len)`` of the listed pages.
    hist_block_table, hist_seq_lens, hist_kv_start : Tensor, int32
        The same restricted to tokens before the run (``hist_seq_lens`` 0: none).
    cu_seqlens_q : Tensor, int32 ``[N + 1]``
        Query rows of each sequence (chunk lengths, cumulated).
    slot_mapping : Tensor, int32 (int64 past 2**31 slots) ``[B * T]``
        Where ``commit=True`` writes the run's tokens (chunk 0 right-aligned in its slab).
    own_page_tokens : int
        Rows per page of the given k/v viewed as pages (``T`` for a one-chunk plan).
    dense_block_table, dense_seq_lens, dense_kv_start : Tensor, int32
        The run's tokens each chunk sees, in the given k/v ``[B, T, H_kv, D]`` viewed as
        ``[B * T / own_page_tokens, own_page_tokens, H_kv, D]`` pages.
    max_seqlen_q, max_seqlen_k, hist_max_seqlen_k, dense_max_seqlen_k : int
        Host maxima.
    has_kv_start, hist_has_kv_start, dense_has_kv_start : bool
        Whether any sequence needs its ``kv_start``.
    """

    namespaces: tuple
    chunk_indices: tuple
    chunk_ranges: tuple
    n_tokens: int
    num_seqs: int
    num_chunks: int
    page_tokens: int
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    kv_start: torch.Tensor
    hist_block_table: torch.Tensor
    hist_seq_lens: torch.Tensor
    hist_kv_start: torch.Tensor
    cu_seqlens_q: torch.Tensor
    slot_mapping: torch.Tensor
    own_page_tokens: int
    dense_block_table: torch.Tensor
    dense_seq_lens: torch.Tensor
    dense_kv_start: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    hist_max_seqlen_k: int
    dense_max_seqlen_k: int
    has_kv_start: bool
    hist_has_kv_start: bool
    dense_has_kv_start: bool
    _owner: int = field(repr=False)
    _versions: tuple = field(repr=False)
    _epoch: int = field(repr=False)
    _current: tuple = field(repr=False)  # _Chunk of every planned chunk
    _history: tuple = field(repr=False)  # ((namespace, index), _Chunk) of every chunk seen before the run
    # RoPE on read, per position mode the pool's layers use: {mode: (q_pos [n], full shift
    # [n, w], history shift [n, w_h], own shift [n, w_o], the largest position)}.
    rope: dict = field(default_factory=dict, repr=False)
    #: Context parallel, tokens mode: query rows per rollout (the whole chunk; ``n_tokens``
    #: is then this rank's rows of it). 0: ``n_tokens``.
    q_tokens: int = 0

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
    _retired: tuple = field(repr=False, default=())  # (index, _Chunk) retired by a run, still held


class SlabKVCache(KVPoolBase):
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
    hits, misses : int
        The original ``cache_pools.py`` counters; always 0.
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
        context_parallel=None,
    ) -> None:
        self._init_pool(policy, attention)
        self._cp = None
        self._cp_n0: dict = {}  # context parallel, tokens mode: namespace -> chunk 0's tokens
        if context_parallel is not None:
            policy, layout, slab_tokens = self._context_parallel(context_parallel, policy, layout, arena, slab_tokens)
            self.policy = policy  # this rank's share of the budget
        device = as_device(device)
        per = policy.per_component
        unknown = sorted(set(per) - _SLAB_COMPONENTS)
        if unknown:  # a misspelt "window" would silently mean an unbounded window
            raise ValueError(
                f"policy.per_component: unknown key {unknown[0]!r} for a slab pool; expected "
                f"{', '.join(repr(k) for k in sorted(_SLAB_COMPONENTS))}"
            )
        token_keys = sorted(set(per) & {"sink_tokens", "window_tokens"})
        chunk_keys = sorted(set(per) & {"sinks", "window"})
        if token_keys and chunk_keys:
            raise ValueError(
                f"policy.per_component: {chunk_keys[0]!r} (whole chunks) and {token_keys[0]!r} (tokens) "
                "cannot be mixed; give sinks/window or sink_tokens/window_tokens"
            )
        if token_keys:
            self.sinks = self.window = None
            self.sink_tokens = _check_int('policy.per_component["sink_tokens"]', per.get("sink_tokens", 0), 0)
            w = per.get("window_tokens")
            self.window_tokens = None if w is None else _check_int('policy.per_component["window_tokens"]', w, 1)
        else:
            self.window = max(1, int(per.get("window", _UNBOUNDED_WINDOW)))
            self.sinks = int(per.get("sinks", 0))
            self.sink_tokens = self.window_tokens = None
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

    def _context_parallel(self, cp, policy, layout, arena, slab_tokens):
        """This rank's policy, layout and slab size under ``cp``: heads mode, ``H_kv / N``
        heads in ``max_bytes / N``; tokens mode, the rank's rows of every chunk in slabs of
        ``split_sizes(slab_tokens)[rank]`` rows, as many slabs as the whole budget holds
        whole chunks. Either way a budget sized for one process fits the sharded rollout."""
        from kvarena.distributed import ContextParallel

        if not isinstance(cp, ContextParallel):
            raise TypeError(f"context_parallel: expected a kvarena.distributed.ContextParallel, got "
                            f"{type(cp).__name__}")
        if arena is not None:
            raise ValueError("arena: with context_parallel the pool makes this rank's own arena (max_bytes / N)")
        if layout is None:
            raise ValueError("layout: context_parallel needs the model's (global) KVLayout")
        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout: expected a KVLayout, got {type(layout).__name__}")
        n = cp.world_size
        bb = int(getattr(policy, "block_bytes", 0))
        if cp.mode == "tokens":
            per = dict(policy.per_component)
            if "sink_tokens" in per or "window_tokens" in per:
                raise ValueError("context_parallel.mode: 'tokens' shards every chunk's rows over the ranks, which "
                                 "needs whole-chunk visibility (per_component sinks / window); token-granular "
                                 "sink_tokens / window_tokens take heads mode")
            st = slab_tokens if slab_tokens is not None else per.get("slab_tokens")
            if st is None or isinstance(st, bool) or not isinstance(st, int) or st < n:
                raise ValueError(f"slab_tokens: tokens mode gives every rank a share of each chunk; expected an int >= "
                                 f"the world size {n}, got {st!r}")
            local_st = cp.split_sizes(st)[cp.rank]
            if any(spec.rope_cos is not None for spec in (layer_specs(self._attention, layout.num_layers) or ())):
                raise ValueError("rope_cos: RoPE on read is not served in context parallel tokens mode (a rank's rows "
                                 "would rotate at their positions in its share); heads mode serves it")
            slabs = policy.max_bytes // (bb or layout.block_bytes(st))
            per.pop("slab_tokens", None)
            self._cp, self._cp_st = cp, st
            local = dataclasses.replace(policy, max_bytes=slabs * layout.block_bytes(local_st), block_bytes=0,
                                        per_component=per)
            return local, layout, local_st
        if layout.num_kv_heads % n:
            raise ValueError(f"num_kv_heads: heads mode splits the layout's {layout.num_kv_heads} kv heads over "
                             f"{n} ranks; the world size must divide it")
        self._cp = cp
        local = dataclasses.replace(layout, num_kv_heads=layout.num_kv_heads // n)
        return dataclasses.replace(policy, max_bytes=policy.max_bytes // n, block_bytes=bb // n), local, slab_tokens

    @property
    def context_parallel(self):
        """The pool's :class:`~kvarena.distributed.ContextParallel`, or None."""
        return self._cp

    # ------------------------------------------------------------------ arena
    def _check_slab(self, bb: int, layout: KVLayout, slab_tokens: int) -> None:
        if layout.groups is not None:
            raise ValueError("layout.groups: a slab holds every layer of a chunk and is recycled whole; layer "
                             "groups are for PagedKVCache (pass a layout without groups)")
        if self.window_tokens is not None and self.window_tokens < slab_tokens:
            raise ValueError(
                f'policy.per_component["window_tokens"]: expected >= slab_tokens ({slab_tokens}): a '
                f"chunk's queries see their whole chunk, got {self.window_tokens}"
            )
        given = int(getattr(self.policy, "block_bytes", 0))
        if given not in (0, bb):
            raise ValueError(
                f"policy.block_bytes: expected 0 (derived) or {bb} = layout.block_bytes"
                f"({slab_tokens}) for {layout}, got {given}"
            )

    def _materialize(self, layout: KVLayout, slab_tokens: int, device) -> None:
        bb = layout.block_bytes(slab_tokens)
        self._check_slab(bb, layout, slab_tokens)
        specs = self._bind_layout(layout, device or torch.device("cpu"))
        arena = KVArena.single("slab_kv", layout, slab_tokens, self.policy.max_bytes, device=device)
        self._attach(arena, arena["slab_kv"], specs)

    ROPE_POSITIONS = ("absolute", "virtual")

    def _check_spec(self, spec: AttentionSpec, where: str) -> None:
        for name, default in (("window_left", None), ("sink_tokens", 0), ("chunk_size", None), ("causal", True)):
            if getattr(spec, name) != default:
                raise ValueError(f"{where}.{name}: must stay {default!r}: {_VISIBILITY}")
        if spec.sink_logits is not None:
            raise ValueError(f"{where}.sink_logits: {_NO_SINK_LOGITS}")

    def _attach(self, arena: KVArena, reg: ArenaRegion, specs: tuple) -> None:
        self._specs = specs
        self._op_specs = tuple(_op_spec(s) for s in specs)
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
        st = self.slab_tokens
        with self._lock:
            r = self._rollouts.get(namespace)
            n0 = None if r is None else r.n0
            if self._cp is not None and self._cp.mode == "tokens":  # the chunks' own sizes, not the rank's share
                st, n0 = self._cp_st, None if r is None else self._cp_n0.get(namespace, self._cp_st)
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

    # ------------------------------------------------------------------ visibility
    def _rule(self, n0: int) -> tuple[int, int | None]:
        """``(S, W)``: sink and window tokens of a rollout whose chunk 0 has ``n0`` tokens.

        Chunk counts are the token rule at chunk boundaries: ``sinks`` chunks are the
        tokens before chunk ``sinks``' start, a ``window`` of m chunks is ``m * slab_tokens``
        tokens ending at a chunk's end. ``W`` None is unbounded.
        """
        if self.sink_tokens is not None:
            return self.sink_tokens, self.window_tokens
        st = self.slab_tokens or 1  # chunk visibility does not depend on it
        s = 0 if self.sinks == 0 else n0 + (self.sinks - 1) * st
        return s, None if self.window >= _UNBOUNDED_WINDOW else self.window * st

    def _intervals(self, c: int, n0: int) -> list[tuple[int, int]]:
        """Token intervals chunk ``c`` sees: ``t < e`` and (``t < S`` or ``t >= e - W``)."""
        s_tok, w_tok = self._rule(n0)
        e = _chunk_end(c, n0, self.slab_tokens or 1)
        lo = 0 if w_tok is None else max(0, e - w_tok)
        if lo <= s_tok:
            return [(0, e)]
        return ([(0, s_tok)] if s_tok > 0 else []) + [(lo, e)]

    def _chunks_seen(self, c: int, n0: int) -> list[int]:
        st = self.slab_tokens or 1
        pad = st - n0
        seen: set[int] = set()
        for a, b in self._intervals(c, n0):
            seen.update(range((a + pad) // st, (b + pad - 1) // st + 1))
        return sorted(seen)

    def slabs_per_rollout(self, first_chunk_tokens: int | None = None, run_chunks: int = 1) -> int | None:
        """The most slabs one rollout holds at once (None: unbounded window or training mode).

        ``first_chunk_tokens``: chunk 0's length (default a full slab); ``run_chunks``: the
        longest multi-chunk step (each extra chunk may hold one more slab during it).
        At most ``ceil(S / T) + ceil(W / T) + 2 + run_chunks - 1``; what is needed for
        exactly the rollouts a budget must hold.
        """
        self._require_arena("slabs_per_rollout")
        if self._cp is not None and self._cp.mode == "tokens" and first_chunk_tokens is not None:
            # Whole-chunk visibility: the rank's share of chunk 0 holds the same slabs.
            n0 = _check_int("first_chunk_tokens", first_chunk_tokens, self._cp.world_size)
            if n0 > self._cp_st:
                raise ValueError(f"first_chunk_tokens: expected {self._cp.world_size} to slab_tokens ({self._cp_st}), "
                                 f"got {n0}")
            first_chunk_tokens = self._cp.split_sizes(n0)[self._cp.rank]
        _s, w = self._rule(first_chunk_tokens or self.slab_tokens)
        if w is None or self.training_mode:
            return None
        st = self.slab_tokens
        n0 = _check_int("first_chunk_tokens", first_chunk_tokens or st, 1)
        if n0 > st:
            raise ValueError(f"first_chunk_tokens: expected 1 to slab_tokens ({st}), got {n0}")
        s_tok, _w = self._rule(n0)
        # Holdings repeat once the window has left the sinks: two windows past that suffice.
        last = 2 + (s_tok + 2 * w) // st
        held = max(len(self._chunks_seen(c, n0)) for c in range(last + 1))
        return held + _check_int("run_chunks", run_chunks, 1) - 1

    def visible_chunks(self, chunk_index: int, namespace: Hashable | None = None) -> list[int]:
        """Chunk indices chunk ``chunk_index`` attends to (at least one token of), ascending.

        With token sinks/window the answer depends on the length of the rollout's chunk
        0: that of ``namespace`` if it is known, else a full one.
        """
        c = _check_int("chunk_index", chunk_index, 0)
        if self.sink_tokens is not None:
            self._require_arena("visible_chunks")
        r = self._rollouts.get(namespace) if namespace is not None else None
        return self._chunks_seen(c, r.n0 if r is not None else (self.slab_tokens or 1))

    # ------------------------------------------------------------------ planning
    def _parse(self, ns, spec) -> tuple[int, int, int | None]:
        """``(c0, c1, n_tokens)`` of one batch entry (``n_tokens`` of the whole run)."""
        n = None
        if isinstance(spec, tuple):
            if len(spec) != 2:
                raise ValueError(
                    f"batch[{ns!r}]: expected chunk_index or (chunk_index, n_tokens), or range(c0, c1) "
                    f"or (range(c0, c1), n_tokens), got {spec!r}"
                )
            spec, n = spec
            n = _check_int(f"batch[{ns!r}] n_tokens", n, 1)
        if isinstance(spec, range):
            if spec.step != 1 or len(spec) == 0 or spec.start < 0:
                raise ValueError(
                    f"batch[{ns!r}]: expected a non-empty range(c0, c1) of consecutive chunks, c0 >= 0, got {spec!r}"
                )
            return spec.start, spec.stop, n
        c = _check_int(f"batch[{ns!r}] chunk_index", spec, 0)
        return c, c + 1, n

    def _run_lengths(self, ns, r: _Rollout | None, c0: int, c1: int, n: int | None) -> tuple[int, list[int]]:
        """``(n0, tokens of each chunk of the run)`` after checking ``n`` against them."""
        st = self.slab_tokens
        last = -1 if r is None else r.last
        records = {} if r is None else {**r.retired, **r.chunks}
        known = {c: records[c].n_tokens for c in range(c0, min(c1, last + 1))}
        if c1 - c0 == 1 and n is not None:  # one chunk: the historical messages
            c = c0
            if c in known and n != known[c]:
                raise ValueError(
                    f"batch[{ns!r}]: chunk {c} was planned with {known[c]} tokens; re-planning it with {n} is not allowed"
                )
            if c not in known and n > st:
                raise ValueError(f"batch[{ns!r}]: n_tokens {n} is longer than a slab ({st} slab_tokens)")
            if c not in known and n < st and c != 0:
                raise ValueError(
                    f"batch[{ns!r}]: only chunk 0 may be shorter than slab_tokens ({st}); chunk {c} has {n} tokens"
                )
        if r is not None:
            n0 = r.n0
        elif n is None:
            n0 = st
        else:  # chunk 0 is new and starts this run: it takes what the others leave
            n0 = n - (c1 - 1) * st
            if not 1 <= n0 <= st:
                raise ValueError(
                    f"batch[{ns!r}]: n_tokens {n} for chunks {c0}..{c1 - 1}: expected {(c1 - 1) * st + 1} to "
                    f"{c1 * st} (only chunk 0 may be shorter than slab_tokens {st})"
                )
        lens = [known.get(c, _chunk_len(c, n0, st)) for c in range(c0, c1)]
        if n is not None and n != sum(lens):
            raise ValueError(f"batch[{ns!r}]: chunks {c0}..{c1 - 1} hold {sum(lens)} tokens, got n_tokens {n}")
        return n0, lens

    def _reserve(self, batch: Mapping) -> tuple[list, int]:
        """Validate a batch and claim its slots (all-or-nothing). Caller holds the lock.

        Returns ``([(namespace, rollout, run chunks, chunk records by index)], T_run)``
        after applying it; the records include chunks the run retired (still read by it).
        """
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"batch: expected a mapping of namespace -> chunk_index, (chunk_index, n_tokens), "
                f"range(c0, c1) or (range(c0, c1), n_tokens), got {type(batch).__name__}"
            )
        if not batch:
            raise ValueError("batch: expected at least one namespace")
        st = self.slab_tokens
        steps = []
        t_common = None
        new_slots = released = 0
        for ns, spec in batch.items():
            c0, c1, n = self._parse(ns, spec)
            r = self._rollouts.get(ns)
            last = -1 if r is None else r.last
            if c0 > last + 1:
                raise ValueError(f"batch[{ns!r}]: the next new chunk of this namespace is {last + 1}, got {c0}")
            gone = [c for c in range(c0, min(c1, last + 1)) if c not in r.chunks and c not in r.retired]
            if gone:
                raise ValueError(
                    f"batch[{ns!r}]: chunk {gone[0]} was already recycled (namespace holds chunks {list(r.chunks)})"
                )
            n0, lens = self._run_lengths(ns, r, c0, c1, n)
            run_tokens = sum(lens)
            if t_common is None:
                t_common = run_tokens
            elif run_tokens != t_common:
                raise ValueError(
                    f"batch[{ns!r}]: every rollout of one plan shares one T; got {run_tokens} tokens "
                    f"after {t_common} (plan a short first chunk in a batch of its own)"
                )
            resident = set(r.chunks) if r is not None else set()
            seen_by_run: set[int] = set()
            for c in range(c0, c1):
                seen = self._chunks_seen(c, n0)
                seen_by_run.update(seen)
                if c <= last:
                    missing = [i for i in seen if i not in resident and i not in r.retired and not c0 <= i < c1]
                    if missing:
                        raise ValueError(
                            f"batch[{ns!r}]: chunk {c} sees chunks {missing} that were already recycled; "
                            "it cannot be planned again"
                        )
            # Walk the new chunks as one-by-one planning would. A chunk that no later query can
            # see (no sink token, every token older than the window) is dead: its slot goes to
            # the new chunk in place, unless this run still reads it; then it is retired, its
            # slot held until the namespace's next plan. Slots: an int, or -k for fresh one k.
            s_tok, w_tok = self._rule(n0)
            slot_of = {i: r.chunks[i].slot for i in resident}
            new_slot: dict[int, int] = {}
            reuse, retire, fresh, dropped = [], [], 0, 0
            for c in range(max(c0, last + 1), c1):
                if w_tok is not None and not self.training_mode:
                    limit = _chunk_end(c, n0, st) - w_tok
                    for i in sorted(slot_of):
                        if _chunk_start(i, n0, st) >= s_tok and _chunk_end(i, n0, st) <= limit:
                            if i in seen_by_run:
                                retire.append(i)
                                slot_of.pop(i)
                            else:
                                reuse.append(slot_of.pop(i))
                            dropped += 1
                if reuse:
                    slot_of[c] = reuse.pop(0)  # the oldest dead chunk's slab, in place
                else:
                    fresh += 1
                    slot_of[c] = -fresh
                new_slot[c] = slot_of[c]
            new_slots += fresh
            if r is not None:
                released += sum(1 for i in r.retired if i not in seen_by_run)
            steps.append((ns, c0, c1, n0, lens, slot_of, new_slot, reuse, retire, fresh, dropped, seen_by_run))
        alloc = self._region.allocator
        if new_slots > alloc.num_free + released:
            raise CacheFullError(
                f"plan needs {new_slots} new slabs, only {alloc.num_free + released} of {alloc.num_blocks} "
                f"are free ({self.slab_bytes} bytes each, budget {self.policy.max_bytes})"
            )
        # Release the slabs earlier runs retired, then every new slab in ONE allocator call
        # before anything else changes: the allocator may be shared with another pool on the
        # same arena region (its own lock, not ours), so a per-row alloc could fail half-way.
        for ns, *_x, seen_by_run in steps:
            r = self._rollouts.get(ns)
            done = [] if r is None else [i for i in r.retired if i not in seen_by_run]
            if done:
                alloc.decref([r.retired.pop(i).slot for i in done])
                r.version = self._stamp()
        fresh_ids = alloc.alloc(new_slots)
        out = []
        for ns, c0, c1, n0, lens, slot_of, new_slot, reuse, retire, fresh, dropped, _seen in steps:
            ids, fresh_ids = fresh_ids[:fresh], fresh_ids[fresh:]

            def real(tok: int, ids=ids) -> int:
                return tok if tok >= 0 else ids[-tok - 1]

            r = self._rollouts.get(ns)
            if r is None:
                r = self._rollouts[ns] = _Rollout(n0)
            records = {**r.retired, **r.chunks}
            for c, n in zip(range(c0, c1), lens):
                if c in new_slot:
                    records[c] = _Chunk(c, real(new_slot[c]), n, self.layout.num_layers)
                    r.last = c
            run = [records[c] for c in range(c0, c1)]
            r.chunks = {i: records[i] for i in sorted(slot_of)}
            if dropped:
                r.version = self._stamp()
            if reuse:  # dead chunks beyond those the new chunks took over
                alloc.decref(reuse)
            r.retired.update((i, records[i]) for i in retire)
            out.append((ns, r, run, records))
        return out, t_common

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
        if self._cp is not None and self._cp.mode == "tokens":
            return self._plan_tokens(batch)
        with self._lock:
            rows, t = self._reserve(batch)
            return self._build_meta(rows, t)

    def _plan_tokens(self, batch) -> SlabMetadata:
        """Context parallel, tokens mode: plan the rank's rows of each chunk, with query
        rows for the whole chunk (every rank attends all queries over its keys)."""
        cp = self._cp
        if not isinstance(batch, Mapping) or not batch:
            raise TypeError(f"batch: expected a non-empty mapping of namespace -> chunk, got {batch!r}")
        with self._lock:
            local, sizes, new_n0 = {}, set(), {}
            for ns, item in batch.items():
                c, n = item if isinstance(item, tuple) and len(item) == 2 else (item, None)
                if isinstance(c, range):
                    raise ValueError(f"batch[{ns!r}]: a run of chunks in one step is not served by context parallel "
                                     "tokens mode (plan its chunks one by one, or use heads mode)")
                if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < cp.world_size):
                    raise ValueError(f"batch[{ns!r}]: tokens mode needs at least one row of the chunk per rank: "
                                     f"n_tokens >= the world size {cp.world_size}, got {n!r}")
                # The checks the rank's plan would make on its share, made on the chunk itself:
                # two different lengths can share a rank's share, and the ranks must agree.
                if n is not None and n > self._cp_st:
                    raise ValueError(f"batch[{ns!r}]: a chunk of {n} tokens is longer than a slab ({self._cp_st})")
                if n is not None and c != 0 and n != self._cp_st:
                    raise ValueError(f"batch[{ns!r}]: only chunk 0 may be shorter than slab_tokens ({self._cp_st}), "
                                     f"chunk {c} has {n}")
                if n is not None and c == 0 and ns in self._cp_n0 and n != self._cp_n0[ns]:
                    raise ValueError(f"batch[{ns!r}]: chunk 0 was planned with {self._cp_n0[ns]} tokens, not {n}")
                if n is not None:
                    t = n
                elif c == 0:  # a known chunk 0 keeps its length; a new one is a whole slab
                    t = self._cp_n0.get(ns, self._cp_st)
                else:
                    t = self._cp_st
                if c == 0 and ns not in self._rollouts:
                    new_n0[ns] = t
                sizes.add(t)
                local[ns] = c if n is None else (c, cp.split_sizes(n)[cp.rank])
            if len(sizes) > 1:
                raise ValueError(f"batch: every rollout of one plan must have the same number of tokens, got "
                                 f"{sorted(sizes)}")
            meta = self._build_meta(*self._reserve(local))
            self._cp_n0.update(new_n0)
        t = sizes.pop()
        cu = torch.arange(0, (meta.num_seqs + 1) * t, t, dtype=torch.int32, device=self.device)
        return dataclasses.replace(meta, cu_seqlens_q=cu, max_seqlen_q=t, q_tokens=t)

    def _build_meta(self, rows, t: int) -> SlabMetadata:
        st = self.slab_tokens
        b = len(rows)
        # Per kernel sequence (one per chunk of each run): its queries' token intervals,
        # split into history (before the run) and own (the run's given k/v).
        seqs = []
        history: dict = {}
        for row, (ns, r, run, records) in enumerate(rows):
            n0, pad = r.n0, st - r.n0
            r0 = _chunk_start(run[0].index, n0, st)
            for ch in run:
                full = self._intervals(ch.index, n0)
                hist = _clip(full, 0, r0)
                own = [(a - r0, e - r0) for a, e in _clip(full, r0, INT_LIMIT)]
                seqs.append((row, r, records, pad, ch.n_tokens, full, hist, own))
                for i in self._chunks_seen(ch.index, n0):
                    if i < run[0].index:
                        history[(ns, i)] = records[i]
        # Page sizes: the largest divisor of the slab (of the run) at which every junction
        # between the sink part and the window part falls on a page edge.
        g = st
        g_own = t
        for _row, _r, _rec, pad, _n, full, hist, own in seqs:
            for ivs, shift in ((full, pad), (hist, pad)):
                if len(ivs) > 1:
                    g = math.gcd(g, ivs[0][1] + shift, ivs[1][0] + shift)
            if len(own) > 1:
                g_own = math.gcd(g_own, own[0][1], own[1][0])
        per_slab = 2 * self.layout.num_layers * st // g  # pages between two slabs' starts

        def arena_page(records, p):
            slot = records[p * g // st].slot
            return slot if g == st else slot * per_slab + (p * g % st) // g

        full_t, hist_t, own_t = [], [], []
        for row, _r, records, pad, _n, full, hist, own in seqs:
            shifted = [(a + pad, e + pad) for a, e in full]
            full_t.append(_pages(shifted, g, lambda p, rec=records: arena_page(rec, p)))
            shifted = [(a + pad, e + pad) for a, e in hist]
            hist_t.append(_pages(shifted, g, lambda p, rec=records: arena_page(rec, p)))
            own_t.append(_pages(own, g_own, lambda p, row=row: row * (t // g_own) + p))
        rope = self._rope_meta(rows, seqs, g, g_own, full_t, hist_t, own_t) if self._rope_modes else {}
        n_seq = len(seqs)
        flat: list[int] = []
        widths = []
        for tab in (full_t, hist_t, own_t):
            w = max(1, max(len(ids) for ids, _s, _l in tab))
            widths.append(w)
            for ids, _s, _l in tab:
                flat += ids + [0] * (w - len(ids))
        if flat and max(flat) >= 2**31:
            raise ValueError(
                f"batch: page ids pass int32 (page size {g} tokens of {st}-token slabs); "
                "use chunk lengths and sink/window sizes with a larger common divisor"
            )
        for tab in (full_t, hist_t, own_t):
            flat += [ln for _i, _s, ln in tab] + [s for _i, s, _l in tab]
        q_lens = [n for *_x, n, _f, _h, _o in seqs]
        cu = [0]
        for n in q_lens:
            cu.append(cu[-1] + n)
        flat += cu
        # slot_mapping: chunk i's tokens go to rows st - n_i .. st - 1 of its slab; built on
        # the device from one first slot per chunk (a host list of B * T ints costs ~1 ms).
        chunks = [ch for _ns, _r, run, _rec in rows for ch in run]
        flat += [ch.slot for ch in chunks] + [st - ch.n_tokens for ch in chunks]
        packed = upload(flat, torch.int32, self.device)
        o = 0

        def take(n: int) -> torch.Tensor:
            nonlocal o
            o += n
            return packed[o - n : o]

        tables = [take(n_seq * w).view(n_seq, w) for w in widths]
        lens_starts = [(take(n_seq), take(n_seq)) for _ in range(3)]
        cu_t = take(n_seq + 1)
        first = take(n_seq).to(torch.int64) * st  # int64: slot * slab_tokens may pass 2**31
        first = first + take(n_seq)
        (seq_lens, kv_start), (hist_lens, hist_start), (own_lens, own_start) = lens_starts
        if all(ch.n_tokens == t for ch in chunks):  # one chunk per rollout, all of one length
            offsets = torch.arange(t, device=self.device, dtype=torch.int64)
            slot_mapping = (first[:, None] + offsets[None, :]).reshape(-1)
        else:
            lens = torch.tensor([ch.n_tokens for ch in chunks], dtype=torch.int64)
            starts = torch.cumsum(lens, 0) - lens
            idx = torch.arange(b * t, dtype=torch.int64)
            rel = (idx - torch.repeat_interleave(starts, lens, output_size=b * t)).to(self.device)
            slot_mapping = torch.repeat_interleave(first, lens.to(self.device), output_size=b * t) + rel
        return SlabMetadata(
            namespaces=tuple(ns for ns, _r, _run, _rec in rows),
            chunk_indices=tuple(run[-1].index for _ns, _r, run, _rec in rows),
            chunk_ranges=tuple(range(run[0].index, run[-1].index + 1) for _ns, _r, run, _rec in rows),
            n_tokens=t,
            num_seqs=b,
            num_chunks=n_seq,
            page_tokens=g,
            block_table=tables[0],
            seq_lens=seq_lens,
            kv_start=kv_start,
            hist_block_table=tables[1],
            hist_seq_lens=hist_lens,
            hist_kv_start=hist_start,
            cu_seqlens_q=cu_t,
            slot_mapping=slot_mapping.to(self._slot_dtype),
            own_page_tokens=g_own,
            dense_block_table=tables[2],
            dense_seq_lens=own_lens,
            dense_kv_start=own_start,
            max_seqlen_q=max(q_lens),
            max_seqlen_k=max(ln for _i, _s, ln in full_t),
            hist_max_seqlen_k=max(ln for _i, _s, ln in hist_t),
            dense_max_seqlen_k=max(ln for _i, _s, ln in own_t),
            has_kv_start=any(s for _i, s, _l in full_t),
            hist_has_kv_start=any(s for _i, s, _l in hist_t),
            dense_has_kv_start=any(s for _i, s, _l in own_t),
            rope=rope,
            _owner=self._cache_id,
            _versions=tuple(r.version for _ns, r, _run, _rec in rows),
            _epoch=self._epoch,
            _current=tuple(ch for _ns, _r, run, _rec in rows for ch in run),
            _history=tuple(history.items()),
        )

    def _rope_meta(self, rows, seqs, g: int, g_own: int, full_t, hist_t, own_t) -> dict:
        """RoPE-on-read positions of a plan (see ``SlabMetadata.rope``), host math + one upload.

        Absolute: a key's logical token index; the queries are the chunk's tokens. Virtual:
        the key's index in the concatenation of the keys the chunk sees (its sinks, its
        window, then its own tokens), which is the kernel's key space minus ``kv_start``;
        the own keys of a denoising step continue after the history.
        """
        st = self.slab_tokens
        out = {}
        for mode in self._rope_modes:
            q_pos, tabs, top = [], ([], [], []), 0
            for (row, r, _rec, pad, n_tok, full, hist, own), ft, ht, ot in zip(seqs, full_t, hist_t, own_t):
                run0 = _chunk_start(rows[row][2][0].index, r.n0, st)
                (f_ids, f_start, f_len), (h_ids, h_start, h_len), (o_ids, o_start, _o_len) = ft, ht, ot
                if mode == "absolute":
                    q0 = full[-1][1] - n_tok
                    fs = _page_shifts([(a + pad, e + pad) for a, e in full], g, pad)
                    hs = _page_shifts([(a + pad, e + pad) for a, e in hist], g, pad)
                    os_ = _page_shifts(own, g_own, -run0)
                    top = max(top, full[-1][1] - 1)
                else:
                    q0 = f_len - f_start - n_tok
                    fs, hs = [-f_start] * len(f_ids), [-h_start] * len(h_ids)
                    os_ = [(h_len - h_start) - o_start] * len(o_ids)
                    top = max(top, f_len - f_start - 1)
                q_pos.append(q0)
                for tab, sh in zip(tabs, (fs, hs, os_)):
                    tab.append(sh)
            flat = list(q_pos)
            widths = []
            for tab in tabs:
                w = max(1, max(len(x) for x in tab))
                widths.append(w)
                for x in tab:
                    flat += x + [0] * (w - len(x))
            packed = upload(flat, torch.int32, self.device)
            n = len(seqs)
            o, parts = n, []
            for w in widths:
                parts.append(packed[o : o + n * w].view(n, w))
                o += n * w
            out[mode] = (packed[:n], *parts, top)
        return out

    def _pages_of(self, layer: int, g: int):
        """Layer ``layer``'s K and V as pages of ``g`` rows (a divisor of ``slab_tokens``).

        ``g = slab_tokens``: the region's own per-layer views (page id = slot). Smaller:
        views of the whole arena region with a page stride of ``g`` rows, whose page
        ``slot * (2 * num_layers * slab_tokens / g) + i`` is rows ``i*g .. i*g+g-1`` of
        ``slot``'s slab at this layer; pages between two slabs' layer rows belong to other
        layers and are never listed. No byte moves; pages never overlap. Made once per
        (layer, g). Returns a :class:`CacheView`: fp8 per-token scales get the same page
        views of the region's scale section (None for a float layout).
        """
        region = self._region
        if g == self.slab_tokens:
            return region.op_views(layer)
        views = self._page_views.get((layer, g))
        if views is None:
            st, h, d = self.slab_tokens, self.layout.num_kv_heads, self.layout.head_dim
            n_pages = (self.num_slots - 1) * (2 * self.layout.num_layers * st // g) + st // g

            def pages(t, e):  # t: [slots, L, 2, st, H(, D)] contiguous; e elements per (token, head)
                size, stride = (n_pages, g, h, e)[: t.dim() - 2], (g * h * e, h * e, e, 1)[: t.dim() - 2]
                base = t.storage_offset() + layer * 2 * st * h * e
                return t.as_strided(size, stride, base), t.as_strided(size, stride, base + st * h * e)

            k, v = pages(region.data, d)
            scales = region.op_views(layer).scales
            if self.layout.is_fp8:  # as the ops take them (region.op_views): uint8 views
                k, v = as_bytes(k), as_bytes(v)
                if region.scales is not None:
                    scales = tuple(as_bytes(x) for x in pages(region.scales, 1))
            views = CacheView(k, v, scales)
            self._page_views[(layer, g)] = views
        return views

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
    META_TYPE = SlabMetadata
    FORWARD_OPTIONS = frozenset(("backend", "scale", "softcap", "return_lse", "num_splits", "deterministic"))
    NOT_FORWARD_OPTIONS = {
        **{name: _VISIBILITY for name in ("window_left", "sink_tokens", "chunk_size", "causal")},
        "kv_start": "set by the pool from the plan's metadata (a short first chunk); do not pass it",
        "sink_logits": _NO_SINK_LOGITS,
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
        if self._cp is not None and self._cp.mode == "tokens":
            return self._forward_tokens(q, k, v, meta, layer, commit, options)
        if self._cp is not None and self._cp.world_size > 1:
            return self._forward_heads(q, k, v, meta, layer, commit, options)
        return self._forward_local(q, k, v, meta, layer, commit, options)

    def _forward_tokens(self, q, k, v, meta, layer, commit, options):
        """Context parallel, tokens mode: every rank attends the whole chunk's queries over
        its rows of the visible chunks; the partial (out, lse) of each rank's rows come
        back to it and merge in rank order (bitwise repeatable)."""
        cp = self._cp
        layer, spec = self._cp_checks(meta, layer, commit, options)
        b, t_r, t = meta.num_seqs, meta.n_tokens, meta.q_tokens
        self._check_qkv(q, k, v, (b, t_r), f"rank {cp.rank}'s {t_r} of the chunk's {t} rows, [B, T_r, H, D]", layer)
        q_all = cp.gather_rows(q, t, layer)  # [B, T, H_q, D]
        out, lse = self._forward_local(q_all, k, v, meta, layer, commit, {**options, "return_lse": True})
        outs, lses = cp.scatter_rows(out, layer), cp.scatter_rows(lse, layer)  # [N, B, T_r, H_q(, D)]
        h, d = out.shape[2], out.shape[3]
        backend = resolve_backend(spec.backend, self.device, out.dtype, torch.is_grad_enabled() and out.requires_grad)
        parts = [(outs[i].reshape(b * t_r, h, d), lses[i].reshape(b * t_r, h)) for i in range(cp.world_size)]
        acc_o, acc_l = merge_partials(parts, backend)  # fixed rank order: the same bits every run
        out = acc_o.reshape(b, t_r, h, d)
        return (out, acc_l.reshape(b, t_r, h)) if spec.return_lse else out

    def _cp_checks(self, meta, layer, commit, options):
        """What a rank can refuse on its own, before its first collective (the other ranks
        would wait in it): metadata, ``commit``, ``layer`` and the per-call options."""
        self._require_current(meta)
        check_bool("commit", commit)
        layer = self._check_layer(layer)
        return layer, self._call_spec(layer, options)

    def _forward_heads(self, q, k, v, meta, layer, commit, options):
        """Context parallel, heads mode: this rank's rows -> its heads of every row, the
        local pool, and back. Everything a rank can refuse on its own is checked before
        the first collective (the others would wait in it)."""
        cp = self._cp
        n = cp.world_size
        layer, spec = self._cp_checks(meta, layer, commit, options)
        b, t = meta.num_seqs, meta.n_tokens
        t_r = cp.split_sizes(t)[cp.rank]
        lay = self.layout
        if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[2] % (lay.num_kv_heads * n):
            got = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
            raise ValueError(f"q: expected this rank's [B, T_r, H_q, D] shard with H_q a multiple of the world size "
                             f"{n} and of num_kv_heads {lay.num_kv_heads * n}, got {got}")
        kv_shape = (b, t_r, lay.num_kv_heads * n, lay.head_dim)
        for name, x in (("q", q), ("k", k), ("v", v)):
            shape = (b, t_r, q.shape[2], lay.head_dim) if name == "q" else kv_shape
            check_forward_tensor(name, x, shape, lay.input_dtype, self.device,
                                 f"rank {cp.rank}'s {t_r} of the step's {t} rows, [B, T_r, H, D]")
        qh, kh, vh = (cp.to_heads(x, t, layer) for x in (q, k, v))  # [B, T, H / N, D]
        res = self._forward_local(qh, kh, vh, meta, layer, commit, options)
        if spec.return_lse:
            return cp.to_tokens(res[0], layer), cp.to_tokens(res[1], layer)
        return cp.to_tokens(res, layer)

    def _forward_local(self, q, k, v, meta, layer, commit, options):
        region = self._require_arena("forward")
        self._require_current(meta)
        b, t = meta.num_seqs, meta.n_tokens
        tq = meta.q_tokens or t  # query rows (the whole chunk under context parallel tokens mode)
        layer, spec, h_q, attn_backend, store_backend, kv_grad = self._check_call(
            q, k, v, layer, commit, options, (b, t), tq)
        h_kv, d = self.layout.num_kv_heads, self.layout.head_dim
        self._check_committed(meta._history, layer)
        op_spec = _op_spec(spec) if options else self._op_specs[layer]
        q_pos = full_sh = hist_sh = own_sh = None
        if spec.rope_mode:
            q_pos, full_sh, hist_sh, own_sh, top = meta.rope[spec.rope_positions]
            if top >= spec.rope_cos.shape[0]:
                raise ValueError(f"rope_cos: this step reaches {spec.rope_positions} position {top}, past the "
                                 f"{spec.rope_cos.shape[0]}-row rotary table of layer {layer}")
        rows = QueryRows(meta.cu_seqlens_q, meta.max_seqlen_q, q_pos)
        store_cache = region.op_views(layer)
        pages = self._pages_of(layer, meta.page_tokens)
        qf = q.reshape(b * tq, h_q, d)
        kf, vf = k.reshape(b * t, h_kv, d), v.reshape(b * t, h_kv, d)
        multi = meta.num_chunks != b
        if multi and (kv_grad or (torch.is_grad_enabled() and q.requires_grad)):
            # Each chunk of a run sees part of the others through the given k/v read as a
            # paged cache: gradients to a cache tensor are the torch path's.
            attn_backend = resolve_backend(spec.backend, self.device, self.layout.input_dtype, True,
                                           "k/v of a multi-chunk step")
        if commit:
            store(kf, vf, store_cache, meta.slot_mapping, store_backend)
            for ch in meta._current:  # host-only bookkeeping: single stores, no lock, traceable
                ch.committed[layer] = True
        if commit and not (multi and kv_grad):
            keys = KeySet(meta.block_table, meta.seq_lens, meta.max_seqlen_k,
                          meta.kv_start if meta.has_kv_start else None, full_sh)
            res = attend(qf, pages, keys, rows, spec=op_spec, backend=attn_backend,
                         own=OwnKeys(kf, vf) if kv_grad else None)
            out, lse = res if spec.return_lse else (res, None)
        else:
            # The history before the run from the arena, the run's own tokens from k, v.
            kd = k if k.stride(-1) == 1 else k.contiguous()
            vd = v if v.stride(-1) == 1 else v.contiguous()
            if self.layout.is_fp8:
                # What a commit would store and read back: the denoising step attends exactly
                # what the clean pass will (the store's rule: per-row or the layer's static scales).
                static = store_cache.scales if store_cache.scales[0].dim() == 0 else (None, None)
                kd, vd = fp8_round_trip(kd, static[0]), fp8_round_trip(vd, static[1])
            if multi:
                g = meta.own_page_tokens
                kd, vd = kd.reshape(b * t // g, g, h_kv, d), vd.reshape(b * t // g, g, h_kv, d)
            own_keys = KeySet(meta.dense_block_table, meta.dense_seq_lens,
                              meta.dense_max_seqlen_k if multi else t,
                              meta.dense_kv_start if multi and meta.dense_has_kv_start else None, own_sh)
            hist = KeySet(meta.hist_block_table, meta.hist_seq_lens, meta.hist_max_seqlen_k,
                          meta.hist_kv_start if meta.hist_has_kv_start else None, hist_sh)
            res = attend(qf, pages, hist, rows, spec=op_spec, backend=attn_backend,
                         own=OwnKeys(kd, vd, own_keys, paged=multi))
            out, lse = res if spec.return_lse else (res, None)
        out = out.reshape(b, tq, h_q, d)
        return (out, lse.reshape(b, tq, h_q)) if spec.return_lse else out

    def _check_call(self, q, k, v, layer, commit, options: dict, lead: tuple[int, int], q_tokens: int | None = None):
        """What the forward checks that needs no metadata, in its order: ``commit``, the
        layer, the per-call options, q/k/v (``lead = (B, T)``; q has ``q_tokens`` rows, default
        T) and the backends. Changes nothing; an adapter calls it before it plans a step, so
        a step the forward would refuse plans nothing. Returns ``(layer, spec, H_q,
        attention backend, store backend, k/v need gradients)``."""
        check_bool("commit", commit)
        layer = self._check_layer(layer)
        spec = self._call_spec(layer, options)
        h_q = self._check_qkv(q, k, v, lead, "[B, T, H, D]", q_lead=(lead[0], q_tokens or lead[1]))
        return (layer, spec, h_q, *self._backends(spec, q, k, v))

    @staticmethod
    def _check_committed(history, layer: int) -> None:
        """``history``: ``((namespace, index), chunk record)`` pairs a step reads; each must be
        committed at ``layer``."""
        for (ns, _i), ch in history:
            if not ch.committed[layer]:
                raise RuntimeError(
                    f"forward: chunk {ch.index} of namespace {ns!r} is in the history but was "
                    f"never committed at layer {layer} (run forward(..., commit=True) for it)"
                )

    def _history_of(self, batch: Mapping) -> list:
        """The history a plan of ``batch`` (namespace -> ``(range, n_tokens)``) would read, as
        :meth:`_build_meta` lists it, changing nothing; chunks the plan would refuse (recycled)
        are left to the plan's own error."""
        out = []
        with self._lock:
            for ns, (run, _n) in batch.items():
                r = self._rollouts.get(ns)
                if r is None:
                    continue  # a new rollout: no history
                records = {**r.retired, **r.chunks}
                for c in run:
                    for i in self._chunks_seen(c, r.n0):
                        if i < run.start and i in records:
                            out.append(((ns, i), records[i]))
        return out

    # ------------------------------------------------------------------ cache_pools.py compatibility API
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
                    check_forward_tensor(name, x, shape, lay.input_dtype, self.device,
                                         "[num_layers, T, H_kv, D] of the layout")
                rows, _t = self._reserve({namespace: (_check_int("slab.chunk_index", slab.chunk_index, 0), t)})
            except BaseException:
                if fresh:  # a failed first append leaves the pool as it was: no arena
                    self.arena = self._region = self.layout = None
                    self.slab_tokens = prev_st
                    self._specs = ()
                raise
            ch = rows[0][2][0]
            st = self.slab_tokens
            region = self._region
            data = region.data[ch.slot]  # [L, 2, st, H, D]
            with torch.no_grad():
                for j, x in ((0, k), (1, v)):
                    if lay.is_fp8:
                        # The store's quantization rule (bit-equal to the kernels'), all layers at once.
                        if region.scales is not None:
                            sc = fp8_row_scales(x)  # [L, t, H]
                            region.scales[ch.slot, :, j, st - t :].copy_(sc)
                        else:
                            sc = torch.stack([region.kv_scales(i)[j] for i in range(lay.num_layers)])
                            sc = sc[:, None, None].expand(x.shape[:3])
                        x = quantize_fp8(x, sc)
                    data[:, j, st - t :].copy_(x)
            ch.committed = [True] * lay.num_layers

    def get(self, namespace: Hashable) -> list[Slab]:
        """The namespace's chunks committed at every layer, in logical order.

        Returns
        -------
        list of Slab
            Sinks, then the oldest to the newest chunk; ``k, v [num_layers, n, H_kv, D]``
            are views into the arena of the chunk's ``n`` real tokens (fp8 layouts:
            dequantized copies in the layout's ``input_dtype``). ``[]`` for an unknown
            namespace.
        """
        with self._lock:
            r = self._rollouts.get(namespace)
            if r is None or self._region is None:
                return []
            st = self.slab_tokens
            region = self._region

            def read(ch, j):  # [L, n, H, D] of K (j = 0) or V (j = 1)
                x = region.data[ch.slot, :, j, st - ch.n_tokens :]
                if not self.layout.is_fp8:
                    return x
                if region.scales is not None:
                    sc = region.scales[ch.slot, :, j, st - ch.n_tokens :]
                else:
                    sc = torch.stack([region.kv_scales(i)[j] for i in range(self.layout.num_layers)])
                    sc = sc[:, None, None].expand(x.shape[:3])
                # In fp32, then cast: an fp16 scale would underflow for rows below ~1e-5.
                return dequantize_fp8(x, sc, torch.float32).to(self.layout.input_dtype)

            return [Slab(i, read(ch, 0), read(ch, 1)) for i, ch in r.chunks.items() if all(ch.committed)]

    def clear_namespace(self, namespace: Hashable) -> None:
        """Free every slab of ``namespace`` (unknown: no-op)."""
        with self._lock:
            r = self._rollouts.pop(namespace, None)
            self._cp_n0.pop(namespace, None)
            if r is not None:
                self._stamp()
            if r is not None and (r.chunks or r.retired):
                self._region.allocator.decref(
                    [ch.slot for ch in sorted(r.chunks.values(), key=lambda c: -c.index)]
                    + [ch.slot for ch in r.retired.values()]
                )

    # ------------------------------------------------------------------ rollback
    def snapshot(self, namespace: Hashable) -> SlabSnapshot:
        """A rollback point of ``namespace`` (``KeyError`` if unknown)."""
        with self._lock:
            r = self._rollouts.get(namespace)
            if r is None:
                raise KeyError(f"namespace {namespace!r} is not in this SlabKVCache")
            return SlabSnapshot(namespace, self._cache_id, tuple(r.chunks.items()), r.last, tuple(r.retired.items()))

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
            # Slabs a run retired after the snapshot belong to the abandoned timeline: freed.
            was_retired = dict(snap._retired)
            extra += [ch for i, ch in r.retired.items() if was_retired.get(i) is not ch]
            if extra:
                self._region.allocator.decref([ch.slot for ch in extra])
            r.retired = {i: ch for i, ch in r.retired.items() if was_retired.get(i) is ch}
            r.chunks = dict(snap._chunks)
            r.last = snap._last
            r.version = self._stamp()

    def __repr__(self) -> str:
        vis = (f"window={self.window}, sinks={self.sinks}" if self.sink_tokens is None
               else f"window_tokens={self.window_tokens}, sink_tokens={self.sink_tokens}")
        return (
            f"SlabKVCache(slots={self.num_slots}, used={self.used_bytes}, {vis}, "
            f"slab_tokens={self.slab_tokens}, training={self.training_mode})"
        )
