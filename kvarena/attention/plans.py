"""Plan once per step: the Triton launch plan of each key set a step attends.

The kernel's launch plan (``kernels/attn_plan.py``: :func:`launch_shape` +
:func:`plan_attention` -> ``AttentionLaunch``: target, tile, grid, splits, constexprs) is a
pure function of host values that are the same for every layer reading one key set of a
step with one spec: the shapes of the layer group (head_dim, heads, block size, cache
addressing), the step's bounds (``max_seqlen_q`` / ``max_seqlen_k``), which optional
operands it reads, the spec. So it is made once per step: the step's
:class:`~kvarena.attention.batch.QueryRows` (built by a pool's ``plan``, shared by every
layer) carries the memo ``launches``, keyed by ``(key set, spec, query heads, own keys per
sequence, lse written)``; the first layer that launches a key set plans it, every other
layer of the step reads the plan and only launches. A one-shot call (the public op, a
``torch.library`` op body) builds fresh rows, so it plans once for itself.

The memo's invariant (which the pools keep): within one step, a key set is read through
cache views of one shape and strides (its layer group's) and by queries of one dtype and
head dim. A spec is told apart by identity (the pools hand every layer its own, made
once); a call with per-call overrides brings a new spec, which plans anew.

:func:`takes_own_keys` is the one place attention asks whether the kernel takes a step's
own keys after the history in the same launch.
"""

from __future__ import annotations

import torch

from kvarena.attention.batch import CacheView, KeySet, OwnKeys, QueryRows
from kvarena.attention.spec import AttentionSpec

__all__ = ["MEMO_LIMIT", "launch_plan", "takes_own_keys", "empty_launch"]


def empty_launch(q: torch.Tensor, keys: KeySet, rows: QueryRows) -> bool:
    """Whether no query row exists (no launch, nothing to plan)."""
    return rows.max_seqlen_q == 0 or q.shape[0] == 0 or keys.seq_lens.shape[0] == 0


#: Plans one step's memo holds at most (a pool's step needs one per layer group, spec and
#: form; calls with per-call overrides bring a new spec each, and a CUDA-graph plan's rows
#: live across steps): past it the memo starts over.
MEMO_LIMIT = 64


def _memo(rows: QueryRows, key: tuple, spec: AttentionSpec, make):
    """``make()`` once per step for ``key`` in the step's memo (``rows.launches``); the entry
    keeps the spec itself, so a later spec at a reused id never reads it."""
    memo = rows.launches
    got = memo.get(key)
    if got is not None and got[0] is spec:
        return got[1]
    value = make()
    if len(memo) >= MEMO_LIMIT:
        memo.clear()
    memo[key] = (spec, value)
    return value


def launch_plan(q: torch.Tensor, cache: CacheView, keys: KeySet, rows: QueryRows, spec: AttentionSpec, *,
                lse: bool, own: OwnKeys | None = None):
    """The ``AttentionLaunch`` of attending ``keys`` of ``cache`` (and dense ``own`` keys after
    the history, which the caller has asked :func:`takes_own_keys` about) with ``spec``,
    writing the lse iff ``lse``. Read from the step's memo when made before in this step,
    else made and stored there."""
    own_len = None if own is None else own.k.shape[1]
    return _memo(rows, (keys, id(spec), q.shape[1], own_len, lse), spec,
                 lambda: _plan(q, cache, keys, rows, spec, own_len, lse))


def _shape(q, cache: CacheView, keys: KeySet, rows: QueryRows, spec: AttentionSpec, own_len, lse: bool):
    """The kernel's ``LaunchShape`` of a call (host values only)."""
    from kvarena.kernels.attn_plan import launch_shape

    rope = bool(spec.rope_mode)
    return launch_shape(
        q, cache.k, cache.v, num_seqs=keys.seq_lens.shape[0], max_seqlen_q=rows.max_seqlen_q,
        max_seqlen_k=keys.max_seqlen_k, own_len=own_len, has_kv_start=keys.kv_start is not None, write_lse=lse,
        kv_scales=cache.scales, rope_q_pos=rope and rows.rope_q_pos is not None,
        rope_k_shift=rope and keys.rope_k_shift is not None,
    )


def _plan(q, cache: CacheView, keys: KeySet, rows: QueryRows, spec: AttentionSpec, own_len, lse: bool):
    """The kernel launcher's planner on the call's host values (the only call to it from
    attention; looked up on the launcher module so a test's patch of it holds)."""
    from kvarena.kernels import paged_attention as pa
    from kvarena.kernels.arch import launch_arch

    return pa.plan_attention(_shape(q, cache, keys, rows, spec, own_len, lse), spec, launch_arch(q))


def takes_own_keys(q: torch.Tensor, cache: CacheView, keys: KeySet, rows: QueryRows, own: OwnKeys,
                   spec: AttentionSpec, lse: bool) -> bool:
    """Whether ONE Triton launch takes the dense ``own`` keys after the history of ``keys``
    (else: two launches merged by LSE): the kernel's pure predicate
    (``kernels.attn_plan.takes_own_keys``), asked once per step and key set (memoized like
    the plans), launching nothing."""
    if empty_launch(q, keys, rows):
        return True  # nothing launches: one (empty) launch
    from kvarena.kernels import attn_plan
    from kvarena.kernels.arch import launch_arch

    own_len = own.k.shape[1]
    return _memo(rows, ("takes own", keys, id(spec), q.shape[1], own_len, lse), spec,
                 lambda: attn_plan.takes_own_keys(_shape(q, cache, keys, rows, spec, own_len, lse), spec,
                                                  launch_arch(q)))
