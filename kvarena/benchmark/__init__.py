"""Benchmarks: one registry of cases and providers for ``kvarena bench`` and ``bench/``.

Modules
-------
cases
    The case registry (shapes from docs/contract.md "Realistic shapes", plus a tiny CPU set)
    and which providers run on each kind of case. Imports nothing heavy.
providers
    The implementations: kvarena's public ops and the baselines (gather + SDPA, SDPA on
    contiguous data, FlexAttention, FlashAttention, FlashInfer) for each case.
runner
    Timing (``triton.testing.do_bench`` on CUDA, ``time.perf_counter`` on CPU), the
    device ceilings measured in the same run, correctness against kvarena's output,
    ratios against each kind's baseline.
recycle
    The shift-left copy window of Self-Forcing/LongLive (the baseline), a byte counter
    (a ``TorchDispatchMode``) and the rollout comparison against the slab ring.
overhead
    Host (Python) cost per ``plan()`` and per-layer ``forward()`` call.
report
    Terminal table, JSON/CSV with run metadata, PNG plot.
cli
    ``kvarena bench``.

Nothing here imports torch at import time: the CLI imports ``kvarena.benchmark.cli``
to build its parser, and ``kvarena --version`` must stay cheap.
"""
