"""The attention rules the oracle and the CPU path share, as PyTorch functions.

* :func:`visibility_mask`: which key positions a query position sees (``causal``,
  ``chunk_size``, ``window_left`` + ``sink_tokens``); lengths and ``kv_start`` are the
  callers'.
* :func:`apply_rope`: the RoPE rotation of a query or key by its table row.
* :func:`scaled_scores` and :func:`masked_softmax_attend`: scaled (optionally soft-capped) dot
  products, and the softmax over the visible keys with the NaN rules of docs/contract.md
  (a row that sees no key gives ``out = 0``, ``lse = -inf``; a non-finite value in a key a
  row cannot see never reaches it).
"""

from __future__ import annotations

import torch

from kvarena.attention.spec import AttentionSpec

__all__ = ["visibility_mask", "apply_rope", "scaled_scores", "masked_softmax_attend"]


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


def scaled_scores(q: torch.Tensor, k: torch.Tensor, equation: str, scale: float, softcap: float | None) -> torch.Tensor:
    """``einsum(equation, q, k) * scale``, then ``softcap * tanh(s / softcap)`` when ``softcap``."""
    s = torch.einsum(equation, q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    return s


def masked_softmax_attend(
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
