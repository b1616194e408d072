"""Sampling parameters of a request, and the per-step batch of them."""

from __future__ import annotations

from typing import Sequence

import attrs
import torch

from speculum.devices import on_device
from speculum.logits_process import NO_RULES, LogitsRules, TokenRules, needs_processing


def _non_negative(_inst, attribute, value):
    if value is not None and value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value}")


def _to_stop_list(value) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value)


def _to_logit_bias(value) -> tuple[tuple[int, float], ...]:
    """``{token id: bias}`` (ids may be strings, as JSON writes them) -> sorted pairs."""
    if not value:
        return ()
    items = value.items() if hasattr(value, "items") else value
    out = {}
    for tok, bias in items:
        try:
            out[int(tok)] = float(bias)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias maps token ids to numbers, got {tok!r}: {bias!r}") from None
    return tuple(sorted(out.items()))


def _optional_count(_inst, attribute, value):
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ValueError(f"{attribute.name} must be None or an integer >= 0, got {value!r}")


def _in_range(lo: float, hi: float):
    def check(_inst, attribute, value):
        if not lo <= value <= hi:
            raise ValueError(f"{attribute.name} must be in [{lo}, {hi}], got {value}")
    return check


@attrs.frozen
class SamplingParams:
    """How to sample one request (the fields vLLM and OpenAI users know).

    ``temperature=0`` is greedy decoding. ``top_k=0`` or ``-1`` and ``top_p=1`` disable
    those filters. ``seed`` makes a sampled request reproducible.

    Every field works with speculation on and keeps it lossless (docs/config.md,
    "Sampling under speculation"): ``n`` / ``best_of`` samples; ``presence_penalty``,
    ``frequency_penalty`` (OpenAI's, over the output) and ``repetition_penalty`` (over
    prompt and output); ``min_p``; ``logit_bias`` (``{token id: bias}``, added to the
    logits); ``min_tokens`` (EOS and ``stop_token_ids`` masked until that many tokens);
    ``bad_words`` (strings never generated); ``logprobs`` (top-n log-probabilities of each
    generated token, from the target's raw logits as vLLM's default ``raw_logprobs``)
    and ``prompt_logprobs`` (the same for prompt tokens). ``speculative=False`` runs the
    request without drafts (in the same batch as speculative ones);
    ``num_speculative_tokens`` caps its drafts per step (at most the engine's).
    """

    temperature: float = attrs.field(default=1.0, validator=_non_negative)
    top_p: float = attrs.field(default=1.0)
    top_k: int = attrs.field(default=0)
    max_tokens: int = attrs.field(default=16)
    stop: tuple[str, ...] = attrs.field(default=(), converter=_to_stop_list)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=lambda v: tuple(v or ()))
    ignore_eos: bool = False
    seed: int | None = None
    #: samples returned per prompt, and samples drawn to pick them from (highest cumulative logprob)
    n: int = attrs.field(default=1)
    best_of: int | None = attrs.field(default=None)
    presence_penalty: float = attrs.field(default=0.0, validator=_in_range(-2.0, 2.0))
    frequency_penalty: float = attrs.field(default=0.0, validator=_in_range(-2.0, 2.0))
    repetition_penalty: float = attrs.field(default=1.0)
    min_p: float = attrs.field(default=0.0, validator=_in_range(0.0, 1.0))
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_to_logit_bias)
    min_tokens: int = attrs.field(default=0, validator=_non_negative)
    bad_words: tuple[str, ...] = attrs.field(default=(), converter=_to_stop_list)
    logprobs: int | None = attrs.field(default=None, validator=_optional_count)
    prompt_logprobs: int | None = attrs.field(default=None, validator=_optional_count)
    speculative: bool = True
    num_speculative_tokens: int | None = attrs.field(default=None, validator=_optional_count)

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

    @n.validator
    def _check_n(self, _attr, value):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"n must be an integer >= 1, got {value!r}")

    @best_of.validator
    def _check_best_of(self, _attr, value):
        if value is not None and (not isinstance(value, int) or value < self.n):
            raise ValueError(f"best_of must be an integer >= n ({self.n}), got {value!r}")

    @repetition_penalty.validator
    def _check_repetition(self, _attr, value):
        if not value > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 disables it), got {value}")

    @logit_bias.validator
    def _check_bias(self, _attr, value):
        bad = [(t, b) for t, b in value if t < 0 or not -100.0 <= b <= 100.0]
        if bad:
            raise ValueError(f"logit_bias entries must map token ids >= 0 to biases in [-100, 100], got {bad[:3]}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_samples(self) -> int:
        """Sequences this request runs (``best_of`` if set, else ``n``)."""
        return self.best_of or self.n


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """The parameters of sample ``index`` of a request with ``n`` / ``best_of`` > 1.

    Each sample is one sequence with ``n=1``. A seeded request gives sample ``i`` its own
    seed derived from ``(seed, i)`` (sample 0 keeps ``seed``), so the samples are
    independent draws and the request stays reproducible. ``best_of > n`` needs the
    cumulative log-probability of each sample: their logprobs are computed (top 0) and
    dropped from the output unless the request asked for them.
    """
    seed = params.seed
    if seed is not None and index:
        seed = (seed * 1_000_003 + index * 7_919) % (2 ** 63 - 1)
    logprobs = params.logprobs
    if logprobs is None and (params.best_of or 1) > params.n:
        logprobs = 0
    return attrs.evolve(params, n=1, best_of=None, seed=seed, logprobs=logprobs,
                        prompt_logprobs=params.prompt_logprobs if index == 0 else None)


class SamplingBatch:
    """Sampling settings of the rows of one step, plus per-row generators.

    The per-row tensors are built on first use only: an all-greedy step never needs them,
    which keeps host-to-device copies out of the fast path.
    """

    def __init__(self, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                 device: torch.device | str = "cpu", histories: Sequence[tuple[Sequence[int], int]] | None = None,
                 rules: Sequence[TokenRules] | None = None, needs: bool | None = None):
        self.params = list(params)
        # one generator per row, or a single generator shared by all rows
        self.generators = generators if isinstance(generators, torch.Generator) else list(generators)
        self.device = device
        self.all_greedy = all(p.temperature == 0 for p in self.params)
        self._t = None
        #: per row (token ids so far, prompt length) and token rules: what penalties,
        #: min_tokens and bad_words read (None: rows without them only)
        self.histories = list(histories) if histories is not None else None
        self.rules = list(rules) if rules is not None else [NO_RULES] * len(self.params)
        #: whether any row's logits go through :class:`~speculum.logits_process.LogitsRules`
        self.needs_processing = (any(needs_processing(p, r) for p, r in zip(self.params, self.rules))
                                 if needs is None else needs)
        self._logits_rules = None
        #: per row (noise seed, position of the first token this step samples), or None:
        #: what noise keyed by position reads (``speculum.verifiers.noise.keyed_exponentials``)
        self.keys: list[tuple[int, int]] | None = None

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                    device: torch.device | str = "cpu", histories: Sequence[tuple[Sequence[int], int]] | None = None,
                    rules: Sequence[TokenRules] | None = None, needs: bool | None = None,
                    keys: Sequence[tuple[int, int]] | None = None) -> "SamplingBatch":
        """``needs``: whether any row needs :meth:`process_logits`, when the caller knows
        (the loop does, per sequence); None works it out from the parameters. ``keys``:
        per row (seed, position of the next token), for noise keyed by position."""
        batch = cls(params, generators, device, histories, rules, needs)
        batch.keys = list(keys) if keys is not None else None
        return batch

    def select(self, rows: Sequence[int]) -> "SamplingBatch":
        """The batch of the given rows only (a proposer's subset), histories included."""
        gens = self.generators if isinstance(self.generators, torch.Generator) else [self.generators[b] for b in rows]
        batch = SamplingBatch([self.params[b] for b in rows], gens, self.device,
                              [self.histories[b] for b in rows] if self.histories is not None else None,
                              [self.rules[b] for b in rows])
        batch.keys = [self.keys[b] for b in rows] if self.keys is not None else None
        return batch

    def process_logits(self, logits: torch.Tensor, new_tokens: torch.Tensor | None = None, offset: int = 0,
                       rows: Sequence[int] | None = None) -> torch.Tensor:
        """Penalties, logit_bias, min_tokens, bad_words and min_p applied to ``logits``
        [R, T, V] (see :mod:`speculum.logits_process`); the logits unchanged when no row
        uses them. ``new_tokens`` [R, n]: tokens after each row's history (drafts);
        position ``t`` follows ``new_tokens[:, :offset + t]``. ``rows``: which of this
        batch's rows ``logits`` holds (default: all)."""
        if not self.needs_processing:
            return logits
        if self._logits_rules is None:
            if self.histories is None:
                raise ValueError("these sampling parameters (penalties, min_tokens, bad_words...) need the rows' "
                                 "token histories: build the batch with SamplingBatch.from_params(..., histories=)")
            self._logits_rules = LogitsRules(self.params, self.histories, self.rules, self.device)
        return self._logits_rules.apply(logits, new_tokens, offset, rows)

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
                on_device([p.temperature for p in ps], self.device, torch.float32),  # asynchronous copies
                on_device([max(p.top_k, 0) for p in ps], self.device),
                on_device([p.top_p for p in ps], self.device, torch.float32),
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
