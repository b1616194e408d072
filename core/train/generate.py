"""Generation for self-distillation: the answering engine, the job stream, and the
target's hidden states of each finished answer.

:func:`stream_jobs` pushes the jobs of the data mix (:mod:`speculum.train.mix`) through
one :class:`speculum.LLM` (plain decoding: no proposer, so steps overlap on a GPU),
continuously: a finished answer that wants a follow-up queues its next job at once, so
the batch stays full and a conversation's turns need no separate passes.
:func:`prefill_features` then gives each finished conversation the target's hidden
states by one teacher-forced, batched prefill over its tokens (what EAGLE's own data
pipeline does): far cheaper than copying states out of every decode step, and the same
states up to the rounding of the kernels (``tests/test_train.py``).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import attrs
import torch

from speculum.interfaces import KVCacheFull
from speculum.train.mix import QUESTION, Job, Row, first_jobs, first_message, next_jobs

log = logging.getLogger(__name__)

#: tokens prefilled together when computing features (bounded: the engine's own
#: sequences hold the rest of the KV cache)
FEATURE_TOKENS = 16384


def prefill_features(llm, token_lists: Sequence[Sequence[int]], layers: Sequence[int],
                     to: torch.device | str = "cpu") -> list[dict[int, torch.Tensor]]:
    """Per sequence ``{layer: [n, H]}`` bfloat16 on ``to`` (the host by default): the
    target's state at each of its ``n`` positions given the tokens before it, from batched
    prefills through the engine's target runner (zeros for the last token: nothing follows
    it to train on)."""
    runner = llm.target
    out: list[dict[int, torch.Tensor]] = [None] * len(token_lists)  # type: ignore[list-item]
    order = sorted(range(len(token_lists)), key=lambda i: len(token_lists[i]))  # similar lengths together
    budget = FEATURE_TOKENS
    i = 0
    while i < len(order):
        group, total = [], 0
        while i < len(order) and (not group or total + len(token_lists[order[i]]) <= budget):
            group.append(order[i])
            total += len(token_lists[order[i]])
            i += 1
        sids = [-(j + 1) for j in range(len(group))]  # never an engine sequence's id
        try:
            hidden = runner.add_many(sids, [list(token_lists[g])[:-1] for g in group], hidden_layers=tuple(layers))
        except KVCacheFull:
            for sid in sids:
                runner.remove(sid)
            if len(group) == 1:
                raise
            i -= len(group)
            budget = max(1, total // 2)  # fewer at a time while the engine holds the cache
            continue
        for sid in sids:
            runner.remove(sid)
        for g, sid in zip(group, sids):
            feats = {}
            for l in layers:
                h = hidden[sid][l].to(to, torch.bfloat16)
                feats[l] = torch.cat([h, h.new_zeros(1, h.shape[1])])
            out[g] = feats
    return out


class PromptIds:
    """Token ids of the prompts a job sends, each conversation tokenised once (the
    answers of one prompt share it; the length check of the selection made it first)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.memo: dict[tuple, list[int]] = {}

    def chat(self, messages: Sequence[dict], start: str = "") -> list[int]:
        """The chat template of ``messages`` (generation prompt added), then ``start``'s tokens."""
        key = (tuple((m["role"], m["content"]) for m in messages), start)
        ids = self.memo.get(key)
        if ids is None:
            ids = self.tokenizer.apply_chat_template([dict(m) for m in messages])
            if start:
                ids = ids + list(self.tokenizer.hf.encode(start, add_special_tokens=False))
            self.memo[key] = ids
        return list(ids)

    def of_job(self, job: Job) -> list[int]:
        if job.messages is None:
            if job.row.token_ids is not None:
                return list(job.row.token_ids)
            return self.tokenizer.encode(job.row.turns[0])
        return self.chat(job.messages, job.start)

    def first_prompt(self, row: Row, chat: bool) -> list[int]:
        if row.token_ids is not None:
            return list(row.token_ids)
        return self.chat(first_message(row)) if chat else self.tokenizer.encode(row.turns[0])


@attrs.define(eq=False)
class Shard:
    """Source rows cached together, and the records of their finished answers."""

    index: int
    rows: list[Row]
    open: int = 0  # jobs queued or running
    records: list = attrs.field(factory=list)


def stream_jobs(llm, shards: list[Shard], spec, ids: PromptIds, on_done: Callable[[Shard], None],
                time_limit: float = 0, bar=None) -> int:
    """Answer every job of ``shards`` through ``llm`` (continuous batching); a shard is
    handed to ``on_done`` once all its jobs, follow-ups included, are finished, with its
    records' hidden states filled (:func:`prefill_features`). With ``time_limit``
    (seconds), stops there and drops unfinished shards; returns how many shards were
    finished."""
    from speculum.sampling import SamplingParams
    tok = llm.tokenizer
    room = llm.max_model_len - 1
    queue: list[tuple[Shard, Job]] = [(s, j) for s in shards for r in s.rows for j in first_jobs(r, spec, spec.chat)]
    queue.reverse()  # a stack: pop() takes the next in order
    for s, _ in queue:
        s.open += 1
    running: dict[str, tuple[Shard, Job]] = {}
    rids = iter(range(1 << 62))
    refill = max(1, llm.max_num_seqs // 8)
    t0, finished = time.perf_counter(), 0

    def submit(shard: Shard, job: Job) -> None:
        prompt = ids.of_job(job)
        max_tokens = job.max_tokens or spec.max_tokens
        if len(prompt) >= room:  # a conversation grown past the context: nothing to answer
            shard.open -= 1
            return
        params = SamplingParams(temperature=job.temperature, max_tokens=min(max_tokens, room - len(prompt)),
                                seed=job.seed if job.temperature > 0 else None)
        rid = f"d{next(rids)}"
        llm.add_request(rid, {"prompt_token_ids": prompt}, params)
        running[rid] = (shard, job)

    def close(shard: Shard) -> None:
        nonlocal finished
        if shard.open == 0:
            feats = prefill_features(llm, [toks for _, toks, _, _ in shard.records], spec.layers)
            shard.records = [(job, toks, P, f) for (job, toks, P, _), f in zip(shard.records, feats)]
            on_done(shard)
            finished += 1
            if bar is not None:
                bar.update(len(shard.rows))

    while queue or running:
        if time_limit and time.perf_counter() - t0 > time_limit:
            for rid in list(running):
                llm.abort_request(rid)
            log.warning("self-distillation stopped at its time limit (%.0f s): %d of %d shards finished",
                        time_limit, finished, len(shards))
            break
        # refill in bulk, once an eighth of the batch is free: the new requests' prefill is
        # one forward every few dozen steps instead of a small one every step (on an H200 at
        # 512 sequences, a prefill per step took more time than the decode step itself)
        free = llm.max_num_seqs - llm.num_running - llm.num_waiting
        if queue and (free >= refill or not running):
            while queue and free > 0:
                shard, job = queue.pop()
                submit(shard, job)
                free -= 1
                close(shard)  # a shard whose jobs were all skipped
        for out in llm.step(include_running=False):
            shard, job = running.pop(out.request_id)
            if job.kind != QUESTION:
                shard.records.append((job, list(out.prompt_token_ids) + list(out.token_ids),
                                      len(out.prompt_token_ids), None))
            follow = next_jobs(job, out.text or tok.decode(out.token_ids), spec)
            shard.open += len(follow) - 1
            for nj in reversed(follow):
                queue.append((shard, nj))  # next in line: the conversation goes on at the next refill
            close(shard)
    return finished


#: generation engines kept between ensure_distill calls of one process (training data,
#: then evaluation data: one engine, one set of CUDA graphs)
_ENGINES: dict[tuple, object] = {}


def engine(spec, device, dtype, max_num_seqs: int, max_model_len: int, prefill_chunk: int | None = None):
    """The answering LLM (plain decoding), made once per configuration (``prefill_chunk``:
    the torch backend's prompt tokens per prefill forward; None: its default)."""
    from speculum.engine import LLM
    key = (spec.model, str(device), str(dtype), max_num_seqs, max_model_len, prefill_chunk)
    if key not in _ENGINES:
        options = {} if prefill_chunk is None else {"prefill_chunk": prefill_chunk}
        _ENGINES[key] = LLM(spec.model, device=device, dtype=dtype, seed=spec.seed, max_num_seqs=max_num_seqs,
                            max_model_len=max_model_len, **options)
    return _ENGINES[key]


def release_engines() -> None:
    """Drop the generation engines and give their (GPU) memory back before training."""
    import gc
    _ENGINES.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
