"""Hook specifications: the whole plugin contract of speculum.

A plugin is a module or object with functions marked ``@speculum.hookimpl`` whose names
match the specs below. pluggy passes only the arguments an implementation names, so a
spec can grow later without breaking plugins. Hooks run once, when the plugin manager
builds the registry; never inside the decode loop.

Entry point group: ``speculum``. Example ``pyproject.toml`` of a plugin::

    [project.entry-points.speculum]
    my_method = "my_package.plugin"
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import pluggy

PROJECT = "speculum"

hookspec = pluggy.HookspecMarker(PROJECT)
#: Marker for plugin hook implementations (public).
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def speculum_register_proposers(register: Callable[..., None]) -> None:
    """Register speculative methods (proposers).

    Call ``register(name, factory, backends=("torch",), options=None, description="")``:

    - ``name``: the ``method`` users write in the speculative config (e.g. ``"ngram"``).
    - ``factory(ctx) -> Proposer``: builds the proposer for one engine; ``ctx`` is a
      :class:`speculum.plugins.ProposerContext` (config, target runner, backend, options).
    - ``backends``: backends the factory supports; asking for another is a clear error.
    - ``options``: an attrs class of plugin options; the config's ``options`` dict is
      validated by it (unknown keys are an error listing the valid ones).
    """


@hookspec
def speculum_register_verifiers(register: Callable[..., None]) -> None:
    """Register verifiers: ``register(name, factory, lossless=True, description="", options=None)``.

    ``factory()`` returns a :class:`speculum.interfaces.Verifier`; users pick one with
    ``acceptance_method``. A lossy verifier must say so with ``lossless=False`` (the engine
    then warns at start, ``speculum plugins`` shows LOSSY and metrics carry
    ``lossless: false``). ``options``: an attrs class; the config's ``verifier_options``
    dict is validated by it and the instance passed as ``factory(options)``.
    """


@hookspec
def speculum_register_backends(register: Callable[..., None]) -> None:
    """Register execution backends: ``register(name, backend_class, description="")``.

    The backend class is instantiated with ``(device=..., dtype=...)`` and loads models
    as :class:`speculum.interfaces.ModelRunner` objects.
    """


@hookspec
def speculum_register_trainers(register: Callable[..., None]) -> None:
    """Register trainers for ``speculum train METHOD``: ``register(name, factory, description="")``.

    ``factory`` is a :class:`speculum.train.Trainer` subclass, a callable returning one, or
    an import path ``"package.module:Trainer"`` loaded only when that method is trained
    (so listing trainers never imports training code). ``description`` is the line
    ``speculum train --help`` shows.
    """


@hookspec(firstresult=True)
def speculum_detect_method(model_path: str, config: Mapping[str, Any]) -> str | None:
    """Name the method a draft checkpoint belongs to, or return None.

    Called with the checkpoint path and its parsed ``config.json`` (empty when absent)
    when the speculative config names a ``model`` but no ``method``. The first non-None
    answer wins; when nobody answers, the checkpoint is a ``draft_model``.
    """
