"""EAGLE-3 heads that draft every target token (``speculum train eagle3 --draft-tail``): the
draft vocabulary through the head's own LM head, every other token through the target's.
A reduced draft vocabulary can never draft a token outside it (on the H200's answers to the
training prompts 5.7% of the tokens are outside the shipped head's 8,192): the tail lifts
that cap without storing more rows. Tiny models, CPU, fp32."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from speculum import SamplingParams
from speculum.backends.torch.heads import TargetParts, arch_from_config, init_layer
from speculum.errors import ConfigError
from speculum.proposers.head_checkpoint import read_weights
from speculum.testing import (make_llm, TOKEN_PROMPTS as PROMPTS, TREE_CONFIGS, assert_static_draft_matches_eager,
                              assert_tree_greedy_lossless, record_drafts, train_tiny)
from speculum_eagle.formats import eagle3_state, load_eagle3, save_eagle3
from speculum_eagle.model import Eagle3Head

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: on a CPU the tail is off unless asked for (options.draft_tail; the default is a GPU only)
TAIL = {"options": {"draft_tail": True}}


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    """A head trained with the tail from the start, and one trained without it (the
    shipped kind), both on a draft vocabulary of 64 of the target's 512 tokens."""
    work = tmp_path_factory.mktemp("train")
    return {"tail": train_tiny("eagle3", target, work / "tail", extra=("--draft-vocab", "64", "--draft-tail")),
            "plain": train_tiny("eagle3", target, work / "plain", extra=("--draft-vocab", "64"))}


def test_logits_cover_every_token_and_the_checkpoint_stays_eagle3(parts, tmp_path):
    """The head's own rows give the draft vocabulary's logits, the target's LM head every
    other token's; saved, the weights are a plain EAGLE-3 checkpoint of the draft vocabulary
    (no target rows), with ``speculum_target_tail`` in config.json."""
    torch.manual_seed(0)
    head = Eagle3Head(arch_from_config(parts.config, num_layers=1), parts.embed, parts.hidden_size, 200, (1, 1, 0))
    init_layer(head.layer, 0.1)
    for p in (head.fc.weight, head.lm_head.weight, head.norm.weight, head.hidden_norm.weight):
        torch.nn.init.normal_(p, std=0.1)
    head.set_vocab(torch.arange(0, 400, 2))
    plain_state = {k: v.clone() for k, v in eagle3_state(head).items()}
    head.use_target_tail(parts.lm_head)
    out = torch.randn(3, 64)
    logits = head.logits(out)
    x = head.norm(out)
    assert logits.shape == (3, 512) and torch.isfinite(logits).all()
    assert torch.allclose(logits[:, :400:2], head.lm_head(x), atol=1e-6)
    rest = torch.ones(512, dtype=torch.bool)
    rest[:400:2] = False
    assert torch.allclose(logits[:, rest], F.linear(x, parts.lm_head.float())[:, rest], atol=1e-6)
    assert torch.equal(head.greedy(out), logits.argmax(-1))
    save_eagle3(head, tmp_path / "e3")
    assert json.loads((tmp_path / "e3" / "config.json").read_text())["speculum_target_tail"] is True
    sd = read_weights(tmp_path / "e3")
    assert set(sd) == set(plain_state) | {"tail_map.weight"} and sd["lm_head.weight"].shape == (200, 64)
    loaded = load_eagle3(tmp_path / "e3", parts)
    assert loaded.tail is parts.lm_head
    assert torch.allclose(loaded.logits(out), logits, atol=1e-6)
    del sd["tail_map.weight"]  # the flag without the map: a clear error
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "e3" / "model.safetensors"))
    with pytest.raises(ConfigError, match="tail_map"):
        load_eagle3(tmp_path / "e3", parts)


def test_the_fitted_map_reads_the_head_rows_out_of_the_target_rows(parts):
    """A head whose own rows are the target's rows through some map A (as a head that drifted
    from its initialisation, linearly): fit_tail_map recovers A, and every token, inside the
    draft vocabulary or not, is scored as that head would score it."""
    torch.manual_seed(1)
    head = Eagle3Head(arch_from_config(parts.config, num_layers=1), parts.embed, parts.hidden_size, 200, (1, 1, 0))
    head.set_vocab(torch.arange(0, 400, 2))
    a = torch.eye(64) + 0.3 * torch.randn(64, 64)
    with torch.no_grad():
        head.lm_head.weight.copy_(parts.lm_head.float()[head.own_ids] @ a)
    head.use_target_tail(parts.lm_head)
    head.fit_tail_map(ridge=0.0)
    assert torch.allclose(head.tail_map.weight, a, atol=1e-3)
    x = torch.randn(5, 64)
    logits = head.draft_logits(x)
    assert logits.shape == (5, 512)  # every token, scored as through the rows A gives it
    assert torch.allclose(logits, F.linear(head.norm(x), parts.lm_head.float() @ a), atol=1e-3)


def test_a_head_with_the_tail_drafts_tokens_outside_its_vocabulary_losslessly(target, heads):
    """Greedy output identical to no speculation (chains and a tree), and some accepted
    drafts are tokens the draft vocabulary lacks."""
    spec = {"method": "eagle3", "model": str(heads["tail"]), "num_speculative_tokens": 3, **TAIL}
    base = make_llm(target, max_num_seqs=4).generate(PROMPTS, GREEDY)
    llm = make_llm(target, spec, max_num_seqs=2)
    assert llm.proposer.head.folded is not None  # inference: one product a draft step
    drafts = record_drafts(llm)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    own = set(llm.proposer.head.own_ids.tolist())
    drafted = {t for _, live in drafts for t in live.flatten().tolist() if t >= 0}
    assert drafted - own, "no draft outside the draft vocabulary"
    assert 0 < llm.metrics.num_accepted_tokens < llm.metrics.num_draft_tokens
    assert_tree_greedy_lossless(lambda s=None, **kw: make_llm(target, s, **kw),
                                {"method": "eagle3", "model": str(heads["tail"]), **TREE_CONFIGS["dynamic"], **TAIL},
                                PROMPTS, GREEDY)


def test_static_draft_function_drafts_like_the_eager_loop(target, heads):
    assert_static_draft_matches_eager(lambda spec: make_llm(target, spec, max_num_seqs=4),
                                      {"method": "eagle3", "model": str(heads["tail"]), "num_speculative_tokens": 3, **TAIL},
                                      PROMPTS, GREEDY)


def test_a_head_grows_the_tail_and_keeps_it(target, heads, tmp_path, capsys):
    """--init-from a head without the tail plus --draft-tail: at a learning rate of 0 its
    weights come back unchanged and config.json gains the flag. A head with the tail
    continued without --draft-tail is refused, not silently cut back to its vocabulary."""
    out = train_tiny("eagle3", target, tmp_path / "grow", steps=2, num_prompts=16, max_tokens=16,
                     extra=("--draft-vocab", "64", "--draft-tail", "--init-from", str(heads["plain"]), "--lr", "0",
                            "--save-dtype", "bfloat16"))
    before, after = read_weights(heads["plain"]), read_weights(out)
    assert set(after) == set(before) | {"tail_map.weight"}
    for name, w in before.items():
        assert torch.equal(w, after[name]), name
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculum_target_tail"] is True
    parent = json.loads((heads["plain"] / "config.json").read_text())["speculum"]["training"]
    assert cfg["speculum"]["training"]["grown_from"] == [  # the recipe it continued, recorded
        {**{k: parent[k] for k in ("command", "device", "steps", "train_seconds", "expected_acceptance_length")},
         "val_split": parent["data"]["val_split"]}]
    grown = load_eagle3(out, TargetParts.from_checkpoint(target))
    assert not torch.allclose(grown.tail_map.weight.float(), torch.eye(64), atol=0.05)  # fitted, not the identity
    with pytest.raises(RuntimeError):  # the CLI prints the ConfigError and exits 1
        train_tiny("eagle3", target, tmp_path / "cut", steps=1, num_prompts=16, max_tokens=16,
                   extra=("--draft-vocab", "64", "--init-from", str(heads["tail"])))
    assert "continue it with --draft-tail" in capsys.readouterr().err


def test_sampled_drafts_carry_mass_beyond_the_draft_vocabulary(target, heads):
    """Sampled requests draft from the head's processed distribution over every token (the
    rejection sampler then keeps the target's law): the probabilities sum to one and put
    mass outside the draft vocabulary, where a head without the tail puts none."""
    llm = make_llm(target, {"method": "eagle3", "model": str(heads["tail"]), "num_speculative_tokens": 3, **TAIL})
    seen = []
    inner = llm.proposer.propose
    llm.proposer.propose = lambda b: seen.append(inner(b)) or seen[-1]
    outs = llm.generate(PROMPTS[1:3], SamplingParams(temperature=0.8, max_tokens=12, seed=1, ignore_eos=True))
    assert all(len(o.token_ids) == 12 for o in outs)
    own = torch.zeros(512, dtype=torch.bool)
    own[llm.proposer.head.own_ids] = True
    outside = 0.0
    for d in seen:
        rows = d.token_ids[:, 0] >= 0
        p = d.probs[rows]
        assert torch.allclose(p.sum(-1), torch.ones(p.shape[:2]), atol=1e-5)
        outside += float(p[..., ~own].sum())
    assert outside > 0


def test_the_folded_tail_scores_as_the_unfolded_one_and_training_drops_it(parts):
    """fold_tail makes one [V, H] matrix of the map, the target's rows and the own rows: the
    same logits as the three-part path; train() drops it (the weights are about to change)."""
    torch.manual_seed(2)
    head = Eagle3Head(arch_from_config(parts.config, num_layers=1), parts.embed, parts.hidden_size, 200, (1, 1, 0))
    for p in (head.lm_head.weight, head.norm.weight):
        torch.nn.init.normal_(p, std=0.1)
    head.set_vocab(torch.arange(0, 400, 2))
    head.use_target_tail(parts.lm_head)
    with torch.no_grad():
        head.tail_map.weight.add_(0.2 * torch.randn(64, 64))
    x = torch.randn(4, 64)
    unfolded = head.draft_logits(x)
    head.eval().fold_tail()
    assert head.folded is not None and head.folded.shape == (512, 64)
    assert torch.allclose(head.draft_logits(x), unfolded, atol=1e-5)
    assert torch.equal(head.greedy(x), unfolded.argmax(-1))
    assert "folded" not in head.state_dict() and "tail_map.weight" in eagle3_state(head)
    head.train()
    assert head.folded is None


def test_draft_ids_map_to_target_ids_without_building_the_map(parts):
    """to_target (greedy drafts, tree top-k) gives draft_to_target[ids], with and without the tail."""
    head = Eagle3Head(arch_from_config(parts.config, num_layers=1), parts.embed, parts.hidden_size, 200, (1, 1, 0))
    head.set_vocab(torch.arange(0, 400, 2))
    ids = torch.tensor([[0, 5, 199], [7, 7, 1]])
    assert torch.equal(head.to_target(ids), head.draft_to_target[ids]) and head.to_target(ids)[0, 2] == 398
    head.use_target_tail(parts.lm_head)
    ids = torch.tensor([[0, 301, 511]])
    assert torch.equal(head.to_target(ids), head.draft_to_target[ids]) and head.to_target(ids) is ids


@pytest.mark.parametrize("options", [{"draft_tail": False}, {}], ids=["off", "default-on-cpu"])
def test_without_the_tail_it_drafts_from_the_own_vocabulary_only(target, heads, options):
    """``options.draft_tail: false``, and the default on a CPU, read a tail head as a plain
    EAGLE-3 head: every draft inside its draft vocabulary, output identical to no speculation."""
    spec = {"method": "eagle3", "model": str(heads["tail"]), "num_speculative_tokens": 3, "options": options}
    base = make_llm(target, max_num_seqs=4).generate(PROMPTS, GREEDY)
    llm = make_llm(target, spec, max_num_seqs=2)
    assert llm.proposer.head.tail is None and llm.proposer.head.folded is None
    drafts = record_drafts(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [b.token_ids for b in base]
    own = set(llm.proposer.head.own_ids.tolist())
    drafted = {t for _, live in drafts for t in live.flatten().tolist() if t >= 0}
    assert drafted and drafted <= own


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the default is a GPU only)")
def test_on_a_gpu_the_tail_is_on_by_default_and_folded(target, heads):
    spec = {"method": "eagle3", "model": str(heads["tail"]), "num_speculative_tokens": 3}
    base = make_llm(target, device="cuda").generate(PROMPTS, GREEDY)
    llm = make_llm(target, spec, device="cuda")
    assert llm.proposer.head.tail is not None and llm.proposer.head.folded is not None
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [b.token_ids for b in base]
