"""scripts/medusa_tree.py: its static tree and its model of the proposer's dynamic tree."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import torch

from speculum.proposers.tree import dynamic_tree
from speculum.testing import tree_token_paths
from speculum.tree import TreeSpec

SCRIPT = Path(__file__).parents[1] / "scripts" / "medusa_tree.py"


def _module():
    spec = importlib.util.spec_from_file_location("medusa_tree", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Ranks:
    """An Expander whose candidates' token ids are their ranks: head ``level``'s top
    log-probs ``lp[level]`` for every parent (Medusa: children do not depend on the parent)."""

    def __init__(self, lp: torch.Tensor):
        self.lp, self.device = lp, torch.device("cpu")

    def root(self, width):
        return self.lp[0, :width].view(1, -1), torch.arange(width).view(1, -1)

    def expand(self, level, parent, tokens, vis, slots, width):
        F = tokens.shape[1]
        return (self.lp[level, :width].view(1, 1, -1).expand(1, F, -1),
                torch.arange(width).view(1, 1, -1).expand(1, F, -1))


def test_dynamic_paths_are_the_proposers_dynamic_tree():
    """The script's tree for each position is the one the proposer drafts (EAGLE-2 over the
    heads' log-probs), checked on random log-probabilities for three budgets."""
    mod = _module()
    g = torch.Generator().manual_seed(0)
    for topk, depth, nodes in ((4, 3, 10), (8, 4, 31), (16, 4, 31)):
        for _ in range(20):
            lp = (torch.randn(depth, 50, generator=g) * 2).log_softmax(-1).topk(topk, dim=-1).values  # no ties
            tokens, parents = dynamic_tree(_Ranks(lp), TreeSpec.dynamic(topk, depth, nodes + 1))
            assert tree_token_paths(tokens[0].tolist(), parents[0].tolist()) == mod.dynamic_paths(lp, topk, nodes)


def test_static_tree_is_the_most_frequent_prefixes_and_its_acceptance_counts_them():
    mod = _module()
    ranks = torch.tensor([[0, 0, 1], [0, 1, -1], [1, 0, 0], [0, 0, 0], [2, -1, -1], [-1, 0, 0]])
    counts = mod.prefix_counts(ranks)
    assert counts == Counter({(0,): 3, (0, 0): 2, (1,): 1, (2,): 1, (0, 1): 1, (0, 0, 1): 1, (0, 0, 0): 1,
                              (1, 0): 1, (1, 0, 0): 1})
    paths = mod.best_static(counts, 3)
    assert paths == [(0,), (1,), (0, 0)]
    # accepted drafts per row: 2, 1, 1, 2, 0, 0 -> MAL 1 + 6/6
    assert mod.mal(ranks, set(paths)) == 2.0
    assert mod.mal(ranks, {(0,), (0, 0), (0, 0, 0)}) == 1 + (2 + 1 + 0 + 3 + 0 + 0) / 6


def test_prompt_sets_by_name_or_path(tmp_path):
    """--prompts / --eval-prompts take a shipped set by name (mt_bench, other_tasks), as the
    CLI's --eval-prompts does, or a JSONL path; a missing file is a clear error."""
    import pytest
    from speculum.datasets import mt_bench
    from speculum.errors import RequestError

    mod = _module()
    chats = mod.read_chats("mt_bench", 3, None)
    assert [c[0]["content"] for c in chats] == [r["turns"][0] for r in mt_bench(3)]
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    assert mod.read_chats(str(tmp_path / "p.jsonl"), 5, None) == [[{"role": "user", "content": "a"}],
                                                                   [{"role": "user", "content": "b"}]]
    with pytest.raises(RequestError, match="not found"):
        mod.read_chats(str(tmp_path / "missing.jsonl"), 1, None)


def test_head_ranks_agree_with_the_live_proposer_under_a_prefix_layer(tiny_llama, tmp_path):
    """head_ranks reads heads with a prefix layer teacher-forced over whole sequences
    (`MedusaHeads.sequence_features`); the live proposer feeds the layer position by position
    through its cache. At every step the engine drafted, head i's draft is the true token
    exactly when head_ranks gives the true token rank 0 (for the heads whose earlier drafts
    were true, as head_ranks assumes; near-ties left out). The wrong variant, ranks read
    without the prefix layer, disagrees with the drafts somewhere."""
    import pytest
    pytest.importorskip("speculum_medusa")
    from speculum import SamplingParams
    from speculum.testing import make_llm, record_drafts, train_tiny

    mod = _module()
    heads_dir = train_tiny("medusa", tiny_llama, tmp_path, extra=("--num-heads", "3", "--sequential", "--prefix-layer"))
    llm = make_llm(tiny_llama, {"method": "medusa", "model": str(heads_dir), "num_speculative_tokens": 3}, max_num_seqs=1)
    heads = llm.proposer.heads
    torch.manual_seed(0)
    with torch.no_grad():  # the layer must matter for the wrong variant to show: any weights draft losslessly
        for p in heads.prefix.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    recorded = record_drafts(llm)
    g = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(3, 400, (n,), generator=g).tolist()} for n in (6, 9)]
    depth, width = 3, 8
    ranks, top = mod.head_ranks(llm, heads, prompts, 40, depth, width)
    seen = [(seqs[0], drafts[0].tolist()) for seqs, drafts in recorded]  # one sequence a step (max_num_seqs=1)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40))  # the answers head_ranks read
    rows, start = {}, 0
    for o in outs:  # head_ranks' rows per answer: its states with a token two ahead
        P, T = len(o.prompt_token_ids), len(o.prompt_token_ids) + len(o.token_ids)
        rows[tuple(o.prompt_token_ids)] = (start, P, list(o.prompt_token_ids) + list(o.token_ids), max(T - P - 1, 0))
        start += max(T - P - 1, 0)

    def compared(r):
        both, agree, right = 0, 0, 0
        for seq, drafts in seen:
            key = next(k for k in rows if tuple(seq[: len(k)]) == k)
            s, P, toks, U = rows[key]
            u = len(seq) - 1 - P  # the state that produced the sequence's last token
            # (the first step's drafts come from the prompt's state before its last token, u = -1: the prefill
            # leaves the last prompt token to the first verify; head_ranks starts at the answer)
            for i, d in enumerate(drafts):
                if u < 0 or u >= U - i or (i and drafts[i - 1] != toks[len(seq) + i - 1]):
                    break
                if top[s + u, i, 0] - top[s + u, i, 1] < 1e-4:
                    continue  # a near-tie: either order is right
                both += 1
                right += int(d == toks[len(seq) + i])
                agree += int((d == toks[len(seq) + i]) == bool(r[s + u, i] == 0))
        return both, agree, right

    both, agree, right = compared(ranks)
    assert both > 20 and agree == both
    assert 0 < right < both  # drafts that were right and drafts that were wrong are both among those compared
    prefix, heads.prefix = heads.prefix, None
    try:
        wrong, _ = mod.head_ranks(llm, heads, prompts, 40, depth, width)
    finally:
        heads.prefix = prefix
    both_w, agree_w, _ = compared(wrong)
    assert agree_w < both_w
