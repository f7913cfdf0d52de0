"""``ResidualCache``: step-to-step residuals (DBCache style), per request and per branch.

Entries are keyed by ``(namespace, branch, name)``: the namespace is the request
(or loop) id and the branch the CFG branch (``"cond"``/``"uncond"``) or any other
explicit id, so two interleaved requests, or the two halves of a CFG batch, never
see each other's residuals. The cache enforces ``policy.max_bytes`` by evicting
least-recently-used entries across all namespaces, charging each value exactly the
bytes it keeps alive (see :mod:`kvarena.cache._bytes`); a miss is always safe (the
caller recomputes). Safe to call from several threads.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvarena.cache._bytes import check_storable, storable
from kvarena.cache._dictcache import _ByteBudgetCache
from kvarena.cache.keys import CachePolicy

# check_storable: what a ResidualCache can hold and count, for callers that check before a put.
__all__ = ["ResidualCache", "check_storable"]


def _check_namespace(namespace: Any) -> None:
    if not isinstance(namespace, str):
        raise TypeError(
            f"namespace must be a str (a request id), got {type(namespace).__qualname__}"
        )


def _check_entry(namespace: Any, branch: Any, name: Any) -> tuple[str, str, str]:
    _check_namespace(namespace)
    if not isinstance(branch, str):
        raise TypeError(
            "branch must be a non-empty str naming the CFG branch (e.g. 'cond'), got "
            f"{type(branch).__qualname__}"
        )
    if not branch:
        raise ValueError("branch must be a non-empty str naming the CFG branch (e.g. 'cond')")
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__qualname__}")
    return (namespace, branch, name)


class ResidualCache(_ByteBudgetCache):
    """Per-request, per-branch residual store under a byte budget.

    Parameters
    ----------
    policy : CachePolicy
        ``max_bytes`` is the budget (shared by all namespaces).

    Attributes
    ----------
    policy : CachePolicy
    used_bytes : int
        Bytes the stored values keep alive (exact; never above ``policy.max_bytes``).
    hits, misses, evictions, rejected : int
        Lookups that found / did not find a value, entries evicted for room, puts
        of a value larger than the whole budget (not stored).

    Notes
    -----
    Values are detached. A tensor is copied only when that keeps fewer bytes alive:
    a row ``h[j]`` of a batch would otherwise keep the whole batch alive (see
    :mod:`kvarena.cache._bytes`); otherwise ``get`` returns the stored object. After
    ``put(ns, branch, name, value)``, ``get`` of that entry returns ``value`` (or its
    compact copy) or misses, never an older residual: a rejected put drops the
    previous one.

    Examples
    --------
    >>> import torch
    >>> from kvarena import CachePolicy, ResidualCache
    >>> cache = ResidualCache(CachePolicy("residual", max_bytes=4096))
    >>> h = torch.zeros(2, 16)                            # a CFG batch: row 0 cond, row 1 uncond
    >>> cache.put("req0", "cond", "block_5.residual", h[0])
    True
    >>> cache.get("req0", "cond", "block_5.residual").shape, cache.used_bytes  # a compact copy
    (torch.Size([16]), 64)
    >>> cache.get("req0", "uncond", "block_5.residual") is None   # branches never mix
    True
    >>> cache.clear_namespace("req0"), len(cache)
    (1, 0)
    """

    def __init__(self, policy: CachePolicy) -> None:
        super().__init__(policy)
        # namespace -> keys stored under it (dict used as an ordered set)
        self._by_ns: dict[str, dict[tuple[str, str, str], None]] = {}

    # policy, max_bytes, used_bytes, hits, misses, evictions, rejected, __len__:
    # see _ByteBudgetCache.

    def keys(self) -> list[tuple[str, str, str]]:
        """Return the stored ``(namespace, branch, name)`` keys, least recently used first."""
        with self._lock:
            return list(self._lru.entries)

    def namespaces(self) -> list[str]:
        """Return the namespaces that currently hold entries."""
        with self._lock:
            return list(self._by_ns)

    # -- operations -------------------------------------------------------------------
    def put(self, namespace: str, branch: str, name: str, value: Any) -> bool:
        """Store ``value`` under ``(namespace, branch, name)``.

        Parameters
        ----------
        namespace : str
            The request / loop id.
        branch : str
            Explicit, non-empty branch id (e.g. ``"cond"``, ``"uncond"``).
        name : str
            What the value is (e.g. ``"block_5.residual"``).
        value : object
            Usually a tensor; tensors nested in tuples, lists, dicts, sets,
            frozensets, deques or dataclass instances are accounted too.

        Returns
        -------
        bool
            Whether the value was stored (``False``: larger than ``max_bytes``; then
            nothing else is evicted and the entry's previous value is dropped).

        Raises
        ------
        TypeError
            If ``namespace``, ``branch`` or ``name`` is not a str, or ``value`` holds
            an object whose bytes cannot be counted (a generator, an arbitrary
            object, a sparse tensor, ...). The cache is then unchanged.
        ValueError
            If ``branch`` is empty.
        """
        key = _check_entry(namespace, branch, name)
        # detach, compact and count outside the lock: it may copy tensors
        value, nb = storable(value)
        with self._lock:
            if nb > self._lru.max_bytes:
                self._remove(key)
                self._rejected += 1
                return False
            evicted = self._lru.insert(key, value, nb)
            self._by_ns.setdefault(namespace, {})[key] = None
            for old in evicted:
                self._unindex(old)
            self._evictions += len(evicted)
            return True

    def get(self, namespace: str, branch: str, name: str, default: Any = None) -> Any:
        """Return the value under ``(namespace, branch, name)`` (most recently used now).

        Parameters
        ----------
        namespace, branch, name : str
            As for :meth:`put`.
        default : object, default None
            Returned on a miss (the original ``cache_pools.py`` returned ``None``).

        Returns
        -------
        object

        Raises
        ------
        TypeError, ValueError
            As for :meth:`put`.
        """
        key = _check_entry(namespace, branch, name)
        with self._lock:
            found, value = self._lru.lookup(key)
            if found:
                self._hits += 1
                return value
            self._misses += 1
            return default

    def clear_namespace(self, namespace: str) -> int:
        """Drop every entry of ``namespace`` (all branches); unknown namespaces are a no-op.

        Costs O(entries of that namespace).

        Parameters
        ----------
        namespace : str

        Returns
        -------
        int
            Number of entries dropped.

        Raises
        ------
        TypeError
            If ``namespace`` is not a str.
        """
        _check_namespace(namespace)
        with self._lock:
            keys = self._by_ns.pop(namespace, None)
            if not keys:
                return 0
            for key in keys:
                self._lru.remove(key)
            return len(keys)

    @contextmanager
    def scope(self, namespace: str) -> Iterator[ResidualCache]:
        """Context manager that clears ``namespace`` on exit, exceptions included.

        Parameters
        ----------
        namespace : str
            The request id whose residuals live inside the ``with`` block.

        Yields
        ------
        ResidualCache
            This cache.

        Raises
        ------
        TypeError
            If ``namespace`` is not a str (raised on entry).

        Examples
        --------
        >>> import torch
        >>> from kvarena import CachePolicy, ResidualCache
        >>> cache = ResidualCache(CachePolicy("residual", max_bytes=4096))
        >>> with cache.scope("req1"):
        ...     cache.put("req1", "cond", "block_0.residual", torch.ones(8))
        ...     cache.namespaces(), len(cache)
        True
        (['req1'], 1)
        >>> cache.namespaces(), len(cache)                # cleared on exit
        ([], 0)
        """
        _check_namespace(namespace)
        try:
            yield self
        finally:
            self.clear_namespace(namespace)

    def clear(self) -> int:
        """Drop every entry (counters are kept); return how many were dropped."""
        with self._lock:
            self._by_ns.clear()
            return self._lru.clear()

    def _remove(self, key: tuple[str, str, str]) -> None:
        if self._lru.remove(key):
            self._unindex(key)

    def _unindex(self, key: tuple[str, str, str]) -> None:
        keys = self._by_ns.get(key[0])
        if keys is not None:
            keys.pop(key, None)
            if not keys:
                del self._by_ns[key[0]]

    # -- stats ----------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Return a consistent snapshot of the counters.

        Returns
        -------
        dict
            ``hits, misses, evictions, rejected, entries, namespaces, used_bytes,
            max_bytes``.
        """
        with self._lock:
            return self._stats_locked(namespaces=len(self._by_ns))

    def __repr__(self) -> str:
        return (
            f"ResidualCache(entries={len(self._lru)}, namespaces={len(self._by_ns)}, "
            f"used_bytes={self._lru.used}, max_bytes={self._lru.max_bytes})"
        )
