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


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    """A random tiny Qwen2 (biased q/k/v projections)."""
    return tiny_model_dir(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    """A random tiny Qwen3 (q/k norms, explicit head_dim)."""
    return tiny_model_dir(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", seed=0)
