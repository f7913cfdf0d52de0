"""Cross-attention K/V per prompt: a :class:`~kvarena.FeatureCache` keyed by content.

A key is the content fingerprint (:mod:`._fingerprint`: every bit, the dtype and the
shape) of the call's ``encoder_hidden_states`` (the raw embedding the pipeline passes;
padding included) and of every weight between it and the K/V (diffusers' text MLP and
each block's ``attn2.to_k`` / ``to_v`` / ``to_kv`` / ``norm_k``, looked up on the
transformer at each call, so a replaced module or parameter is seen). Both are read at
every transformer call in one device pass and one small device-to-host copy: no version
counter (``.data`` writes and ``load_state_dict(..., assign=True)`` bypass it; inference
tensors have none) and no object identity is trusted.
"""

from __future__ import annotations

from typing import Any

import torch

from kvarena import CacheKey, CachePolicy, FeatureCache, content_hash
from kvarena.integrations.diffusers._fingerprint import fingerprint
from kvarena.integrations.diffusers._processors import PromptKeys

__all__ = ["PromptCache"]

#: The modules of a block's ``attn2`` between the embedding and the K/V.
KV_MODULES = ("to_k", "to_v", "to_kv", "norm_k")


def kv_weights(transformer: Any) -> list[torch.Tensor]:
    """Every parameter and buffer the prompt's K/V depend on, as the transformer holds them now."""
    mods = [transformer.condition_embedder.text_embedder]
    mods += [getattr(block.attn2, name, None) for block in transformer.blocks for name in KV_MODULES]
    return [t for m in mods if m is not None for t in (*m.parameters(), *m.buffers())]


class PromptCache:
    """The rollout's prompt K/V (``cache``) and the per-call keys into it."""

    def __init__(self, transformer: Any, max_bytes: int) -> None:
        self.cache = FeatureCache(CachePolicy("feature", max_bytes=max_bytes))
        self._transformer = transformer
        self._dtype = str(next(transformer.parameters()).dtype)
        self._layers = len(transformer.blocks)
        self._keys: dict[tuple[str, str], PromptKeys] = {}

    def keys_for(self, emb: torch.Tensor) -> PromptKeys:
        """The keys of this embedding's K/V, one per block."""
        prints = fingerprint([emb, *kv_weights(self._transformer)])
        ident = (content_hash(prints[0]), content_hash(prints[1:]))
        got = self._keys.get(ident)
        if got is None:
            keys = tuple(CacheKey(f"wan.blocks.{i}.attn2.kv", ident[0], ident[1], dtype=self._dtype)
                         for i in range(self._layers))
            if len(self._keys) > 64:  # stale weights versions: forget the key tuples, not the cache
                self._keys.clear()
            got = self._keys[ident] = PromptKeys(cache=self.cache, keys=keys)
        return got

    def clear(self) -> None:
        """Drop every prompt's K/V."""
        self.cache.clear()
        self._keys.clear()
