"""Byte accounting and detaching of cached values (shared by the dict caches).

Accounting rule (what ``used_bytes`` counts for one stored value):

* a ``torch.Tensor`` counts ``numel() * element_size()`` (its logical bytes; a small
  view of a large storage counts only its own elements);
* any other object with an integer ``nbytes`` attribute (a numpy array) counts it;
* ``bytes``/``bytearray``/``memoryview`` count their length, ``str`` its UTF-8 length;
* tuples, lists, mappings (their values; keys are labels and count 0) and dataclass
  instances are walked recursively and count the sum of their parts;
* everything else (numbers, ``None``, opaque objects) counts 0.

The same object reached twice inside one value (e.g. one tensor in two places of a
tuple) is counted once; separate cache entries are accounted independently.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch


def value_nbytes(value: Any) -> int:
    """Return the bytes one cached value accounts for (see the module docstring).

    Parameters
    ----------
    value : object
        A tensor, a nested container of tensors, or anything else.

    Returns
    -------
    int
        The byte count, ``>= 0``.
    """
    seen: set[int] = set()
    total = 0
    stack = [value]
    while stack:
        obj = stack.pop()
        if obj is None or isinstance(obj, (bool, int, float, complex)):
            continue
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            total += obj.numel() * obj.element_size()
        elif isinstance(obj, str):
            total += len(obj.encode("utf-8", "surrogatepass"))
        elif isinstance(obj, (bytes, bytearray)):
            total += len(obj)
        elif isinstance(obj, memoryview):
            total += obj.nbytes
        elif isinstance(obj, (tuple, list)):
            stack.extend(obj)
        elif isinstance(obj, Mapping):
            stack.extend(obj.values())
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            stack.extend(getattr(obj, f.name) for f in dataclasses.fields(obj))
        else:
            nb = getattr(obj, "nbytes", None)
            if isinstance(nb, int) and not isinstance(nb, bool) and nb > 0:
                total += nb
    return total


def _needs_detach(value: Any, seen: set[int]) -> bool:
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if id(value) in seen:
        return False
    if isinstance(value, (tuple, list)):
        seen.add(id(value))
        return any(_needs_detach(v, seen) for v in value)
    if isinstance(value, Mapping):
        seen.add(id(value))
        return any(_needs_detach(v, seen) for v in value.values())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        seen.add(id(value))
        return any(_needs_detach(getattr(value, f.name), seen) for f in dataclasses.fields(value))
    return False


def _detach(value: Any, memo: dict[int, Any]) -> Any:
    key = id(value)
    if key in memo:
        return memo[key]
    if isinstance(value, torch.Tensor):
        out: Any = value.detach() if value.requires_grad else value
    elif isinstance(value, tuple):
        items = [_detach(v, memo) for v in value]
        if hasattr(value, "_make"):  # namedtuple
            out = value._make(items)
        elif type(value) is tuple:
            out = tuple(items)
        else:
            out = type(value)(items)
    elif isinstance(value, list):
        out = copy.copy(value)
        memo[key] = out
        out[:] = [_detach(v, memo) for v in value]
    elif isinstance(value, Mapping):
        out = copy.copy(value) if isinstance(value, dict) else dict(value)
        memo[key] = out
        for k, v in value.items():
            out[k] = _detach(v, memo)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = copy.copy(value)
        memo[key] = out
        for f in dataclasses.fields(value):
            object.__setattr__(out, f.name, _detach(getattr(value, f.name), memo))
    else:
        out = value
    memo[key] = out
    return out


def detached(value: Any) -> Any:
    """Return ``value`` with every grad-requiring tensor replaced by its ``detach()``.

    Containers (tuples, namedtuples, lists, dicts, dataclass instances) are rebuilt
    (shallow copies) only when a tensor inside needs detaching; otherwise ``value``
    itself is returned, so a cache keeps no autograd graph alive and copies nothing
    it does not have to. The same object reached twice maps to one result.

    Parameters
    ----------
    value : object
        The value about to be stored.

    Returns
    -------
    object
        ``value`` or a detached rebuild of it.
    """
    if not _needs_detach(value, set()):
        return value
    return _detach(value, {})


class ByteLRU:
    """An LRU map with byte accounting and a byte budget (no locking: callers lock).

    Each entry holds ``(item, nbytes)``. :meth:`insert` requires
    ``nbytes <= max_bytes``; it then evicts least-recently-used entries until the
    total fits, and can never evict the entry it just inserted.

    Parameters
    ----------
    max_bytes : int
        The budget, ``>= 0``.
    """

    __slots__ = ("max_bytes", "used", "entries")

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.used = 0
        self.entries: OrderedDict[Any, tuple[Any, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, key: Any) -> tuple[bool, Any]:
        """Return ``(found, item)``; a hit becomes the most recently used entry."""
        entry = self.entries.get(key)
        if entry is None:
            return False, None
        self.entries.move_to_end(key)
        return True, entry[0]

    def remove(self, key: Any) -> bool:
        """Drop ``key`` if present; return whether it was."""
        entry = self.entries.pop(key, None)
        if entry is None:
            return False
        self.used -= entry[1]
        return True

    def insert(self, key: Any, item: Any, nbytes: int) -> list[Any]:
        """Store ``item`` as the most recently used entry; return the evicted keys."""
        if nbytes > self.max_bytes:
            raise ValueError(f"nbytes={nbytes} exceeds max_bytes={self.max_bytes}")
        self.remove(key)
        self.entries[key] = (item, nbytes)
        self.used += nbytes
        evicted = []
        while self.used > self.max_bytes:
            old_key, (_item, old_nb) = self.entries.popitem(last=False)
            self.used -= old_nb
            evicted.append(old_key)
        return evicted

    def clear(self) -> int:
        """Drop everything; return how many entries were dropped."""
        n = len(self.entries)
        self.entries.clear()
        self.used = 0
        return n
