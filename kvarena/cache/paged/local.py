"""The single-process steps of a paged pool: ``plan`` claims the step's slots (all or
nothing over the batch, :mod:`~kvarena.cache.paged.claim`) and builds its metadata;
``forward`` follows the pools' template (:class:`~kvarena.cache._pool.PoolSteps`): check,
store each layer's new K/V, attend over the layer group's key set of the metadata, with
no host-device sync.
"""

from __future__ import annotations

from collections.abc import Hashable

from kvarena.attention.batch import OwnKeys
from kvarena.attention.checks import check_sink_logits
from kvarena.attention.dispatch import attend, store
from kvarena.cache._pool import CallCheck, PoolSteps
from kvarena.cache.paged.build import graph_meta, packed_meta, padded_meta
from kvarena.cache.paged.claim import reserve, truncate_blocks, truncate_checked
from kvarena.cache.paged.meta import PagedMetadata
from kvarena.cache.paged.planner import check_batch

__all__ = ["LocalSteps"]


class LocalSteps(PoolSteps):
    """The steps of a pool that holds every block of its sequences (no context parallel)."""

    def __init__(self, pool) -> None:
        super().__init__(pool)
        self.region = pool.region  # bound at construction, for good (None: bookkeeping only)

    # ------------------------------------------------------------------ namespace hooks
    def seq_len(self, namespace: Hashable) -> int:
        return self.pool._get(namespace).seq_len

    def forget(self, namespace: Hashable) -> None:
        """``namespace`` was freed."""

    def forked(self, src: Hashable, dst: Hashable) -> None:
        """``dst`` was forked from ``src``."""

    def check_truncate(self, namespace: Hashable, n_tokens: int) -> None:
        truncate_checked(self.pool, namespace, n_tokens)

    def truncate(self, namespace: Hashable, n_tokens: int) -> None:
        truncate_blocks(self.pool, namespace, n_tokens)

    def check_allocate(self) -> None:
        """Raise if the pool takes no ``allocate`` (it does)."""

    # ------------------------------------------------------------------ plan
    def plan(self, batch, graph: bool, pad_to: int | None) -> PagedMetadata:
        pool = self.pool
        names, news = check_batch(batch, graph, pad_to, pool._graph)
        if pad_to is not None:
            pad_to = int(pad_to)
        with pool._lock:
            step = reserve(pool, names, news, graph)
            if pad_to is not None:
                return padded_meta(pool, step, pad_to)
            if graph:
                pool._graph_gen += 1
                return graph_meta(pool, step, pool._graph, pool._graph_gen)
            return packed_meta(pool, step)

    # ------------------------------------------------------------------ forward (the template's steps)
    def _require_layout(self) -> None:
        if self.region is None:
            raise RuntimeError(
                "forward: this PagedKVCache has no layout (block bookkeeping only); "
                "construct it with layout=KVLayout(...) to store and attend"
            )

    def check(self, q, k, v, meta: PagedMetadata, layer, options: dict, commit: bool = True) -> CallCheck:
        pool = self.pool
        self._require_layout()
        pool._require_current(meta)
        call = self.check_call(q, k, v, layer, options, meta.total_q, meta.pad_to is not None)
        spec = call.spec
        # The step's real longest sequence, not a graph plan's capacity: its last token is
        # the largest position any query or key of the step has.
        if spec.rope_mode and meta._max_seq_len > spec.rope_cos.shape[0]:
            raise ValueError(f"rope_cos: this step reaches position {meta._max_seq_len - 1}, past the "
                             f"{spec.rope_cos.shape[0]}-row rotary table of layer {call.layer}")
        return call

    def store(self, k, v, meta: PagedMetadata, call: CallCheck) -> None:
        store(k, v, self.region.op_views(call.layer), meta.slot_mappings[call.group], call.route.store)

    def attend(self, q, k, v, meta: PagedMetadata, call: CallCheck, commit: bool = True):
        r = call.route
        return attend(q, self.region.op_views(call.layer), meta.keys[call.group], meta.rows, spec=call.spec,
                      route=r, own=OwnKeys(k, v) if r.kv_grad else None)

    def check_forward(self, batch, q, k, v, layer, pad_to: int | None, options: dict) -> None:
        """:meth:`PagedKVCache.check_forward`: the batch as ``plan`` checks it, then
        :meth:`check_call` with the plan's ``total_q``."""
        self._require_layout()
        _names, news = check_batch(batch, False, pad_to, None)
        total_q = len(news) * int(pad_to) if pad_to is not None else sum(news)
        self.check_call(q, k, v, layer, options, total_q, pad_to is not None)

    def check_call(self, q, k, v, layer, options: dict, total_q: int, padded: bool = False) -> CallCheck:
        """What :meth:`forward` checks that needs no metadata, in its order: the layer, the
        per-call options, q/k/v (``total_q`` rows), sink logits and the route (``padded``:
        a ``pad_to`` plan). Changes nothing."""
        pool = self.pool
        layer = pool._check_layer(layer)
        spec = pool._call_spec(layer, options)
        group = pool._layer_group[layer]
        h_q = pool._check_qkv(q, k, v, (total_q,), "[total_q, H, D]", layer)
        if spec.sink_logits is not None:
            check_sink_logits(spec.sink_logits, q)
        r = pool._route(spec, q, k, v)
        if r.kv_grad and padded:
            # The differentiable paths read each query row's own k/v at its position, which
            # for a padding row is a real older token's.
            raise ValueError("meta: a padded plan (pad_to) gives no gradient to k/v; plan the real tokens packed")
        return self.call_check(layer, spec, group, h_q, r, options)
