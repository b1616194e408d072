"""What the target answers for self-distillation: source rows, the data mix, overlap checks.

A *row* is one source conversation: the user turns of a prompt-file row (``prompt``,
``text`` or MT-bench's ``turns``), of a ShareGPT row (``conversations``: ``[{"from":
"human"|"gpt"|"system", "value": ...}]``) or an OpenAI row (``messages``: ``[{"role",
"content"}]``), or token ids (``prompt_token_ids``, models without a tokenizer). Only the
user turns are kept: every assistant turn is the target's own (self-distillation).

A *job* is one answer to generate. Per row (:func:`first_jobs`):

- ``answer``: the first user turn answered at ``temperature`` (greedy by default);
- ``sampled``: instruction-style rows (not T0 templates) get ``extra_answers`` more,
  sampled at the ``extra_temperature`` values in turn;
- ``long``: instruction-style rows get ``long_form`` answers to the first turn with a
  request for detail appended (the first at ``temperature``, then sampled), task-template
  rows (T0) ``template_long_form`` answers with a request to explain the answer: the
  explanations, reasoning and longer prose that chat asks for, over the many topics of
  the task rows, where their own answers are a word or a line;
- ``turn``: a row's later user turns (MT-bench's second turn, a conversation's), asked
  after the target's own earlier answers, up to ``max_turns`` turns;
- ``followup``: for a ``second_turns`` fraction of single-turn rows, the target writes a
  follow-up question about its own answer (a *question* job, not kept for training),
  which is then answered in the same conversation.

Later jobs are made from finished ones (:func:`next_jobs`). Training never sees an
evaluation prompt: :func:`drop_overlaps` removes rows whose user turns match (after
:func:`normalise`) or contain a prompt of the evaluation sets.
"""

from __future__ import annotations

import json
import random
import re
import unicodedata
from pathlib import Path
from typing import Iterable, Sequence

import attrs

from speculum.errors import ConfigError

#: job kinds, stored per training sequence (``QUESTION`` jobs are not stored)
KINDS = ("answer", "sampled", "long", "followup", "turn")
ANSWER, SAMPLED, LONG, FOLLOWUP, TURN = range(5)
QUESTION = -1

#: requests for detail appended to instruction prompts (long-form answers)
DETAIL = ("Please answer in detail.", "Explain your answer step by step, in detail.",
          "Give a thorough, well-structured answer with examples.", "Write a detailed and complete response.",
          "Answer at length and cover every important point.")
#: requests appended to task-template prompts (T0) for their long-form answers
EXPLAIN = ("Give the answer, then explain your reasoning step by step.", "Answer, and explain why in detail.",
           "Answer the question and justify your answer thoroughly.",
           "Give your answer with a detailed explanation.")
#: the user's request for a follow-up question, and the question's forced first words
#: (a 135M model asked for "a question" alone mostly answers instead of asking)
FOLLOWUP_REQUEST = "Write a follow-up question I could ask you about your answer."
FOLLOWUP_STARTS = ("Can you explain", "Why", "How", "What", "Could you give an example of", "Can you tell me more about",
                   "What if", "Is it", "What are the", "How would you")
#: a data file's rows get group ids from ``DATA_BASE * (file number + 1)`` on (each file has a
#: cache of its own, so its number is 0: rows of two files may share a group, which only keeps
#: them on one side of the train / validation split together)
DATA_BASE = 10 ** 8
#: characters of an answer kept in a follow-up question's context
CONTEXT_CHARS = 2000


@attrs.frozen
class Row:
    """One source conversation (user turns only) or a token-id prompt."""

    #: group id: the row of the prompt file, or ``DATA_BASE * (n + 1) + row`` of data file n;
    #: a row's answers stay on one side of the train/validation split
    index: int
    source: str
    turns: tuple[str, ...] = ()
    system: str | None = None
    token_ids: tuple[int, ...] | None = None

    @property
    def instruction(self) -> bool:
        """An open-ended instruction (user-oriented, seed task, user data), not a T0 template."""
        return not self.source.startswith("t0")


@attrs.frozen
class Job:
    """One answer (or follow-up question) for the target to generate."""

    row: Row
    kind: int
    temperature: float
    seed: int
    #: the conversation up to and including the user turn to answer (chat), or None for
    #: a plain prompt (token ids, or text without the chat template)
    messages: tuple[dict, ...] | None = None
    #: index of the user turn this job answers
    turn: int = 0
    #: after this answer, the target writes a follow-up question and answers it
    followup: bool = False
    #: QUESTION jobs: the forced first words of the question, and the whole conversation
    #: so far (``messages`` is the request for the question, with shortened context)
    start: str = ""
    history: tuple[dict, ...] | None = None
    max_tokens: int | None = None


def normalise(text: str) -> str:
    """Lower case, Unicode NFKC, every run of non-alphanumerics one space (for overlap checks)."""
    text = unicodedata.normalize("NFKC", str(text)).lower()
    return " ".join(re.sub(r"[\W_]+", " ", text).split())


def user_turns(obj: dict) -> tuple[tuple[str, ...], str | None]:
    """(user turns, system prompt) of a JSONL row in any accepted form; ((), None) if none."""
    if obj.get("conversations") is not None:
        turns, system = [], None
        for m in obj["conversations"]:
            who = str(m.get("from", m.get("role", ""))).lower()
            text = m.get("value", m.get("content", ""))
            if who in ("human", "user"):
                turns.append(str(text))
            elif who == "system" and not turns:
                system = str(text)
        return tuple(turns), system
    if obj.get("messages") is not None:
        turns, system = [], None
        for m in obj["messages"]:
            role, text = str(m.get("role", "")).lower(), m.get("content", "")
            if isinstance(text, list):  # OpenAI content parts
                text = "".join(p.get("text", "") for p in text if isinstance(p, dict))
            if role == "user":
                turns.append(str(text))
            elif role == "system" and not turns:
                system = str(text)
        return tuple(turns), system
    if obj.get("turns"):
        return tuple(str(t) for t in obj["turns"]), obj.get("system")
    text = obj.get("prompt") or obj.get("text") or obj.get("instruction")
    if text:
        extra = obj.get("input")  # Alpaca-style rows: instruction + input
        return (f"{text}\n\n{extra}" if extra else str(text),), obj.get("system")
    return (), None


def read_rows(path: str | Path, base: int = 0, source: str | None = None) -> list[Row]:
    """Every row of a JSONL file, numbered ``base + i`` (``i``: its row among the non-empty
    lines); a row without a user turn is an error."""
    rows = []
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"prompt file {p} does not exist")
    # "\n" only: str.splitlines() would also split at U+2028 and the like inside JSON strings
    lines = [l for l in p.read_text().split("\n") if l.strip()]
    for i, line in enumerate(lines):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{p}:{i + 1}: not JSON ({exc.msg}); one JSON object per line expected") from None
        src = source or str(obj.get("source", ""))
        if "prompt_token_ids" in obj:
            rows.append(Row(base + i, src, token_ids=tuple(int(t) for t in obj["prompt_token_ids"])))
            continue
        turns, system = user_turns(obj)
        if not turns:
            raise ConfigError(f"{p}:{i + 1}: no user turn; a row needs 'prompt', 'turns', 'conversations' "
                              "([{'from': 'human', 'value': ...}]) or 'messages' ([{'role': 'user', 'content': ...}])")
        rows.append(Row(base + i, src, turns, system))
    return rows


def eval_texts(paths: Iterable[str | Path]) -> set[str]:
    """Normalised user turns of every row of the evaluation sets ``paths`` (missing files skipped)."""
    out = set()
    for p in paths:
        if p and Path(p).exists():
            for row in read_rows(p):
                out |= {normalise(t) for t in row.turns if normalise(t)}
    return out


def overlaps(row: Row, texts: set[str], min_contained: int = 40) -> bool:
    """Whether a user turn of ``row`` equals an evaluation prompt (normalised), or contains
    one of at least ``min_contained`` characters (e.g. a question inside a template)."""
    for t in row.turns:
        n = normalise(t)
        if n in texts or any(len(e) >= min_contained and e in n for e in texts):
            return True
    return False


def drop_overlaps(rows: Sequence[Row], texts: set[str]) -> tuple[list[Row], int]:
    """(rows without the evaluation prompts ``texts``, how many were dropped)."""
    if not texts:
        return list(rows), 0
    kept = [r for r in rows if not overlaps(r, texts)]
    return kept, len(rows) - len(kept)


def order_rows(rows: Sequence[Row], seed: int) -> list[Row]:
    """Shuffled with ``seed``, instruction-style rows first (what chat asks for), then the others."""
    out = list(rows)
    random.Random(seed).shuffle(out)
    out.sort(key=lambda r: not r.instruction)
    return out


def _seed(spec_seed: int, row: Row, slot: int) -> int:
    """A job's sampling seed: fixed by the spec's seed, the row and the job's slot."""
    return (spec_seed * 1_000_003 + row.index * 131 + slot) % (2 ** 62)


def _chat(row: Row, turn: str) -> tuple[dict, ...]:
    return (({"role": "system", "content": row.system},) if row.system else ()) + ({"role": "user", "content": turn},)


def first_message(row: Row) -> tuple[dict, ...]:
    """The chat a row's first answer is asked with (its system prompt, its first turn)."""
    return _chat(row, row.turns[0])


def wants_followup(row: Row, fraction: float, seed: int) -> bool:
    """Whether ``row`` gets a target-written second turn (a fixed ``fraction`` of rows)."""
    return fraction > 0 and random.Random(f"followup-{seed}-{row.index}").random() < fraction


def first_jobs(row: Row, spec, chat: bool = True) -> list[Job]:
    """The jobs a row starts with (see the module doc); ``spec`` is a DistillSpec."""
    temps = spec.extra_temperatures
    if row.token_ids is not None or not chat:  # no chat: one plain answer (+ sampled ones)
        jobs = [Job(row, ANSWER, spec.temperature, _seed(spec.seed, row, 0))]
        n = spec.extra_answers if row.instruction else 0
        return jobs + [Job(row, SAMPLED, temps[i % len(temps)], _seed(spec.seed, row, 1 + i)) for i in range(n)]
    first = first_message(row)
    more = len(row.turns) > 1 and spec.max_turns > 1
    follow = not more and len(row.turns) == 1 and wants_followup(row, spec.second_turns, spec.seed)
    jobs = [Job(row, ANSWER, spec.temperature, _seed(spec.seed, row, 0), first, followup=follow)]
    if row.instruction:
        jobs += [Job(row, SAMPLED, temps[i % len(temps)], _seed(spec.seed, row, 1 + i), first)
                 for i in range(spec.extra_answers)]
    n, asks = (spec.long_form, DETAIL) if row.instruction else (getattr(spec, "template_long_form", 0), EXPLAIN)
    rng = random.Random(f"long-{spec.seed}-{row.index}")
    for i in range(n):
        t = spec.temperature if i == 0 else temps[(i - 1) % len(temps)]
        ask = _chat(row, f"{row.turns[0].rstrip()}\n\n{rng.choice(asks)}")
        jobs.append(Job(row, LONG, t, _seed(spec.seed, row, 1000 + i), ask))
    return jobs


def next_jobs(job: Job, answer: str, spec) -> list[Job]:
    """Jobs that follow a finished one: the row's next user turn, the follow-up question
    after an answer that wants one, the answer to a written follow-up question."""
    if job.messages is None:
        return []
    if job.kind == QUESTION:
        question = clean_question(job.start + answer, job.start)
        return [Job(job.row, FOLLOWUP, spec.temperature, _seed(spec.seed, job.row, 2000),
                    job.history + ({"role": "user", "content": question},), turn=job.turn + 1)]
    history = job.messages + ({"role": "assistant", "content": answer},)
    nxt = job.turn + 1
    if job.kind in (ANSWER, TURN) and nxt < min(len(job.row.turns), spec.max_turns):
        return [Job(job.row, TURN, spec.temperature, _seed(spec.seed, job.row, 3000 + nxt),
                    history + ({"role": "user", "content": job.row.turns[nxt]},), turn=nxt)]
    if job.followup:
        start = random.Random(f"start-{spec.seed}-{job.row.index}").choice(FOLLOWUP_STARTS)
        ctx = job.messages[:-1] + ({"role": "user", "content": job.messages[-1]["content"][:CONTEXT_CHARS]},
                                   {"role": "assistant", "content": answer[:CONTEXT_CHARS]},
                                   {"role": "user", "content": FOLLOWUP_REQUEST})
        return [Job(job.row, QUESTION, 0.7, _seed(spec.seed, job.row, 4000), ctx, turn=job.turn, start=start,
                    history=history, max_tokens=48)]
    return []


def clean_question(text: str, start: str = "") -> str:
    """The first question in ``text`` (up to its first '?', else its first line)."""
    text = text.strip().strip('"').strip()
    q = text.find("?")
    line = text[: q + 1] if q >= 0 else text.split("\n", 1)[0]
    line = line.strip().strip('"').strip()
    return line if len(line) > len(start) + 2 else f"{start} that in more detail?".strip()
