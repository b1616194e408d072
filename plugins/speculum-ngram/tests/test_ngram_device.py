"""N-gram chains drafted on the device from the verdict (``VerdictDrafter``): the device
rule equals the host's, and on a tiny target with overlap forced on (a CPU engine does not
overlap unless told) the engine verifies the same drafts, accepts the same tokens and
outputs what plain decoding outputs, with the next forward launched from the verdict too,
through an abort, a join and preemption."""

from __future__ import annotations

import pytest
import torch

from speculum.engine import LLM
from speculum.sampling import SamplingParams
from speculum.testing import (assert_drafts_from_verdict_under_preemption, run_with_an_abort_and_a_join,
                              tiny_model_dir, verified_drafts)
from speculum_ngram import find_ngram_draft
from speculum_ngram import device as ngram_device
from speculum_ngram.device import DeviceHistory, match_drafts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.mark.parametrize("vocab", [3, 8, 50])
def test_the_device_rule_drafts_what_the_host_rule_drafts(vocab):
    """300 batches of 1-6 rows of random lengths (small vocabularies: many candidates, long
    runs), the buffer past each row's length filled with random tokens it must ignore: every
    row's drafts and count equal find_ngram_draft's."""
    g = torch.Generator().manual_seed(vocab)
    rnd = (lambda hi, n=(1,): torch.randint(0, hi, n, generator=g))
    for _ in range(300):
        R, W = int(rnd(6)) + 1, 70
        hist = rnd(vocab, (R, W))
        length = rnd(W - 1, (R,)) + 1
        n_min = int(rnd(3)) + 1
        n_max = n_min + int(rnd(5))
        k = int(rnd(5)) + 1
        drafts, counts = match_drafts(hist, length, n_min, n_max, k)
        for r in range(R):
            want = find_ngram_draft(hist[r, : length[r]], n_min, n_max, k)
            assert drafts[r, : len(want)].tolist() == want and int(counts[r]) == len(want)
            assert (drafts[r, len(want):] == -1).all()


def test_the_history_grows_and_reuses_slots():
    h = DeviceHistory(torch.device("cpu"), capacity=4, slots=1)
    h.add(7)
    h.add(9)  # a second slot: the buffer doubles
    h.reserve(10)
    assert h.buf.shape == (2, 16)
    tokens = list(range(12))
    h.sync(9, tokens, 5)
    h.sync(9, tokens, 12)  # copies only what the device has not seen
    assert h.buf[h.slot[9], :12].tolist() == tokens and h.known[9] == 12
    h.remove(7)
    h.add(11)
    assert h.slot[11] != h.slot[9]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("target"), "llama", seed=0)


def _prompts() -> list[dict]:
    """Repeating prompts: n-gram lookup finds matches, and misses between them."""
    return [{"prompt_token_ids": [3 + i, 17, 29, 41, 3 + i, 17] * (1 + i % 3)} for i in range(4)]


def _build(target, forward: bool, overlap: bool) -> LLM:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "from_verdict": "forward" if forward else "draft"}
    llm = LLM(str(target), spec, device="cpu", dtype="float32", kv_cache_memory=16 << 20, max_num_seqs=4)
    llm.loop.overlap = overlap
    return llm


def _real(steps: list) -> list:
    """Each verified step's drafts without the -1 padding (a device draft is always k wide)."""
    return [[[t for t in row if t >= 0] for row in step] for step in steps]


@pytest.mark.parametrize("forward", [False, True], ids=["draft", "forward"])
def test_drafts_made_from_the_device_verdict_change_nothing(target, forward):
    """With overlap the drafts come from the device (more than ten steps; with ``forward``
    the next verify forward is launched from the verdict too); without it from the host
    index. Same real drafts at every step, same drafts and acceptances counted (lengths
    count real drafts, not padding), outputs equal plain decoding, through an abort and a
    join."""
    llm, other = _build(target, forward, True), _build(target, forward, False)
    steps_on, steps_off = verified_drafts(llm), verified_drafts(other)
    on, drafts_on, acc_on = run_with_an_abort_and_a_join(llm, _prompts(), GREEDY)
    off, drafts_off, acc_off = run_with_an_abort_and_a_join(other, _prompts(), GREEDY)
    plain = LLM(str(target), device="cpu", dtype="float32", kv_cache_memory=16 << 20).generate(_prompts(), GREEDY)
    assert on == off == {f"r{i}": plain[i].outputs[0].token_ids for i in (0, 2, 3)}
    assert _real(steps_on) == _real(steps_off) and len(steps_on) > 10
    assert (drafts_on, acc_on) == (drafts_off, acc_off) and acc_on > 0
    loop = llm.loop
    assert loop.drafted_from_verdict > 10, loop.drafted_from_verdict
    assert (loop.forwards_from_verdict > 10) if forward else loop.forwards_from_verdict == 0
    # steps without a match verify padding only: some device drafts had none
    assert any(row and row[0] == -1 for step in steps_on for row in step)


def test_a_stale_device_history_is_caught(target, monkeypatch):
    """The wrong variant: the device rule run one token short of each row's length (the
    verdict's new token not appended). The test above's drafts comparison fails on it."""
    right = ngram_device.match_drafts
    monkeypatch.setattr("speculum_ngram.proposer.match_drafts",
                        lambda hist, length, *a: right(hist, length - 1, *a))
    llm, other = _build(target, True, True), _build(target, True, False)
    steps_on, steps_off = verified_drafts(llm), verified_drafts(other)
    run_with_an_abort_and_a_join(llm, _prompts(), GREEDY)
    run_with_an_abort_and_a_join(other, _prompts(), GREEDY)
    assert _real(steps_on) != _real(steps_off)


@pytest.mark.parametrize("forward", [False, True], ids=["draft", "forward"])
def test_drafts_made_from_the_verdict_under_preemption(target, forward):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    # (no cache of its own: a budget of ~160 tokens and sequences of at most 96 preempt)
    assert_drafts_from_verdict_under_preemption(target, spec, 150_000, forward_from_verdict=forward, max_model_len=96)
