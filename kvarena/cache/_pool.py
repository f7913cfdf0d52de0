"""What the two KV pools share: policy checks, per-layer attention specs, accounting,
metadata freshness, the per-call option rule of ``forward``, the forward template
(:class:`PoolSteps`, checked into one :class:`CallCheck`) and the public
:meth:`KVPoolBase.attend` of a batch of query rows.

A pool validates its attention options once, at construction, into one
:class:`~kvarena.attention.spec.AttentionSpec` per layer. ``forward`` then takes the
layer's spec as it is (no per-call work), or, when the caller passes overrides, a copy
with them applied and validated, before anything is written.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields

import torch

from kvarena.argcheck import is_int
from kvarena.attention.backend import resolve_backend
from kvarena.attention.batch import KeySet, QueryRows
from kvarena.attention.checks import check_head_dim
from kvarena.attention.ops import paged_attention
from kvarena.attention.route import Own, Route, route
from kvarena.attention.spec import AttentionSpec
from kvarena.cache._meta import check_forward_tensor, next_version
from kvarena.cache.arena import KVArena, KVLayout, _check_index
from kvarena.cache.keys import CachePolicy

__all__ = ["CallCheck", "KVPoolBase", "PoolSteps", "layer_specs"]


@dataclass(frozen=True)
class CallCheck:
    """What a pool's steps resolved for one layer's call before anything is written: the
    layer, the spec its attention runs with (the layer's, per-call overrides applied; the
    slab pool's in its non-causal form, see ``_attend_spec``), the layer's group (0 in a
    pool without layer groups), ``H_q`` and the call's
    :class:`~kvarena.attention.route.Route` (:meth:`KVPoolBase._route`: decided once, before
    the store; the steps only read it)."""

    layer: int
    spec: AttentionSpec
    group: int
    h_q: int
    route: Route


class PoolSteps:
    """The forward template of both pools: a pool holds one such object, chosen at
    construction (one process, or a context-parallel strategy), and its ``forward`` runs

    1. :meth:`check`: everything the call can refuse, before any write, into a
       :class:`CallCheck` (the metadata's freshness, the layer, the options, q/k/v, the
       route);
    2. :meth:`store`: the new K/V into the layer's cache view (skipped when ``commit`` is
       False: a slab pool's denoising step writes nothing);
    3. :meth:`attend`: the query rows over the step's key set, read from the plan's
       metadata as it is (no host work, no sync).

    Each pool supplies its planner (``plan``), its claim and its key sets (the metadata);
    a context-parallel strategy either implements the three steps for its rank or wraps
    the local steps' :meth:`forward` (reshaping around it, merging after it).
    """

    #: The pool's ContextParallel (None: one process).
    context_parallel = None

    def __init__(self, pool) -> None:
        self.pool = pool
        self._calls: dict = {}  # call_check's records of the layers' own specs

    def call_check(self, layer: int, spec: AttentionSpec, group: int, h_q: int, r: Route,
                   options: dict) -> CallCheck:
        """The :class:`CallCheck` of a checked call: a new one with per-call ``options``, else
        the one record per (layer, H_q, route) kept here (a hot path: made once). Routes are
        memoized, so the route is told by identity (no hash of its fields); the record holds
        it, so its id cannot pass to another object while keyed here."""
        if options:
            return CallCheck(layer, spec, group, h_q, r)
        key = (layer, h_q, id(r))
        call = self._calls.get(key)
        if call is None or call.spec is not spec:
            call = self._calls[key] = CallCheck(layer, spec, group, h_q, r)
        return call

    def forward(self, q, k, v, meta, layer, options: dict, commit: bool = True):
        call = self.check(q, k, v, meta, layer, options, commit)
        if commit:
            self.store(k, v, meta, call)
        return self.attend(q, k, v, meta, call, commit)

    def check(self, q, k, v, meta, layer, options: dict, commit: bool) -> CallCheck:
        raise NotImplementedError

    def store(self, k, v, meta, call: CallCheck) -> None:
        raise NotImplementedError

    def attend(self, q, k, v, meta, call: CallCheck, commit: bool):
        raise NotImplementedError


def _spec_layers(key, num_layers: int | None) -> list[int]:
    """The layer indices a key of the ``attention`` mapping names."""
    if isinstance(key, bool):
        raise TypeError(f"attention: a key must be a layer index or an iterable of them, got {key!r}")
    if isinstance(key, int):
        layers = [key]
    elif isinstance(key, Iterable) and not isinstance(key, (str, bytes)):
        layers = list(key)
    else:
        raise TypeError(f"attention: a key must be a layer index or an iterable of them, got {key!r}")
    for layer in layers:
        if not is_int(layer):
            raise TypeError(f"attention: layer index {layer!r} (in key {key!r}) is not an int")
        if layer < 0 or (num_layers is not None and layer >= num_layers):
            bound = "" if num_layers is None else f" < num_layers ({num_layers})"
            raise ValueError(f"attention: layer index {layer} (in key {key!r}) must be >= 0{bound}")
    return layers


def layer_specs(attention, num_layers: int | None) -> tuple[AttentionSpec, ...] | None:
    """Normalize a pool's ``attention=`` argument into one spec per layer.

    Parameters
    ----------
    attention : None, AttentionSpec, sequence of AttentionSpec, or mapping
        ``None``: the default spec everywhere. A spec: every layer. A sequence: one
        per layer (its length must be ``num_layers``). A mapping from a layer index or
        an iterable of them (``range(0, 30, 6)``, a tuple) to a spec: the layers it
        names (each at most once); the others take the default spec.
    num_layers : int or None
        None checks only the types (a pool that does not know its layout yet) and
        returns None.

    Raises
    ------
    TypeError, ValueError
        A value that is not an AttentionSpec, a bad key, a layer out of range or named
        twice, or a sequence of the wrong length.
    """
    default = AttentionSpec()
    if attention is None:
        return None if num_layers is None else (default,) * num_layers
    if isinstance(attention, AttentionSpec):
        return None if num_layers is None else (attention,) * num_layers
    if isinstance(attention, Mapping):
        chosen: dict[int, AttentionSpec] = {}
        for key, spec in attention.items():
            if not isinstance(spec, AttentionSpec):
                raise TypeError(f"attention[{key!r}]: expected an AttentionSpec, got {type(spec).__name__}")
            for layer in _spec_layers(key, num_layers):
                if layer in chosen:
                    raise ValueError(f"attention: layer {layer} is named twice (again in key {key!r})")
                chosen[layer] = spec
        return None if num_layers is None else tuple(chosen.get(i, default) for i in range(num_layers))
    if isinstance(attention, Sequence) and not isinstance(attention, (str, bytes)):
        for i, spec in enumerate(attention):
            if not isinstance(spec, AttentionSpec):
                raise TypeError(f"attention[{i}]: expected an AttentionSpec, got {type(spec).__name__}")
        if num_layers is None:
            return None
        if len(attention) != num_layers:
            raise ValueError(f"attention: {len(attention)} specs for {num_layers} layers (one per layer)")
        return tuple(attention)
    raise TypeError(
        "attention: expected an AttentionSpec, a list of them (one per layer) or a mapping "
        f"{{layer or layers: AttentionSpec}}, got {type(attention).__name__}"
    )


class KVPoolBase:
    """Shared state and checks of :class:`PagedKVCache` and :class:`SlabKVCache`.

    Subclasses set ``CLASS_NAME`` (the policy class they serve), ``FORWARD_OPTIONS``
    (the spec fields ``forward`` takes as per-call overrides) and ``NOT_FORWARD_OPTIONS``
    (keyword -> where it goes instead, for the message of the TypeError).
    """

    CLASS_NAME = ""
    FORWARD_OPTIONS: frozenset = frozenset()
    NOT_FORWARD_OPTIONS: Mapping[str, str] = {}

    def _init_pool(self, policy, attention) -> None:
        if not isinstance(policy, CachePolicy):
            raise TypeError(f"policy: expected a kvarena.CachePolicy, got {type(policy).__name__}")
        if policy.class_name != self.CLASS_NAME:
            raise ValueError(
                f"policy.class_name: {type(self).__name__} serves {self.CLASS_NAME!r} policies, "
                f"got {policy.class_name!r} (make_pool picks the class from it)"
            )
        layer_specs(attention, None)  # types now; layer coverage once the layout is known
        self.policy = policy
        self._lock = threading.RLock()
        self._cache_id = next_version()  # process-unique, never reused (unlike id())
        self._attention = attention
        self._specs: tuple[AttentionSpec, ...] = ()
        # Any change that can make metadata stale stamps a new epoch; metadata planned at
        # the current epoch is fresh without looking at its namespaces (O(1) per layer).
        self._epoch = next_version()

    #: The metadata class the pool's ``plan`` returns (subclasses).
    META_TYPE: type = object

    @property
    def hits(self) -> int:
        """int: always 0 (a KV pool has no lookups; the counter every cache of the package has)."""
        return 0

    @property
    def misses(self) -> int:
        """int: always 0 (see :attr:`hits`)."""
        return 0

    def _require_current(self, meta) -> None:
        """Raise unless ``meta`` is this pool's and still current: O(1) when it was planned at
        the current epoch, else :meth:`check_metadata` (host data only: no sync). Skipped
        while torch.compile traces: dynamo would guard on the epoch and recompile after
        every plan."""
        if torch.compiler.is_compiling():
            return
        if not (type(meta) is self.META_TYPE and meta._owner == self._cache_id and meta._epoch == self._epoch):
            self.check_metadata(meta)

    def _check_meta_owner(self, meta) -> None:
        """The first checks of ``check_metadata``: ``meta`` is a ``META_TYPE`` (TypeError)
        planned by this pool (ValueError)."""
        if not isinstance(meta, self.META_TYPE):
            raise TypeError(f"meta: expected a {self.META_TYPE.__name__}, got {type(meta).__name__}")
        if meta._owner != self._cache_id:
            raise ValueError(f"meta: this metadata was planned by another {type(self).__name__}")

    @staticmethod
    def _stale_namespaces(meta, records: Mapping):
        """The namespaces of ``meta`` whose record (an object with a ``version``) is gone or
        has a newer version than the one ``meta`` was planned at, in ``meta``'s order."""
        for ns, ver in zip(meta.namespaces, meta._versions):
            rec = records.get(ns)
            if rec is None or rec.version != ver:
                yield ns

    def _stamp(self) -> int:
        """A new version for a changed namespace; also moves the pool's epoch."""
        self._epoch = next_version()
        return self._epoch

    def _bind_layout(self, layout: KVLayout, device: torch.device) -> tuple[AttentionSpec, ...]:
        """Check the layout against the ops and resolve the per-layer specs (no state change)."""
        for grp in layout.layer_groups:
            check_head_dim("layout.head_dim", grp.head_dim)
        specs = layer_specs(self._attention, layout.num_layers)
        for i, spec in enumerate(specs):
            if i == 0 or spec is not specs[i - 1] or layout.groups is not None:
                self._check_spec(spec, f"attention[{i}]")
                resolve_backend(spec.backend, device, layout.input_dtype, False, "layout.input_dtype")
                if spec.rope_mode:
                    self._check_rope(spec, f"attention[{i}]", layout.layer_shape(i)[1], device)
        return specs

    def _check_block_bytes(self, block_bytes: int, tokens: int, layout: KVLayout | None = None) -> None:
        """``policy.block_bytes`` must be 0 (derived) or ``block_bytes``, the layout's bytes of a
        ``tokens``-token block (``layout``, when given, is named in the message)."""
        given = int(getattr(self.policy, "block_bytes", 0))
        if given not in (0, block_bytes):
            of = "" if layout is None else f" for {layout}"
            raise ValueError(f"policy.block_bytes: expected 0 (derived) or {block_bytes} = layout.block_bytes"
                             f"({tokens}){of}, got {given}")

    def _own_arena(self, layout: KVLayout, tokens: int, device: torch.device | None) -> KVArena:
        """The pool's own arena: one region named ``CLASS_NAME`` of ``tokens``-token blocks in
        ``policy.max_bytes``, made after the layout is bound (``_specs`` resolved for it)."""
        self._specs = self._bind_layout(layout, device or torch.device("cpu"))
        return KVArena.single(self.CLASS_NAME, layout, tokens, self.policy.max_bytes, device=device)

    def _check_spec(self, spec: AttentionSpec, where: str) -> None:
        """Pool-specific limits of a spec (subclasses)."""

    #: The RoPE-on-read position modes the pool can give (subclasses).
    ROPE_POSITIONS: tuple = ("absolute",)

    def _check_rope(self, spec: AttentionSpec, where: str, head_dim: int, device: torch.device) -> None:
        if spec.rope_cos.shape[1] * 2 != head_dim:
            raise ValueError(f"{where}.rope_cos: expected head_dim / 2 = {head_dim // 2} columns, got "
                             f"{spec.rope_cos.shape[1]} (partial rotary is not supported)")
        if spec.rope_cos.device.type != device.type:
            raise ValueError(f"{where}.rope_cos: expected the pool's device {device}, got {spec.rope_cos.device}")
        if spec.rope_positions not in self.ROPE_POSITIONS:
            raise ValueError(f"{where}.rope_positions: {type(self).__name__} gives {' or '.join(self.ROPE_POSITIONS)} "
                             f"positions, not {spec.rope_positions!r} (in a paged pool each query row has its own "
                             "window, so there is no one [sinks | window] layout per sequence)")

    @property
    def region(self):
        """The :class:`~kvarena.cache.arena.ArenaRegion` holding this pool's blocks (None before
        a layout is bound): its ``data``, ``scales``, per-layer ``k(layer)``/``v(layer)`` views
        and ``allocator`` are the pool's bytes, for inspection. Writing them bypasses the pool."""
        return self._region

    # ------------------------------------------------------------------ accounting
    def _blocks(self):
        """``(allocator, bytes per block)`` or None before the pool has an arena."""
        raise NotImplementedError

    @property
    def used_bytes(self) -> int:
        """int: bytes of the blocks in use (whole blocks)."""
        got = self._blocks()
        return 0 if got is None else got[0].num_used * got[1]

    @property
    def free_bytes(self) -> int:
        """int: bytes of free blocks (the whole budget before the arena exists)."""
        got = self._blocks()
        return int(self.policy.max_bytes) if got is None else got[0].num_free * got[1]

    # ------------------------------------------------------------------ per-layer options
    def attention_spec(self, layer: int) -> AttentionSpec:
        """The :class:`AttentionSpec` of ``layer`` (validated at construction)."""
        return self._specs[self._check_layer(layer)]

    def _check_layer(self, layer) -> int:
        return _check_index("layer", layer, len(self._specs))

    def _call_spec(self, layer: int, overrides: dict) -> AttentionSpec:
        """The layer's spec with ``forward``'s overrides applied (validated)."""
        spec = self._specs[layer]
        if not overrides:
            return spec
        for name in overrides:
            if name not in self.FORWARD_OPTIONS:
                where = self.NOT_FORWARD_OPTIONS.get(name)
                if where is None:
                    where = (f"not an option of {type(self).__name__}.forward (per-call options: "
                             f"{', '.join(sorted(self.FORWARD_OPTIONS))})")
                raise TypeError(f"{name}: {where}")
        spec = spec.replace(**overrides)
        self._check_spec(spec, "forward")
        return spec

    def _attend_spec(self, spec: AttentionSpec) -> AttentionSpec:
        """The spec a call's attention runs with, for the layer's spec (subclasses: the slab
        pool attends the keys it lists in full)."""
        return spec

    def attend(self, q, layer: int, keys: KeySet, rows: QueryRows, **options):
        """Attention of a batch of query rows over this pool's stored keys of ``layer``; writes
        nothing.

        For an integration that attends rows the step's metadata does not describe (a query
        with its own window, a row of another plan): ``keys`` (a
        :class:`~kvarena.attention.batch.KeySet`: :meth:`block_table` of the rows'
        namespaces, each row's key count and optional ``kv_start``) says which stored keys
        each sequence's rows see, ``rows`` (:class:`~kvarena.attention.batch.QueryRows`)
        where its rows are in ``q [total_q, H_q, D]``. The layer's spec applies, with the
        per-call overrides ``forward`` takes (``options``, checked as ``forward`` checks
        them), as ``forward`` applies it (the slab pool: full attention over the keys
        listed). Every argument is validated as :func:`kvarena.paged_attention` validates
        it. Returns ``out`` (``(out, lse)`` with ``return_lse``).
        """
        region = self._region
        if region is None:
            raise RuntimeError(f"attend: this {type(self).__name__} holds no K/V (no layout)")
        layer = self._check_layer(layer)
        spec = self._attend_spec(self._call_spec(layer, options))
        if not isinstance(keys, KeySet):
            raise TypeError(f"keys: expected a kvarena.attention.batch.KeySet, got {type(keys).__name__}")
        if not isinstance(rows, QueryRows):
            raise TypeError(f"rows: expected a kvarena.attention.batch.QueryRows, got {type(rows).__name__}")
        scales = region.kv_scales(layer)
        fp8 = {} if scales is None else dict(k_scale=scales[0], v_scale=scales[1])
        given = {f.name: getattr(spec, f.name) for f in fields(spec) if f.name != "rope_positions"}
        return paged_attention(q, region.k(layer), region.v(layer), keys.block_table, keys.seq_lens,
                               rows.cu_seqlens_q, kv_start=keys.kv_start, max_seqlen_q=rows.max_seqlen_q,
                               max_seqlen_k=keys.max_seqlen_k, rope_q_pos=rows.rope_q_pos,
                               rope_k_shift=keys.rope_k_shift, **given, **fp8)

    def _check_qkv(self, q, k, v, lead: tuple[int, ...], what: str, layer: int = 0, q_lead=None) -> int:
        """q ``[*q_lead, H_q, D]`` (``q_lead`` default ``lead``), k/v ``[*lead, H_kv, D]`` of
        ``layer`` in the layout; returns ``H_q``."""
        lay = self.layout
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if q.dim() != len(lead) + 2:
            raise ValueError(f"q: expected a {what} tensor, got shape {tuple(q.shape)}")
        h_q = q.shape[-2]
        h_kv, d = lay.layer_shape(layer)
        if h_q == 0 or h_q % h_kv:
            raise ValueError(f"q: H_q ({h_q}) must be a positive multiple of the layout's H_kv ({h_kv})")
        for name, t, heads in (("q", q, h_q), ("k", k, h_kv), ("v", v, h_kv)):
            rows = q_lead if name == "q" and q_lead is not None else lead
            check_forward_tensor(name, t, (*rows, heads, d), lay.input_dtype, self.device, f"{what} of the plan/layout")
        return h_q

    def _route(self, spec: AttentionSpec, q, k, v, own: Own = Own.NONE, takes_own=False) -> Route:
        """The call's :class:`~kvarena.attention.route.Route` (the one decision of backend,
        path and launches; ``own``: where the step's own keys sit, ``takes_own``: the
        kernel's answer for them, see :func:`~kvarena.attention.route.route`), made before
        any write."""
        grad_on = torch.is_grad_enabled()
        q_grad = grad_on and q.requires_grad
        kv_grad = grad_on and (k.requires_grad or v.requires_grad)
        sink_grad = grad_on and spec.sink_logits is not None and spec.sink_logits.requires_grad
        # The arena never requires grad: gradients go to q and the given k/v, which the
        # Triton backward computes (learned sink logits: the torch path's).
        if self.layout.is_fp8 and (kv_grad or sink_grad or q_grad):
            raise ValueError("k/v: this pool stores fp8 K/V, which has no backward (quantization is not "
                             "differentiable); run under torch.no_grad() or use a float layout to train")
        return route(spec.backend, self.device, self.layout.input_dtype, rope=bool(spec.rope_mode), q_grad=q_grad,
                     kv_grad=kv_grad, sink_grad=sink_grad, own=own, takes_own=takes_own)
