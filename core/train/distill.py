"""Self-distillation data: the target answers training prompts, its hidden states recorded.

Generation runs through :class:`speculum.LLM` (batched, greedy or sampled, on any device)
with an in-process *recorder* proposer: it drafts nothing and declares the hidden layers
to keep, so the engine hands it the prefill's states and those of every decode step, the
same plumbing the EAGLE/Medusa/MTP proposers use at inference.

The result is cached under ``$SPECULUM_CACHE/distill/<model>-<key>/`` in shards of
``shard_size`` prompts (``shard_00000.safetensors`` ...); an interrupted run resumes at
the first missing shard, and a run asking for more prompts extends the same cache. Each shard holds, for its ``S`` sequences of ``N`` tokens in all:
``tokens`` [N] int32, ``offsets`` [S + 1] int64, ``prompt_lens`` [S] int32, ``prompt_index``
[S] int32 (row of the prompt file) and ``hidden.<layer>`` [N, H] bfloat16: the target's
state at each position (the last token of a sequence has none and gets zeros).
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from pathlib import Path
from typing import Sequence

import attrs
import torch

import speculum
from speculum.interfaces import Draft

log = logging.getLogger(__name__)


@attrs.frozen
class DistillSpec:
    """What to generate; its JSON (with the resolved model path) keys the cache."""

    model: str
    prompts: str
    num_prompts: int = 1024
    max_prompt_tokens: int = 192
    max_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    layers: tuple[int, ...] = (-1,)
    chat: bool = True
    #: extra sampled answers per instruction-style prompt (sources other than ``t0/...``)
    extra_answers: int = 0
    extra_temperature: float = 0.8

    def key(self) -> str:
        """Everything but ``num_prompts``: shards are a prefix-stable sequence, so a larger
        run extends a smaller one's cache and a smaller run reuses its first shards."""
        d = attrs.asdict(self)
        d.pop("num_prompts")
        if not self.extra_answers:  # caches made before these fields existed stay valid
            d.pop("extra_answers")
            d.pop("extra_temperature")
        p = Path(self.prompts)
        d["prompts"] = [p.name, p.stat().st_size] if p.exists() else self.prompts
        return hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


class Recorder:
    """A proposer that drafts nothing and records the target's hidden states."""

    def __init__(self, layers: Sequence[int]):
        self.hidden_layers = tuple(layers)
        self.live: dict[int, tuple[list[int], int, dict[int, list[torch.Tensor]]]] = {}
        self.done: dict[int, tuple[list[int], int, dict[int, torch.Tensor]]] = {}

    def add_request(self, seq, hidden_states=None):
        parts = {l: [hidden_states[l].to("cpu", torch.bfloat16)] for l in self.hidden_layers}
        self.live[seq.seq_id] = (seq.token_ids, seq.num_prompt_tokens, parts)

    def propose(self, batch):
        B = len(batch.seqs)
        return Draft(token_ids=torch.empty(B, 0, dtype=torch.int64), lengths=[0] * B)

    def observe(self, feedback):
        hs = {l: feedback.hidden_states[l][:, 0].to("cpu", torch.bfloat16) for l in self.hidden_layers}
        for b, sid in enumerate(feedback.seq_ids):
            for l in self.hidden_layers:
                self.live[sid][2][l].append(hs[l][b: b + 1])

    def remove_request(self, seq_id):
        tokens, P, parts = self.live.pop(seq_id)
        tokens = list(tokens)
        n = len(tokens)
        feats = {}
        for l, ps in parts.items():
            h = torch.cat(ps)[: n - 1]
            feats[l] = torch.cat([h, h.new_zeros(n - h.shape[0], h.shape[1])])  # the last token: none
        self.done[seq_id] = (tokens, P, feats)  # a preempted sequence is recorded again later


def _recorder_plugin(recorder: Recorder):
    class RecorderPlugin:
        @staticmethod
        @speculum.hookimpl
        def speculum_register_proposers(register):
            register("_distill_recorder", lambda ctx: recorder, description="records hidden states (training)")
    return RecorderPlugin


def is_instruction(row: dict) -> bool:
    """An open-ended instruction (user-oriented or seed task), not a T0 template."""
    return not str(row.get("source", "")).startswith("t0")


def select_prompts(spec: DistillSpec, tokenizer) -> list[tuple[int, object]]:
    """(row, prompt) pairs: instruction-style sources first, then the others, all shuffled,
    keeping prompts of at most ``max_prompt_tokens`` tokens, ``num_prompts`` in all; an
    instruction-style prompt is repeated ``extra_answers`` times after itself (sampled).

    Rows have ``prompt`` (text, sent through the chat template unless ``chat`` is off) or
    ``prompt_token_ids``."""
    rows = [json.loads(l) for l in Path(spec.prompts).read_text().split("\n") if l.strip()]
    rng = random.Random(spec.seed)
    order = list(range(len(rows)))
    rng.shuffle(order)
    # sources that look like MT-bench (user instructions, seed tasks) before T0 templates
    order.sort(key=lambda i: not is_instruction(rows[i]))
    out, taken = [], 0
    for i in order:
        if "prompt_token_ids" in rows[i]:  # token ids (models without a tokenizer, tests)
            prompt = {"prompt_token_ids": [int(t) for t in rows[i]["prompt_token_ids"]]}
            n = len(prompt["prompt_token_ids"])
        else:
            text = rows[i].get("prompt") or rows[i].get("text") or (rows[i].get("turns") or [""])[0]
            prompt = [{"role": "user", "content": text}] if spec.chat else text
            n = len(tokenizer.apply_chat_template(prompt) if spec.chat else tokenizer.encode(text))
        if n <= spec.max_prompt_tokens:
            taken += 1
            out.append((i, prompt))
            # open-ended prompts also get sampled answers: more of the long-form text that
            # chat benchmarks ask for (the target's own distribution is the label either way)
            out += [(i, prompt)] * (spec.extra_answers if is_instruction(rows[i]) else 0)
        if taken >= spec.num_prompts:
            break
    return out


def cache_dir(spec: DistillSpec, root: Path | None = None) -> Path:
    from speculum.model_source import cache_root
    root = Path(root) if root else cache_root() / "distill"
    return root / f"{Path(spec.model).name}-{spec.key()}"


def ensure_distill(spec: DistillSpec, root: Path | None = None, max_num_seqs: int = 32, device: str = "auto",
                   dtype: str = "auto", shard_size: int = 64, progress: bool = True) -> tuple[Path, list[str]]:
    """Generate (or reuse) the cached distillation data of ``spec``.

    Returns the cache directory and the shard files that make up ``spec.num_prompts``.
    """
    from speculum.engine import LLM
    from speculum.sampling import SamplingParams
    out = cache_dir(spec, root)
    out.mkdir(parents=True, exist_ok=True)
    meta_file = out / "meta.json"
    meta = json.loads(meta_file.read_text()) if meta_file.exists() else {
        "spec": {k: v for k, v in attrs.asdict(spec).items() if k != "num_prompts"}, "shard_size": shard_size,
        "shards": [], "sizes": {}}
    shard_size = meta["shard_size"]
    from speculum.model_source import resolve_model_path
    from speculum.tokenizer import Tokenizer
    prompts = select_prompts(spec, Tokenizer.load(resolve_model_path(spec.model)))
    starts = list(range(0, len(prompts), shard_size))
    shards = [prompts[i: i + shard_size] for i in starts]
    params = SamplingParams(temperature=spec.temperature, max_tokens=spec.max_tokens,
                            seed=spec.seed if spec.temperature > 0 else None)

    def item_params(pos: int) -> SamplingParams:
        """The first answer of a prompt uses ``temperature``; repeats are sampled."""
        if pos == 0 or prompts[pos - 1][0] != prompts[pos][0]:
            return params
        return SamplingParams(temperature=spec.extra_temperature, max_tokens=spec.max_tokens,
                              seed=spec.seed * 1_000_003 + pos)
    names = [f"shard_{i:05d}.safetensors" for i in range(len(shards))]
    # a shard is done when it holds all its prompts (a smaller earlier run may have cut it)
    todo = [i for i, n in enumerate(names) if meta["sizes"].get(n) != len(shards[i])]
    if not todo:
        return out, names
    recorder = Recorder(spec.layers)
    llm = LLM(spec.model, {"method": "_distill_recorder", "num_speculative_tokens": 1}, device=device, dtype=dtype,
              seed=spec.seed, max_num_seqs=max_num_seqs, plugins=[_recorder_plugin(recorder)])
    bar = None
    if progress and todo:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(prompts), desc="self-distillation", unit="prompt",
                   initial=len(prompts) - sum(len(shards[i]) for i in todo))
    for i in todo:
        shard, name = shards[i], names[i]
        recorder.done.clear()
        shard_params = [item_params(starts[i] + j) for j in range(len(shard))]
        outs = llm.generate([p for _, p in shard], shard_params)  # continuous batching over the shard
        if bar is not None:
            bar.update(len(shard))
        recs = [recorder.done[s] for s in sorted(recorder.done)]
        for (tokens, P, _), o in zip(recs, outs):
            assert tokens[:P] == o.prompt_token_ids and tokens[P:] == o.token_ids, "recorder out of order"
        _write_shard(out / name, recs, [r for r, _ in shard])
        meta["shards"] = sorted(set(meta["shards"]) | {name})
        meta["sizes"][name] = len(shard)
        meta_file.write_text(json.dumps(meta, indent=2))
    if bar is not None:
        bar.close()
    return out, names


def _write_shard(path: Path, recs, prompt_rows: list[int]) -> None:
    from safetensors.torch import save_file
    tokens = torch.tensor([t for toks, _, _ in recs for t in toks], dtype=torch.int32)
    lens = torch.tensor([0] + [len(toks) for toks, _, _ in recs], dtype=torch.int64)
    data = {"tokens": tokens, "offsets": lens.cumsum(0), "prompt_lens": torch.tensor([P for _, P, _ in recs],
                                                                                     dtype=torch.int32),
            "prompt_index": torch.tensor(prompt_rows, dtype=torch.int32)}
    for layer in recs[0][2]:
        data[f"hidden.{layer}"] = torch.cat([f[layer] for _, _, f in recs]).contiguous()
    tmp = path.with_suffix(".tmp")
    save_file(data, str(tmp))
    tmp.rename(path)
