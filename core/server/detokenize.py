"""Streaming text from token ids: emit only the new text, never text that may still change.

The engine's outputs carry token ids (text is None until a request finishes), so a
stream decodes the ids it has so far and sends what is new. Two kinds of tail are held
back until more tokens settle them: an incomplete UTF-8 character (decoded as a trailing
U+FFFD) and text that could be the start of a stop string (the engine cuts a matched stop
string from the final text, so it must never reach the client).
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

log = logging.getLogger(__name__)


def stop_holdback(text: str, stop: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def settled_text(text: str, stop: Sequence[str] = ()) -> str:
    """The part of ``text`` that more tokens cannot change nor cut."""
    end = len(text.rstrip("\ufffd"))
    if stop:
        end -= stop_holdback(text[:end], stop)
    return text[:end]


class IncrementalDetokenizer:
    """Turns the growing output of one request into text deltas.

    ``decode`` maps all output token ids to text (the engine's own decoding, so the sum
    of the deltas equals the engine's final text).
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
        self._decode = decode
        self._stop = tuple(stop)
        self.token_ids: list[int] = []
        self.sent = ""

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Take new token ids; return the text that is now safe to send (may be "")."""
        self.token_ids.extend(new_token_ids)
        safe = settled_text(self._decode(self.token_ids), self._stop)
        if not safe.startswith(self.sent) or len(safe) <= len(self.sent):
            return ""  # nothing new, or decoding revised earlier text: wait for the final text
        delta = safe[len(self.sent):]
        self.sent = safe
        return delta

    def finish(self, final_text: str | None, new_token_ids: Sequence[int] = ()) -> str:
        """The rest of the text, given the engine's final text (stop strings already cut)."""
        self.token_ids.extend(new_token_ids)
        if final_text is None:
            final_text = self._decode(self.token_ids)
        if not final_text.startswith(self.sent):
            log.warning("streamed text %r is not a prefix of the final text %r", self.sent[-40:], final_text[-40:])
            return ""
        delta = final_text[len(self.sent):]
        self.sent = final_text
        return delta
