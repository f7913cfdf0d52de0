"""Trusted dispatch: what the pools (and the public ops, once validated) call per layer.

:func:`attend` is the one attention entry: it takes the typed step metadata of
:mod:`kvarena.attention.batch` and decides, each in one function,

* which path runs (:func:`_path`: the Triton forward + backward op, the differentiable
  torch path, an eager Triton launch, or the opaque op under torch.compile), and
* whether the history and the step's own keys go in one launch or two merged by LSE
  (:func:`_one_launch`).

Arguments are trusted: the options arrive as an ``AttentionSpec`` (validated when it was
made), the metadata from a pool's ``plan`` and the backend from
:func:`kvarena.attention.backend.resolve_backend`. Tensors are flattened only at the
``torch.library`` boundary (:mod:`kvarena.attention.library`, whose schemas take plain
tensors) and at the kernel launchers.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

import torch

from kvarena.attention import library, torch_path  # noqa: F401  (library registers torch.ops.kvarena)
from kvarena.attention.backend import needs_grad
from kvarena.attention.batch import CacheView, KeySet, OwnKeys, QueryRows
from kvarena.attention.fp8 import as_bytes, from_bytes
from kvarena.attention.launch import (
    launch_triton,
    merge_impl,
    new_outputs,
    run_attention,
    store_impl,
    takes_own,
)
from kvarena.attention.spec import AttentionSpec
from kvarena.kernels.placement import OWN_AFTER_HISTORY, OWN_AT_QUERIES

__all__ = ["attend", "store", "merge", "merge_partials"]


class _Path(Enum):
    TRITON_TRAIN = "the Triton forward and backward (one custom op with an autograd formula)"
    TORCH_GRAD = "the differentiable torch path (plain torch ops autograd and dynamo trace through)"
    TRITON_EAGER = "an eager Triton launch straight into the caller's out"
    COMPILED = "the opaque custom op under torch.compile"
    BODY = "the op's body called directly (eager, no dispatch cost)"


def _path(backend: str, grad: bool) -> _Path:
    """The one place that decides which path runs a call (``backend`` already resolved)."""
    if grad:
        return _Path.TRITON_TRAIN if backend == "triton" else _Path.TORCH_GRAD
    if torch.compiler.is_compiling():
        return _Path.COMPILED
    return _Path.TRITON_EAGER if backend == "triton" else _Path.BODY


def _viewed(cache: CacheView) -> CacheView:
    """fp8 bytes and scales (an arena's uint8 views) as float8 / fp32 for an eager call."""
    if cache.scales is None or torch.compiler.is_compiling():
        return cache
    k, v, scales = from_bytes(cache.k, cache.v, *cache.scales)
    return CacheView(k, v, scales)


def attend(
    q: torch.Tensor,
    cache: CacheView,
    keys: KeySet,
    rows: QueryRows,
    *,
    spec: AttentionSpec,
    backend: str,
    own: OwnKeys | None = None,
    out: torch.Tensor | None = None,
):
    """Attention of ``q [total_q, H_q, D]`` over ``keys`` of ``cache`` (and ``own``).

    ``own`` (see :class:`~kvarena.attention.batch.OwnKeys`): the query rows' own keys
    (gradients reach them), or the step's own keys after each sequence's history (one
    launch where the kernel takes them, else two partial attentions merged by LSE).
    ``backend`` is :func:`~kvarena.attention.backend.resolve_backend`'s answer. Returns
    ``out``, or ``(out, lse)`` with ``spec.return_lse``; written into ``out`` when given.
    """
    if own is not None and own.keys is not None:  # after the history
        res, lse = _history_and_own(q, cache, keys, rows, own, spec, backend)
        if out is not None:
            out.copy_(res)
            res = out
        return (res, lse) if spec.return_lse else res
    return _attend_cache(q, cache if cache.scales is None else _viewed(cache), keys, rows, spec, backend, own, out)


def _attend_cache(q, cache: CacheView, keys: KeySet, rows: QueryRows, spec: AttentionSpec, backend: str,
                  own: OwnKeys | None, out):
    """One source of keys: the cache (the query rows' own keys, if given, read from ``own``
    on the differentiable paths)."""
    own_k, own_v = (own.k, own.v) if own is not None else (None, None)
    grad = torch.is_grad_enabled() and needs_grad(q, cache.k, cache.v, own_k, own_v, spec.sink_logits)
    path = _path(backend, grad)
    if path is _Path.TRITON_EAGER:
        # Straight into the caller's ``out`` (no copy), no lse store unless asked for.
        result, lse = new_outputs(q, out, spec.return_lse)
        launch_triton(q, cache, keys, rows, result, lse, spec)
        return (result, lse) if spec.return_lse else result
    if path is _Path.TRITON_TRAIN:
        _refuse_triton_grad(cache, spec)
        result, lse = torch.ops.kvarena.attention_train(
            q, own_k, own_v, cache.k, cache.v, keys.block_table, keys.seq_lens, rows.cu_seqlens_q, keys.kv_start,
            rows.max_seqlen_q, keys.max_seqlen_k, OWN_AT_QUERIES, *spec.op_args(),
        )
    elif path is _Path.TORCH_GRAD:
        result, lse = torch_path.paged_attention_torch(
            q, cache.k, cache.v, keys.block_table, keys.seq_lens, rows.cu_seqlens_q, keys.kv_start, spec=spec,
            max_seqlen_q=rows.max_seqlen_q, max_seqlen_k=keys.max_seqlen_k, own=own,
            rope_q_pos=rows.rope_q_pos, rope_k_shift=keys.rope_k_shift,
        )
    elif path is _Path.COMPILED:
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


def _refuse_triton_grad(cache: CacheView, spec: AttentionSpec) -> None:
    """What the Triton backward cannot differentiate (checked before anything runs)."""
    if cache.k.requires_grad or cache.v.requires_grad:
        raise ValueError("k_cache/v_cache: the Triton backward gives no gradient to a cache tensor; "
                         "use backend='torch' (or give the keys as the step's own k, v)")
    refuse_rope_triton_grad(spec)
    if needs_grad(spec.sink_logits):
        raise ValueError("sink_logits: the Triton backward gives no gradient to sink_logits; use backend='torch'")


def refuse_rope_triton_grad(spec: AttentionSpec) -> None:
    if spec.rope_mode:
        raise ValueError("backend: 'triton' has no backward under RoPE on read (rope_cos/rope_sin); "
                         "use backend='auto' or 'torch' for gradients")


def _one_launch(own: OwnKeys, backend: str, grad: bool) -> bool:
    """The one place that decides whether history and own keys MAY go in one launch: dense own
    keys on Triton, eager (or differentiable, also while compiling: the train op)."""
    return not own.paged and backend == "triton" and (grad or not torch.compiler.is_compiling())


def _history_and_own(q, cache: CacheView, keys: KeySet, rows: QueryRows, own: OwnKeys, spec: AttentionSpec,
                     backend: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(out, lse or None)`` over the cached history (``keys``) plus the step's own keys."""
    grad = needs_grad(q, own.k, own.v)
    if grad and backend == "triton":
        refuse_rope_triton_grad(spec)  # the one-launch form's backward would not rotate either
    if _one_launch(own, backend, grad):
        if grad:
            # The Triton backward (dq, and dk/dv of the own keys); its forward falls back to
            # two launches and a merge when one launch cannot take both sources.
            out, lse = torch.ops.kvarena.attention_train(
                q, own.k, own.v, cache.k, cache.v, keys.block_table, keys.seq_lens, rows.cu_seqlens_q,
                keys.kv_start, rows.max_seqlen_q, keys.max_seqlen_k, OWN_AFTER_HISTORY, *spec.op_args(),
            )
            return out, (lse if spec.return_lse else None)
        out, lse = new_outputs(q, None, spec.return_lse)
        viewed = _viewed(cache)
        if takes_own(q, viewed, keys, rows, own, spec):
            launch_triton(q, viewed, keys, rows, out, lse, spec, own=own)
            return out, lse
    parts = [
        _attend_cache(q, _viewed(cache), keys, rows, spec.with_lse, backend, None, None),
        _attend_cache(q, CacheView(own.k, own.v), own.keys, rows, spec.with_lse, backend, None, None),
    ]
    out, lse = merge_partials(parts, backend)
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
