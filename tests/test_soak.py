"""A short fault-injection soak on the CPU (issue 9): every method, random requests and
aborts, proposer faults and malformed drafts, a KV budget at the exact edge; no block
leaked or held twice after any step, every request finished exactly once, every completed
greedy request identical to plain decoding. ``speculum bench soak`` runs the long one."""

from __future__ import annotations

import importlib.util

import pytest

from speculum import LLM
from speculum.bench.soak import plain_reference, soak_engine
from speculum.kv import blocks_for
from speculum.testing import train_tiny

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_LEN = 96
K = 3
HEADS = {"eagle": "speculum_eagle", "eagle3": "speculum_eagle", "mtp": "speculum_mtp", "medusa": "speculum_medusa"}


@pytest.fixture(scope="module")
def heads(tiny_llama, tmp_path_factory):
    """Tiny heads trained on the tiny target for a few steps (they accept sometimes)."""
    work = tmp_path_factory.mktemp("soak-heads")
    out = {}
    for method, module in HEADS.items():
        if importlib.util.find_spec(module) is not None:
            out[method] = train_tiny(method, tiny_llama, work, steps=15, num_prompts=16, max_tokens=16)
    return out


def _config(method, tiny_llama_draft, heads):
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": K}
    if method == "draft_model":
        if importlib.util.find_spec("speculum_draft_model") is None:
            pytest.skip("speculum-draft-model is not installed")
        return {"method": "draft_model", "model": str(tiny_llama_draft), "num_speculative_tokens": K}
    if method not in heads:
        pytest.skip(f"the plugin of {method} is not installed")
    return {"method": method, "model": str(heads[method]), "num_speculative_tokens": K}


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return plain_reference(str(tiny_llama), MAX_LEN, dtype="float32", device="cpu")


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle", "eagle3", "mtp", "medusa"])
def test_soak(method, tiny_llama, tiny_llama_draft, heads, reference):
    cfg = _config(method, tiny_llama_draft, heads)
    probe = LLM(str(tiny_llama), cfg, dtype="float32", device="cpu", max_model_len=MAX_LEN)
    plan = probe.backend.plan
    # the exact edge: one max-length sequence (plus draft positions) and not a block more
    blocks = blocks_for(MAX_LEN + plan.overshoot, plan.block_size) + 1
    llm = LLM(str(tiny_llama), cfg, dtype="float32", device="cpu", max_model_len=MAX_LEN, max_num_seqs=8,
              kv_cache_memory=blocks * sum(plan.bytes_per_block.values()))
    assert llm.backend.plan.max_seqs_at_max_len == 1
    st = soak_engine(llm, num_requests=150, seed=hash(method) % 1000, fault_rate=0.1, abort_rate=0.15,
                     reference=reference)
    assert st.lost == 0 and st.duplicated == 0 and st.leaked_blocks == 0
    assert st.preemptions > 0, "the budget was meant to force preemption"
    assert sum(st.faults.values()) > 5 and sum(st.aborts.values()) > 5 and st.rejected > 0
    assert st.greedy_completed > 20 and st.greedy_identical == st.greedy_completed
    assert sum(st.finished.values()) + st.rejected == st.requests
