"""Cross-attention K/V per prompt: a :class:`~kvarena.FeatureCache` keyed by content and weights.

A key is the content hash of the call's ``encoder_hidden_states`` (the raw embedding the
pipeline passes; padding included) and a version of every weight between it and the
K/V (diffusers' text MLP and each block's ``attn2.to_k`` / ``to_v`` / ``norm_k``). The
weights version is read from the parameters' storage address and in-place version
counter, so a ``load_state_dict`` or a LoRA fuse is a new key without hashing weights.
The embedding is hashed once per transformer call (one copy to the host), or not at
all when the call passes the same, unmodified tensor object as the previous one.
"""

from __future__ import annotations

from typing import Any

import torch

from kvarena import CacheKey, CachePolicy, FeatureCache, content_hash
from kvarena.integrations.diffusers._processors import PromptKeys

__all__ = ["PromptCache"]


def _params(module: torch.nn.Module) -> list[torch.Tensor]:
    return list(module.parameters()) if module is not None else []


class PromptCache:
    """The rollout's prompt K/V (``cache``) and the per-call keys into it."""

    def __init__(self, transformer: Any, max_bytes: int) -> None:
        self.cache = FeatureCache(CachePolicy("feature", max_bytes=max_bytes))
        tracked = _params(transformer.condition_embedder.text_embedder)
        for block in transformer.blocks:
            a = block.attn2
            for name in ("to_k", "to_v", "to_kv", "norm_k"):
                tracked += _params(getattr(a, name, None))
        self._tracked = tracked
        self._dtype = str(next(transformer.parameters()).dtype)
        self._layers = len(transformer.blocks)
        self._last: tuple[torch.Tensor, int, str] | None = None
        self._keys: dict[tuple[str, str], PromptKeys] = {}

    def weights_version(self) -> str:
        """Changes whenever a tracked parameter is replaced or modified in place."""
        return content_hash(tuple((p.data_ptr(), p._version, tuple(p.shape)) for p in self._tracked))

    def _digest(self, emb: torch.Tensor) -> str:
        last = self._last
        if last is not None and last[0] is emb and last[1] == emb._version:
            return last[2]
        digest = content_hash(emb.detach())
        self._last = (emb, emb._version, digest)
        return digest

    def keys_for(self, emb: torch.Tensor) -> PromptKeys:
        """The keys of this embedding's K/V, one per block."""
        ident = (self._digest(emb), self.weights_version())
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
        self._last = None
