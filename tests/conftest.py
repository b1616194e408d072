"""Shared fixtures: tiny random models built in code, and the real default model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from speculum.testing import tiny_model_dir

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("tiny_llama"), "llama", seed=0)


@pytest.fixture(scope="session")
def tiny_llama_draft(tmp_path_factory) -> Path:
    """A smaller random Llama with the same vocabulary (a bad but valid draft)."""
    return tiny_model_dir(tmp_path_factory.mktemp("tiny_llama_draft"), "llama", seed=1, num_layers=1)
