"""Decode context parallel for the paged pool (``PagedKVCache(..., context_parallel=cp)``).

Tokens mode, as vLLM's decode context parallel: q, k, v are replicated on every rank;
``plan`` is the same call on every rank (one all-reduce of a flag: does the step fit on
every rank); block ``j`` of a sequence (tokens ``j * bs ..``) belongs to rank ``(j + o) %
N``, which alone stores it, in its own arena of ``ceil(blocks / N)`` blocks; ``o`` is the
sequence's creation count modulo ``N`` (a fork takes its source's), so the first blocks of
many short sequences do not all land on rank 0. Per layer each rank attends every
query over its blocks of the history (all older than the step's first token, so no
mask), every rank attends the step's own keys causally (replicated, small), and the
partial ``(out, lse)`` of the ranks are all-gathered and merged in a fixed order (own
keys, then rank 0 .. N-1): the output is replicated and the same bits on every rank.

A rank's pool holds its blocks like a single-process pool (local block ``i`` of a
sequence is its ``i``-th owned global block), so fork (blocks shared by reference count,
copy-on-write) and truncate work on it unchanged; :class:`DecodeContextParallel`, the
steps the pool holds, keeps the global lengths and builds the step's metadata for the
replicated rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping

import torch

from kvarena.argcheck import check_bool, is_int
from kvarena.attention.batch import CacheView, KeySet, QueryRows
from kvarena.attention.dispatch import attend, merge_partials, store
from kvarena.cache._meta import upload
from kvarena.cache._pool import CallCheck, PoolSteps
from kvarena.cache.arena import CacheFullError, _check_int
from kvarena.cache.paged.claim import reserve, truncate_blocks
from kvarena.cache.paged.meta import PagedMetadata
from kvarena.cache.paged.table import cdiv

__all__ = ["DecodeContextParallel", "local_policy"]

_REFUSED = ("window_left", "sink_tokens", "chunk_size", "sink_logits")


def local_policy(cp, policy, layout, block_size, unsupported: dict):
    """This rank's policy under ``cp`` (``ceil(blocks / N)`` blocks of the global budget),
    after the checks of what context parallel does not serve (ValueError naming the
    argument): ``mode="heads"``, ``unsupported`` arguments set, no layout, layer groups,
    fp8 storage."""
    from kvarena.distributed import ContextParallel

    if not isinstance(cp, ContextParallel):
        raise TypeError(f"context_parallel: expected a kvarena.distributed.ContextParallel, got {type(cp).__name__}")
    if cp.mode != "tokens":
        raise ValueError(f"context_parallel.mode: PagedKVCache shards tokens (decode context parallel), not "
                         f"{cp.mode!r}")
    for name, value in unsupported.items():
        if value not in (None, False, 0):
            raise ValueError(f"{name}: not served with context_parallel (each rank holds only its blocks)")
    if layout is None:
        raise ValueError("layout: context_parallel needs the model's KVLayout")
    if layout.groups is not None:
        raise ValueError("layout.groups: layer groups are not served with context_parallel")
    if layout.is_fp8:
        raise ValueError("layout.dtype: fp8 storage is not served with context_parallel (the step's own keys "
                         "are attended from the given k / v, the single-process pool reads them back quantized)")
    bs = _check_int("block_size", block_size, 1)
    blocks = policy.max_bytes // layout.block_bytes(bs)
    return dataclasses.replace(policy, max_bytes=-(-blocks // cp.world_size) * layout.block_bytes(bs))


def check_cp_spec(spec, where: str) -> None:
    """Raise for what a spec asks that context parallel does not serve."""
    for name in _REFUSED:
        if getattr(spec, name) not in (None, 0):
            raise ValueError(f"{where}.{name}: not served with context_parallel (the mask needs each key's "
                             "global position; each rank holds every N-th block)")
    if spec.rope_mode:
        raise ValueError(f"{where}.rope_cos: RoPE on read is not served with context_parallel")
    if not spec.causal:
        raise ValueError(f"{where}.causal: the paged pool is causal")


class DecodeContextParallel(PoolSteps):
    """The steps of a rank's pool under decode context parallel (``cp.mode == "tokens"``).

    Not served (ValueError naming the argument, at construction or call): sliding windows /
    sink tokens / block-causal chunks / learned sink logits / RoPE on read (their masks need
    global key positions), ``graph_capacity``, ``pad_to`` plans, ``allocate``, and
    autograd (decode context parallel is inference-only).
    """

    def __init__(self, pool, cp) -> None:
        specs = tuple(pool.attention_spec(i) for i in range(pool.layout.num_layers))
        for i, spec in enumerate(specs):
            check_cp_spec(spec, f"attention[{i}]")
        super().__init__(pool)
        self.context_parallel = cp
        self._glen: dict[Hashable, int] = {}
        self._first: dict[Hashable, int] = {}  # namespace -> the rank holding its block 0
        self._made = 0  # namespaces created (the next one's first rank, modulo N)
        # The history's spec of each layer: no mask (every key is older than the step).
        self._hist_specs = tuple(s.with_lse.replace(causal=False) for s in specs)

    def _owned(self, a: int, b: int, first: int) -> int:
        """Tokens in ``[a, b)`` of a sequence whose block 0 is on rank ``first`` that this
        rank stores (blocks ``(j + first) % N == rank``). O(blocks in the range)."""
        cp = self.context_parallel
        bs, n, r = self.pool.block_size, cp.world_size, cp.rank
        out = 0
        for j in range(a // bs, cdiv(b, bs)):
            if (j + first) % n == r:
                out += min(b, (j + 1) * bs) - max(a, j * bs)
        return out

    # ------------------------------------------------------------------ namespace hooks
    def seq_len(self, namespace: Hashable) -> int:
        self.pool._get(namespace)
        return self._glen[namespace]

    def forget(self, namespace: Hashable) -> None:
        self._glen.pop(namespace, None)
        self._first.pop(namespace, None)

    def forked(self, src: Hashable, dst: Hashable) -> None:
        self._glen[dst] = self._glen[src]
        self._first[dst] = self._first[src]  # the same blocks on the same ranks

    def check_truncate(self, namespace: Hashable, n_tokens: int) -> None:
        self.pool._get(namespace)
        if not is_int(n_tokens):
            raise TypeError(f"n_tokens: expected an int, got {n_tokens!r}")
        if not 0 <= n_tokens <= self._glen[namespace]:
            raise ValueError(f"n_tokens: expected 0 <= n_tokens <= seq_len ({self._glen[namespace]}), got "
                             f"{n_tokens}")

    def truncate(self, namespace: Hashable, n_tokens: int) -> None:
        self.check_truncate(namespace, n_tokens)
        truncate_blocks(self.pool, namespace, self._owned(0, n_tokens, self._first[namespace]))
        self._glen[namespace] = n_tokens

    def check_allocate(self) -> None:
        raise ValueError("allocate: not served with context_parallel (plan the tokens instead)")

    # ------------------------------------------------------------------ plan
    def _firsts(self, items) -> list[int]:
        """Each row's first rank (a new namespace's block 0 goes to the next rank in turn);
        changes nothing."""
        made, firsts = self._made, []
        for ns, _n in items:
            if ns in self._first:
                firsts.append(self._first[ns])
            else:
                firsts.append(made % self.context_parallel.world_size)
                made += 1
        return firsts

    def plan(self, batch, graph: bool, pad_to: int | None) -> PagedMetadata:
        """Every rank calls it with the same batch (one all-reduce of a flag: a step that does
        not fit on some rank is a CacheFullError on all of them). The metadata's rows are
        the step's replicated rows: ``slot_mapping`` -1 where another rank stores the
        token, ``block_table`` / ``seq_lens`` this rank's blocks of the history."""
        items = _check_batch(batch, graph, pad_to)
        pool, cp = self.pool, self.context_parallel
        with pool._lock:
            olds = [self._glen.get(ns, 0) for ns, _n in items]
            firsts = self._firsts(items)
            made = self._made + sum(1 for ns, _n in items if ns not in self._first)
            local = {ns: self._owned(old, old + n, f) for (ns, n), old, f in zip(items, olds, firsts)}
            # The history this rank holds: its pool's own length (no walk over the history).
            hist = [pool._seqs[ns].seq_len if ns in pool._seqs else 0 for ns, _n in items]
            owned = [(ns, m) for ns, m in local.items() if m]
            # Ranks hold different blocks, so one can be full while the others are not:
            # agree first (one tiny all-reduce per step), or the others would go on into the
            # layer's collectives alone.
            needs = pool._windows.count(owned, pool._seqs, pool.allocator) if owned else None
            need, available = (needs.need, needs.available) if needs else (0, 0)
            if not cp.all_fit(need <= available, pool.device):
                raise CacheFullError(f"plan: rank {cp.rank} needs {need} blocks and has {available} free "
                                     f"(block_size {pool.block_size} tokens, {pool.block_bytes} bytes a block, "
                                     f"budget {pool.policy.max_bytes} bytes); some rank of the group cannot take "
                                     "this step (nothing changed on any rank)")
            if owned:
                reserve(pool, *zip(*owned))  # all-or-nothing
            for ns, _n in items:
                if ns not in pool._seqs:  # a rank with no block of it yet: an empty local sequence
                    pool._seqs[ns] = pool._table.new_seq()
            version = pool._stamp()  # one stamp for the step
            for (ns, n), old, f in zip(items, olds, firsts):
                self._glen[ns] = old + n
                self._first[ns] = f
                pool._seqs[ns].version = version
            self._made = made
            return self._meta(items, olds, hist, firsts)

    def _meta(self, items, olds, hist, firsts) -> PagedMetadata:
        pool, cp = self.pool, self.context_parallel
        bs, n_ranks, rank = pool.block_size, cp.world_size, cp.rank
        seqs = [pool._seqs[ns] for ns, _n in items]
        nseq = len(items)
        cu = [0]
        for _ns, n in items:
            cu.append(cu[-1] + n)
        total_q, max_q = cu[-1], max(n for _ns, n in items)
        # [B, cols]: this rank's blocks of each row (the pool's public block table, a fork's
        # queued entries written first), every column a step's slot can name
        table = pool.block_table([ns for ns, _n in items])
        cols = table.shape[1]
        # Per row: the first global block this rank holds ((rank - first) mod N).
        mine0 = [(rank - f) % n_ranks for f in firsts]
        packed = upload(hist + olds + mine0 + cu, torch.int32, pool.device)
        hist_t, olds_t, mine0_t = (packed[i * nseq:(i + 1) * nseq] for i in range(3))
        cu_t = packed[3 * nseq:]
        dev = pool.device
        q_lens = cu_t[1:] - cu_t[:-1]
        row_of = torch.repeat_interleave(torch.arange(nseq, device=dev), q_lens, output_size=total_q)
        i = torch.arange(total_q, device=dev)
        pos = i - cu_t[:-1].long()[row_of] + olds_t.long()[row_of]  # global position of each row
        blk = pos // bs
        off = blk - mine0_t.long()[row_of]  # blocks past this rank's first one
        mine = (off >= 0) & (off % n_ranks == 0)
        lcol = (off // n_ranks).clamp(min=0, max=cols - 1)
        slots = torch.where(mine, table.long()[row_of, lcol] * bs + pos % bs, torch.full_like(pos, -1))
        # The step's own keys: row b's are rows cu[b] .. of the given k/v, one-token pages.
        j = torch.arange(max_q, device=dev)[None, :]
        own = (cu_t[:-1].long()[:, None] + j).clamp(max=max(total_q - 1, 0)).to(torch.int32)  # [B, max_q]
        slots = slots.to(pool._slot_dtype)
        max_k = max(max(hist), 1)
        return PagedMetadata(
            slot_mapping=slots, block_table=table, slot_mappings=(slots,), block_tables=(table,), seq_lens=hist_t,
            cu_seqlens_q=cu_t, max_seqlen_q=max_q, max_seqlen_k=max_k, total_q=total_q, num_seqs=nseq,
            namespaces=tuple(ns for ns, _n in items), num_tokens=total_q,
            keys=(KeySet(table, hist_t, max_k),), rows=QueryRows(cu_t, max_q),
            _owner=pool._cache_id, _versions=tuple(s.version for s in seqs), _epoch=pool._epoch,
            own_keys=KeySet(own, q_lens, max_q),
        )

    # ------------------------------------------------------------------ forward (the template's steps)
    def check_forward(self, batch, q, k, v, layer, pad_to: int | None, options: dict) -> None:
        """:meth:`PagedKVCache.check_forward` under context parallel (changes nothing)."""
        items = _check_batch(batch, False, pad_to)
        self._check_call(q, k, v, layer, options, sum(n for _ns, n in items))

    def check(self, q, k, v, meta: PagedMetadata, layer, options: dict, commit: bool = True) -> CallCheck:
        self.pool._require_current(meta)
        if meta.own_keys is None:
            raise ValueError("meta: not planned by a context-parallel PagedKVCache")
        return self._check_call(q, k, v, layer, options, meta.total_q)

    def _check_call(self, q, k, v, layer, options: dict, total_q: int) -> CallCheck:
        pool = self.pool
        layer = pool._check_layer(layer)
        spec = pool._call_spec(layer, options)
        if options:
            check_cp_spec(spec, "forward")
        h_q = pool._check_qkv(q, k, v, (total_q,), "[total_q, H, D] (replicated)", layer)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise ValueError("q: decode context parallel is inference-only; run under torch.no_grad()")
        return CallCheck(layer, spec, 0, h_q, pool._route(spec, q, k, v))

    def store(self, k, v, meta: PagedMetadata, call: CallCheck) -> None:
        """This rank's new tokens (the others' slots are -1)."""
        store(k, v, self.pool.region.op_views(call.layer), meta.slot_mapping, call.route.store)

    def attend(self, q, k, v, meta: PagedMetadata, call: CallCheck, commit: bool = True):
        """Every query over this rank's history blocks and over the step's own keys, then the
        ranks' partials merged: the same output on every rank."""
        cp, spec, layer, r = self.context_parallel, call.spec, call.layer, call.route
        hist_spec = self._hist_specs[layer] if spec is self.pool.attention_spec(layer) else \
            spec.with_lse.replace(causal=False)
        hist = attend(q, self.pool.region.op_views(layer), meta.keys[0], meta.rows, spec=hist_spec, route=r)
        h_kv, d = k.shape[1], k.shape[2]
        own = attend(q, CacheView(k.view(-1, 1, h_kv, d), v.view(-1, 1, h_kv, d)), meta.own_keys, meta.rows,
                     spec=spec.with_lse, route=r)
        outs, lses = cp.all_gather(hist[0], layer), cp.all_gather(hist[1], layer)  # [N, total_q, ...]
        # own keys, then rank 0 .. N-1: the same bits on every rank
        out, lse = merge_partials([own, *zip(outs, lses)], r.backend)
        return (out, lse) if spec.return_lse else out


def _check_batch(batch, graph, pad_to) -> list:
    """The ``(namespace, n_new_tokens)`` of a context-parallel plan's batch, checked."""
    check_bool("graph", graph)
    if graph or pad_to is not None:
        raise ValueError(f"{'graph' if graph else 'pad_to'}: not served with context_parallel")
    if not isinstance(batch, Mapping) or not batch:
        raise TypeError(f"batch: expected a non-empty mapping of namespace -> n_new_tokens, got {batch!r}")
    return [(ns, _check_int(f"batch[{ns!r}]", n, 1)) for ns, n in batch.items()]
