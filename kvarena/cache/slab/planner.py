"""Host planning of one step: a batch entry read, checked and walked into a :class:`RunPlan`.

Pure: reads a rollout's records, changes nothing. The pool applies the plans
(:mod:`kvarena.cache.slab.claim`) once every rollout of the batch has planned.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass

from kvarena.cache.arena import _check_int
from kvarena.cache.slab.records import _Rollout
from kvarena.cache.slab.visibility import RolloutRule, Visibility

__all__ = ["RunPlan", "RunRequest", "check_batch", "parse_entry", "plan_run"]


@dataclass(frozen=True)
class RunRequest:
    """One batch entry: chunks ``c0 .. c1-1``, ``n_tokens`` of the whole run (None: not given)."""

    c0: int
    c1: int
    n_tokens: int | None


@dataclass(frozen=True)
class RunPlan:
    """One rollout's share of a step, before it is applied.

    Slots are ints, or ``-k`` for the k-th fresh slab the rollout takes.

    Attributes
    ----------
    namespace, c0, c1 : the run ``c0 .. c1-1`` of ``namespace``.
    rule : the rollout's visibility.
    lens : tokens of each chunk of the run.
    slot_of : index -> slot of every chunk the rollout holds after the run.
    new_slot : index -> slot of the run's new chunks.
    reuse : slots of dead chunks no new chunk took over (freed).
    retire : dead chunks the run still reads (held until a later plan).
    released : retired chunks of earlier runs this run no longer reads (freed).
    fresh : new slabs the run takes.
    dropped : chunks the run evicts.
    seen : what the run's queries see.
    """

    namespace: Hashable
    c0: int
    c1: int
    rule: RolloutRule
    lens: tuple
    slot_of: dict
    new_slot: dict
    reuse: list
    retire: list
    released: tuple
    fresh: int
    dropped: int
    seen: _Seen

    @property
    def n_tokens(self) -> int:
        return sum(self.lens)


def check_batch(batch) -> None:
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"batch: expected a mapping of namespace -> chunk_index, (chunk_index, n_tokens), "
            f"range(c0, c1) or (range(c0, c1), n_tokens), got {type(batch).__name__}"
        )
    if not batch:
        raise ValueError("batch: expected at least one namespace")


def parse_entry(ns, spec) -> RunRequest:
    """One batch entry (``n_tokens`` of the whole run)."""
    n = None
    if isinstance(spec, tuple):
        if len(spec) != 2:
            raise ValueError(
                f"batch[{ns!r}]: expected chunk_index or (chunk_index, n_tokens), or range(c0, c1) "
                f"or (range(c0, c1), n_tokens), got {spec!r}"
            )
        spec, n = spec
        n = _check_int(f"batch[{ns!r}] n_tokens", n, 1)
    if isinstance(spec, range):
        if spec.step != 1 or len(spec) == 0 or spec.start < 0:
            raise ValueError(
                f"batch[{ns!r}]: expected a non-empty range(c0, c1) of consecutive chunks, c0 >= 0, got {spec!r}"
            )
        return RunRequest(spec.start, spec.stop, n)
    c = _check_int(f"batch[{ns!r}] chunk_index", spec, 0)
    return RunRequest(c, c + 1, n)


def _check_order(ns, r: _Rollout | None, req: RunRequest) -> None:
    last = -1 if r is None else r.last
    if req.c0 > last + 1:
        raise ValueError(f"batch[{ns!r}]: the next new chunk of this namespace is {last + 1}, got {req.c0}")
    gone = [c for c in range(req.c0, min(req.c1, last + 1)) if c not in r.chunks and c not in r.retired]
    if gone:
        raise ValueError(
            f"batch[{ns!r}]: chunk {gone[0]} was already recycled (namespace holds chunks {list(r.chunks)})"
        )


def _check_one_chunk(ns, c: int, n: int, known: dict, st: int) -> None:
    if c in known and n != known[c]:
        raise ValueError(
            f"batch[{ns!r}]: chunk {c} was planned with {known[c]} tokens; re-planning it with {n} is not allowed"
        )
    if c not in known and n > st:
        raise ValueError(f"batch[{ns!r}]: n_tokens {n} is longer than a slab ({st} slab_tokens)")
    if c not in known and n < st and c != 0:
        raise ValueError(
            f"batch[{ns!r}]: only chunk 0 may be shorter than slab_tokens ({st}); chunk {c} has {n} tokens"
        )


def _first_chunk_tokens(ns, r: _Rollout | None, req: RunRequest, st: int) -> int:
    if r is not None:
        return r.n0
    if req.n_tokens is None:
        return st
    # chunk 0 is new and starts this run: it takes what the others leave
    c0, c1, n = req.c0, req.c1, req.n_tokens
    n0 = n - (c1 - 1) * st
    if not 1 <= n0 <= st:
        raise ValueError(
            f"batch[{ns!r}]: n_tokens {n} for chunks {c0}..{c1 - 1}: expected {(c1 - 1) * st + 1} to "
            f"{c1 * st} (only chunk 0 may be shorter than slab_tokens {st})"
        )
    return n0


def plan_run(ns, spec, r: _Rollout | None, vis: Visibility, st: int, training: bool,
             t_common: int | None) -> RunPlan:
    """Read, check and walk one batch entry (``t_common``: the batch's T so far, None first)."""
    req = parse_entry(ns, spec)
    c0, c1, n = req.c0, req.c1, req.n_tokens
    last = -1 if r is None else r.last
    if c0 != last + 1:  # a new chunk that is not the next one, or a re-planned one
        _check_order(ns, r, req)
    if c0 > last:  # new chunks only
        known = {}
    else:
        records = r.records()
        known = {c: records[c].n_tokens for c in range(c0, min(c1, last + 1))}
    if c1 - c0 == 1 and n is not None:  # one chunk: the historical messages
        _check_one_chunk(ns, c0, n, known, st)
    rule = vis.rule(_first_chunk_tokens(ns, r, req, st), st)
    lens = tuple([known.get(c, rule.length(c)) for c in range(c0, c1)])
    run_tokens = sum(lens)
    if n is not None and n != run_tokens:
        raise ValueError(f"batch[{ns!r}]: chunks {c0}..{c1 - 1} hold {run_tokens} tokens, got n_tokens {n}")
    if t_common is not None and run_tokens != t_common:
        raise ValueError(
            f"batch[{ns!r}]: every rollout of one plan shares one T; got {run_tokens} tokens "
            f"after {t_common} (plan a short first chunk in a batch of its own)"
        )
    return _walk(ns, r, req, rule, lens, _Seen.of(ns, r, req, rule), training)


@dataclass(frozen=True)
class _Seen:
    """What a run's queries see: per chunk its token intervals and chunks, and all of them."""

    intervals: tuple
    chunks: tuple
    by_run: frozenset

    @classmethod
    def of(cls, ns, r: _Rollout | None, req: RunRequest, rule: RolloutRule) -> _Seen:
        """A re-planned chunk must still see all of its own chunks."""
        last = -1 if r is None else r.last
        intervals, chunks = [], []
        for c in range(req.c0, req.c1):
            ivs = rule.intervals(c)
            seen = rule.chunks_in(ivs)
            intervals.append(ivs)
            chunks.append(seen)
            if c <= last:
                missing = [i for i in seen if i not in r.chunks and i not in r.retired and not req.c0 <= i < req.c1]
                if missing:
                    raise ValueError(
                        f"batch[{ns!r}]: chunk {c} sees chunks {missing} that were already recycled; "
                        "it cannot be planned again"
                    )
        return cls(tuple(intervals), tuple(chunks), frozenset(chunks[0]).union(*chunks[1:]))


def _walk(ns, r: _Rollout | None, req: RunRequest, rule: RolloutRule, lens: tuple, seen: _Seen,
          training: bool) -> RunPlan:
    """Walk the new chunks as one-by-one planning would.

    A chunk that no later query can see (no sink token, every token older than the
    window) is dead: its slot goes to the new chunk in place, unless this run still reads
    it; then it is retired, its slot held until the namespace's next plan.
    """
    last = -1 if r is None else r.last
    slot_of = {} if r is None else {i: ch.slot for i, ch in r.chunks.items()}
    new_slot: dict[int, int] = {}
    reuse: list[int] = []
    retire: list[int] = []
    fresh = dropped = 0
    seen_by_run = seen.by_run
    recycle = rule.window is not None and not training
    n0, st, sink = rule.n0, rule.st, rule.sink
    for c in range(max(req.c0, last + 1), req.c1):
        if recycle:
            limit = rule.dead_before(c)
            for i in sorted(slot_of):
                # rule.is_dead(i, c), inline: once per held chunk and new chunk
                if (0 if i == 0 else n0 + (i - 1) * st) >= sink and n0 + i * st <= limit:
                    if i in seen_by_run:
                        retire.append(i)
                        slot_of.pop(i)
                    else:
                        reuse.append(slot_of.pop(i))
                    dropped += 1
        if reuse:
            slot_of[c] = reuse.pop(0)  # the oldest dead chunk's slab, in place
        else:
            fresh += 1
            slot_of[c] = -fresh
        new_slot[c] = slot_of[c]
    released = () if r is None or not r.retired else tuple([i for i in r.retired if i not in seen_by_run])
    return RunPlan(ns, req.c0, req.c1, rule, lens, slot_of, new_slot, reuse, retire, released, fresh, dropped, seen)
