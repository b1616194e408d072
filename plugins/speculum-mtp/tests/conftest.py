"""Fixtures shared by the MTP plugin's tests: a tiny random target and its parts."""

from __future__ import annotations

import pytest

from speculum.backends.torch.heads import TargetParts
from speculum.testing import tiny_model_dir


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("target"), "llama", seed=0)


@pytest.fixture(scope="module")
def parts(target):
    return TargetParts.from_checkpoint(target)
