"""Tokenizer access for the engine: text and chat prompts in, text out."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from speculum.errors import RequestError


class Tokenizer:
    """A thin wrapper over a transformers tokenizer (or none, for token-id-only models)."""

    def __init__(self, hf_tokenizer: Any | None, eos_token_ids: Sequence[int] = ()):
        self.hf = hf_tokenizer
        ids = set(eos_token_ids)
        if hf_tokenizer is not None and hf_tokenizer.eos_token_id is not None:
            ids.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(ids)

    @classmethod
    def load(cls, path: Path | None, eos_token_ids: Sequence[int] = ()) -> "Tokenizer":
        hf = None
        if path is not None and any((Path(path) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            from transformers import AutoTokenizer
            hf = AutoTokenizer.from_pretrained(str(path))
        return cls(hf, eos_token_ids)

    def _need(self, what: str):
        if self.hf is None:
            raise RequestError(
                f"this model has no tokenizer, so {what} is not possible; pass token ids as "
                '{"prompt_token_ids": [...]}'
            )
        return self.hf

    def encode(self, text: str) -> list[int]:
        return list(self._need("a text prompt").encode(text, add_special_tokens=True))

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.chat_prompt(messages)[1]

    def chat_prompt(self, messages: list[dict]) -> tuple[str, list[int]]:
        """(the templated prompt text, its token ids) of a conversation."""
        tok = self._need("a chat prompt")
        if not getattr(tok, "chat_template", None):
            raise RequestError("this model's tokenizer has no chat template; send a plain text prompt")
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # malformed messages: the template's own error, named
            raise RequestError(f"the chat template could not render these messages ({type(exc).__name__}: "
                               f"{exc}); each message needs 'role' and 'content'") from exc
        # the template writes its special tokens itself; tokenizing its text adds none
        return text, list(tok.encode(text, add_special_tokens=False))

    def user_turn_prefix(self) -> list[int]:
        """Token ids of a conversation up to where the user's first message begins, as the
        chat template writes it (its default system prompt included)."""
        from speculum.errors import ConfigError
        tok = self._need("a chat template")
        if not getattr(tok, "chat_template", None):
            raise ConfigError("this model's tokenizer has no chat template: it cannot write its own chat requests")
        marker = "\u2063speculum-request\u2063"
        text = tok.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=False,
                                       tokenize=False)
        if marker not in text:
            raise ConfigError("the chat template does not show the user's message as written; no request prefix")
        return list(tok.encode(text[: text.index(marker)], add_special_tokens=False))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self.hf is None:
            return ""
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
