"""Shared test setup.

Without CUDA the Triton kernels run through the Triton interpreter, which is chosen when
triton is first imported: set TRITON_INTERPRET=1 here, before any test module can import
triton (importing torch does not import triton).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def seed():
    """A fixed torch seed for the test; returns it so messages can quote it."""
    torch.manual_seed(1234)
    return 1234


def _needs_check(item) -> bool:
    return "perf_run" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(session, config, items):
    """The tests that wait for ``kvarena check --perf`` run last, so the check (started in
    the background below) overlaps the rest of the suite (tests/_check_run.py)."""
    items[:] = [i for i in items if not _needs_check(i)] + [i for i in items if _needs_check(i)]


def pytest_collection_finish(session):
    """Start ``kvarena check --perf`` now when a collected test needs it."""
    if any(_needs_check(item) for item in session.items):
        import _check_run

        _check_run.start()


def pytest_sessionfinish(session, exitstatus):
    import _check_run

    _check_run.stop()
