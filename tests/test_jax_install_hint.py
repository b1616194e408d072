"""Without JAX installed, backend 'jax' and the JAX verifiers are listed but building them is
a ConfigError that says how to install JAX (runs whether or not JAX is installed)."""

from __future__ import annotations

import sys

import pytest

from speculum import LLM
from speculum.errors import ConfigError
from speculum.plugins import build_registry


@pytest.fixture
def no_jax(monkeypatch):
    """Make ``import jax`` fail as it does where JAX is not installed."""
    for name in [m for m in sys.modules if m == "jax" or m.startswith("jax.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "jax", None)


def test_jax_backend_is_registered_as_a_default_plugin():
    reg = build_registry()
    assert reg.backends["jax"].plugin.name == "speculum.backends.jax"
    assert reg.verifiers["rejection_sampler_jax"].lossless and reg.verifiers["greedy_jax"].lossless


def test_backend_jax_without_jax_says_how_to_install(no_jax, tiny_llama):
    with pytest.raises(ConfigError, match=r"backend 'jax' needs JAX, which is not installed .* "
                                          r"pip install 'speculum\[jax\]'"):
        LLM(model=str(tiny_llama), backend="jax", device="cpu")
    reg = build_registry()
    for name in ("rejection_sampler_jax", "greedy_jax"):
        with pytest.raises(ConfigError, match=r"pip install 'speculum\[jax\]'"):
            reg.verifiers[name].factory()
