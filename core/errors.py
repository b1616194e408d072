"""Errors speculum raises at its edges. Each message says what to do."""


class ConfigError(ValueError):
    """A configuration that cannot work; raised at construction."""


class PluginError(RuntimeError):
    """A plugin failed to load or broke its contract."""


class ModelLoadError(RuntimeError):
    """A model or tokenizer could not be found or loaded."""


class RequestError(ValueError):
    """A request that cannot be served (bad prompt, bad parameters)."""


class RowError(RuntimeError):
    """A proposer or verifier failed on some rows of a step only.

    ``rows``: indices into the batch it was given. Those requests finish with
    ``finish_reason="error"``; the other rows run the step without drafts.
    """

    def __init__(self, message: str, rows):
        super().__init__(message)
        self.rows = list(rows)


class EngineDeadError(RuntimeError):
    """The engine's device failed; it refuses new work (restart the process)."""
