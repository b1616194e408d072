"""Importing JAX on demand, with the install hint when it is missing.

``speculum.backends.jax`` is registered as a default plugin whether or not JAX is
installed; only building the backend or a JAX verifier imports it.
"""

from __future__ import annotations

import os
from types import ModuleType

from speculum.errors import ConfigError

INSTALL_HINT = "pip install 'speculum[jax]'"


def require_jax() -> ModuleType:
    """Return the ``jax`` module, or raise a ConfigError that says how to install it."""
    # JAX grabs 75% of a GPU's memory at its first use unless told otherwise; the engine
    # plans the KV cache itself (and torch may share the card), so allocate on demand
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        import jax
    except ImportError as exc:
        raise ConfigError(
            f"backend 'jax' needs JAX, which is not installed ({exc}); install it with "
            f"{INSTALL_HINT} (the CPU build), or jax[cuda12] for NVIDIA GPUs, or use backend='torch'"
        ) from exc
    return jax
