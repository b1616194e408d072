"""Logits processing that depends on the tokens before each position: penalties,
``logit_bias``, ``min_tokens``, ``bad_words`` and ``min_p``.

In a verify step the target scores ``k + 1`` positions at once. Position ``t`` of row
``b`` follows the request's tokens so far *and* the drafts ``d_1 .. d_t`` before it, so
its penalties count those drafts too (:meth:`TokenRules.apply`, ``new_tokens``). Applied
this way, the processed target distribution at position ``t`` is exactly the one plain
decoding would use after emitting ``d_1 .. d_t``; when a draft is accepted the next
position's distribution is therefore right, and when one is rejected nothing after it
is used. The rejection sampler only needs, at every position it reaches, the target's
true distribution given the emitted prefix (``p``) and the distribution the draft token
was drawn from (``q``); it is exact for any ``q``. Proposers that sample apply the same
rules to their own logits (same function, their drafts so far as ``new_tokens``) so
that ``q`` stays close to ``p`` and drafts are accepted; that is for speed only.

Order (vLLM's): bad words, min_tokens, logit_bias, then the repetition penalty
(``l / r`` for a seen token with ``l > 0``, ``l * r`` otherwise; seen = in the prompt or
the output), the frequency penalty (``- f * count``) and the presence penalty
(``- p * [count > 0]``), counts over the output only; then ``min_p`` (after temperature,
as vLLM applies it; done here on logits: keep ``x`` when ``l_x >= l_max + T ln(min_p)``,
which is ``p_T(x) >= min_p * max p_T``). Temperature, top-k and top-p follow in
:func:`speculum.sampling.processed_probs`. Greedy requests take the argmax of these
processed logits (``min_p`` never changes it).
"""

from __future__ import annotations

import math
from typing import Sequence

import attrs
import torch

from speculum.devices import on_device


@attrs.frozen
class TokenRules:
    """The token-id form of one request's token-dependent settings (resolved when the
    request is added: bad words tokenised, EOS ids known)."""

    #: banned token sequences: the last token is banned where the others precede it
    bad_words: tuple[tuple[int, ...], ...] = ()
    #: masked while fewer than ``min_tokens`` tokens were generated (EOS + stop_token_ids)
    min_tokens_stop_ids: tuple[int, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.bad_words and not self.min_tokens_stop_ids


NO_RULES = TokenRules()


def needs_processing(params, rules: TokenRules | None) -> bool:
    """Whether a request's logits are processed here (host-side, from its parameters)."""
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
                or params.logit_bias or params.min_p > 0 or params.min_tokens or params.bad_words
                or (rules is not None and rules.bad_words))


class LogitsRules:
    """The processing of one step's rows, built once per step (tensors on first use).

    ``params``: per-row :class:`~speculum.sampling.SamplingParams`; ``histories``: per
    row ``(token_ids, num_prompt_tokens)`` (prompt then output so far); ``rules``: per-row
    :class:`TokenRules`.
    """

    def __init__(self, params: Sequence, histories: Sequence[tuple[Sequence[int], int]],
                 rules: Sequence[TokenRules], device: torch.device | str):
        self.params = list(params)
        self.histories = list(histories)
        self.rules = list(rules)
        self.device = torch.device(device)
        ps = self.params
        self.any_counts = any(p.presence_penalty or p.frequency_penalty for p in ps)
        self.any_repetition = any(p.repetition_penalty != 1.0 for p in ps)
        self.any_bias = any(p.logit_bias for p in ps)
        self.any_min_p = any(p.min_p > 0 and p.temperature > 0 for p in ps)
        self.any_min_tokens = any(p.min_tokens and r.min_tokens_stop_ids for p, r in zip(ps, self.rules))
        self.any_bad_words = any(r.bad_words for r in self.rules)
        self._cache: dict[str, torch.Tensor] = {}

    # -- per-step tensors --------------------------------------------------------------
    def _outputs(self, V: int) -> torch.Tensor:
        """[B, V] float32 counts of each token in the output so far."""
        if "counts" not in self._cache:
            B = len(self.params)
            rows = [list(t[n:]) for t, n in self.histories]
            L = max((len(r) for r in rows), default=0)
            ids = torch.full((B, max(L, 1)), V, dtype=torch.int64)  # V: a dummy column
            for b, r in enumerate(rows):
                if r:
                    ids[b, : len(r)] = torch.tensor(r, dtype=torch.int64)
            counts = torch.zeros(B, V + 1, dtype=torch.float32)
            counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
            self._cache["counts"] = counts[:, :V].to(self.device, non_blocking=True)
        return self._cache["counts"]

    def _seen_in_prompt(self, V: int) -> torch.Tensor:
        """[B, V] bool: tokens of each row's prompt (the repetition penalty's extra set)."""
        if "prompt" not in self._cache:
            B = len(self.params)
            seen = torch.zeros(B, V, dtype=torch.bool)
            for b, ((toks, n), p) in enumerate(zip(self.histories, self.params)):
                if p.repetition_penalty != 1.0 and n:
                    seen[b, torch.tensor(list(toks[:n]), dtype=torch.int64)] = True
            self._cache["prompt"] = seen.to(self.device, non_blocking=True)
        return self._cache["prompt"]

    def _row_values(self, name: str, fn) -> torch.Tensor:
        if name not in self._cache:
            self._cache[name] = on_device([float(fn(p)) for p in self.params], self.device, torch.float32)
        return self._cache[name]

    def _bias(self, V: int) -> torch.Tensor:
        if "bias" not in self._cache:
            bias = torch.zeros(len(self.params), V, dtype=torch.float32)
            for b, p in enumerate(self.params):
                for tok, v in p.logit_bias:
                    bias[b, tok] += v
            self._cache["bias"] = bias.to(self.device, non_blocking=True)
        return self._cache["bias"]

    # -- the processing ------------------------------------------------------------------
    def apply(self, logits: torch.Tensor, new_tokens: torch.Tensor | None = None, offset: int = 0,
              rows: Sequence[int] | None = None) -> torch.Tensor:
        """Processed logits [R, T, V] (float32) for ``logits`` [R, T, V].

        ``new_tokens`` [R, n] (-1 padded): tokens that follow each row's history; position
        ``t`` of ``logits`` comes after ``new_tokens[:, :offset + t]`` (a verify step:
        the drafts, offset 0; a proposer's i-th draft step: its drafts so far, offset i).
        A -1 ends a row's new tokens (later positions are never used by verification).
        ``rows``: the step's rows these logits belong to (a proposer's subset; default all).
        """
        logits = logits.float()
        R, T, V = logits.shape
        sel = list(range(len(self.params))) if rows is None else list(rows)
        idx = on_device(sel, self.device)
        need = offset + T - 1  # new tokens that precede the last position
        if need > 0:
            if new_tokens is None or new_tokens.shape[1] < need:
                raise ValueError(f"positions {offset}..{offset + T - 1} need {need} new tokens, got "
                                 f"{0 if new_tokens is None else new_tokens.shape[1]}")
            new = new_tokens[:, :need].to(self.device, torch.int64)
            valid = (new >= 0).to(torch.int64).cumprod(dim=1).bool()  # [R, need]
            new = torch.where(valid, new, torch.zeros_like(new))
        else:
            new = torch.zeros(R, 0, dtype=torch.int64, device=self.device)
            valid = torch.zeros(R, 0, dtype=torch.bool, device=self.device)
        if self.any_bad_words:
            logits = self._ban_bad_words(logits, sel, new, valid, offset)
        if self.any_min_tokens:
            logits = self._min_tokens(logits, sel, offset)
        if self.any_bias:
            logits = logits + self._bias(V)[idx].unsqueeze(1)
        if self.any_counts or self.any_repetition:
            counts = self._outputs(V)[idx].unsqueeze(1).expand(R, T, V).clone()  # [R, T, V]
            if need:
                # one-hot of new token j added to every position after it (t > j - offset)
                onehot = torch.zeros(R, need, V, device=self.device)
                onehot.scatter_(2, new.unsqueeze(-1), valid.unsqueeze(-1).float())
                cum = onehot.cumsum(dim=1)  # [R, need, V]: counts of new[:, :j+1]
                for t in range(T):
                    j = offset + t - 1  # position t follows new[:, :offset + t]
                    if j >= 0:
                        counts[:, t] += cum[:, j]
            if self.any_repetition:
                r = self._row_values("rep", lambda p: p.repetition_penalty)[idx].view(R, 1, 1)
                seen = (counts > 0) | self._seen_in_prompt(V)[idx].unsqueeze(1)
                logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
            if self.any_counts:
                f = self._row_values("freq", lambda p: p.frequency_penalty)[idx].view(R, 1, 1)
                pp = self._row_values("pres", lambda p: p.presence_penalty)[idx].view(R, 1, 1)
                logits = logits - f * counts - pp * (counts > 0).float()
        if self.any_min_p:
            logits = self._min_p(logits, idx)
        return logits

    def _min_p(self, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        R = logits.shape[0]
        min_p = self._row_values("min_p", lambda p: p.min_p if p.temperature > 0 else 0.0)[idx].view(R, 1, 1)
        temp = self._row_values("temp", lambda p: p.temperature)[idx].view(R, 1, 1)
        # ln(0) = -inf: rows without min_p keep everything
        floor = logits.max(dim=-1, keepdim=True).values + temp * torch.log(min_p)
        floor = torch.where(min_p > 0, floor, torch.full_like(floor, -math.inf))
        return logits.masked_fill(logits < floor, -math.inf)

    def _min_tokens(self, logits: torch.Tensor, sel: list[int], offset: int) -> torch.Tensor:
        R, T, V = logits.shape
        mask = torch.zeros(R, T, V, dtype=torch.bool)
        for r, b in enumerate(sel):
            p, rule = self.params[b], self.rules[b]
            if not p.min_tokens or not rule.min_tokens_stop_ids:
                continue
            toks, n = self.histories[b]
            generated = len(toks) - n
            ids = torch.tensor(rule.min_tokens_stop_ids, dtype=torch.int64)
            for t in range(T):
                if generated + offset + t < p.min_tokens:  # output length before this position
                    mask[r, t, ids] = True
        return logits.masked_fill(mask.to(logits.device), -math.inf)

    def _ban_bad_words(self, logits: torch.Tensor, sel: list[int], new: torch.Tensor, valid: torch.Tensor,
                       offset: int) -> torch.Tensor:
        R, T, V = logits.shape
        mask = torch.zeros(R, T, V, dtype=torch.bool)
        host_new = new.tolist() if new.numel() else [[] for _ in range(R)]  # a sync, only with bad_words
        host_valid = valid.tolist() if valid.numel() else [[] for _ in range(R)]
        for r, b in enumerate(sel):
            words = self.rules[b].bad_words
            if not words:
                continue
            toks, n = self.histories[b]
            extra = [tok for tok, ok in zip(host_new[r], host_valid[r]) if ok]
            for t in range(T):
                if offset + t > len(extra):
                    break  # after the row's last valid new token: never used
                hist = list(toks[n:]) + extra[: offset + t]  # the output before this position
                for w in words:
                    m = len(w) - 1
                    if m == 0 or (len(hist) >= m and hist[len(hist) - m:] == list(w[:-1])):
                        mask[r, t, w[-1]] = True
        return logits.masked_fill(mask.to(logits.device), -math.inf)
