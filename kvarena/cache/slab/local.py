"""The single-process steps of a slab pool: ``plan`` claims the step's slabs (all or
nothing, :mod:`~kvarena.cache.slab.claim`) and builds its metadata; ``forward`` follows the
pools' template (:class:`~kvarena.cache._pool.PoolSteps`): check, store the chunk's K/V
(a commit), attend over the step's key set (the visible slabs, or the history and the
given K/V of a denoising step). The context-parallel steps (:mod:`~kvarena.cache.slab.cp`)
wrap this forward.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from kvarena.argcheck import check_bool
from kvarena.attention.batch import CacheView, OwnKeys
from kvarena.attention.dispatch import attend, store
from kvarena.attention.fp8 import fp8_round_trip
from kvarena.attention.plans import takes_own_keys
from kvarena.attention.route import Own
from kvarena.attention.spec import AttentionSpec
from kvarena.cache._pool import CallCheck, PoolSteps
from kvarena.cache.slab.claim import reserve
from kvarena.cache.slab.meta import SlabKeys, SlabMetadata, build_meta

__all__ = ["ChunkSizes", "LocalSteps", "seam_of"]


@dataclass(frozen=True)
class ChunkSizes:
    """A rollout's chunk sizes as the model counts them: ``slab_tokens`` per chunk, chunk 0 of
    ``first_chunk_tokens`` (None: no chunk yet)."""

    slab_tokens: int
    first_chunk_tokens: int | None


def seam_of(meta: SlabMetadata, spec: AttentionSpec, layer: int) -> SlabKeys:
    """The plan's key sets for a layer's spec (its RoPE position mode, if any)."""
    if not spec.rope_mode:
        return meta.seam
    seam = meta.rope.of(spec.rope_positions)
    if seam.top_position >= spec.rope_cos.shape[0]:
        raise ValueError(f"rope_cos: this step reaches {spec.rope_positions} position {seam.top_position}, past "
                         f"the {spec.rope_cos.shape[0]}-row rotary table of layer {layer}")
    return seam


class LocalSteps(PoolSteps):
    """No context parallel (or one rank's share of it): the pool plans and attends on its own."""

    # ------------------------------------------------------------------ plan, chunk sizes
    def plan(self, batch) -> SlabMetadata:
        pool = self.pool
        with pool._lock:
            return build_meta(pool, reserve(pool, batch))

    def chunk_sizes(self, namespace: Hashable, r) -> ChunkSizes:
        return ChunkSizes(self.pool.slab_tokens, None if r is None else r.n0)

    def first_chunk_share(self, first_chunk_tokens: int | None) -> int | None:
        return first_chunk_tokens

    def forget(self, namespace: Hashable) -> None:
        """A cleared namespace (nothing held here)."""

    # ------------------------------------------------------------------ forward (the template's steps)
    def check_call(self, q, k, v, layer, commit, options: dict, lead: tuple[int, int],
                   q_tokens: int | None = None, own: Own | None = None, takes_own=None) -> CallCheck:
        """What the forward checks that needs no metadata, in its order: ``commit``, the
        layer, the per-call options, q/k/v (``lead = (B, T)``; q has ``q_tokens`` rows, default
        T) and the route (``own``: where the given k/v sit, None: as a one-chunk step's;
        ``takes_own(layer, op_spec)``: the kernel's answer for them, None: no). Changes
        nothing. The call's spec is the one the op runs with (non-causal: the key sets list
        only what a chunk sees)."""
        pool = self.pool
        check_bool("commit", commit)
        layer = pool._check_layer(layer)
        spec = pool._call_spec(layer, options)
        h_q = pool._check_qkv(q, k, v, lead, "[B, T, H, D]", q_lead=(lead[0], q_tokens or lead[1]))
        op_spec = pool._attend_spec(spec) if options else pool._op_specs[layer]
        if own is None:
            own = Own.NONE if commit else Own.AFTER
        asked = (lambda: takes_own(layer, op_spec)) if takes_own is not None else False
        return self.call_check(layer, op_spec, 0, h_q, pool._route(spec, q, k, v, own, asked), options)

    def check(self, q, k, v, meta: SlabMetadata, layer, options: dict, commit: bool = True) -> CallCheck:
        pool = self.pool
        pool._require_arena("forward")
        pool._require_current(meta)
        b, t = meta.num_seqs, meta.n_tokens
        tq = meta.q_tokens or t  # query rows (the whole chunk under context parallel tokens mode)
        # A multi-chunk step reads the run's tokens through pages (each chunk sees part of
        # the others): under autograd, gradients to a cache tensor, the torch path's (the
        # route's Own.AFTER_PAGED rule).
        own = Own.AFTER_PAGED if meta.num_chunks != b else (Own.NONE if commit else Own.AFTER)
        call = self.check_call(q, k, v, layer, commit, options, (b, t), tq, own,
                               lambda layer, op_spec: self._takes_own(q, k, meta, layer, op_spec))
        if call.layer not in meta._committed_at:
            pool._check_committed(meta._history, call.layer)
            meta._committed_at.add(call.layer)
        if call.spec.rope_mode:
            seam_of(meta, call.spec, call.layer)  # a step past the rotary table: refused before any write
        return call

    def _takes_own(self, q, k, meta: SlabMetadata, layer: int, op_spec: AttentionSpec) -> bool:
        """Whether one launch takes a one-chunk denoising step's history and given k/v
        (:func:`~kvarena.attention.plans.takes_own_keys`: it plans into the step's memo, where
        :meth:`attend`'s launch then reads the plan)."""
        seam = seam_of(meta, op_spec, layer)
        pages = self.pool._pages_of(layer, meta.page_tokens)
        qf = q.reshape(-1, q.shape[-2], q.shape[-1])
        return takes_own_keys(qf, pages, seam.history, seam.rows, OwnKeys(k, k), op_spec, lse=op_spec.return_lse)

    def store(self, k, v, meta: SlabMetadata, call: CallCheck) -> None:
        """The chunk's clean K/V into its slabs, and the chunks marked committed at the layer."""
        lay = self.pool.layout
        n = meta.num_seqs * meta.n_tokens
        kf, vf = k.reshape(n, lay.num_kv_heads, lay.head_dim), v.reshape(n, lay.num_kv_heads, lay.head_dim)
        store(kf, vf, self.pool.region.op_views(call.layer), meta.slot_mapping, call.route.store)
        for ch in meta._current:  # host-only bookkeeping: single stores, no lock, traceable
            ch.committed[call.layer] = True

    def attend(self, q, k, v, meta: SlabMetadata, call: CallCheck, commit: bool = True):
        pool, layer, spec = self.pool, call.layer, call.spec
        b, t = meta.num_seqs, meta.n_tokens
        tq = meta.q_tokens or t
        h_kv, d = pool.layout.num_kv_heads, pool.layout.head_dim
        seam = seam_of(meta, spec, layer)
        pages = pool._pages_of(layer, meta.page_tokens)
        qf = q.reshape(b * tq, call.h_q, d)
        multi = meta.num_chunks != b
        r = call.route
        if commit and not (multi and r.kv_grad):
            own = OwnKeys(k.reshape(b * t, h_kv, d), v.reshape(b * t, h_kv, d)) if r.kv_grad else None
            res = attend(qf, pages, seam.keys, seam.rows, spec=spec, route=r, own=own)
        else:
            # The history before the run from the arena, the run's own tokens from k, v.
            own = self._own_keys(k, v, pool.region.op_views(layer), meta, seam, multi)
            res = attend(qf, pages, seam.history, seam.rows, spec=spec, route=r, own=own)
        if not spec.return_lse:
            return res.reshape(b, tq, call.h_q, d)
        out, lse = res
        return out.reshape(b, tq, call.h_q, d), lse.reshape(b, tq, call.h_q)

    def _own_keys(self, k, v, store_cache: CacheView, meta: SlabMetadata, seam: SlabKeys, multi: bool) -> OwnKeys:
        """The run's own keys as a denoising step attends them."""
        lay = self.pool.layout
        kd = k if k.stride(-1) == 1 else k.contiguous()
        vd = v if v.stride(-1) == 1 else v.contiguous()
        if lay.is_fp8:
            # What a commit would store and read back: the denoising step attends exactly
            # what the clean pass will (the store's rule: per-row or the layer's static scales).
            static = store_cache.scales if store_cache.scales[0].dim() == 0 else (None, None)
            kd, vd = fp8_round_trip(kd, static[0]), fp8_round_trip(vd, static[1])
        if multi:
            g = meta.own_page_tokens
            n = meta.num_seqs * meta.n_tokens // g
            kd, vd = kd.reshape(n, g, lay.num_kv_heads, lay.head_dim), vd.reshape(n, g, lay.num_kv_heads, lay.head_dim)
        return OwnKeys(kd, vd, seam.own, paged=multi)
