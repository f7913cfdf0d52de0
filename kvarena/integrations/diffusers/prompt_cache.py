"""``cache_prompts(pipe, cache)``: a diffusers pipeline's ``encode_prompt`` served from a FeatureCache.

Serving the same prompt again re-runs a multi-billion-parameter text encoder for bits it
already produced. The handle wraps ``pipe.encode_prompt`` (so ``pipe(...)`` uses it too)
and keys each call by everything that decides its output, so a hit is bitwise the
uncached result and never a stale one:

* the call: every argument of ``encode_prompt`` as bound to its signature, defaults
  applied (prompt strings, embeddings by content, ``max_sequence_length``,
  ``num_*_per_prompt``, CFG on/off, ``dtype``, ``device``, ``lora_scale``,
  ``clip_skip``, ...), and the pipeline's execution device;
* the numerics mode: grad and inference mode, autocast, TF32 / matmul precision;
* per text encoder and tokenizer: its state (:mod:`._encoder_state`: parameter objects,
  version counters, data pointers, PEFT adapter state, and an epoch counting the
  pipeline's LoRA-API calls and :meth:`PromptCacheHandle.invalidate_weights`).

A call that cannot be keyed (an argument with no content hash, an encoder in training
mode, a call that would build an autograd graph) runs uncached. Misses (and uncached
calls) are serialized by the handle's lock: diffusers' ``encode_prompt`` is not thread
safe (a fast tokenizer's padding state is shared). Values are copied in and out, so a
caller editing a returned tensor in place never changes the cache.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Iterable
from typing import Any

import torch

from kvarena import CacheKey, FeatureCache, content_hash
from kvarena.cache.keys import check_names
from kvarena.integrations.diffusers._encoder_state import (
    bump_epoch,
    component_state,
    epoch_of,
    is_training,
)

__all__ = ["LORA_METHODS", "PromptCacheHandle", "cache_prompts"]

#: The pipeline LoRA-API methods that may change a text encoder without a visible write
#: (a fuse writes through ``.data``): each call is an event the key counts.
LORA_METHODS = ("load_lora_weights", "unload_lora_weights", "set_adapters", "fuse_lora", "unfuse_lora",
                "delete_adapters", "enable_lora", "disable_lora", "set_lora_device", "enable_lora_hotswap")

_MISSING = object()
_MARK = "__kvarena_prompt_cache__"


class _Uncacheable(Exception):
    """A call argument or result that the cache cannot key or copy: run the call uncached."""


def _canon(value: Any) -> Any:
    """An argument as content :func:`content_hash` takes (tensors with their device)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (torch.dtype, torch.device)):
        return ("dtype" if isinstance(value, torch.dtype) else "device", str(value))
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.device), value)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_canon(v) for v in value))
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return ("dict", {k: _canon(v) for k, v in value.items()})
    raise _Uncacheable(type(value).__qualname__)


def _copy(value: Any) -> Any:
    """A copy of a result no later in-place edit of ``value`` (or of the copy) reaches."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value)
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    raise _Uncacheable(type(value).__qualname__)


def _numerics() -> tuple:
    """The global modes that change an encoder's bits for the same input and weights."""
    autocast = tuple((d, torch.is_autocast_enabled(d), str(torch.get_autocast_dtype(d))) for d in ("cpu", "cuda"))
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast,
            torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32)


def _tracked(pipe: Any, components: Iterable[str] | None) -> dict[str, Any]:
    """The text encoders and tokenizers the key reads, by component name."""
    comps = getattr(pipe, "components", None)
    if not isinstance(comps, dict):
        raise TypeError(f"pipe: expected a diffusers pipeline (with .components), got {type(pipe).__qualname__}")
    if components is None:
        names = [n for n, c in comps.items() if c is not None and n.startswith(("text_encoder", "tokenizer"))]
    else:
        names = check_names("components", components)
        unknown = [n for n in names if comps.get(n) is None]
        if unknown:
            raise ValueError(f"components: {unknown} are not components of this pipeline; it has {sorted(comps)}")
    if not any(isinstance(comps[n], torch.nn.Module) for n in names):
        raise ValueError("components: no text encoder (a torch module) among the components to track; pass "
                         "components=[...] naming the pipeline's text encoders and tokenizers")
    return {n: comps[n] for n in names}


def cache_prompts(pipe: Any, cache: FeatureCache, *, components: Iterable[str] | None = None) -> PromptCacheHandle:
    """Serve ``pipe.encode_prompt(...)`` (and so ``pipe(...)``) from ``cache``.

    Parameters
    ----------
    pipe : diffusers.DiffusionPipeline
        Any pipeline with an ``encode_prompt`` method (Wan, Flux, LTX, ...).
    cache : kvarena.FeatureCache
        May be shared with other pipelines: entries are shared only where the encoders are
        the same objects in the same state.
    components : iterable of str, optional
        The components the output depends on; default: every ``text_encoder*`` and
        ``tokenizer*`` component.

    Returns
    -------
    PromptCacheHandle
        ``close()`` restores the pipeline.

    Raises
    ------
    TypeError
        ``pipe`` has no ``encode_prompt`` / is not a pipeline; ``cache`` is not a FeatureCache.
    ValueError
        ``pipe`` already has an open handle; ``components`` names no text encoder.
    """
    if not isinstance(cache, FeatureCache):
        raise TypeError(f"cache: expected a kvarena.FeatureCache, got {type(cache).__qualname__}")
    if not callable(getattr(pipe, "encode_prompt", None)):
        raise TypeError(f"pipe: expected a diffusers pipeline with an encode_prompt method, got "
                        f"{type(pipe).__qualname__}")
    if hasattr(pipe.encode_prompt, _MARK):
        raise ValueError("pipe: already served by a prompt cache; close() that handle first")
    return PromptCacheHandle(pipe, cache, list(_tracked(pipe, components)))


class PromptCacheHandle:
    """The installed prompt cache of one pipeline (made by :func:`cache_prompts`).

    Attributes
    ----------
    cache : kvarena.FeatureCache
    component_id : str
        The entries' ``CacheKey.component_id``: the tracked text encoders' names joined by
        ``+`` (``"text_encoder"``; ``"text_encoder+text_encoder_2"`` for Flux).
    closed : bool
        Whether :meth:`close` restored the pipeline.
    """

    def __init__(self, pipe: Any, cache: FeatureCache, tracked: list[str]) -> None:
        self.cache = cache
        self._pipe, self._tracked = pipe, tuple(tracked)
        self.component_id = "+".join(n for n in tracked if isinstance(getattr(pipe, n), torch.nn.Module))
        self._lock = threading.Lock()  # misses and uncached calls, one at a time
        self._count_lock = threading.Lock()  # the counters (a hit does not wait for a miss)
        self._counts = {"hits": 0, "misses": 0, "uncached": 0, "encoder_calls": 0}
        self._encode = pipe.encode_prompt
        self._signature = inspect.signature(self._encode)
        self._saved: dict[str, Any] = {}
        self._install("encode_prompt", functools.wraps(self._encode)(
            lambda *args, **kwargs: self._encode_prompt(*args, **kwargs)))
        for name in LORA_METHODS:
            if callable(getattr(pipe, name, None)):
                self._install(name, self._lora_event(getattr(pipe, name)))

    # ------------------------------------------------------------------ install / restore
    def _install(self, name: str, fn: Any) -> None:
        self._saved[name] = self._pipe.__dict__.get(name, _MISSING)
        setattr(fn, _MARK, self)
        setattr(self._pipe, name, fn)

    def _lora_event(self, method: Any) -> Any:
        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            finally:  # even a call that failed half-way may have written the weights
                for m in self._modules:
                    bump_epoch(m)
        return call

    def close(self) -> None:
        """Restore the pipeline's own ``encode_prompt`` and LoRA methods (entries stay in the cache)."""
        for name, old in self._saved.items():
            if old is _MISSING:
                self._pipe.__dict__.pop(name, None)
            else:
                setattr(self._pipe, name, old)
        self._saved = {}

    @property
    def _modules(self) -> list[torch.nn.Module]:
        """The tracked text encoders as the pipeline holds them now (a replaced one is seen)."""
        found = (getattr(self._pipe, n, None) for n in self._tracked)
        return [m for m in found if isinstance(m, torch.nn.Module)]

    @property
    def closed(self) -> bool:
        return not self._saved

    # ------------------------------------------------------------------ keys
    def _key(self, args: tuple, kwargs: dict) -> CacheKey:
        """The key of this call, or :class:`_Uncacheable` when no key can promise the bits."""
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise _Uncacheable("arguments") from exc  # the pipeline's own call raises its error
        bound.apply_defaults()
        call = {name: _canon(value) for name, value in bound.arguments.items()}
        if any(is_training(m) for m in self._modules):
            raise _Uncacheable("an encoder is in training mode")
        if torch.is_grad_enabled() and self._builds_graph(bound.arguments.values()):
            raise _Uncacheable("the call builds an autograd graph")
        states = tuple((n, component_state(getattr(self._pipe, n, None))) for n in self._tracked)
        where = str(getattr(self._pipe, "_execution_device", None))
        content = content_hash((type(self._pipe).__qualname__, call, where, _numerics(), states))
        return CacheKey(self.component_id, content, self._label())

    def _builds_graph(self, values: Iterable[Any]) -> bool:
        if any(p.requires_grad for m in self._modules for p in m.parameters()):
            return True
        return any(isinstance(v, torch.Tensor) and v.requires_grad for v in values)

    def _label(self) -> str:
        return "+".join(sorted({epoch_of(m)[0] for m in self._modules}))

    # ------------------------------------------------------------------ the call
    def _encode_prompt(self, *args: Any, **kwargs: Any) -> Any:
        try:
            key = self._key(args, kwargs)
        except _Uncacheable:
            return self._uncached(args, kwargs)
        found = self.cache.get(key, _MISSING)
        if found is not _MISSING:
            return self._hit(found)
        with self._lock:  # misses one at a time: encode_prompt itself is not thread safe
            if key in self.cache and (found := self.cache.get(key, _MISSING)) is not _MISSING:
                return self._hit(found)
            self._count("misses", "encoder_calls")
            out = self._encode(*args, **kwargs)
            try:
                stored = _copy(out)
            except _Uncacheable:
                return out
            if self._same_key(key, args, kwargs):  # the state did not change while encoding
                self.cache.put(key, stored)
            return out

    def _same_key(self, key: CacheKey, args: tuple, kwargs: dict) -> bool:
        try:
            return self._key(args, kwargs) == key
        except _Uncacheable:
            return False

    def _count(self, *names: str) -> None:
        with self._count_lock:
            for name in names:
                self._counts[name] += 1

    def _hit(self, value: Any) -> Any:
        self._count("hits")
        return _copy(value)

    def _uncached(self, args: tuple, kwargs: dict) -> Any:
        with self._lock:
            self._count("uncached", "encoder_calls")
            return self._encode(*args, **kwargs)

    # ------------------------------------------------------------------ invalidation / stats
    def invalidate_weights(self, version: str) -> int:
        """After a write no version counter sees (``weight.data.copy_(...)``: an RL weight sync,
        a manual LoRA merge): every key of the tracked encoders changes (its weights version
        becomes ``version``), and the entries of this handle's component id are dropped (those
        of other pipelines with the same component id too). Returns how many were dropped."""
        if not isinstance(version, str):
            raise TypeError(f"version: expected a str, got {type(version).__qualname__}")
        for m in self._modules:
            bump_epoch(m, version)
        return self.cache.invalidate_components({self.component_id})

    def invalidate_components(self, names: Iterable[str]) -> int:
        """Drop this handle's entries if ``names`` includes a tracked text encoder or tokenizer
        (``{"transformer"}`` keeps them). Returns how many were dropped."""
        names = check_names("names", names)
        comps = self._pipe.components
        unknown = [n for n in names if n not in comps]
        if unknown:
            raise ValueError(f"names: {unknown} are not components of this pipeline; it has {sorted(comps)}")
        if not any(n in self._tracked for n in names):
            return 0
        for m in self._modules:
            bump_epoch(m)
        return self.cache.invalidate_components({self.component_id})

    def stats(self) -> dict[str, int]:
        """``hits, misses, uncached, encoder_calls`` of this handle; ``entries, used_bytes,
        max_bytes`` of the (possibly shared) cache."""
        with self._count_lock:
            out = dict(self._counts)
        cache = self.cache.stats()
        out.update(entries=cache["entries"], used_bytes=cache["used_bytes"], max_bytes=cache["max_bytes"])
        return out

    def __enter__(self) -> PromptCacheHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
