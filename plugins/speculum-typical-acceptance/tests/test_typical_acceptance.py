"""Tests of the typical-acceptance plugin: the rule, greedy exactness, sampling of the next
token, options, registration (and its lossy label), and the engine end to end.

Statistical checks use Pearson's chi-square at level ``ALPHA = 1e-4`` against the exact
law (the next token after the accepted prefix is sampled from ``p`` there), with 100 000
rows; the power against sampling from the wrong position (``p`` of the position before)
is computed and asserted > 0.999.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from scipy import stats

import speculum
from speculum import SamplingParams
from speculum.errors import ConfigError
from speculum.interfaces import Draft
from speculum.plugins import build_registry
from speculum.sampling import SamplingBatch, make_generator, processed_probs
from speculum.testing import make_llm as fp32_llm, tiny_model_dir
from speculum.verifiers import greedy_verify
from speculum_typical_acceptance import TypicalAcceptanceOptions, TypicalAcceptanceVerifier, typical_accept

ALPHA = 1e-4
N = 100_000

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def entropy(p: torch.Tensor) -> torch.Tensor:
    return -(p * p.log()).nansum(-1)


# ------------------------------------------------------------------ the rule
def test_threshold_is_min_of_ceiling_and_entropy_adaptive_term():
    # position 0: flat over 4 tokens (H = log 4, alpha e^-H = 0.075 < 0.09): accepts p > 0.075
    # position 1: peaked (H small, alpha e^-H > 0.09): the ceiling 0.09 applies
    flat = torch.tensor([0.25, 0.25, 0.25, 0.25, 0.0, 0.0])
    peaked = torch.tensor([0.85, 0.08, 0.07, 0.0, 0.0, 0.0])
    assert 0.3 * float(torch.exp(-entropy(flat))) == pytest.approx(0.075)
    assert 0.3 * float(torch.exp(-entropy(peaked))) > 0.09
    p = torch.stack([flat, peaked, flat]).unsqueeze(0).expand(5, -1, -1)
    drafts = torch.tensor([[0, 0], [3, 1], [4, 0], [1, 2], [2, -1]])
    v = typical_accept(p, drafts, torch.Generator().manual_seed(0))
    # 0.25 > 0.075 then 0.85 > 0.09; 0.25 then 0.08 < 0.09; p = 0 rejected; 0.07 < 0.09; padding
    assert v.num_accepted.tolist() == [2, 1, 0, 1, 1]
    assert v.token_ids[0, :2].tolist() == [0, 0] and v.token_ids[1, 0] == 3 and v.token_ids[3, 0] == 1
    assert (v.token_ids[2, 1:] == -1).all() and v.token_ids[4, 2] == -1
    # options move the threshold: a ceiling of 0.05 accepts the 0.07 and the 0.08
    v = typical_accept(p, drafts, torch.Generator().manual_seed(0), posterior_threshold=0.05)
    assert v.num_accepted.tolist() == [2, 2, 0, 2, 1]


def test_next_token_is_sampled_from_the_target_where_acceptance_stopped():
    """Rows stop at position 0, 1 or 2 (k = 2); the emitted token there follows p at that
    position (not a residual). Power against taking p of the previous position: > 0.999."""
    g = torch.Generator().manual_seed(1)
    p = (torch.randn(3, 8, generator=g) * 1.5).softmax(-1)
    drafts = torch.multinomial(p[:2], N, replacement=True, generator=g).T.contiguous()  # [N, 2]
    v = typical_accept(p.expand(N, -1, -1), drafts, g)
    for i in range(3):
        rows = v.num_accepted == i
        assert int(rows.sum()) > 5000, i
        obs = torch.bincount(v.token_ids[rows, i], minlength=8).double().numpy()
        pi = p[i].double() / p[i].double().sum()
        exp = pi.numpy() * obs.sum()
        pval = stats.chisquare(obs, exp).pvalue
        assert pval > ALPHA, f"position {i}: next token is not p_{i} (p = {pval:.2e})"
        if i:  # the wrong position's law is far: noncentrality >> the 1e-4 critical value
            n = obs.sum()
            prev = p[i - 1].double() / p[i - 1].double().sum()
            lam = float((n * (prev - pi) ** 2 / pi).sum())
            assert stats.ncx2.sf(stats.chi2.isf(ALPHA, 7), 7, lam) > 0.999
            assert stats.chisquare(obs, prev.numpy() * n).pvalue < ALPHA


def test_temperature_zero_is_exactly_greedy_matching():
    """The rule itself (no shortcut) on one-hot p, and the verifier on greedy rows."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(64, 4, 50, generator=g)
    am = logits.argmax(-1)
    corrupt = torch.rand(64, 3, generator=g) < 0.3
    drafts = torch.where(corrupt, torch.randint(0, 50, (64, 3), generator=g), am[:, :3])
    drafts[::7, 2] = -1
    ref = greedy_verify(logits, drafts)
    t0 = torch.zeros(64)
    onehot = processed_probs(logits, t0, torch.zeros(64, dtype=torch.int64), torch.ones(64))
    for opts in (TypicalAcceptanceOptions(), TypicalAcceptanceOptions(0.99, 5.0)):
        v = typical_accept(onehot, drafts, g, opts.posterior_threshold, opts.posterior_alpha)
        assert torch.equal(v.token_ids, ref.token_ids) and torch.equal(v.num_accepted, ref.num_accepted)
    sampling = SamplingBatch.from_params([SamplingParams(temperature=0)] * 64, [None] * 64)
    v = TypicalAcceptanceVerifier().verify(logits, Draft(drafts), sampling)
    assert torch.equal(v.token_ids, ref.token_ids) and torch.equal(v.num_accepted, ref.num_accepted)
    assert 0 < int(ref.num_accepted.sum()) < 3 * 64


def test_seeded_rows_reproduce_and_ignore_the_batch():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 4, 30, generator=g)
    drafts = torch.randint(0, 30, (6, 3), generator=g)
    params = [SamplingParams(temperature=0.7, seed=s) for s in range(6)]

    def verify(rows):
        return TypicalAcceptanceVerifier().verify(
            logits[rows], Draft(drafts[rows]),
            SamplingBatch.from_params([params[r] for r in rows], [make_generator(r) for r in rows]))

    full = verify(list(range(6)))
    assert torch.equal(full.token_ids, verify(list(range(6))).token_ids)
    for r in range(6):
        assert torch.equal(verify([r]).token_ids[0], full.token_ids[r])


# ------------------------------------------------------------------ options, registration
@pytest.mark.parametrize("bad, match", [({"posterior_threshold": 1.0}, "posterior_threshold must be in"),
                                        ({"posterior_threshold": 0}, "posterior_threshold must be in"),
                                        ({"posterior_alpha": -0.1}, "posterior_alpha must be >= 0")])
def test_options_are_validated(bad, match):
    with pytest.raises(ValueError, match=match):
        TypicalAcceptanceOptions(**bad)
    assert TypicalAcceptanceOptions() == TypicalAcceptanceOptions(0.09, 0.3)


def test_registered_as_lossy_with_its_distribution(monkeypatch, capsys):
    monkeypatch.delenv("SPECULUM_DISABLE_PLUGINS", raising=False)
    spec = build_registry().verifiers["typical_acceptance"]
    assert not spec.lossless and spec.options is TypicalAcceptanceOptions
    assert (spec.plugin.distribution, spec.plugin.version) == ("speculum-typical-acceptance", "0.1.0")
    from speculum.cli import main
    assert main(["plugins", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    row = rows["typical_acceptance"]
    assert row["kind"] == "verifier" and row["distribution"] == "speculum-typical-acceptance"
    assert row["details"].startswith("LOSSY")
    assert main(["plugins"]) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if "typical_acceptance" in ln][0]
    assert "speculum-typical-acceptance" in line and "LOSSY" in line


def test_disabled_plugin_is_gone(monkeypatch):
    monkeypatch.setenv("SPECULUM_DISABLE_PLUGINS", "typical_acceptance")
    reg = build_registry()
    assert "typical_acceptance" not in reg.verifiers and "rejection_sampler" in reg.verifiers


# ------------------------------------------------------------------ the engine
@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("target"), "llama", seed=0)


def make_llm(target, **spec):
    cfg = {"method": "draft_model", "model": str(target), "num_speculative_tokens": 3,
           "options": {"num_layers": 1}, "acceptance_method": "typical_acceptance", **spec}
    return fp32_llm(target, cfg, max_num_seqs=4)


PROMPTS = [{"prompt_token_ids": p} for p in ([5, 6, 7], [30, 31, 32, 30, 31], [10, 11, 12, 13] * 3)]


def test_engine_greedy_is_identical_to_plain_decoding(target):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    base = [o.token_ids for o in fp32_llm(target).generate(PROMPTS, greedy)]
    llm = make_llm(target)
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == base
    assert llm.metrics.num_accepted_tokens > 0


def test_engine_labels_the_output_lossy_and_takes_options(target, caplog):
    with caplog.at_level(logging.INFO, logger="speculum"):
        llm = make_llm(target, verifier_options={"posterior_threshold": 0.2, "posterior_alpha": 0.5})
    assert llm.verifier.options == TypicalAcceptanceOptions(0.2, 0.5)
    assert any("LOSSY" in r.message and r.levelname == "WARNING" for r in caplog.records)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.7, max_tokens=16, seed=1))
    assert all(o.metrics.as_dict()["lossless"] is False for o in outs)
    assert llm.metrics.as_dict()["lossless"] is False and llm.metrics.num_accepted_tokens > 0
    with pytest.raises(ConfigError, match=r"unknown option\(s\) alpha for verifier 'typical_acceptance'; "
                                          r"valid options: posterior_threshold, posterior_alpha"):
        make_llm(target, verifier_options={"alpha": 0.3})
    with pytest.raises(ConfigError, match=r"invalid options for verifier 'typical_acceptance': "
                                          r"posterior_threshold must be in"):
        make_llm(target, verifier_options={"posterior_threshold": 2})
    assert speculum.SpeculativeConfig  # the plugin needs nothing but the public API


def test_lossy_by_design_a_typical_draft_is_kept_where_rejection_would_often_refuse():
    """Why it is lossy, in one number: with p = (0.5, 0.3, 0.2) and a draft of the 0.2
    token, typical acceptance always keeps it (0.2 > min(0.09, 0.3 e^-H) = 0.09); a lossless
    verifier with a one-hot draft keeps it with probability 0.2 only."""
    p = torch.tensor([[[0.5, 0.3, 0.2], [1 / 3, 1 / 3, 1 / 3]]]).expand(1000, -1, -1)
    v = typical_accept(p, torch.full((1000, 1), 2), torch.Generator().manual_seed(4))
    assert int(v.num_accepted.sum()) == 1000
    assert np.isclose(0.3 * np.exp(-float(entropy(p[0, 0]))), 0.107, atol=1e-3)  # so the ceiling 0.09 applies


# ------------------------------------------------------------------ token trees
def _tree(parents):
    from speculum.tree import TokenTree
    return TokenTree(torch.tensor([parents]))


def test_chain_as_a_tree_gives_the_chain_verdict():
    from speculum_typical_acceptance.rule import typical_accept_tree
    torch.manual_seed(3)
    for _ in range(20):
        p = torch.softmax(torch.randn(1, 5, 12) * 2, -1)
        ids = torch.randint(0, 12, (1, 4))
        ids[0, :2] = p[0, :2].argmax(-1)  # some accepted prefix
        chain = typical_accept(p, ids, make_generator(7))
        tree = typical_accept_tree(p, ids, _tree([-1, 0, 1, 2]), make_generator(7))
        assert int(chain.num_accepted) == int(tree.num_accepted)
        assert chain.token_ids.tolist() == tree.token_ids.tolist()
        n = int(tree.num_accepted)
        assert tree.path[0, :n].tolist() == list(range(n))


def test_tree_keeps_the_deepest_passing_path_ties_by_likelihood():
    from speculum_typical_acceptance.rule import typical_accept_tree
    V = 8
    # root: p(1)=0.5, p(2)=0.3 (both pass), p(3)=0.01 (fails); after node 0 (token 1):
    # p(4)=0.6 passes; after node 1 (token 2): p(5)=0.9 passes; after node 2 (token 3): all
    p = torch.zeros(1, 6, V)
    p[0, 0, 1], p[0, 0, 2], p[0, 0, 3] = 0.5, 0.3, 0.01
    p[0, 1, 4], p[0, 2, 5], p[0, 3, 6] = 0.6, 0.9, 0.99
    p[0, :, 0] = 1 - p.sum(-1)[0]  # token 0 takes the rest of each row
    #          node: 0  1  2  3  4      tokens 1, 2, 3, 4, 5
    parents = [-1, -1, -1, 0, 1]
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    v = typical_accept_tree(p, ids, _tree(parents), make_generator(0))
    # depth-2 paths 0->3 (0.5*0.6 = 0.30) and 1->4 (0.3*0.9 = 0.27): the likelier wins
    assert int(v.num_accepted) == 2 and v.path[0, :2].tolist() == [0, 3]
    assert v.token_ids[0, :2].tolist() == [1, 4]
    # make the second likelier: 0.3 * 0.9 against 0.5 * 0.5
    p2 = p.clone()
    p2[0, 1, 4], p2[0, 1, 0] = 0.5, 0.5
    v = typical_accept_tree(p2, ids, _tree(parents), make_generator(0))
    assert v.path[0, :2].tolist() == [1, 4]
    # a node under a failing parent never counts, however likely itself
    v = typical_accept_tree(p, torch.tensor([[3, 7, 7, 6, 7]]), _tree([-1, -1, -1, 0, 1]), make_generator(0))
    assert int(v.num_accepted) == 0


def test_tree_at_temperature_zero_is_the_greedy_tree_rule():
    from speculum.tree import TokenTree
    from speculum.verifiers import tree_greedy_verify
    torch.manual_seed(0)
    B, N, V = 3, 6, 10
    logits = torch.randn(B, N + 1, V) * 3
    parents = torch.tensor([[-1, -1, 0, 0, 2, 1]] * B)
    am = logits.argmax(-1)
    ids = torch.randint(0, V, (B, N))
    ids[:, 0] = am[:, 0]
    ids[:, 2] = am[:, 1]
    tree = TokenTree(parents)
    want = tree_greedy_verify(logits, ids, tree)
    for temps in ([0.0] * B, [0.0, 0.8, 0.0]):  # all greedy, and greedy rows beside a sampled one
        params = [SamplingParams(temperature=t, seed=1) for t in temps]
        sampling = SamplingBatch.from_params(params, [make_generator(1) for _ in params], device="cpu")
        got = TypicalAcceptanceVerifier().verify(logits, Draft(token_ids=ids, tree=tree), sampling)
        for b in (0, 2):
            assert got.token_ids[b].tolist() == want.token_ids[b].tolist()
            assert got.path[b].tolist() == want.path[b].tolist()


def test_engine_tree_greedy_is_identical_and_sampled_runs(target, tmp_path):
    import importlib.util
    from speculum.testing import train_tiny
    if importlib.util.find_spec("speculum_eagle") is None:
        pytest.skip("trees need a tree-drafting method: speculum-eagle is not installed")
    head = train_tiny("eagle", target, tmp_path)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    base = [o.token_ids for o in fp32_llm(target).generate(PROMPTS, greedy)]
    tree = {"method": "eagle", "model": str(head), "tree_topk": 2, "tree_depth": 3, "num_draft_tokens": 6,
            "acceptance_method": "typical_acceptance"}
    llm = fp32_llm(target, tree, max_num_seqs=4)
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == base
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.7, max_tokens=16, seed=1, ignore_eos=True))
    assert all(len(o.token_ids) == 16 for o in outs) and llm.metrics.num_accepted_tokens > 0
