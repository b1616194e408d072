"""The draft model shipped for the default model: small, saved without the target's embedding,
and lossless on it.

The real-model tests (marked ``real_model``) run SmolLM2-135M-Instruct in fp32 on the CPU over
3 MT-bench prompts x 48 tokens: greedy output with the shipped draft (``{"method":
"draft_model"}`` without ``model``) must be token-identical to output without speculation, and
its drafts accepted.
"""

from __future__ import annotations

import pytest

from speculum.testing import assert_shipped_head_lossless, check_shipped_heads, default_model_baseline
from speculum_draft_model.proposer import SHIPPED

NUM_PROMPTS, MAX_TOKENS = 3, 48
pytestmark = pytest.mark.skipif(not any(SHIPPED.glob("*/config.json")),
                                reason="no draft shipped in this checkout (train one with `speculum train draft`, see README)")


def test_shipped_draft_is_small_and_shares_the_embedding():
    assert check_shipped_heads(SHIPPED) == 1  # for SmolLM2-135M-Instruct


@pytest.fixture(scope="module")
def baseline():
    return default_model_baseline(NUM_PROMPTS, MAX_TOKENS)  # shared with the other plugins' tests


@pytest.mark.real_model
@pytest.mark.parametrize("k", [2, 4])
def test_shipped_draft_is_lossless_on_the_default_model(baseline, k):
    assert_shipped_head_lossless("draft_model", baseline, NUM_PROMPTS, MAX_TOKENS, k=k)
