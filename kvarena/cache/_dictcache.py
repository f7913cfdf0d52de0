"""State shared by the dict caches (``FeatureCache``, ``ResidualCache``).

One lock, one :class:`~kvarena.cache._bytes.ByteLRU` under ``policy.max_bytes`` and
the hit / miss / eviction / rejection counters, with their read-only properties.
Each cache keeps its own keys, lookups, puts and invalidation.
"""

from __future__ import annotations

import threading

from kvarena.cache._bytes import ByteLRU
from kvarena.cache.keys import CachePolicy


class _ByteBudgetCache:
    """Base of the dict caches: policy, lock, byte-budgeted LRU and counters.

    Subclasses mutate ``_lru`` and the counters only while holding ``_lock``.
    """

    def __init__(self, policy: CachePolicy) -> None:
        if not isinstance(policy, CachePolicy):
            raise TypeError(f"policy must be a CachePolicy, got {type(policy).__qualname__}")
        self._policy = policy
        self._lock = threading.Lock()
        self._lru = ByteLRU(policy.max_bytes)
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._rejected = 0

    # -- read-only state -------------------------------------------------------------
    @property
    def policy(self) -> CachePolicy:
        """CachePolicy: the policy the cache was built with."""
        return self._policy

    @property
    def max_bytes(self) -> int:
        """int: the byte budget (``policy.max_bytes``)."""
        return self._policy.max_bytes

    @property
    def used_bytes(self) -> int:
        """int: bytes the stored values keep alive (see :mod:`kvarena.cache._bytes`)."""
        return self._lru.used

    @property
    def hits(self) -> int:
        """int: lookups that found a value."""
        return self._hits

    @property
    def misses(self) -> int:
        """int: lookups that found nothing."""
        return self._misses

    @property
    def evictions(self) -> int:
        """int: entries evicted to make room (not counting replacements or invalidations)."""
        return self._evictions

    @property
    def rejected(self) -> int:
        """int: puts that stored nothing (see the class's ``put``)."""
        return self._rejected

    def __len__(self) -> int:
        return len(self._lru)

    def _stats_locked(self, **extra: int) -> dict[str, int]:
        """The ``stats()`` snapshot; ``extra`` goes after ``entries``. Hold ``_lock``."""
        return {
            "hits": self._hits,
            "misses": self._misses,
            "evictions": self._evictions,
            "rejected": self._rejected,
            "entries": len(self._lru),
            **extra,
            "used_bytes": self._lru.used,
            "max_bytes": self._lru.max_bytes,
        }
