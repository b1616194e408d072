"""The corpus shipped for the default model (``options.corpus: "shipped"``): found by the
target's tokenizer, compact on disk, and lossless on the real model with more tokens per
target forward than the request-only lookup.

The real-model test (marked ``real_model``) runs SmolLM2-135M-Instruct in fp32 on the CPU
over 3 MT-bench prompts x 48 tokens (the shipped heads' baseline)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from speculum.errors import ConfigError
from speculum.sampling import SamplingParams
from speculum.testing import default_model_baseline, mt_bench_chat_prompts
from speculum_ngram.corpus import SHIPPED, read_tokens, shipped_corpus

NUM_PROMPTS, MAX_TOKENS = 3, 48


class Probe:
    """A tokenizer that encodes one text as given ids (anything else as nothing)."""

    def __init__(self, text: str, ids: list[int]):
        self.text, self.ids = text, ids

    def encode(self, text: str) -> list[int]:
        return list(self.ids) if text == self.text else []


def test_the_shipped_corpus_is_compact_and_described():
    metas = sorted(SHIPPED.glob("*.json"))
    assert [m.stem for m in metas] == ["smollm2-135m-instruct"]
    meta = json.loads(metas[0].read_text())
    npy = metas[0].with_suffix(".npy")
    assert npy.stat().st_size < 24 << 20  # within the plugin's package budget (~30 MB)
    toks = read_tokens(npy)
    assert toks.dtype == np.int64 and toks.min() == -1 and toks.max() < meta["vocab_size"]
    assert int((toks >= 0).sum()) == meta["tokens"] and int((toks < 0).sum()) == meta["streams"]
    assert "MT-bench" in meta["not_from"] and meta["command"].startswith("python -m speculum_ngram.corpus build")


def test_the_shipped_corpus_is_found_by_the_tokenizer(tmp_path, monkeypatch):
    meta = json.loads((SHIPPED / "smollm2-135m-instruct.json").read_text())
    assert shipped_corpus(Probe(meta["probe"], meta["probe_ids"]), meta["vocab_size"]).endswith(
        "smollm2-135m-instruct.npy")
    with pytest.raises(ConfigError, match="no n-gram corpus is shipped for this target's tokenizer"):
        shipped_corpus(Probe(meta["probe"], meta["probe_ids"][:-1]), meta["vocab_size"])  # another tokenizer
    with pytest.raises(ConfigError, match="SmolLM2-135M-Instruct"):
        shipped_corpus(Probe(meta["probe"], meta["probe_ids"]), 32000)  # another vocabulary size


def test_compact_files_read_as_the_int32_ones(tmp_path):
    streams = [[5, 6, 7], [8, 65534]]
    flat = np.array([t for s in streams for t in (*s, -1)], dtype=np.int32)
    np.save(tmp_path / "a.npy", flat)
    np.save(tmp_path / "b.npy", np.where(flat < 0, 65535, flat).astype(np.uint16))
    assert read_tokens(tmp_path / "a.npy").tolist() == read_tokens(tmp_path / "b.npy").tolist() == flat.tolist()


@pytest.mark.real_model
def test_the_shipped_corpus_is_lossless_on_the_default_model_and_drafts_more():
    """Greedy, fp32, CPU: output with the shipped corpus equals plain decoding, and it
    emits more tokens per target forward than lookup in the request alone (not vacuous)."""
    from speculum.engine import LLM
    baseline = default_model_baseline(NUM_PROMPTS, MAX_TOKENS)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    per_forward = {}
    for name, opts in (("plain", {}), ("shipped", {"options": {"corpus": "shipped"}})):
        llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4, **opts}, dtype="float32",
                  device="cpu", max_num_seqs=NUM_PROMPTS)
        outs = llm.generate(mt_bench_chat_prompts(NUM_PROMPTS), params)
        assert [o.token_ids for o in outs] == [b.token_ids for b in baseline]
        m = llm.metrics
        per_forward[name] = m.num_emitted_tokens / m.num_steps
    assert per_forward["shipped"] > per_forward["plain"] + 0.1, per_forward
