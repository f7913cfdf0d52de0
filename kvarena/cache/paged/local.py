"""The single-process steps of a paged pool: ``plan`` reserves the step's slots (all or
nothing over the batch) and ``forward`` stores each layer's new K/V and attends with the
step's metadata, with no host-device sync.

A shared block that a namespace is about to write into (the partial last block after a
fork, or a full one after a ``truncate``) is copied first (copy-on-write at plan time: a
new block gets the whole ``[num_layers, 2, block_size, H_kv, D]`` contents and the old
one is dereferenced).
"""

from __future__ import annotations

from collections.abc import Hashable
from itertools import compress, count
from operator import add, gt

import torch

from kvarena.attention.batch import OwnKeys
from kvarena.attention.checks import check_sink_logits
from kvarena.attention.dispatch import attend, store
from kvarena.cache._meta import upload
from kvarena.cache.arena import CacheFullError
from kvarena.cache.paged.build import StepRows, graph_meta, packed_meta, padded_meta
from kvarena.cache.paged.meta import CallCheck, PagedMetadata
from kvarena.cache.paged.planner import StepNeeds, check_batch
from kvarena.cache.paged.table import FREED, cdiv

__all__ = ["LocalSteps", "check_call"]


class LocalSteps:
    """The steps of a pool that holds every block of its sequences (no context parallel)."""

    #: The pool's ContextParallel (none here).
    context_parallel = None

    def __init__(self, pool) -> None:
        self.pool = pool

    # ------------------------------------------------------------------ namespace hooks
    def seq_len(self, namespace: Hashable) -> int:
        return self.pool._get(namespace).seq_len

    def forget(self, namespace: Hashable) -> None:
        """``namespace`` was freed."""

    def forked(self, src: Hashable, dst: Hashable) -> None:
        """``dst`` was forked from ``src``."""

    def check_truncate(self, namespace: Hashable, n_tokens: int) -> None:
        self.pool._truncate_checked(namespace, n_tokens)

    def truncate(self, namespace: Hashable, n_tokens: int) -> None:
        self.pool._truncate_blocks(namespace, n_tokens)

    def check_allocate(self) -> None:
        """Raise if the pool takes no ``allocate`` (it does)."""

    # ------------------------------------------------------------------ plan
    def plan(self, batch, graph: bool, pad_to: int | None) -> PagedMetadata:
        pool = self.pool
        names, news = check_batch(batch, graph, pad_to, pool._graph)
        if pad_to is not None:
            pad_to = int(pad_to)
        with pool._lock:
            step = self.reserve(names, news, graph)
            if pad_to is not None:
                return padded_meta(pool, step, pad_to)
            if graph:
                pool._graph_gen += 1
                return graph_meta(pool, step, pool._graph, pool._graph_gen)
            return packed_meta(pool, step)

    def reserve(self, names: tuple, news: tuple, graph: bool = False) -> StepRows:
        """Take the blocks of ``news[i]`` new tokens of each namespace ``names[i]`` (all or
        nothing; call under the lock) and flush the table: the step's rows, not yet gathered.

        A sequence whose new tokens end within its record's ``limit`` (most rows of a decode
        step) is a plain append: only its length and version change, written into the
        table's row arrays. The others are counted, released and taken in full
        (:meth:`WindowRules.count`)."""
        pool = self.pool
        table = pool._table
        batch = table.rows_of(names, pool._seqs)
        recs = batch.records
        if batch.generation < 0 or 0 in news:
            olds = [0 if r is None else r.seq_len for r in recs]
            ends = list(map(add, olds, news))
            slow = [i for i, (r, e, n) in enumerate(zip(recs, ends, news)) if r is None or not n or e > r.limit]
        else:
            st = table.state
            olds = batch.take(st.lens)
            ends = list(map(add, olds, news))
            slow = list(compress(count(), map(gt, ends, batch.take(st.limit))))
        longest = max(ends)
        max_blocks = cdiv(longest, pool.block_size)
        grow, others = pool._windows.growing(slow, recs, olds, news)
        rest = [(names[i], news[i]) for i in others]  # what count() and the general path of _take see
        needs = pool._windows.count(rest, pool._seqs, pool.allocator) if rest else None
        g_cap = pool._graph
        if graph and max_blocks > g_cap.max_blocks:
            raise ValueError(
                f"batch: a sequence needs {max_blocks} blocks, over graph_capacity max_blocks {g_cap.max_blocks}"
            )
        need = len(grow) * pool._ngroups + (needs.need if needs is not None else 0)
        available = needs.available if needs is not None else pool.allocator.num_free
        if need > available:
            raise CacheFullError(
                f"plan needs {need} blocks, only {available} of {pool.total_blocks} are free "
                f"(block_size {pool.block_size} tokens, {pool.block_bytes} bytes a block, "
                f"budget {pool.policy.max_bytes} bytes)"
            )
        version = pool._stamp()  # one stamp for the step: every row's metadata is new
        if rest:
            self._release(needs, version)
        if slow:
            self._take([(names[i], news[i], recs[i] if i in grow else None) for i in slow], needs, need, max_blocks)
        if batch.generation < 0:  # records and rows made just now
            batch = table.rows_of(names, pool._seqs)
            recs = batch.records
        st = table.state
        batch.put(st.lens, ends)
        batch.put(st.version, (version,) * len(ends))
        if others:
            refs, refresh = pool.allocator._ref, pool._windows.refresh
            for i in others:
                refresh(recs[i], refs)
        table.flush()
        return StepRows(batch, news, olds, ends, longest, max_blocks, version, slow)

    def _release(self, needs: StepNeeds, version: int) -> None:
        """The step's out-of-window blocks back to the allocator (even if a shared allocator
        refuses the step's blocks below: their rows are stamped ``version`` here)."""
        pool = self.pool
        for (ns, g), dead in needs.dead.items():
            seq = pool._seqs[ns]
            if dead.indices:
                blocks = seq.blocks[g]
                pool._drop(g, [blocks[j] for j in dead.indices])
                for j in dead.indices:
                    blocks[j] = FREED
                    pool._table.set_entry(g, seq.row, j, 0)
                seq.version = version
            seq.released[g] = dead.end

    def _take(self, items: list, needs: StepNeeds | None, need: int, max_blocks: int) -> None:
        """New namespaces, copy-on-write copies and new blocks (the lengths stay), row by row
        in the batch's order: ``items`` are ``(namespace, new tokens, grows)``, where
        ``grows`` is the record of a row :meth:`WindowRules.growing` found (one new block
        per group) and None for a row ``needs`` counted.

        Every block is taken in ONE allocator call before anything changes: the allocator
        may be shared with another pool on the same arena region (its own lock, not ours),
        so blocks counted free can be gone by now; a per-block alloc could then raise
        half-way through and leave the batch half applied."""
        pool = self.pool
        alloc, bs, table = pool.allocator, pool.block_size, pool._table
        refs = alloc._ref
        fresh = iter(alloc.alloc(need))
        table.ensure_cols(max_blocks)
        copies_src: list[int] = []
        copies_dst: list[int] = []
        groups = range(pool._ngroups)
        pending, opened = table.pending, pool._windows.opened
        grown = 0
        for ns, n, grows in items:
            if grows is not None:
                col = len(grows.blocks[0])
                new = [next(fresh) for _ in groups]
                for g, b in zip(groups, new):
                    grows.blocks[g].append(b)
                    pending[(g, grows.row, col)] = b
                opened(grows, n, new)
                grown += 1
                continue
            seq = pool._seqs.get(ns)
            if seq is None:
                seq = pool._seqs[ns] = table.new_seq()
            old = seq.seq_len
            n_blocks = cdiv(old + n, bs)
            for g in groups if ns in needs.touched else ():
                blocks = seq.blocks[g]
                for j in range(old // bs, min(len(blocks), n_blocks)):
                    b = blocks[j]
                    if refs.get(b, 0) > 1:
                        nb = next(fresh)
                        pool._group_used[g] += 1
                        alloc.decref([b])  # shared: never frees
                        copies_src.append(b)
                        copies_dst.append(nb)
                        blocks[j] = nb
                        table.set_entry(g, seq.row, j, nb)
                start = len(blocks)
                if n_blocks > start:
                    blocks.extend(next(fresh) for _ in range(n_blocks - start))
                    pool._group_used[g] += n_blocks - start
                    table.set_entries(seq, g, start)
        for g in groups if grown else ():
            pool._group_used[g] += grown
        if copies_src and pool._region is not None:
            src = upload(copies_src, torch.int64, pool.device)
            dst = upload(copies_dst, torch.int64, pool.device)
            pool._region.copy_blocks(src, dst)

    # ------------------------------------------------------------------ forward
    def forward(self, q, k, v, meta: PagedMetadata, layer, options: dict):
        pool = self.pool
        region = pool._region
        if region is None:
            raise RuntimeError(
                "forward: this PagedKVCache has no layout (block bookkeeping only); "
                "construct it with layout=KVLayout(...) to store and attend"
            )
        pool._require_current(meta)
        call = check_call(pool, q, k, v, layer, options, meta.total_q, meta.pad_to is not None)
        spec = call.spec
        # The step's real longest sequence, not a graph plan's capacity: its last token is
        # the largest position any query or key of the step has.
        if spec.rope_mode and meta._max_seq_len > spec.rope_cos.shape[0]:
            raise ValueError(f"rope_cos: this step reaches position {meta._max_seq_len - 1}, past the "
                             f"{spec.rope_cos.shape[0]}-row rotary table of layer {call.layer}")
        cache = region.op_views(call.layer)
        r = call.route
        store(k, v, cache, meta.slot_mappings[call.group], r.store)
        return attend(q, cache, meta.keys[call.group], meta.rows, spec=spec, route=r,
                      own=OwnKeys(k, v) if r.kv_grad else None)


def check_call(pool, q, k, v, layer, options: dict, total_q: int | None = None, padded: bool = False) -> CallCheck:
    """What :meth:`forward` checks that needs no metadata, in its order: the layer, the
    per-call options, q/k/v (``total_q`` rows; None: ``q``'s), sink logits and the
    route (``padded``: a ``pad_to`` plan). Changes nothing; an adapter calls it before
    it plans a step, so a step the forward would refuse plans nothing."""
    layer = pool._check_layer(layer)
    spec = pool._call_spec(layer, options)
    group = pool._layer_group[layer]
    lim = pool._limits[group]
    if options and lim is not None:
        w, sinks = lim
        if spec.window_left is None or spec.window_left > w or spec.sink_tokens > sinks:
            raise ValueError(f"window_left/sink_tokens: this pool releases layer {layer}'s blocks outside "
                             f"window_left={w}, sink_tokens={sinks} (free_out_of_window); a call cannot see more")
    if total_q is None:
        total_q = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() else 0
    pool._check_qkv(q, k, v, (total_q,), "[total_q, H, D]", layer)
    if spec.sink_logits is not None:
        check_sink_logits(spec.sink_logits, q)
    r = pool._route(spec, q, k, v)
    if r.kv_grad and padded:
        # The differentiable paths read each query row's own k/v at its position, which
        # for a padding row is a real older token's.
        raise ValueError("meta: a padded plan (pad_to) gives no gradient to k/v; plan the real tokens packed")
    if options:
        return CallCheck(layer, spec, group, r)
    # The layer's own spec: one record per (layer, route), made once (a hot path).
    key = (layer, r)
    call = pool._calls.get(key)
    if call is None:
        call = pool._calls[key] = CallCheck(layer, spec, group, r)
    return call
