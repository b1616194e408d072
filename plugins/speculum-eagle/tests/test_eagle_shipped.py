"""The EAGLE heads shipped for the default model: small, and lossless on it.

The real-model test (marked ``real_model``) runs SmolLM2-135M-Instruct in fp32 on the CPU
over 3 MT-bench prompts x 48 tokens: greedy output with the shipped head must be
token-identical to output without speculation.
"""

from __future__ import annotations

import pytest

from speculum.testing import assert_shipped_head_lossless, check_shipped_heads, default_model_baseline
from speculum_eagle.proposer import HEADS

NUM_PROMPTS, MAX_TOKENS = 3, 48
pytestmark = pytest.mark.skipif(not any(HEADS.glob("*/config.json")),
                                reason="no EAGLE heads shipped in this checkout (train them with `speculum train`, see README)")


def test_shipped_heads_are_small_and_share_the_embedding():
    assert check_shipped_heads(HEADS) == 2  # eagle and eagle3 for SmolLM2-135M-Instruct


@pytest.fixture(scope="module")
def baseline():
    return default_model_baseline(NUM_PROMPTS, MAX_TOKENS)  # shared with the other plugins' tests


@pytest.mark.real_model
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_shipped_head_is_lossless_on_the_default_model(baseline, method):
    assert_shipped_head_lossless(method, baseline, NUM_PROMPTS, MAX_TOKENS)


@pytest.mark.real_model
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_shipped_head_trees_are_lossless_on_the_default_model(baseline, method):
    """A dynamic EAGLE-2 tree (top-4, depth 4, 16 tokens verified) with the shipped head."""
    assert_shipped_head_lossless(method, baseline, NUM_PROMPTS, MAX_TOKENS,
                                 tree={"tree_topk": 4, "tree_depth": 4, "num_draft_tokens": 16})


@pytest.mark.real_model
@pytest.mark.parametrize("tree", [None, {"tree_topk": 4, "tree_depth": 4, "num_draft_tokens": 16}], ids=["chain", "tree"])
def test_shipped_eagle3_head_drafting_every_token_is_lossless(baseline, tree):
    """The shipped EAGLE-3 head carries the target's tail (``--draft-tail``), used by default
    on a GPU only: asked for on the CPU it is lossless too."""
    assert_shipped_head_lossless("eagle3", baseline, NUM_PROMPTS, MAX_TOKENS, tree=tree, options={"draft_tail": True})
