"""Public attention ops: argument validation and backend dispatch.

``backend="auto"`` runs the Triton kernels on CUDA tensors and the PyTorch path on CPU;
``"triton"`` on CPU runs the Triton interpreter (TRITON_INTERPRET=1 must be set before
triton is imported); ``"torch"`` forces the PyTorch path. A call that needs gradients
takes the PyTorch path (there is no Triton backward yet).

Checks that read only shapes, dtypes and devices always run. Checks that need the
*values* of block tables, lengths or slots run on CPU tensors and, on CUDA, only under
``KVARENA_DEBUG=1``, so the hot path never synchronizes with the device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kvarena.attention import reference

__all__ = ["paged_attention", "store_kv", "merge_attention_states", "debug_enabled"]

_BACKENDS = ("auto", "torch", "triton")
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TORCH_DTYPES = (*_KERNEL_DTYPES, torch.float64)
_MAX_HEAD_DIM = 256


def debug_enabled() -> bool:
    """True when ``KVARENA_DEBUG=1``: device-data checks also run for CUDA tensors."""
    return os.environ.get("KVARENA_DEBUG", "0") not in ("", "0")


def _check_values(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" or debug_enabled()


def _require_tensor(name: str, t, ndim: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}")
    return t


def _require_int_tensor(name: str, t, shape: tuple[int, ...], device: torch.device, dtypes=(torch.int32,)):
    _require_tensor(name, t, len(shape))
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    return t


def _opt_int(name: str, value, minimum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected None or an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected None or an int >= {minimum}, got {value}")
    return value


def _resolve_backend(backend: str, device: torch.device, needs_grad: bool) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and not needs_grad else "torch"
    if backend == "triton":
        if needs_grad:
            raise ValueError("backend='triton' has no backward yet: use backend='auto' or 'torch' when gradients are needed")
        if device.type == "cpu":
            _require_interpreter()
        elif device.type != "cuda":
            raise ValueError(f"backend='triton': expected CUDA or CPU (interpreter) tensors, got device {device}")
    return backend


def _require_interpreter() -> None:
    """The interpreter is chosen when triton is imported: the flag must be set before."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise RuntimeError(
            "backend='triton' on CPU tensors runs the Triton interpreter: set TRITON_INTERPRET=1 "
            "in the environment before triton is imported (e.g. at the top of the script)"
        )


@dataclass(frozen=True)
class _PagedArgs:
    """Normalized arguments of one ``paged_attention`` call."""

    cu_seqlens_q: torch.Tensor
    scale: float
    chunk_size: int | None
    window_left: int | None
    sink_tokens: int
    softcap: float | None
    max_seqlen_q: int
    max_seqlen_k: int


def _check_out(out, q: torch.Tensor) -> None:
    if out is None:
        return
    _require_tensor("out", out, 3)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"out: expected shape {tuple(q.shape)}, dtype {q.dtype}, device {q.device}; "
            f"got {tuple(out.shape)}, {out.dtype}, {out.device}"
        )


def _normalize_options(d, causal, scale, chunk_size, window_left, sink_tokens, softcap, max_seqlen_q, max_seqlen_k):
    """Validate the scalar options; returns (scale, chunk_size, window_left, softcap, max_q, max_k)."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    chunk_size = _opt_int("chunk_size", chunk_size, 1)
    window_left = _opt_int("window_left", window_left, 0)
    if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, int) or sink_tokens < 0:
        raise ValueError(f"sink_tokens: expected an int >= 0, got {sink_tokens!r}")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap >= 0:
            raise ValueError(f"softcap: expected None, 0 (off) or a float > 0, got {softcap!r}")
        softcap = float(softcap) if softcap > 0 else None
    if scale is None:
        scale = d**-0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (abs(scale) < float("inf")):
        raise ValueError(f"scale: expected None or a finite float, got {scale!r}")
    max_seqlen_q = _opt_int("max_seqlen_q", max_seqlen_q, 0)
    max_seqlen_k = _opt_int("max_seqlen_k", max_seqlen_k, 0)
    return float(scale), chunk_size, window_left, softcap, max_seqlen_q, max_seqlen_k


def _validate_paged(
    q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, out, *,
    scale, causal, chunk_size, window_left, sink_tokens, softcap, max_seqlen_q, max_seqlen_k,
    check_values: bool,
) -> _PagedArgs:
    _require_tensor("q", q, 3)
    _require_tensor("k_cache", k_cache, 4)
    _require_tensor("v_cache", v_cache, 4)
    if q.dtype not in _TORCH_DTYPES:
        raise TypeError(f"q: expected dtype float16, bfloat16, float32 or float64, got {q.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: expected q's dtype {q.dtype}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: expected q's device {q.device}, got {t.device}")
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name}: the last (head_dim) dimension must be contiguous, got strides {t.stride()}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache: expected k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    total_q, h_q, d = q.shape
    num_blocks, block_size, h_kv, d_k = k_cache.shape
    if d_k != d:
        raise ValueError(f"k_cache: head_dim {d_k} differs from q's head_dim {d}")
    if d % 8 or not 8 <= d <= _MAX_HEAD_DIM:
        raise ValueError(f"q: head_dim must be a multiple of 8 in [8, {_MAX_HEAD_DIM}], got {d}")
    if h_kv == 0 or h_q % h_kv:
        raise ValueError(f"q: H_q ({h_q}) must be a multiple of the caches' H_kv ({h_kv})")
    if block_size < 1:
        raise ValueError(f"k_cache: block_size (dim 1) must be >= 1, got {block_size}")
    _require_tensor("block_table", block_table, 2)
    b = block_table.shape[0]
    max_blocks = block_table.shape[1]
    _require_int_tensor("block_table", block_table, (b, max_blocks), q.device)
    _require_int_tensor("seq_lens", seq_lens, (b,), q.device)
    if cu_seqlens_q is None:
        if total_q != b:
            raise ValueError(f"q: with cu_seqlens_q=None there is one query per sequence ({b}), got {total_q}")
        cu = torch.arange(b + 1, dtype=torch.int32, device=q.device)
        if max_seqlen_q is None:
            max_seqlen_q = 1 if b else 0
    else:
        cu = _require_int_tensor("cu_seqlens_q", cu_seqlens_q, (b + 1,), q.device)
    if kv_start is not None:
        _require_int_tensor("kv_start", kv_start, (b,), q.device)
    _check_out(out, q)
    scale, chunk_size, window_left, softcap, max_seqlen_q, max_seqlen_k = _normalize_options(
        d, causal, scale, chunk_size, window_left, sink_tokens, softcap, max_seqlen_q, max_seqlen_k
    )
    capacity = max_blocks * block_size
    if max_seqlen_k is not None and max_seqlen_k > capacity:
        raise ValueError(
            f"max_seqlen_k: {max_seqlen_k} exceeds what block_table can address "
            f"({max_blocks} blocks x {block_size} tokens = {capacity})"
        )

    if check_values or max_seqlen_q is None or max_seqlen_k is None:
        lens = seq_lens.tolist()
        cus = cu.tolist()
        q_lens = [cus[i + 1] - cus[i] for i in range(b)]
        if max_seqlen_q is None:
            max_seqlen_q = max(q_lens, default=0)
        if max_seqlen_k is None:
            max_seqlen_k = max(lens, default=0)
    if check_values:
        _check_paged_values(
            lens, cus, q_lens, block_table, kv_start, total_q, num_blocks, block_size, capacity,
            max_seqlen_q, max_seqlen_k,
        )
    return _PagedArgs(cu, scale, chunk_size, window_left, sink_tokens, softcap, max_seqlen_q, max_seqlen_k)


def _check_paged_values(lens, cus, q_lens, block_table, kv_start, total_q, num_blocks, block_size, capacity,
                        max_seqlen_q, max_seqlen_k) -> None:
    if cus and cus[0] != 0:
        raise ValueError(f"cu_seqlens_q: must start at 0, got {cus[0]}")
    if cus and cus[-1] != total_q:
        raise ValueError(f"cu_seqlens_q: must end at total_q = {total_q}, got {cus[-1]}")
    for i, (seq_len, q_len) in enumerate(zip(lens, q_lens)):
        if q_len < 0:
            raise ValueError(f"cu_seqlens_q: must be non-decreasing, entry {i + 1} < entry {i}")
        if not 0 <= seq_len <= capacity:
            raise ValueError(f"seq_lens[{i}] = {seq_len}: expected 0 <= seq_len <= {capacity} (block_table capacity)")
        if q_len > seq_len > 0:  # a seq_len-0 row may own queries: CUDA-graph padding, out 0
            raise ValueError(f"seq_lens[{i}] = {seq_len} is shorter than its {q_len} queries (cu_seqlens_q)")
        if seq_len > max_seqlen_k:
            raise ValueError(f"max_seqlen_k: {max_seqlen_k} is below seq_lens[{i}] = {seq_len}")
        if q_len > max_seqlen_q:
            raise ValueError(f"max_seqlen_q: {max_seqlen_q} is below query length {q_len} of sequence {i}")
    if kv_start is not None:
        for i, (s, seq_len) in enumerate(zip(kv_start.tolist(), lens)):
            if not 0 <= s <= seq_len:
                raise ValueError(f"kv_start[{i}] = {s}: expected 0 <= kv_start <= seq_lens[{i}] = {seq_len}")
    # Only the entries covering 0..L-1 are read; they must name real blocks.
    n_used = torch.tensor([-(-n // block_size) for n in lens], dtype=torch.long)
    if len(lens):
        cols = torch.arange(block_table.shape[1])
        used = cols[None, :] < n_used[:, None]
        ids = block_table.cpu().long()[used]
        bad = (ids < 0) | (ids >= num_blocks)
        if bool(bad.any()):
            raise ValueError(
                f"block_table: block id {int(ids[bad][0])} out of range [0, {num_blocks}) within seq_lens"
            )


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
    _trusted: bool = False,
):
    """Block-table gather attention over a paged (or slab) KV cache.

    Parameters
    ----------
    q : ``[total_q, H_q, D]``, fp16/bf16/fp32 (fp64 on the torch path), the caches' dtype.
    k_cache, v_cache : ``[num_blocks, block_size, H_kv, D]``; any strides, last dim contiguous.
    block_table : int32 ``[B, max_blocks]``; token t of sequence b lives in block
        ``block_table[b, t // block_size]``, row ``t % block_size``.
    seq_lens : int32 ``[B]``; keys at logical positions ``0 .. L-1``.
    cu_seqlens_q : int32 ``[B + 1]`` or None (one query per sequence). Queries of
        sequence b sit at positions ``L - q_len .. L - 1`` (bottom-right aligned).
    scale : softmax scale, default ``D ** -0.5``.
    causal, chunk_size, window_left, sink_tokens, softcap, kv_start : masks (DESIGN.md).
    max_seqlen_q, max_seqlen_k : host ints bounding the lengths (None = read from device).
    return_lse : also return the fp32 log-sum-exp ``[total_q, H_q]``.
    out : optional ``[total_q, H_q, D]`` output buffer.
    backend : ``"auto"``, ``"torch"`` or ``"triton"``.
    num_splits : split-KV count override for the Triton path (None = heuristic).
    deterministic : Triton split size independent of the batch.

    Returns
    -------
    ``out`` or ``(out, lse)``.
    """
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k_cache, v_cache)
    )
    if _trusted and cu_seqlens_q is not None and max_seqlen_q is not None and max_seqlen_k is not None:
        # A pool's own caches and plan() metadata, q/k/v already checked against its layout:
        # only the caller's options are validated (keeps a decode layer's Python ~2x cheaper).
        _check_out(out, q)
        opts = _normalize_options(
            q.shape[-1], causal, scale, chunk_size, window_left, sink_tokens, softcap, max_seqlen_q, max_seqlen_k
        )
        args = _PagedArgs(cu_seqlens_q, opts[0], opts[1], opts[2], sink_tokens, opts[3], opts[4], opts[5])
    else:
        args = _validate_paged(
            q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, out,
            scale=scale, causal=causal, chunk_size=chunk_size, window_left=window_left,
            sink_tokens=sink_tokens, softcap=softcap, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, check_values=(not _trusted) and _check_values(q),
        )
    _opt_int("num_splits", num_splits, 1)
    chosen = _resolve_backend(backend, q.device, needs_grad)
    if chosen == "triton" and q.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"q: the Triton kernels take float16, bfloat16 or float32, got {q.dtype}")
    if needs_grad:
        # Differentiable path: plain torch ops that autograd (and dynamo) trace through.
        result, lse = reference.paged_attention_torch(
            q, k_cache, v_cache, block_table, seq_lens, args.cu_seqlens_q,
            scale=args.scale, causal=causal, chunk_size=args.chunk_size, window_left=args.window_left,
            sink_tokens=args.sink_tokens, softcap=args.softcap, kv_start=kv_start,
            max_seqlen_q=args.max_seqlen_q, max_seqlen_k=args.max_seqlen_k,
        )
    elif chosen == "triton" and not torch.compiler.is_compiling():
        # Eager Triton: launch straight into the caller's ``out`` (no extra copy) and skip
        # the lse store when it is not asked for; also skips ~10-20 us of op dispatch.
        result = torch.empty_like(q) if out is None else out
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse else None
        _launch_triton(q, k_cache, v_cache, block_table, seq_lens, args.cu_seqlens_q, kv_start, result, lse,
                       args.scale, causal, args.chunk_size, args.window_left, args.sink_tokens, args.softcap,
                       args.max_seqlen_q, args.max_seqlen_k, num_splits, deterministic)
        return (result, lse) if return_lse else result
    else:
        # Under torch.compile: one opaque custom op with a fake impl. Eager calls the body
        # directly, skipping the ~10-20 us of custom-op dispatch per layer.
        op = torch.ops.kvarena.paged_attention if torch.compiler.is_compiling() else _paged_attention_impl
        result, lse = op(
            q, k_cache, v_cache, block_table, seq_lens, args.cu_seqlens_q, kv_start,
            args.scale, causal, args.chunk_size, args.window_left, args.sink_tokens, args.softcap,
            args.max_seqlen_q, args.max_seqlen_k, num_splits, deterministic, chosen,
        )
    if out is not None:
        out.copy_(result)
        result = out
    return (result, lse) if return_lse else result


def _validate_store(k, v, k_cache, v_cache, slot_mapping, check_values: bool) -> None:
    _require_tensor("k", k, 3)
    _require_tensor("v", v, 3)
    _require_tensor("k_cache", k_cache, 4)
    _require_tensor("v_cache", v_cache, 4)
    if v.shape != k.shape:
        raise ValueError(f"v: expected k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache: expected k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    if tuple(k.shape[1:]) != tuple(k_cache.shape[2:]):
        raise ValueError(f"k: expected [N, {k_cache.shape[2]}, {k_cache.shape[3]}] to match the cache, got {tuple(k.shape)}")
    for name, t in (("k", k), ("v", v), ("v_cache", v_cache)):
        if t.dtype != k_cache.dtype:
            raise TypeError(f"{name}: expected the cache dtype {k_cache.dtype}, got {t.dtype}")
        if t.device != k_cache.device:
            raise ValueError(f"{name}: expected the cache device {k_cache.device}, got {t.device}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name}: the last (head_dim) dimension must be contiguous, got strides {t.stride()}")
    _require_int_tensor("slot_mapping", slot_mapping, (k.shape[0],), k_cache.device, (torch.int32, torch.int64))
    if check_values and slot_mapping.numel():
        reference.check_slots(slot_mapping.long().cpu(), k_cache.shape[0] * k_cache.shape[1])


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: str = "auto",
    _trusted: bool = False,
) -> None:
    """Scatter new keys/values into the cache in place.

    Parameters
    ----------
    k, v : ``[N, H_kv, D]`` in the caches' dtype.
    k_cache, v_cache : ``[num_blocks, block_size, H_kv, D]`` (strided views are fine).
    slot_mapping : int32/int64 ``[N]``; token i goes to block ``s // block_size``, row
        ``s % block_size``; ``s < 0`` is skipped. Nothing is written unless every slot is
        valid (in range, no duplicates).
    """
    if not _trusted:  # a pool's trusted call has checked k/v against its own layout and caches
        _validate_store(k, v, k_cache, v_cache, slot_mapping, _check_values(k_cache))
    chosen = _resolve_backend(backend, k_cache.device, needs_grad=False)
    op = torch.ops.kvarena.store_kv if torch.compiler.is_compiling() else _store_kv_impl
    op(k.detach(), v.detach(), k_cache, v_cache, slot_mapping, chosen)


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
    out_a, out_b : ``[N, H, D]``, same dtype.
    lse_a, lse_b : ``[N, H]`` fp32 (fp64 with fp64 outputs); ``-inf`` marks an empty part.

    Returns
    -------
    ``(out [N, H, D], lse [N, H])``: softmax over the union of both key sets.
    """
    for name, t in (("out_a", out_a), ("out_b", out_b)):
        _require_tensor(name, t, 3)
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        _require_tensor(name, t, 2)
    if out_b.shape != out_a.shape or out_b.dtype != out_a.dtype or out_b.device != out_a.device:
        raise ValueError(f"out_b: expected out_a's shape/dtype/device {tuple(out_a.shape)}/{out_a.dtype}, got {tuple(out_b.shape)}/{out_b.dtype}")
    if out_a.dtype not in _TORCH_DTYPES:
        raise TypeError(f"out_a: expected a floating dtype, got {out_a.dtype}")
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(t.shape) != tuple(out_a.shape[:2]):
            raise ValueError(f"{name}: expected shape {tuple(out_a.shape[:2])}, got {tuple(t.shape)}")
        if t.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{name}: expected float32 (or float64), got {t.dtype}")
        if t.device != out_a.device:
            raise ValueError(f"{name}: expected out_a's device {out_a.device}, got {t.device}")
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (out_a, lse_a, out_b, lse_b))
    chosen = _resolve_backend(backend, out_a.device, needs_grad)
    if chosen == "triton" and out_a.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"out_a: the Triton kernels take float16, bfloat16 or float32, got {out_a.dtype}")
    if needs_grad:
        return reference.merge_attention_states_torch(out_a, lse_a, out_b, lse_b)
    op = torch.ops.kvarena.merge_attention_states if torch.compiler.is_compiling() else _merge_impl
    return op(out_a, lse_a, out_b, lse_b, chosen)


# --- custom ops -------------------------------------------------------------------------
# Each op takes the already-validated, normalized arguments plus the resolved backend, so
# the op body is pure dispatch. Fake impls give shapes only, for torch.compile/FakeTensor.


def _launch_triton(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, out, lse, scale, causal,
                   chunk_size, window_left, sink_tokens, softcap, max_seqlen_q, max_seqlen_k, num_splits,
                   deterministic) -> None:
    from kvarena.kernels.paged_attention import paged_attention_fwd

    paged_attention_fwd(
        q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, out, lse,
        scale=scale, causal=causal, chunk_size=chunk_size, window_left=window_left,
        sink_tokens=sink_tokens, softcap=softcap, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, num_splits=num_splits, deterministic=deterministic,
    )


def _paged_attention_impl(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_start: torch.Tensor | None,
    scale: float,
    causal: bool,
    chunk_size: int | None,
    window_left: int | None,
    sink_tokens: int,
    softcap: float | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    num_splits: int | None,
    deterministic: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    if backend == "triton":
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        _launch_triton(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, out, lse, scale, causal,
                       chunk_size, window_left, sink_tokens, softcap, max_seqlen_q, max_seqlen_k, num_splits,
                       deterministic)
        return out, lse
    return reference.paged_attention_torch(
        q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q,
        scale=scale, causal=causal, chunk_size=chunk_size, window_left=window_left,
        sink_tokens=sink_tokens, softcap=softcap, kv_start=kv_start,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
    )


_paged_attention_op = torch.library.custom_op(
    "kvarena::paged_attention", _paged_attention_impl, mutates_args=()
)


@_paged_attention_op.register_fake
def _(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, scale, causal, chunk_size,
      window_left, sink_tokens, softcap, max_seqlen_q, max_seqlen_k, num_splits, deterministic, backend):
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=lse_dtype)


def _store_kv_impl(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: str,
) -> None:
    if backend == "triton":
        from kvarena.kernels.store import store_kv_fwd

        store_kv_fwd(k, v, k_cache, v_cache, slot_mapping)
        return
    reference.store_kv_torch(k, v, k_cache, v_cache, slot_mapping)


_store_kv_op = torch.library.custom_op(
    "kvarena::store_kv", _store_kv_impl, mutates_args=("k_cache", "v_cache")
)


@_store_kv_op.register_fake
def _(k, v, k_cache, v_cache, slot_mapping, backend):
    return None


def _merge_impl(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    if backend == "triton":
        from kvarena.kernels.merge import merge_attention_states_fwd

        out = torch.empty_like(out_a)
        lse = torch.empty(out_a.shape[:2], dtype=torch.float32, device=out_a.device)
        merge_attention_states_fwd(out_a, lse_a, out_b, lse_b, out, lse)
        return out, lse
    return reference.merge_attention_states_torch(out_a, lse_a, out_b, lse_b)


_merge_op = torch.library.custom_op(
    "kvarena::merge_attention_states", _merge_impl, mutates_args=()
)


@_merge_op.register_fake
def _(out_a, lse_a, out_b, lse_b, backend):
    lse_dtype = torch.float64 if out_a.dtype == torch.float64 else torch.float32
    return torch.empty_like(out_a), out_a.new_empty(out_a.shape[:2], dtype=lse_dtype)
