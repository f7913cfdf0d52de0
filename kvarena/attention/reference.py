"""The fp64 oracle of the attention ops: plain PyTorch, checked by eye, tested against.

* :func:`paged_attention_ref`: one Python iteration per sequence, host reads of
  ``seq_lens``/``cu_seqlens_q``, K/V gathered block by block and GQA expanded with
  ``repeat_interleave``. Simple enough to be checked by eye (and by a per-query fp64 loop
  in the tests).
* :func:`store_kv_ref`: the slot rule, one boolean-indexed write.
* :func:`merge_attention_states_ref`: the merge by its definition, ``lse = logaddexp(lse_a,
  lse_b)``.

They compute in fp32 (fp64 when given fp64) and follow docs/contract.md: queries
bottom-right aligned, keys ``t < kv_start`` invisible, ``causal`` / ``chunk_size``
(block-causal) / ``window_left`` + ``sink_tokens`` masks, optional ``softcap``, rows that
see no key give ``out = 0`` and ``lse = -inf``. Slots outside a sequence's visible range
are never allowed to reach the output (NaN there stays there). The position and softmax
rules are :mod:`kvarena.attention.rules`, shared with the CPU path
(:mod:`kvarena.attention.torch_path`), which this module does not use.
"""

from __future__ import annotations

import torch

from kvarena.attention.checks import check_slots
from kvarena.attention.dtypes import accumulator_dtype
from kvarena.attention.rules import masked_softmax_attend, scaled_scores, visibility_mask
from kvarena.attention.spec import AttentionSpec

__all__ = ["paged_attention_ref", "store_kv_ref", "merge_attention_states_ref"]


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
        s = scaled_scores(q[q0:q1].to(acc), k, "qhd,khd->hqk", scale, spec.softcap)  # [H_q, Q, L]
        o, l_ = masked_softmax_attend(s, vis.unsqueeze(0), v, "hqk,khd->qhd")
        res[q0:q1] = o
        lse[q0:q1] = l_.transpose(0, 1)
    result = res.to(q.dtype)
    if out is not None:
        out.copy_(result)
        result = out
    if spec.return_lse:
        return result, lse if acc == torch.float64 else lse.float()
    return result


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


def merge_attention_states_ref(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two partial attentions over disjoint key sets.

    ``lse = logaddexp(lse_a, lse_b)`` and ``out = sum_part e^(lse_part - lse) out_part``; an
    empty part (``lse = -inf``) weighs nothing, whatever its out holds, and two empty parts
    give ``out = 0``, ``lse = -inf``.

    Parameters
    ----------
    out_a, out_b : ``[N, H, D]``.
    lse_a, lse_b : ``[N, H]`` natural-log sum-exp of each part (``-inf`` = empty part).

    Returns
    -------
    ``(out [N, H, D] in out_a's dtype, lse [N, H] fp32 (fp64 for fp64))``.
    """
    acc = accumulator_dtype(out_a.dtype)
    lse = torch.logaddexp(lse_a.to(acc), lse_b.to(acc))
    out = torch.zeros(out_a.shape, dtype=acc, device=out_a.device)
    for part, part_lse in ((out_a, lse_a.to(acc)), (out_b, lse_b.to(acc))):
        weight = torch.exp(part_lse - lse)[..., None]
        out = out + torch.where(torch.isneginf(part_lse)[..., None], 0.0, part.to(acc) * weight)
    return out.to(out_a.dtype), lse
