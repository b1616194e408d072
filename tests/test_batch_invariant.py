"""Batch-invariant mode on the CPU: its code paths (the torch twins of the invariant kernels,
keyed noise, exact-match sampling) run, agree with the default kernels, and keep greedy and
seeded sampled output identical with and without speculation (fp32). The bitwise claim
in bf16 is checked on a GPU (tests/test_batch_invariant_cuda.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from speculum import LLM, Draft, SamplingParams
from speculum.testing import TreeOracle, proposer_plugin, truth_table
from speculum.backends.torch.native.invariant import linear_torch, paged_attention_torch
from speculum.errors import ConfigError
from speculum.verifiers import exact_match_sample, keyed_exponentials

PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7, 8, 9]}, {"prompt_token_ids": list(range(1, 13)) * 3},
           {"prompt_token_ids": [3, 9, 27]}]


def test_linear_twin_matches_and_each_row_is_the_same_alone():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 96, generator=g)
    w, b = torch.randn(80, 96, generator=g), torch.randn(80, generator=g)
    y = linear_torch(x, w, b)
    assert torch.allclose(y, F.linear(x, w, b), atol=1e-5)
    # the rows go through fixed tiles of 16: a row alone gives the same bits
    assert all(torch.equal(linear_torch(x[i:i + 1], w, b)[0], y[i]) for i in range(37))


@pytest.mark.parametrize("hq,hkv", [(6, 2), (4, 4)])
def test_attention_twin_matches_masked_sdpa(hq, hkv):
    g = torch.Generator().manual_seed(1)
    B, T, D, n_slots, Lc = 2, 3, 16, 200, 96
    kp, vp = torch.randn(n_slots, hkv, D, generator=g), torch.randn(n_slots, hkv, D, generator=g)
    slots = torch.stack([torch.randperm(n_slots, generator=g)[:Lc] for _ in range(B)])
    pos = torch.tensor([[70, 71, 72], [5, 6, 7]])
    q = torch.randn(B, T, hq, D, generator=g)
    out = paged_attention_torch(q, kp, vp, slots, pos, D ** -0.5)
    mask = torch.arange(Lc).view(1, 1, 1, Lc) <= pos.unsqueeze(1).unsqueeze(-1)
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), kp[slots].transpose(1, 2), vp[slots].transpose(1, 2),
                                         attn_mask=mask, scale=D ** -0.5, enable_gqa=hq != hkv).transpose(1, 2)
    assert torch.allclose(out, ref, atol=1e-5)


def test_greedy_identical_with_every_method_and_batch(tiny_llama, tiny_llama_draft):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    base = LLM(str(tiny_llama), device="cpu", dtype="float32", batch_invariant=True, max_num_seqs=1)
    assert base.target.model.batch_invariant
    assert base.target.supports_trees  # a tree query reads its own slot table (no mask)
    ref = [o.token_ids for o in base.generate(PROMPTS, params)]
    plain = LLM(str(tiny_llama), device="cpu", dtype="float32", max_num_seqs=1)
    assert [o.token_ids for o in plain.generate(PROMPTS, params)] == ref  # fp32: the modes agree too
    for spec in ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
                 {"method": "draft_model", "model": str(tiny_llama_draft), "num_speculative_tokens": 3}):
        llm = LLM(str(tiny_llama), spec, device="cpu", dtype="float32", batch_invariant=True, max_num_seqs=3)
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == ref, spec["method"]
        assert llm.stats.num_drafts > 0
        if spec["method"] == "draft_model":  # the draft keeps the fast kernels
            assert not llm.proposer.runner.model.batch_invariant


class Oracle:
    """Drafts the reference output's next tokens (every other step a wrong last token)."""

    def __init__(self, truth: dict):
        self.truth, self.i = truth, 0

    def propose(self, batch):
        k = batch.num_speculative_tokens
        rows = []
        for s in batch.seqs:
            self.i += 1
            future = self.truth[(tuple(s.token_ids[:s.num_prompt_tokens]), tuple(s.token_ids[s.num_prompt_tokens:]))]
            d = list(future[:k]) + [0] * (k - len(future[:k]))
            if self.i % 2:
                d[-1] = (d[-1] + 1) % 512
            rows.append(d)
        return Draft(token_ids=torch.tensor(rows, dtype=torch.int64))

    def observe(self, feedback):
        pass


def test_seeded_sampling_same_tokens_with_and_without_speculation(tiny_llama):
    params = SamplingParams(temperature=0.7, max_tokens=32, ignore_eos=True, seed=11)
    base = LLM(str(tiny_llama), device="cpu", dtype="float32", batch_invariant=True, max_num_seqs=1)
    assert type(base.verifier).__name__ == "ExactMatchVerifier"
    ref = [o.token_ids for o in base.generate(PROMPTS, params)]
    plugin = proposer_plugin("oracle", Oracle(truth_table(PROMPTS, ref)))
    llm = LLM(str(tiny_llama), {"method": "oracle", "num_speculative_tokens": 3, "acceptance_method": "exact_match"},
              device="cpu", dtype="float32", batch_invariant=True, max_num_seqs=3, plugins=[plugin])
    out = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert out == ref
    assert llm.stats.num_accepted_tokens > 20  # drafts were accepted, not just rejected


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_trees_give_the_tokens_of_plain_decoding(tiny_llama, temperature, monkeypatch):
    """Batch-invariant mode with token trees (each tree query reads its own slot table; the
    verifier keys each node's sample by its depth): greedy and seeded sampled outputs equal
    plain batch-invariant decoding, with drafts accepted along either branch. The wrong
    variant (noise keyed by the node's column, as a chain's would be) changes tokens."""
    import speculum.verifiers.exact as exact
    params = SamplingParams(temperature=temperature, max_tokens=32, ignore_eos=True, seed=11)
    base = LLM(str(tiny_llama), device="cpu", dtype="float32", batch_invariant=True, max_num_seqs=1)
    ref = [o.token_ids for o in base.generate(PROMPTS, params)]
    plugin = proposer_plugin("tree_oracle", TreeOracle(truth_table(PROMPTS, ref)))

    def run():
        llm = LLM(str(tiny_llama), {"method": "tree_oracle", "speculative_token_tree": TreeOracle.PATHS,
                                    "acceptance_method": "exact_match"},
                  device="cpu", dtype="float32", batch_invariant=True, max_num_seqs=3, plugins=[plugin])
        return [o.token_ids for o in llm.generate(PROMPTS, params)], llm

    out, llm = run()
    assert out == ref
    assert type(llm.verifier).__name__ == "ExactMatchVerifier"
    assert llm.stats.num_accepted_tokens > 30  # both branches: up to 3 and 2 accepted per step
    if temperature:
        monkeypatch.setattr(exact, "exact_match_tree", _by_column)
        bad, _ = run()
        assert bad != ref


def _by_column(p, token_ids, tree, e):
    """The wrong variant of ``exact_match_tree``: node ``i`` samples with the noise of
    column ``i + 1`` (as if the tree were a chain), not of its depth."""
    from speculum.verifiers.tree import greedy_path
    from speculum.interfaces import Verdict
    B, N1, V = p.shape
    cols = torch.arange(N1).clamp_max(e.shape[1] - 1)
    samples = (p / e[:, cols]).argmax(dim=-1)
    out, num, path = greedy_path(samples, token_ids, tree.parents, tree.ancestors, tree.depth)
    return Verdict(token_ids=out, num_accepted=num, path=path)


def test_keyed_noise_depends_on_seed_and_position_only():
    e = keyed_exponentials(torch.tensor([3, 3, 4]), torch.tensor([10, 11, 10]), 2, 50)
    assert torch.equal(e[0, 1], e[1, 0])  # same seed, same absolute position
    assert not torch.equal(e[0, 0], e[2, 0])  # another seed
    assert not torch.equal(e[0, 0], e[0, 1])  # another position
    u = torch.exp(-keyed_exponentials(torch.arange(200), torch.zeros(200, dtype=torch.int64), 1, 500)).flatten()
    # Kolmogorov-Smirnov against U(0, 1): 100 000 draws, the 0.1% critical value is 1.95 / sqrt(n)
    srt = u.sort().values.double()
    n = srt.numel()
    ks = torch.maximum(torch.arange(1, n + 1) / n - srt, srt - torch.arange(n) / n).max().item()
    assert ks < 1.95 / math.sqrt(n)


def _joint_chi2(keyed_by_position: bool) -> float:
    """Chi-square of the first two emitted tokens of exact-match sampling against p0 x p1.

    p0 = p1 = p over 6 tokens; a one-hot draft of token 0 at both positions; 20 000 seeds;
    36 cells, 35 degrees of freedom: the 0.1% critical value is 66.6. The second token is
    the accepted draft, or the sample of the next step at position 1 after a rejection."""
    p = torch.tensor([0.3, 0.25, 0.2, 0.12, 0.08, 0.05])
    N = 20000
    seeds, pos0 = torch.arange(N), torch.full((N,), 40, dtype=torch.int64)

    def noise(offset: int, n: int) -> torch.Tensor:
        if keyed_by_position:
            return keyed_exponentials(seeds, pos0 + offset, n, 6)
        return keyed_exponentials(seeds, pos0, 1, 6).expand(N, n, 6)  # the wrong variant

    v = exact_match_sample(p.view(1, 1, 6).expand(N, 3, 6), torch.zeros(N, 2, dtype=torch.int64), noise(0, 3))
    first = v.token_ids[:, 0]
    second_next = (p.view(1, 6) / noise(1, 1)[:, 0]).argmax(-1)
    second = torch.where(v.num_accepted >= 1, v.token_ids[:, 1], second_next)
    counts = torch.zeros(6, 6)
    counts.index_put_((first, second), torch.ones(N), accumulate=True)
    expected = N * p.view(6, 1) * p.view(1, 6)
    return float(((counts - expected) ** 2 / expected).sum())


def test_exact_match_sampling_follows_the_target_law():
    """Power: with noise keyed by seed only (the wrong variant) both positions share it,
    every pair lands on the diagonal and the statistic is in the tens of thousands; the
    right rule passes at the 0.1% level (a false alarm once in a thousand seeds-sets)."""
    assert _joint_chi2(keyed_by_position=True) < 66.6
    assert _joint_chi2(keyed_by_position=False) > 1000


def test_clear_errors(tiny_llama):
    with pytest.raises(ConfigError, match="native runner"):
        LLM(str(tiny_llama), device="cpu", runner="hf", batch_invariant=True)
    with pytest.raises(ConfigError, match="True or False"):
        LLM(str(tiny_llama), device="cpu", batch_invariant="yes")


def test_flag_on_every_engine_command():
    from speculum.cli import build_parser, engine_options
    parser = build_parser()
    for argv in (["generate"], ["serve"], ["tune"], ["verify-quality", "--speculative-config", "{}"], ["bench", "offline"],
                 ["bench", "verifiers"], ["bench", "serve"]):
        args = parser.parse_args(argv + ["--batch-invariant"])
        assert args.batch_invariant is True, argv
    assert engine_options(parser.parse_args(["generate", "--batch-invariant"]))["batch_invariant"] is True
    assert parser.parse_args(["bench", "scaling", "--batch-invariant", "both"]).batch_invariant == "both"
