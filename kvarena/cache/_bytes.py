"""What a dict cache stores for a value, and the bytes it charges for it.

A cached value is charged for the memory it keeps alive while stored, so a budget cannot be
bypassed by a small view of a large buffer or by a container the counter does not see into.

Accounting rule (:func:`value_nbytes`; what ``used_bytes`` counts for one stored value):

* a ``torch.Tensor`` counts the bytes of its storage (``untyped_storage().nbytes()``),
  each storage once per value: a view keeps its whole base alive, and two views of one
  storage keep it alive once;
* a numpy array that owns its data counts ``nbytes``; one that does not counts what its
  ``base`` keeps alive; a numpy scalar counts ``nbytes`` (or its base, if it views an array);
* ``bytes``/``bytearray`` count their length, ``str`` its UTF-8 length, a ``memoryview``
  what the object it exports (``.obj``) counts;
* ``None``, numbers, enum members, ``range``, ``torch.dtype`` and ``torch.device`` count 0
  (no Python object header is counted);
* tuples (named or not), lists, sets, frozensets, deques, mappings (keys and values) and
  dataclass instances (fields and other instance attributes) count the sum of their parts;
* anything else raises ``TypeError``: an object the counter cannot see into (a generator,
  a module, an arbitrary class holding tensors) could keep any amount of memory alive.

The same object reached twice inside one value is counted once; separate cache entries
are accounted independently.

:func:`storable` turns a value into what a cache stores, and counts it. Grad-requiring
tensors are detached. Tensors are replaced by compact copies (``clone()``, which allocates
just the tensor's own elements) where that keeps fewer bytes alive than the tensors
themselves: for each storage, when the distinct tensors of the value on it hold fewer bytes
than the storage (a slice of a large tensor), and always when torch did not allocate the
memory itself (a non-resizable, non-pinned storage: ``from_numpy``, ``frombuffer``, DLPack,
``torch.load``), because what the owner of that memory keeps alive is invisible to torch:
``from_numpy(a[:1])`` sees 8 bytes of an array that may pin megabytes. Numpy arrays that do
not own their data are copied likewise. Tensors that own their storage, and views that together cover theirs
(``k, v = kv.unbind(1)``), are stored as they are. The count is taken on the stored value,
so it is exactly what the cache keeps alive.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import numbers
import sys
from collections import OrderedDict, deque
from collections.abc import Mapping
from typing import Any

import torch

_ALLOWED = (
    "a cached value may hold tensors, numpy arrays, str, bytes, bytearray, memoryview, "
    "numbers and None, nested in tuples, lists, dicts, sets, frozensets, deques or "
    "dataclass instances"
)

# Leaves that keep no payload alive: numbers and interned constants.
_FREE = (numbers.Number, enum.Enum, range, torch.dtype, torch.device)


def _unsupported(obj: Any, why: str = "") -> TypeError:
    what = why or f"cannot count the bytes kept alive by a {type(obj).__qualname__}"
    return TypeError(f"value: {what}; {_ALLOWED}")


def _numpy() -> Any:
    """The numpy module if it is loaded (no numpy object can exist before), else None."""
    return sys.modules.get("numpy")


def _attr_names(obj: Any) -> list[str]:
    """A dataclass instance's fields, then any other attributes in its ``__dict__``."""
    names = dict.fromkeys(f.name for f in dataclasses.fields(obj))
    names.update(dict.fromkeys(getattr(obj, "__dict__", ())))
    # an init=False field without a default may be unset: it holds nothing
    return [n for n in names if hasattr(obj, n)]


def _parts(obj: Any) -> list[Any] | None:
    """The parts of a container the counter walks, or ``None`` when ``obj`` is no container."""
    if isinstance(obj, (tuple, list, set, frozenset, deque)):
        return list(obj)
    if isinstance(obj, Mapping):
        return [x for kv in obj.items() for x in kv]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [getattr(obj, n) for n in _attr_names(obj)]
    return None


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    """The storage ``t`` keeps alive; ``TypeError`` when it has none the counter can see."""
    if t.layout != torch.strided:
        raise _unsupported(
            t, f"cannot count the bytes of a {t.layout} tensor (store its dense form or parts)"
        )
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError) as exc:
        raise _unsupported(t, f"cannot reach the storage of a {type(t).__qualname__}") from exc


def _storage_key(storage: torch.UntypedStorage) -> tuple[torch.device, int] | None:
    """Identity of the memory behind ``storage`` (``None``: no memory to share, e.g. empty)."""
    ptr = storage.data_ptr()
    return (storage.device, ptr) if ptr else None


def _numpy_base(np: Any, obj: Any) -> Any:
    """What a numpy array or scalar views (``None`` when it owns its data).

    ``TypeError`` for what ``nbytes`` does not cover: object arrays (their elements) and
    ndarray subclasses other than ``memmap`` (e.g. a masked array's mask).
    """
    if isinstance(obj, np.generic):
        # a structured scalar taken from an array views it; other scalars own their bytes
        return obj.base if isinstance(obj.base, np.ndarray) else None
    if type(obj) is not np.ndarray and not isinstance(obj, np.memmap):
        raise _unsupported(obj)
    if obj.dtype.hasobject:
        raise _unsupported(obj, "cannot count the Python objects of a numpy object array")
    return None if obj.flags.owndata else obj.base


def value_nbytes(value: Any) -> int:
    """Return the bytes one value keeps alive (see the module docstring).

    Parameters
    ----------
    value : object
        A tensor, a nested container of tensors, or another supported leaf.

    Returns
    -------
    int
        The byte count, ``>= 0``.

    Raises
    ------
    TypeError
        If ``value`` holds an object the counter cannot size.
    """
    np = _numpy()
    seen: dict[int, Any] = {}  # id -> object (kept referenced, so no id is reused mid-walk)
    storages: dict[tuple[torch.device, int], int] = {}
    total = 0
    stack = [value]
    while stack:
        obj = stack.pop()
        if obj is None or isinstance(obj, (bool, int, float, complex)):
            continue
        if id(obj) in seen:
            continue
        seen[id(obj)] = obj
        if isinstance(obj, torch.Tensor):
            storage = _storage(obj)
            key = _storage_key(storage)
            if key is None:
                total += storage.nbytes()
            else:  # two views of one storage keep it alive once
                storages[key] = max(storages.get(key, 0), storage.nbytes())
        elif isinstance(obj, str):
            total += len(obj.encode("utf-8", "surrogatepass"))
        elif isinstance(obj, (bytes, bytearray)):
            total += len(obj)
        elif isinstance(obj, memoryview):
            stack.append(obj.obj)  # a slice of a large buffer keeps all of it alive
        elif np is not None and isinstance(obj, (np.ndarray, np.generic)):
            base = _numpy_base(np, obj)
            if base is None:
                total += int(obj.nbytes)
            else:
                stack.append(base)
        elif (parts := _parts(obj)) is not None:
            stack.extend(parts)
        elif not isinstance(obj, _FREE):
            raise _unsupported(obj)
    return total + sum(storages.values())


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _torch_allocated(t: torch.Tensor, storage: torch.UntypedStorage) -> bool:
    """Whether torch allocated ``storage`` itself, so ``nbytes()`` is all it keeps alive.

    Storages wrapping memory owned by someone else (``from_numpy``, DLPack, ...) are
    not resizable; pinned host memory is not either, but torch's host allocator owns it.
    """
    return storage.resizable() or (t.device.type == "cpu" and t.is_pinned())


def _plan(value: Any) -> tuple[bool, set[int]]:
    """Walk ``value`` once: validate it and decide what :func:`storable` must change.

    Returns
    -------
    (bool, set of int)
        Whether a tensor needs detaching, and the ids of the tensors and numpy objects
        to replace by compact copies.

    Raises
    ------
    TypeError
        As :func:`value_nbytes`.
    """
    np = _numpy()
    seen: dict[int, Any] = {}
    # storage identity -> [storage bytes, torch owns it, bytes of its distinct tensors, tensors]
    groups: dict[Any, list[Any]] = {}
    copies: set[int] = set()
    grad = False
    stack = [value]
    while stack:
        obj = stack.pop()
        if obj is None or isinstance(obj, (bool, int, float, complex)) or id(obj) in seen:
            continue
        seen[id(obj)] = obj
        if isinstance(obj, torch.Tensor):
            grad = grad or obj.requires_grad
            storage = _storage(obj)
            key = _storage_key(storage) or id(obj)
            group = groups.setdefault(key, [0, True, 0, []])
            group[0] = max(group[0], storage.nbytes())
            group[1] = group[1] and _torch_allocated(obj, storage)
            group[2] += _tensor_bytes(obj)
            group[3].append(obj)
        elif isinstance(obj, (str, bytes, bytearray)):
            continue
        elif isinstance(obj, memoryview):
            value_nbytes(obj)  # stored as is; only check that its exporter can be sized
        elif np is not None and isinstance(obj, (np.ndarray, np.generic)):
            if _numpy_base(np, obj) is not None:
                copies.add(id(obj))
        elif (parts := _parts(obj)) is not None:
            stack.extend(parts)
        elif not isinstance(obj, _FREE):
            raise _unsupported(obj)
    for nbytes, owned, own_bytes, tensors in groups.values():
        if not owned or own_bytes < nbytes:
            copies.update(id(t) for t in tensors)
    return grad, copies


def _compact(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` holding just its own elements, in a storage torch owns."""
    out = t.clone()  # preserve_format: keeps dense strides, fresh storage of numel elements
    if out.device.type == "cpu" and t.is_pinned():
        out = out.pin_memory()  # clone allocates pageable memory; keep async H2D copies fast
    return out


def _rebuild(obj: Any, copies: set[int], memo: dict[int, Any], building: set[int]) -> Any:
    """``obj`` with tensors detached and the objects in ``copies`` copied (shallow rebuilds)."""
    key = id(obj)
    if key in memo:
        return memo[key]
    np = _numpy()
    if isinstance(obj, torch.Tensor):
        out: Any = obj.detach() if obj.requires_grad else obj
        if key in copies:
            out = _compact(out)
    elif key in copies:  # a numpy array or scalar viewing another array
        out = np.array(obj, copy=True, order="K") if isinstance(obj, np.ndarray) else obj.copy()
    elif isinstance(obj, (tuple, frozenset)):
        # immutable: built after its parts, so a cycle back to it cannot be closed
        if key in building:
            raise TypeError(
                f"value: a reference cycle through a {type(obj).__qualname__} cannot be "
                "copied; break the cycle or store the tensors as they are"
            )
        building.add(key)
        items = [_rebuild(v, copies, memo, building) for v in obj]
        building.discard(key)
        if isinstance(obj, frozenset):
            out = frozenset(items) if type(obj) is frozenset else type(obj)(items)
        elif hasattr(obj, "_make"):  # namedtuple
            out = obj._make(items)
        else:
            out = tuple(items) if type(obj) is tuple else type(obj)(items)
    elif isinstance(obj, (list, set, deque)):
        # mutable: the copy is registered first, so a cycle resolves to it
        out = copy.copy(obj)
        memo[key] = out
        items = [_rebuild(v, copies, memo, building) for v in obj]
        if isinstance(obj, list):
            out[:] = items
        elif isinstance(obj, set):
            out.clear()
            out.update(items)
        else:
            out.clear()
            out.extend(items)
    elif isinstance(obj, Mapping):
        out = copy.copy(obj) if isinstance(obj, dict) else {}
        memo[key] = out
        pairs = [
            (_rebuild(k, copies, memo, building), _rebuild(v, copies, memo, building))
            for k, v in obj.items()
        ]
        out.clear()
        out.update(pairs)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = copy.copy(obj)
        memo[key] = out
        for name in _attr_names(obj):
            object.__setattr__(out, name, _rebuild(getattr(obj, name), copies, memo, building))
    else:
        out = obj
    memo[key] = out
    return out


def check_storable(value: Any) -> None:
    """Raise the ``TypeError`` of :func:`storable` for an object it cannot size, copying nothing."""
    _plan(value)


def storable(value: Any) -> tuple[Any, int]:
    """Return what a cache stores for ``value`` and the bytes it charges for it.

    Grad-requiring tensors are detached and tensors (and numpy arrays) that would keep more
    memory alive than a copy of them are copied (see the module docstring). Containers are
    rebuilt (shallow copies) only when something inside changes; otherwise ``value`` itself
    is returned. The same object reached twice maps to one result.

    Parameters
    ----------
    value : object
        The value about to be stored.

    Returns
    -------
    stored : object
        ``value`` or its rebuild.
    nbytes : int
        ``value_nbytes(stored)``: exactly what ``stored`` keeps alive.

    Raises
    ------
    TypeError
        If ``value`` holds an object the counter cannot size (the message starts with
        ``"value: "`` and names its type), or a cycle through a tuple or frozenset that
        would have to be copied.
    """
    grad, copies = _plan(value)
    if grad or copies:
        value = _rebuild(value, copies, {}, set())
    return value, value_nbytes(value)


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
