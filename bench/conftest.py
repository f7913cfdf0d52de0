"""pytest-benchmark suite over the same registry as ``kvarena bench``.

Run it explicitly (it is outside ``testpaths``, and pyproject's ``addopts`` disables
benchmarks, hence ``--benchmark-enable``)::

    pytest bench --benchmark-enable                       # quick set on CPU, gpu set on CUDA
    KVARENA_BENCH_SET=quick pytest bench --benchmark-enable -k decode
    pytest bench --benchmark-enable --benchmark-json=out.json

Environment
-----------
KVARENA_BENCH_DEVICE
    ``cpu``, ``cuda``, ... (default: cuda when available).
KVARENA_BENCH_SET
    ``quick`` or ``gpu`` (default: gpu on CUDA, quick otherwise).
KVARENA_BENCH_CASES
    Comma-separated substrings of case names to keep (as ``--cases``).

Without ``--benchmark-enable`` every benchmark body still runs once, so ``pytest bench``
is a correctness pass over every provider (errors against kvarena are asserted).
"""

from __future__ import annotations

import os

import pytest
import torch

from kvarena.benchmark.cases import cases, default_set, providers_for
from kvarena.benchmark.providers import make_data


def bench_device() -> torch.device:
    """The device the suite runs on (``KVARENA_BENCH_DEVICE``, default cuda if available)."""
    return torch.device(os.environ.get("KVARENA_BENCH_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu"))


def bench_set() -> str:
    """The case set (``KVARENA_BENCH_SET``, default by device)."""
    return os.environ.get("KVARENA_BENCH_SET") or default_set(str(bench_device()))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # (case, provider) pairs straight from the registry, ids like "decode-b2-ctx128-kvarena".
    if "case_provider" in metafunc.fixturenames:
        pairs = [(c, p) for c in cases(bench_set(), os.environ.get("KVARENA_BENCH_CASES"))
                 for p in providers_for(c)]
        metafunc.parametrize("case_provider", pairs, ids=[f"{c.name}-{p}" for c, p in pairs])


@pytest.fixture(scope="session")
def set_name() -> str:
    """The case set of this session (``KVARENA_BENCH_SET``, default by device)."""
    return bench_set()


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The suite's device; CPU runs use one intra-op thread (see ``kvarena bench --threads``)."""
    dev = bench_device()
    if dev.type == "cpu" and bench_set() == "quick":
        torch.set_num_threads(1)
    return dev


class _DataCache:
    """Keeps the data (and kvarena's reference output) of the latest case only: the GPU
    set's decode cases hold up to 8 GiB of K/V each."""

    def __init__(self) -> None:
        self.case = None
        self.data = None
        self.ref = None

    def get(self, case, device):
        if self.case != case:
            self.case, self.data, self.ref = None, None, None
            if device.type == "cuda":
                torch.cuda.empty_cache()
            self.data = make_data(case, device)
            self.case = case
        return self.data


@pytest.fixture(scope="session")
def data_cache() -> _DataCache:
    """Session cache of the current case's data."""
    return _DataCache()
