"""``FeatureCache``: encoder outputs reused across requests by content hash.

Entries are keyed by :attr:`CacheKey.hash`, so a key partitions by component,
input content, weights version, adapter stack and every other staleness field.
The cache enforces ``policy.max_bytes`` by evicting least-recently-used entries,
charging each value exactly the bytes it keeps alive (see :mod:`kvarena.cache._bytes`
for what a value counts and when a view is stored as a compact copy). It is safe to
call from several threads (one lock; the ``fn`` of :meth:`FeatureCache.get_or_compute`
runs outside it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from kvarena.cache._bytes import check_storable, storable
from kvarena.cache._dictcache import _ByteBudgetCache
from kvarena.cache.keys import CacheKey, check_names

__all__ = ["FeatureCache"]


def _check_key(key: Any) -> str:
    if not isinstance(key, CacheKey):
        raise TypeError(f"key must be a CacheKey, got {type(key).__qualname__}")
    return key.hash


class FeatureCache(_ByteBudgetCache):
    """Content-hash keyed LRU cache of component outputs under a byte budget.

    Parameters
    ----------
    policy : CachePolicy
        ``max_bytes`` is the budget; ``reuse_across_requests=False`` disables the
        cache (every ``put`` is rejected, every ``get`` misses).

    Attributes
    ----------
    policy : CachePolicy
    used_bytes : int
        Bytes the stored values keep alive (exact; never above ``policy.max_bytes``).
    hits, misses, evictions, rejected : int
        Counters: lookups that found / did not find a value, entries evicted for
        room, puts not stored (value larger than the budget, or reuse disabled).

    Notes
    -----
    Stored tensors are detached (no autograd graph is kept alive). A tensor is
    copied only when that keeps fewer bytes alive, e.g. a small view of a large
    tensor (see :mod:`kvarena.cache._bytes`); otherwise ``get`` returns the stored
    object itself, which callers must treat as read-only. A ``put`` never raises for
    size: a value larger than the budget is simply not stored and evicts nothing. It
    raises ``TypeError`` for a value holding an object the cache cannot size, before
    changing anything. After ``put(key, value)``, ``get(key)`` returns ``value`` (or
    its compact copy) or misses, never an older value of that key (so a rejected put
    also drops the key's previous entry).

    Examples
    --------
    >>> import torch
    >>> from kvarena import CacheKey, CachePolicy, FeatureCache
    >>> cache = FeatureCache(CachePolicy("feature", max_bytes=4096))
    >>> key = CacheKey.from_content("text_encoder", [101, 2023, 102], "w1")
    >>> emb = torch.zeros(3, 16)                          # 192 bytes
    >>> cache.put(key, emb), cache.get(key) is emb, cache.used_bytes
    (True, True, 192)
    >>> cache.get(CacheKey.from_content("text_encoder", [101, 2023, 102], "w2"))  # other weights
    >>> cache.hits, cache.misses
    (1, 1)
    >>> cache.put(key, torch.zeros(2048)), key in cache   # 8 KB > budget: rejected, old entry gone
    (False, False)
    """

    # policy, max_bytes, used_bytes, hits, misses, evictions, rejected, __len__:
    # see _ByteBudgetCache.

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is stored (does not count as a lookup, nor touch LRU order)."""
        if not isinstance(key, CacheKey):
            return False
        with self._lock:
            return key.hash in self._lru.entries

    def keys(self) -> list[CacheKey]:
        """Return the stored keys, least recently used first.

        Returns
        -------
        list of CacheKey
        """
        with self._lock:
            return [item[1] for item, _nb in self._lru.entries.values()]

    # -- lookups -----------------------------------------------------------------------
    def get(self, key: CacheKey, default: Any = None) -> Any:
        """Return the value stored under ``key`` (making it most recently used).

        Parameters
        ----------
        key : CacheKey
        default : object, default None
            Returned on a miss (the original ``cache_pools.py`` ``get`` returned ``None``).

        Returns
        -------
        object
            The stored value, or ``default``.

        Raises
        ------
        TypeError
            If ``key`` is not a ``CacheKey``.
        """
        found, value = self._lookup(_check_key(key))
        return value if found else default

    def _lookup(self, h: str) -> tuple[bool, Any]:
        """Count a hit or a miss and return ``(found, value)`` (misses while reuse is off)."""
        with self._lock:
            if self._policy.reuse_across_requests:
                found, item = self._lru.lookup(h)
                if found:
                    self._hits += 1
                    return True, item[0]
            self._misses += 1
            return False, None

    def put(self, key: CacheKey, value: Any) -> bool:
        """Store ``value`` under ``key``, replacing any previous value of that key.

        Least-recently-used entries are evicted until the budget holds.

        Parameters
        ----------
        key : CacheKey
        value : object
            A tensor, or tensors nested in tuples, lists, dicts, sets, frozensets,
            deques or dataclass instances; also numpy arrays, str, bytes, numbers,
            None (see :mod:`kvarena.cache._bytes` for its byte count).

        Returns
        -------
        bool
            Whether the value was stored. ``False`` when reuse is disabled by the
            policy or when the value alone exceeds ``max_bytes`` (then nothing else
            is evicted, and the key's previous entry, if any, is dropped).

        Raises
        ------
        TypeError
            If ``key`` is not a ``CacheKey``, or ``value`` holds an object whose
            bytes cannot be counted (a generator, an arbitrary object, a sparse
            tensor, ...). The cache is then unchanged.
        """
        h = _check_key(key)
        if not self._policy.reuse_across_requests:
            check_storable(value)  # the same values fail whether or not reuse is on
            with self._lock:
                self._rejected += 1
            return False
        # detach, compact and count outside the lock: it may copy tensors
        value, nb = storable(value)
        with self._lock:
            if nb > self._lru.max_bytes:
                self._lru.remove(h)
                self._rejected += 1
                return False
            self._evictions += len(self._lru.insert(h, (value, key), nb))
            return True

    def get_or_compute(self, key: CacheKey, fn: Callable[[], Any]) -> Any:
        """Return the value under ``key``, computing and storing it on a miss.

        Parameters
        ----------
        key : CacheKey
        fn : callable
            Called with no arguments on a miss, outside the cache's lock (so it may
            use the cache itself). Its result is stored (detached, views
            compacted) with :meth:`put` and returned as ``fn`` returned it.

        Returns
        -------
        object

        Raises
        ------
        TypeError
            If ``key`` is not a ``CacheKey`` or ``fn`` is not callable, or ``fn``
            returned a value :meth:`put` rejects with ``TypeError`` (the miss stays
            counted; nothing else changes).

        Notes
        -----
        Two threads missing the same key at once both call ``fn``; the last put
        wins. An exception from ``fn`` propagates and leaves the cache unchanged
        (the miss stays counted).

        Examples
        --------
        >>> import torch
        >>> from kvarena import CacheKey, CachePolicy, FeatureCache
        >>> cache = FeatureCache(CachePolicy("feature", max_bytes=4096))
        >>> key = CacheKey.from_content("text_encoder", "a red fox", "w1")
        >>> calls = []
        >>> def encode():
        ...     calls.append(1)
        ...     return torch.ones(3, 16)
        >>> first = cache.get_or_compute(key, encode)     # miss: computed and stored
        >>> again = cache.get_or_compute(key, encode)     # hit: fn is not called
        >>> again is first, len(calls), tuple(again.shape), (cache.hits, cache.misses)
        (True, 1, (3, 16), (1, 1))
        """
        h = _check_key(key)
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__qualname__}")
        found, value = self._lookup(h)
        if found:
            return value
        value = fn()
        self.put(key, value)
        return value

    # -- invalidation ---------------------------------------------------------------
    def invalidate_weights(self, version: str) -> int:
        """Drop every entry whose ``weights_version`` differs from ``version``.

        Called after a weight update (e.g. an RL ``update_weights``) with the new
        version: entries computed with any other version are stale.

        Parameters
        ----------
        version : str
            The current weights version.

        Returns
        -------
        int
            Number of entries dropped.

        Raises
        ------
        TypeError
            If ``version`` is not a str.
        """
        if not isinstance(version, str):
            raise TypeError(f"version must be a str, got {type(version).__qualname__}")
        return self._drop(lambda k: k.weights_version != version)

    def invalidate_components(self, names: Iterable[str]) -> int:
        """Drop only the entries produced by the named components.

        A transformer-only weight sync must not evict text-encoder embeddings:
        entries of other components stay.

        Parameters
        ----------
        names : iterable of str
            Component ids (a set, list, ...; a bare str is rejected).

        Returns
        -------
        int
            Number of entries dropped.

        Raises
        ------
        TypeError
            If ``names`` is a str or not an iterable of str.
        """
        wanted = frozenset(check_names("names", names))
        return self._drop(lambda k: k.component_id in wanted)

    def clear(self) -> int:
        """Drop every entry (counters are kept); return how many were dropped."""
        with self._lock:
            return self._lru.clear()

    def _drop(self, predicate: Callable[[CacheKey], bool]) -> int:
        with self._lock:
            drop = [h for h, (item, _nb) in self._lru.entries.items() if predicate(item[1])]
            for h in drop:
                self._lru.remove(h)
            return len(drop)

    # -- stats ------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Return a consistent snapshot of the counters.

        Returns
        -------
        dict
            ``hits, misses, evictions, rejected, entries, used_bytes, max_bytes``.
        """
        with self._lock:
            return self._stats_locked()

    def __repr__(self) -> str:
        return (
            f"FeatureCache(entries={len(self._lru)}, used_bytes={self._lru.used}, "
            f"max_bytes={self._lru.max_bytes})"
        )
