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
