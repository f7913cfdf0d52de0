"""Shared test setup.

Without CUDA the Triton kernels run through the Triton interpreter, which is chosen when
triton is first imported: set TRITON_INTERPRET=1 here, before any test module can import
triton (importing torch does not import triton).

The suite mirrors the package (tests/kernels, tests/attention, tests/cache/{paged,slab},
tests/integrations; tests/tooling for check/benchmark/cli/examples, tests/project for the
repo-wide docs and structure checks). The folders are not packages: each test module's
own folder goes on sys.path when pytest imports it (so a folder's ``_*.py`` helpers import
by name), and this file puts tests/ there too, so ``from _helpers import ...`` works from
every folder. Test module names are unique across the tree (pytest requires it of
non-package folders).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)


@pytest.fixture
def seed() -> int:
    """The one seed fixture: seeds torch with 1234, or with ``KVARENA_TEST_SEED`` when set
    (rerun the suite under other data); returns the seed so a test can build its own
    generators from it and messages can quote it."""
    env = os.environ.get("KVARENA_TEST_SEED")
    value = int(env) if env else 1234
    torch.manual_seed(value)
    return value


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
# its core while the other idles. Order only; what runs is unchanged. By file name (names
# are unique across the folders): tests/tooling/test_check.py,
# tests/cache/test_context_parallel.py, tests/tooling/test_examples.py.
_SLOW_FIRST = ("test_check.py", "test_context_parallel.py", "test_examples.py")


def pytest_collection_modifyitems(session, config, items):
    def rank(item) -> int:
        name = item.path.name
        return _SLOW_FIRST.index(name) if name in _SLOW_FIRST else len(_SLOW_FIRST)

    items.sort(key=rank)  # stable: the order inside a module and among the rest is kept
