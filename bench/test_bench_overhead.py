"""Host overhead per call: ``plan`` and per-layer ``forward`` at batch 1, 64 and 256.

Tiny tensors (see ``kvarena.benchmark.overhead``), so the numbers are dominated by
Python and dispatch. ``plan`` advances the sequences (decode) or the rollout (slab) on
every call, so it is benchmarked with a fixed number of rounds that the pools are sized
for; ``forward`` reuses one step's metadata.
"""

from __future__ import annotations

import pytest

from kvarena.benchmark.overhead import BATCHES, decode_pool, rollout_pool
from kvarena.benchmark.runner import synced

_ROUNDS = 50  # plan() calls per benchmark; decode_pool() gets room for them


@pytest.mark.parametrize("batch", BATCHES)
def test_paged_plan(benchmark, batch, device):
    pool, names, *_ = decode_pool(batch, device, extra_tokens=_ROUNDS + 8)
    step = dict.fromkeys(names, 1)
    benchmark.group = "overhead: paged.plan"
    benchmark.pedantic(synced(lambda: pool.plan(step), device), rounds=_ROUNDS, warmup_rounds=3)


@pytest.mark.parametrize("batch", BATCHES)
def test_paged_forward(benchmark, batch, device):
    pool, names, q, k, v = decode_pool(batch, device)
    meta = pool.plan(dict.fromkeys(names, 1))
    benchmark.group = "overhead: paged.forward (one layer)"
    benchmark(synced(lambda: pool.forward(q, k, v, meta, 0), device))


@pytest.mark.parametrize("batch", BATCHES)
def test_slab_plan(benchmark, batch, device):
    pool, names, _q, _k, _v, nxt = rollout_pool(batch, device)
    chunk = [nxt]

    def plan():
        # Each call is a new chunk: past the window, so every plan recycles a slab.
        meta = pool.plan(dict.fromkeys(names, chunk[0]))
        chunk[0] += 1
        return meta

    benchmark.group = "overhead: slab.plan"
    benchmark.pedantic(synced(plan, device), rounds=_ROUNDS, warmup_rounds=3)


@pytest.mark.parametrize("batch", BATCHES)
def test_slab_forward(benchmark, batch, device):
    pool, names, q, k, v, nxt = rollout_pool(batch, device)
    meta = pool.plan(dict.fromkeys(names, nxt))
    benchmark.group = "overhead: slab.forward commit (one layer)"
    benchmark(synced(lambda: pool.forward(q, k, v, meta, 0, commit=True), device))
