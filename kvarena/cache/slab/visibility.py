"""Which logical tokens a chunk's queries see, and how they are listed as pages.

Logical token ``t`` counts from a rollout's first token; chunk 0 has ``n0`` tokens (stored
right-aligned in its slab), every later chunk ``slab_tokens``. A query of the chunk
covering ``[s, e)`` sees ``t < e`` with ``t < S`` (sinks) or ``t >= e - W`` (window).
:class:`Visibility` is the pool's rule (in tokens or in whole chunks); :class:`RolloutRule`
the same rule for one rollout's chunk sizes, with the chunk arithmetic the plan needs.
Everything here is pure host arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvarena.cache.arena import _check_int

__all__ = ["PageTable", "RolloutRule", "Visibility", "clip", "page_shifts"]

UNBOUNDED_WINDOW = 1 << 30

# The per_component keys a slab pool reads (CachePolicy is shared by every cache class).
SLAB_COMPONENTS = frozenset({"window", "sinks", "sink_tokens", "window_tokens", "slab_tokens"})


@dataclass(frozen=True)
class RolloutRule:
    """The visibility rule of one rollout: sink tokens ``sink``, window tokens ``window``
    (None: unbounded), chunk 0 of ``n0`` tokens, later chunks of ``st``."""

    n0: int
    st: int
    sink: int
    window: int | None

    def start(self, c: int) -> int:
        """First logical token of chunk ``c``."""
        return 0 if c == 0 else self.n0 + (c - 1) * self.st

    def end(self, c: int) -> int:
        return self.n0 + c * self.st

    def length(self, c: int) -> int:
        return self.n0 if c == 0 else self.st

    def intervals(self, c: int) -> list[tuple[int, int]]:
        """Token intervals chunk ``c`` sees: ``t < e`` and (``t < S`` or ``t >= e - W``)."""
        s_tok, w_tok = self.sink, self.window
        e = self.n0 + c * self.st
        lo = 0 if w_tok is None else max(0, e - w_tok)
        if lo <= s_tok:
            return [(0, e)]
        return ([(0, s_tok)] if s_tok > 0 else []) + [(lo, e)]

    def chunks_seen(self, c: int) -> list[int]:
        """Chunk indices chunk ``c`` attends to (at least one token of), ascending."""
        return self.chunks_in(self.intervals(c))

    def chunks_in(self, intervals: list[tuple[int, int]]) -> list[int]:
        """Chunk indices holding at least one token of ``intervals``, ascending."""
        st = self.st
        pad = st - self.n0
        seen: list[int] = []
        for a, b in intervals:  # ascending and disjoint: consecutive ones may share a chunk
            lo = (a + pad) // st
            if seen and seen[-1] >= lo:
                lo = seen[-1] + 1
            seen += range(lo, (b + pad - 1) // st + 1)
        return seen

    def dead_before(self, c: int) -> int:
        """Chunks ``i >= 1`` whose end is at most this are invisible to chunk ``c`` and every
        later one, unless they hold a sink token (see :meth:`is_dead`); a bounded window."""
        return self.end(c) - self.window

    def is_dead(self, i: int, c: int) -> bool:
        """Whether chunk ``i`` is invisible to chunk ``c`` and every later one (no sink token,
        every token older than ``c``'s window; a bounded window)."""
        return self.start(i) >= self.sink and self.end(i) <= self.dead_before(c)

    def slabs_held(self) -> int:
        """The most chunks one chunk's queries see (a bounded window): holdings repeat once the
        window has left the sinks, so two windows past that suffice."""
        last = 2 + (self.sink + 2 * self.window) // self.st
        return max(len(self.chunks_seen(c)) for c in range(last + 1))


@dataclass(frozen=True)
class Visibility:
    """A slab pool's visibility: the chunk form (``sinks``, ``window`` in chunks) or the token
    form (``sink_tokens``, ``window_tokens``; the other pair None)."""

    sinks: int | None
    window: int | None
    sink_tokens: int | None
    window_tokens: int | None
    _rules: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @classmethod
    def from_components(cls, per: Mapping) -> Visibility:
        """Read (and check) a policy's ``per_component``."""
        unknown = sorted(set(per) - SLAB_COMPONENTS)
        if unknown:  # a misspelt "window" would silently mean an unbounded window
            raise ValueError(
                f"policy.per_component: unknown key {unknown[0]!r} for a slab pool; expected "
                f"{', '.join(repr(k) for k in sorted(SLAB_COMPONENTS))}"
            )
        token_keys = sorted(set(per) & {"sink_tokens", "window_tokens"})
        chunk_keys = sorted(set(per) & {"sinks", "window"})
        if token_keys and chunk_keys:
            raise ValueError(
                f"policy.per_component: {chunk_keys[0]!r} (whole chunks) and {token_keys[0]!r} (tokens) "
                "cannot be mixed; give sinks/window or sink_tokens/window_tokens"
            )
        if token_keys:
            sink = _check_int('policy.per_component["sink_tokens"]', per.get("sink_tokens", 0), 0)
            w = per.get("window_tokens")
            window = None if w is None else _check_int('policy.per_component["window_tokens"]', w, 1)
            return cls(None, None, sink, window)
        window = max(1, int(per.get("window", UNBOUNDED_WINDOW)))
        return cls(int(per.get("sinks", 0)), window, None, None)

    @property
    def unbounded(self) -> bool:
        """Whether the window is unbounded (every chunk stays visible)."""
        if self.sink_tokens is not None:
            return self.window_tokens is None
        return self.window >= UNBOUNDED_WINDOW

    def rule(self, n0: int, st: int) -> RolloutRule:
        """The rule of a rollout whose chunk 0 has ``n0`` tokens (slabs of ``st``).

        Chunk counts are the token rule at chunk boundaries: ``sinks`` chunks are the tokens
        before chunk ``sinks``' start, a ``window`` of m chunks is ``m * st`` tokens ending at
        a chunk's end. Made once per ``(n0, st)``.
        """
        key = (n0, st)
        got = self._rules.get(key)
        if got is None:
            if self.sink_tokens is not None:
                got = RolloutRule(n0, st, self.sink_tokens, self.window_tokens)
            else:
                s = 0 if self.sinks == 0 else n0 + (self.sinks - 1) * st
                got = RolloutRule(n0, st, s, None if self.window >= UNBOUNDED_WINDOW else self.window * st)
            self._rules[key] = got
        return got


def clip(intervals: list, lo: int, hi: int) -> list:
    """``intervals`` cut to ``[lo, hi)``, empty pieces dropped."""
    out = [(max(a, lo), min(b, hi)) for a, b in intervals]
    return [(a, b) for a, b in out if b > a]


def page_shifts(intervals: list, g: int, base: int) -> list[int]:
    """Per page of :meth:`PageTable.add`'s row: ``logical position - kernel position`` of its rows.

    Buffer row ``x`` of an interval is logical token ``x - base``; page p of the table
    holds kernel rows ``k * g ..``, so key t of that page has logical position ``t + shift``.
    """
    out: list[int] = []
    for a, b in intervals:
        for p in range(a // g, -(-b // g)):
            out.append(p * g - base - len(out) * g)
    return out


class PageTable:
    """Kernel sequences over buffer intervals in pages of ``g`` rows, one :meth:`add` each.

    Per sequence: ``ids`` (the pages covering each interval in order), ``starts`` (the
    first interval's offset in its first page: ``kv_start``) and ``lengths`` (the last
    interval's end: ``seq_len``). Every interval but the first starts, and every one but
    the last ends, on a page edge (the caller picks ``g`` so), so the visible keys are
    exactly ``[kv_start, seq_len)`` of the concatenation.
    """

    __slots__ = ("g", "ids", "starts", "lengths")

    def __init__(self, g: int) -> None:
        self.g = g
        self.ids: list[list[int]] = []
        self.starts: list[int] = []
        self.lengths: list[int] = []

    def add(self, intervals: list, page_id: Callable[[int], int]) -> None:
        g = self.g
        ids: list[int] = []
        start = length = 0
        for n, (a, b) in enumerate(intervals):
            p0, p1 = a // g, -(-b // g)
            if n == 0:
                start = a - p0 * g
            ids += [page_id(p) for p in range(p0, p1)]
            length = len(ids) * g - (p1 * g - b)
        self.ids.append(ids)
        self.starts.append(start)
        self.lengths.append(length)

    def width(self) -> int:
        return max(1, max(len(ids) for ids in self.ids))
