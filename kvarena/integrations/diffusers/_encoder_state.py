"""What a text encoder's output depends on, read without hashing its weights.

The prompt cache (:mod:`.prompt_cache`) keys an ``encode_prompt`` result by the state of
every text encoder and tokenizer the pipeline holds. Per tensor (parameter or buffer) that
state is its object (a serial number, never reused, so a replaced parameter or
``load_state_dict(..., assign=True)`` is a new state), its version counter (bumped by
every torch in-place op: ``copy_`` in ``load_state_dict``, ``add_`` under ``no_grad``), its
data pointer (``p.data = other``), dtype, shape and device. Version counters do not see a
write through ``.data`` (how PEFT merges a LoRA): that is what the explicit epoch (bumped by
the handle's ``invalidate_weights`` and by every call of the pipeline's LoRA API) is for.

An inference tensor (made under ``torch.inference_mode()``) has no version counter, and can
be written in place inside inference mode: such a tensor is keyed by a content fingerprint
of its bits (:mod:`._fingerprint`), which sees every write, at the cost of a pass over it.
The registries are process-wide, so two pipelines holding the same encoder object see the
same state and share entries, and two different encoders never do.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from kvarena.integrations.diffusers._fingerprint import fingerprint

__all__ = ["bump_epoch", "component_state", "epoch_of", "is_training", "serial"]

_lock = threading.Lock()
_serials: WeakIdKeyDictionary = WeakIdKeyDictionary()
_next = itertools.count(1)
_epochs: WeakIdKeyDictionary = WeakIdKeyDictionary()  # module -> (label, events)


def serial(obj: Any) -> int:
    """A number naming ``obj`` for as long as it lives (ids are reused; these are not)."""
    with _lock:
        got = _serials.get(obj)
        if got is None:
            got = _serials[obj] = next(_next)
        return got


def epoch_of(module: Any) -> tuple[str, int]:
    """``(label, events)``: the last ``invalidate_weights`` label and the LoRA-API events."""
    with _lock:
        return _epochs.get(module, ("", 0))


def bump_epoch(module: Any, label: str | None = None) -> None:
    """Count one event on ``module`` (and set its label when given): old keys miss."""
    with _lock:
        old_label, events = _epochs.get(module, ("", 0))
        _epochs[module] = (old_label if label is None else label, events + 1)


def _tensor_state(t: torch.Tensor) -> tuple:
    if t.is_inference():
        return ("inference", *fingerprint([t]))
    return (serial(t), t._version, t.data_ptr(), str(t.dtype), tuple(t.shape), str(t.device))


def _adapter_state(module: torch.nn.Module) -> list[tuple]:
    """PEFT layers' active / merged / disabled adapters and scales (set without a weight write)."""
    out = []
    for name, sub in module.named_modules():
        if not hasattr(sub, "merged_adapters"):
            continue
        scaling = getattr(sub, "scaling", {}) or {}
        out.append((name, tuple(getattr(sub, "active_adapters", ()) or ()), tuple(sub.merged_adapters),
                    bool(getattr(sub, "disable_adapters", False)),
                    tuple(sorted((str(k), float(v)) for k, v in scaling.items()))))
    return out


def _module_state(module: torch.nn.Module) -> tuple:
    tensors = [(n, _tensor_state(p)) for n, p in module.named_parameters(remove_duplicate=False)]
    tensors += [(n, _tensor_state(b)) for n, b in module.named_buffers(remove_duplicate=False)]
    return ("module", serial(module), epoch_of(module), tuple(tensors), tuple(_adapter_state(module)))


def _tokenizer_state(tok: Any) -> tuple:
    """A tokenizer by object, vocabulary size and the settings its call reads."""
    return ("tokenizer", serial(tok), len(tok), str(getattr(tok, "padding_side", None)),
            str(getattr(tok, "truncation_side", None)), int(getattr(tok, "model_max_length", 0) or 0))


def is_training(module: torch.nn.Module) -> bool:
    """Whether any submodule is in training mode (dropout: the output is not a function of the key)."""
    return any(m.training for m in module.modules())


def component_state(component: Any) -> tuple:
    """The state of one text encoder (a module) or tokenizer, as the cache key holds it."""
    if component is None:  # removed from the pipeline since the handle was made
        return ("none",)
    if isinstance(component, torch.nn.Module):
        return _module_state(component)
    return _tokenizer_state(component)
