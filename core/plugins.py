"""The plugin manager and the registry it fills.

``make_plugin_manager()`` builds a pluggy manager with the built-in plugins (default
verifiers, the torch backend and the JAX backend) and every installed ``speculum`` entry point, minus those
named in ``SPECULUM_DISABLE_PLUGINS`` (comma separated). ``build_registry()`` then calls
the register hooks once and returns a :class:`Registry`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata as md
import logging
import os
from typing import Any, Callable, Iterable

import attrs
import pluggy

from speculum import hooks
from speculum.errors import ConfigError, PluginError

log = logging.getLogger(__name__)

#: Modules registered as plugins before any entry point (pytest's default_plugins).
#: ``speculum.backends.jax`` imports JAX only when its backend or verifiers are built.
DEFAULT_PLUGINS = ("speculum.verifiers", "speculum.backends.torch", "speculum.backends.jax", "speculum.train")
ENTRY_POINT_GROUP = "speculum"


@attrs.frozen
class PluginInfo:
    name: str
    distribution: str
    version: str


@attrs.frozen
class MethodSpec:
    name: str
    factory: Callable[..., Any]
    backends: tuple[str, ...]
    options: type | None
    description: str
    plugin: PluginInfo


@attrs.frozen
class VerifierSpec:
    name: str
    #: ``factory()``, or ``factory(options)`` when ``options`` (an attrs class) is set
    factory: Callable[..., Any]
    lossless: bool
    description: str
    plugin: PluginInfo
    options: type | None = None


@attrs.frozen
class BackendSpec:
    name: str
    factory: Callable[..., Any]
    description: str
    plugin: PluginInfo


@attrs.frozen
class TrainerSpec:
    name: str
    factory: Callable[[], Any] | str
    description: str
    plugin: PluginInfo

    def create(self) -> Any:
        """A trainer instance (an import path is imported now, with a named error)."""
        factory = self.factory
        if isinstance(factory, str):
            mod, _, attr = factory.partition(":")
            try:
                factory = getattr(importlib.import_module(mod), attr)
            except Exception as exc:
                raise PluginError(f"trainer {self.name!r} of plugin {self.plugin.name!r} ({self.plugin.distribution}) "
                                  f"could not be loaded from {self.factory!r}: {type(exc).__name__}: {exc}") from exc
        return factory()


@attrs.define
class Registry:
    """Everything registered by plugins, keyed by name."""

    pm: pluggy.PluginManager
    methods: dict[str, MethodSpec] = attrs.field(factory=dict)
    verifiers: dict[str, VerifierSpec] = attrs.field(factory=dict)
    backends: dict[str, BackendSpec] = attrs.field(factory=dict)
    trainers: dict[str, TrainerSpec] = attrs.field(factory=dict)

    def method(self, name: str, backend: str) -> MethodSpec:
        """The method ``name`` for ``backend``, or a ConfigError naming what is installed."""
        spec = self.methods.get(name)
        if spec is None:
            raise ConfigError(
                f"unknown speculative method {name!r}; installed methods: "
                f"{', '.join(sorted(self.methods)) or '(none)'}. Install the plugin that "
                "provides it (e.g. pip install speculum-<method>) or fix the name."
            )
        if backend not in spec.backends:
            raise ConfigError(
                f"method {name!r} (from {spec.plugin.distribution}) has no implementation for "
                f"backend {backend!r}; it supports: {', '.join(spec.backends)}. Choose one of "
                "those backends."
            )
        return spec

    def verifier(self, name: str) -> VerifierSpec:
        spec = self.verifiers.get(name)
        if spec is None:
            raise ConfigError(
                f"unknown acceptance_method {name!r}; installed verifiers: "
                f"{', '.join(sorted(self.verifiers))}"
            )
        return spec

    def backend(self, name: str) -> BackendSpec:
        spec = self.backends.get(name)
        if spec is None:
            raise ConfigError(
                f"unknown backend {name!r}; installed backends: {', '.join(sorted(self.backends))}"
            )
        return spec

    def detect_method(self, model_path: str, config: dict) -> str | None:
        return self.pm.hook.speculum_detect_method(model_path=model_path, config=config)


def _disabled() -> set[str]:
    raw = os.environ.get("SPECULUM_DISABLE_PLUGINS", "")
    return {p.strip() for p in raw.split(",") if p.strip()}


@functools.lru_cache(maxsize=1)
def _packages_distributions() -> dict[str, list[str]]:
    """Top-level module -> distributions; scanning every installed one takes ~0.3 s, so once."""
    return dict(md.packages_distributions())


def _dist_info(module: Any) -> tuple[str, str]:
    name = getattr(module, "__name__", type(module).__name__)
    top = name.split(".")[0]
    for dist in _packages_distributions().get(top, []):
        try:
            return dist, md.version(dist)
        except md.PackageNotFoundError:  # pragma: no cover
            pass
    return "(not installed)", "-"


def make_plugin_manager(extra_plugins: Iterable[Any] = (), load_entry_points: bool = True) -> pluggy.PluginManager:
    """Build a plugin manager: built-ins, installed entry points, then ``extra_plugins``.

    ``extra_plugins`` are modules or objects with hook implementations; tests and
    applications pass in-process plugins this way without installing them.
    """
    pm = pluggy.PluginManager(hooks.PROJECT)
    pm.add_hookspecs(hooks)
    disabled = _disabled()
    for modname in DEFAULT_PLUGINS:
        if modname in disabled:
            continue
        pm.register(importlib.import_module(modname), name=modname)
    if load_entry_points:
        for ep in md.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in disabled or pm.get_plugin(ep.name) is not None:
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # name the plugin, not just the traceback
                dist = ep.dist.name if ep.dist else "?"
                raise PluginError(
                    f'error importing speculum plugin "{ep.name}" (entry point {ep.value!r} of '
                    f"distribution {dist}): {type(exc).__name__}: {exc}. Fix or uninstall it, or "
                    f"disable it with SPECULUM_DISABLE_PLUGINS={ep.name}"
                ) from exc
            pm.register(plugin, name=ep.name)
    for i, plugin in enumerate(extra_plugins):
        name = getattr(plugin, "__name__", None) or f"extra-{i}-{type(plugin).__name__}"
        if name not in disabled:
            pm.register(plugin, name=name)
    pm.check_pending()
    if os.environ.get("SPECULUM_TRACE_PLUGINS"):
        pm.trace.root.setwriter(lambda msg: log.warning("plugin trace: %s", msg.rstrip()))
        pm.enable_tracing()
    return pm


def build_registry(pm: pluggy.PluginManager | None = None, extra_plugins: Iterable[Any] = ()) -> Registry:
    """Call every register hook once and collect the results."""
    pm = pm or make_plugin_manager(extra_plugins)
    reg = Registry(pm=pm)

    def caller_info(impl) -> PluginInfo:
        dist, version = _dist_info(impl.plugin)
        return PluginInfo(name=impl.plugin_name, distribution=dist, version=version)

    def collect(hook_name: str, store: dict, make: Callable[..., Any]) -> None:
        hook = getattr(pm.hook, hook_name)
        for impl in hook.get_hookimpls():
            info = caller_info(impl)

            def register(name: str, factory: Callable[..., Any], *args: Any, _info=info, **kw: Any) -> None:
                if name in store and store[name].plugin.name != _info.name:
                    log.warning("%s %r from %s replaces the one from %s", hook_name, name,
                                _info.name, store[name].plugin.name)
                store[name] = make(name, factory, _info, *args, **kw)

            impl.function(register=register)

    collect("speculum_register_proposers", reg.methods,
            lambda name, factory, info, backends=("torch",), options=None, description="": MethodSpec(
                name, factory, tuple(backends), options, description, info))
    collect("speculum_register_verifiers", reg.verifiers,
            lambda name, factory, info, lossless=True, description="", options=None: VerifierSpec(
                name, factory, lossless, description, info, options))
    collect("speculum_register_backends", reg.backends,
            lambda name, factory, info, description="": BackendSpec(name, factory, description, info))
    collect("speculum_register_trainers", reg.trainers,
            lambda name, factory, info, description="": TrainerSpec(name, factory, description, info))
    return reg


def _strict(kind: type, ok: Callable[[Any], bool]) -> Callable[[Any, type], Any]:
    def structure(value: Any, _type: type) -> Any:
        if not ok(value):
            raise TypeError(f"expected {kind.__name__}, got {value!r} ({type(value).__name__})")
        return kind(value)
    return structure


@functools.lru_cache(maxsize=1)
def _options_converter():
    """A cattrs converter that structures JSON-like options into an attrs class by type,
    without coercion: "x" is no int, 3.5 no int, 1 no bool (JSON's numbers and lists are
    accepted where the field's type asks for them)."""
    import cattrs
    conv = cattrs.Converter(forbid_extra_keys=True)
    conv.register_structure_hook(bool, _strict(bool, lambda v: isinstance(v, bool)))
    conv.register_structure_hook(int, _strict(int, lambda v: isinstance(v, int) and not isinstance(v, bool)))
    conv.register_structure_hook(float, _strict(float, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)))
    conv.register_structure_hook(str, _strict(str, lambda v: isinstance(v, str)))
    return conv


def _option_errors(exc: BaseException, path: str = "") -> list[str]:
    """Flatten a cattrs error tree into 'field: message' lines."""
    from cattrs.errors import IterableValidationNote
    subs = getattr(exc, "exceptions", None)
    if not subs:
        return [f"{path}: {exc}" if path else str(exc)]
    out = []
    for sub in subs:
        where = path
        for note in getattr(sub, "__notes__", []):
            name = getattr(note, "name", None)
            if isinstance(note, IterableValidationNote):
                where = f"{where}[{note.index}]"
            elif name is not None:
                where = f"{where}.{name}" if where else name
        out += _option_errors(sub, where)
    return out


def validate_options(spec: MethodSpec | VerifierSpec, options: dict[str, Any], kind: str = "method") -> Any:
    """Structure and validate a method's (``kind="verifier"``: a verifier's) options into
    its attrs class, by type (cattrs) and by the class's own validators; unknown keys are
    an error listing the valid ones, a wrong type names the field and the type expected."""
    if spec.options is None:
        if options:
            raise ConfigError(f"{kind} {spec.name!r} takes no options, got: {', '.join(sorted(options))}")
        return None
    valid = [a.name for a in attrs.fields(spec.options)]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ConfigError(
            f"unknown option(s) {', '.join(unknown)} for {kind} {spec.name!r}; valid options: "
            f"{', '.join(valid) or '(none)'}"
        )
    try:
        return _options_converter().structure(dict(options), spec.options)
    except Exception as exc:  # cattrs' error tree, or a validator's ValueError / TypeError
        lines = _option_errors(exc)
        raise ConfigError(f"invalid options for {kind} {spec.name!r}: {'; '.join(lines)}") from exc
