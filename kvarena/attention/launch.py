"""Trusted execution bodies: the Triton launches and the PyTorch paths for validated
arguments and a resolved backend. Shared by the dispatcher (eager calls) and the
``torch.library`` op implementations (compiled calls)."""

from __future__ import annotations

import torch

from kvarena.attention import torch_path
from kvarena.attention.batch import CacheView, KeySet, OwnKeys, QueryRows
from kvarena.attention.fp8 import from_bytes
from kvarena.attention.plans import empty_launch, launch_plan, takes_own_keys
from kvarena.attention.spec import AttentionSpec


def new_outputs(q: torch.Tensor, out: torch.Tensor | None = None, lse: bool = True):
    """``(out, lse)`` buffers of a launch: the caller's ``out`` or a new one, an fp32 lse or None."""
    res = torch.empty_like(q) if out is None else out
    return res, (torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if lse else None)


def launch_triton(q: torch.Tensor, cache: CacheView, keys: KeySet, rows: QueryRows, out: torch.Tensor,
                  lse: torch.Tensor | None, spec: AttentionSpec, own: OwnKeys | None = None) -> None:
    """One Triton launch writing ``out`` (and ``lse`` unless None) in place, from the step's
    plan (:func:`~kvarena.attention.plans.launch_plan`: made by the step's first launch of
    this key set, read by the others). ``own``: dense own keys after the history in the same
    launch, which the caller has asked :func:`~kvarena.attention.plans.takes_own_keys` about.
    fp8 views must already be float8 / fp32 (:func:`from_bytes`)."""
    if q.device.type == "meta" or empty_launch(q, keys, rows):
        return  # a dry run (the outputs are allocated), or no query row: no kernel runs
    fwd = launch_plan(q, cache, keys, rows, spec, lse=lse is not None, own=own)
    launch_planned(fwd, q, cache, keys, rows, out, lse, spec, own)


def launch_planned(fwd, q: torch.Tensor, cache: CacheView, keys: KeySet, rows: QueryRows, out: torch.Tensor,
                   lse: torch.Tensor | None, spec: AttentionSpec, own: OwnKeys | None = None) -> None:
    """Launch the planned ``fwd`` (an ``AttentionLaunch``) over the typed seam: the kernel
    launcher's :func:`~kvarena.kernels.paged_attention.launch_planned`."""
    from kvarena.kernels import paged_attention as pa

    pa.launch_planned(fwd, q, cache.k, cache.v, keys.block_table, keys.seq_lens, rows.cu_seqlens_q, keys.kv_start,
                      out, lse, spec=spec, own_k=None if own is None else own.k,
                      own_v=None if own is None else own.v, kv_scales=cache.scales, rope_q_pos=rows.rope_q_pos,
                      rope_k_shift=keys.rope_k_shift)


def run_attention(q: torch.Tensor, cache: CacheView, keys: KeySet, rows: QueryRows, spec: AttentionSpec,
                  backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of a forward-only call on ``backend`` (fp8 views already viewed back)."""
    if backend == "triton":
        out, lse = new_outputs(q)
        launch_triton(q, cache, keys, rows, out, lse, spec)
        return out, lse
    # No gradient here: the SDPA shortcut when the call has no position mask (same answer,
    # decided on the lengths' host values), else the batched path.
    args = (q, cache.k, cache.v, keys.block_table, keys.seq_lens, rows.cu_seqlens_q, keys.kv_start)
    kw = dict(spec=spec, max_seqlen_q=rows.max_seqlen_q, max_seqlen_k=keys.max_seqlen_k, kv_scales=cache.scales)
    fast = torch_path.paged_attention_sdpa(*args, **kw)
    if fast is not None:
        return fast
    return torch_path.paged_attention_torch(*args, **kw, rope_q_pos=rows.rope_q_pos, rope_k_shift=keys.rope_k_shift)


def dense_own_keys(k: torch.Tensor, v: torch.Tensor) -> OwnKeys:
    """Own keys ``[B, T, H_kv, D]`` visible to all of a sequence's rows, listed as one T-token
    block per sequence."""
    b, t = k.shape[0], k.shape[1]
    table = torch.arange(b, dtype=torch.int32, device=k.device)[:, None]
    lens = torch.full((b,), t, dtype=torch.int32, device=k.device)
    return OwnKeys(k, v, KeySet(table, lens, t))


def own_keys_spec(spec: AttentionSpec) -> AttentionSpec:
    """The spec of attending the own keys after the history alone: every query row sees
    them all (no causal mask, no window or sinks), lse returned for the merge."""
    if spec.causal or spec.window_left is not None or spec.sink_tokens:
        spec = spec.replace(causal=False, window_left=None, sink_tokens=0)
    return spec.with_lse


def merged_with_own(q: torch.Tensor, cache: CacheView, keys: KeySet, rows: QueryRows, own: OwnKeys,
                    spec: AttentionSpec, part, merge) -> tuple[torch.Tensor, torch.Tensor]:
    """THE two-launch form of history + own keys: ``part(q, cache, keys, rows, spec)`` over the
    history and over the own keys (each ``(out, lse)``), then ``merge(out_a, lse_a, out_b,
    lse_b)`` by LSE. The eager dispatcher and the train op's forward both run it, each
    with its own ``part`` (its path) and ``merge`` (its backend)."""
    out_h, lse_h = part(q, cache, keys, rows, spec.with_lse)
    out_o, lse_o = part(q, CacheView(own.k, own.v), own.keys, rows, own_keys_spec(spec))
    return merge(out_h, lse_h, out_o, lse_o)


def history_and_own_forward(q: torch.Tensor, cache: CacheView, keys: KeySet, rows: QueryRows, own: OwnKeys,
                            spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, fp32 lse) over the cached history plus dense own keys visible to every query, on
    Triton (the train op's forward): one launch where the kernel takes both, else
    :func:`merged_with_own`."""
    spec = spec.with_lse
    if takes_own_keys(q, cache, keys, rows, own, spec, lse=True):
        out, lse = new_outputs(q)
        launch_triton(q, cache, keys, rows, out, lse, spec, own=own)
        return out, lse
    return merged_with_own(q, cache, keys, rows, own, spec, _triton_part, _triton_merge)


def _triton_part(q, cache: CacheView, keys: KeySet, rows: QueryRows, spec: AttentionSpec):
    return run_attention(q, cache, keys, rows, spec, "triton")


def _triton_merge(out_a, lse_a, out_b, lse_b):
    return merge_impl(out_a, lse_a, out_b, lse_b, "triton")


def store_impl(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: str,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    k_cache, v_cache, kv_scales = from_bytes(k_cache, v_cache, k_scale, v_scale)
    if backend == "triton":
        from kvarena.kernels.store import store_kv_fwd

        if k_cache.device.type != "meta":  # meta: a dry run (shapes and allocations only)
            store_kv_fwd(k, v, k_cache, v_cache, slot_mapping, kv_scales)
        return
    torch_path.store_kv_torch(k, v, k_cache, v_cache, slot_mapping, kv_scales)


def merge_impl(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    if backend == "triton":
        from kvarena.kernels.merge import merge_attention_states_fwd

        out = torch.empty_like(out_a)
        lse = torch.empty(out_a.shape[:2], dtype=torch.float32, device=out_a.device)
        if out.device.type != "meta":  # meta: a dry run
            merge_attention_states_fwd(out_a, lse_a, out_b, lse_b, out, lse)
        return out, lse
    return torch_path.merge_attention_states_torch(out_a, lse_a, out_b, lse_b)
