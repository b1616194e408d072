"""Generation for self-distillation: the recorder proposer, its engine, and the job stream.

:class:`Recorder` drafts nothing and records the target's hidden states, handed to it by
the engine like to any proposer that declares ``hidden_layers`` (prefill and every
decode step). :func:`stream_jobs` pushes the jobs of the data mix
(:mod:`speculum.train.mix`) through one :class:`speculum.LLM`, continuously: a finished
answer that wants a follow-up queues its next job at once, so the batch stays full and a
conversation's turns need no separate passes.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import attrs
import torch

import speculum
from speculum.interfaces import Draft
from speculum.train.mix import QUESTION, Job, Row, first_jobs, first_message, next_jobs

log = logging.getLogger(__name__)


class Recorder:
    """A proposer that drafts nothing and records the target's hidden states.

    Per step it copies the states of all layers to the host in one transfer and keeps,
    per sequence, references to its rows; a finished sequence's states are gathered
    once, at :meth:`remove_request`.
    """

    def __init__(self, layers: Sequence[int]):
        self.hidden_layers = tuple(layers)
        #: seq_id -> (token list, prompt length, prefill {layer: [P - 1, H]}, [(step [B, nL, H], row)])
        self.live: dict[int, tuple[list[int], int, dict[int, torch.Tensor], list]] = {}
        #: seq_id -> (tokens, prompt length, {layer: [n, H]}) of finished sequences
        self.done: dict[int, tuple[list[int], int, dict[int, torch.Tensor]]] = {}

    def add_request(self, seq, hidden_states=None):
        self.done.pop(seq.seq_id, None)  # a preempted sequence is recorded again from the start
        pre = {l: hidden_states[l].to("cpu", torch.bfloat16) for l in self.hidden_layers}
        self.live[seq.seq_id] = (seq.token_ids, seq.num_prompt_tokens, pre, [])

    def propose(self, batch):
        B = len(batch.seqs)
        return Draft(token_ids=torch.empty(B, 0, dtype=torch.int64), lengths=[0] * B)

    def observe(self, feedback):
        hs = feedback.hidden_states
        step = torch.stack([hs[l][:, 0] for l in self.hidden_layers], dim=1).to("cpu", torch.bfloat16)  # [B, nL, H]
        for b, sid in enumerate(feedback.seq_ids):
            self.live[sid][3].append((step, b))

    def remove_request(self, seq_id):
        tokens, P, pre, steps = self.live.pop(seq_id)
        tokens = list(tokens)
        n = len(tokens)
        feats = {}
        rows = torch.stack([s[b] for s, b in steps]) if steps else None  # [n_steps, nL, H]
        for i, l in enumerate(self.hidden_layers):
            h = pre[l] if rows is None else torch.cat([pre[l], rows[:, i]])
            h = h[: n - 1]
            feats[l] = torch.cat([h, h.new_zeros(n - h.shape[0], h.shape[1])])  # the last token: none
        self.done[seq_id] = (tokens, P, feats)

    def take(self, tokens: Sequence[int]) -> tuple[list[int], int, dict[int, torch.Tensor]]:
        """The record of the finished sequence with exactly these tokens (prompt + output)."""
        want = list(tokens)
        for sid, rec in self.done.items():
            if rec[0] == want:
                return self.done.pop(sid)
        raise RuntimeError("recorder lost a finished sequence (was it preempted and not recomputed?)")


def _recorder_plugin(recorder: Recorder):
    class RecorderPlugin:
        @staticmethod
        @speculum.hookimpl
        def speculum_register_proposers(register):
            register("_distill_recorder", lambda ctx: recorder, description="records hidden states (training)")
    return RecorderPlugin


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


def stream_jobs(llm, recorder: Recorder, shards: list[Shard], spec, ids: PromptIds,
                on_done: Callable[[Shard], None], time_limit: float = 0, bar=None) -> int:
    """Answer every job of ``shards`` through ``llm`` (continuous batching); a shard is
    handed to ``on_done`` once all its jobs, follow-ups included, are finished. With
    ``time_limit`` (seconds), stops there and drops unfinished shards; returns how many
    shards were finished."""
    from speculum.sampling import SamplingParams
    tok = llm.tokenizer
    room = llm.max_model_len - 1
    queue: list[tuple[Shard, Job]] = [(s, j) for s in shards for r in s.rows for j in first_jobs(r, spec, spec.chat)]
    queue.reverse()  # a stack: pop() takes the next in order
    for s, _ in queue:
        s.open += 1
    running: dict[str, tuple[Shard, Job]] = {}
    rids = iter(range(1 << 62))
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
            on_done(shard)
            finished += 1
            if bar is not None:
                bar.update(len(shard.rows))

    while queue or running:
        if time_limit and time.perf_counter() - t0 > time_limit:
            for rid in list(running):
                llm.abort_request(rid)
            recorder.done.clear()
            log.warning("self-distillation stopped at its time limit (%.0f s): %d of %d shards finished",
                        time_limit, finished, len(shards))
            break
        while queue and llm.num_waiting < llm.max_num_seqs:  # keep the batch full, the queue short
            shard, job = queue.pop()
            submit(shard, job)
            close(shard)  # a shard whose jobs were all skipped
        for out in llm.step(include_running=False):
            shard, job = running.pop(out.request_id)
            tokens, P, feats = recorder.take(out.prompt_token_ids + out.token_ids)
            if job.kind != QUESTION:
                shard.records.append((job, tokens, P, feats))
            follow = next_jobs(job, out.text or tok.decode(out.token_ids), spec)
            shard.open += len(follow) - 1
            for nj in follow:
                submit(shard, nj)  # at once: the conversation goes on in the running batch
            close(shard)
    return finished


#: generation engines kept between ensure_distill calls of one process (training data,
#: then evaluation data: one engine, one set of CUDA graphs)
_ENGINES: dict[tuple, tuple] = {}


def engine(spec, device, dtype, max_num_seqs: int, max_model_len: int):
    """(LLM with a recorder proposer, the recorder), made once per configuration."""
    from speculum.engine import LLM
    key = (spec.model, str(device), str(dtype), tuple(spec.layers), max_num_seqs, max_model_len)
    if key not in _ENGINES:
        recorder = Recorder(spec.layers)
        llm = LLM(spec.model, {"method": "_distill_recorder", "num_speculative_tokens": 1}, device=device,
                  dtype=dtype, seed=spec.seed, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                  plugins=[_recorder_plugin(recorder)])
        _ENGINES[key] = (llm, recorder)
    llm, recorder = _ENGINES[key]
    recorder.done.clear()
    return llm, recorder


def release_engines() -> None:
    """Drop the generation engines and give their (GPU) memory back before training."""
    import gc
    _ENGINES.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
