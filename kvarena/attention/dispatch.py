"""Trusted dispatch: what the pools (and the public ops, once validated) call per layer.

:func:`attend` is the one attention entry: it takes the typed step metadata of
:mod:`kvarena.attention.batch` and the call's :class:`~kvarena.attention.route.Route`
(decided once, before anything ran, by :func:`~kvarena.attention.route.route`), and runs
it: the path, and for the step's own keys after a history one launch or
:func:`~kvarena.attention.launch.merged_with_own`.

Arguments are trusted: the options arrive as an ``AttentionSpec`` (validated when it was
made), the metadata from a pool's ``plan``. Tensors are flattened only at the
``torch.library`` boundary (:mod:`kvarena.attention.library`, whose schemas take plain
tensors) and at the kernel launchers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvarena.attention import library, torch_path  # noqa: F401  (library registers torch.ops.kvarena)
from kvarena.attention.backend import needs_grad
from kvarena.attention.batch import CacheView, KeySet, OwnKeys, QueryRows
from kvarena.attention.fp8 import as_bytes, from_bytes
from kvarena.attention.launch import (
    launch_triton,
    merge_impl,
    merged_with_own,
    new_outputs,
    run_attention,
    store_impl,
)
from kvarena.attention.plans import takes_own_keys
from kvarena.attention.route import Own, Path, Route, path_of, route
from kvarena.attention.spec import AttentionSpec
from kvarena.kernels.placement import OWN_AFTER_HISTORY, OWN_AT_QUERIES

__all__ = ["attend", "route_call", "store", "merge", "merge_partials"]


def _viewed(cache: CacheView) -> CacheView:
    """fp8 bytes and scales (an arena's uint8 views) as float8 / fp32 for an eager call."""
    if cache.scales is None or torch.compiler.is_compiling():
        return cache
    k, v, scales = from_bytes(cache.k, cache.v, *cache.scales)
    return CacheView(k, v, scales)


def own_of(own: OwnKeys | None) -> Own:
    """Where ``own`` sits, as the route names it."""
    if own is None:
        return Own.NONE
    if own.keys is None:
        return Own.AT_QUERIES
    return Own.AFTER_PAGED if own.paged else Own.AFTER


def route_call(q, cache: CacheView, keys: KeySet, rows: QueryRows, spec: AttentionSpec, backend: str,
               own: OwnKeys | None = None) -> Route:
    """The route of an :func:`attend` call made with a (resolved or requested) ``backend``
    name, read off its tensors: what a caller that has no route yet passes through."""
    place = own_of(own)
    own_k, own_v = (own.k, own.v) if own is not None else (None, None)
    takes = (lambda: takes_own_keys(q, cache, keys, rows, own, spec, lse=spec.return_lse)) if place is Own.AFTER \
        else False
    return route(backend, q.device, q.dtype, rope=bool(spec.rope_mode), q_grad=needs_grad(q),
                 kv_grad=needs_grad(own_k, own_v), cache_grad=needs_grad(cache.k, cache.v),
                 sink_grad=needs_grad(spec.sink_logits), own=place, takes_own=takes)


def attend(
    q: torch.Tensor,
    cache: CacheView,
    keys: KeySet,
    rows: QueryRows,
    *,
    spec: AttentionSpec,
    route: Route | None = None,
    backend: str | None = None,
    own: OwnKeys | None = None,
    out: torch.Tensor | None = None,
):
    """Attention of ``q [total_q, H_q, D]`` over ``keys`` of ``cache`` (and ``own``).

    ``own`` (see :class:`~kvarena.attention.batch.OwnKeys`): the query rows' own keys
    (gradients reach them), or the step's own keys after each sequence's history (one
    launch where the kernel takes them, else two partial attentions merged by LSE).
    ``route``: the call's :class:`~kvarena.attention.route.Route` (a pool's, made before its
    store); without one, ``backend`` (a resolved name) and :func:`route_call` make it.
    Returns ``out``, or ``(out, lse)`` with ``spec.return_lse``; written into ``out`` when given.
    """
    if route is None:
        route = route_call(q, cache, keys, rows, spec, backend, own)
    if own is not None and own.keys is not None:  # after the history
        res, lse = _history_and_own(q, cache, keys, rows, own, spec, route)
        if out is not None:
            out.copy_(res)
            res = out
        return (res, lse) if spec.return_lse else res
    cache = cache if cache.scales is None else _viewed(cache)
    return _attend_cache(q, cache, keys, rows, spec, route.path, route.backend, own, out)


def _attend_cache(q, cache: CacheView, keys: KeySet, rows: QueryRows, spec: AttentionSpec, path: Path, backend: str,
                  own: OwnKeys | None, out):
    """One source of keys: the cache (the query rows' own keys, if given, read from ``own``
    on the differentiable paths), on ``path``."""
    if path is Path.TRITON_EAGER:
        # Straight into the caller's ``out`` (no copy), no lse store unless asked for.
        result, lse = new_outputs(q, out, spec.return_lse)
        launch_triton(q, cache, keys, rows, result, lse, spec)
        return (result, lse) if spec.return_lse else result
    own_k, own_v = (own.k, own.v) if own is not None else (None, None)
    if path is Path.TRITON_TRAIN:
        result, lse = torch.ops.kvarena.attention_train(
            q, own_k, own_v, cache.k, cache.v, keys.block_table, keys.seq_lens, rows.cu_seqlens_q, keys.kv_start,
            rows.max_seqlen_q, keys.max_seqlen_k, OWN_AT_QUERIES, *spec.op_args(),
        )
    elif path is Path.TORCH_GRAD:
        result, lse = torch_path.paged_attention_torch(
            q, cache.k, cache.v, keys.block_table, keys.seq_lens, rows.cu_seqlens_q, keys.kv_start, spec=spec,
            max_seqlen_q=rows.max_seqlen_q, max_seqlen_k=keys.max_seqlen_k, own=own,
            rope_q_pos=rows.rope_q_pos, rope_k_shift=keys.rope_k_shift,
        )
    elif path is Path.COMPILED:
        result, lse = _compiled_attention(q, cache, keys, rows, spec, backend)
    else:
        result, lse = run_attention(q, cache, keys, rows, spec, backend)
    if out is not None:
        out.copy_(result)
        result = out
    return (result, lse) if spec.return_lse else result


def _compiled_attention(q, cache: CacheView, keys: KeySet, rows: QueryRows, spec: AttentionSpec, backend: str):
    """The opaque ``kvarena::paged_attention`` op (fp8 as uint8 views: see :func:`as_bytes`)."""
    ks, vs = cache.scales if cache.scales is not None else (None, None)
    fp8 = cache.scales is not None
    return torch.ops.kvarena.paged_attention(
        q, as_bytes(cache.k) if fp8 else cache.k, as_bytes(cache.v) if fp8 else cache.v, keys.block_table,
        keys.seq_lens, rows.cu_seqlens_q, keys.kv_start, as_bytes(ks), as_bytes(vs), rows.rope_q_pos,
        keys.rope_k_shift, rows.max_seqlen_q, keys.max_seqlen_k, *spec.replace(backend=backend).op_args(),
    )


def _history_and_own(q, cache: CacheView, keys: KeySet, rows: QueryRows, own: OwnKeys, spec: AttentionSpec,
                     route: Route) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(out, lse or None)`` over the cached history (``keys``) plus the step's own keys, as
    ``route`` says: the train op (whose forward asks the kernel itself), one eager launch,
    or :func:`merged_with_own`."""
    if route.path is Path.TRITON_TRAIN and not route.merge:
        # The Triton backward (dq, and dk/dv of the own keys); its forward takes one launch
        # or two and a merge (launch.history_and_own_forward).
        out, lse = torch.ops.kvarena.attention_train(
            q, own.k, own.v, cache.k, cache.v, keys.block_table, keys.seq_lens, rows.cu_seqlens_q,
            keys.kv_start, rows.max_seqlen_q, keys.max_seqlen_k, OWN_AFTER_HISTORY, *spec.op_args(),
        )
        return out, (lse if spec.return_lse else None)
    if not route.merge:
        out, lse = new_outputs(q, None, spec.return_lse)
        launch_triton(q, _viewed(cache), keys, rows, out, lse, spec, own=own)
        return out, lse
    backend = route.backend

    def part(q, cache: CacheView, keys: KeySet, rows: QueryRows, spec: AttentionSpec):
        path = path_of(backend, needs_grad(q, cache.k, cache.v, spec.sink_logits))
        return _attend_cache(q, cache, keys, rows, spec, path, backend, None, None)

    out, lse = merged_with_own(q, _viewed(cache), keys, rows, own, spec, part,
                               lambda *states: merge(*states, backend))
    return out, (lse if spec.return_lse else None)


def store(k, v, cache: CacheView, slot_mapping: torch.Tensor, backend: str) -> None:
    """Scatter ``k, v [N, H_kv, D]`` into ``cache`` at ``slot_mapping`` (validated arguments,
    resolved backend); stored detached."""
    ks, vs = cache.scales if cache.scales is not None else (None, None)
    k_cache, v_cache = cache.k, cache.v
    if torch.compiler.is_compiling():
        if cache.scales is not None:
            k_cache, v_cache, ks, vs = as_bytes(k_cache), as_bytes(v_cache), as_bytes(ks), as_bytes(vs)
        torch.ops.kvarena.store_kv(k.detach(), v.detach(), k_cache, v_cache, slot_mapping, backend, ks, vs)
    else:
        store_impl(k.detach(), v.detach(), k_cache, v_cache, slot_mapping, backend, ks, vs)


def merge(out_a, lse_a, out_b, lse_b, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two partial attentions (validated arguments, resolved backend)."""
    if backend == "torch" and needs_grad(out_a, lse_a, out_b, lse_b):
        return torch_path.merge_attention_states_torch(out_a, lse_a, out_b, lse_b)
    op = torch.ops.kvarena.merge_attention_states if torch.compiler.is_compiling() else merge_impl
    return op(out_a, lse_a, out_b, lse_b, backend)


def merge_partials(parts: Sequence[tuple[torch.Tensor, torch.Tensor]], backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold ``(out, lse)`` partials over disjoint key sets left to right (a fixed order: the
    same bits every run and on every rank)."""
    out, lse = parts[0]
    for o, s in parts[1:]:
        out, lse = merge(out, lse, o, s, backend)
    return out, lse
