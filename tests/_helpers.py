"""Helpers and fixtures shared by several test modules (imported by them, not a plugin).

A fixture here applies only to a module that imports it; ``per_test_seed`` (fixture name
``seed``) then overrides conftest's fixed ``seed`` in that module.
"""

from __future__ import annotations

import os
import sys
import threading
import zlib
from collections.abc import Callable

import pytest
import torch

# Relative ||out - ref|| / ||ref|| bound per dtype (the reference is fp64 on the same inputs).
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.fixture(name="seed")
def per_test_seed(request: pytest.FixtureRequest) -> int:
    """A per-test seed (stable per test id; override with KVARENA_TEST_SEED)."""
    env = os.environ.get("KVARENA_TEST_SEED")
    value = int(env) if env else zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(value)
    return value


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny tensors: intra-op threads only add spin-wait overhead (worst on a loaded box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def blob(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor of ``nbytes`` bytes (a value of known size)."""
    return torch.empty(nbytes, dtype=torch.uint8)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """``out`` within ``TOL[dtype]`` of the fp64 ``ref`` in relative L2 norm."""
    err = (out.double() - ref).norm() / ref.norm().clamp_min(1e-30)
    assert err <= TOL[dtype], (
        f"{what}: relative error {err:.3e} > {TOL[dtype]:.0e} ({dtype}); "
        f"max abs diff {(out.double() - ref).abs().max():.3e}"
    )


def run_threads(target: Callable[[int], object], n: int) -> list[BaseException]:
    """Run ``target(i)`` for ``i < n`` on ``n`` threads with a tiny switch interval.

    Returns the exceptions the threads raised (the caller asserts there are none).
    """
    errors: list[BaseException] = []

    def wrapped(i: int) -> None:
        try:
            target(i)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        threads = [threading.Thread(target=wrapped, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        sys.setswitchinterval(old)
    return errors
