"""Overlapped steps (issue 16): the next forward (with its drafts, for a stateless proposer
at a fixed k) runs ahead while the host does this step's bookkeeping. On a CPU the engine turns overlap off (the host computes the forward); these
tests turn it on to check that it changes nothing about outputs, stops, aborts,
admission, preemption or KV accounting, and that the forwards run ahead are used."""

from __future__ import annotations

import pytest
import torch

from speculum import LLM, SamplingParams
from speculum.spec_length import FixedLength

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY_TOKEN_BYTES = 2 * 2 * 2 * 16 * 4  # tiny llama, fp32: KV bytes per token


def _prompts(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, 500, (5 + 7 * i,), generator=g).tolist()} for i in range(n)]


def _llm(model, overlap: bool, **kw) -> LLM:
    llm = LLM(str(model), dtype="float32", device="cpu", **kw)
    llm.loop.overlap = overlap  # the engine's default is off on a CPU
    return llm


def _run(llm: LLM, prompts, params):
    outs = llm.generate(prompts, params)
    llm.scheduler.check()
    assert all(llm.target.length(s) == 0 for s in range(64))  # nothing held after the run
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_outputs_identical_with_and_without_overlap(tiny_llama, temperature):
    prompts = _prompts(6)
    # different max_tokens: rows finish at different steps, so the batch changes under a run-ahead
    params = [SamplingParams(temperature=temperature, max_tokens=9 + 4 * i, ignore_eos=True, seed=i)
              for i in range(6)]
    on = _llm(tiny_llama, True, max_num_seqs=4)
    off = _llm(tiny_llama, False, max_num_seqs=4)
    assert _run(on, prompts, params) == _run(off, prompts, params)
    # while 2 of the 6 wait nothing runs ahead; after that a forward run ahead serves the next
    # step, also when rows finished meanwhile (its other rows are used)
    assert on.loop.ahead_used > 10
    assert off.loop.ahead_used == off.loop.ahead_dropped == 0


def test_stop_strings_penalties_and_eos(tiny_llama):
    prompts = _prompts(3, seed=1)
    params = SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3, stop_token_ids=[7, 11, 13])
    on, off = _llm(tiny_llama, True, max_num_seqs=3), _llm(tiny_llama, False, max_num_seqs=3)
    assert _run(on, prompts, params) == _run(off, prompts, params)


def test_abort_while_a_forward_runs_ahead(tiny_llama):
    llm = _llm(tiny_llama, True, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i, p in enumerate(_prompts(3, seed=2)):
        llm.add_request(f"r{i}", p, params)
    for _ in range(4):
        llm.step()
    assert llm.loop._ahead is not None  # a forward is out for the next step
    used = llm.loop.ahead_used
    llm.abort_request("r1")
    outs = []
    while llm.has_unfinished_requests():
        outs += [o for o in llm.step() if o.finished]
    assert sorted(o.request_id for o in outs) == ["r0", "r2"]
    assert llm.loop.ahead_used > used  # the other rows of the forward run ahead were used
    llm.scheduler.check()
    ref = _llm(tiny_llama, False, max_num_seqs=4).generate([_prompts(3, seed=2)[i] for i in (0, 2)], params)
    assert [o.outputs[0].token_ids for o in sorted(outs, key=lambda o: o.request_id)] == \
        [o.outputs[0].token_ids for o in ref]


def test_a_request_joining_drops_the_forward_run_ahead(tiny_llama):
    llm = _llm(tiny_llama, True, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = _prompts(3, seed=7)
    for i, p in enumerate(prompts[:2]):
        llm.add_request(f"r{i}", p, params)
    for _ in range(5):
        llm.step()
    assert llm.loop._ahead is not None
    llm.add_request("r2", prompts[2], params)  # admitted next step: the batch grows
    outs = []
    while llm.has_unfinished_requests():
        outs += [o for o in llm.step() if o.finished]
    assert llm.loop.ahead_dropped == 1
    llm.scheduler.check()
    ref = _llm(tiny_llama, False, max_num_seqs=4).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in sorted(outs, key=lambda o: o.request_id)] == \
        [o.outputs[0].token_ids for o in ref]


def test_preemption_and_a_full_cache_under_overlap(tiny_llama):
    """A cache of 17 blocks: rows are preempted and recomputed, and a run-ahead that finds no
    room for its one position is skipped; outputs equal a roomy run's."""
    prompts = _prompts(8, seed=3)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    tight = _llm(tiny_llama, True, kv_cache_memory=17 * 16 * TINY_TOKEN_BYTES, max_model_len=256, max_num_seqs=8)
    got = _run(tight, prompts, params)
    assert tight.num_preemptions > 0
    assert got == _run(_llm(tiny_llama, False, max_num_seqs=8), prompts, params)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def _repetitive(n: int, seed: int) -> list[dict]:
    """Prompts that repeat themselves, so n-gram drafts (and is accepted) often."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        base = torch.randint(3, 500, (6 + i,), generator=g).tolist()
        out.append({"prompt_token_ids": base * 4})
    return out


def test_speculative_steps_drafted_ahead_change_nothing(tiny_llama):
    """n-gram, greedy: each step's drafts and forward are made at the end of the previous
    step; rows finishing at different steps drop them. Outputs equal a run without overlap."""
    prompts = _repetitive(5, seed=4)
    params = [SamplingParams(temperature=0, max_tokens=10 + 7 * i, ignore_eos=True) for i in range(5)]
    on = _llm(tiny_llama, True, speculative_config=NGRAM, max_num_seqs=3)
    got = _run(on, prompts, params)
    assert got == _run(_llm(tiny_llama, False, speculative_config=NGRAM, max_num_seqs=3), prompts, params)
    assert got == _run(_llm(tiny_llama, False, max_num_seqs=3), prompts, params)  # and without speculation
    # a step in which a row finishes drafts nothing ahead (the batch changes): none dropped here
    assert on.loop.ahead_used > 10
    assert on.stats.num_accepted_tokens > 0


def test_mixed_rows_and_sampled_rows(tiny_llama):
    """Speculative and plain rows together, and sampled rows (whose random streams must
    not be drawn early): outputs equal a run without overlap."""
    prompts = _repetitive(4, seed=5)
    params = [SamplingParams(temperature=0.8 if i == 3 else 0, max_tokens=16, ignore_eos=True, seed=i,
                             speculative=i % 2 == 0) for i in range(4)]
    on = _llm(tiny_llama, True, speculative_config=NGRAM, max_num_seqs=4)
    got = _run(on, prompts, params)
    assert got == _run(_llm(tiny_llama, False, speculative_config=NGRAM, max_num_seqs=4), prompts, params)
    # a sampled row is in the batch until its end: nothing is drafted ahead meanwhile
    assert on.loop.ahead_used == 0


def test_abort_and_preemption_with_drafts_made_ahead(tiny_llama):
    prompts = _repetitive(8, seed=6)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    tight = _llm(tiny_llama, True, speculative_config=NGRAM, kv_cache_memory=17 * 16 * TINY_TOKEN_BYTES,
                 max_model_len=256, max_num_seqs=8)
    got = _run(tight, prompts, params)
    assert tight.num_preemptions > 0
    assert got == _run(_llm(tiny_llama, False, max_num_seqs=8), prompts, params)
    llm = _llm(tiny_llama, True, speculative_config=NGRAM, max_num_seqs=4)
    for i, p in enumerate(prompts[:3]):
        llm.add_request(f"r{i}", p, params)
    for _ in range(3):
        llm.step()
    assert llm.loop._ahead is not None and llm.loop._ahead.plan is not None
    llm.abort_request("r1")
    outs = []
    while llm.has_unfinished_requests():
        outs += [o for o in llm.step() if o.finished]
    llm.scheduler.check()
    assert llm.loop.ahead_dropped >= 1
    ref = _llm(tiny_llama, False, max_num_seqs=4).generate([prompts[0], prompts[2]], params)
    assert [o.outputs[0].token_ids for o in sorted(outs, key=lambda o: o.request_id)] == \
        [o.outputs[0].token_ids for o in ref]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_cuda_overlap_is_the_default_and_changes_nothing(tiny_llama, temperature):
    prompts = _prompts(6)
    params = [SamplingParams(temperature=temperature, max_tokens=9 + 4 * i, ignore_eos=True, seed=i)
              for i in range(6)]
    on = LLM(str(tiny_llama), dtype="float32", device="cuda", max_num_seqs=4)
    off = LLM(str(tiny_llama), dtype="float32", device="cuda", max_num_seqs=4, overlap=False)
    assert on.overlap and not off.overlap
    assert [o.outputs[0].token_ids for o in on.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in off.generate(prompts, params)]
    assert on.loop.ahead_used > 10
    on.scheduler.check()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_speculative_overlap_changes_nothing(tiny_llama):
    prompts = _repetitive(5, seed=4)
    params = [SamplingParams(temperature=0, max_tokens=10 + 7 * i, ignore_eos=True) for i in range(5)]
    on = LLM(str(tiny_llama), NGRAM, dtype="float32", device="cuda", max_num_seqs=3)
    off = LLM(str(tiny_llama), NGRAM, dtype="float32", device="cuda", max_num_seqs=3, overlap=False)
    assert [o.outputs[0].token_ids for o in on.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in off.generate(prompts, params)]
    assert on.loop.ahead_used > 10
    on.scheduler.check()


def test_no_overlap_flag_on_every_engine_command(tiny_llama):
    from speculum.cli import build_parser, engine_options
    parser = build_parser()
    for argv in (["generate"], ["serve"], ["tune"], ["bench", "offline"], ["bench", "serve"], ["bench", "scaling"]):
        assert parser.parse_args(argv + ["--no-overlap"]).no_overlap is True, argv
    assert engine_options(parser.parse_args(["generate", "--no-overlap"]))["overlap"] is False
    assert "overlap" not in engine_options(parser.parse_args(["generate"]))
    assert LLM(str(tiny_llama), device="cpu", dtype="float32").overlap is False  # a CPU computes on the host


def test_steps_without_drafts_run_ahead_under_a_varying_length_policy(tiny_llama):
    """A batch-size schedule (as "auto" under load) that gives k = 0 at 3-4 rows: those steps
    run the next plain forward ahead although the rows could draft; when the batch falls to
    2 rows and drafts come back, the forward run ahead is dropped. Outputs equal a run
    without overlap and a run without speculation."""
    prompts = _repetitive(6, seed=6)
    params = [SamplingParams(temperature=0, max_tokens=8 + 6 * i, ignore_eos=True) for i in range(6)]
    cfg = dict(NGRAM, num_speculative_tokens_per_batch_size={"1-2": 3, "3-64": 0})
    on = _llm(tiny_llama, True, speculative_config=cfg, max_num_seqs=4)
    got = _run(on, prompts, params)
    assert got == _run(_llm(tiny_llama, False, speculative_config=cfg, max_num_seqs=4), prompts, params)
    assert got == _run(_llm(tiny_llama, False, max_num_seqs=4), prompts, params)
    zero, drafting = on.loop.k_counts[0], on.loop.k_counts[3]
    assert zero > 10 and drafting > 10 and on.stats.num_accepted_tokens > 0
    # most steps ran ahead: the k = 0 ones (plain forwards) and the k = 3 ones (drafted
    # ahead); under the rule before (rows that may draft never run a plain step ahead) only
    # the latter did: 15 of 43 steps here, against 26 now
    assert on.loop.ahead_used >= 0.55 * (zero + drafting)


def test_a_schedule_of_k_0_everywhere_overlaps_like_no_speculation(tiny_llama):
    """``num_speculative_tokens_per_batch_size`` giving k = 0 at every batch size (a vLLM
    config that switches speculation off under load): its plain steps run ahead as an engine
    without speculation does. Before, rows that could draft stopped every run-ahead when the
    policy's k did not vary (a fixed schedule is never asked for the next step's k): on the
    H200 that step synchronised with the GPU every time (0.8 ms per step at batch 64)."""
    prompts = _prompts(6, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=10 + 3 * i, ignore_eos=True) for i in range(6)]
    plain = _llm(tiny_llama, True, max_num_seqs=4)
    off = _llm(tiny_llama, True, speculative_config=dict(NGRAM, num_speculative_tokens_per_batch_size={"1-4096": 0}),
               max_num_seqs=4)
    assert not off.loop.length.varies
    assert _run(off, prompts, params) == _run(plain, prompts, params)
    assert off.loop.k_counts[0] == sum(off.loop.k_counts) > 10
    assert off.loop.ahead_used == plain.loop.ahead_used > 10


@pytest.mark.parametrize("spec", [None, NGRAM])
def test_a_full_batch_with_a_queue_runs_ahead(tiny_llama, spec):
    """Batch 1 (max_num_seqs=1) with requests queued (an offline benchmark): the running
    row's steps run ahead although requests wait, since none can join before it finishes.
    Before, a queue stopped overlap: only the last request's steps ran ahead."""
    prompts = _repetitive(4, seed=7)
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True) for _ in range(4)]
    on = _llm(tiny_llama, True, speculative_config=spec, max_num_seqs=1)
    got = _run(on, prompts, params)
    assert got == _run(_llm(tiny_llama, False, max_num_seqs=1), prompts, params)
    steps = sum(on.loop.k_counts)
    # each request's first step follows its prefill (nothing ran ahead for it) and its last
    # step runs nothing ahead; the rest do
    assert on.loop.ahead_used >= steps - 2 * len(prompts) - 2, (on.loop.ahead_used, steps)


class _Scripted(FixedLength):
    """A length policy whose k varies by a script (as "auto" switches between speculative
    and plain steps); records the step times it is told."""

    kind, times_drafting, varies = "scripted", False, True

    def __init__(self, max_k: int, script: list[int]):
        self.max_k, self.script, self.calls, self.timed, self.drafting = max_k, script, 0, [], []

    def choose(self, seqs) -> int:
        self.calls += 1
        return self.script[(self.calls - 1) % len(self.script)]

    def observe_acceptance(self, seq, asked, drafted, accepted) -> None:
        pass

    def observe_step(self, batch_size, k, q, draft_seconds, step_seconds) -> None:
        self.timed.append(step_seconds)
        if k:
            self.drafting.append(draft_seconds)

    def needs_timing(self, batch_size) -> bool:
        return False


def test_a_varying_policy_chooses_the_next_k_when_a_step_ends(tiny_llama):
    """A policy that switches between drafting and plain steps every few steps: the next
    step's k is chosen when a step ends, so a plain step after a speculative one runs ahead
    and a speculative one after a plain one is drafted ahead, and nothing launched ahead is
    dropped while the batch stays the same. Outputs equal a run without overlap."""
    prompts = _repetitive(3, seed=8)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    script = [3, 3, 0, 0, 2, 0, 3, 0, 0, 0, 1]
    on = _llm(tiny_llama, True, speculative_config=NGRAM, max_num_seqs=3)
    on.loop.length = policy = _Scripted(3, script)
    got = _run(on, prompts, params)
    off = _llm(tiny_llama, False, speculative_config=NGRAM, max_num_seqs=3)
    off.loop.length = _Scripted(3, script)
    assert got == _run(off, prompts, params)
    assert got == _run(_llm(tiny_llama, False, max_num_seqs=3), prompts, params)
    steps = sum(on.loop.k_counts)
    assert on.loop.k_counts[0] > 5 and on.loop.k_counts[3] > 5
    # one choice per step, made ahead or at the step (a plain last step chooses for a next
    # step before it knows that its rows finish)
    assert steps <= policy.calls <= steps + 1
    assert on.loop.ahead_dropped == 0
    # all but the first step, the last, and the steps in which a row finished (the batch
    # changes, so nothing is drafted ahead)
    assert on.loop.ahead_used >= steps - 2 - len(prompts)
    # every step's cycle was timed (none paid for dropped work), but the last (no next step)
    assert len(policy.timed) == steps - 1 and all(t is not None for t in policy.timed)


def test_drafting_made_ahead_is_timed_for_a_policy_that_reads_it(tiny_llama):
    """A policy that reads drafting times ("auto") learns them from the steps drafted ahead
    too, the steady state, not only from steps drafted at their own start (after an
    admission or a changed batch)."""
    prompts = _repetitive(2, seed=10)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    llm = _llm(tiny_llama, True, speculative_config=NGRAM, max_num_seqs=2)
    llm.loop.length = policy = _Scripted(3, [3])
    policy.times_drafting = True  # on the CPU every drafting step is then timed
    _run(llm, prompts, params)
    assert llm.loop.ahead_used > 5 and len(policy.drafting) > 5
    assert all(d is not None and d >= 0 for d in policy.drafting)


def test_a_step_that_dropped_work_launched_ahead_is_not_timed(tiny_llama):
    """A forward run ahead that a step cannot use (the batch changed: a row was aborted) is
    paid for by that step; the policy is told its cycle is unmeasured (None), not that its
    kind of step costs that much."""
    prompts = _repetitive(3, seed=9)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    llm = _llm(tiny_llama, True, speculative_config=NGRAM, max_num_seqs=3)
    llm.loop.length = policy = _Scripted(3, [3])
    for i, p in enumerate(prompts):
        llm.add_request(f"r{i}", p, params)
    for _ in range(4):
        llm.step()
    assert llm.loop._ahead is not None
    llm.abort_request("r1")
    llm.step()
    llm.step()  # its start times the step before
    assert llm.loop.ahead_dropped == 1
    assert policy.timed[-1] is None and all(t is not None for t in policy.timed[2:-1])
