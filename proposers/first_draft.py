"""``"method": "a+b"``: per sequence and step, the draft of the first method that has one.

N-gram lookup costs nothing and, when the text repeats, is accepted far more often than a
head (MAL above 3 on MT-bench where EAGLE-3 reaches about 1.7), but it drafts on only a
third of the steps. ``"ngram+eagle3"`` drafts those steps by lookup and the rest with the
head, so the head's drafting is paid only where lookup found nothing. Every part is built
from the same speculative config (``method`` replaced by its own name); ``options`` go to
the last part, the others take their defaults (the n-gram bounds are top-level fields).

At most one part may keep per-request state (a head), and it must be the last (a part whose
hooks are optional, ``hooks_optional``, such as n-gram, counts as stateless before it): it sees
every step's feedback (the states of tokens another part drafted join its backlog,
:class:`speculum.backends.torch.heads.proposer.ChainHeadProposer`), and a stateless part
has nothing to take back. Chains only: a token tree comes from one proposer.
"""

from __future__ import annotations

from typing import Sequence

import torch

from speculum.devices import on_device
from speculum.errors import ConfigError
from speculum.interfaces import (Draft, HiddenStateProposer, ProposeBatch, RewindableProposer, StatefulProposer,
                                 StepFeedback)


def split_method(method: str) -> list[str]:
    """``"ngram+eagle3"`` -> ``["ngram", "eagle3"]`` (one name -> a list of one)."""
    names = [m.strip() for m in method.split("+")]
    if any(not m for m in names):
        raise ConfigError(f"method {method!r}: write methods joined by '+', e.g. \"ngram+eagle3\"")
    return names


def first_draft(parts: Sequence, names: Sequence[str]) -> "FirstDraft":
    """The composite of ``parts``, with the per-request hooks of its last part and no others
    (the engine and the loop recognise hooks by their presence on the class)."""
    # (a part whose hooks are optional keeps nothing that needs them: it is stateless here)
    stateful = [n for i, (n, p) in enumerate(zip(names, parts)) if isinstance(p, StatefulProposer)
                and not (i + 1 < len(parts) and getattr(p, "hooks_optional", False))]
    if stateful and (len(stateful) > 1 or not isinstance(parts[-1], StatefulProposer)):
        raise ConfigError(f"method {'+'.join(names)!r}: only the last method may keep per-request state "
                          f"(a head or a draft model); {', '.join(stateful)} do. Put the model last, e.g. "
                          "\"ngram+eagle3\"")
    last = parts[-1]
    bases: list[type] = [FirstDraft]
    if isinstance(last, StatefulProposer):
        bases.append(_Stateful)
    if isinstance(last, RewindableProposer):
        bases.append(_Rewindable)
    if isinstance(last, HiddenStateProposer):
        bases.append(_HiddenStates)
    cls = type("FirstDraft", tuple(bases), {"__doc__": FirstDraft.__doc__})
    return cls(parts, names)


class FirstDraft:
    """Drafts with ``parts[0]``; the rows it leaves empty go to ``parts[1]``, and so on
    (built by :func:`first_draft`)."""

    def __init__(self, parts: Sequence, names: Sequence[str]):
        self.parts, self.names = list(parts), list(names)

    def propose(self, batch: ProposeBatch) -> Draft:
        return self._propose(batch, 0)

    def _propose(self, batch: ProposeBatch, i: int) -> Draft:
        draft = self.parts[i].propose(batch)
        if i + 1 == len(self.parts):
            return draft
        B = len(batch.seqs)
        lengths = list(draft.lengths) if draft.lengths is not None else draft.num_tokens.tolist()
        rest = [b for b in range(B) if lengths[b] == 0]
        if not rest:
            return draft
        sub = batch.sampling if len(rest) == B else batch.sampling.select(rest)
        later = self._propose(ProposeBatch([batch.seqs[b] for b in rest], batch.num_speculative_tokens, sub), i + 1)
        if len(rest) == B:
            return later
        return _merge(draft, lengths, later.scatter(rest, B), rest)

    def observe(self, feedback: StepFeedback) -> None:
        for p in self.parts:
            p.observe(feedback)


class _Stateful:
    def add_request(self, *args, **kwargs) -> None:
        self.parts[-1].add_request(*args, **kwargs)

    def remove_request(self, seq_id: int) -> None:
        self.parts[-1].remove_request(seq_id)


class _Rewindable:
    def rewind(self, seq_ids) -> None:  # the other parts are stateless: nothing to take back
        self.parts[-1].rewind(seq_ids)


class _HiddenStates:
    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return tuple(self.parts[-1].hidden_layers)


def _merge(first: Draft, lengths: list[int], later: Draft, rest: list[int]) -> Draft:
    """Rows of ``first`` that drafted (``lengths`` > 0), the others from ``later`` (both [B, ...])."""
    dev = later.token_ids.device
    B = len(lengths)
    k = max(first.token_ids.shape[1], later.token_ids.shape[1])
    token_ids = torch.full((B, k), -1, dtype=torch.int64, device=dev)
    token_ids[:, : first.token_ids.shape[1]] = first.token_ids.to(dev, torch.int64)
    rows = on_device(rest, dev)
    token_ids[rows] = -1
    token_ids[rows, : later.token_ids.shape[1]] = later.token_ids.to(torch.int64)[rows]
    later_lengths = later.lengths if later.lengths is not None else later.num_tokens.tolist()
    merged = [later_lengths[b] if n == 0 else n for b, n in enumerate(lengths)]
    probs = None
    if first.probs is not None or later.probs is not None:
        ref = later.probs if later.probs is not None else first.probs
        V, pdev = ref.shape[-1], ref.device
        probs = torch.zeros(B, k, V, dtype=ref.dtype, device=pdev)
        drafted = on_device([b for b, n in enumerate(lengths) if n > 0], pdev)
        for d, sel in ((first, drafted), (later, rows.to(pdev))):
            q = d.probs if d.probs is not None else _one_hot(d.token_ids, V, pdev, ref.dtype)  # deterministic drafts
            probs[sel, : q.shape[1]] = q.to(pdev, ref.dtype)[sel]
    return Draft(token_ids=token_ids, probs=probs, lengths=merged)


def _one_hot(token_ids: torch.Tensor, V: int, device, dtype) -> torch.Tensor:
    t = token_ids.to(device, torch.int64)
    out = torch.zeros(*t.shape, V, dtype=dtype, device=device)
    out.scatter_(-1, t.clamp_min(0).unsqueeze(-1), (t >= 0).unsqueeze(-1).to(dtype))
    return out
