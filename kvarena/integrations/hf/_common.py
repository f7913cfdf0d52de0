"""What the transformers adapter's modules share: its name, its refusal, the hand-off
from :class:`~kvarena.integrations.hf.cache.KVArenaCache` to the attention function, and
the classes that mix transformers' bases in at first use (transformers is imported there,
never at import time)."""

from __future__ import annotations

import torch

from kvarena.attention.dtypes import accumulator_dtype

#: The attention (and mask) implementation name registered with transformers.
NAME = "kvarena"


def _unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(f"kvarena: {what} is not supported by the kvarena attention implementation")


# The hand-off from KVArenaCache.update to the attention function: the new key tensor the
# cache returned -> (weakref to it, weakref to the cache, layer). transformers has no
# official way for an attention function to find a custom cache's storage; an id alone
# could be reused once the tensor is gone, hence the weakref identity check. The cache is
# held weakly too: the last step's entries stay until the next step, and must not keep a
# cache the caller dropped (and its arena) alive.
_HANDOFF: dict[int, tuple] = {}


def version_key(t: torch.Tensor) -> tuple[int, int] | None:
    """``(id, version)`` of a tensor kvarena did not create, for a memo that must see the
    tensor change in place between calls; None for an inference tensor
    (``torch.inference_mode()``), which has no version counter and can be changed in place
    unseen inside inference mode: nothing read from one is memoized across calls."""
    if t.is_inference():
        return None
    return id(t), t._version


def _sink_logits(s_aux: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """gpt-oss's ``s_aux`` (a parameter in the model's dtype) as kvarena's sink_logits."""
    return None if s_aux is None else s_aux.to(accumulator_dtype(dtype))


def _cache_base():
    from transformers.cache_utils import Cache

    return Cache


def _layer_base():
    from transformers.cache_utils import CacheLayerMixin

    return CacheLayerMixin


def _cache_class(cls, base):
    """``cls`` with transformers' Cache mixed in (made once)."""
    made = _MIXED.get(cls)
    if made is None:
        made = _MIXED[cls] = type(cls.__name__, (cls, base), {"__module__": cls.__module__})
    return made


_MIXED: dict = {}
