"""Argument validation of the attention ops: shapes, dtypes, devices, aliasing, and the
value checks (block tables, lengths, slots) that run on CPU tensors and, on CUDA, only
under ``KVARENA_DEBUG=1`` so the hot path never synchronizes with the device."""

from __future__ import annotations

import os

import torch

from kvarena.argcheck import check_opt_int
from kvarena.attention.dtypes import FP8_CACHE_DTYPES, MAX_HEAD_DIM, TORCH_DTYPES, accumulator_dtype
from kvarena.attention.spec import AttentionSpec


def debug_enabled() -> bool:
    """True when ``KVARENA_DEBUG=1``: device-data checks also run for CUDA tensors."""
    return os.environ.get("KVARENA_DEBUG", "0") not in ("", "0")


def check_values(t: torch.Tensor) -> bool:
    """Whether the ops check the values of ``t`` (block ids, lengths): on CPU outside
    ``torch.compile`` (a host read there is a graph break), and anywhere under
    ``KVARENA_DEBUG=1``."""
    return (t.device.type == "cpu" and not torch.compiler.is_compiling()) or debug_enabled()


def check_head_dim(name: str, d: int) -> None:
    """The head dims every backend takes: multiples of 8 in [8, 256]."""
    if d % 8 or not 8 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"{name}: head_dim must be a multiple of 8 in [8, {MAX_HEAD_DIM}], got {d}")


def require_tensor(name: str, t, ndim: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}")
    return t


def require_int_tensor(name: str, t, shape: tuple[int, ...], device: torch.device, dtypes=(torch.int32,)):
    require_tensor(name, t, len(shape))
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    return t


def check_no_overlap(name: str, t: torch.Tensor) -> None:
    """Reject a tensor whose elements share memory (a stride-0 / expanded view).

    A written-to tensor (``out``, a cache) must give each element its own address, or
    the writes race and the reads see other rows. The test is the sufficient condition
    of a non-overlapping layout: sorted by stride, each dimension steps past the whole
    extent of the smaller ones (size-1 dimensions are ignored).
    """
    if not is_non_overlapping(t):
        raise ValueError(
            f"{name}: overlapping memory (strides {t.stride()} for shape {tuple(t.shape)}, "
            "e.g. an expand()ed view); pass a tensor whose elements do not alias"
        )


def is_non_overlapping(t: torch.Tensor) -> bool:
    """Whether no two elements of ``t`` share an address (the sufficient test above)."""
    if t.is_contiguous():
        return True  # the common case, answered in C
    dims = sorted((t.stride(i), t.shape[i]) for i in range(t.dim()) if t.shape[i] > 1)
    extent = 1
    for stride, size in dims:
        if stride < extent:
            return False
        extent = stride * size
    return True


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
    (a0, a1), (b0, b1) = _span(t), _span(other)
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


def check_written_apart(name: str, t: torch.Tensor, inputs: dict) -> None:
    """Reject a written tensor ``t`` (``out``, a cache) sharing memory with any of ``inputs``
    (name -> tensor or None): a kernel writing ``t`` while it reads an input would read its
    own output. ``t`` must have passed :func:`check_no_overlap`; an input that aliases itself
    (an expanded view) is refused when its byte span meets ``t``'s."""
    if t.numel() == 0:
        return
    a0, a1 = _span(t)
    for other_name, other in inputs.items():
        if not isinstance(other, torch.Tensor) or other.numel() == 0 or other.device != t.device:
            continue
        b0, b1 = _span(other)
        if a1 <= b0 or b1 <= a0:
            continue  # the common case: two data_ptr reads and a few multiplications
        if is_non_overlapping(other):
            check_disjoint(name, t, other_name, other)
        else:
            raise ValueError(f"{name}: overlaps {other_name}'s memory (an aliasing view of the same buffer); "
                             "a write to one would change the other: pass separate memory")


def _span(t: torch.Tensor) -> tuple[int, int]:
    """``[first byte, last byte + 1)`` of ``t`` (strides are non-negative in torch)."""
    lo = t.data_ptr()
    return lo, lo + (sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 1) + 1) * t.element_size()


# One int32 ``arange`` per device, sliced for the implicit ``cu_seqlens_q`` of decode calls
# (a fresh arange is ~10 us of a ~60 us validation); it only grows to the largest batch seen.
_ARANGE: dict[torch.device, torch.Tensor] = {}


def arange_i32(n: int, device: torch.device) -> torch.Tensor:
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
    want = accumulator_dtype(q.dtype)  # the lse's dtype
    if sink.dtype != want:
        raise TypeError(f"sink_logits: expected {want} for {q.dtype} queries, got {sink.dtype}")


def check_rope(spec: AttentionSpec, q: torch.Tensor, block_table: torch.Tensor, rope_q_pos, rope_k_shift):
    """The RoPE-on-read arguments of a call, checked; returns ``(rope_q_pos, rope_k_shift)``.

    The tables (already 2-D fp32, see AttentionSpec) must have ``D / 2`` columns and sit
    on q's device; ``rope_q_pos`` int32 ``[B]``, ``rope_k_shift`` int32 of block_table's
    shape. Position values are checked by :func:`check_rope_values` (CPU, or debug).
    """
    if not spec.rope_mode:
        if rope_q_pos is not None or rope_k_shift is not None:
            raise ValueError("rope_q_pos/rope_k_shift: give rope_cos/rope_sin too (no RoPE on read without tables)")
        return None, None
    d = q.shape[-1]
    if spec.rope_cos.shape[1] * 2 != d:
        raise ValueError(f"rope_cos: expected D/2 = {d // 2} columns for head_dim {d}, got {spec.rope_cos.shape[1]} "
                         "(partial rotary is not supported)")
    if spec.rope_cos.device != q.device:
        raise ValueError(f"rope_cos: expected q's device {q.device}, got {spec.rope_cos.device}")
    b = block_table.shape[0]
    if rope_q_pos is not None:
        require_int_tensor("rope_q_pos", rope_q_pos, (b,), q.device)
    if rope_k_shift is not None:
        require_int_tensor("rope_k_shift", rope_k_shift, tuple(block_table.shape), q.device)
    return rope_q_pos, rope_k_shift


def check_rope_values(spec: AttentionSpec, rope_q_pos, rope_k_shift, seq_lens, cu_seqlens_q, block_size: int,
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
    rq, rk = rope_q_pos, rope_k_shift
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


def check_fp8_format(name: str, t: torch.Tensor) -> None:
    """A float8 cache must be OCP ``float8_e4m3fn``: that is what the store quantizes to on
    every target (decoded in registers where the hardware's own fp8 differs, as gfx942's
    e4m3fnuz does). Another float8 format (``float8_e4m3fnuz``, ``float8_e5m2``) is refused
    by name rather than read with the wrong bias or NaN encoding."""
    if t.dtype.is_floating_point and t.element_size() == 1 and t.dtype not in FP8_CACHE_DTYPES:
        raise TypeError(f"{name}: float8 caches must be torch.float8_e4m3fn (OCP e4m3, served on every target), "
                        f"got {t.dtype}")


def check_out(out, q: torch.Tensor) -> None:
    if out is None:
        return
    require_tensor("out", out, 3)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"out: expected shape {tuple(q.shape)}, dtype {q.dtype}, device {q.device}; "
            f"got {tuple(out.shape)}, {out.dtype}, {out.device}"
        )
    check_no_overlap("out", out)


def validate_paged(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, out,
                    max_seqlen_q, max_seqlen_k) -> tuple[torch.Tensor, int, int]:
    """Check one functional call's tensors; returns ``(cu_seqlens_q, max_q, max_k)``."""
    require_tensor("q", q, 3)
    require_tensor("k_cache", k_cache, 4)
    require_tensor("v_cache", v_cache, 4)
    if q.dtype not in TORCH_DTYPES:
        raise TypeError(f"q: expected dtype float16, bfloat16, float32 or float64, got {q.dtype}")
    fp8 = k_cache.dtype in FP8_CACHE_DTYPES
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_fp8_format(name, t)
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
    require_tensor("block_table", block_table, 2)
    b, max_blocks = block_table.shape
    require_int_tensor("block_table", block_table, (b, max_blocks), q.device)
    require_int_tensor("seq_lens", seq_lens, (b,), q.device)
    max_seqlen_q = check_opt_int("max_seqlen_q", max_seqlen_q, 0)
    max_seqlen_k = check_opt_int("max_seqlen_k", max_seqlen_k, 0)
    if cu_seqlens_q is None:
        if total_q != b:
            raise ValueError(f"q: with cu_seqlens_q=None there is one query per sequence ({b}), got {total_q}")
        cu = arange_i32(b + 1, q.device)
        if max_seqlen_q is None:
            max_seqlen_q = 1 if b else 0
    else:
        cu = require_int_tensor("cu_seqlens_q", cu_seqlens_q, (b + 1,), q.device)
    if kv_start is not None:
        require_int_tensor("kv_start", kv_start, (b,), q.device)
    check_out(out, q)
    capacity = max_blocks * block_size
    if max_seqlen_k is not None and max_seqlen_k > capacity:
        raise ValueError(
            f"max_seqlen_k: {max_seqlen_k} exceeds what block_table can address "
            f"({max_blocks} blocks x {block_size} tokens = {capacity})"
        )
    by_value = check_values(q)
    if by_value or max_seqlen_q is None or max_seqlen_k is None:
        lens = seq_lens.tolist()
        cus = cu.tolist()
        q_lens = [cus[i + 1] - cus[i] for i in range(b)]
        if max_seqlen_q is None:
            max_seqlen_q = max(q_lens, default=0)
        if max_seqlen_k is None:
            max_seqlen_k = max(lens, default=0)
        if by_value:
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


def validate_store(k, v, k_cache, v_cache, slot_mapping) -> None:
    require_tensor("k", k, 3)
    require_tensor("v", v, 3)
    require_tensor("k_cache", k_cache, 4)
    require_tensor("v_cache", v_cache, 4)
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
    require_int_tensor("slot_mapping", slot_mapping, (k.shape[0],), k_cache.device, (torch.int32, torch.int64))
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):  # the kernel reads k, v while it writes
        check_written_apart(name, cache, {"k": k, "v": v, "slot_mapping": slot_mapping})
    if check_values(k_cache) and slot_mapping.numel():
        check_slots(slot_mapping.long().cpu(), k_cache.shape[0] * k_cache.shape[1])


def check_slots(slots: torch.Tensor, capacity: int) -> torch.Tensor:
    """Host check of a store's slots (int64 CPU ``[N]``); returns the used (``>= 0``) ones.

    Raises ``ValueError`` naming ``slot_mapping`` for a slot past the cache or used twice.
    """
    used = slots[slots >= 0]
    if used.numel() and int(used.max()) >= capacity:
        raise ValueError(f"slot_mapping: slot {int(used.max())} is past the cache ({capacity} slots)")
    if used.unique().numel() != used.numel():
        raise ValueError("slot_mapping: a slot appears twice in one store_kv call")
    return used
