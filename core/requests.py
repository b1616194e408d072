"""What the engine checks and derives when a request arrives, and how a request's
samples (``n`` / ``best_of``) become one :class:`~speculum.outputs.RequestOutput`.

Every sampling field is either served losslessly under speculation or refused here with
an error that says what to change; none is silently ignored.
"""

from __future__ import annotations

from typing import Sequence as Seq

import attrs

from speculum.errors import RequestError
from speculum.logits_process import TokenRules
from speculum.logprobs import LazyLogprobs, as_dicts
from speculum.metrics import SpecDecodeMetrics
from speculum.outputs import CompletionOutput, RequestOutput
from speculum.sampling import SamplingParams
from speculum.sequence import Sequence
from speculum.tokenizer import Tokenizer


@attrs.frozen
class RequestLimits:
    """What an engine can serve (checked against each request's parameters)."""

    vocab_size: int
    #: the engine's num_speculative_tokens (0: no speculation)
    max_k: int
    #: the most top logprobs per token (vLLM's ``max_logprobs``, default 20)
    max_logprobs: int = 20
    #: whether the target runner can hand over prefill logits (prompt_logprobs)
    prompt_logprobs: bool = True


def check_params(params: SamplingParams, limits: RequestLimits) -> None:
    """Raise RequestError for parameters this engine cannot serve exactly."""
    if params.num_speculative_tokens is not None and params.num_speculative_tokens > limits.max_k:
        if limits.max_k == 0:
            raise RequestError(f"num_speculative_tokens={params.num_speculative_tokens}, but this engine runs "
                               "without speculation; leave num_speculative_tokens unset (or start the engine "
                               "with a speculative_config)")
        raise RequestError(f"num_speculative_tokens={params.num_speculative_tokens} is higher than the engine's "
                           f"{limits.max_k}; ask for at most {limits.max_k} (0 or speculative=false turns "
                           "speculation off for this request)")
    for name in ("logprobs", "prompt_logprobs"):
        n = getattr(params, name)
        if n is not None and n > limits.max_logprobs:
            raise RequestError(f"{name}={n} is more than this engine returns ({limits.max_logprobs}); ask for "
                               f"at most {limits.max_logprobs}")
    if params.prompt_logprobs is not None and not limits.prompt_logprobs:
        raise RequestError("prompt_logprobs need a runner that returns prefill logits (the torch backend's "
                           "native and transformers runners do); this engine's runner does not")
    bad = [t for t, _ in params.logit_bias if t >= limits.vocab_size]
    if bad:
        raise RequestError(f"logit_bias names token ids {bad[:5]} outside the vocabulary "
                           f"(0..{limits.vocab_size - 1})")
    if params.min_tokens > params.max_tokens:
        raise RequestError(f"min_tokens ({params.min_tokens}) must be <= max_tokens ({params.max_tokens})")
    if params.best_of is not None and params.best_of > params.n and params.greedy:
        raise RequestError(f"best_of={params.best_of} with temperature 0 would return {params.n} copies of one "
                           "greedy output; use temperature > 0 or leave best_of unset")


def token_rules(params: SamplingParams, tokenizer: Tokenizer) -> TokenRules:
    """bad_words as token sequences (each word as written and with a leading space, as
    vLLM tokenises them) and the ids min_tokens holds back (EOS unless ignore_eos, and
    stop_token_ids)."""
    words: list[tuple[int, ...]] = []
    if params.bad_words:
        if tokenizer.hf is None:
            raise RequestError("bad_words need a tokenizer; this model has none")
        for w in params.bad_words:
            for text in (w, " " + w.lstrip()):
                ids = tuple(tokenizer.hf.encode(text, add_special_tokens=False))
                if ids and ids not in words:
                    words.append(ids)
    stop_ids: tuple[int, ...] = ()
    if params.min_tokens:
        ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            ids |= set(tokenizer.eos_token_ids)
        stop_ids = tuple(sorted(ids))
    return TokenRules(bad_words=tuple(words), min_tokens_stop_ids=stop_ids)


def request_output(request_id: str, prompt: str | None, prompt_token_ids: list[int], seqs: Seq[Sequence],
                   params: SamplingParams, tokenizer: Tokenizer) -> RequestOutput:
    """One request's output from its samples: ``n`` of them, the best ``n`` by cumulative
    log-probability when ``best_of > n`` (finished samples only count)."""
    finished = all(s.finished for s in seqs)
    chosen = list(seqs)
    if len(seqs) > params.n and finished:
        chosen = sorted(seqs, key=lambda s: (-(s.cumulative_logprob or 0.0), s.index))[: params.n]
    elif len(seqs) > params.n:
        chosen = list(seqs)[: params.n]
    want_logprobs = params.logprobs is not None
    decode = (lambda t: tokenizer.decode([t], skip_special_tokens=False)) if tokenizer.hf is not None else None
    outputs = []
    for i, s in enumerate(chosen):
        out_ids = s.output_token_ids
        text = (s.text if s.text is not None else tokenizer.decode(out_ids)) if s.finished else None
        outputs.append(CompletionOutput(
            i, text, list(out_ids), s.finish_reason, s.stop_reason,
            logprobs=(as_dicts(s.logprobs, decode) if s.finished else LazyLogprobs(s.logprobs)) if want_logprobs
            else None,
            cumulative_logprob=s.cumulative_logprob if want_logprobs or len(seqs) > params.n else None))
    first = seqs[0]
    if len(seqs) == 1:
        metrics = first.metrics
    else:
        metrics = SpecDecodeMetrics()
        for s in seqs:
            metrics.merge(s.metrics)
    errors = [s.error for s in seqs if s.error]
    times = [s.first_token_time for s in seqs if s.first_token_time]
    ends = [s.finish_time for s in seqs if s.finish_time]
    return RequestOutput(
        request_id=request_id, prompt=prompt, prompt_token_ids=list(prompt_token_ids), outputs=outputs,
        finished=finished, metrics=metrics, error=errors[0] if errors else None,
        time_to_first_token=(min(times) - first.arrival_time) if times else None,
        latency=(max(ends) - first.arrival_time) if finished and ends else None,
        prompt_logprobs=_prompt_logprobs(first, decode) if params.prompt_logprobs is not None else None)


def _prompt_logprobs(seq: Sequence, decode):
    if seq.prompt_logprobs is None:
        return None
    return [None] + as_dicts(seq.prompt_logprobs[1:], decode)
