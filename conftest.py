"""Fixtures shared by the core tests and every plugin's tests."""

from __future__ import annotations

import os

import pytest
import torch

# tiny models and 2-core CI machines: engines default to one torch thread in the test suite
# (tests of the default rule itself clear this)
os.environ.setdefault("SPECULUM_THREADS", "1")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a module's tiny models on one thread: far faster for them, and CI has 2 cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
