"""Sampled output through the whole engine follows the target's exact distribution.

``tests/test_rejection_sampler.py`` proves the verifier exact for given p and q. This file
checks the plumbing around it with real proposers: that a proposer's reported draft
probabilities are the ones it sampled from, that rollback leaves the caches right for the
next token, that per-request seeds are independent. Setting: one fixed prompt, N requests
with seeds 0..N-1, temperature 1 and top-k 5, ``max_tokens=4``; the law of the first two
tokens (25 possible pairs) is tested. With k = 3 both come out of the first verify step
when its first draft is accepted, from two steps otherwise (likewise for the EAGLE token
tree, whose first step accepts a path of 0 to 3 nodes). The exact joint law of (x1, x2) is computed from
the target alone with transformers (``p(x1) p(x2 | x1)``, top-k then softmax). The
model-based chain proposers run with the rejection sampler and with block verification.

Statistic: Pearson's chi-square of the 25 joint counts against N times the exact law,
level ``ALPHA = 1e-4`` (false-alarm rate per test; runs are seeded, so reproducible).

Power: with N = 6000, any output law at total variation TV from the exact one has
noncentrality ``lambda >= 4 N TV^2`` (Cauchy-Schwarz), so ``TV >= 0.06`` is detected with
probability > 0.99 (computed in ``test_power_of_the_joint_test``). The draft model's
case also runs a broken proposer (reports probabilities at temperature 1/4 while
sampling at temperature 1), computes the law it really produces for x1 analytically,
checks that it is at TV >= 0.06 and that the test rejects it.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from scipy import stats

from speculum import LLM, SamplingParams
from speculum.testing import train_tiny

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ALPHA = 1e-4
N = 6000
TOP_K = 5
SHARPEN = 4  # the broken proposer reports q ** SHARPEN (temperature 1 / SHARPEN)


def topk_probs(logits: torch.Tensor, k: int = TOP_K, temperature: float = 1.0) -> torch.Tensor:
    """Softmax over the k largest logits (the rest 0), in float64."""
    logits = logits.double() / temperature
    keep = logits.topk(k).indices
    out = torch.zeros_like(logits)
    out[keep] = logits[keep].softmax(-1)
    return out


def accept_law(p: torch.Tensor, q: torch.Tensor, q_reported: torch.Tensor) -> torch.Tensor:
    """The law of the token a verify position emits when its draft is sampled from ``q`` and
    reported as ``q_reported`` (the rejection sampler's rule: accepted iff ``u q' < p``, else
    drawn from ``norm(max(0, p - q'))``)."""
    a = torch.where(q_reported > 0, (p / q_reported.clamp_min(1e-300)).clamp(max=1.0), (p > 0).double())
    kept = q * a
    residual = (p - q_reported).clamp_min(0)
    return kept + (1 - kept.sum()) * residual / residual.sum()


@pytest.fixture(scope="module")
def prompt(tiny_llama):
    """``[a, b, c, d, a, b]``: n-gram lookup drafts ``c, d, a``; ``c`` is chosen among 200
    tokens as the one the target finds likeliest there, so n-gram drafts get accepted."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    cands = torch.arange(3, 203)
    rows = torch.stack([torch.tensor([17, 4, int(c), 9, 17, 4]) for c in cands])
    with torch.no_grad():
        p = model(rows).logits[:, -1].softmax(-1)
    best = int(p[torch.arange(len(cands)), cands].argmax())
    return rows[best].tolist()


@pytest.fixture(scope="module")
def exact(tiny_llama, prompt):
    return exact_law(tiny_llama, prompt)


def exact_law(tiny_llama, prompt) -> dict:
    """{(x1, x2): probability} of the first two sampled tokens, from the target alone."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    with torch.no_grad():
        p1 = topk_probs(model(torch.tensor([prompt])).logits[0, -1])
        law = {}
        for x1 in p1.nonzero().flatten().tolist():
            p2 = topk_probs(model(torch.tensor([prompt + [x1]])).logits[0, -1])
            for x2 in p2.nonzero().flatten().tolist():
                law[(x1, x2)] = float(p1[x1] * p2[x2])
    return law


def sample_pairs(llm: LLM, prompt: list[int]) -> list[tuple[int, int]]:
    params = [SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=4, seed=i, ignore_eos=True) for i in range(N)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * N, params)
    return [tuple(o.token_ids[:2]) for o in outs]


def joint_pvalue(pairs, law) -> float:
    cells = sorted(law)
    if any(pr not in law for pr in pairs):
        return 0.0  # a continuation the target cannot produce
    index = {c: i for i, c in enumerate(cells)}
    obs = np.bincount([index[pr] for pr in pairs], minlength=len(cells)).astype(float)
    exp = np.array([law[c] for c in cells]) * len(pairs)
    return float(stats.chisquare(obs, exp).pvalue)


def power_at_tv(tv: float, cells: int, n: int = N) -> float:
    """Lower bound on the power against any law at total variation ``tv``."""
    df = cells - 1
    return float(stats.ncx2.sf(stats.chi2.isf(ALPHA, df), df, 4 * n * tv ** 2))


def test_power_of_the_joint_test(exact):
    assert all(v * N >= 5 for v in exact.values()), "every cell needs an expected count >= 5"
    assert power_at_tv(0.06, len(exact)) > 0.99


METHODS = {
    "ngram": lambda tgt, draft, tmp: {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    # the target's first layer as the draft: top-5 sets overlap, drafts are accepted and rejected
    "draft_model": lambda tgt, draft, tmp: {"method": "draft_model", "model": str(tgt),
                                            "num_speculative_tokens": 3, "options": {"num_layers": 1}},
    "eagle": lambda tgt, draft, tmp: {"method": "eagle", "model": str(train_tiny("eagle", tgt, tmp)),
                                      "num_speculative_tokens": 3},
    # a dynamic token tree: deterministic top-k nodes, recursive rejection over siblings
    "eagle_tree": lambda tgt, draft, tmp: {"method": "eagle", "model": str(train_tiny("eagle", tgt, tmp)),
                                           "tree_topk": 3, "tree_depth": 3, "num_draft_tokens": 8},
}


@pytest.mark.parametrize("method, verifier", [(m, "rejection_sampler") for m in sorted(METHODS)]
                         + [("draft_model", "block"), ("eagle", "block")])
def test_sampled_output_follows_the_target_through_the_engine(tiny_llama, tiny_llama_draft, prompt, exact, method,
                                                              verifier, tmp_path):
    if method.startswith("eagle") and importlib.util.find_spec("speculum_eagle") is None:
        pytest.skip("speculum-eagle is not installed")
    spec = {**METHODS[method](tiny_llama, tiny_llama_draft, tmp_path), "acceptance_method": verifier}
    llm = LLM(str(tiny_llama), spec, device="cpu", dtype="float32", max_num_seqs=512, kv_cache_memory=64 << 20)
    pairs = sample_pairs(llm, prompt)
    m = llm.metrics
    assert m.num_drafts > 0 and 0 < m.num_accepted_tokens < m.num_draft_tokens  # drafts accepted and rejected
    pval = joint_pvalue(pairs, exact)
    assert pval > ALPHA, f"{method} ({verifier}): sampled output differs from the target's law (p = {pval:.2e})"


def test_a_proposer_reporting_wrong_probabilities_is_caught(tiny_llama, tiny_llama_draft, prompt, exact):
    """Drafts sampled at temperature 1, probabilities reported at temperature 1 / SHARPEN."""
    spec = METHODS["draft_model"](tiny_llama, tiny_llama_draft, None)
    llm = LLM(str(tiny_llama), spec, device="cpu", dtype="float32", max_num_seqs=512, kv_cache_memory=64 << 20)
    inner = llm.proposer.propose

    def wrong(batch):
        d = inner(batch)
        if d.probs is not None:
            sharp = d.probs.double() ** SHARPEN
            d.probs = (sharp / sharp.sum(-1, keepdim=True)).to(d.probs.dtype)
        return d

    llm.proposer.propose = wrong
    pairs = sample_pairs(llm, prompt)
    # the law of x1 it really produces: x ~ q accepted with min(1, p / q'), else the residual of p - q'
    from transformers import AutoModelForCausalLM
    with torch.no_grad():
        tl = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)(torch.tensor([prompt]))
        draft = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32, num_hidden_layers=1)
        dl = draft(torch.tensor([prompt]))
    p, q = topk_probs(tl.logits[0, -1]), topk_probs(dl.logits[0, -1])
    q2 = q ** SHARPEN / (q ** SHARPEN).sum()
    w = accept_law(p, q, q2)
    tv = float(0.5 * (w - p).abs().sum())
    assert tv >= 0.06, f"pick a case where the broken proposer differs enough (TV {tv:.3f})"
    x1 = np.array([a for a, _ in pairs])
    support = p.nonzero().flatten().tolist()
    obs = np.array([(x1 == s).sum() for s in support], dtype=float)
    exp = np.array([float(p[s]) for s in support]) * N
    assert set(x1.tolist()) <= set(support)
    assert stats.chisquare(obs, exp).pvalue < ALPHA  # the marginal of x1 alone already rejects it
    assert joint_pvalue(pairs, exact) < ALPHA



# ------------------------------------------------------------------ sequential Medusa heads
SEQ_SCALE = 30.0  # the heads' maps of the drafted tokens, scaled up (see trained_medusa)
SECOND = 0.12  # the least probability that the first step accepts both drafts, for the prompt chosen


def unfed(heads, h, prompt, x1=None):
    """Head 0's features at the first propose without a prefix layer, for head 1 not advanced
    by the first draft ``x1``: what Medusa-1 heads would read."""
    return heads.features(h[-1], torch.tensor(prompt[-1]))


def medusa_case(tiny_llama, out, drafting, reported):
    """A Medusa case for the joint test. ``out``: trained heads (3); ``drafting(heads, h,
    prompt)``: head 0's features at the first propose, from the final normed target states
    ``h`` [len - 1, H] of the prompt without its last token; ``reported(heads, h, prompt, x1)``:
    head 1's features as a wrong variant reports them when ``x1`` was drafted first (it samples
    as drafting does). The prompt is chosen among 400 seeded random ones for the largest total
    variation between the two laws. Returns (spec, prompt, exact law of (x1, x2), the wrong
    variant's law (computed: x1 exact; given the first draft accepted, x2 by
    :func:`accept_law` with head 1 as reported), their total variation, ``reported``)."""
    from transformers import AutoModelForCausalLM
    from speculum.testing import PrefillHidden
    spec = {"method": "medusa", "model": str(out), "num_speculative_tokens": 3}
    heads = LLM(str(tiny_llama), spec, device="cpu", dtype="float32").proposer.heads
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    prefill = PrefillHidden(tiny_llama, (-1,))

    def laws(prompt):
        with torch.inference_mode():
            p1 = topk_probs(model(torch.tensor([prompt])).logits[0, -1])
            h = prefill(prompt[:-1])[-1]
            z0 = drafting(heads, h, prompt)  # drafts x1, x2, ...
            q0 = topk_probs(heads.logits(0, z0))
            exact, wrong, second = {}, {}, 0.0
            for x1 in p1.nonzero().flatten().tolist():
                p2 = topk_probs(model(torch.tensor([prompt + [x1]])).logits[0, -1])
                q1 = topk_probs(heads.logits(1, heads.advance(0, z0, torch.tensor(x1))))
                q1_reported = topk_probs(heads.logits(1, reported(heads, h, prompt, x1)))
                both = float(min(q0[x1], p1[x1]))  # x1 emitted as the accepted first draft
                second += both * float(torch.minimum(q1, p2).sum())
                w = accept_law(p2, q1, q1_reported)
                for x2 in p2.nonzero().flatten().tolist():
                    exact[(x1, x2)] = float(p1[x1] * p2[x2])
                    wrong[(x1, x2)] = both * float(w[x2]) + (float(p1[x1]) - both) * float(p2[x2])
        tv = 0.5 * sum(abs(exact[c] - wrong.get(c, 0.0)) for c in exact)
        return exact, wrong, tv, second

    g = torch.Generator().manual_seed(0)
    prompts = [tuple(torch.randint(3, 500, (6,), generator=g).tolist()) for _ in range(400)]
    cands = {pr: laws(list(pr)) for pr in prompts}
    # the largest TV among prompts whose first step accepts both drafts often (the second
    # drafts' verification is what the wrong variants get wrong)
    prompt = max(cands, key=lambda pr: cands[pr][2] * (cands[pr][3] >= SECOND))
    return spec, list(prompt), *cands[prompt][:3], reported


def trained_medusa(tiny_llama, tmp_path_factory, name: str, extra: tuple[str, ...], scale: dict):
    """Sequential Medusa heads (3) trained on the tiny target, each weight whose name starts
    with a key of ``scale`` multiplied by its value (a few hundred tiny steps move the parts
    that start at zero little from it; any heads are valid drafts)."""
    if importlib.util.find_spec("speculum_medusa") is None:
        pytest.skip("speculum-medusa is not installed")
    from safetensors.torch import load_file, save_file
    out = train_tiny("medusa", tiny_llama, tmp_path_factory.mktemp(name), steps=600,
                     extra=("--num-heads", "3", "--sequential", "--save-dtype", "float32", *extra))
    f = out / "medusa_lm_head.safetensors"
    save_file({k: v * next((x for pre, x in scale.items() if k.startswith(pre)), 1.0)
               for k, v in load_file(str(f)).items()}, str(f))
    return out


@pytest.fixture(scope="module")
def seq_case(tiny_llama, tmp_path_factory):
    """Sequential heads, their maps of the drafted tokens scaled by SEQ_SCALE; the wrong variant
    reports head 1 unfed (without the first draft, as if the heads were Medusa-1's)."""
    out = trained_medusa(tiny_llama, tmp_path_factory, "seq_medusa", (), {"seq_proj.": SEQ_SCALE})
    return medusa_case(tiny_llama, out, unfed, unfed)


@pytest.fixture(scope="module")
def pre_case(tiny_llama, tmp_path_factory):
    """Sequential heads under a prefix layer (the kind shipped since the thirty-fourth session),
    the maps scaled by SEQ_SCALE (the layer as trained: it moves the heads' features enough);
    the wrong variant reports head 1 from the features without the layer (advanced by the
    first draft)."""
    out = trained_medusa(tiny_llama, tmp_path_factory, "pre_medusa", ("--prefix-layer",), {"seq_proj.": SEQ_SCALE})

    def through_the_layer(heads, h, prompt):  # the layer over every position's features, causal
        return heads.sequence_features(h[None], torch.tensor(prompt[1:])[None])[0, -1]

    def without_the_layer(heads, h, prompt, x1):
        return heads.advance(0, unfed(heads, h, prompt), torch.tensor(x1))

    return medusa_case(tiny_llama, out, through_the_layer, without_the_layer)


def report_head1_wrong(llm: LLM, reported) -> None:
    """Make ``llm``'s Medusa proposer report head 1's distribution at each request's first
    propose from the features ``reported(heads, h, prompt, x1)`` gives (see
    :func:`medusa_case`), its drafts unchanged. Only the first propose's head 1 decides the law
    of (x1, x2): a later step drafts x2 only after x1 was rejected, with head 0."""
    proposer = llm.proposer
    heads, add, inner = proposer.heads, proposer.add_request, proposer.propose
    states: dict[int, torch.Tensor] = {}

    def keep_states(seq, hidden_states=None):
        states[seq.seq_id] = hidden_states[-1].clone()
        return add(seq, hidden_states)

    def wrong(batch):
        d = inner(batch)
        if d.probs is not None:
            with torch.inference_mode():
                for b, s in enumerate(batch.seqs):
                    h = states.pop(s.seq_id, None)  # the first propose only
                    if h is not None and d.lengths[b] > 1:
                        x = reported(heads, h, list(s.token_ids), int(d.token_ids[b, 0]))
                        d.probs[b, 1] = topk_probs(heads.logits(1, x)).to(d.probs.dtype)
        return d

    proposer.add_request, proposer.propose = keep_states, wrong


MEDUSA_CASES = pytest.mark.parametrize("case", ["seq_case", "pre_case"], ids=["sequential", "prefix-layer"])


@MEDUSA_CASES
def test_sampled_medusa_follows_the_target(tiny_llama, case, request):
    """Sequential Medusa heads, with and without a prefix layer, report each draft's
    distribution given the drafts before it (and the layer): the output follows the target's
    law (the joint test above: TV >= 0.06 detected with probability > 0.99)."""
    spec, prompt, exact, *_ = request.getfixturevalue(case)
    assert all(v * N >= 5 for v in exact.values()) and power_at_tv(0.06, len(exact)) > 0.99
    llm = LLM(str(tiny_llama), spec, device="cpu", dtype="float32", max_num_seqs=512, kv_cache_memory=64 << 20)
    assert llm.proposer.heads.prefixed == (case == "pre_case")
    pairs = sample_pairs(llm, prompt)
    assert llm.metrics.accepted_per_position[1] > 0.1 * N  # second drafts are verified and accepted
    assert joint_pvalue(pairs, exact) > ALPHA


@MEDUSA_CASES
def test_medusa_reporting_head1_wrong_is_caught(tiny_llama, case, request):
    """The wrong variants: drafts sampled as drafting does, head 1's distribution reported
    unfed (without the first draft) or without the prefix layer. Each one's law of (x1, x2),
    computed, is at TV >= 0.06 from the target's; the joint test rejects it, and does not
    reject the law computed for it."""
    spec, prompt, exact, wrong_law, tv, reported = request.getfixturevalue(case)
    assert tv >= 0.06, f"pick a case where the reported head differs enough (TV {tv:.3f})"
    llm = LLM(str(tiny_llama), spec, device="cpu", dtype="float32", max_num_seqs=512, kv_cache_memory=64 << 20)
    report_head1_wrong(llm, reported)
    pairs = sample_pairs(llm, prompt)
    assert joint_pvalue(pairs, exact) < ALPHA
    assert joint_pvalue(pairs, wrong_law) > ALPHA  # and it is the law computed for it
