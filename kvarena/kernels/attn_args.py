"""The attention launcher's arguments: what one ``_paged_attn_kernel`` launch of a plan
passes, split into what every layer of a step passes alike and what each layer brings.

A step plans once (``kvarena.attention.plans``) and every layer launches that plan with
tensors of one layout: its own q, cache views, outputs, own keys and fp8 scales (new
pointers, the same shapes and strides), and the step's metadata (the same tensor
objects). :func:`layout_args` builds, once per plan and call layout, a
:class:`LayoutArgs`: the step metadata's pointers, every stride, scalar, constexpr and
launch option, and how each layer's tensors are taken (copies for rows past the int32
tile offsets, uint8 views of fp8 bytes). The plan keeps it (``AttentionLaunch.layouts``),
keyed by :func:`layout_key`, so a layer after the first only fills in its own pointers
(:func:`layer_kwargs`) and launches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvarena.kernels._common import I32_MAX
from kvarena.kernels.attn_plan import AttentionLaunch

__all__ = ["LAYER_POINTERS", "LayoutArgs", "Outputs", "layer_kwargs", "layout_args", "layout_key", "outputs"]

#: The kernel's pointers that each layer brings (all others are the step's).
LAYER_POINTERS = ("q_ptr", "k_ptr", "v_ptr", "o_ptr", "lse_ptr", "own_k_ptr", "own_v_ptr", "ks_ptr", "vs_ptr")

#: Layouts one plan keeps at most (a step's layers share one; past it the plan starts over).
LAYOUT_LIMIT = 16


def tile_span(t: torch.Tensor, block_m: int, group: int) -> int:
    """Largest in-tile element offset of a [tokens, heads(, D)] tensor (int32 bound)."""
    span = (block_m // group + 1) * t.stride(0) + group * t.stride(1)
    if t.dim() == 3:
        span += t.shape[2] * t.stride(2)
    return span


def _dense_strides(shape) -> tuple[int, ...]:
    """The strides of a new contiguous tensor of ``shape`` (``torch.empty``)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True, eq=False)
class LayoutArgs:
    """What every launch of one plan with one call layout passes alike (:func:`layout_args`)."""

    kwargs: dict  # all keyword arguments of _paged_attn_kernel but LAYER_POINTERS
    unread: tuple[str, ...]  # the LAYER_POINTERS the plan does not pass (None)
    copy_q: bool  # q's rows pass the int32 tile offsets: launch on a contiguous copy
    copy_out: bool  # (unsplit) out's rows pass them: write a new buffer, copied into out after
    copy_lse: bool  # the same for lse
    as_bytes: bool  # fp8 caches read as uint8 (no native fp8 loads)
    reusable: bool  # no step tensor was copied here (a kept copy would miss in-place updates)
    spec: object  # the spec launched (held: its id is in the key)


def layout_key(spec, q, k_cache, v_cache, metadata: tuple, out, lse, own_k, own_v, kv_scales) -> tuple:
    """What a :class:`LayoutArgs` depends on beyond its plan: the spec and the step's
    ``metadata`` tensors by identity (a kept record holds them, so no other object takes
    their ids while it is kept), the layer's tensors by shape and strides."""
    return (id(spec), *map(id, metadata), q.shape, q.stride(), k_cache.shape, k_cache.stride(), v_cache.stride(),
            out.stride(), None if lse is None else lse.stride(),
            None if own_k is None else (own_k.shape, own_k.stride(), own_v.stride()),
            None if kv_scales is None else (kv_scales[0].stride(), kv_scales[1].stride()))


def _step_pointers(fwd: AttentionLaunch, spec, block_table, seq_lens, cu_seqlens_q, kv_start, rope_q_pos,
                   rope_k_shift) -> tuple[dict, torch.Tensor, torch.Tensor | None]:
    """The step's pointers (1-D metadata read with unit stride: ``.contiguous()``, free when
    it already is), and the block table and RoPE key shifts launched (whose strides it passes)."""
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    if rope_k_shift is not None and rope_k_shift.shape[1] > 1 and rope_k_shift.stride(1) != 1:
        rope_k_shift = rope_k_shift.contiguous()
    on = bool(spec.rope_mode)
    ptrs = dict(block_table_ptr=block_table, seq_lens_ptr=seq_lens.contiguous(), cu_q_ptr=cu_seqlens_q.contiguous(),
                kv_start_ptr=kv_start.contiguous() if kv_start is not None else None, sink_ptr=spec.sink_logits,
                cos_ptr=spec.rope_cos if on else None, sin_ptr=spec.rope_sin if on else None,
                qpos_ptr=rope_q_pos.contiguous() if rope_q_pos is not None else None, kshift_ptr=rope_k_shift)
    for name in fwd.unused:
        if name in ptrs:
            ptrs[name] = None
    return ptrs, block_table, rope_k_shift


def layout_args(fwd: AttentionLaunch, spec, q, k_cache, v_cache, metadata: tuple, out, lse, own_k, own_v,
                kv_scales) -> LayoutArgs:
    """The :class:`LayoutArgs` of launching ``fwd`` with these tensors (``metadata``:
    ``block_table, seq_lens, cu_seqlens_q, kv_start, rope_q_pos, rope_k_shift``, the last
    two None unless RoPE on read): everything but the layer's own pointers."""
    ptrs, block_table, k_shift = _step_pointers(fwd, spec, *metadata)
    kept = (ptrs["block_table_ptr"], ptrs["seq_lens_ptr"], ptrs["cu_q_ptr"], ptrs["kv_start_ptr"], ptrs["qpos_ptr"],
            ptrs["kshift_ptr"])
    reusable = all(a is None or a is b for a, b in zip(kept, metadata))
    cfg, plan = fwd.plan.cfg, fwd.plan
    group = q.shape[1] // k_cache.shape[2]
    block_m = cfg["BLOCK_M"]
    copy_out = not fwd.split and tile_span(out, block_m, group) > I32_MAX
    copy_lse = not fwd.split and lse is not None and tile_span(lse, block_m, group) > I32_MAX
    if fwd.split:
        o_strides = _dense_strides((plan.num_splits, *out.shape))
        l_strides = _dense_strides((plan.num_splits, *out.shape[:2]))
    else:
        o_strides = (0, *(_dense_strides(out.shape) if copy_out else out.stride()))
        l_strides = (0, 0, 0) if lse is None else (0, *(_dense_strides(lse.shape) if copy_lse else lse.stride()))
    sc = (0,) * 6  # the fp8 scales' strides, K's then V's (0: none, or static scales)
    if kv_scales is not None and kv_scales[0].dim():
        sc = (*kv_scales[0].stride(), *kv_scales[1].stride())
    own = plan.own
    ow = (*own_k.stride()[-4:-1], *own_v.stride()[-4:-1]) if own else (0,) * 6  # own K's, V's [B, T, H]
    copy_q = tile_span(q, block_m, group) > I32_MAX
    qs, ks, vs = _dense_strides(q.shape) if copy_q else q.stride(), k_cache.stride(), v_cache.stride()
    on = bool(spec.rope_mode)
    kwargs = dict(
        ptrs,
        stride_qt=qs[0], stride_qh=qs[1], stride_qd=qs[2],
        stride_kb=ks[0], stride_kt=ks[1], stride_kh=ks[2], stride_vb=vs[0], stride_vt=vs[1], stride_vh=vs[2],
        stride_ksb=sc[0], stride_kst=sc[1], stride_ksh=sc[2], stride_vsb=sc[3], stride_vst=sc[4], stride_vsh=sc[5],
        stride_own_kb=ow[0], stride_own_kt=ow[1], stride_own_kh=ow[2],
        stride_own_vb=ow[3], stride_own_vt=ow[4], stride_own_vh=ow[5],
        stride_os=o_strides[0], stride_ot=o_strides[1], stride_oh=o_strides[2], stride_od=o_strides[3],
        stride_ls=l_strides[0], stride_lt=l_strides[1], stride_lh=l_strides[2],
        stride_bt=block_table.stride(0), stride_rp=spec.rope_cos.stride(0) if on else 0,
        stride_rb=k_shift.stride(0) if k_shift is not None else 0,
        scale_log2=fwd.scale_log2, softcap_inv=fwd.softcap_inv, softcap_log2=fwd.softcap_log2,
        block_size=k_cache.shape[1], chunk_size=fwd.causal_chunk, window_left=fwd.window, sink_tokens=fwd.sinks,
        own_len=own_k.shape[1] if own else 0, num_kv_heads=k_cache.shape[2], num_q_tiles=plan.num_q_tiles,
        tiles_per_split=plan.tiles_per_split, n_pos=spec.rope_cos.shape[0] if on else 1,
        **fwd.meta, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], maxnreg=cfg["maxnreg"],
    )
    return LayoutArgs(kwargs, tuple(n for n in LAYER_POINTERS if n in fwd.unused),
                      copy_q=copy_q, copy_out=copy_out, copy_lse=copy_lse,
                      as_bytes=kv_scales is not None and not fwd.meta["FP8_NATIVE"], reusable=reusable, spec=spec)


@dataclass(frozen=True, eq=False)
class Outputs:
    """Where the attention kernel writes: the split partials, or (unsplit) the caller's
    ``out`` / ``lse`` or, for a view whose rows pass the int32 tile offsets, a new buffer."""

    o: torch.Tensor
    lse: torch.Tensor | None  # None when no lse is written
    lse_target: torch.Tensor | None  # unsplit: the lse written (None: none)


def outputs(out: torch.Tensor, lse: torch.Tensor | None, fwd: AttentionLaunch, args: LayoutArgs) -> Outputs:
    """The layer's :class:`Outputs` (new buffers where ``args`` says; strides as it says)."""
    if fwd.split:
        part = torch.empty((fwd.plan.num_splits, *out.shape), dtype=torch.float32, device=out.device)
        part_lse = torch.empty((fwd.plan.num_splits, *out.shape[:2]), dtype=torch.float32, device=out.device)
        return Outputs(part, part_lse, None)
    out_k = torch.empty(out.shape, dtype=out.dtype, device=out.device) if args.copy_out else out
    lse_k = torch.empty(lse.shape, dtype=lse.dtype, device=lse.device) if args.copy_lse else lse
    return Outputs(out_k, lse_k, lse_k)


def layer_kwargs(args: LayoutArgs, q, k_cache, v_cache, dst: Outputs, own_k, own_v, kv_scales) -> dict:
    """All keyword arguments of the layer's launch: ``args``' and the layer's own pointers
    (``LAYER_POINTERS``; None where the plan reads none)."""
    ks, vs = kv_scales if kv_scales is not None else (None, None)
    if args.as_bytes:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    kwargs = args.kwargs.copy()  # one copy and update: cheaper than merging two dicts in the call
    kwargs.update(q_ptr=q, k_ptr=k_cache, v_ptr=v_cache, o_ptr=dst.o, lse_ptr=dst.lse, own_k_ptr=own_k,
                  own_v_ptr=own_v, ks_ptr=ks, vs_ptr=vs)
    for name in args.unread:
        kwargs[name] = None
    return kwargs
