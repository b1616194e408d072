"""Nothing lost, nothing stuck (issue 9): KV accounting that is right at the edge, and
failed requests that leave every other request and the engine healthy."""

from __future__ import annotations

import pytest
import torch

from speculum import LLM, Draft, SamplingParams, hookimpl
from speculum.errors import ConfigError, EngineDeadError, RowError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
#: tiny llama (2 layers, 2 KV heads of 16, fp32): 512 bytes of KV per token; 17 blocks of 16
TINY_TOKEN_BYTES = 2 * 2 * 2 * 16 * 4
EDGE_BUDGET = 17 * 16 * TINY_TOKEN_BYTES


def _prompt(n: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    # a repetitive prompt, so ngram drafts (and reserves lookahead) all the way
    base = torch.randint(3, 500, (12,), generator=g).tolist()
    return {"prompt_token_ids": (base * (n // 12 + 1))[:n]}


# ------------------------------------------------------------------------- the edge
@pytest.mark.parametrize("max_tokens", [36, 40, 42, 45, 46, 48])
def test_one_request_at_the_context_limit_fits_the_plan(tiny_llama, max_tokens):
    """The held-out check: 17 blocks (16 usable), max_model_len 256, ngram k=4, a 210-token
    prompt. Before: 'needs 17 KV blocks but the cache has 16' out of generate()."""
    llm = LLM(str(tiny_llama), NGRAM, dtype="float32", device="cpu", kv_cache_memory=EDGE_BUDGET,
              max_model_len=256)
    assert llm.backend.plan.usable_blocks == 16 and llm.backend.plan.max_seqs_at_max_len == 1
    out = llm.generate(_prompt(210), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == min(max_tokens, 256 - 210)
    plain = LLM(str(tiny_llama), dtype="float32", device="cpu", max_model_len=256).generate(
        _prompt(210), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0]
    assert out.token_ids == plain.token_ids
    llm.scheduler.check()
    assert all(c.num_free_blocks == c.num_usable_blocks for c in llm.scheduler.caches)


def test_the_next_request_is_served_after_one_at_the_edge(tiny_llama):
    """Before: the failed request stayed queued and the next, unrelated one failed too."""
    llm = LLM(str(tiny_llama), NGRAM, dtype="float32", device="cpu", kv_cache_memory=EDGE_BUDGET,
              max_model_len=256)
    first = llm.generate(_prompt(210), SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))[0]
    second = llm.generate(_prompt(53, seed=1), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    assert first.finish_reason == "length" and second.finish_reason == "length" and len(second.token_ids) == 20
    assert not llm.has_unfinished_requests()


def test_draft_caches_count_too(tiny_llama, tiny_llama_draft):
    """A draft model's cache runs k - 1 positions ahead: the plan makes room for it."""
    spec = {"method": "draft_model", "model": str(tiny_llama_draft), "num_speculative_tokens": 4}
    pytest.importorskip("speculum_draft_model")
    probe = LLM(str(tiny_llama), spec, dtype="float32", device="cpu", max_model_len=256)
    budget = 17 * sum(probe.backend.plan.bytes_per_block.values())  # target + draft groups: 16 usable blocks
    with pytest.raises(ConfigError, match=r"the largest max_model_len that fits is 252"):
        LLM(str(tiny_llama), spec, dtype="float32", device="cpu", max_model_len=256, kv_cache_memory=budget)
    llm = LLM(str(tiny_llama), spec, dtype="float32", device="cpu", max_model_len=252, kv_cache_memory=budget)
    out = llm.generate(_prompt(210), SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))[0]
    assert len(out.token_ids) == 252 - 210
    llm.scheduler.check()


def test_budget_too_small_names_the_largest_max_model_len(tiny_llama):
    with pytest.raises(ConfigError) as exc:
        LLM(str(tiny_llama), dtype="float32", device="cpu", kv_cache_memory=EDGE_BUDGET, max_model_len=300)
    assert "the largest max_model_len that fits is 256" in str(exc.value)


def test_preemption_near_the_edge_is_lossless(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [_prompt(60 + 17 * i, seed=i) for i in range(8)]
    tight = LLM(str(tiny_llama), NGRAM, dtype="float32", device="cpu", kv_cache_memory=EDGE_BUDGET,
                max_model_len=256, max_num_seqs=8)
    outs = tight.generate(prompts, params)
    assert tight.num_preemptions > 0
    ref = LLM(str(tiny_llama), dtype="float32", device="cpu", max_num_seqs=8).generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    tight.scheduler.check()


# ----------------------------------------------------------------- local failures
class Faulty:
    """ngram-like proposer that fails on command: ``mode`` in row / batch / malformed / nan."""

    def __init__(self, ctx):
        self.mode = None
        self.victim = None  # seq_id of the row to fail

    def propose(self, batch):
        k = batch.num_speculative_tokens
        ids = torch.tensor([[s.token_ids[-1]] * k for s in batch.seqs])
        if self.mode == "batch":
            raise RuntimeError("injected: proposer down")
        if self.mode == "row":
            rows = [i for i, s in enumerate(batch.seqs) if s.seq_id == self.victim]
            if rows:
                raise RowError("injected: bad row", rows)
        if self.mode == "malformed":
            return Draft(token_ids=ids[:, :1].repeat(1, k + 3))
        if self.mode == "out_of_vocab":
            return Draft(token_ids=ids + 10_000_000)
        if self.mode == "nan_probs":
            return Draft(token_ids=ids, probs=torch.full((len(batch.seqs), k, 512), float("nan")))
        return Draft(token_ids=ids)

    def observe(self, feedback):
        pass


class FaultyPlugin:
    def __init__(self):
        self.proposer = None

    @hookimpl
    def speculum_register_proposers(self, register):
        def make(ctx):
            self.proposer = Faulty(ctx)
            return self.proposer
        register("faulty", make)


def _faulty(tiny_llama, **kw):
    plugin = FaultyPlugin()
    llm = LLM(str(tiny_llama), {"method": "faulty", "num_speculative_tokens": 3}, dtype="float32", device="cpu",
              plugins=[plugin], max_num_seqs=4, **kw)
    return llm, plugin.proposer


PROMPTS = [_prompt(20 + 5 * i, seed=i) for i in range(4)]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return [o.token_ids for o in LLM(str(tiny_llama), dtype="float32", device="cpu", max_num_seqs=4)
            .generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("mode", ["batch", "malformed", "out_of_vocab", "nan_probs"])
def test_a_failing_proposer_costs_only_its_drafts(tiny_llama, reference, mode, caplog):
    llm, p = _faulty(tiny_llama)
    p.mode = mode
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.finish_reason for o in outs] == ["length"] * 4
    assert [o.token_ids for o in outs] == reference
    assert sum(o.metrics.num_accepted_tokens for o in outs) == 0
    assert llm.loop.failures, "the failure was noticed"
    assert sum("logged once" in r.message for r in caplog.records) == 1
    llm.scheduler.check()


def test_a_row_error_fails_that_request_only(tiny_llama, reference):
    llm, p = _faulty(tiny_llama)
    for i, pr in enumerate(PROMPTS):
        llm.add_request(str(i), pr, GREEDY)
    p.mode, p.victim = "row", llm._by_request["2"][0].seq_id
    done = {}
    while llm.has_unfinished_requests():
        for o in llm.step(include_running=False):
            assert o.request_id not in done, "finished twice"
            done[o.request_id] = o
    assert done["2"].finish_reason == "error" and "injected: bad row" in done["2"].error
    for i in (0, 1, 3):
        assert done[str(i)].finish_reason == "length" and done[str(i)].token_ids == reference[i]
    assert llm.num_failed_requests == 1
    llm.scheduler.check()
    # and the engine serves the next request normally
    p.mode = None
    again = llm.generate(PROMPTS[2], GREEDY)[0]
    assert again.token_ids == reference[2] and again.metrics.num_drafts > 0  # speculation is back


class NaNRows:
    """Wraps the target runner: rows of ``victim`` sequences get NaN logits."""

    def __init__(self, runner, victims):
        self.runner, self.victims = runner, victims

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def forward(self, seq_ids, token_ids, num_tokens, hidden_layers=(), **kw):  # kw: tree, last_tokens
        out = self.runner.forward(seq_ids, token_ids, num_tokens, hidden_layers, **kw)
        logits = out.logits.clone()
        for b, sid in enumerate(seq_ids):
            if sid in self.victims:
                logits[b] = float("nan")
        out.logits = logits
        return out


@pytest.mark.parametrize("spec", [None, NGRAM])
def test_nan_logits_fail_their_request_only(tiny_llama, reference, spec):
    llm = LLM(str(tiny_llama), spec, dtype="float32", device="cpu", max_num_seqs=4)
    victims: set = set()
    llm.loop.target = NaNRows(llm.target, victims)
    for i, pr in enumerate(PROMPTS):
        llm.add_request(str(i), pr, GREEDY)
    victims.add(llm._by_request["1"][0].seq_id)
    done = {}
    while llm.has_unfinished_requests():
        for o in llm.step(include_running=False):
            done[o.request_id] = o
    assert done["1"].finish_reason == "error" and "NaN" in done["1"].error
    assert [done[str(i)].token_ids for i in (0, 2, 3)] == [reference[i] for i in (0, 2, 3)]
    llm.scheduler.check()


def test_a_stop_check_error_fails_that_request_only(tiny_llama, reference, monkeypatch):
    from speculum import sequence as seqmod
    llm = LLM(str(tiny_llama), NGRAM, dtype="float32", device="cpu", max_num_seqs=4)
    real = seqmod.Sequence.append

    def append(self, tokens, tokenizer):
        if self.request_id.endswith("-3"):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(self, tokens, tokenizer)
    monkeypatch.setattr(seqmod.Sequence, "append", append)
    outs = llm.generate(PROMPTS, GREEDY)
    assert outs[3].finish_reason == "error" and "injected" in outs[3].error
    assert [o.token_ids for o in outs[:3]] == reference[:3]


class BrokenVerifier:
    lossless = True

    def verify(self, target_logits, draft, sampling):
        raise RuntimeError("injected: verifier down")


def test_a_raising_verifier_falls_back_to_plain_sampling(tiny_llama, reference):
    llm = LLM(str(tiny_llama), NGRAM, dtype="float32", device="cpu", max_num_seqs=4)
    llm.loop.verifier = BrokenVerifier()
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference and llm.loop.failures["verifier"] > 0


def test_a_dead_device_refuses_new_work(tiny_llama, monkeypatch):
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", max_num_seqs=4)

    def forward(*a, **k):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
    monkeypatch.setattr(llm.loop.target, "forward", forward)
    monkeypatch.setattr(llm, "_device_failure", lambda: "RuntimeError: CUDA error (injected)")
    outs = llm.generate(PROMPTS[:2], GREEDY)
    assert [o.finish_reason for o in outs] == ["error", "error"] and "restart" in outs[0].error
    with pytest.raises(EngineDeadError):
        llm.add_request("x", PROMPTS[0], GREEDY)


def test_a_forward_error_on_a_healthy_device_fails_that_batch_only(tiny_llama, reference, monkeypatch):
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", max_num_seqs=4)
    real = llm.loop.target.forward
    calls = {"n": 0}

    def forward(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected: one bad forward")
        return real(*a, **k)
    monkeypatch.setattr(llm.loop.target, "forward", forward)
    outs = llm.generate(PROMPTS, GREEDY)
    assert all(o.finish_reason == "error" for o in outs)
    assert llm.dead is None
    monkeypatch.setattr(llm.loop.target, "forward", real)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    llm.scheduler.check()
