"""Recycling: one chunk of a rollout, kvarena's slab ring against the shift-left window.

Both schemes are prefilled past ``sinks + window`` chunks, so every benchmarked call is
in the steady state (kvarena recycles a slab in place; the baseline shifts its window).
The configuration is ``kvarena.benchmark.recycle.CONFIGS[<set>]``.
"""

from __future__ import annotations

import pytest

from kvarena.benchmark.recycle import CONFIGS, KVByteCounter, chunk_stepper
from kvarena.benchmark.runner import synced

SCHEMES = ("kvarena", "shift_left")


@pytest.fixture(scope="module")
def cfg(set_name):
    return CONFIGS[set_name]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_chunk_step(benchmark, scheme, cfg, device):
    step, _state = chunk_stepper(scheme, cfg, device)
    benchmark.group = "recycle: one chunk, all layers"
    benchmark.extra_info.update({"scheme": scheme, **{f"cfg_{k}": v for k, v in vars(cfg).items()}})
    benchmark(synced(step, device))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_retained_bytes_moved(scheme, cfg, device):
    """Not timed: the byte counts that the recycling claim is about, in the steady state."""
    # The counter sees what the PyTorch path writes; on CUDA the store is a Triton kernel
    # it cannot see, so count on CPU with the same shapes there.
    if device.type != "cpu":
        pytest.skip("byte counting runs the PyTorch path (tests/tooling/test_bench_smoke.py covers it on CPU)")
    step, state = chunk_stepper(scheme, cfg, device)
    counter = KVByteCounter()
    kv = [state.arena.buffer] if scheme == "kvarena" else [*state.k, *state.v]
    counter.watch(*kv)
    with counter:
        for _ in range(3):
            counter.begin_chunk()
            step()
    retained = [c["retained"] for c in counter.per_chunk]
    if scheme == "kvarena":
        assert retained == [0, 0, 0]
    else:
        assert min(retained) > 0
