"""Log-probabilities of generated and prompt tokens, as vLLM returns them.

They come from the target's *raw* logits (vLLM's default ``logprobs_mode=raw_logprobs``:
``log_softmax`` of the model's output before temperature, penalties or any filter), at
the position that emitted each token. With speculation the emitted token at verify
position ``t`` follows the same prefix as it would without speculation, so its logits
and log-probabilities are the same (up to floating-point summation order: within 1e-5
in fp32, tests/test_sampling_features.py).

Each token's entry is ``{token id: Logprob}`` holding the emitted token and the top-n
(``logprobs=n``; ``0`` gives the emitted token only). ``rank`` is 1 for the likeliest
token.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from typing import Sequence

import attrs
import torch


@attrs.define
class Logprob:
    """One token's log-probability (vLLM's ``Logprob``)."""

    logprob: float
    #: 1 = the likeliest token
    rank: int | None = None
    decoded_token: str | None = None


#: (token id, logprob, rank, top ids, top logprobs) of one emitted token, kept on the host
TokenLogprobs = tuple[int, float, int, list[int], list[float]]


def position_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top_n: int) -> list[list[TokenLogprobs]]:
    """Log-probabilities of ``tokens`` [R, T] under ``logits`` [R, T, V] (raw, fp32).

    Returns per row and position (token id, logprob, rank, top ids, top logprobs); token
    ids < 0 (padding) are scored as token 0 and should be dropped by the caller. One
    host copy.
    """
    logp = torch.log_softmax(logits.double(), dim=-1)  # [R, T, V] (float64: no rounding of its own)
    tok = tokens.to(logp.device, torch.int64).clamp_min(0)
    lp = logp.gather(-1, tok.unsqueeze(-1))  # [R, T, 1]
    rank = (logp > lp).sum(-1) + 1  # [R, T]
    parts = [lp.squeeze(-1), rank.to(lp.dtype)]
    if top_n > 0:
        top = logp.topk(top_n, dim=-1)
        parts += [top.values, top.indices.to(lp.dtype)]
    host = torch.cat([p.reshape(*tok.shape, -1).double() for p in parts], dim=-1).cpu().tolist()  # [R, T, 2 + 2n]
    ids = tok.cpu().tolist()
    return [[(ids[r][t], h[0], int(h[1]), [int(x) for x in h[2 + top_n:]], h[2: 2 + top_n])
             for t, h in enumerate(row)] for r, row in enumerate(host)]


def as_dicts(entries: Sequence[TokenLogprobs] | None, decode=None) -> list[dict[int, Logprob]] | None:
    """vLLM's form: per token ``{token id: Logprob}`` (emitted token first, then the top-n)."""
    if entries is None:
        return None
    out = []
    for tok, lp, rank, top_ids, top_lps in entries:
        d = {tok: Logprob(lp, rank, decode(tok) if decode else None)}
        for i, (t, v) in enumerate(zip(top_ids, top_lps)):
            if t not in d:
                d[t] = Logprob(v, i + 1, decode(t) if decode else None)
        out.append(d)
    return out


class LazyLogprobs(SequenceABC):
    """A running request's logprobs in vLLM's form, converted only where read (a stream
    reads the new tokens' entries each step, never the whole list again)."""

    def __init__(self, entries: Sequence[TokenLogprobs], decode=None):
        self._entries = list(entries)
        self._decode = decode

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return as_dicts(self._entries[i], self._decode)
        return as_dicts([self._entries[i]], self._decode)[0]


def prompt_scorer(prompt: Sequence[int], top_n: int):
    """A ``logits_sink`` for a runner's prefill that collects prompt logprobs.

    Returns ``(sink, entries)``: ``sink(start, logits [n, V])`` scores prefill positions
    ``start .. start + n - 1``, whose logits predict prompt tokens ``start + 1 ..``;
    ``entries`` fills with one entry per prompt token after the first.
    """
    entries: dict[int, TokenLogprobs] = {}

    def sink(start: int, logits: torch.Tensor) -> None:
        n = logits.shape[0]
        targets = torch.tensor([prompt[start + i + 1] for i in range(n)], dtype=torch.int64)
        rows = position_logprobs(logits.unsqueeze(0), targets.view(1, n), top_n)[0]
        for i, e in enumerate(rows):
            entries[start + i + 1] = e

    return sink, entries
