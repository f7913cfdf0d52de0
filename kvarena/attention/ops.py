"""Public attention ops: argument validation and backend dispatch.

Two kinds of entry point:

* The functional ops ``paged_attention``, ``store_kv`` and ``merge_attention_states``
  are one-shot calls: every argument is validated on every call, into an
  :class:`~kvarena.attention.spec.AttentionSpec` for the options.
* :func:`attend` and :func:`store` are what the KV pools call per layer. They trust
  their arguments: the options arrive as an ``AttentionSpec`` (validated when it was
  made), the metadata comes from the pool's own ``plan`` and the pool has checked
  q/k/v against its layout. There is no private flag on the public ops.

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

import os

import torch

from kvarena.attention import reference
from kvarena.attention.spec import AttentionSpec, check_backend

__all__ = [
    "paged_attention",
    "store_kv",
    "merge_attention_states",
    "debug_enabled",
    "attend",
    "attend_with_own_kv",
    "store",
    "resolve_backend",
    "check_no_overlap",
    "check_disjoint",
]

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TORCH_DTYPES = (*KERNEL_DTYPES, torch.float64)
FP8_CACHE_DTYPES = (torch.float8_e4m3fn,)
MAX_HEAD_DIM = 256


def debug_enabled() -> bool:
    """True when ``KVARENA_DEBUG=1``: device-data checks also run for CUDA tensors."""
    return os.environ.get("KVARENA_DEBUG", "0") not in ("", "0")


def _check_values(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" or debug_enabled()


def check_head_dim(name: str, d: int) -> None:
    """The head dims every backend takes: multiples of 8 in [8, 256]."""
    if d % 8 or not 8 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"{name}: head_dim must be a multiple of 8 in [8, {MAX_HEAD_DIM}], got {d}")


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


def _opt_host_int(name: str, value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected None or an int >= 0, got {value!r}")
    if value < 0:
        raise ValueError(f"{name}: expected None or an int >= 0, got {value}")
    return value


def check_no_overlap(name: str, t: torch.Tensor) -> None:
    """Reject a tensor whose elements share memory (a stride-0 / expanded view).

    A written-to tensor (``out``, a cache) must give each element its own address, or
    the writes race and the reads see other rows. The test is the sufficient condition
    of a non-overlapping layout: sorted by stride, each dimension steps past the whole
    extent of the smaller ones (size-1 dimensions are ignored).
    """
    if t.is_contiguous():
        return None  # the common case, answered in C
    dims = sorted((t.stride(i), t.shape[i]) for i in range(t.dim()) if t.shape[i] > 1)
    extent = 1
    for stride, size in dims:
        if stride < extent:
            raise ValueError(
                f"{name}: overlapping memory (strides {t.stride()} for shape {tuple(t.shape)}, "
                "e.g. an expand()ed view); pass a tensor whose elements do not alias"
            )
        extent = stride * size
    return None


def _layout(t: torch.Tensor) -> list[tuple[int, int]]:
    """``(stride, size)`` of ``t``'s dimensions of size > 1, largest stride first."""
    return sorted(((t.stride(i), t.shape[i]) for i in range(t.dim()) if t.shape[i] > 1), reverse=True)


def _lattice_hits(target: int, dims: list[tuple[int, int]]) -> bool:
    """Whether ``target = sum c_i * stride_i`` has a solution with ``|c_i| < size_i`` over
    ``dims`` (a non-overlapping layout, largest stride first: each stride passes the whole
    extent of the smaller ones, so at most two digits fit per dimension)."""
    if not dims:
        return target == 0
    (stride, size), rest = dims[0], dims[1:]
    reach = sum((n - 1) * st for st, n in rest)  # what the smaller dimensions can still add
    lo = max(-(size - 1), -((reach - target) // stride))  # ceil((target - reach) / stride)
    hi = min(size - 1, (target + reach) // stride)
    return any(_lattice_hits(target - c * stride, rest) for c in range(lo, hi + 1))


def _holds_byte(t: torch.Tensor, dims: list[tuple[int, int]], rel: torch.Tensor) -> torch.Tensor:
    """Per byte offset ``rel`` (int64, from ``t.data_ptr()``): does one of ``t``'s elements
    cover it? ``dims``: ``_layout(t)`` of a non-overlapping ``t`` (greedy digits are exact)."""
    isz = t.element_size()
    ok = rel >= 0
    r = rel.clamp(min=0)
    for stride, size in dims:
        c = r // (stride * isz)
        ok &= c < size
        r = r - c.clamp(max=size - 1) * (stride * isz)
    return ok & (r < isz)


def check_disjoint(name: str, t: torch.Tensor, other_name: str, other: torch.Tensor) -> None:
    """Reject ``t`` sharing any byte with ``other`` (both written, or meant to be distinct).

    Equal addresses, a tensor passed twice, views a few elements apart: every overlap, while
    views that interleave without touching (one arena's K and V of a layer) pass. Both must
    have passed :func:`check_no_overlap`. Tensors whose byte spans do not meet cost two
    multiplications; equal layouts are settled on their strides; others (never the case of
    an arena's views) by their elements.
    """
    if t.numel() == 0 or other.numel() == 0 or t.device != other.device:
        return
    spans = []
    for x in (t, other):
        lo = x.data_ptr()
        spans.append((lo, lo + (sum((n - 1) * st for st, n in _layout(x)) + 1) * x.element_size()))
    (a0, a1), (b0, b1) = spans
    if a1 <= b0 or b1 <= a0:
        return
    dims, odims = _layout(t), _layout(other)
    isz = t.element_size()
    if isz == other.element_size() and dims == odims:
        # Element I of t and J of other overlap iff off(J) - off(I) is the address gap to
        # within an element: a multiple of the item size, at most two candidates.
        gap = a0 - b0
        hit = any(_lattice_hits(g, dims) for g in {gap // isz, -(-gap // isz)} if abs(g * isz - gap) < isz)
    else:  # the smaller tensor's bytes, looked up in the other's layout
        small, big, bdims = (t, other, odims) if t.numel() <= other.numel() else (other, t, dims)
        sdims = _layout(small)
        offs = torch.zeros(1, dtype=torch.int64)
        for stride, size in sdims:
            offs = (offs[:, None] + torch.arange(size, dtype=torch.int64)[None, :] * (stride * small.element_size())).flatten()
        base = small.data_ptr() - big.data_ptr()
        hit = False
        for j in range(small.element_size()):
            for part in offs.split(1 << 20):
                if bool(_holds_byte(big, bdims, part + (base + j)).any()):
                    hit = True
                    break
            if hit:
                break
    if hit:
        raise ValueError(
            f"{name}: overlaps {other_name}'s memory (the same tensor, or views of one buffer sharing elements); "
            f"a write to one would change the other: pass separate memory"
        )


def _require_interpreter() -> None:
    """The interpreter is chosen when triton is imported: the flag must be set before."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise RuntimeError(
            "backend='triton' on CPU tensors runs the Triton interpreter: set TRITON_INTERPRET=1 "
            "in the environment before triton is imported (e.g. at the top of the script)"
        )


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype, needs_grad: bool,
                    what: str = "q", *, triton_grad: bool = False) -> str:
    """The backend that runs a call: ``"torch"`` or ``"triton"``.

    ``backend`` is an already validated name. ``triton_grad``: the call's gradients are
    ones the Triton backward computes (attention w.r.t. q and the keys given in the
    call, not w.r.t. a cache tensor). Raises before anything runs when the chosen backend
    cannot serve the call: ``"triton"`` under autograd it cannot differentiate, on a
    device other than CUDA/CPU, on CPU without the interpreter, or for a dtype the kernels
    do not take (``what`` names the tensor in the message).
    """
    if backend == "auto":
        return "triton" if device.type == "cuda" and (triton_grad or not needs_grad) else "torch"
    if backend == "triton":
        if needs_grad and not triton_grad:
            raise ValueError(
                f"backend: 'triton' has no backward for this call's gradient (w.r.t. {what}); the "
                "Triton backward covers attention w.r.t. q and the keys given in the call. Use "
                "backend='auto' or 'torch'"
            )
        if device.type == "cpu":
            _require_interpreter()
        elif device.type not in ("cuda", "meta"):  # meta: a dry run, allocations only
            raise ValueError(f"backend: 'triton' takes CUDA or CPU (interpreter) tensors, got device {device}")
        if dtype not in KERNEL_DTYPES:
            raise TypeError(f"{what}: the Triton kernels take float16, bfloat16 or float32, got {dtype}")
    return backend


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# --------------------------------------------------------------------------- attention


# One int32 ``arange`` per device, sliced for the implicit ``cu_seqlens_q`` of decode calls
# (a fresh arange is ~10 us of a ~60 us validation); it only grows to the largest batch seen.
_ARANGE: dict[torch.device, torch.Tensor] = {}


def _arange_i32(n: int, device: torch.device) -> torch.Tensor:
    base = _ARANGE.get(device)
    if base is None or base.shape[0] < n:
        base = torch.arange(max(n, 64 if base is None else 2 * base.shape[0]), dtype=torch.int32, device=device)
        _ARANGE[device] = base
    return base[:n]


def check_sink_logits(sink: torch.Tensor | None, q: torch.Tensor) -> None:
    """``sink`` (already a 1-D float tensor, see AttentionSpec) fits ``q [.., H_q, D]``."""
    if sink is None:
        return
    h_q = q.shape[-2]
    if sink.shape[0] != h_q:
        raise ValueError(f"sink_logits: expected one logit per query head ({h_q}), got shape {tuple(sink.shape)}")
    if sink.device != q.device:
        raise ValueError(f"sink_logits: expected q's device {q.device}, got {sink.device}")
    want = reference._acc_dtype(q.dtype)  # the lse's dtype
    if sink.dtype != want:
        raise TypeError(f"sink_logits: expected {want} for {q.dtype} queries, got {sink.dtype}")


def check_kv_scales(k_cache: torch.Tensor, k_scale, v_scale, q_dtype: torch.dtype, what: str = "q") -> tuple | None:
    """The fp8 rule of a cache pair: ``(k_scale, v_scale)`` for fp8 caches, None for float ones.

    fp8 caches need both scales: fp32 ``[num_blocks, block_size, H_kv]`` (per token and kv
    head; any strides) or 0-dim fp32 static scales, on the caches' device; their inputs are
    float16, bfloat16 or float32. Float caches take no scales.
    """
    fp8 = k_cache.dtype in FP8_CACHE_DTYPES
    if not fp8:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale/v_scale: only fp8 caches take scales; k_cache is {k_cache.dtype}")
        return None
    if q_dtype not in KERNEL_DTYPES:
        raise TypeError(f"{what}: fp8 caches take float16, bfloat16 or float32 inputs, got {q_dtype}")
    want = tuple(k_cache.shape[:3])
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t is None:
            raise ValueError(f"{name}: an fp8 cache ({k_cache.dtype}) needs its fp32 scales: a "
                             f"[num_blocks, block_size, H_kv] = {list(want)} tensor or a 0-dim static scale")
        _require_tensor(name, t)
        if t.dtype != torch.float32:
            raise TypeError(f"{name}: expected float32 scales, got {t.dtype}")
        if t.dim() and tuple(t.shape) != want:
            raise ValueError(f"{name}: expected shape {want} ([num_blocks, block_size, H_kv]) or a 0-dim static "
                             f"scale, got {tuple(t.shape)}")
        if t.device != k_cache.device:
            raise ValueError(f"{name}: expected the caches' device {k_cache.device}, got {t.device}")
    if k_scale.dim() != v_scale.dim():
        raise ValueError("v_scale: k_scale and v_scale must both be per-token tensors or both 0-dim static scales")
    if k_scale.dim():
        check_no_overlap("k_scale", k_scale)
        check_no_overlap("v_scale", v_scale)
        check_disjoint("v_scale", v_scale, "k_scale", k_scale)
    elif _check_values(k_scale):
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not 0 < float(t) < float("inf"):
                raise ValueError(f"{name}: a static scale must be finite and > 0, got {float(t)}")
    return k_scale, v_scale


def as_bytes(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` as a uint8 view (None and 0-dim tensors, static fp8 scales, as they are).

    An arena's fp8 bytes and fp32 scales are views of one uint8 buffer; torch.compile's
    aot_autograd refuses mutated graph inputs that are views of one base in two dtypes,
    while uint8 views of the uint8 buffer are plain. The pools hand the ops such views
    (``ArenaRegion.op_views``) and the ops view them back with :func:`_from_bytes`.
    """
    return t if t is None or t.dim() == 0 or t.dtype == torch.uint8 else t.view(torch.uint8)


def _from_bytes(k_cache, v_cache, k_scale, v_scale):
    """fp8 caches and scales given as uint8 views (a pool's ``op_views``, a custom op's
    arguments) viewed back as float8_e4m3fn / fp32: ``(k_cache, v_cache, kv_scales or None)``."""
    if k_scale is None:
        return k_cache, v_cache, None
    if k_cache.dtype == torch.uint8:
        k_cache, v_cache = k_cache.view(FP8_CACHE_DTYPES[0]), v_cache.view(FP8_CACHE_DTYPES[0])
    if k_scale.dtype == torch.uint8:
        k_scale, v_scale = k_scale.view(torch.float32), v_scale.view(torch.float32)
    return k_cache, v_cache, (k_scale, v_scale)


def check_rope(spec: AttentionSpec, q: torch.Tensor, block_table: torch.Tensor, rope_q_pos, rope_k_shift):
    """The RoPE-on-read arguments of a call; returns ``rope_pos`` (None or ``(q_pos, k_shift)``).

    The tables (already 2-D fp32, see AttentionSpec) must have ``D / 2`` columns and sit
    on q's device; ``rope_q_pos`` int32 ``[B]``, ``rope_k_shift`` int32 of block_table's
    shape. Position values are checked by :func:`check_rope_values` (CPU, or debug).
    """
    if not spec.rope_mode:
        if rope_q_pos is not None or rope_k_shift is not None:
            raise ValueError("rope_q_pos/rope_k_shift: give rope_cos/rope_sin too (no RoPE on read without tables)")
        return None
    d = q.shape[-1]
    if spec.rope_cos.shape[1] * 2 != d:
        raise ValueError(f"rope_cos: expected D/2 = {d // 2} columns for head_dim {d}, got {spec.rope_cos.shape[1]} "
                         "(partial rotary is not supported)")
    if spec.rope_cos.device != q.device:
        raise ValueError(f"rope_cos: expected q's device {q.device}, got {spec.rope_cos.device}")
    b = block_table.shape[0]
    if rope_q_pos is not None:
        _require_int_tensor("rope_q_pos", rope_q_pos, (b,), q.device)
    if rope_k_shift is not None:
        _require_int_tensor("rope_k_shift", rope_k_shift, tuple(block_table.shape), q.device)
    return None if rope_q_pos is None and rope_k_shift is None else (rope_q_pos, rope_k_shift)


def check_rope_values(spec: AttentionSpec, rope_pos, seq_lens, cu_seqlens_q, block_size: int,
                      kv_start=None) -> None:
    """Query and key positions inside the table (host read: CPU / debug only).

    Rows of sequences with keys, and the keys some query of the sequence can see: in
    ``[kv_start, L)`` and, with a window, at or after its first query's window start
    ``L - q_len - window_left`` (or below ``sink_tokens``). A ``seq_len = 0`` padding row
    sees nothing, and no invisible key is rotated into a result (the kernels clamp rows
    into the table anyway), so a hidden key's shift may point anywhere (StreamingLLM-style
    shifts of blocks outside the window).
    """
    n_pos = spec.rope_cos.shape[0]
    rq, rk = rope_pos if rope_pos is not None else (None, None)
    lens = seq_lens.long().cpu()
    cu = cu_seqlens_q.long().cpu()
    q_lens = cu[1:] - cu[:-1]
    q0 = rq.long().cpu() if rq is not None else lens - q_lens
    starts = kv_start.long().cpu() if kv_start is not None else torch.zeros_like(lens)
    for b in range(lens.shape[0]):
        n_k, n_q, k0 = int(lens[b]), int(q_lens[b]), int(starts[b])
        if n_k == 0 or k0 >= n_k:
            continue  # sees no key: nothing is rotated into its output
        if n_q and (int(q0[b]) < 0 or int(q0[b]) + n_q > n_pos):
            raise ValueError(f"rope_q_pos: sequence {b}'s query positions [{int(q0[b])}, {int(q0[b]) + n_q}) "
                             f"leave the {n_pos}-row rotary table")
        t = torch.arange(k0, n_k)
        if spec.window_left is not None:  # the first query sees the most: t >= p0 - window_left
            t = t[(t >= n_k - n_q - spec.window_left) | (t < spec.sink_tokens)]
        if n_q and t.numel():
            pos = t + (rk[b].long().cpu()[t // block_size] if rk is not None else 0)
            lo, hi = int(pos.min()), int(pos.max())
            if lo < 0 or hi >= n_pos:
                raise ValueError(f"rope_k_shift: sequence {b}'s key positions reach [{lo}, {hi}], outside the "
                                 f"{n_pos}-row rotary table")


def _refuse_rope_triton_grad(spec: AttentionSpec) -> None:
    if spec.rope_mode:
        raise ValueError("rope_cos: the Triton backward does not rotate (RoPE on read); use backend='torch' "
                         "for gradients")


def refuse_fp8_grad(kv_scales, *tensors) -> None:
    """fp8 caches are for inference: a call that needs gradients is a ValueError."""
    if kv_scales is not None and _needs_grad(*tensors):
        raise ValueError("k_cache: fp8 KV caches have no backward (quantization is not differentiable and "
                         "no kernel computes it); run under torch.no_grad() or use a float layout to train")


def _check_out(out, q: torch.Tensor) -> None:
    if out is None:
        return
    _require_tensor("out", out, 3)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"out: expected shape {tuple(q.shape)}, dtype {q.dtype}, device {q.device}; "
            f"got {tuple(out.shape)}, {out.dtype}, {out.device}"
        )
    check_no_overlap("out", out)


def _validate_paged(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, out,
                    max_seqlen_q, max_seqlen_k) -> tuple[torch.Tensor, int, int]:
    """Check one functional call's tensors; returns ``(cu_seqlens_q, max_q, max_k)``."""
    _require_tensor("q", q, 3)
    _require_tensor("k_cache", k_cache, 4)
    _require_tensor("v_cache", v_cache, 4)
    if q.dtype not in TORCH_DTYPES:
        raise TypeError(f"q: expected dtype float16, bfloat16, float32 or float64, got {q.dtype}")
    fp8 = k_cache.dtype in FP8_CACHE_DTYPES
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != (k_cache.dtype if fp8 else q.dtype):
            want = f"k_cache's dtype {k_cache.dtype}" if fp8 else f"q's dtype {q.dtype}"
            raise TypeError(f"{name}: expected {want}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: expected q's device {q.device}, got {t.device}")
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name}: the last (head_dim) dimension must be contiguous, got strides {t.stride()}")
        check_no_overlap(name, t)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache: expected k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    total_q, h_q, d = q.shape
    num_blocks, block_size, h_kv, d_k = k_cache.shape
    if d_k != d:
        raise ValueError(f"k_cache: head_dim {d_k} differs from q's head_dim {d}")
    check_head_dim("q", d)
    if h_kv == 0:
        raise ValueError("k_cache: H_kv (dim 2) must be >= 1")
    if h_q == 0 or h_q % h_kv:
        raise ValueError(f"q: H_q ({h_q}) must be a positive multiple of the caches' H_kv ({h_kv})")
    if block_size < 1:
        raise ValueError(f"k_cache: block_size (dim 1) must be >= 1, got {block_size}")
    _require_tensor("block_table", block_table, 2)
    b, max_blocks = block_table.shape
    _require_int_tensor("block_table", block_table, (b, max_blocks), q.device)
    _require_int_tensor("seq_lens", seq_lens, (b,), q.device)
    max_seqlen_q = _opt_host_int("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _opt_host_int("max_seqlen_k", max_seqlen_k)
    if cu_seqlens_q is None:
        if total_q != b:
            raise ValueError(f"q: with cu_seqlens_q=None there is one query per sequence ({b}), got {total_q}")
        cu = _arange_i32(b + 1, q.device)
        if max_seqlen_q is None:
            max_seqlen_q = 1 if b else 0
    else:
        cu = _require_int_tensor("cu_seqlens_q", cu_seqlens_q, (b + 1,), q.device)
    if kv_start is not None:
        _require_int_tensor("kv_start", kv_start, (b,), q.device)
    _check_out(out, q)
    capacity = max_blocks * block_size
    if max_seqlen_k is not None and max_seqlen_k > capacity:
        raise ValueError(
            f"max_seqlen_k: {max_seqlen_k} exceeds what block_table can address "
            f"({max_blocks} blocks x {block_size} tokens = {capacity})"
        )
    check_values = _check_values(q)
    if check_values or max_seqlen_q is None or max_seqlen_k is None:
        lens = seq_lens.tolist()
        cus = cu.tolist()
        q_lens = [cus[i + 1] - cus[i] for i in range(b)]
        if max_seqlen_q is None:
            max_seqlen_q = max(q_lens, default=0)
        if max_seqlen_k is None:
            max_seqlen_k = max(lens, default=0)
        if check_values:
            _check_paged_values(lens, cus, q_lens, block_table, kv_start, total_q, num_blocks, block_size,
                                capacity, max_seqlen_q, max_seqlen_k)
    return cu, max_seqlen_q, max_seqlen_k


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
    # Only the entries covering 0..L-1 are read; they must name real blocks. One min/max
    # over the used columns settles the usual case; entries past a shorter sequence's own
    # blocks may hold anything, so only a failure there is looked at entry by entry.
    n_used = [-(-n // block_size) for n in lens]
    cols = max(n_used, default=0)
    if cols == 0:
        return
    ids = block_table[:, :cols].cpu()
    lo, hi = torch.aminmax(ids)
    if int(lo) >= 0 and int(hi) < num_blocks:
        return
    used = torch.arange(cols)[None, :] < torch.tensor(n_used)[:, None]
    ids = ids.long()[used]
    bad = (ids < 0) | (ids >= num_blocks)
    if bool(bad.any()):
        raise ValueError(f"block_table: block id {int(ids[bad][0])} out of range [0, {num_blocks}) within seq_lens")


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
        Output buffer (q's shape, dtype and device; no aliasing elements).

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
    cu, max_q, max_k = _validate_paged(
        q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, out, max_seqlen_q, max_seqlen_k
    )
    check_sink_logits(spec.sink_logits, q)
    kv_scales = check_kv_scales(k_cache, k_scale, v_scale, q.dtype)
    refuse_fp8_grad(kv_scales, q, spec.sink_logits, k_cache, v_cache, k_scale, v_scale)
    rope_pos = check_rope(spec, q, block_table, rope_q_pos, rope_k_shift)
    if spec.rope_mode and _check_values(q):
        check_rope_values(spec, rope_pos, seq_lens, cu, k_cache.shape[1], kv_start)
    cache_grad = _needs_grad(k_cache, v_cache, spec.sink_logits)
    what = "k_cache/v_cache/sink_logits" if cache_grad else ("q (RoPE on read)" if spec.rope_mode else "q")
    chosen = resolve_backend(spec.backend, q.device, q.dtype, cache_grad or _needs_grad(q), what,
                             triton_grad=not cache_grad and not spec.rope_mode)
    return attend(q, k_cache, v_cache, block_table, seq_lens, cu, kv_start, spec=spec, max_seqlen_q=max_q,
                  max_seqlen_k=max_k, backend=chosen, out=out, kv_scales=kv_scales, rope_pos=rope_pos)


def attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_start: torch.Tensor | None,
    *,
    spec: AttentionSpec,
    max_seqlen_q: int,
    max_seqlen_k: int,
    backend: str,
    out: torch.Tensor | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    rope_pos: tuple | None = None,
):
    """Block-table attention with already validated arguments (what the pools call).

    ``backend`` is :func:`resolve_backend`'s answer. ``new_kv = (k, v)``, each
    ``[total_q, H_kv, D]``: the keys/values of the query rows themselves, which the
    caller has just stored at the rows' positions; on the differentiable path the
    attention reads them from these tensors (so gradients reach them) instead of from
    the cache. ``kv_scales``: fp8 caches (see :func:`check_kv_scales`; never with
    gradients). ``rope_pos = (q_pos, k_shift)``: RoPE on read positions (either None).
    Returns like :func:`paged_attention`.
    """
    kn, vn = new_kv if new_kv is not None else (None, None)
    if kv_scales is not None and not torch.compiler.is_compiling():
        k_cache, v_cache, kv_scales = _from_bytes(k_cache, v_cache, *kv_scales)
    grad = _needs_grad(q, k_cache, v_cache, kn, vn, spec.sink_logits)
    if grad and backend == "triton":
        # The Triton forward, then the Triton backward (dq, and dk/dv for new_kv): one
        # custom op with an autograd formula and fake kernels, eager or compiled. Sink logits
        # need nothing there: the forward's lse includes them, so P = exp(s - lse) is exact.
        if k_cache.requires_grad or v_cache.requires_grad:
            raise ValueError("k_cache/v_cache: the Triton backward gives no gradient to a cache tensor; "
                             "use backend='torch' (or give the keys as new_kv / own k, v)")
        _refuse_rope_triton_grad(spec)
        if _needs_grad(spec.sink_logits):
            raise ValueError("sink_logits: the Triton backward gives no gradient to sink_logits; use backend='torch'")
        result, lse = torch.ops.kvarena.attention_train(
            q, kn, vn, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, max_seqlen_q,
            max_seqlen_k, _GIVEN_AT_QUERIES, *spec.op_args(),
        )
    elif grad:
        # Differentiable torch path: plain torch ops that autograd (and dynamo) trace through.
        result, lse = reference.paged_attention_torch(
            q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, spec=spec,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, new_kv=new_kv, rope_pos=rope_pos,
        )
    elif backend == "triton" and not torch.compiler.is_compiling():
        # Eager Triton: launch straight into the caller's ``out`` (no extra copy) and skip
        # the lse store when it is not asked for; also skips ~10-20 us of op dispatch.
        result = torch.empty_like(q) if out is None else out
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if spec.return_lse else None
        _launch_triton(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, result, lse, spec,
                       max_seqlen_q, max_seqlen_k, kv_scales=kv_scales, rope_pos=rope_pos)
        return (result, lse) if spec.return_lse else result
    else:
        # Under torch.compile: one opaque custom op with a fake impl. Eager calls the body
        # directly, skipping the ~10-20 us of custom-op dispatch per layer.
        if torch.compiler.is_compiling():
            ks, vs = kv_scales if kv_scales is not None else (None, None)
            rq, rk = rope_pos if rope_pos is not None else (None, None)
            fp8 = kv_scales is not None
            result, lse = torch.ops.kvarena.paged_attention(
                q, as_bytes(k_cache) if fp8 else k_cache, as_bytes(v_cache) if fp8 else v_cache, block_table,
                seq_lens, cu_seqlens_q, kv_start, as_bytes(ks), as_bytes(vs), rq, rk, max_seqlen_q, max_seqlen_k,
                *spec.replace(backend=backend).op_args(),
            )
        else:
            result, lse = _paged_attention_body(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q,
                                                kv_start, spec, max_seqlen_q, max_seqlen_k, backend, kv_scales,
                                                rope_pos)
    if out is not None:
        out.copy_(result)
        result = out
    return (result, lse) if spec.return_lse else result


def attend_with_own_kv(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_start: torch.Tensor | None,
    own_kv: tuple[torch.Tensor, torch.Tensor],
    *,
    spec: AttentionSpec,
    max_seqlen_q: int,
    max_seqlen_k: int,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    rope_pos: tuple | None = None,
):
    """History from the cache plus the step's own k/v in ONE Triton launch, or None.

    ``own_kv = (k, v)``, each ``[B, T, H_kv, D]``: keys after every sequence's cached ones,
    visible to all its queries (a slab denoising step). One online softmax over both
    sources, fp32 throughout (no rounded partials, no merge launch). Returns like
    :func:`attend`, or None when the launch cannot take a second source (the caller then
    attends to each source and merges). Arguments trusted. Under autograd (eager or
    compiled) it always answers: the differentiable op falls back to two launches and a
    merge inside its forward.
    """
    if _needs_grad(q, *own_kv):
        # Differentiable: the Triton backward (dq, and dk/dv of the own keys); its forward
        # falls back to two launches and a merge when one launch cannot take both sources.
        result, lse = torch.ops.kvarena.attention_train(
            q, own_kv[0], own_kv[1], k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start,
            max_seqlen_q, max_seqlen_k, _GIVEN_AFTER_HISTORY, *spec.op_args(),
        )
        return (result, lse) if spec.return_lse else result
    result = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if spec.return_lse else None
    if kv_scales is not None:
        k_cache, v_cache, kv_scales = _from_bytes(k_cache, v_cache, *kv_scales)
    if not _launch_triton(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, result, lse, spec,
                          max_seqlen_q, max_seqlen_k, own_kv=own_kv, kv_scales=kv_scales, rope_pos=rope_pos):
        return None
    return (result, lse) if spec.return_lse else result


def attend_history_and_own(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_start: torch.Tensor | None,
    own_kv: tuple[torch.Tensor, torch.Tensor],
    *,
    own_table: torch.Tensor,
    own_lens: torch.Tensor,
    spec: AttentionSpec,
    spec_lse: AttentionSpec,
    max_seqlen_q: int,
    max_seqlen_k: int,
    backend: str,
    own_kv_start: torch.Tensor | None = None,
    own_max_seqlen_k: int | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    rope_hist: tuple | None = None,
    rope_own: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A denoising step: the cached history plus the step's own k/v.

    ``own_kv`` is either ``[B, T, H_kv, D]``, every sequence's own keys visible to all its
    queries (``own_table`` ``[B, 1]`` = ``arange(B)``, ``own_lens`` = T), or, with
    ``own_max_seqlen_k`` given, a paged view of them read through ``own_table``,
    ``own_lens`` and ``own_kv_start`` (a multi-chunk step, where each chunk sees part of
    the run). Triton with whole own blocks (eager, or under autograd also while
    compiling): :func:`attend_with_own_kv`, one launch. Otherwise, or when that launch
    cannot take both sources, two partial attentions merged by LSE. ``spec_lse`` is
    ``spec`` with ``return_lse``. RoPE on read: ``rope_hist`` / ``rope_own`` are the
    ``(q_pos, k_shift)`` of the history and the own-key launches (the one-launch form
    places own key r at ``q_pos + r``). Returns ``(out, lse)``, ``lse`` None unless
    ``spec.return_lse``.
    """
    paged = own_max_seqlen_k is not None
    grad = _needs_grad(q, *own_kv)
    if grad and backend == "triton":
        _refuse_rope_triton_grad(spec)  # the one-launch form's backward would not rotate either
    if not paged and backend == "triton" and (grad or not torch.compiler.is_compiling()):
        res = attend_with_own_kv(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, own_kv,
                                 spec=spec, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, kv_scales=kv_scales,
                                 rope_pos=rope_hist)
        if res is not None:
            return res if spec.return_lse else (res, None)
    out_h, lse_h = attend(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, spec=spec_lse,
                          max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, backend=backend, kv_scales=kv_scales,
                          rope_pos=rope_hist)
    out_c, lse_c = attend(q, own_kv[0], own_kv[1], own_table, own_lens, cu_seqlens_q, own_kv_start, spec=spec_lse,
                          max_seqlen_q=max_seqlen_q, max_seqlen_k=own_max_seqlen_k if paged else own_kv[0].shape[1],
                          backend=backend, rope_pos=rope_own)
    out, lse = merge(out_h, lse_h, out_c, lse_c, backend)
    return out, (lse if spec.return_lse else None)


# ----------------------------------------------------------------------- Triton backward

# How the keys given in a call relate to the query rows (kernels.paged_attention_bwd).
_GIVEN_AT_QUERIES, _GIVEN_AFTER_HISTORY = 0, 1


def _history_and_own(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, own_kv, spec,
                     max_seqlen_q, max_seqlen_k) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, fp32 lse) over the cached history plus own keys visible to every query."""
    spec = spec.replace(return_lse=True)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    if _launch_triton(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, out, lse, spec,
                      max_seqlen_q, max_seqlen_k, own_kv=own_kv):
        return out, lse
    # Two launches: the history, then the own keys as one block per sequence; exact merge.
    k2, v2 = own_kv
    b, t = k2.shape[0], k2.shape[1]
    out_h, lse_h = _paged_attention_body(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, spec,
                                         max_seqlen_q, max_seqlen_k, "triton")
    table = torch.arange(b, dtype=torch.int32, device=q.device)[:, None]
    lens = torch.full((b,), t, dtype=torch.int32, device=q.device)
    own_spec = spec.replace(causal=False, window_left=None, sink_tokens=0)
    _launch_triton(q, k2, v2, table, lens, cu_seqlens_q, None, out, lse, own_spec, max_seqlen_q, t)
    return merge(out_h, lse_h, out, lse, "triton")


def _attention_train_impl(q, gk, gv, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start,
                          max_seqlen_q, max_seqlen_k, mode, *spec_args):
    spec = AttentionSpec.from_op_args(spec_args)
    if mode == _GIVEN_AFTER_HISTORY:
        return _history_and_own(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, (gk, gv), spec,
                                int(max_seqlen_q), int(max_seqlen_k))
    return _paged_attention_body(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, spec,
                                 int(max_seqlen_q), int(max_seqlen_k), "triton")


def _attention_train_bwd_impl(dout, dlse, q, gk, gv, out, lse, k_cache, v_cache, block_table, seq_lens,
                              cu_seqlens_q, kv_start, max_seqlen_q, mode, *spec_args):
    from kvarena.kernels.paged_attention_bwd import paged_attention_bwd

    given = (gk, gv) if gk is not None else None
    dq, dk, dv = paged_attention_bwd(
        dout, q, out, lse, dlse, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start,
        spec=AttentionSpec.from_op_args(spec_args), max_seqlen_q=int(max_seqlen_q), given=given, given_mode=mode,
    )
    if dk is None:  # no given keys: 0-element placeholders (the schema returns tensors)
        dk, dv = q.new_empty(0), q.new_empty(0)
    return dq, dk, dv


def _attention_train_setup(ctx, inputs, output):
    q, gk, gv, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, max_q, _, mode, *spec_args = inputs
    out, lse = output
    # The arena is saved through .data: a separate version counter, since every later store
    # into the arena (other layers, the next chunk) bumps the shared one and would make
    # autograd refuse a backward that reads blocks nobody touched. The caller keeps the
    # blocks the step read unchanged until backward (docs/contract.md).
    ctx.save_for_backward(q, gk, gv, out, lse, k_cache.data, v_cache.data, block_table, seq_lens, cu_seqlens_q,
                          kv_start)
    ctx.max_seqlen_q, ctx.mode, ctx.spec_args = max_q, mode, spec_args


def _attention_train_backward(ctx, dout, dlse):
    q, gk, gv, out, lse, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.kvarena.attention_train_bwd(
        dout, dlse, q, gk, gv, out, lse, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start,
        ctx.max_seqlen_q, ctx.mode, *ctx.spec_args,
    )
    if gk is None:
        dk = dv = None
    return (dq, dk, dv, *([None] * (9 + len(ctx.spec_args))))


# --------------------------------------------------------------------------- store


def _validate_store(k, v, k_cache, v_cache, slot_mapping) -> None:
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
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"v_cache: expected k_cache's dtype {k_cache.dtype}, got {v_cache.dtype}")
    # fp8 caches take k/v of one input dtype (checked by check_kv_scales); float ones their own.
    want, what = (k.dtype, "k's dtype") if k_cache.dtype in FP8_CACHE_DTYPES else (k_cache.dtype, "the cache dtype")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != want:
            raise TypeError(f"{name}: expected {what} {want}, got {t.dtype}")
    for name, t in (("k", k), ("v", v), ("v_cache", v_cache)):
        if t.device != k_cache.device:
            raise ValueError(f"{name}: expected the cache device {k_cache.device}, got {t.device}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name}: the last (head_dim) dimension must be contiguous, got strides {t.stride()}")
    check_no_overlap("k_cache", k_cache)
    check_no_overlap("v_cache", v_cache)
    check_disjoint("v_cache", v_cache, "k_cache", k_cache)
    _require_int_tensor("slot_mapping", slot_mapping, (k.shape[0],), k_cache.device, (torch.int32, torch.int64))
    if _check_values(k_cache) and slot_mapping.numel():
        reference.check_slots(slot_mapping.long().cpu(), k_cache.shape[0] * k_cache.shape[1])


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
        Strided views are fine; elements must not alias.
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
    _validate_store(k, v, k_cache, v_cache, slot_mapping)
    kv_scales = check_kv_scales(k_cache, k_scale, v_scale, k.dtype, "k")
    if kv_scales is not None and k_scale.dim():  # per-token scales are written too
        for sname, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
            for cname, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
                check_disjoint(sname, sc, cname, cache)
    store(k, v, k_cache, v_cache, slot_mapping, resolve_backend(backend, k_cache.device, k.dtype, False, "k"),
          kv_scales)


def store(k, v, k_cache, v_cache, slot_mapping, backend: str, kv_scales=None) -> None:
    """``store_kv`` with validated arguments and a resolved backend (what the pools call)."""
    ks, vs = kv_scales if kv_scales is not None else (None, None)
    if torch.compiler.is_compiling():
        if kv_scales is not None:
            k_cache, v_cache, ks, vs = as_bytes(k_cache), as_bytes(v_cache), as_bytes(ks), as_bytes(vs)
        torch.ops.kvarena.store_kv(k.detach(), v.detach(), k_cache, v_cache, slot_mapping, backend, ks, vs)
    else:
        _store_kv_impl(k.detach(), v.detach(), k_cache, v_cache, slot_mapping, backend, ks, vs)


# --------------------------------------------------------------------------- merge


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
        _require_tensor(name, t, 3)
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        _require_tensor(name, t, 2)
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
    needs_grad = _needs_grad(out_a, lse_a, out_b, lse_b)
    return merge(out_a, lse_a, out_b, lse_b, resolve_backend(backend, out_a.device, out_a.dtype, needs_grad, "out_a"))


def merge(out_a, lse_a, out_b, lse_b, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``merge_attention_states`` with validated arguments and a resolved backend."""
    if backend == "torch" and _needs_grad(out_a, lse_a, out_b, lse_b):
        return reference.merge_attention_states_torch(out_a, lse_a, out_b, lse_b)
    op = torch.ops.kvarena.merge_attention_states if torch.compiler.is_compiling() else _merge_impl
    return op(out_a, lse_a, out_b, lse_b, backend)


# --------------------------------------------------------------------------- custom ops
# Each op takes validated arguments plus the resolved backend, so the op body is pure
# dispatch. The attention op's option arguments are generated from AttentionSpec's fields
# (AttentionSpec.op_schema / op_args / from_op_args): one list of options for the public
# op, the custom op, its fake, the launcher, the torch path and the oracle.


def _launch_triton(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, out, lse, spec,
                   max_seqlen_q, max_seqlen_k, own_kv=None, kv_scales=None, rope_pos=None) -> bool:
    if q.device.type == "meta":
        return True  # a dry run: the caller's outputs are allocated, no kernel runs
    from kvarena.kernels.paged_attention import paged_attention_fwd

    return paged_attention_fwd(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, out, lse,
                               spec=spec, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, own_kv=own_kv,
                               kv_scales=kv_scales, rope_pos=rope_pos)


def _paged_attention_body(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, spec,
                          max_seqlen_q, max_seqlen_k, backend, kv_scales=None,
                          rope_pos=None) -> tuple[torch.Tensor, torch.Tensor]:
    if backend == "triton":
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        _launch_triton(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, out, lse, spec,
                       max_seqlen_q, max_seqlen_k, kv_scales=kv_scales, rope_pos=rope_pos)
        return out, lse
    # No gradient here: the SDPA route when the call has no position mask, else the batched one.
    args = (q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start)
    kw = dict(spec=spec, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, kv_scales=kv_scales)
    fast = reference.paged_attention_sdpa(*args, **kw)
    return fast if fast is not None else reference.paged_attention_torch(*args, **kw, rope_pos=rope_pos)


_LIB = torch.library.Library("kvarena", "FRAGMENT")
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
    k_cache, v_cache, kv_scales = _from_bytes(k_cache, v_cache, k_scale, v_scale)
    rope_pos = None if rope_q_pos is None and rope_k_shift is None else (rope_q_pos, rope_k_shift)
    out, lse = _paged_attention_body(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, spec,
                                     int(max_seqlen_q), int(max_seqlen_k), backend, kv_scales, rope_pos)
    return out, lse


def _paged_attention_op_fake(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, k_scale, v_scale,
                             rope_q_pos, rope_k_shift, max_seqlen_q, max_seqlen_k, *spec_args):
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=lse_dtype)


_LIB.impl("paged_attention", _paged_attention_op_impl, "CompositeExplicitAutograd")
torch.library.register_fake("kvarena::paged_attention", _paged_attention_op_fake, lib=_LIB)

# The differentiable Triton attention (training): forward with lse, and its backward, each
# an opaque op with a fake kernel so torch.compile(fullgraph=True) keeps the Triton
# backward (no [queries x keys] tensor) in its graphs.
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
_LIB.impl("attention_train", _attention_train_impl, "CompositeExplicitAutograd")
_LIB.impl("attention_train_bwd", _attention_train_bwd_impl, "CompositeExplicitAutograd")
torch.library.register_fake(
    "kvarena::attention_train",
    lambda q, *args: (torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)), lib=_LIB,
)


def _attention_train_bwd_fake(dout, dlse, q, gk, gv, *args):
    if gk is None:
        return torch.empty_like(q), q.new_empty(0), q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(gk), torch.empty_like(gv)


torch.library.register_fake("kvarena::attention_train_bwd", _attention_train_bwd_fake, lib=_LIB)
torch.library.register_autograd("kvarena::attention_train", _attention_train_backward,
                                setup_context=_attention_train_setup, lib=_LIB)


def _store_kv_impl(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: str,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    k_cache, v_cache, kv_scales = _from_bytes(k_cache, v_cache, k_scale, v_scale)
    if backend == "triton":
        from kvarena.kernels.store import store_kv_fwd

        if k_cache.device.type != "meta":  # meta: a dry run (shapes and allocations only)
            store_kv_fwd(k, v, k_cache, v_cache, slot_mapping, kv_scales)
        return
    reference.store_kv_torch(k, v, k_cache, v_cache, slot_mapping, kv_scales)


_store_kv_op = torch.library.custom_op(
    "kvarena::store_kv", _store_kv_impl, mutates_args=("k_cache", "v_cache", "k_scale", "v_scale")
)


@_store_kv_op.register_fake
def _(k, v, k_cache, v_cache, slot_mapping, backend, k_scale=None, v_scale=None):
    return None


def _merge_impl(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    if backend == "triton":
        from kvarena.kernels.merge import merge_attention_states_fwd

        out = torch.empty_like(out_a)
        lse = torch.empty(out_a.shape[:2], dtype=torch.float32, device=out_a.device)
        if out.device.type != "meta":  # meta: a dry run
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
