"""Execution backends: torch (built in), jax (optional)."""
