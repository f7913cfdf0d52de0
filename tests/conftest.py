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


@pytest.fixture
def launched(monkeypatch):
    """The constexprs of every attention launch of the test, in order: a spy on the one
    function that builds them (``attn_plan._attn_constexprs``)."""
    import kvarena.kernels.attn_plan as attn_plan

    seen = []
    real = attn_plan._attn_constexprs

    def spy(*args, **kwargs):
        meta = real(*args, **kwargs)
        seen.append(meta)
        return meta

    monkeypatch.setattr(attn_plan, "_attn_constexprs", spy)
    return seen


# The slowest modules first: under `pytest -n 2 --dist loadfile` (the README's command) a
# module runs whole on one worker, so a 2-minute module scheduled last would run alone on
# its core while the other idles. Order only; what runs is unchanged.
_SLOW_FIRST = ("test_check.py", "test_context_parallel.py", "test_examples.py")


def pytest_collection_modifyitems(session, config, items):
    def rank(item) -> int:
        name = item.path.name
        return _SLOW_FIRST.index(name) if name in _SLOW_FIRST else len(_SLOW_FIRST)

    items.sort(key=rank)  # stable: the order inside a module and among the rest is kept
