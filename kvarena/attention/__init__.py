"""Public attention ops (validation + dispatch), their options, and the fp64 oracle.

Names are resolved lazily (PEP 562), so importing a submodule (the arena reads
``kvarena.attention.dtypes`` and ``kvarena.attention.batch``) registers no
``torch.library`` op; ``paged_attention``, ``store_kv`` and ``merge_attention_states``
(:mod:`kvarena.attention.ops`) do.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AttentionSpec": "kvarena.attention.spec",
    "paged_attention": "kvarena.attention.ops",
    "store_kv": "kvarena.attention.ops",
    "merge_attention_states": "kvarena.attention.ops",
}

__all__ = ["AttentionSpec", "paged_attention", "store_kv", "merge_attention_states", "reference"]


def __getattr__(name: str) -> Any:
    if name == "reference":
        return importlib.import_module("kvarena.attention.reference")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvarena.attention' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
