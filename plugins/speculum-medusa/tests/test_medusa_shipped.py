"""The Medusa heads shipped for the default model: small, and lossless on it.

The real-model test (marked ``real_model``) runs SmolLM2-135M-Instruct in fp32 on the CPU
over 3 MT-bench prompts x 48 tokens: greedy output with the shipped head must be
token-identical to output without speculation.
"""

from __future__ import annotations

import json

import pytest

from speculum.testing import assert_shipped_head_lossless, check_shipped_heads, default_model_baseline
from speculum_medusa.proposer import HEADS

NUM_PROMPTS, MAX_TOKENS = 3, 48
pytestmark = pytest.mark.skipif(not any(HEADS.glob("*/config.json")),
                                reason="no Medusa heads shipped in this checkout (train them with `speculum train`, see README)")


def test_shipped_heads_are_small_and_share_the_embedding():
    assert check_shipped_heads(HEADS) == 1  # for SmolLM2-135M-Instruct


@pytest.fixture(scope="module")
def baseline():
    return default_model_baseline(NUM_PROMPTS, MAX_TOKENS)  # shared with the other plugins' tests


@pytest.mark.real_model
@pytest.mark.parametrize("method", ["medusa"])
def test_shipped_head_is_lossless_on_the_default_model(baseline, method):
    assert_shipped_head_lossless(method, baseline, NUM_PROMPTS, MAX_TOKENS)


@pytest.mark.real_model
@pytest.mark.parametrize("method", ["medusa"])
def test_shipped_head_trees_are_lossless_on_the_default_model(baseline, method):
    """A dynamic EAGLE-2 tree (top-4, depth 4, 16 tokens verified) with the shipped head."""
    assert_shipped_head_lossless(method, baseline, NUM_PROMPTS, MAX_TOKENS,
                                 tree={"tree_topk": 4, "tree_depth": 4, "num_draft_tokens": 16})


@pytest.mark.real_model
def test_sequential_heads_grown_from_token_aware_ones_on_the_default_model(baseline, tmp_path):
    """Token-aware heads grown sequential (`speculum train medusa --sequential --init-from`'s
    load: zero maps of the drafted tokens) draft exactly as the heads they grew from on the
    default model (same acceptance, step for step); the shipped heads, sequential since the
    thirty-first session, are those heads with trained maps, which are read (their acceptance
    differs), and every output is the model's own. The token-aware heads are the shipped ones
    with their maps of the drafted tokens left out (and the prefix layer, shipped since the
    thirty-fourth session, kept: the growth keeps it as it is)."""
    import argparse

    import torch
    from speculum.backends.torch.heads import TargetParts
    from speculum.engine import LLM
    from speculum.sampling import SamplingParams
    from speculum.testing import mt_bench_chat_prompts
    from speculum_medusa.formats import load_medusa, save_medusa
    from speculum_medusa.train import MedusaTrainer

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def run(model=None):
        spec = {"method": "medusa", "num_speculative_tokens": 4, **({"model": str(model)} if model else {})}
        llm = LLM(speculative_config=spec, dtype="float32", device="cpu", max_num_seqs=NUM_PROMPTS)
        outs = llm.generate(mt_bench_chat_prompts(NUM_PROMPTS), params)
        assert [o.token_ids for o in outs] == [b.token_ids for b in baseline]
        return llm

    shipped = run()
    config = next(HEADS.glob("*/config.json"))
    assert shipped.proposer.heads.sequential and shipped.proposer.heads.prefixed == bool(
        json.loads(config.read_text()).get("speculum_prefix_layer"))
    parts = TargetParts.from_runner(shipped.target)
    heads = load_medusa(config.parent, parts)
    assert heads.sequential and all(lin.weight.any() for lin in heads.seq_proj)
    heads.seq_proj = None  # token-aware: the same blocks and token map
    save_medusa(heads, tmp_path / "aware", base_model="SmolLM2-135M-Instruct", dtype=torch.float32)
    aware = run(tmp_path / "aware")
    assert not aware.proposer.heads.sequential and aware.proposer.heads.token_input
    assert aware.metrics.accepted_per_position != shipped.metrics.accepted_per_position  # the maps are read
    args = argparse.Namespace(num_layers=2, token_input=False, sequential=True, prefix_layer=heads.prefixed)
    grown = MedusaTrainer().load(tmp_path / "aware", parts, args)
    assert grown.sequential and not any(lin.weight.any() for lin in grown.seq_proj)
    save_medusa(grown, tmp_path / "seq", base_model="SmolLM2-135M-Instruct", dtype=torch.float32)
    same = run(tmp_path / "seq")
    assert same.proposer.heads.sequential
    assert same.metrics.accepted_per_position == aware.metrics.accepted_per_position
