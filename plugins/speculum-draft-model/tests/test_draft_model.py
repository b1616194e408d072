"""Tests of the draft-model plugin: construction checks, KV rollback, options, sampling."""

from __future__ import annotations

import pytest
import torch

from speculum import LLM, SamplingParams
from speculum.errors import ConfigError
from speculum.interfaces import Draft, ProposeBatch, SequenceView
from speculum.sampling import SamplingBatch
from speculum.testing import make_llm, tiny_model_dir
from speculum_draft_model import DraftModelOptions, DraftModelProposer

PROMPTS = [{"prompt_token_ids": p} for p in ([5], [30, 31, 32, 30, 31, 32, 30], [10, 11, 12, 13, 14] * 4)]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("target"), "llama", seed=0)


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("small_vocab"), "llama", seed=2, num_layers=1, vocab_size=256)


def kv_tokens_in_use(allocator) -> int:
    if hasattr(allocator, "num_free_blocks"):  # paged
        return (allocator.num_blocks - 1 - allocator.num_free_blocks) * allocator.block_size
    return allocator.used_tokens


RUNNERS = ["native", "hf"]


def self_draft(target, k=3, **extra) -> dict:
    """The target's first layer drafting for it: partial acceptance, so rollback matters."""
    spec = {"method": "draft_model", "model": str(target), "num_speculative_tokens": k,
            "options": {"num_layers": 1}}
    spec.update(extra)
    return spec


def record_drafts(llm: LLM) -> list:
    """Wrap the proposer's propose(): returns the list it appends (token rows, draft) to."""
    seen = []
    inner = llm.proposer.propose

    def propose(batch: ProposeBatch):
        d = inner(batch)
        # copies: the loop masks drafts past a request's room in place
        seen.append(([list(s.token_ids) for s in batch.seqs],
                     Draft(d.token_ids.clone(), None if d.probs is None else d.probs.clone())))
        return d

    llm.proposer.propose = propose
    return seen


# ------------------------------------------------------------------ construction
def test_vocabulary_mismatch_is_a_config_error(target, small_vocab):
    with pytest.raises(ConfigError, match="vocabulary size 256 differs from the target's 512"):
        make_llm(target, {"model": str(small_vocab), "num_speculative_tokens": 2})


def test_model_is_required(target):
    with pytest.raises(ConfigError, match="needs 'model'"):
        make_llm(target, {"method": "draft_model", "num_speculative_tokens": 2})


@pytest.mark.parametrize("runner", RUNNERS)
def test_num_layers_option(target, runner):
    llm = make_llm(target, self_draft(target, k=2), runner=runner)
    draft = llm.proposer.runner
    assert isinstance(llm.proposer, DraftModelProposer)
    assert draft.num_layers == 1 and llm.target.num_layers == 2  # the target is untouched
    layers = draft.model.model.layers if runner == "hf" else draft.model.layers
    assert len(layers) == 1
    assert DraftModelOptions().num_layers is None
    with pytest.raises(ConfigError, match="invalid options for method 'draft_model'"):
        make_llm(target, self_draft(target, options={"num_layers": 0}))
    with pytest.raises(ConfigError, match="valid options: num_layers"):
        make_llm(target, self_draft(target, options={"layers": 1}))


# ------------------------------------------------------------------ KV rollback
@pytest.mark.parametrize("runner", RUNNERS)
def test_rollback_keeps_draft_cache_consistent(target, runner):
    llm = make_llm(target, self_draft(target, k=3), max_num_seqs=2, runner=runner)
    drafts = record_drafts(llm)
    runner = llm.proposer.runner
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=25, seed=3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=35, ignore_eos=True)]
    for i, (p, sp) in enumerate(zip(PROMPTS, params)):
        llm.add_request(f"r{i}", p, sp)
    ids = {s.request_id: s.seq_id for s in llm.scheduler.waiting}
    finished, steps = [], 0
    while llm.has_unfinished_requests():
        finished += [o for o in llm.step() if o.finished]
        steps += 1
        for s in llm.scheduler.running:
            n = len(s.token_ids)
            assert llm.target.length(s.seq_id) == n - 1
            # accepted KV is kept (not recomputed) and nothing past the last token remains;
            # when all k drafts were accepted the last one never went through the draft
            assert n - 2 <= runner.length(s.seq_id) <= n - 1, (runner.length(s.seq_id), n)
        for o in finished:  # finished requests dropped their KV
            sid = ids[o.request_id]
            assert runner.length(sid) == 0 and llm.target.length(sid) == 0
    assert len(finished) == 3 and steps < 200
    assert kv_tokens_in_use(runner.allocator) == 0 == kv_tokens_in_use(llm.target.allocator)
    m = llm.metrics
    assert 0 < m.num_accepted_tokens < m.num_draft_tokens  # some drafts rejected: rollbacks happened
    assert len(drafts) == steps


@pytest.mark.parametrize("runner", RUNNERS)
def test_rolled_back_cache_drafts_like_a_fresh_prefill(target, runner):
    """After many rollbacks the draft proposes exactly what a fresh draft model would."""
    llm = make_llm(target, self_draft(target, k=3), max_num_seqs=3, runner=runner)
    drafts = record_drafts(llm)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert 0 < llm.metrics.num_accepted_tokens < llm.metrics.num_draft_tokens
    backend = type(llm.backend)(device="cpu", dtype="float32", runner=runner, kv_cache_memory=4 << 20)
    fresh = DraftModelProposer(backend.load_model(target, role="draft", num_layers=1))
    backend.plan_memory(64)
    seq_id = 10_000
    for rows, live in drafts[1:]:
        views = []
        for toks in rows:
            seq_id += 1
            views.append(SequenceView(seq_id, toks, 1))
            fresh.add_request(views[-1])
        sampling = SamplingBatch.from_params([SamplingParams(temperature=0)] * len(rows), [None] * len(rows))
        d = fresh.propose(ProposeBatch(views, 3, sampling))
        assert d.token_ids.tolist() == live.token_ids.tolist()
        for v in views:
            fresh.remove_request(v.seq_id)


@pytest.mark.parametrize("runner", RUNNERS)
def test_near_the_context_limit(target, runner):
    """Drafting past max_model_len is cut by the loop and must not overflow the draft KV."""
    llm = make_llm(target, {"model": str(target), "num_speculative_tokens": 4}, max_model_len=24, runner=runner)
    assert llm.proposer.runner.allocator.max_model_len >= 24 + 4 - 1
    outs = llm.generate([PROMPTS[2], PROMPTS[0]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [4, 23]
    assert all(o.finish_reason == "length" for o in outs)
    base = make_llm(target, None, max_model_len=24, runner=runner)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base.generate(
        [PROMPTS[2], PROMPTS[0]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))]


# ------------------------------------------------------------------ draft sampling
@pytest.mark.parametrize("method", ["sample", "greedy"])
def test_draft_sample_method(target, method):
    llm = make_llm(target, self_draft(target, k=3, draft_sample_method=method))
    assert llm.proposer.sample == (method == "sample")
    drafts = record_drafts(llm)
    sampled = SamplingParams(temperature=0.8, max_tokens=12, seed=1, ignore_eos=True)
    outs = llm.generate(PROMPTS[:2], sampled)
    assert all(len(o.token_ids) == 12 for o in outs)
    for _, d in drafts:
        if method == "greedy":
            assert d.probs is None  # draft argmax, one-hot for the verifier
        else:
            B, k = d.token_ids.shape
            assert d.probs.shape == (B, k, 512)
            assert torch.allclose(d.probs.sum(-1), torch.ones(B, k), atol=1e-5)
            # each draft token was drawn from its reported distribution
            assert bool((d.probs.gather(-1, d.token_ids.unsqueeze(-1)) > 0).all())
    # greedy requests never carry probabilities, whatever the method
    drafts.clear()
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert drafts and all(d.probs is None for _, d in drafts)


def test_drafting_ahead_with_rewinds_drafts_what_a_plain_step_would(target):
    """Overlapped steps with a draft model (forced on: a CPU engine does not overlap): each
    step is drafted and launched at the end of the step before; an abort and a request
    joining drop a step drafted ahead, and the proposer truncates its cache back. Outputs
    equal plain decoding, and drafts and acceptance equal a run without overlap: the rewound
    draft model drafts exactly as if nothing had been drafted ahead. One that does not
    rewind (the wrong variant: its cache keeps the dropped drafts) drafts differently."""
    from speculum.interfaces import RewindableProposer
    from speculum.testing import assert_drafting_ahead_changes_nothing, run_with_an_abort_and_a_join
    prompts = [{"prompt_token_ids": [3 + i, 17, 29, 41, 3 + i, 17]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)

    def build(overlap: bool, rewind: bool = True):
        llm = make_llm(target, self_draft(target), max_num_seqs=4)
        llm.loop.overlap = overlap
        if not rewind:
            llm.proposer.rewind = lambda seq_ids: None
        return llm

    plain = [o.outputs[0].token_ids for o in make_llm(target, None).generate(prompts, params)]
    off, loop = assert_drafting_ahead_changes_nothing(build, prompts, params, plain)
    assert isinstance(loop.proposer, RewindableProposer) and loop.rewindable
    _, drafts_bad, acc_bad = run_with_an_abort_and_a_join(build(True, rewind=False), prompts, params)
    assert (drafts_bad, acc_bad) != off


@pytest.mark.parametrize("forward", [False, True], ids=["draft", "forward"])
def test_chains_drafted_from_the_device_verdict_change_nothing(target, forward):
    """Overlapped greedy steps (forced on) with a draft model: each next chain starts from the
    verdict still on the device (``VerdictDrafter``: the draft's runner forwards from the
    accepted count only the device knows yet, rewriting the last accepted position and
    appending the new token, then drafting), is settled by observe, taken by the plan ahead or
    taken back when an abort or a join changes the batch. With ``forward`` the target's next
    verify forward is launched from the verdict too. Outputs equal plain decoding, and every
    verified draft and acceptance equal a run without overlap."""
    from speculum.interfaces import VerdictDrafter
    from speculum.testing import assert_overlap_changes_nothing
    spec = self_draft(target, from_verdict="forward" if forward else "draft")
    prompts = [{"prompt_token_ids": [3 + i, 17, 29, 41, 3 + i, 17]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)
    _, loop = assert_overlap_changes_nothing(make_llm, target, spec, prompts, params)
    assert isinstance(loop.proposer, VerdictDrafter)
    assert loop.drafted_from_verdict > 10, loop.drafted_from_verdict
    assert (loop.forwards_from_verdict > 10) if forward else loop.forwards_from_verdict == 0


def test_chains_drafted_from_the_verdict_under_preemption(target):
    """The same with a KV budget that forces preemption (rows leave and come back while their
    chains are drafted from the verdict, the draft's cache over-allocated for the longest
    outcome until observe cuts it): outputs equal plain decoding, the books balance."""
    from speculum.testing import assert_drafts_from_verdict_under_preemption
    assert_drafts_from_verdict_under_preemption(target, self_draft(target), 20 * 16 * (512 + 256))


def test_a_wrong_context_from_the_verdict_drafts_differently(target, monkeypatch):
    """The wrong variant fails: chains drafted from the verdict whose first forward feeds the
    new token where the last accepted one belongs (its K/V in the draft's cache then holds the
    wrong token) draft other tokens than a run without overlap, though outputs stay lossless:
    the equality of drafts the test above checks has power over what the launch writes."""
    import speculum.backends.torch.native.runner as mod
    from speculum.testing import run_with_an_abort_and_a_join
    prompts = [{"prompt_token_ids": [3 + i, 17, 29, 41, 3 + i, 17]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)

    def run(overlap: bool):
        llm = make_llm(target, self_draft(target), max_num_seqs=4)
        llm.loop.overlap = overlap
        return run_with_an_abort_and_a_join(llm, prompts, params), llm.loop.drafted_from_verdict

    (off, drafts_off, acc_off), _ = run(False)
    (on, drafts_on, acc_on), n = run(True)
    assert (on, drafts_on, acc_on) == (off, drafts_off, acc_off) and n > 10
    inner = mod.first_chain_tokens
    monkeypatch.setattr(mod, "first_chain_tokens", lambda cand, acc: inner(cand, acc)[:, [1, 1]])
    (bad, drafts_bad, acc_bad), n = run(True)
    assert bad == off and n > 10  # lossless all the same
    assert (drafts_bad, acc_bad) != (drafts_off, acc_off)


def test_the_hf_runner_drafts_after_the_copy(target):
    """A draft runner without forwards from the verdict (the HF runner): nothing is launched
    early, outputs still equal plain decoding."""
    prompts = [{"prompt_token_ids": [3 + i, 17, 29, 41, 3 + i, 17]} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm = make_llm(target, self_draft(target), max_num_seqs=4, runner="hf")
    llm.loop.overlap = True
    outs = llm.generate(prompts, params)
    plain = make_llm(target, None).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert llm.loop.drafted_from_verdict == 0
