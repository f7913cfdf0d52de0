"""The ``torch.library`` registration of kvarena's ops (``torch.ops.kvarena.*``).

Each op takes validated arguments plus the resolved backend, so the op body is pure
dispatch. The attention op's option arguments are generated from AttentionSpec's fields
(AttentionSpec.op_schema / op_args / from_op_args): one list of options for the public
op, the custom op, its fake, the launcher, the torch path and the oracle. Imported by
:mod:`kvarena.attention.dispatch`, the only module that calls the ops.
"""

from __future__ import annotations

import torch

from kvarena.attention.backend import resolve_backend
from kvarena.attention.batch import CacheView, KeySet, QueryRows
from kvarena.attention.dtypes import accumulator_dtype
from kvarena.attention.fp8 import from_bytes
from kvarena.attention.launch import (
    dense_own_keys,
    history_and_own_forward,
    merge_impl,
    run_attention,
    store_impl,
)
from kvarena.attention.spec import AttentionSpec
from kvarena.kernels.placement import OWN_AFTER_HISTORY

__all__: list[str] = []  # registers torch.ops.kvarena.*; nothing to import


def _typed(k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, max_seqlen_q, max_seqlen_k,
           k_scale=None, v_scale=None, rope_q_pos=None, rope_k_shift=None):
    """The op arguments as the seam's objects (fp8 uint8 views viewed back)."""
    k_cache, v_cache, scales = from_bytes(k_cache, v_cache, k_scale, v_scale)
    return (CacheView(k_cache, v_cache, scales),
            KeySet(block_table, seq_lens, int(max_seqlen_k), kv_start, rope_k_shift),
            QueryRows(cu_seqlens_q, int(max_seqlen_q), rope_q_pos))


_LIB = torch.library.Library("kvarena", "FRAGMENT")

# Forward-only attention: one opaque op with a fake kernel under torch.compile
_LIB.define(
    "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
    "Tensor cu_seqlens_q, Tensor? kv_start, Tensor? k_scale, Tensor? v_scale, Tensor? rope_q_pos, "
    "Tensor? rope_k_shift, SymInt max_seqlen_q, "
    "SymInt max_seqlen_k, "
    f"{AttentionSpec.op_schema()}) -> (Tensor, Tensor)"
)


def _paged_attention_op_impl(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, k_scale, v_scale,
                             rope_q_pos, rope_k_shift, max_seqlen_q, max_seqlen_k, *spec_args):
    spec = AttentionSpec.from_op_args(spec_args)
    backend = resolve_backend(spec.backend, q.device, q.dtype, False)
    cache, keys, rows = _typed(k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, max_seqlen_q,
                               max_seqlen_k, k_scale, v_scale, rope_q_pos, rope_k_shift)
    return run_attention(q, cache, keys, rows, spec, backend)


def _paged_attention_op_fake(q, *args):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=accumulator_dtype(q.dtype))


_LIB.impl("paged_attention", _paged_attention_op_impl, "CompositeExplicitAutograd")
torch.library.register_fake("kvarena::paged_attention", _paged_attention_op_fake, lib=_LIB)

# The differentiable Triton attention (training): forward with lse, and its backward,
# each an opaque op with a fake kernel so torch.compile(fullgraph=True) keeps the Triton
# backward (no [queries x keys] tensor) in its graphs. The schemas' ``gk, gv`` are the own
# keys and ``mode`` their placement (kvarena.kernels.placement).
_LIB.define(
    "attention_train(Tensor q, Tensor? gk, Tensor? gv, Tensor k_cache, Tensor v_cache, Tensor block_table, "
    "Tensor seq_lens, Tensor cu_seqlens_q, Tensor? kv_start, SymInt max_seqlen_q, SymInt max_seqlen_k, int mode, "
    f"{AttentionSpec.op_schema()}) -> (Tensor, Tensor)"
)
_LIB.define(
    "attention_train_bwd(Tensor dout, Tensor? dlse, Tensor q, Tensor? gk, Tensor? gv, Tensor out, Tensor lse, "
    "Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, Tensor cu_seqlens_q, Tensor? kv_start, "
    f"SymInt max_seqlen_q, int mode, {AttentionSpec.op_schema()}) -> (Tensor, Tensor, Tensor)"
)


def _attention_train_impl(q, own_k, own_v, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start,
                          max_seqlen_q, max_seqlen_k, mode, *spec_args):
    spec = AttentionSpec.from_op_args(spec_args)
    cache, keys, rows = _typed(k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, max_seqlen_q,
                               max_seqlen_k)
    if mode == OWN_AFTER_HISTORY:
        return history_and_own_forward(q, cache, keys, rows, dense_own_keys(own_k, own_v), spec)
    return run_attention(q, cache, keys, rows, spec, "triton")


def _attention_train_bwd_impl(dout, dlse, q, own_k, own_v, out, lse, k_cache, v_cache, block_table, seq_lens,
                              cu_seqlens_q, kv_start, max_seqlen_q, mode, *spec_args):
    from kvarena.kernels.paged_attention_bwd import paged_attention_bwd

    dq, dk, dv = paged_attention_bwd(
        dout, q, out, lse, dlse, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start,
        spec=AttentionSpec.from_op_args(spec_args), max_seqlen_q=int(max_seqlen_q), own_k=own_k, own_v=own_v,
        placement=mode,
    )
    if dk is None:  # no own keys: 0-element placeholders (the schema returns tensors)
        dk, dv = q.new_empty(0), q.new_empty(0)
    return dq, dk, dv


def _attention_train_setup(ctx, inputs, output):
    q, own_k, own_v, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, max_q, _, mode, *spec_args = inputs
    out, lse = output
    # The arena is saved through .data: a separate version counter, since every later store
    # into the arena (other layers, the next chunk) bumps the shared one and would make
    # autograd refuse a backward that reads blocks nobody touched. The caller keeps the
    # blocks the step read unchanged until backward (docs/contract.md).
    ctx.save_for_backward(q, own_k, own_v, out, lse, k_cache.data, v_cache.data, block_table, seq_lens, cu_seqlens_q,
                          kv_start)
    ctx.max_seqlen_q, ctx.mode, ctx.spec_args = max_q, mode, spec_args


def _attention_train_backward(ctx, dout, dlse):
    q, own_k, own_v, out, lse, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.kvarena.attention_train_bwd(
        dout, dlse, q, own_k, own_v, out, lse, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start,
        ctx.max_seqlen_q, ctx.mode, *ctx.spec_args,
    )
    if own_k is None:
        dk = dv = None
    return (dq, dk, dv, *([None] * (9 + len(ctx.spec_args))))


def _attention_train_bwd_fake(dout, dlse, q, own_k, own_v, *args):
    if own_k is None:
        return torch.empty_like(q), q.new_empty(0), q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(own_k), torch.empty_like(own_v)


_LIB.impl("attention_train", _attention_train_impl, "CompositeExplicitAutograd")
_LIB.impl("attention_train_bwd", _attention_train_bwd_impl, "CompositeExplicitAutograd")
torch.library.register_fake(
    "kvarena::attention_train",
    lambda q, *args: (torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)), lib=_LIB,
)
torch.library.register_fake("kvarena::attention_train_bwd", _attention_train_bwd_fake, lib=_LIB)
torch.library.register_autograd("kvarena::attention_train", _attention_train_backward,
                                setup_context=_attention_train_setup, lib=_LIB)

# Store and merge: custom ops around the same bodies the eager calls run
_store_kv_op = torch.library.custom_op(
    "kvarena::store_kv", store_impl, mutates_args=("k_cache", "v_cache", "k_scale", "v_scale")
)


@_store_kv_op.register_fake
def _(k, v, k_cache, v_cache, slot_mapping, backend, k_scale=None, v_scale=None):
    return None


_merge_op = torch.library.custom_op(
    "kvarena::merge_attention_states", merge_impl, mutates_args=()
)


@_merge_op.register_fake
def _(out_a, lse_a, out_b, lse_b, backend):
    lse_dtype = torch.float64 if out_a.dtype == torch.float64 else torch.float32
    return torch.empty_like(out_a), out_a.new_empty(out_a.shape[:2], dtype=lse_dtype)
