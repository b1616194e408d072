"""Turning a SpeculativeConfig into a proposer and a verifier (at engine construction)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Mapping

import attrs

from speculum.config import SpeculativeConfig
from speculum.context import ProposerContext
from speculum.errors import ConfigError
from speculum.plugins import Registry, VerifierSpec, validate_options

log = logging.getLogger(__name__)


def resolve_method(cfg: SpeculativeConfig, registry: Registry) -> SpeculativeConfig:
    """Fill in ``method`` when only ``model`` was given (auto-detection)."""
    if cfg.method is not None:
        if cfg.model_is_ngram and cfg.method != "ngram":
            raise ConfigError(f"model {cfg.model!r} means method 'ngram', but method is {cfg.method!r}")
        return cfg
    if cfg.model_is_ngram:
        return attrs.evolve(cfg, method="ngram")
    path = Path(cfg.model).expanduser()
    config = {}
    cfg_file = path / "config.json" if path.is_dir() else None
    if cfg_file is not None and cfg_file.exists():
        try:
            config = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{cfg_file} is not valid JSON: {exc}") from exc
    method = registry.detect_method(str(path), config) or "draft_model"
    log.info("speculative method for %s detected as %r", cfg.model, method)
    return attrs.evolve(cfg, method=method)


def check_parallel(cfg: SpeculativeConfig, target_tp: int) -> None:
    dtp = cfg.draft_tensor_parallel_size
    if dtp is not None and dtp not in (1, target_tp):
        raise ConfigError(
            f"draft_tensor_parallel_size must be 1 or the target's tensor_parallel_size "
            f"({target_tp}), got {dtp}"
        )


def build_speculation(cfg: SpeculativeConfig, registry: Registry, backend_name: str, **ctx_fields):
    """Return ``(resolved config, proposer, method spec)`` for the engine."""
    from speculum.proposers.first_draft import first_draft, split_method
    cfg = resolve_method(cfg, registry)
    check_parallel(cfg, ctx_fields.get("tensor_parallel_size", 1))
    names = split_method(cfg.method)
    if len(names) > 1 and cfg.tree is not None:
        raise ConfigError(f"method {cfg.method!r} combines proposers, which draft chains only; drop the tree "
                          f"settings or use one method (e.g. {names[-1]!r})")
    parts = []
    for i, name in enumerate(names):  # options belong to the last method; the others take their defaults
        spec = registry.method(name, backend_name)
        options = validate_options(spec, dict(cfg.options) if i == len(names) - 1 else {})
        part_cfg = cfg if len(names) == 1 else attrs.evolve(cfg, method=name)
        parts.append(spec.factory(ProposerContext(config=part_cfg, options=options, **ctx_fields)))
    proposer = parts[0] if len(parts) == 1 else first_draft(parts, names)
    return cfg, proposer, spec


def build_verifier(registry: Registry, name: str, options: Mapping[str, Any] | None = None) -> tuple[VerifierSpec, Any]:
    """Return ``(spec, verifier)`` for ``acceptance_method`` ``name`` with its validated options.

    A lossy verifier is announced with a warning: its output does not follow the target's
    distribution.
    """
    spec = registry.verifier(name)
    opts = validate_options(spec, dict(options or {}), kind="verifier")
    verifier = spec.factory(opts) if spec.options is not None else spec.factory()
    if not spec.lossless:
        log.warning("acceptance_method %r (from %s) is LOSSY: sampled output does not follow the target model's "
                    "distribution; metrics say lossless=false", name, spec.plugin.distribution)
    return spec, verifier
