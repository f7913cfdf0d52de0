"""Public attention ops (validation + dispatch), their options, and the fp64 oracle.

Names are resolved lazily (PEP 562), so importing a submodule (the arena reads
``kvarena.attention.dtypes`` and ``kvarena.attention.batch``) registers no
``torch.library`` op; ``paged_attention``, ``store_kv`` and ``merge_attention_states``
(:mod:`kvarena.attention.ops`) do.
"""

from __future__ import annotations

from kvarena._lazy import lazy_names

_EXPORTS = {
    "AttentionSpec": "kvarena.attention.spec",
    "paged_attention": "kvarena.attention.ops",
    "store_kv": "kvarena.attention.ops",
    "merge_attention_states": "kvarena.attention.ops",
}

__all__ = ["AttentionSpec", "paged_attention", "store_kv", "merge_attention_states", "reference"]


__getattr__, __dir__ = lazy_names(__name__, _EXPORTS, globals(), submodules=("reference",))
