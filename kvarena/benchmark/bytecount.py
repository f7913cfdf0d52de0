""":class:`KVByteCounter`: the KV bytes a rollout writes, sorted by where they came from.

:class:`KVByteCounter` is a ``TorchDispatchMode`` that watches the KV storages (the
arena; the baseline's buffers) and sorts every byte written by a copy or a mutating op:

``new``
    written into KV storage from data that did not come from KV storage (the chunk's
    fresh K/V);
``retained``
    written into KV storage from data that came from KV storage, directly or through a
    copy (``clone``, ``_to_copy``, ``cat``, ...): retained KV moved;
``temp``
    copies of KV data made outside KV storage (the baseline's ``.clone()``).

Attention's own reads (the gathers inside the CPU attention path, ``aten.index``) are
not moves: the Triton kernel reads the arena in place. Triton kernel launches are
invisible to a dispatch mode, so the counted rollout always runs the PyTorch path
(``backend="torch"``); it writes exactly the bytes the store kernel writes.
"""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["KVByteCounter"]

aten = torch.ops.aten

# Ops that produce a copy of their input(s). aten.index (a gather) is deliberately absent:
# it is how the CPU attention path reads keys, not a move of the cache.
_COPY_OPS = {
    aten.clone.default,
    aten._to_copy.default,
    aten.cat.default,
    aten.stack.default,
    aten.roll.default,
    aten.slice_scatter.default,
    aten.select_scatter.default,
    aten.index_copy.default,
    aten.index_put.default,
}


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return []


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _sptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class KVByteCounter(TorchDispatchMode):
    """Sort the bytes written by copies and in-place ops into new / retained / temp.

    Usage::

        counter = KVByteCounter()
        counter.watch(*kv_tensors)          # any views of the KV storages
        with counter:
            for c in range(chunks):
                counter.begin_chunk()
                ...                         # store + attend every layer
        counter.per_chunk                   # [{"new": b, "retained": b, "temp": b}, ...]

    ``watch`` may also be called inside the ``with`` (e.g. once a lazily built arena
    exists). Temporaries derived from KV are held until the next ``begin_chunk`` so their
    addresses cannot be reused by unrelated tensors while being tracked.
    """

    def __init__(self) -> None:
        super().__init__()
        self._kv: set[int] = set()
        self._derived: dict[int, torch.Tensor] = {}
        self.per_chunk: list[dict[str, int]] = []

    def watch(self, *tensors: torch.Tensor) -> None:
        """Register the storages of ``tensors`` as KV storage."""
        for t in tensors:
            self._kv.add(_sptr(t))

    def begin_chunk(self) -> None:
        """Start the next chunk's tally."""
        self._derived.clear()
        self.per_chunk.append({"new": 0, "retained": 0, "temp": 0})

    def _from_kv(self, t: torch.Tensor) -> bool:
        p = _sptr(t)
        return p in self._kv or p in self._derived

    def _tally(self, key: str, n: int) -> None:
        if not self.per_chunk:
            self.begin_chunk()
        self.per_chunk[-1][key] += n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        written: list[torch.Tensor] = []
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                val = args[i] if i < len(args) else kwargs.get(a.name)
                written += _tensors(val)
        if written:
            ids = {id(w) for w in written}
            sources = [t for t in _tensors(list(args)) + _tensors(list(kwargs.values())) if id(t) not in ids]
            from_kv = any(self._from_kv(s) for s in sources if s.is_floating_point())
            for w in written:
                if _sptr(w) in self._kv:
                    self._tally("retained" if from_kv else "new", self._written_bytes(func, w, args))
        elif func in _COPY_OPS:
            ins = _tensors(list(args))
            kv_in = [t for t in ins if t.is_floating_point() and self._from_kv(t)]
            if kv_in:
                outs = _tensors(out)
                n = sum(_nbytes(t) for t in kv_in) if func in (aten.cat.default, aten.stack.default) \
                    else sum(_nbytes(t) for t in outs)
                self._tally("temp", n)
                for t in outs:
                    self._derived[_sptr(t)] = t
        return out

    @staticmethod
    def _written_bytes(func, dest: torch.Tensor, args) -> int:
        if func in (aten.index_put_.default, aten._index_put_impl_.default):
            indices = [i for i in args[1] if i is not None]
            if indices and all(i.dtype != torch.bool for i in indices):
                rows = math.prod(torch.broadcast_shapes(*(i.shape for i in indices)))
                return rows * math.prod(dest.shape[len(args[1]):]) * dest.element_size()
            return _nbytes(args[2])
        return _nbytes(dest)
