"""What a proposer factory receives when the engine builds it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from speculum.config import SpeculativeConfig
from speculum.errors import ConfigError


@attrs.define(eq=False)
class ProposerContext:
    """Everything a method needs to build its proposer for one engine.

    ``options`` is the validated instance of the method's options class (or None).
    ``backend`` loads draft models (``backend.load_model(path, role="draft")``).
    """

    config: SpeculativeConfig
    options: Any
    backend: Any
    target: Any
    target_path: Path | None
    vocab_size: int
    tokenizer: Any
    max_model_len: int
    tensor_parallel_size: int = 1

    def resolve_draft_path(self, hint: str | None = None, default: Path | None = None) -> Path:
        """The draft checkpoint (``model`` of the config, else ``default``: one the method ships
        for this target) as a local transformers directory (GGUF converted; a draft saved without
        the target's embedding completed from the target, :func:`speculum.model_source.complete_draft`).
        ``hint`` says what else the user can do for this method (e.g. leave ``model`` unset for a
        shipped head, or train one); errors end with it."""
        from speculum.model_source import complete_draft, resolve_model_path
        method = self.config.method
        hint = hint or f"or train one with `speculum train {method}`"
        if self.config.model:
            path = resolve_model_path(self.config.model,
                                      what=f"{method} checkpoint ('model' of the speculative config)", hint=hint)
        elif default is not None:
            path = Path(default)
        else:
            raise ConfigError(f"method {method!r} needs 'model' in the speculative config: the path of a "
                              f"{method} checkpoint; {hint}")
        return complete_draft(path, self.target_path) if self.target_path is not None else path

    def check_vocab(self, draft_vocab_size: int, what: str = "draft model") -> None:
        """Raise a ConfigError when the draft's vocabulary differs from the target's."""
        if draft_vocab_size != self.vocab_size:
            raise ConfigError(
                f"{what} vocabulary size {draft_vocab_size} differs from the target's "
                f"{self.vocab_size}; draft and target must share one tokenizer/vocabulary. "
                "Pick a draft from the same model family."
            )
