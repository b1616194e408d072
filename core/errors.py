"""Errors speculum raises at its edges. Each message says what to do."""


class ConfigError(ValueError):
    """A configuration that cannot work; raised at construction."""


class PluginError(RuntimeError):
    """A plugin failed to load or broke its contract."""


class ModelLoadError(RuntimeError):
    """A model or tokenizer could not be found or loaded."""


class RequestError(ValueError):
    """A request that cannot be served (bad prompt, bad parameters)."""
