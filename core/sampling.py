"""Sampling parameters of a request, and the per-step batch of them."""

from __future__ import annotations

from typing import Sequence

import attrs
import torch


def _non_negative(_inst, attribute, value):
    if value is not None and value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value}")


def _to_stop_list(value) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value)


@attrs.frozen
class SamplingParams:
    """How to sample one request (the fields vLLM and OpenAI users know).

    ``temperature=0`` is greedy decoding. ``top_k=0`` or ``-1`` and ``top_p=1`` disable
    those filters. ``seed`` makes a sampled request reproducible.
    """

    temperature: float = attrs.field(default=1.0, validator=_non_negative)
    top_p: float = attrs.field(default=1.0)
    top_k: int = attrs.field(default=0)
    max_tokens: int = attrs.field(default=16)
    stop: tuple[str, ...] = attrs.field(default=(), converter=_to_stop_list)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=lambda v: tuple(v or ()))
    ignore_eos: bool = False
    seed: int | None = None

    @top_p.validator
    def _check_top_p(self, _attr, value):
        if not 0.0 < value <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {value}")

    @top_k.validator
    def _check_top_k(self, _attr, value):
        if value < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {value}")

    @max_tokens.validator
    def _check_max_tokens(self, _attr, value):
        if value is None or value < 1:
            raise ValueError(f"max_tokens must be >= 1, got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class SamplingBatch:
    """Sampling settings of the rows of one step, plus per-row generators.

    The per-row tensors are built on first use only: an all-greedy step never needs them,
    which keeps host-to-device copies out of the fast path.
    """

    def __init__(self, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                 device: torch.device | str = "cpu"):
        self.params = list(params)
        # one generator per row, or a single generator shared by all rows
        self.generators = generators if isinstance(generators, torch.Generator) else list(generators)
        self.device = device
        self.all_greedy = all(p.temperature == 0 for p in self.params)
        self._t = None

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                    device: torch.device | str = "cpu") -> "SamplingBatch":
        return cls(params, generators, device)

    @classmethod
    def from_tensors(cls, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     generators: Sequence[torch.Generator | None]) -> "SamplingBatch":
        """Build directly from [B] tensors (tests, kernels)."""
        batch = cls([], generators, temperature.device)
        batch._t = (temperature.float(), top_k.long(), top_p.float())
        batch.all_greedy = bool((temperature == 0).all())
        return batch

    def _tensors(self):
        if self._t is None:
            ps = self.params
            self._t = (
                torch.tensor([p.temperature for p in ps], dtype=torch.float32).to(self.device),
                torch.tensor([max(p.top_k, 0) for p in ps], dtype=torch.int64).to(self.device),
                torch.tensor([p.top_p for p in ps], dtype=torch.float32).to(self.device),
            )
        return self._t

    @property
    def temperature(self) -> torch.Tensor:
        """[B] float32; 0 marks a greedy row."""
        return self._tensors()[0]

    @property
    def top_k(self) -> torch.Tensor:
        """[B] int64; 0 disables."""
        return self._tensors()[1]

    @property
    def top_p(self) -> torch.Tensor:
        """[B] float32; 1 disables."""
        return self._tensors()[2]

    def __len__(self) -> int:
        return self.temperature.shape[0] if self._t is not None else len(self.params)

    def flags(self, vocab_size: int) -> tuple[bool, bool, bool] | None:
        """(any top-k filter, any top-p filter, any greedy row) from the host-side params."""
        if not self.params:
            return None
        return (any(0 < p.top_k < vocab_size for p in self.params), any(p.top_p < 1 for p in self.params),
                any(p.temperature == 0 for p in self.params))


def processed_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor, flags: tuple[bool, bool, bool] | None = None) -> torch.Tensor:
    """Turn logits into the distribution a request samples from.

    ``logits``: [B, T, V]; ``temperature``, ``top_k``, ``top_p``: [B]. Returns float32
    probabilities [B, T, V]. Greedy rows (temperature 0) get a one-hot at the argmax.
    The same function serves target and draft, so both see identical filtering.
    ``flags`` = (any top-k, any top-p, any greedy row), known on the host from the
    requests' parameters (:meth:`SamplingBatch.flags`), spares three device syncs.
    """
    logits = logits.float()
    B, T, V = logits.shape
    greedy = temperature == 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature).view(B, 1, 1)
    scaled = logits / t
    k = top_k.view(B, 1, 1)
    if flags is None:
        flags = (bool(((top_k > 0) & (top_k < V)).any()), bool((top_p < 1).any()), bool(greedy.any()))
    need_k, need_p, any_greedy = flags
    if need_k or need_p:
        sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)
        remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if need_k:
            ranks = torch.arange(V, device=logits.device).view(1, 1, V)
            remove |= (k > 0) & (ranks >= k)
        if need_p:
            masked = sorted_logits.masked_fill(remove, float("-inf"))
            sp = masked.softmax(dim=-1)
            # mass strictly before each token; keep tokens until that mass reaches top_p
            before = sp.cumsum(dim=-1) - sp
            remove |= before >= top_p.view(B, 1, 1)
            remove[..., 0] = False
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(-1, sorted_idx, sorted_logits)
    probs = scaled.softmax(dim=-1)
    if any_greedy:
        onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy.view(B, 1, 1), onehot, probs)
    return probs


def sample_rows(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Draw one token per row of ``probs`` [B, V] with each row's own generator.

    Rows whose generator is None take the argmax (greedy).
    """
    out = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
    for b, gen in enumerate(generators):
        if gen is None:
            out[b] = probs[b].argmax()
        else:
            out[b] = torch.multinomial(probs[b], 1, generator=gen)[0]
    return out


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded by the request's seed, or from fresh entropy when None."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen
