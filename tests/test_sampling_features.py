"""Every sampling feature through the engine with speculation on: identical to plain
decoding where the output is deterministic (greedy, fp32 on the CPU), and the target's
exact law where it is sampled.

Identity tests use two proposers: n-gram lookup (one-hot drafts) and the target itself
as its draft model ("self-draft": every draft it proposes under the same processing is
the target's choice, so whole runs of drafts are accepted and every verify position past
the first is exercised). Logprobs with speculation must equal those without within 1e-5.

Statistical tests: one prompt, N requests with seeds 0..N-1, temperature 1, top-k 5;
the law of the first two tokens (x1, x2) against the exact law computed here from the
target's logits with a reference implementation of each feature (this file's
``process``; x2's penalties count x1). Pearson's chi-square at ``ALPHA = 1e-4``; with N =
6000 and at most 25 cells, any law at total variation >= 0.06 is rejected with
probability > 0.99 (``test_power``). The drafts come from the target's first layer
(sampled drafts with their probabilities, processed with the same rules) with k = 3,
so x1 and x2 often come out of one verify step. The wrong variant (penalties that do
not count the drafts before a position) is run through the same test and rejected.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from speculum import LLM, SamplingParams
from speculum.errors import RequestError
from speculum.logits_process import LogitsRules
from speculum.sampling import sample_params

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ALPHA = 1e-4
N = 6000
TOP_K = 5
PROMPT = [17, 4, 30, 9, 17, 4, 30, 9, 17, 4]
#: for the laws: x1 often reappears among x2's likeliest tokens, so the penalty on x1 at
#: position 2 matters (total variation 0.33 between counting x1 and not; picked by search)
LAW_PROMPT = [384, 466, 262, 475, 384, 466, 262, 475, 384, 466]
ENGINE = dict(device="cpu", dtype="float32", max_num_seqs=512, kv_cache_memory=64 << 20)


def ngram():
    return {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


def self_draft(target):
    return {"method": "draft_model", "model": str(target), "num_speculative_tokens": 3}


def layer_draft(target):
    return {"method": "draft_model", "model": str(target), "num_speculative_tokens": 3,
            "options": {"num_layers": 1}}


@pytest.fixture(scope="module")
def engines(tiny_llama):
    return {"base": LLM(str(tiny_llama), None, **ENGINE), "ngram": LLM(str(tiny_llama), ngram(), **ENGINE),
            "self": LLM(str(tiny_llama), self_draft(tiny_llama), **ENGINE)}


GREEDY_CASES = {
    "penalties": SamplingParams(temperature=0, max_tokens=24, presence_penalty=0.8, frequency_penalty=0.6,
                                repetition_penalty=1.4, ignore_eos=True),
    "logit_bias": SamplingParams(temperature=0, max_tokens=24, logit_bias={184: -100, 466: 4.0, 30: 2.5},
                                 ignore_eos=True),
    "min_tokens": SamplingParams(temperature=0, max_tokens=24, min_tokens=9, stop_token_ids=[372, 466]),
    "logprobs": SamplingParams(temperature=0, max_tokens=24, logprobs=5, ignore_eos=True),
}


@pytest.mark.parametrize("case", sorted(GREEDY_CASES))
@pytest.mark.parametrize("method", ["ngram", "self"])
def test_greedy_output_is_identical_with_speculation(engines, case, method):
    p = GREEDY_CASES[case]
    want = engines["base"].generate({"prompt_token_ids": PROMPT}, p)[0]
    got = engines[method].generate({"prompt_token_ids": PROMPT}, p)[0]
    assert got.token_ids == want.token_ids
    assert got.finish_reason == want.finish_reason
    if method == "self":  # drafts were accepted, so later verify positions were used
        assert got.metrics.num_accepted_tokens > 0


def test_min_tokens_holds_back_the_stop_tokens(engines):
    p = GREEDY_CASES["min_tokens"]
    free = engines["base"].generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=24))[0]
    assert 372 in free.token_ids[:9] or 466 in free.token_ids[:9], "pick stop tokens the model emits early"
    out = engines["self"].generate({"prompt_token_ids": PROMPT}, p)[0]
    assert len(out.token_ids) > 9 and not set(out.token_ids[:9]) & {372, 466}


def test_logit_bias_bans_and_favours_tokens(engines):
    out = engines["self"].generate({"prompt_token_ids": PROMPT}, GREEDY_CASES["logit_bias"])[0]
    assert 184 not in out.token_ids


def test_logprobs_with_speculation_equal_those_without(engines):
    p = SamplingParams(temperature=0, max_tokens=24, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    want = engines["base"].generate({"prompt_token_ids": PROMPT}, p)[0]
    for method in ("ngram", "self"):
        got = engines[method].generate({"prompt_token_ids": PROMPT}, p)[0]
        assert got.token_ids == want.token_ids
        a, b = want.outputs[0].logprobs, got.outputs[0].logprobs
        assert len(a) == len(b) == len(want.token_ids)
        for tok, x, y in zip(want.token_ids, a, b):
            assert list(x) == list(y)  # the token, then the same top-5 in the same order
            assert x[tok].rank == y[tok].rank == 1  # greedy: the argmax
            for t in x:
                assert abs(x[t].logprob - y[t].logprob) <= 1e-5
        assert abs(want.outputs[0].cumulative_logprob - got.outputs[0].cumulative_logprob) <= 1e-4
        assert want.prompt_logprobs[0] is None and len(want.prompt_logprobs) == len(PROMPT)
        for x, y in zip(want.prompt_logprobs[1:], got.prompt_logprobs[1:]):
            assert list(x) == list(y) and all(abs(x[t].logprob - y[t].logprob) <= 1e-5 for t in x)


def test_logprobs_are_the_raw_log_softmax(engines, tiny_llama):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    p = SamplingParams(temperature=0, max_tokens=6, logprobs=2, presence_penalty=2.0, ignore_eos=True)
    out = engines["self"].generate({"prompt_token_ids": PROMPT}, p)[0]
    with torch.no_grad():
        logp = model(torch.tensor([PROMPT + out.token_ids])).logits[0].log_softmax(-1)
    for i, (tok, d) in enumerate(zip(out.token_ids, out.outputs[0].logprobs)):
        assert abs(d[tok].logprob - float(logp[len(PROMPT) - 1 + i, tok])) < 1e-4  # raw: before the penalty


def test_n_samples_of_a_seeded_request_are_distinct_and_reproducible(engines):
    p = SamplingParams(temperature=1.0, max_tokens=8, n=4, seed=7, ignore_eos=True)
    a = engines["self"].generate({"prompt_token_ids": PROMPT}, p)[0]
    b = engines["self"].generate({"prompt_token_ids": PROMPT}, p)[0]
    assert [o.index for o in a.outputs] == [0, 1, 2, 3]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1


def test_best_of_returns_the_samples_with_the_highest_cumulative_logprob(engines):
    p = SamplingParams(temperature=1.0, max_tokens=8, n=2, best_of=5, seed=3, ignore_eos=True)
    out = engines["ngram"].generate({"prompt_token_ids": PROMPT}, p)[0]
    singles = [engines["ngram"].generate({"prompt_token_ids": PROMPT}, sample_params(p, i))[0] for i in range(5)]
    ranked = sorted(singles, key=lambda o: -o.outputs[0].cumulative_logprob)[:2]
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in ranked]
    assert out.outputs[0].logprobs is None  # not asked for: only used to rank


def test_per_request_speculation_off_runs_in_the_same_batch(engines):
    llm = engines["self"]
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, speculative=False)
    fast = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    capped = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, num_speculative_tokens=1)
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * 3, [plain, fast, capped])
    ref = engines["base"].generate({"prompt_token_ids": PROMPT}, fast)[0].token_ids
    assert all(o.token_ids == ref for o in outs)
    assert outs[0].metrics.num_draft_tokens == 0
    assert outs[1].metrics.num_accepted_tokens > outs[2].metrics.num_accepted_tokens > 0
    assert len(outs[2].metrics.drafts_per_position) == 1  # never more than one draft per step


def test_a_proposer_never_sees_a_request_without_speculation(tiny_llama):
    llm = LLM(str(tiny_llama), self_draft(tiny_llama), **ENGINE)
    seen = set()
    inner = llm.proposer.propose

    def spy(batch):
        seen.update(s.seq_id for s in batch.seqs)
        return inner(batch)
    llm.proposer.propose = spy
    added = []
    inner_add = llm.proposer.add_request
    llm.proposer.add_request = lambda view: (added.append(view.seq_id), inner_add(view))
    llm.generate([{"prompt_token_ids": PROMPT}] * 2, [SamplingParams(temperature=0, max_tokens=8, speculative=False),
                                                     SamplingParams(temperature=0, max_tokens=8)])
    assert len(seen) == 1 and seen == set(added)


def test_requests_the_engine_cannot_serve_are_refused_with_the_fix(engines):
    base, spec = engines["base"], engines["ngram"]
    with pytest.raises(RequestError, match="higher than the engine's 3"):
        spec.add_request("a", {"prompt_token_ids": PROMPT}, SamplingParams(num_speculative_tokens=4))
    with pytest.raises(RequestError, match="without speculation"):
        base.add_request("b", {"prompt_token_ids": PROMPT}, SamplingParams(num_speculative_tokens=2))
    with pytest.raises(RequestError, match="outside the vocabulary"):
        spec.add_request("c", {"prompt_token_ids": PROMPT}, SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(RequestError, match="at most 20"):
        spec.add_request("d", {"prompt_token_ids": PROMPT}, SamplingParams(logprobs=21))
    with pytest.raises(RequestError, match="min_tokens"):
        spec.add_request("e", {"prompt_token_ids": PROMPT}, SamplingParams(min_tokens=20, max_tokens=4))
    with pytest.raises(RequestError, match="bad_words need a tokenizer"):
        spec.add_request("f", {"prompt_token_ids": PROMPT}, SamplingParams(bad_words=["x"]))
    assert not spec.has_unfinished_requests()


# -- sampled laws -------------------------------------------------------------------------
def process(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """The distribution of the next token, from the definitions (float64)."""
    l = logits.double().clone()
    for tok, b in p.logit_bias:
        l[tok] += b
    if p.repetition_penalty != 1.0:
        for tok in set(prompt) | set(output):
            l[tok] = l[tok] / p.repetition_penalty if l[tok] > 0 else l[tok] * p.repetition_penalty
    for tok in set(output):
        l[tok] -= p.frequency_penalty * output.count(tok) + p.presence_penalty
    l = l / p.temperature
    probs = l.softmax(-1)
    keep = probs >= p.min_p * probs.max()
    keep &= torch.zeros_like(keep).scatter_(0, l.topk(p.top_k).indices, True)
    out = torch.where(keep, probs, torch.zeros_like(probs))
    return out / out.sum()


def exact_law(target, p: SamplingParams) -> dict:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    with torch.no_grad():
        p1 = process(model(torch.tensor([LAW_PROMPT])).logits[0, -1], LAW_PROMPT, [], p)
        law = {}
        for x1 in p1.nonzero().flatten().tolist():
            p2 = process(model(torch.tensor([LAW_PROMPT + [x1]])).logits[0, -1], LAW_PROMPT, [x1], p)
            for x2 in p2.nonzero().flatten().tolist():
                law[(x1, x2)] = float(p1[x1] * p2[x2])
    return law


def pvalue(pairs, law) -> float:
    if any(pr not in law for pr in pairs):
        return 0.0
    cells = sorted(law)
    index = {c: i for i, c in enumerate(cells)}
    obs = np.bincount([index[pr] for pr in pairs], minlength=len(cells)).astype(float)
    return float(stats.chisquare(obs, np.array([law[c] for c in cells]) * len(pairs)).pvalue)


def power_at_tv(tv: float, cells: int) -> float:
    df = cells - 1
    return float(stats.ncx2.sf(stats.chi2.isf(ALPHA, df), df, 4 * N * tv ** 2))


LAWS = {
    "penalties": SamplingParams(temperature=1.0, top_k=TOP_K, presence_penalty=1.5, frequency_penalty=0.5,
                                repetition_penalty=1.3, max_tokens=4, ignore_eos=True),
    # the bias lifts the 7th likeliest first token (322) into the top 5 and lowers the first (292);
    # min_p then drops the least likely of the five
    "min_p_logit_bias": SamplingParams(temperature=1.0, top_k=TOP_K, min_p=0.4, logit_bias={322: 1.5, 292: -1.0},
                                       max_tokens=4, ignore_eos=True),
}


def sample_pairs(llm, p: SamplingParams, n: int = 1) -> list[tuple[int, int]]:
    params = [attrs_evolve(p, seed=i, n=n) for i in range(N // n)]
    outs = llm.generate([{"prompt_token_ids": LAW_PROMPT}] * len(params), params)
    return [tuple(o.token_ids[:2]) for out in outs for o in out.outputs]


def attrs_evolve(p, **kw):
    import attrs
    return attrs.evolve(p, **kw)


@pytest.mark.parametrize("case", sorted(LAWS))
def test_power(tiny_llama, case):
    law = exact_law(tiny_llama, LAWS[case])
    assert len(law) <= 25 and all(v * N >= 5 for v in law.values())
    assert power_at_tv(0.06, len(law)) > 0.99


@pytest.mark.parametrize("case", sorted(LAWS))
def test_sampled_law_with_speculation(tiny_llama, case):
    llm = LLM(str(tiny_llama), layer_draft(tiny_llama), **ENGINE)
    pairs = sample_pairs(llm, LAWS[case])
    m = llm.metrics
    assert 0 < m.num_accepted_tokens < m.num_draft_tokens
    p = pvalue(pairs, exact_law(tiny_llama, LAWS[case]))
    assert p > ALPHA, f"{case}: output differs from the target's law (p = {p:.2e})"


def test_n_samples_follow_the_law_and_are_independent(tiny_llama):
    llm = LLM(str(tiny_llama), layer_draft(tiny_llama), **ENGINE)
    p = LAWS["penalties"]
    pairs = sample_pairs(llm, p, n=4)
    assert pvalue(pairs, exact_law(tiny_llama, p)) > ALPHA
    # independence of sample 0 and sample 1 of each request (x1 of both): contingency test
    firsts = np.array([pr[0] for pr in pairs]).reshape(-1, 4)
    vals = sorted(set(firsts[:, :2].flatten().tolist()))
    table = np.zeros((len(vals), len(vals)))
    for a, b in firsts[:, :2]:
        table[vals.index(a), vals.index(b)] += 1
    assert stats.chi2_contingency(table).pvalue > ALPHA


def test_penalties_that_ignore_the_drafts_are_caught(tiny_llama, monkeypatch):
    """The wrong variant: every verify position gets the penalties of the step's start."""
    original = LogitsRules.apply

    def blind(self, logits, new_tokens=None, offset=0, rows=None):
        if offset == 0 and logits.shape[1] > 1:  # a verify step: drop the drafts from the counts
            return torch.cat([original(self, logits[:, t: t + 1], None, 0, rows) for t in range(logits.shape[1])], 1)
        return original(self, logits, new_tokens, offset, rows)

    monkeypatch.setattr(LogitsRules, "apply", blind)
    llm = LLM(str(tiny_llama), layer_draft(tiny_llama), **ENGINE)
    p = LAWS["penalties"]
    assert pvalue(sample_pairs(llm, p), exact_law(tiny_llama, p)) < ALPHA
    assert llm.metrics.num_accepted_tokens > 0


def test_logprobs_and_processors_with_a_token_tree(engines, tiny_llama, tmp_path):
    """Under a tree config logprobs are read along the accepted path (equal to those
    without speculation), and a request with a logits processor decodes without drafts
    (its output equals the base engine's)."""
    import importlib.util
    from speculum.testing import train_tiny
    if importlib.util.find_spec("speculum_eagle") is None:
        pytest.skip("trees are drafted by head methods: speculum-eagle is not installed")
    head = train_tiny("eagle", tiny_llama, tmp_path)
    llm = LLM(str(tiny_llama), {"method": "eagle", "model": str(head), "tree_topk": 2, "tree_depth": 3,
                                "num_draft_tokens": 6}, **ENGINE)
    p = SamplingParams(temperature=0, max_tokens=24, logprobs=3, ignore_eos=True)
    prompts = [{"prompt_token_ids": q} for q in (PROMPT, [5, 6, 7], [30, 31, 32, 30, 31], [10, 11, 12, 13] * 3)]
    wants = engines["base"].generate(prompts, p)
    gots = llm.generate(prompts, p)
    assert sum(g.metrics.num_accepted_tokens for g in gots) > 0  # paths deeper than the root were taken
    for want, got in zip(wants, gots):
        assert got.token_ids == want.token_ids
        for x, y in zip(want.outputs[0].logprobs, got.outputs[0].logprobs):
            assert list(x) == list(y) and all(abs(x[t].logprob - y[t].logprob) <= 1e-5 for t in x)
    pen = GREEDY_CASES["penalties"]
    out = llm.generate({"prompt_token_ids": PROMPT}, pen)[0]
    assert out.token_ids == engines["base"].generate({"prompt_token_ids": PROMPT}, pen)[0].token_ids
    assert out.metrics.num_draft_tokens == 0
