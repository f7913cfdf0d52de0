"""kvarena: one-arena KV caches and block-table attention for video DiTs and AR decoders.

Public names are resolved lazily (PEP 562) so that ``import kvarena`` and the CLI stay
cheap and so that ``TRITON_INTERPRET`` can still be set by the caller before anything
imports triton.
"""

from __future__ import annotations

from kvarena._lazy import lazy_names
from kvarena._version import __version__

_EXPORTS = {
    "CacheKey": "kvarena.cache.keys",
    "CachePolicy": "kvarena.cache.keys",
    "content_hash": "kvarena.cache.keys",
    "FeatureCache": "kvarena.cache.feature",
    "ResidualCache": "kvarena.cache.residual",
    "KVLayout": "kvarena.cache.arena",
    "KVArena": "kvarena.cache.arena",
    "LayerGroup": "kvarena.cache.arena",
    "group_layers": "kvarena.cache.arena",
    "CacheFullError": "kvarena.cache.arena",
    "SlabKVCache": "kvarena.cache.slab",
    "Slab": "kvarena.cache.slab",
    "SlabMetadata": "kvarena.cache.slab",
    "PagedKVCache": "kvarena.cache.paged",
    "PagedMetadata": "kvarena.cache.paged",
    "CacheHandle": "kvarena.cache.handle",
    "ContextParallel": "kvarena.distributed",
    "make_pool": "kvarena.cache.handle",
    "AttentionSpec": "kvarena.attention.spec",
    "paged_attention": "kvarena.attention.ops",
    "store_kv": "kvarena.attention.ops",
    "merge_attention_states": "kvarena.attention.ops",
}

__all__ = ["__version__", *_EXPORTS]


__getattr__, __dir__ = lazy_names(__name__, _EXPORTS, globals())
