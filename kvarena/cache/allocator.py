"""Reference-counted block ids: :class:`BlockAllocator`, its read-only snapshot
:class:`AllocatorState`, and :class:`CacheFullError` for an allocation the budget cannot hold."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from kvarena.argcheck import is_int
from kvarena.cache.layout import _check_pos_int

__all__ = ["AllocatorState", "BlockAllocator", "CacheFullError"]


class CacheFullError(RuntimeError):
    """An allocation the budget cannot hold. The pool is exactly as before the call."""


@dataclass(frozen=True)
class AllocatorState:
    """A snapshot of a :class:`BlockAllocator` (:meth:`BlockAllocator.state`): two are equal
    when their free stacks, reference counts and fresh counters are.

    Attributes
    ----------
    free : tuple of int
        Freed ids in stack order; the last is handed out first.
    refcounts : Mapping[int, int]
        Allocated id -> reference count (read-only copy).
    fresh : int
        The first id never handed out; ids ``fresh .. num_blocks-1`` are free too.
    """

    free: tuple[int, ...]
    refcounts: Mapping[int, int]
    fresh: int


class BlockAllocator:
    """Reference-counted allocator of ``num_blocks`` block ids ``0 .. num_blocks-1``.

    Freed ids sit on a stack (O(1) alloc and free; a freed id is the next one handed
    out, which keeps re-planned rollouts on the same blocks); ids never handed out yet
    come from a counter, so the allocator's memory grows with the blocks in use, not
    with ``num_blocks`` (a budget of 2**60 one-byte blocks costs nothing up front).
    Every call is all-or-nothing and thread-safe.

    Parameters
    ----------
    num_blocks : int
        Number of blocks, ``>= 0``.

    Examples
    --------
    >>> from kvarena.cache.allocator import BlockAllocator
    >>> alloc = BlockAllocator(4)
    >>> blocks = alloc.alloc(2)
    >>> blocks, alloc.num_free
    ([0, 1], 2)
    >>> alloc.incref([0])                       # a fork shares block 0
    >>> alloc.decref(blocks), alloc.refcount(0)  # block 1 is free again, block 0 still held
    ([1], 1)
    >>> alloc.alloc(1)                          # the freed id is handed out first
    [1]
    >>> alloc.alloc(3)
    Traceback (most recent call last):
        ...
    kvarena.cache.allocator.CacheFullError: need 3 blocks, only 2 of 4 are free
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = _check_pos_int("num_blocks", num_blocks, 0)
        self._lock = threading.Lock()
        self._free: list[int] = []  # freed ids, reused first (LIFO)
        self._fresh = 0  # ids >= _fresh were never handed out
        self._ref: dict[int, int] = {}  # allocated id -> reference count

    @property
    def num_free(self) -> int:
        """int: blocks not allocated."""
        return len(self._free) + self.num_blocks - self._fresh

    @property
    def num_used(self) -> int:
        """int: blocks allocated (refcount >= 1)."""
        return len(self._ref)

    def state(self) -> AllocatorState:
        """A consistent read-only snapshot of the allocator (taken under its lock): later
        calls do not change it."""
        with self._lock:
            return AllocatorState(tuple(self._free), MappingProxyType(dict(self._ref)), self._fresh)

    def refcount(self, block: int) -> int:
        """Reference count of ``block`` (0 when free)."""
        self._check_id(block)
        return self._ref.get(block, 0)

    def alloc(self, n: int = 1) -> list[int]:
        """Allocate ``n`` blocks, each with refcount 1.

        Returns
        -------
        list of int
            The block ids (``[]`` for ``n = 0``).

        Raises
        ------
        CacheFullError
            Fewer than ``n`` blocks are free (nothing is allocated).
        ValueError
            ``n < 0``.
        """
        n = _check_pos_int("n", n, 0)
        with self._lock:
            if n > self.num_free:
                raise CacheFullError(
                    f"need {n} blocks, only {self.num_free} of {self.num_blocks} are free"
                )
            reused = min(n, len(self._free))
            out = [self._free.pop() for _ in range(reused)]
            out += range(self._fresh, self._fresh + n - reused)
            self._fresh += n - reused
            for b in out:
                self._ref[b] = 1
            return out

    def incref(self, blocks: Iterable[int]) -> None:
        """Add one reference to each allocated block (a fork). All-or-nothing.

        Raises
        ------
        ValueError
            A block id out of range or not allocated (the message names it).
        """
        blocks = list(blocks)
        with self._lock:
            for b in blocks:
                self._check_id(b)
                if b not in self._ref:
                    raise ValueError(f"block {b} is not allocated (incref of a free block)")
            for b in blocks:
                self._ref[b] += 1

    def decref(self, blocks: Iterable[int]) -> list[int]:
        """Drop one reference per listed id (an id may repeat); free blocks reaching 0.

        Validated before anything changes: a double free, or more drops than
        references, raises and leaves every refcount as it was.

        Returns
        -------
        list of int
            The ids that became free, in the order they were pushed on the free stack.

        Raises
        ------
        ValueError
            An id out of range, or freed more often than it is referenced.
        """
        blocks = list(blocks)
        with self._lock:
            drops: dict[int, int] = {}
            for b in blocks:
                self._check_id(b)
                drops[b] = drops.get(b, 0) + 1
                if drops[b] > self._ref.get(b, 0):
                    raise ValueError(
                        f"block {b} freed more often than referenced (refcount "
                        f"{self._ref.get(b, 0)}): double free or foreign block id"
                    )
            freed = []
            for b in blocks:
                self._ref[b] -= 1
                if self._ref[b] == 0:
                    del self._ref[b]
                    self._free.append(b)
                    freed.append(b)
            return freed

    free = decref

    def _check_id(self, block) -> None:
        if not is_int(block):
            raise TypeError(f"block id: expected an int, got {block!r}")
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block id {block} out of range [0, {self.num_blocks})")

