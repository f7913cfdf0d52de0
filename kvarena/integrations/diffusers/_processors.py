"""kvarena's attention processors for diffusers' ``WanAttention`` (``attn1`` and ``attn2``).

Each processor wraps the one it replaced. Outside a rollout step (no :class:`LiveCall`
published on the shared :class:`Live`) it calls that original processor with the same
arguments, so the transformer behaves exactly as before. Inside a step:

* ``attn1`` (self-attention): the chunk's Q/K/V as diffusers computes them (projections,
  ``norm_q`` / ``norm_k`` across heads), RoPE at the chunk's absolute frames (the call's
  ``rotary_emb`` numbers frames from 0 and is ignored), then attention over the cached
  history and the chunk through the step's :class:`~kvarena.integrations.causal_wan.CausalStep`
  (which commits K/V after norm and RoPE in a clean step, as Self-Forcing does);
* ``attn2`` (cross-attention): K/V of the prompt from the rollout's :class:`~kvarena.FeatureCache`
  (projected on the first call that sees the prompt), queries as usual.

No host synchronization: everything read per layer was computed once per call by the
rollout's forward pre-hook.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvarena.integrations.diffusers._rope import ChunkRotary, apply_rotary

__all__ = ["CrossAttention", "Live", "LiveCall", "PromptKeys", "SelfAttention"]


@dataclass(frozen=True)
class PromptKeys:
    """Where one call's prompt K/V live: a cache and a key maker per layer."""

    cache: Any  # kvarena.FeatureCache
    keys: tuple  # one kvarena.CacheKey per block


@dataclass(frozen=True)
class LiveCall:
    """What the processors read during one transformer call inside a step."""

    layers: Any  # kvarena.integrations.causal_wan.CausalStep
    current_start: int
    rotary: ChunkRotary
    prompt: PromptKeys | None


class Live:
    """The one mutable cell the rollout and its processors share."""

    __slots__ = ("call",)

    def __init__(self) -> None:
        self.call: LiveCall | None = None


def _qkv(attn, hidden_states: torch.Tensor, context: torch.Tensor | None):
    """Projections as diffusers' ``_get_qkv_projections`` (fused or not)."""
    ctx = hidden_states if context is None else context
    if getattr(attn, "fused_projections", False):
        if context is None:
            return attn.to_qkv(hidden_states).chunk(3, dim=-1)
        q = attn.to_q(hidden_states)
        return (q, *attn.to_kv(ctx).chunk(2, dim=-1))
    return attn.to_q(hidden_states), attn.to_k(ctx), attn.to_v(ctx)


class SelfAttention:
    """``blocks[layer].attn1``: causal attention through the rollout's slab cache."""

    def __init__(self, live: Live, layer: int, original) -> None:
        self.live, self.layer, self.original = live, layer, original

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
                 **kwargs):
        call = self.live.call
        if call is None:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs)
        q, k, v = _qkv(attn, hidden_states, None)
        q = attn.norm_q(q).unflatten(2, (attn.heads, -1))
        k = attn.norm_k(k).unflatten(2, (attn.heads, -1))
        v = v.unflatten(2, (attn.heads, -1))
        q, k = apply_rotary(q, call.rotary), apply_rotary(k, call.rotary)
        out = call.layers[self.layer](q, k, v, current_start=call.current_start)
        out = out.flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


class CrossAttention:
    """``blocks[layer].attn2``: the prompt's K/V projected once, then reused."""

    def __init__(self, live: Live, layer: int, original) -> None:
        self.live, self.layer, self.original = live, layer, original

    def _prompt_kv(self, attn, context: torch.Tensor, prompt: PromptKeys) -> torch.Tensor:
        key = prompt.keys[self.layer]
        kv = prompt.cache.get(key)
        if kv is None:
            if getattr(attn, "fused_projections", False):
                k, v = attn.to_kv(context).chunk(2, dim=-1)
            else:
                k, v = attn.to_k(context), attn.to_v(context)
            k = attn.norm_k(k).unflatten(2, (attn.heads, -1))
            kv = torch.stack((k, v.unflatten(2, (attn.heads, -1))))
            prompt.cache.put(key, kv)
        return kv

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
                 **kwargs):
        call = self.live.call
        if call is None or call.prompt is None or encoder_hidden_states is None:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs)
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        k, v = self._prompt_kv(attn, encoder_hidden_states, call.prompt)
        q = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        out = dispatch_attention_fn(q, k, v, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
                                    backend=getattr(self.original, "_attention_backend", None))
        out = out.flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))
