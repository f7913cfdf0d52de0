"""Plain-PyTorch attention ops: the oracle every kernel is tested against, and the CPU path.

Two implementations of block-table attention live here on purpose:

* ``paged_attention_ref`` is the *oracle*: one Python iteration per sequence, host reads
  of ``seq_lens``/``cu_seqlens_q``, K/V gathered block by block and GQA expanded with
  ``repeat_interleave``. Simple enough to be checked by eye (and by a per-query fp64
  loop in the tests).
* ``paged_attention_torch`` is the *CPU path* used by the caches' ``forward``: fully
  batched over a padded ``[B, max_seqlen_q, max_seqlen_k]`` score tensor, with no host
  read of device data (only the host maxima shape it), so it runs under FakeTensorMode,
  on the ``meta`` device, under ``torch.compile(fullgraph=True)`` and with autograd.

Both compute in fp32 (fp64 when given fp64) and follow the semantics of docs/contract.md:
queries bottom-right aligned, keys ``t < kv_start`` invisible, ``causal`` /
``chunk_size`` (block-causal) / ``window_left`` + ``sink_tokens`` masks, optional
``softcap``, rows that see no key give ``out = 0`` and ``lse = -inf``. Slots outside
a sequence's visible range are never allowed to reach the output (NaN there stays there).
"""


from __future__ import annotations

import torch

from kvarena.attention.checks import check_slots
from kvarena.attention.dtypes import accumulator_dtype
from kvarena.attention.fp8 import dequantize_fp8, fp8_row_scales, quantize_fp8
from kvarena.attention.spec import AttentionSpec

__all__ = [
    "paged_attention_ref",
    "paged_attention_torch",
    "paged_attention_sdpa",
    "store_kv_ref",
    "store_kv_torch",
    "merge_attention_states_ref",
    "merge_attention_states_torch",
    "visibility_mask",
]


def apply_rope(x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               interleaved: bool) -> torch.Tensor:
    """``x [..., D]`` rotated by table rows ``pos [...]`` (``cos``/``sin`` ``[P, D/2]``), in x's dtype.

    Pairs ``(2i, 2i+1)`` when ``interleaved``, else ``(i, i + D/2)``; out-of-table rows
    are clamped (as the kernels do; the pools validate positions). Differentiable in x.
    """
    p = pos.long().clamp(0, cos.shape[0] - 1)
    c, s = cos[p].to(x.dtype), sin[p].to(x.dtype)  # [..., D/2]
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)


def _read_kv(cache: torch.Tensor, scale: torch.Tensor | None, index, dtype: torch.dtype) -> torch.Tensor:
    """``cache[index]`` in ``dtype``, dequantized with ``scale[index]`` for an fp8 cache."""
    x = cache[index]
    if scale is None:
        return x.to(dtype)
    return dequantize_fp8(x, scale[index] if scale.dim() else scale, dtype)


def visibility_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """Boolean mask ``[..., Q, K]`` of the position rules (not the length/kv_start rules).

    Parameters
    ----------
    q_pos : Tensor ``[..., Q]`` of query positions.
    k_pos : Tensor ``[..., K]`` of key positions.
    spec : AttentionSpec
        ``causal``, ``chunk_size``, ``window_left`` and ``sink_tokens`` are read.
    """
    qp = q_pos.unsqueeze(-1)  # [..., Q, 1]
    kp = k_pos.unsqueeze(-2)  # [..., 1, K]
    vis = torch.ones(torch.broadcast_shapes(qp.shape, kp.shape), dtype=torch.bool, device=q_pos.device)
    if spec.causal:
        if spec.chunk_size is not None:
            c = spec.chunk_size
            vis = vis & (torch.div(kp, c, rounding_mode="floor") <= torch.div(qp, c, rounding_mode="floor"))
        else:
            vis = vis & (kp <= qp)
    if spec.window_left is not None:
        vis = vis & ((kp >= qp - spec.window_left) | (kp < spec.sink_tokens))
    return vis


def _masked_softmax_attend(
    scores: torch.Tensor, vis: torch.Tensor, v: torch.Tensor, equation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the last dim of ``scores`` restricted to ``vis``, then ``@ v``.

    ``vis`` broadcasts to ``scores``. Returns ``(out, lse)``; a row with no visible key
    gives ``out = 0``, ``lse = -inf``. A non-finite value in a key a row cannot see never
    reaches that row (``0 * NaN`` would): values are multiplied with non-finite entries
    zeroed, and a row that sees a non-finite value gets NaN in that head.
    """
    neg_inf = torch.tensor(float("-inf"), dtype=scores.dtype, device=scores.device)
    s = torch.where(vis, scores, neg_inf)
    m = s.amax(dim=-1, keepdim=True)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m_safe)  # masked entries: exp(-inf) = 0
    denom = p.sum(dim=-1, keepdim=True)
    empty = denom == 0
    finite = torch.isfinite(v)
    v_clean = torch.where(finite, v, torch.zeros((), dtype=v.dtype, device=v.device))
    out = torch.einsum(equation, p / torch.where(empty, torch.ones_like(denom), denom), v_clean)
    # [..., 1] per output row and head: how many visible keys hold a non-finite value.
    bad = (~finite).any(dim=-1, keepdim=True).to(v.dtype)
    hits = torch.einsum(equation, vis.to(v.dtype).expand(p.shape), bad)
    out = torch.where(hits > 0, torch.full((), float("nan"), dtype=out.dtype, device=out.device), out)
    lse = torch.where(empty, neg_inf, m_safe + torch.log(torch.where(empty, torch.ones_like(denom), denom)))
    return out, lse.squeeze(-1)


def _scores(q: torch.Tensor, k: torch.Tensor, equation: str, scale: float, softcap: float | None) -> torch.Tensor:
    s = torch.einsum(equation, q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    return s


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    *,
    kv_start: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    out: torch.Tensor | None = None,
    spec: AttentionSpec | None = None,
    **options,
):
    """Oracle block-table attention: one Python iteration per sequence.

    Parameters
    ----------
    q : ``[total_q, H_q, D]``.
    k_cache, v_cache : ``[num_blocks, block_size, H_kv, D]``.
    block_table : int ``[B, max_blocks]``.
    seq_lens : int ``[B]``.
    cu_seqlens_q : int ``[B + 1]`` or None (one query per sequence).
    kv_start : int ``[B]`` or None.
    spec : AttentionSpec, optional
        The options; ``**options`` (the same keywords as
        :func:`kvarena.paged_attention`: ``scale``, ``causal``, ``window_left``, ...)
        build one, or override ``spec``'s fields. ``backend``, ``num_splits`` and
        ``deterministic`` do not change the oracle's answer.

    Returns
    -------
    ``out [total_q, H_q, D]`` in q's dtype, and with ``return_lse`` also
    ``lse [total_q, H_q]`` (fp32; fp64 for fp64 inputs).
    """
    del max_seqlen_q, max_seqlen_k  # the oracle reads the lengths themselves
    spec = AttentionSpec(**options) if spec is None else spec.replace(**options)
    total_q, h_q, d = q.shape
    block_size, h_kv = k_cache.shape[1], k_cache.shape[2]
    group = h_q // h_kv
    acc = accumulator_dtype(q.dtype)
    scale = spec.scale_for(d)
    lens = seq_lens.tolist()
    b_count = len(lens)
    cu = list(range(b_count + 1)) if cu_seqlens_q is None else cu_seqlens_q.tolist()
    starts = [0] * b_count if kv_start is None else kv_start.tolist()
    res = torch.zeros(total_q, h_q, d, dtype=acc, device=q.device)
    lse = torch.full((total_q, h_q), float("-inf"), dtype=acc, device=q.device)
    for b in range(b_count):
        seq_len, q0, q1 = lens[b], cu[b], cu[b + 1]
        q_len = q1 - q0
        if q_len == 0 or seq_len == 0:
            continue
        n_blocks = -(-seq_len // block_size)
        blocks = block_table[b, :n_blocks].long()
        k = k_cache[blocks].reshape(n_blocks * block_size, h_kv, d)[:seq_len].to(acc)
        v = v_cache[blocks].reshape(n_blocks * block_size, h_kv, d)[:seq_len].to(acc)
        k = k.repeat_interleave(group, dim=1)  # [L, H_q, D]
        v = v.repeat_interleave(group, dim=1)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        vis = visibility_mask(q_pos, k_pos, spec) & (k_pos >= starts[b])  # [Q, L]
        # Invisible keys are zeroed so that garbage (even NaN) in them cannot leak via 0 * NaN.
        key_ok = (k_pos >= starts[b])[:, None, None]
        k = torch.where(key_ok, k, torch.zeros_like(k))
        v = torch.where(key_ok, v, torch.zeros_like(v))
        s = _scores(q[q0:q1].to(acc), k, "qhd,khd->hqk", scale, spec.softcap)  # [H_q, Q, L]
        o, l_ = _masked_softmax_attend(s, vis.unsqueeze(0), v, "hqk,khd->qhd")
        res[q0:q1] = o
        lse[q0:q1] = l_.transpose(0, 1)
    result = res.to(q.dtype)
    if out is not None:
        out.copy_(result)
        result = out
    if spec.return_lse:
        return result, lse if acc == torch.float64 else lse.float()
    return result


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
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    rope_pos: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched, sync-free block-table attention (the CPU path; differentiable).

    All arguments are already validated by ``kvarena.attention.ops``: ``cu_seqlens_q`` is
    a tensor and the maxima are host ints bounding the real lengths. ``new_kv = (k, v)``
    ``[total_q, H_kv, D]`` are read instead of the cache at the query rows' own
    positions (``L - q_len + i``), so that gradients reach the keys a pool has just
    stored. ``kv_scales = (k_scale, v_scale)``: fp8 caches, dequantized as gathered.
    ``spec.rope_cos``: queries and the gathered keys are rotated, at the positions
    ``rope_pos = (q_pos, k_shift)`` give (see ``kernels.paged_attention_fwd``).

    Returns
    -------
    ``out [total_q, H_q, D]`` in q's dtype and ``lse [total_q, H_q]`` (fp32, fp64 for fp64).
    """
    total_q, h_q, d = q.shape
    b_count = seq_lens.shape[0]
    block_size, h_kv = k_cache.shape[1], k_cache.shape[2]
    group = h_q // h_kv
    acc = accumulator_dtype(q.dtype)
    dev = q.device
    if total_q == 0 or max_seqlen_k == 0 or max_seqlen_q == 0 or b_count == 0:
        # Zeros that stay connected to q (gradient 0, as on the Triton path; a where, not
        # q * 0, so a NaN in q cannot reach them).
        out = torch.where(torch.zeros((), dtype=torch.bool, device=dev), q, torch.zeros((), dtype=q.dtype, device=dev))
        lse = torch.full((total_q, h_q), float("-inf"), dtype=acc, device=dev)
        return add_sink_logits(out, lse, spec.sink_logits)
    lens = seq_lens.long()
    cu = cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]  # [B]
    # Packed query row r belongs to sequence b(r), row i(r) of it.
    r = torch.arange(total_q, device=dev)
    b_of_r = torch.searchsorted(cu[1:], r, right=True).clamp(max=b_count - 1)
    i_of_r = r - cu[b_of_r]

    # Queries, padded to [B, Mq]: row i of sequence b is token cu[b] + i.
    qi = torch.arange(max_seqlen_q, device=dev)
    q_valid = qi[None, :] < q_lens[:, None]  # [B, Mq]
    q_rows = torch.where(q_valid, cu[:-1, None] + qi[None, :], torch.zeros_like(q_valid, dtype=torch.long))
    qp = q[q_rows].to(acc).view(b_count, max_seqlen_q, h_kv, group, d)  # [B, Mq, H_kv, G, D]

    # Keys, gathered through the block table into [B, Mk]. Only entries below seq_len are
    # dereferenced (others point at block 0), and keys out of [kv_start, L) are zeroed.
    tk = torch.arange(max_seqlen_k, device=dev)
    k_in = tk[None, :] < lens[:, None]  # [B, Mk]
    if kv_start is not None:
        k_in = k_in & (tk[None, :] >= kv_start.long()[:, None])
    blocks = block_table.long()[:, tk // block_size]  # [B, Mk]
    blocks = torch.where(k_in, blocks, torch.zeros_like(blocks))
    rows = (tk % block_size).expand(b_count, -1)
    ks, vs = kv_scales if kv_scales is not None else (None, None)
    kg = _read_kv(k_cache, ks, (blocks, rows), acc)  # [B, Mk, H_kv, D]
    vg = _read_kv(v_cache, vs, (blocks, rows), acc)
    if new_kv is not None:
        # Row r's own key sits at position L - q_len + i; padding rows (seq_len 0) go to a
        # dummy column Mk that is sliced off again.
        pos = (lens - q_lens)[b_of_r] + i_of_r  # [total_q]
        pos = torch.where(pos >= 0, pos, torch.full_like(pos, max_seqlen_k))
        pad = torch.zeros((b_count, 1, h_kv, d), dtype=acc, device=dev)
        kg = torch.cat([kg, pad], 1).index_put((b_of_r, pos), new_kv[0].to(acc))[:, :max_seqlen_k]
        vg = torch.cat([vg, pad], 1).index_put((b_of_r, pos), new_kv[1].to(acc))[:, :max_seqlen_k]
    if spec.rope_mode:
        rq, rk = rope_pos if rope_pos is not None else (None, None)
        q0 = rq.long() if rq is not None else lens - q_lens  # [B]
        kpos = tk.expand(b_count, -1)
        if rk is not None:
            kpos = kpos + rk.long().gather(1, (tk // block_size).clamp(max=rk.shape[1] - 1).expand(b_count, -1))
        kg = apply_rope(kg, kpos[:, :, None], spec.rope_cos, spec.rope_sin, spec.rope_interleaved)
        qpos = (q0[:, None] + qi[None, :])[:, :, None, None]  # [B, Mq, 1, 1]
        qp = apply_rope(qp, qpos, spec.rope_cos, spec.rope_sin, spec.rope_interleaved)
    q_pos = (lens - q_lens)[:, None] + qi[None, :]  # [B, Mq]
    vis = visibility_mask(q_pos, tk.expand(b_count, -1), spec)  # [B, Mq, Mk]
    vis = vis & k_in[:, None, :] & q_valid[:, :, None]
    # Keys no query row of the sequence sees are zeroed too (a window's old keys, whose
    # blocks a pool may have released and reused): the backward's dS @ K would otherwise
    # meet 0 * NaN there.
    seen = vis.any(1)  # [B, Mk]
    zero = torch.zeros((), dtype=acc, device=dev)
    kp = torch.where(seen[..., None, None], kg, zero)
    vp = torch.where(seen[..., None, None], vg, zero)

    s = _scores(qp, kp, "bmhgd,bkhd->bhgmk", spec.scale_for(d), spec.softcap)  # [B, H_kv, G, Mq, Mk]
    o, lse = _masked_softmax_attend(s, vis[:, None, None], vp, "bhgmk,bkhd->bmhgd")  # o [B, Mq, H_kv, G, D]

    # Back to the packed layout.
    out = o[b_of_r, i_of_r].reshape(total_q, h_q, d)
    lse = lse.permute(0, 3, 1, 2)[b_of_r, i_of_r].reshape(total_q, h_q)  # [total_q, H_q]
    out, lse = add_sink_logits(out, lse, spec.sink_logits)
    return out.to(q.dtype), lse


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
    if spec.causal or spec.window_left is not None:
        # Does a position rule hide a key in [kv_start, L) from some query? The causal rule
        # binds hardest on the first query, the window on the last.
        chunk, window = spec.chunk_size, spec.window_left
        for seq_len, start in zip(lens, starts):
            p0 = seq_len - q_len  # the first query's position
            if seq_len == 0 or start >= seq_len:
                continue  # sees nothing: zeroed below
            if spec.causal and (q_len > 1 if chunk is None else p0 // chunk < (seq_len - 1) // chunk):
                return None  # keys in the causal future of some query
            if window is not None and seq_len - 1 - window > max(start, spec.sink_tokens):
                return None  # the last query's window cuts into the keys in range
    block_size, h_kv = k_cache.shape[1], k_cache.shape[2]
    out_dtype = q.dtype
    max_k = max(lens)
    if max_k == 0:
        return None
    n_blocks = -(-max_k // block_size)
    full = all(n == max_k for n in lens) and not any(starts)
    table = block_table if block_table.shape[1] == n_blocks else block_table[:, :n_blocks]  # [B, n_blocks]
    if not full:
        # Entries past a sequence's own blocks may hold anything: point them at block 0.
        used = torch.tensor([-(-n // block_size) for n in lens])
        table = torch.where(torch.arange(n_blocks)[None, :] < used[:, None], table, torch.zeros_like(table))
    flat = table.reshape(-1)  # int32 or int64: index_select takes both
    # The gathered [B * n_blocks, block_size, H_kv, D] pages seen as [B, H_kv, Mk, D] in one
    # as_strided (view + slice + transpose cost ~3-5 us each at these sizes).
    kv_shape = (b_count, h_kv, max_k, d)
    kv_strides = (n_blocks * block_size * h_kv * d, d, h_kv * d, 1)
    if kv_scales is None:
        k = k_cache.index_select(0, flat).as_strided(kv_shape, kv_strides)
        v = v_cache.index_select(0, flat).as_strided(kv_shape, kv_strides)
    else:  # fp8: the gathered blocks dequantized once, to fp32
        k = _read_kv(k_cache, kv_scales[0], flat.long(), torch.float32).as_strided(kv_shape, kv_strides)
        v = _read_kv(v_cache, kv_scales[1], flat.long(), torch.float32).as_strided(kv_shape, kv_strides)
    if q.stride(-1) != 1:
        q = q.contiguous()  # the CPU kernel assumes a unit head_dim stride
    if q.dtype in (torch.float16, torch.bfloat16) or kv_scales is not None:
        # The CPU kernel's half-precision path converts each K/V block once per query head
        # (and per query block); converting the gathered K/V once is 1.5-2.5x faster for
        # decode at 128-512 keys and 4-8% faster for 64-query chunks (1 thread, same run).
        q, k, v = q.float(), k.float(), v.float()
    mask = None
    if not full:
        t = torch.arange(max_k)
        k_out = (t[None, :] >= torch.tensor(lens)[:, None]) | (t[None, :] < torch.tensor(starts)[:, None])  # [B, Mk]
        k.masked_fill_(k_out[:, None, :, None], 0)  # fresh gathered copies: garbage never meets a weight
        v.masked_fill_(k_out[:, None, :, None], 0)
        mask = torch.zeros(b_count, 1, 1, max_k, dtype=q.dtype).masked_fill_(k_out[:, None, None, :], float("-inf"))
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


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Oracle ``store_kv``: token ``i`` goes to block ``s // block_size``, row ``s % block_size``.

    Slots ``< 0`` are skipped. Raises ``ValueError`` (and writes nothing) on a slot past the
    cache or a slot used twice.
    """
    block_size = k_cache.shape[1]
    slots = slot_mapping.long().cpu()
    used = check_slots(slots, k_cache.shape[0] * block_size)
    keep = (slots >= 0).nonzero().flatten()
    blk, row = used // block_size, used % block_size
    k_cache[blk, row] = k[keep.to(k.device)].to(k_cache.dtype)
    v_cache[blk, row] = v[keep.to(v.device)].to(v_cache.dtype)


def store_kv_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Sync-free ``store_kv`` (the CPU path): no boolean indexing, no host read.

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


def merge_attention_states_ref(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two partial attentions over disjoint key sets.

    Parameters
    ----------
    out_a, out_b : ``[N, H, D]``.
    lse_a, lse_b : ``[N, H]`` natural-log sum-exp of each part (``-inf`` = empty part).

    Returns
    -------
    ``(out [N, H, D] in out_a's dtype, lse [N, H] fp32 (fp64 for fp64))``.
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
    # An empty part contributes nothing even if its out holds garbage.
    part_a = torch.where((wa > 0)[..., None], out_a.to(acc) * wa[..., None], zero)
    part_b = torch.where((wb > 0)[..., None], out_b.to(acc) * wb[..., None], zero)
    out = ((part_a + part_b) / denom[..., None]).to(out_a.dtype)
    lse = torch.where(empty, torch.full_like(m, float("-inf")), m_safe + torch.log(denom))
    return out, lse


# The merge is already sync-free and batched: the CPU path is the oracle itself.
merge_attention_states_torch = merge_attention_states_ref
