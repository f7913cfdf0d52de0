"""Context parallel for a slab pool, as the steps the pool holds from construction.

:class:`~kvarena.cache.slab.local.LocalSteps` (one process, or heads mode on one rank),
:class:`HeadsSteps` (Ulysses: every rank stores and attends its ``H_kv / N`` heads) and
:class:`TokensSteps` (every rank stores its rows of each chunk; queries all-gathered,
partial attentions merged by LSE in rank order). Each plans a step, sizes chunks for
:meth:`~kvarena.cache.slab.SlabKVCache.chunks_for_tokens` and runs a layer's forward; the
two context-parallel ones wrap the local forward (reshaping or gathering around it,
merging after it), never a private method of the pool.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from functools import partial

import torch

from kvarena.argcheck import check_bool, is_int
from kvarena.attention.backend import resolve_backend
from kvarena.attention.dispatch import merge_partials
from kvarena.cache._meta import check_forward_tensor
from kvarena.cache._pool import layer_specs
from kvarena.cache.arena import KVLayout, _check_int
from kvarena.cache.slab.claim import reserve
from kvarena.cache.slab.local import ChunkSizes, LocalSteps
from kvarena.cache.slab.meta import SlabMetadata, build_meta

__all__ = ["HeadsSteps", "ParallelShare", "TokensSteps", "parallel_share"]


def _rank_checks(pool, meta, layer, commit, options):
    """What a rank can refuse on its own, before its first collective (the other ranks
    would wait in it): metadata, ``commit``, ``layer`` and the per-call options."""
    pool._require_current(meta)
    check_bool("commit", commit)
    layer = pool._check_layer(layer)
    return layer, pool._call_spec(layer, options)


class HeadsSteps(LocalSteps):
    """Context parallel, heads mode: this rank's rows -> its heads of every row, the local
    steps, and back."""

    def __init__(self, pool, cp) -> None:
        super().__init__(pool)
        self.cp = self.context_parallel = cp

    def forward(self, q, k, v, meta, layer, options: dict, commit: bool = True):
        """Everything a rank can refuse on its own is checked before the first collective
        (the others would wait in it)."""
        cp, pool = self.cp, self.pool
        n = cp.world_size
        layer, spec = _rank_checks(pool, meta, layer, commit, options)
        b, t = meta.num_seqs, meta.n_tokens
        t_r = cp.split_sizes(t)[cp.rank]
        lay = pool.layout
        if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[2] % (lay.num_kv_heads * n):
            got = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
            raise ValueError(f"q: expected this rank's [B, T_r, H_q, D] shard with H_q a multiple of the world size "
                             f"{n} and of num_kv_heads {lay.num_kv_heads * n}, got {got}")
        kv_shape = (b, t_r, lay.num_kv_heads * n, lay.head_dim)
        for name, x in (("q", q), ("k", k), ("v", v)):
            shape = (b, t_r, q.shape[2], lay.head_dim) if name == "q" else kv_shape
            check_forward_tensor(name, x, shape, lay.input_dtype, pool.device,
                                 f"rank {cp.rank}'s {t_r} of the step's {t} rows, [B, T_r, H, D]")
        qh, kh, vh = (cp.to_heads(x, t, layer) for x in (q, k, v))  # [B, T, H / N, D]
        res = super().forward(qh, kh, vh, meta, layer, options, commit)
        if spec.return_lse:
            return cp.to_tokens(res[0], layer), cp.to_tokens(res[1], layer)
        return cp.to_tokens(res, layer)


class TokensSteps(LocalSteps):
    """Context parallel, tokens mode: the rank stores its rows of each chunk (of
    ``slab_tokens`` rows, whole-chunk sinks / window) and attends every query."""

    def __init__(self, pool, cp, slab_tokens: int) -> None:
        super().__init__(pool)
        self.cp = self.context_parallel = cp
        self.slab_tokens = slab_tokens
        self.first_chunk: dict = {}  # namespace -> chunk 0's tokens (the whole chunk's)

    def chunk_sizes(self, namespace: Hashable, r) -> ChunkSizes:
        # the chunks' own sizes, not the rank's share
        st = self.slab_tokens
        return ChunkSizes(st, None if r is None else self.first_chunk.get(namespace, st))

    def first_chunk_share(self, first_chunk_tokens: int | None) -> int | None:
        if first_chunk_tokens is None:
            return None
        # Whole-chunk visibility: the rank's share of chunk 0 holds the same slabs.
        n0 = _check_int("first_chunk_tokens", first_chunk_tokens, self.cp.world_size)
        if n0 > self.slab_tokens:
            raise ValueError(f"first_chunk_tokens: expected {self.cp.world_size} to slab_tokens ({self.slab_tokens}), "
                             f"got {n0}")
        return self.cp.split_sizes(n0)[self.cp.rank]

    def forget(self, namespace: Hashable) -> None:
        self.first_chunk.pop(namespace, None)

    def _chunk_tokens(self, ns, c, n) -> int:
        """The tokens of chunk ``c`` (``n`` given or None), checked as the rank's plan would
        check its share: two different lengths can share a rank's share, and the ranks must agree."""
        cp, st = self.cp, self.slab_tokens
        if isinstance(c, range):
            raise ValueError(f"batch[{ns!r}]: a run of chunks in one step is not served by context parallel "
                             "tokens mode (plan its chunks one by one, or use heads mode)")
        if n is not None and (not is_int(n) or n < cp.world_size):
            raise ValueError(f"batch[{ns!r}]: tokens mode needs at least one row of the chunk per rank: "
                             f"n_tokens >= the world size {cp.world_size}, got {n!r}")
        if n is not None and n > st:
            raise ValueError(f"batch[{ns!r}]: a chunk of {n} tokens is longer than a slab ({st})")
        if n is not None and c != 0 and n != st:
            raise ValueError(f"batch[{ns!r}]: only chunk 0 may be shorter than slab_tokens ({st}), "
                             f"chunk {c} has {n}")
        if n is not None and c == 0 and ns in self.first_chunk and n != self.first_chunk[ns]:
            raise ValueError(f"batch[{ns!r}]: chunk 0 was planned with {self.first_chunk[ns]} tokens, not {n}")
        if n is not None:
            return n
        if c == 0:  # a known chunk 0 keeps its length; a new one is a whole slab
            return self.first_chunk.get(ns, st)
        return st

    def plan(self, batch) -> SlabMetadata:
        """Plan the rank's rows of each chunk, with query rows for the whole chunk (every rank
        attends all queries over its keys)."""
        cp, pool = self.cp, self.pool
        if not isinstance(batch, Mapping) or not batch:
            raise TypeError(f"batch: expected a non-empty mapping of namespace -> chunk, got {batch!r}")
        with pool._lock:
            local, sizes, new_n0 = {}, set(), {}
            for ns, item in batch.items():
                c, n = item if isinstance(item, tuple) and len(item) == 2 else (item, None)
                t = self._chunk_tokens(ns, c, n)
                if c == 0 and ns not in pool._rollouts:
                    new_n0[ns] = t
                sizes.add(t)
                local[ns] = c if n is None else (c, cp.split_sizes(n)[cp.rank])
            if len(sizes) > 1:
                raise ValueError(f"batch: every rollout of one plan must have the same number of tokens, got "
                                 f"{sorted(sizes)}")
            meta = build_meta(pool, reserve(pool, local), q_tokens=sizes.pop())
            self.first_chunk.update(new_n0)
        return meta

    def forward(self, q, k, v, meta, layer, options: dict, commit: bool = True):
        """Every rank attends the whole chunk's queries over its rows of the visible chunks;
        the partial (out, lse) of each rank's rows come back to it and merge in rank order
        (bitwise repeatable)."""
        cp, pool = self.cp, self.pool
        layer, spec = _rank_checks(pool, meta, layer, commit, options)
        b, t_r, t = meta.num_seqs, meta.n_tokens, meta.q_tokens
        pool._check_qkv(q, k, v, (b, t_r), f"rank {cp.rank}'s {t_r} of the chunk's {t} rows, [B, T_r, H, D]", layer)
        q_all = cp.gather_rows(q, t, layer)  # [B, T, H_q, D]
        out, lse = super().forward(q_all, k, v, meta, layer, {**options, "return_lse": True}, commit)
        outs, lses = cp.scatter_rows(out, layer), cp.scatter_rows(lse, layer)  # [N, B, T_r, H_q(, D)]
        h, d = out.shape[2], out.shape[3]
        backend = resolve_backend(spec.backend, pool.device, out.dtype, torch.is_grad_enabled() and out.requires_grad)
        parts = [(outs[i].reshape(b * t_r, h, d), lses[i].reshape(b * t_r, h)) for i in range(cp.world_size)]
        acc_o, acc_l = merge_partials(parts, backend)  # fixed rank order: the same bits every run
        out = acc_o.reshape(b, t_r, h, d)
        return (out, acc_l.reshape(b, t_r, h)) if spec.return_lse else out


@dataclass(frozen=True)
class ParallelShare:
    """What a rank holds under context parallel: its steps (made with the pool), policy,
    layout and slab size."""

    steps: Callable[[object], LocalSteps]
    policy: object
    layout: KVLayout | None
    slab_tokens: int | None


def parallel_share(cp, policy, layout, arena, slab_tokens, attention) -> ParallelShare:
    """This rank's share under ``cp`` (None: the whole pool, :class:`LocalSteps`).

    Heads mode: ``H_kv / N`` heads in ``max_bytes / N``; tokens mode: the rank's rows of
    every chunk in slabs of ``split_sizes(slab_tokens)[rank]`` rows, as many slabs as the
    whole budget holds whole chunks. Either way a budget sized for one process fits the
    sharded rollout.
    """
    if cp is None:
        return ParallelShare(LocalSteps, policy, layout, slab_tokens)
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
    if cp.mode == "tokens":
        return _tokens_share(cp, policy, layout, slab_tokens, attention)
    n = cp.world_size
    bb = int(getattr(policy, "block_bytes", 0))
    if layout.num_kv_heads % n:
        raise ValueError(f"num_kv_heads: heads mode splits the layout's {layout.num_kv_heads} kv heads over "
                         f"{n} ranks; the world size must divide it")
    local = dataclasses.replace(layout, num_kv_heads=layout.num_kv_heads // n)
    return ParallelShare(partial(HeadsSteps, cp=cp) if n > 1 else LocalSteps,
                         dataclasses.replace(policy, max_bytes=policy.max_bytes // n, block_bytes=bb // n),
                         local, slab_tokens)


def _tokens_share(cp, policy, layout: KVLayout, slab_tokens, attention) -> ParallelShare:
    n = cp.world_size
    bb = int(getattr(policy, "block_bytes", 0))
    per = dict(policy.per_component)
    if "sink_tokens" in per or "window_tokens" in per:
        raise ValueError("context_parallel.mode: 'tokens' shards every chunk's rows over the ranks, which "
                         "needs whole-chunk visibility (per_component sinks / window); token-granular "
                         "sink_tokens / window_tokens take heads mode")
    st = slab_tokens if slab_tokens is not None else per.get("slab_tokens")
    if st is None or not is_int(st) or st < n:
        raise ValueError(f"slab_tokens: tokens mode gives every rank a share of each chunk; expected an int >= "
                         f"the world size {n}, got {st!r}")
    local_st = cp.split_sizes(st)[cp.rank]
    if any(spec.rope_cos is not None for spec in (layer_specs(attention, layout.num_layers) or ())):
        raise ValueError("rope_cos: RoPE on read is not served in context parallel tokens mode (a rank's rows "
                         "would rotate at their positions in its share); heads mode serves it")
    slabs = policy.max_bytes // (bb or layout.block_bytes(st))
    per.pop("slab_tokens", None)
    local = dataclasses.replace(policy, max_bytes=slabs * layout.block_bytes(local_st), block_bytes=0,
                                per_component=per)
    return ParallelShare(partial(TokensSteps, cp=cp, slab_tokens=st), local, layout, local_st)

