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
