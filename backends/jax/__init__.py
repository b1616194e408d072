"""The JAX backend (default plugin; needs ``pip install 'speculum[jax]'``).

Registers backend ``"jax"`` and the JAX verifiers ``"rejection_sampler_jax"`` and
``"greedy_jax"``. JAX is imported only when one of them is built, so this module loads
(and ``speculum plugins`` lists it) without JAX; building it then is a ConfigError that
says how to install JAX.
"""

from __future__ import annotations

from speculum.backends.jax.availability import INSTALL_HINT, require_jax
from speculum.hooks import hookimpl

__all__ = ["make_backend", "make_rejection_sampler", "make_greedy_verifier", "INSTALL_HINT"]


def make_backend(**options):
    """Build a :class:`~speculum.backends.jax.backend.JaxBackend` (imports JAX)."""
    require_jax()
    from speculum.backends.jax.backend import JaxBackend
    return JaxBackend(**options)


def make_rejection_sampler():
    """Build the jax.numpy rejection sampler (imports JAX)."""
    require_jax()
    from speculum.backends.jax.verifiers import JaxRejectionSampler
    return JaxRejectionSampler()


def make_greedy_verifier():
    """Build the jax.numpy greedy verifier (imports JAX)."""
    require_jax()
    from speculum.backends.jax.verifiers import JaxGreedyVerifier
    return JaxGreedyVerifier()


@hookimpl
def speculum_register_backends(register):
    register("jax", make_backend,
             description=f"JAX (jit) on CPU/GPU; Llama-family models; needs {INSTALL_HINT}")


@hookimpl
def speculum_register_verifiers(register):
    register("rejection_sampler_jax", make_rejection_sampler, lossless=True,
             description="rejection_sampler in jax.numpy (per-row JAX PRNG keys); greedy rows use argmax matching")
    register("greedy_jax", make_greedy_verifier, lossless=True,
             description="greedy in jax.numpy: exact argmax matching; temperature 0 only")
