"""The PyTorch path of the attention ops (the CPU path, and every gradient the Triton
backward does not give).

* :func:`paged_attention_sdpa`: block-table attention through the CPU flash kernel of
  SDPA, for calls without a position mask; None for anything else.
* :func:`paged_attention_torch`: block-table attention fully batched over a padded
  ``[B, max_seqlen_q, max_seqlen_k]`` score tensor, with no host read of device data
  (only the host maxima shape it), so it runs under FakeTensorMode, on the ``meta``
  device, under ``torch.compile(fullgraph=True)`` and with autograd.
* :func:`store_kv_torch`, :func:`merge_attention_states_torch`: sync-free store and merge.

All compute in fp32 (fp64 when given fp64) and follow docs/contract.md through the rules
of :mod:`kvarena.attention.rules`. Arguments are trusted: ``kvarena.attention.ops`` (or a
pool's plan) validated them, ``cu_seqlens_q`` is a tensor and the maxima are host ints
bounding the real lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvarena.attention.batch import OwnKeys
from kvarena.attention.dtypes import accumulator_dtype
from kvarena.attention.fp8 import dequantize_fp8, fp8_row_scales, quantize_fp8
from kvarena.attention.rules import (
    apply_rope,
    masked_softmax_attend,
    scaled_scores,
    visibility_mask,
)
from kvarena.attention.spec import AttentionSpec

__all__ = [
    "paged_attention_torch",
    "paged_attention_sdpa",
    "store_kv_torch",
    "merge_attention_states_torch",
    "add_sink_logits",
]


def _read_kv(cache: torch.Tensor, scale: torch.Tensor | None, index, dtype: torch.dtype) -> torch.Tensor:
    """``cache[index]`` in ``dtype``, dequantized with ``scale[index]`` for an fp8 cache."""
    x = cache[index]
    if scale is None:
        return x.to(dtype)
    return dequantize_fp8(x, scale[index] if scale.dim() else scale, dtype)


def add_sink_logits(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor | None):
    """Attention without sinks ``(out [N, H, D], lse [N, H])`` -> with one sink logit per head.

    A sink is a key of logit ``sink[h]`` and value 0: the denominator grows from ``e^lse``
    to ``e^lse + e^sink``, so ``out`` scales by ``e^(lse - lse')`` with ``lse' =
    logaddexp(lse, sink)`` (exact; a row with no key keeps ``out = 0`` and gets ``lse' =
    sink``). Differentiable, gradients to ``sink`` included. The scaling runs in the lse's
    precision and the result keeps ``out``'s dtype.
    """
    if sink is None:
        return out, lse
    new = torch.logaddexp(lse, sink.to(lse.dtype)[None, :])
    scale = torch.exp(lse - new)  # 0 for a row with no key (lse = -inf)
    return (out.to(lse.dtype) * scale[..., None]).to(out.dtype), new


@dataclass(frozen=True, eq=False)
class _Padded:
    """A call's packed query rows and block-table keys as a padded ``[B, Mq]`` x ``[B, Mk]`` batch."""

    lens: torch.Tensor  # [B] int64: seq_lens
    q_lens: torch.Tensor  # [B] int64: query rows per sequence
    b_of_r: torch.Tensor  # [total_q]: the sequence of packed row r
    i_of_r: torch.Tensor  # [total_q]: its row within that sequence
    qi: torch.Tensor  # [Mq]: padded row index
    q_valid: torch.Tensor  # [B, Mq]: padded row i of sequence b is a real row
    q_index: torch.Tensor  # [B, Mq]: the packed row of each padded one (0 for padding)
    tk: torch.Tensor  # [Mk]: key position
    k_in: torch.Tensor  # [B, Mk]: key t lies in [kv_start, L)
    key_block: torch.Tensor  # [B, Mk]: the block of key t (0 outside [kv_start, L))
    key_row: torch.Tensor  # [B, Mk]: its row in the block


def _padded(dev: torch.device, block_table, seq_lens, cu_seqlens_q, kv_start, total_q: int, max_seqlen_q: int,
            max_seqlen_k: int, block_size: int) -> _Padded:
    """The padded layout on ``dev``. Only block-table entries below seq_len are dereferenced
    (others point at block 0)."""
    b_count = seq_lens.shape[0]
    lens = seq_lens.long()
    cu = cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]
    r = torch.arange(total_q, device=dev)
    b_of_r = torch.searchsorted(cu[1:], r, right=True).clamp(max=b_count - 1)
    qi = torch.arange(max_seqlen_q, device=dev)
    q_valid = qi[None, :] < q_lens[:, None]
    q_index = torch.where(q_valid, cu[:-1, None] + qi[None, :], torch.zeros_like(q_valid, dtype=torch.long))
    tk = torch.arange(max_seqlen_k, device=dev)
    k_in = tk[None, :] < lens[:, None]
    if kv_start is not None:
        k_in = k_in & (tk[None, :] >= kv_start.long()[:, None])
    blocks = block_table.long()[:, tk // block_size]
    return _Padded(lens, q_lens, b_of_r, r - cu[b_of_r], qi, q_valid, q_index, tk, k_in,
                   torch.where(k_in, blocks, torch.zeros_like(blocks)), (tk % block_size).expand(b_count, -1))


def _with_own_keys(gathered: torch.Tensor, own: torch.Tensor, p: _Padded) -> torch.Tensor:
    """``gathered [B, Mk, H_kv, D]`` with packed row r's own key ``own[r]`` at its position
    ``L - q_len + i``; padding rows (seq_len 0) go to a dummy column Mk, sliced off again."""
    b_count, max_k, h_kv, d = gathered.shape
    pos = (p.lens - p.q_lens)[p.b_of_r] + p.i_of_r  # [total_q]
    pos = torch.where(pos >= 0, pos, torch.full_like(pos, max_k))
    pad = torch.zeros((b_count, 1, h_kv, d), dtype=gathered.dtype, device=gathered.device)
    return torch.cat([gathered, pad], 1).index_put((p.b_of_r, pos), own.to(gathered.dtype))[:, :max_k]


def _rotated_keys(kg: torch.Tensor, p: _Padded, spec: AttentionSpec, k_shift, block_size: int) -> torch.Tensor:
    """RoPE on read of the gathered keys: key t takes row ``t + k_shift[b, t // block_size]``."""
    b_count = kg.shape[0]
    kpos = p.tk.expand(b_count, -1)
    if k_shift is not None:
        block = (p.tk // block_size).clamp(max=k_shift.shape[1] - 1).expand(b_count, -1)
        kpos = kpos + k_shift.long().gather(1, block)
    return apply_rope(kg, kpos[:, :, None], spec.rope_cos, spec.rope_sin, spec.rope_interleaved)


def _rotated_queries(qp: torch.Tensor, p: _Padded, spec: AttentionSpec, q_pos) -> torch.Tensor:
    """RoPE on read of the padded queries: row i of sequence b takes row ``q_pos[b] + i``
    (``q_pos`` None: its position ``L - q_len + i``)."""
    q0 = q_pos.long() if q_pos is not None else p.lens - p.q_lens  # [B]
    pos = (q0[:, None] + p.qi[None, :])[:, :, None, None]  # [B, Mq, 1, 1]
    return apply_rope(qp, pos, spec.rope_cos, spec.rope_sin, spec.rope_interleaved)


def _no_rows(q: torch.Tensor, spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The result of a call without a query row or a key: zeros that stay connected to q
    (gradient 0, as on the Triton path; a where, not q * 0, so a NaN in q cannot reach
    them) and an lse of -inf (sinks added)."""
    dev = q.device
    out = torch.where(torch.zeros((), dtype=torch.bool, device=dev), q, torch.zeros((), dtype=q.dtype, device=dev))
    lse = torch.full(q.shape[:2], float("-inf"), dtype=accumulator_dtype(q.dtype), device=dev)
    return add_sink_logits(out, lse, spec.sink_logits)


def paged_attention_torch(
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
    own: OwnKeys | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    rope_q_pos: torch.Tensor | None = None,
    rope_k_shift: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched, sync-free block-table attention (differentiable).

    ``own``: the query rows' own keys (``own.at_queries``, ``k``/``v`` ``[total_q, H_kv,
    D]``), read instead of the cache at the rows' positions (``L - q_len + i``), so that
    gradients reach the keys a pool has just stored. ``kv_scales = (k_scale, v_scale)``:
    fp8 caches, dequantized as gathered. ``spec.rope_cos``: queries and the gathered keys
    are rotated, at the positions ``rope_q_pos`` / ``rope_k_shift`` give (see
    ``kernels.paged_attention_fwd``).

    Returns
    -------
    ``out [total_q, H_q, D]`` in q's dtype and ``lse [total_q, H_q]`` (fp32, fp64 for fp64).
    """
    total_q, h_q, d = q.shape
    b_count = seq_lens.shape[0]
    block_size, h_kv = k_cache.shape[1], k_cache.shape[2]
    acc = accumulator_dtype(q.dtype)
    if total_q == 0 or max_seqlen_k == 0 or max_seqlen_q == 0 or b_count == 0:
        return _no_rows(q, spec)
    p = _padded(q.device, block_table, seq_lens, cu_seqlens_q, kv_start, total_q, max_seqlen_q, max_seqlen_k, block_size)
    qp = q[p.q_index].to(acc).view(b_count, max_seqlen_q, h_kv, h_q // h_kv, d)  # [B, Mq, H_kv, G, D]
    ks, vs = kv_scales if kv_scales is not None else (None, None)
    kg = _read_kv(k_cache, ks, (p.key_block, p.key_row), acc)  # [B, Mk, H_kv, D]
    vg = _read_kv(v_cache, vs, (p.key_block, p.key_row), acc)
    if own is not None:
        kg, vg = _with_own_keys(kg, own.k, p), _with_own_keys(vg, own.v, p)
    if spec.rope_mode:
        kg = _rotated_keys(kg, p, spec, rope_k_shift, block_size)
        qp = _rotated_queries(qp, p, spec, rope_q_pos)
    q_pos = (p.lens - p.q_lens)[:, None] + p.qi[None, :]  # [B, Mq]
    vis = visibility_mask(q_pos, p.tk.expand(b_count, -1), spec)  # [B, Mq, Mk]
    vis = vis & p.k_in[:, None, :] & p.q_valid[:, :, None]
    # Keys no query row of the sequence sees are zeroed too (a window's old keys, whose
    # blocks a pool may have released and reused): the backward's dS @ K would otherwise
    # meet 0 * NaN there.
    seen = vis.any(1)[..., None, None]  # [B, Mk, 1, 1]
    zero = torch.zeros((), dtype=acc, device=q.device)
    kp, vp = torch.where(seen, kg, zero), torch.where(seen, vg, zero)
    s = scaled_scores(qp, kp, "bmhgd,bkhd->bhgmk", spec.scale_for(d), spec.softcap)  # [B, H_kv, G, Mq, Mk]
    o, lse = masked_softmax_attend(s, vis[:, None, None], vp, "bhgmk,bkhd->bmhgd")  # o [B, Mq, H_kv, G, D]
    out = o[p.b_of_r, p.i_of_r].reshape(total_q, h_q, d)  # back to the packed layout
    lse = lse.permute(0, 3, 1, 2)[p.b_of_r, p.i_of_r].reshape(total_q, h_q)  # [total_q, H_q]
    out, lse = add_sink_logits(out, lse, spec.sink_logits)
    return out.to(q.dtype), lse


# The CPU flash-attention kernel behind SDPA, which also returns the log-sum-exp (torch's
# public SDPA does not). Private aten op (torch >= 2.2); without it the batched path runs.
# (The torch.* binding: ~4 us less per call than going through torch.ops.aten.)
_SDPA_CPU = getattr(torch, "_scaled_dot_product_flash_attention_for_cpu", None)


def _host_values(t: torch.Tensor | None) -> list[int] | None:
    """``t.tolist()`` when reading it costs no sync and no trace: a plain CPU tensor."""
    if t is None:
        return []
    if type(t) is not torch.Tensor or t.device.type != "cpu":
        return None  # FakeTensor, FunctionalTensor, meta or CUDA: no host read
    return t.tolist()


def _position_rule_hides(spec: AttentionSpec, lens: list[int], starts: list[int], q_len: int) -> bool:
    """Whether a position rule hides a key in ``[kv_start, L)`` from some query. The causal
    rule binds hardest on the first query, the window on the last."""
    if not spec.causal and spec.window_left is None:
        return False
    chunk, window = spec.chunk_size, spec.window_left
    for seq_len, start in zip(lens, starts):
        p0 = seq_len - q_len  # the first query's position
        if seq_len == 0 or start >= seq_len:
            continue  # sees nothing: zeroed after the kernel
        if spec.causal and (q_len > 1 if chunk is None else p0 // chunk < (seq_len - 1) // chunk):
            return True  # keys in the causal future of some query
        if window is not None and seq_len - 1 - window > max(start, spec.sink_tokens):
            return True  # the last query's window cuts into the keys in range
    return False


def _gathered_pages(cache: torch.Tensor, scale: torch.Tensor | None, flat: torch.Tensor, shape, strides):
    """The pages of ``flat`` gathered, ``[B * n_blocks, block_size, H_kv, D]`` seen as ``[B,
    H_kv, Mk, D]`` in one as_strided (view + slice + transpose cost ~3-5 us each at these
    sizes); fp8 pages dequantized once, to fp32."""
    if scale is None:
        return cache.index_select(0, flat).as_strided(shape, strides)
    return _read_kv(cache, scale, flat.long(), torch.float32).as_strided(shape, strides)


def _length_mask(k: torch.Tensor, v: torch.Tensor, lens: list[int], starts: list[int], dtype) -> torch.Tensor:
    """The ``[B, 1, 1, Mk]`` additive mask of keys out of ``[kv_start, L)``; those keys are
    zeroed in the fresh gathered copies ``k``, ``v`` so that garbage never meets a weight."""
    t = torch.arange(k.shape[2])
    k_out = (t[None, :] >= torch.tensor(lens)[:, None]) | (t[None, :] < torch.tensor(starts)[:, None])  # [B, Mk]
    k.masked_fill_(k_out[:, None, :, None], 0)
    v.masked_fill_(k_out[:, None, :, None], 0)
    return torch.zeros(len(lens), 1, 1, k.shape[2], dtype=dtype).masked_fill_(k_out[:, None, None, :], float("-inf"))


def _sdpa_table(block_table: torch.Tensor, lens: list[int], block_size: int, n_blocks: int, full: bool):
    """The block ids the gather reads, flat ``[B * n_blocks]``; entries past a sequence's own
    blocks (which may hold anything) point at block 0."""
    table = block_table if block_table.shape[1] == n_blocks else block_table[:, :n_blocks]
    if not full:
        used = torch.tensor([-(-n // block_size) for n in lens])
        table = torch.where(torch.arange(n_blocks)[None, :] < used[:, None], table, torch.zeros_like(table))
    return table.reshape(-1)  # int32 or int64: index_select takes both


def paged_attention_sdpa(
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
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Block-table attention through the CPU flash kernel of SDPA, or None (the CPU fast path).

    Runs when every query row sees every key of its sequence in ``[kv_start, L)`` (decode
    rows, a block-causal chunk attending its whole history, no window cutting in) and all
    sequences have the same query count, on plain CPU tensors without softcap. Then no
    position mask exists, so none is built (the batched path materializes a
    ``[B, H, Mq, Mk]`` fp32 score tensor and its mask: 4-8x slower on the quick bench set);
    keys are gathered once through the block table, and the kernel reads each K/V head for
    its whole GQA group (no repeated K/V). Lengths that differ get a
    ``[B, 1, 1, Mk]`` additive mask and their out-of-range keys zeroed, so garbage in
    slots past ``L`` or before ``kv_start`` never meets a weight. Returns None (the caller
    runs :func:`paged_attention_torch`) for anything else: the same answer either way.

    Arguments are trusted as in :func:`paged_attention_torch`; the lengths are read on
    the host (free for CPU tensors), which is why fake, functional and device tensors
    are declined.
    """
    if _SDPA_CPU is None or spec.softcap is not None or q.device.type != "cpu" or spec.rope_mode:
        return None
    lens, cus, starts = _host_values(seq_lens), _host_values(cu_seqlens_q), _host_values(kv_start)
    if lens is None or cus is None or starts is None or not lens:
        return None
    b_count = len(lens)
    total_q, h_q, d = q.shape
    q_len = cus[1] - cus[0]
    if q_len == 0 or cus != list(range(0, total_q + 1, q_len)) or len(cus) != b_count + 1:
        return None  # ragged query counts: the padded path handles them
    starts = starts or [0] * b_count
    max_k = max(lens)
    if _position_rule_hides(spec, lens, starts, q_len) or max_k == 0:
        return None
    block_size, h_kv = k_cache.shape[1], k_cache.shape[2]
    out_dtype = q.dtype
    n_blocks = -(-max_k // block_size)
    full = all(n == max_k for n in lens) and not any(starts)
    flat = _sdpa_table(block_table, lens, block_size, n_blocks, full)
    kv_shape = (b_count, h_kv, max_k, d)
    kv_strides = (n_blocks * block_size * h_kv * d, d, h_kv * d, 1)
    ks, vs = kv_scales if kv_scales is not None else (None, None)
    k = _gathered_pages(k_cache, ks, flat, kv_shape, kv_strides)
    v = _gathered_pages(v_cache, vs, flat, kv_shape, kv_strides)
    if q.stride(-1) != 1:
        q = q.contiguous()  # the CPU kernel assumes a unit head_dim stride
    if q.dtype in (torch.float16, torch.bfloat16) or kv_scales is not None:
        # The CPU kernel's half-precision path converts each K/V block once per query head
        # (and per query block); converting the gathered K/V once is 1.5-2.5x faster for
        # decode at 128-512 keys and 4-8% faster for 64-query chunks (1 thread, same run).
        q, k, v = q.float(), k.float(), v.float()
    mask = None if full else _length_mask(k, v, lens, starts, q.dtype)
    # q as [B, H_q, Mq, D] (row b * Mq + i of the packed q is query i of sequence b). The
    # kernel maps query head h to kv head h // G itself and lays its out as [B, Mq, H_q, D]
    # in memory, so neither q nor out is copied.
    sq = q.stride()
    qv = q.as_strided((b_count, h_q, q_len, d), (q_len * sq[0], sq[1], sq[0], sq[2]))
    try:
        o, lse = _SDPA_CPU(qv, k, v, 0.0, False, attn_mask=mask, scale=spec.scale_for(d))
    except RuntimeError:
        return None  # an older torch whose CPU kernel refuses H_q != H_kv
    # o [B, H_q, Mq, D], lse [B, H_q, Mq]
    if q_len == 1:
        out, lse = o.reshape(total_q, h_q, d), lse.reshape(total_q, h_q)
    else:
        out = o.transpose(1, 2).reshape(total_q, h_q, d)
        lse = lse.transpose(1, 2).reshape(total_q, h_q)
    empty = [i for i, (n, s) in enumerate(zip(lens, starts)) if s >= n]
    if empty:  # no visible key: out 0, lse -inf (the kernel gives lse 0 there)
        rows = torch.tensor([i * q_len + j for i in empty for j in range(q_len)])
        out[rows] = 0
        lse[rows] = float("-inf")
    out, lse = add_sink_logits(out, lse, spec.sink_logits)
    return out.to(out_dtype), lse


def store_kv_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Sync-free ``store_kv``: no boolean indexing, no host read.

    A skipped row (slot < 0) is redirected to the first valid row's slot *with that row's
    value*, so the duplicate write is identical and harmless; with no valid row at all, it
    rewrites slot 0 with its own current value. Slots must already be validated.
    ``kv_scales``: fp8 caches; per-token scale arrays ``[num_blocks, block_size, H_kv]``
    get each row's :func:`fp8_row_scales`, 0-dim static scales are only read.
    """
    n = slot_mapping.shape[0]
    if n == 0 or k_cache.shape[0] * k_cache.shape[1] == 0:
        return  # nothing to write, or an empty cache (then every slot was validated as < 0)
    block_size = k_cache.shape[1]
    slots = slot_mapping.long()
    valid = slots >= 0
    first = torch.argmax(valid.to(torch.int32))  # 0-d; index of the first valid row (0 if none)
    any_valid = valid.any()
    src = torch.where(valid, torch.arange(n, device=slots.device), first)  # [N]
    first_slot = slots.index_select(0, first.view(1))  # [1]; a 0-d tensor index would read the host
    dst = torch.where(valid, slots, torch.where(any_valid, first_slot, torch.zeros_like(first_slot)))
    blk, row = dst // block_size, dst % block_size
    scales = kv_scales if kv_scales is not None else (None, None)
    for new, cache, sc in ((k, k_cache, scales[0]), (v, v_cache, scales[1])):
        rows = new.index_select(0, src)
        if sc is not None:
            # fp8: quantize, then write bytes (and scales) exactly as the float path writes values.
            if sc.dim():
                row_sc = torch.where(any_valid, fp8_row_scales(rows), sc[0, 0])
                sc.index_put_((blk, row), row_sc)
                rows = quantize_fp8(rows, row_sc)
            else:
                rows = quantize_fp8(rows, sc)
            cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
        # With no valid row every write lands on slot 0 and rewrites its own value: only that
        # one row is read back, not one per token (a per-token gather doubled the cost).
        vals = torch.where(any_valid, rows.to(cache.dtype), cache[0, 0])
        cache.index_put_((blk, row), vals)


def merge_attention_states_torch(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact, sync-free merge of two partial attentions over disjoint key sets.

    ``out_a, out_b [N, H, D]``, ``lse_a, lse_b [N, H]`` (``-inf`` = an empty part, which
    contributes nothing even if its out holds garbage). Returns ``(out [N, H, D] in out_a's
    dtype, lse [N, H] fp32 (fp64 for fp64))``. Differentiable.
    """
    acc = accumulator_dtype(out_a.dtype)
    la, lb = lse_a.to(acc), lse_b.to(acc)
    m = torch.maximum(la, lb)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp(la - m_safe), torch.exp(lb - m_safe)  # [N, H]
    total = wa + wb
    empty = total == 0
    denom = torch.where(empty, torch.ones_like(total), total)
    zero = torch.zeros((), dtype=acc, device=out_a.device)
    part_a = torch.where((wa > 0)[..., None], out_a.to(acc) * wa[..., None], zero)
    part_b = torch.where((wb > 0)[..., None], out_b.to(acc) * wb[..., None], zero)
    out = ((part_a + part_b) / denom[..., None]).to(out_a.dtype)
    lse = torch.where(empty, torch.full_like(m, float("-inf")), m_safe + torch.log(denom))
    return out, lse
