"""The slab pool's claim: a step's slabs, the batch's
:class:`~kvarena.cache.slab.planner.RunPlan` s applied to the pool's records, all or nothing
(:func:`reserve`; call under the pool's lock)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass

from kvarena.cache.arena import CacheFullError
from kvarena.cache.slab.planner import RunPlan, check_batch, plan_run
from kvarena.cache.slab.records import _Chunk, _Rollout

__all__ = ["PlannedRun", "Reservation", "reserve"]


@dataclass(frozen=True)
class PlannedRun:
    """One rollout's run once applied: its plan, its chunk records (``run``) and every record
    it may read by index (``records``, chunks the run retired included)."""

    plan: RunPlan
    rollout: _Rollout
    run: tuple
    records: dict

    @property
    def namespace(self) -> Hashable:
        return self.plan.namespace


@dataclass(frozen=True)
class Reservation:
    """A batch's applied runs, in the batch's order, all of ``n_tokens`` tokens."""

    runs: tuple
    n_tokens: int


def reserve(pool, batch: Mapping) -> Reservation:
    """Validate a batch and claim its slots (all-or-nothing). Caller holds the lock."""
    check_batch(batch)
    plans: list[RunPlan] = []
    t_common = None
    new_slots = released = 0
    rollouts, vis, st, training = pool._rollouts, pool._vis, pool.slab_tokens, pool.training_mode
    for ns, spec in batch.items():
        p = plan_run(ns, spec, rollouts.get(ns), vis, st, training, t_common)
        t_common = p.n_tokens if t_common is None else t_common
        new_slots += p.fresh
        released += len(p.released)
        plans.append(p)
    alloc = pool._region.allocator
    if new_slots > alloc.num_free + released:
        raise CacheFullError(
            f"plan needs {new_slots} new slabs, only {alloc.num_free + released} of {alloc.num_blocks} "
            f"are free ({pool.slab_bytes} bytes each, budget {pool.policy.max_bytes})"
        )
    # Release the slabs earlier runs retired, then every new slab in ONE allocator call
    # before anything else changes: the allocator may be shared with another pool on the
    # same arena region (its own lock, not ours), so a per-row alloc could fail half-way.
    for p in plans:
        if p.released:
            r = pool._rollouts[p.namespace]
            alloc.decref([r.retired.pop(i).slot for i in p.released])
            r.version = pool._stamp()
    fresh_ids = alloc.alloc(new_slots)
    runs = []
    for p in plans:
        ids, fresh_ids = fresh_ids[: p.fresh], fresh_ids[p.fresh :]
        runs.append(_apply_run(pool, p, ids))
    return Reservation(tuple(runs), t_common)

def _apply_run(pool, p: RunPlan, ids: list[int]) -> PlannedRun:
    """Apply one rollout's plan (``ids``: its fresh slabs)."""
    r = pool._rollouts.get(p.namespace)
    if r is None:
        r = pool._rollouts[p.namespace] = _Rollout(p.rule.n0)
    records = r.records()
    num_layers, new_slot, c0, c1 = pool.layout.num_layers, p.new_slot, p.c0, p.c1
    for c, n in zip(range(c0, c1), p.lens):
        if c in new_slot:
            slot = new_slot[c]
            records[c] = _Chunk(c, slot if slot >= 0 else ids[-slot - 1], n, num_layers)
            r.last = c
    run = tuple([records[c] for c in range(c0, c1)])
    r.chunks = {i: records[i] for i in sorted(p.slot_of)}
    if p.dropped:
        r.version = pool._stamp()
    if p.reuse:  # dead chunks beyond those the new chunks took over
        pool._region.allocator.decref(p.reuse)
    r.retired.update((i, records[i]) for i in p.retire)
    return PlannedRun(p, r, run, records)
