"""Rollback of one namespace: :meth:`snapshot` and :meth:`restore` of a slab pool."""

from __future__ import annotations

from collections.abc import Hashable

from kvarena.cache.slab.records import SlabSnapshot

__all__ = ["SlabRollback"]


class SlabRollback:
    """The rollback part of :class:`~kvarena.cache.slab.SlabKVCache`."""

    def snapshot(self, namespace: Hashable) -> SlabSnapshot:
        """A rollback point of ``namespace`` (``KeyError`` if unknown)."""
        with self._lock:
            r = self._rollouts.get(namespace)
            if r is None:
                raise KeyError(f"namespace {namespace!r} is not in this SlabKVCache")
            return SlabSnapshot(namespace, self._cache_id, tuple(r.chunks.items()), r.last, tuple(r.retired.items()))

    def restore(self, namespace: Hashable, snap: SlabSnapshot) -> None:
        """Roll ``namespace`` back to ``snap``, freeing the slabs claimed after it.

        Chunks kept keep their slab contents. Metadata planned before becomes stale.

        Raises
        ------
        KeyError
            Unknown namespace.
        ValueError
            ``snap`` is of another namespace or cache, or a chunk it holds was recycled
            or cleared since (its bytes are gone); nothing changed.
        """
        with self._lock:
            r = self._rollouts.get(namespace)
            if r is None:
                raise KeyError(f"namespace {namespace!r} is not in this SlabKVCache")
            if not isinstance(snap, SlabSnapshot):
                raise TypeError(f"snap: expected a SlabSnapshot, got {type(snap).__name__}")
            if snap._owner != self._cache_id or snap.namespace != namespace:
                raise ValueError(
                    f"snap: taken of namespace {snap.namespace!r} of another cache or "
                    f"namespace, not {namespace!r} of this one"
                )
            for i, ch in snap._chunks:
                if r.chunks.get(i) is not ch:
                    raise ValueError(
                        f"snap: chunk {i} of namespace {namespace!r} was recycled or cleared "
                        "since the snapshot; cannot restore"
                    )
            kept = {i for i, _ch in snap._chunks}
            extra = sorted((ch for i, ch in r.chunks.items() if i not in kept), key=lambda c: -c.index)
            # Slabs a run retired after the snapshot belong to the abandoned timeline: freed.
            was_retired = dict(snap._retired)
            extra += [ch for i, ch in r.retired.items() if was_retired.get(i) is not ch]
            if extra:
                self._region.allocator.decref([ch.slot for ch in extra])
            r.retired = {i: ch for i, ch in r.retired.items() if was_retired.get(i) is ch}
            r.chunks = dict(snap._chunks)
            r.last = snap._last
            r.version = self._stamp()
