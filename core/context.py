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

    def resolve_draft_path(self) -> Path:
        """The draft checkpoint as a local transformers directory (GGUF converted)."""
        from speculum.model_source import resolve_model_path
        if not self.config.model:
            raise ConfigError(f"method {self.config.method!r} needs 'model': the path of a draft checkpoint")
        return resolve_model_path(self.config.model)

    def check_vocab(self, draft_vocab_size: int, what: str = "draft model") -> None:
        """Raise a ConfigError when the draft's vocabulary differs from the target's."""
        if draft_vocab_size != self.vocab_size:
            raise ConfigError(
                f"{what} vocabulary size {draft_vocab_size} differs from the target's "
                f"{self.vocab_size}; draft and target must share one tokenizer/vocabulary. "
                "Pick a draft from the same model family."
            )
