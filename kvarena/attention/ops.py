"""Public functional attention ops: every argument validated on every call.

``paged_attention``, ``store_kv`` and ``merge_attention_states`` are one-shot calls: the
options become an :class:`~kvarena.attention.spec.AttentionSpec`, the tensors are checked
(:mod:`kvarena.attention.checks`, :mod:`kvarena.attention.fp8`), and the call goes to the
same trusted dispatcher the KV pools use (:mod:`kvarena.attention.dispatch`).

Backends: ``"auto"`` runs the Triton kernels on CUDA tensors (forward, and the Triton
backward for gradients w.r.t. q and the keys given in the call) and the PyTorch path on
CPU and for gradients w.r.t. a cache tensor; ``"triton"`` on CPU runs the Triton
interpreter (TRITON_INTERPRET=1 must be set before triton is imported); ``"torch"``
forces the PyTorch path.

Checks that read only shapes, dtypes and devices always run. Checks that need the
*values* of block tables, lengths or slots run on CPU tensors and, on CUDA, only under
``KVARENA_DEBUG=1``, so the hot path never synchronizes with the device.
"""

from __future__ import annotations

import torch

from kvarena.attention import checks, dispatch
from kvarena.attention.backend import needs_grad, resolve_backend
from kvarena.attention.batch import CacheView, KeySet, QueryRows
from kvarena.attention.dtypes import TORCH_DTYPES
from kvarena.attention.fp8 import check_kv_scales, refuse_fp8_grad
from kvarena.attention.route import route
from kvarena.attention.spec import AttentionSpec, check_backend

__all__ = ["paged_attention", "store_kv", "merge_attention_states"]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    causal: bool = True,
    chunk_size: int | None = None,
    window_left: int | None = None,
    sink_tokens: int = 0,
    softcap: float | None = None,
    kv_start: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    num_splits: int | None = None,
    deterministic: bool = False,
    sink_logits: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    rope_cos: torch.Tensor | None = None,
    rope_sin: torch.Tensor | None = None,
    rope_interleaved: bool = False,
    rope_q_pos: torch.Tensor | None = None,
    rope_k_shift: torch.Tensor | None = None,
):
    """Block-table gather attention over a paged (or slab) KV cache.

    Parameters
    ----------
    q : Tensor ``[total_q, H_q, D]``
        fp16/bf16/fp32 (fp64 on the torch path), the caches' dtype; ``D`` a multiple of
        8 up to 256; ``H_q`` a multiple of ``H_kv`` (GQA/MQA).
    k_cache, v_cache : Tensor ``[num_blocks, block_size, H_kv, D]``
        Any strides with a contiguous last dim and no aliasing elements.
    block_table : Tensor, int32 ``[B, max_blocks]``
        Token t of sequence b lives in block ``block_table[b, t // block_size]``, row
        ``t % block_size``; only entries covering ``0 .. L-1`` are read.
    seq_lens : Tensor, int32 ``[B]``
        ``L``: keys at logical positions ``0 .. L-1``.
    cu_seqlens_q : Tensor, int32 ``[B + 1]``, optional
        Query offsets (None = one query per sequence). Queries of sequence b sit at
        positions ``L - q_len .. L - 1`` (bottom-right aligned).
    scale, causal, chunk_size, window_left, sink_tokens, softcap, backend, num_splits, deterministic, return_lse
        The options of :class:`kvarena.AttentionSpec` (same names, meanings, checks).
    sink_logits : Tensor ``[H_q]``, optional
        Learned sink logits (gpt-oss), float32 (float64 with fp64 q) on q's device: each
        joins its head's softmax denominator (see :class:`kvarena.AttentionSpec`).
    kv_start : Tensor, int32 ``[B]``, optional
        Keys ``t < kv_start[b]`` are invisible (left padding).
    k_scale, v_scale : Tensor, fp32, optional
        Required with float8_e4m3fn caches (and only then): per-(token, kv head) scales
        ``[num_blocks, block_size, H_kv]`` or 0-dim static scales; key ``t`` is
        ``k_cache[...] * k_scale[...]``. q (and out) are float16/bfloat16/float32.
        Inference only (a ValueError under autograd).
    rope_cos, rope_sin, rope_interleaved
        RoPE on read (see :class:`kvarena.AttentionSpec`): the caches hold un-rotated keys;
        q and the keys are rotated by table rows as they are read.
    rope_q_pos : Tensor, int32 ``[B]``, optional
        Table row of each sequence's first query (None: its position ``L - q_len``).
    rope_k_shift : Tensor, int32 ``[B, max_blocks]``, optional
        Key t of sequence b takes row ``t + rope_k_shift[b, t // block_size]`` (None: t).
        Gradients under RoPE on read are the torch path's (``backend="triton"`` refuses).
    max_seqlen_q, max_seqlen_k : int, optional
        Host bounds of the query / key lengths (None = read from the device: a sync).
    out : Tensor ``[total_q, H_q, D]``, optional
        Output buffer (q's shape, dtype and device; no aliasing elements, and no element
        shared with any input: q, the caches, the tables, the scales, the RoPE tables).

    Returns
    -------
    ``out [total_q, H_q, D]``, or ``(out, lse [total_q, H_q] fp32)`` with ``return_lse``.
    A query that sees no key gets ``out = 0`` and ``lse = -inf``.

    Examples
    --------
    Two sequences of 5 and 3 keys in 4-token blocks, one decode query each:

    >>> import torch
    >>> from kvarena import paged_attention
    >>> k_cache = torch.randn(4, 4, 2, 8)             # [num_blocks, block_size, H_kv, D]
    >>> v_cache = torch.randn(4, 4, 2, 8)
    >>> block_table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    >>> seq_lens = torch.tensor([5, 3], dtype=torch.int32)
    >>> q = torch.randn(2, 4, 8)                      # [total_q, H_q = 2 * H_kv, D]
    >>> out, lse = paged_attention(q, k_cache, v_cache, block_table, seq_lens, return_lse=True)
    >>> out.shape, lse.shape
    (torch.Size([2, 4, 8]), torch.Size([2, 4]))
    """
    spec = AttentionSpec(
        scale=scale, causal=causal, chunk_size=chunk_size, window_left=window_left,
        sink_tokens=sink_tokens, softcap=softcap, backend=backend, num_splits=num_splits,
        deterministic=deterministic, return_lse=return_lse, sink_logits=sink_logits,
        rope_cos=rope_cos, rope_sin=rope_sin, rope_interleaved=rope_interleaved,
    )
    cu, max_q, max_k = checks.validate_paged(
        q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, out, max_seqlen_q, max_seqlen_k
    )
    checks.check_sink_logits(spec.sink_logits, q)
    kv_scales = check_kv_scales(k_cache, k_scale, v_scale, q.dtype)
    refuse_fp8_grad(kv_scales, q, spec.sink_logits, k_cache, v_cache, k_scale, v_scale)
    rope_q_pos, rope_k_shift = checks.check_rope(spec, q, block_table, rope_q_pos, rope_k_shift)
    if spec.rope_mode and checks.check_values(q):
        checks.check_rope_values(spec, rope_q_pos, rope_k_shift, seq_lens, cu, k_cache.shape[1], kv_start)
    if out is not None:  # the kernels write out while they read every input
        checks.check_written_apart("out", out, {
            "q": q, "k_cache": k_cache, "v_cache": v_cache, "block_table": block_table, "seq_lens": seq_lens,
            "cu_seqlens_q": cu_seqlens_q, "kv_start": kv_start, "sink_logits": spec.sink_logits,
            "k_scale": k_scale, "v_scale": v_scale, "rope_cos": spec.rope_cos, "rope_sin": spec.rope_sin,
            "rope_q_pos": rope_q_pos, "rope_k_shift": rope_k_shift})
    call = route(spec.backend, q.device, q.dtype, rope=bool(spec.rope_mode), q_grad=needs_grad(q),
                 cache_grad=needs_grad(k_cache, v_cache, spec.sink_logits))
    return dispatch.attend(
        q, CacheView(k_cache, v_cache, kv_scales), KeySet(block_table, seq_lens, max_k, kv_start, rope_k_shift),
        QueryRows(cu, max_q, rope_q_pos), spec=spec, route=call, out=out,
    )


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter new keys/values into the cache in place.

    Parameters
    ----------
    k, v : Tensor ``[N, H_kv, D]``
        In the caches' dtype (stored detached: the cache never joins autograd).
    k_cache, v_cache : Tensor ``[num_blocks, block_size, H_kv, D]``
        Strided views are fine; elements must not alias, nor share memory with ``k``,
        ``v``, ``slot_mapping`` or static scales (the store reads them while it writes).
    slot_mapping : Tensor, int32/int64 ``[N]``
        Token i goes to block ``s // block_size``, row ``s % block_size``; ``s < 0`` is
        skipped. Nothing is written unless every slot is valid (in range, no
        duplicates; checked on CPU, and on CUDA under ``KVARENA_DEBUG=1``).
    backend : {"auto", "torch", "triton"}
    k_scale, v_scale : Tensor, fp32, optional
        Required with float8_e4m3fn caches (k, v are then float16/bfloat16/float32):
        ``[num_blocks, block_size, H_kv]`` per-token scales, which the store WRITES (each
        row's ``max(amax / 448, 2**-126)``; NaN for a row holding a NaN), or 0-dim static
        scales, which it reads (values beyond +-448 scales saturate). Bytes are rounded to
        nearest-even, equal to torch's cast of ``(x / scale).clamp(-448, 448)``.

    Examples
    --------
    >>> import torch
    >>> from kvarena import store_kv
    >>> k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    >>> k = torch.ones(2, 1, 8)
    >>> store_kv(k, 2 * k, k_cache, v_cache, torch.tensor([5, -1]))   # block 1, row 1; skip
    >>> k_cache[1, 1, 0, 0].item(), v_cache[1, 1, 0, 0].item(), k_cache.sum().item()
    (1.0, 2.0, 8.0)
    """
    check_backend(backend)
    checks.validate_store(k, v, k_cache, v_cache, slot_mapping)
    kv_scales = check_kv_scales(k_cache, k_scale, v_scale, k.dtype, "k")
    if kv_scales is not None and k_scale.dim():  # per-token scales are written too
        for sname, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
            for cname, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
                checks.check_disjoint(sname, sc, cname, cache)
            checks.check_written_apart(sname, sc, {"k": k, "v": v, "slot_mapping": slot_mapping})
    elif kv_scales is not None:  # static scales are read while the caches are written
        for cname, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            checks.check_written_apart(cname, cache, {"k_scale": k_scale, "v_scale": v_scale})
    dispatch.store(k, v, CacheView(k_cache, v_cache, kv_scales), slot_mapping,
                   resolve_backend(backend, k_cache.device, k.dtype, False, "k"))


def merge_attention_states(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two partial attentions over disjoint key sets.

    Parameters
    ----------
    out_a, out_b : Tensor ``[N, H, D]``
        Same shape and dtype.
    lse_a, lse_b : Tensor ``[N, H]``
        fp32 (fp64 with fp64 outputs) natural-log sum-exp; ``-inf`` marks an empty part.
    backend : {"auto", "torch", "triton"}

    Returns
    -------
    ``(out [N, H, D], lse [N, H])``: softmax over the union of both key sets.

    Examples
    --------
    >>> import torch
    >>> from kvarena import merge_attention_states
    >>> o = torch.ones(1, 1, 8)
    >>> lse = torch.zeros(1, 1)
    >>> out, lse2 = merge_attention_states(o, lse, 3 * o, lse)    # equal weights
    >>> out[0, 0, 0].item(), round(lse2.item(), 4)
    (2.0, 0.6931)
    """
    for name, t in (("out_a", out_a), ("out_b", out_b)):
        checks.require_tensor(name, t, 3)
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        checks.require_tensor(name, t, 2)
    if out_b.shape != out_a.shape or out_b.dtype != out_a.dtype or out_b.device != out_a.device:
        raise ValueError(f"out_b: expected out_a's shape/dtype/device {tuple(out_a.shape)}/{out_a.dtype}, got {tuple(out_b.shape)}/{out_b.dtype}")
    if out_a.dtype not in TORCH_DTYPES:
        raise TypeError(f"out_a: expected a floating dtype, got {out_a.dtype}")
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(t.shape) != tuple(out_a.shape[:2]):
            raise ValueError(f"{name}: expected shape {tuple(out_a.shape[:2])}, got {tuple(t.shape)}")
        if t.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{name}: expected float32 (or float64), got {t.dtype}")
        if t.device != out_a.device:
            raise ValueError(f"{name}: expected out_a's device {out_a.device}, got {t.device}")
    check_backend(backend)
    grad = needs_grad(out_a, lse_a, out_b, lse_b)
    return dispatch.merge(out_a, lse_a, out_b, lse_b, resolve_backend(backend, out_a.device, out_a.dtype, grad, "out_a"))
