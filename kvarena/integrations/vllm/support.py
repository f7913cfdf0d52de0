"""What kvarena's vLLM backend serves, decided at engine start: pure rules, no vLLM import.

Every refusal is a :class:`Unsupported` (a ``ValueError``) whose message starts with
``kvarena:`` and names what vLLM asked for, raised while vLLM builds the model or the KV
cache, never mid-generation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "Unsupported", "LayerOptions", "layer_options", "check_head_size", "check_kv_dtype",
    "check_kv_scale", "MODEL_DTYPES", "FP8_KV_DTYPES", "HEAD_SIZES", "supports_head_size",
]

#: model dtypes the kernels take (q, out and float caches).
MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: head sizes the kernels take: multiples of 8 up to 256.
HEAD_SIZES = tuple(range(8, 257, 8))
#: vLLM's names of an OCP e4m3 cache with static per-layer scales.
FP8_KV_DTYPES = ("fp8", "fp8_e4m3")
_FLOAT_KV = {"float16": torch.float16, "bfloat16": torch.bfloat16}
#: vLLM's per-layer options besides the positional ones that kvarena takes at these values
#: (``sinks`` at any value); any other option or value (sqrt-ALiBi, chunked-local lookback,
#: flex tile sizes, ...) is refused.
_EXTRA_DEFAULTS = {"use_alibi_sqrt": False, "chunk_lookback": -1}


class Unsupported(ValueError):
    """vLLM asked kvarena's backend for something its kernels do not do."""


@dataclass(frozen=True)
class LayerOptions:
    """One layer's attention options, fixed for the engine's lifetime.

    ``window_left``: vLLM's ``sliding_window=W`` (a query sees itself and the W - 1 keys
    before it) is kvarena's ``window_left=W - 1``; ``softcap`` None for no cap; ``fp8``
    True for an e4m3 cache with static per-layer scales.
    """

    scale: float
    window_left: int | None
    softcap: float | None
    fp8: bool


def supports_head_size(head_size: int) -> bool:
    """Whether the kernels take ``head_size`` (:data:`HEAD_SIZES`)."""
    return isinstance(head_size, int) and head_size in HEAD_SIZES


def check_head_size(head_size: int, head_size_v: int | None = None) -> None:
    if not supports_head_size(head_size):
        raise Unsupported(f"kvarena: head_size {head_size} is not served (the kernels take multiples of 8 up to 256)")
    if head_size_v is not None and head_size_v != head_size:
        raise Unsupported(f"kvarena: different key and value head sizes ({head_size} and {head_size_v}) are not served")


def check_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> bool:
    """True for an fp8 e4m3 cache, False for a cache in the model dtype; else :class:`Unsupported`."""
    if model_dtype not in MODEL_DTYPES:
        raise Unsupported(f"kvarena: model dtype {model_dtype} is not served (float16, bfloat16 or float32)")
    if kv_cache_dtype in FP8_KV_DTYPES:
        if model_dtype == torch.float32:
            raise Unsupported("kvarena: an fp8 KV cache needs a float16 or bfloat16 model (got float32)")
        return True
    if kv_cache_dtype == "auto" or _FLOAT_KV.get(kv_cache_dtype) == model_dtype:
        return False
    raise Unsupported(
        f"kvarena: kv_cache_dtype {kv_cache_dtype!r} is not served with a {model_dtype} model: the cache holds the "
        f"model dtype ('auto') or OCP fp8 e4m3 with static per-layer scales ('fp8' / 'fp8_e4m3')")


def check_kv_scale(name: str, scale: torch.Tensor) -> None:
    """Static per-layer scales only: per-head or per-token KV scales are refused."""
    if scale.numel() != 1:
        raise Unsupported(f"kvarena: per-head or per-token KV scales are not served ({name} has {scale.numel()} "
                          "elements; kvarena's vLLM backend takes one static scale per layer)")


def layer_options(
    *, head_size: int, num_heads: int, num_kv_heads: int, scale: float, alibi_slopes: Any,
    sliding_window: int | None, kv_cache_dtype: str, logits_soft_cap: float | None, attn_type: str,
    model_dtype: torch.dtype, extra: Mapping[str, Any],
) -> LayerOptions:
    """The options of one vLLM attention layer, or :class:`Unsupported` naming the first gap."""
    if str(getattr(attn_type, "value", attn_type)) != "decoder":
        raise Unsupported(f"kvarena: attention type {attn_type!r} is not served (decoder self-attention only: no "
                          "encoder, encoder-only or cross attention)")
    if alibi_slopes is not None:
        raise Unsupported("kvarena: ALiBi is not served")
    odd = sorted(k for k, v in extra.items() if k != "sinks" and (k not in _EXTRA_DEFAULTS or v != _EXTRA_DEFAULTS[k]))
    if odd:
        raise Unsupported(f"kvarena: vLLM attention options {odd} are not served")
    check_head_size(head_size)
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise Unsupported(f"kvarena: num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if sliding_window is not None and sliding_window < 1:
        raise Unsupported(f"kvarena: sliding_window {sliding_window} must be >= 1")
    fp8 = check_kv_dtype(kv_cache_dtype, model_dtype)
    softcap = float(logits_soft_cap) if logits_soft_cap else None
    window_left = None if sliding_window is None else int(sliding_window) - 1
    return LayerOptions(scale=float(scale), window_left=window_left, softcap=softcap, fp8=fp8)
