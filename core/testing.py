"""Helpers for tests of speculum and of plugins: tiny random models, real-model access.

Plugin authors can import these in their own test suites (like pytest's ``pytester``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

TINY_VOCAB = 512


def tiny_config(arch: str = "llama", num_layers: int = 2, vocab_size: int = TINY_VOCAB, hidden: int = 64):
    """A small transformers config of the Llama family (``llama``, ``qwen2``, ``qwen3``, ``mistral``)."""
    from transformers import AutoConfig
    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    if arch in ("qwen3",):
        common["head_dim"] = hidden // 4
    return AutoConfig.for_model(arch, **common)


def tiny_model_dir(path: Path, arch: str = "llama", seed: int = 0, num_layers: int = 2,
                   vocab_size: int = TINY_VOCAB, hidden: int = 64) -> Path:
    """Write a random tiny causal LM (config + safetensors, no tokenizer) to ``path``."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    cfg = tiny_config(arch, num_layers, vocab_size, hidden)
    model = AutoModelForCausalLM.from_config(cfg)
    # sharper logits than the default init so greedy decoding has clear winners
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(str(path))
    return Path(path)


def shared_dir() -> Path:
    """The project's shared/ folder (MT-bench and training prompts)."""
    env = os.environ.get("SPECULUM_SHARED")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    for parent in here.parents:
        cand = parent.parent / "shared" if parent.name else None
        if cand is not None and (cand / "data" / "mt_bench.jsonl").exists():
            return cand
        if (parent / "shared" / "data" / "mt_bench.jsonl").exists():
            return parent / "shared"
    raise FileNotFoundError("shared/data/mt_bench.jsonl not found; set SPECULUM_SHARED")


def mt_bench_prompts(n: int | None = None) -> list[dict]:
    rows = [json.loads(l) for l in (shared_dir() / "data" / "mt_bench.jsonl").read_text().splitlines() if l.strip()]
    return rows[:n] if n else rows
