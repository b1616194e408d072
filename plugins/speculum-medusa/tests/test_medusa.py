"""Tests of the Medusa plugin on tiny models: format, detection, errors, losslessness, state."""

from __future__ import annotations

import json

import pytest
import torch

from speculum import SamplingParams
from speculum.backends.torch.heads import TargetParts
from speculum.errors import ConfigError
from speculum.interfaces import StepFeedback
from speculum.proposers.head_checkpoint import read_weights
from speculum.backends.torch.heads import topk_logprobs
from speculum.testing import (make_llm, TOKEN_PROMPTS as PROMPTS, TREE_CONFIGS, PrefillHidden,
                              assert_drafts_equal_fresh_prefills, assert_tree_greedy_lossless,
                              assert_tree_greedy_lossless_under_preemption, assert_trees_follow_reference,
                              assert_overlap_changes_nothing, record_drafts, record_trees, tiny_model_dir, train_tiny,
                              assert_training_starts_from)
from speculum_medusa import MedusaHeads, MedusaProposer
from speculum_medusa.formats import detect, load_medusa, medusa_state, save_medusa

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory):
    return train_tiny("medusa", target, tmp_path_factory.mktemp("train"), extra=("--num-heads", "3"))


def random_heads(parts, own: bool, seed=0, num_heads=3, num_layers=2) -> MedusaHeads:
    torch.manual_seed(seed)
    heads = MedusaHeads(parts.hidden_size, parts.vocab_size, num_heads, num_layers,
                        lm_head=None if own else parts.lm_head)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return heads


# ------------------------------------------------------------------ format
@pytest.mark.parametrize("own", [False, True], ids=["shared-lm-head", "own-lm-head"])
def test_round_trip_in_the_medusa_layout(parts, tmp_path, own):
    heads = random_heads(parts, own)
    save_medusa(heads, tmp_path / "m", base_model="tiny")
    sd = read_weights(tmp_path / "m")
    assert (tmp_path / "m" / "medusa_lm_head.safetensors").exists()
    want = {f"{i}.{j}.linear.{p}" for i in range(3) for j in range(2) for p in ("weight", "bias")}
    if own:
        want |= {f"{i}.2.weight" for i in range(3)}
    assert set(sd) == want
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (cfg["medusa_num_heads"], cfg["medusa_num_layers"], cfg["medusa_shared_lm_head"]) == (3, 2, not own)
    loaded = load_medusa(tmp_path / "m", parts)
    assert (loaded.heads is None) == (not own)
    a, b = medusa_state(loaded), medusa_state(heads)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_reads_the_original_medusa_lm_head_pt(parts, tmp_path):
    heads = random_heads(parts, own=True, num_layers=1)
    (tmp_path / "m").mkdir()
    # what FasterDecoding/Medusa writes: torch.save(medusa_head.state_dict()) + a bare config
    torch.save({k: v.clone() for k, v in medusa_state(heads).items()}, tmp_path / "m" / "medusa_lm_head.pt")
    (tmp_path / "m" / "config.json").write_text(json.dumps(
        {"medusa_num_heads": 3, "medusa_num_layers": 1, "base_model_name_or_path": "lmsys/vicuna-7b-v1.3"}))
    loaded = load_medusa(tmp_path / "m", parts)
    assert loaded.num_heads == 3 and loaded.heads is not None
    x = torch.randn(2, 64)
    assert torch.allclose(loaded.logits(1, x), heads.logits(1, x))


def test_detection(target, trained):
    assert detect("x", {"medusa_num_heads": 5}) == "medusa"
    assert detect("x", {"architectures": ["LlamaForCausalLM"]}) is None
    llm = make_llm(target, {"model": str(trained), "num_speculative_tokens": 3})
    assert llm.speculative_config.method == "medusa" and isinstance(llm.proposer, MedusaProposer)


# ------------------------------------------------------------------ errors
def test_mismatches_are_config_errors(target, parts, trained, tmp_path):
    other = TargetParts.from_checkpoint(tiny_model_dir(tmp_path / "narrow", "llama", hidden=32))
    save_medusa(random_heads(other, own=False), tmp_path / "narrow_heads")
    with pytest.raises(ConfigError, match="hidden size 32, but the target's is 64"):
        make_llm(target, {"model": str(tmp_path / "narrow_heads"), "num_speculative_tokens": 2})
    small = TargetParts.from_checkpoint(tiny_model_dir(tmp_path / "small", "llama", vocab_size=256))
    save_medusa(random_heads(small, own=True), tmp_path / "small_heads")
    with pytest.raises(ConfigError, match="vocabulary size 256 differs from the target's 512"):
        make_llm(target, {"model": str(tmp_path / "small_heads"), "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="num_speculative_tokens=4 but .* has 3 Medusa heads"):
        make_llm(target, {"model": str(trained), "num_speculative_tokens": 4})


# ------------------------------------------------------------------ losslessness and state
@pytest.mark.parametrize("runner", ["native", "hf"])
def test_greedy_output_is_identical_to_no_speculation(target, trained, runner):
    base = make_llm(target, runner=runner, max_num_seqs=4).generate(PROMPTS, GREEDY)
    llm = make_llm(target, {"method": "medusa", "model": str(trained), "num_speculative_tokens": 3},
                   runner=runner, max_num_seqs=2)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    assert 0 < llm.metrics.num_accepted_tokens < llm.metrics.num_draft_tokens


def test_drafts_come_from_the_state_of_the_last_accepted_position(target, trained):
    """The heads read the target state that produced the last token: after any number of
    steps the drafts equal those made from a fresh prefill of the whole sequence."""
    llm = make_llm(target, {"method": "medusa", "model": str(trained), "num_speculative_tokens": 3}, max_num_seqs=4)
    assert_drafts_equal_fresh_prefills(llm, target, MedusaProposer(llm.proposer.heads), PROMPTS, GREEDY, 3)


def test_observe_keeps_the_state_at_the_last_accepted_position(trained, parts):
    from speculum_medusa.formats import load_medusa
    p = MedusaProposer(load_medusa(trained, parts))
    h = torch.randn(2, 4, 64)
    p.observe(StepFeedback(seq_ids=[7, 8], num_accepted=[0, 2], new_lengths=[5, 9], hidden_states={-1: h}))
    assert torch.equal(p.last[7], h[0, 0]) and torch.equal(p.last[8], h[1, 2])


def test_sampled_drafts_come_with_their_distribution(target, trained):
    llm = make_llm(target, {"method": "medusa", "model": str(trained), "num_speculative_tokens": 3})
    seen = []
    inner = llm.proposer.propose
    llm.proposer.propose = lambda b: seen.append(inner(b)) or seen[-1]
    outs = llm.generate(PROMPTS[1:3], SamplingParams(temperature=0.8, max_tokens=12, seed=1, ignore_eos=True))
    assert all(len(o.token_ids) == 12 for o in outs)
    for d in seen:
        assert d.probs.shape == (*d.token_ids.shape, 512)
        assert torch.allclose(d.probs.sum(-1), torch.ones(d.token_ids.shape), atol=1e-5)


# ------------------------------------------------------------------ token trees
@pytest.mark.parametrize("runner", ["native", "hf"])
@pytest.mark.parametrize("max_num_seqs", [2, 4], ids=["joins-mid-flight", "all-at-once"])
@pytest.mark.parametrize("tree", ["dynamic", "static"])
def test_tree_greedy_output_is_identical_to_no_speculation(target, trained, runner, tree, max_num_seqs):
    spec = {"method": "medusa", "model": str(trained), **TREE_CONFIGS[tree]}
    assert_tree_greedy_lossless(lambda sp, **kw: make_llm(target, sp, runner=runner, **kw), spec, PROMPTS, GREEDY,
                                max_num_seqs=max_num_seqs)


def test_tree_greedy_lossless_under_preemption(target, trained):
    spec = {"method": "medusa", "model": str(trained), **TREE_CONFIGS["static"]}
    # target 2 layers, K and V, 2 heads x 16 dims, fp32: 512 bytes per token (no draft cache)
    assert_tree_greedy_lossless_under_preemption(target, spec, 512)


@pytest.mark.parametrize("tree", ["dynamic", "static"])
def test_tree_nodes_are_top_k_of_the_head_of_their_depth(target, trained, tree):
    llm = make_llm(target, {"method": "medusa", "model": str(trained), **TREE_CONFIGS[tree]}, max_num_seqs=4)
    seen = record_trees(llm)
    llm.generate(PROMPTS, GREEDY)
    prefill, heads = PrefillHidden(target, (-1,)), llm.proposer.heads

    def topk_for(tokens):
        x = prefill(tokens[:-1])[-1][-1]  # the state that produced the last token

        def topk(path, width):
            with torch.inference_mode():
                lp, ids = topk_logprobs(heads.logits(len(path), x), width)
            return lp.tolist(), ids.tolist()
        return topk

    assert assert_trees_follow_reference(seen, llm.speculative_config.tree, topk_for) > 10


def test_tree_deeper_than_the_heads_is_a_config_error(target, trained):
    with pytest.raises(ConfigError, match="needs 4 Medusa heads"):
        make_llm(target, {"method": "medusa", "model": str(trained), "tree_topk": 2, "tree_depth": 4,
                          "num_draft_tokens": 8})


@pytest.mark.parametrize("forward", [False, True], ids=["", "forward-from-verdict"])
@pytest.mark.parametrize("tree", [None, {"tree_topk": 2, "tree_depth": 3, "num_draft_tokens": 7}],
                         ids=["chain", "tree"])
def test_steps_are_drafted_ahead_and_rewinds_change_nothing(target, trained, tree, forward):
    """Overlapped steps (forced on: a CPU engine does not overlap): Medusa's propose changes
    no state, so it is rewindable for free and each step (a chain or a token tree) is drafted
    from the verdict of the step before, still on the device. An abort and a join drop a
    step drafted ahead. Outputs equal plain decoding, and drafts and acceptance equal a run
    without overlap on the same schedule."""
    spec = {"method": "medusa", "model": str(trained), **(tree or {"num_speculative_tokens": 3})}
    params = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)

    def build(target, spec=None, **kw):  # forward: the next verify forward launched from the verdict too
        llm = make_llm(target, spec, **kw)
        llm.loop.forward_from_verdict = forward and spec is not None
        return llm

    _, loop = assert_overlap_changes_nothing(build, target, spec, PROMPTS, params)
    assert loop.rewindable
    assert (loop.forwards_from_verdict > 10) == forward, loop.forwards_from_verdict
    # each next chain or tree drafted from the verdict still on the device (VerdictDrafter)
    assert loop.drafted_from_verdict > 10, loop.drafted_from_verdict


def test_trees_drafted_from_the_verdict_under_preemption(target, trained):
    """Overlap forced on with a KV budget that forces preemption: rows leave and come back
    while their trees are drafted from the device verdict; outputs equal plain decoding."""
    from speculum.testing import assert_drafts_from_verdict_under_preemption
    spec = {"method": "medusa", "model": str(trained), **TREE_CONFIGS["static"]}
    # target 2 layers, K and V, 2 heads x 16 dims, fp32: 512 bytes per token (no draft cache)
    assert_drafts_from_verdict_under_preemption(target, spec, 20 * 16 * 512)


def test_the_state_drafted_from_is_the_one_observe_keeps(trained, parts):
    """last_accepted_state (device-side, from tree columns and the verdict) picks, bit for
    bit, the state observe() keeps from the same step's states in path order."""
    from speculum.interfaces import Verdict
    from speculum.tree import gather_path
    from speculum_medusa.proposer import last_accepted_state
    g = torch.Generator().manual_seed(0)
    B, N, H = 3, 6, parts.hidden_size
    h = torch.randn(B, N + 1, H, generator=g)
    path = torch.tensor([[0, 2, -1, -1, -1, -1], [-1] * 6, [1, 3, 4, -1, -1, -1]])  # [B, N] nodes, -1 padded
    acc = torch.tensor([2, 0, 3])
    v = Verdict(token_ids=torch.zeros(B, 4, dtype=torch.int64), num_accepted=acc, path=path)
    got = last_accepted_state(h, v)
    along = gather_path({-1: h}, path)[-1]
    assert torch.equal(got, along[torch.arange(B), acc])
    assert torch.equal(got[1], h[1, 0]) and torch.equal(got[2], h[2, 5])


def test_training_starts_from_a_checkpoint(target, trained, tmp_path):
    """--init-from: a run with a learning rate of 0 exports the checkpoint it started from."""
    assert_training_starts_from("medusa", target, trained, tmp_path / "again", ("--num-heads", "3"))


def test_training_grows_a_checkpoint_to_more_blocks(target, trained, parts, tmp_path, capsys):
    """--init-from with --num-layers above the checkpoint's (1 here): its blocks come first, the
    new ones are zero (identity maps), so at a learning rate of 0 the exported heads give the
    checkpoint's logits; a head's blocks still in the Medusa layout ({i}.{j}.linear.*)."""
    out = train_tiny("medusa", target, tmp_path / "grown", steps=2, num_prompts=16, max_tokens=16,
                     extra=("--num-heads", "3", "--num-layers", "3", "--init-from", str(trained), "--lr", "0",
                            "--save-dtype", "float32"))
    before, after = read_weights(trained), read_weights(out)
    assert json.loads((out / "config.json").read_text())["medusa_num_layers"] == 3
    assert set(after) == {f"{i}.{j}.linear.{p}" for i in range(3) for j in range(3) for p in ("weight", "bias")}
    for name, w in before.items():
        assert torch.equal(w.float(), after[name]), name
    assert all(not after[f"{i}.{j}.linear.{p}"].any() for i in range(3) for j in (1, 2) for p in ("weight", "bias"))
    old, new = load_medusa(trained, parts), load_medusa(out, parts)
    h = torch.randn(5, parts.hidden_size)
    for i in range(3):
        torch.testing.assert_close(new.logits(i, h), old.logits(i, h))
    with pytest.raises(RuntimeError):  # fewer blocks than the checkpoint's: refused, not cut silently
        train_tiny("medusa", target, tmp_path / "cut", steps=2, num_prompts=16, max_tokens=16,
                   extra=("--num-heads", "3", "--num-layers", "1", "--init-from", str(out)))
    assert "its heads have 3 blocks each, --num-layers asks for 1" in capsys.readouterr().err


def test_keep_best_exports_the_best_validated_weights(target, parts, trained, tmp_path):
    """--keep-best: a run whose learning rate wrecks the heads exports the validated step with the
    best expected acceptance length (here step 0, the --init-from checkpoint, bit for bit), and
    records which one in training.json and config.json; without it the wrecked last step is
    exported."""
    args = ("--num-heads", "3", "--init-from", str(trained), "--lr", "30", "--warmup", "0", "--eval-every", "2",
            "--val-fraction", "0.25", "--save-dtype", "float32")
    out = train_tiny("medusa", target, tmp_path / "best", steps=4, extra=(*args, "--keep-best"))
    report = json.loads((out / "training.json").read_text())
    scores = {h["step"]: h["val_acceptance_length"] for h in report["history"]}
    assert sorted(scores) == [0, 2, 4]
    best = max(scores, key=lambda s: (scores[s], s))  # a tie goes to the later step
    assert report["kept"] == {"step": best, "val_acceptance_length": scores[best], "start_competed": True}
    assert best == 0 and scores[4] < scores[0]  # lr 30 makes the heads worse than where they started
    assert report["expected_acceptance_length"] == scores[0]
    assert json.loads((out / "config.json").read_text())["speculum"]["training"]["kept"]["step"] == 0
    before, after = read_weights(trained), read_weights(out)
    assert all(torch.equal(w.float(), after[k]) for k, w in before.items())
    plain = train_tiny("medusa", target, tmp_path / "last", steps=4, extra=args)
    assert "kept" not in json.loads((plain / "training.json").read_text())
    assert not all(torch.equal(w.float(), read_weights(plain)[k]) for k, w in before.items())
    assert not (plain / "last-step").exists()  # the last step is the export: no copy beside it
    # the last step's weights are kept beside the earlier step exported: the run without
    # --keep-best exported the same weights, and the copy's config records its step and validation
    last = out / "last-step"
    assert read_weights(last).keys() == read_weights(plain).keys()
    assert all(torch.equal(w, read_weights(last)[k]) for k, w in read_weights(plain).items())
    training = json.loads((last / "config.json").read_text())["speculum"]["training"]
    assert training["steps"] == 4 and training["val_acceptance_length"] == scores[4]
    assert training["data"]["val_split"] == "prompt-hash" and training["grown_from"]
    load_medusa(last, parts)  # loads as any shipped head


# ------------------------------------------------------------------ token-aware heads
@pytest.fixture(scope="module")
def token_trained(target, tmp_path_factory):
    return train_tiny("medusa", target, tmp_path_factory.mktemp("train_tok"), extra=("--num-heads", "3", "--token-input"))


def test_token_aware_heads_round_trip_and_read_the_token(parts, tmp_path):
    heads = MedusaHeads(parts.hidden_size, parts.vocab_size, 3, 2, lm_head=parts.lm_head, embed=parts.embed)
    torch.manual_seed(0)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.1)
    save_medusa(heads, tmp_path / "m", base_model="tiny")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["speculum_token_input"] is True and "token_proj.weight" in read_weights(tmp_path / "m")
    loaded = load_medusa(tmp_path / "m", parts)
    h, tok = torch.randn(4, parts.hidden_size), torch.tensor([1, 2, 3, 4])
    for i in range(3):
        assert torch.equal(loaded.logits(i, loaded.features(h, tok)), heads.logits(i, heads.features(h, tok)))
    # the token matters: other tokens, other features; Medusa-1 heads ignore it
    assert not torch.equal(loaded.features(h, tok), loaded.features(h, tok + 1))
    assert torch.equal(random_heads(parts, own=False).features(h, tok), h)
    bad = tmp_path / "bad"
    save_medusa(random_heads(parts, own=False), bad)
    (bad / "config.json").write_text(json.dumps({**json.loads((bad / "config.json").read_text()),
                                                 "speculum_token_input": True}))
    with pytest.raises(ConfigError, match="lack 'token_proj.weight'"):
        load_medusa(bad, parts)


@pytest.mark.parametrize("runner", ["native", "hf"])
@pytest.mark.parametrize("spec", [{"num_speculative_tokens": 3}, TREE_CONFIGS["static"], TREE_CONFIGS["dynamic"]],
                         ids=["chain", "static-tree", "dynamic-tree"])
@pytest.mark.parametrize("kind", ["token_trained", "seq_trained"], ids=["token-aware", "sequential"])
def test_token_aware_greedy_output_is_identical_to_no_speculation(target, request, kind, runner, spec):
    """Token-aware and sequential heads (the fixtures below): chains and both kinds of tree."""
    spec = {"method": "medusa", "model": str(request.getfixturevalue(kind)), **spec}
    if "num_speculative_tokens" in spec:
        base = make_llm(target, runner=runner, max_num_seqs=4).generate(PROMPTS, GREEDY)
        llm = make_llm(target, spec, runner=runner, max_num_seqs=2)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [b.token_ids for b in base]
        assert 0 < llm.metrics.num_accepted_tokens < llm.metrics.num_draft_tokens
    else:
        assert_tree_greedy_lossless(lambda sp, **kw: make_llm(target, sp, runner=runner, **kw), spec, PROMPTS,
                                    GREEDY, max_num_seqs=2)


def test_token_aware_drafts_read_the_last_state_and_the_token_it_produced(target, token_trained):
    """Each chain equals the heads' argmax on (the state that produced the sequence's last
    token, that token), computed here from a fresh prefill: not the proposer's own code."""
    llm = make_llm(target, {"method": "medusa", "model": str(token_trained), "num_speculative_tokens": 3},
                   max_num_seqs=4)
    heads = llm.proposer.heads
    assert heads.token_input and heads.token_proj.weight.abs().sum() > 0  # training moved the map
    drafts = record_drafts(llm)
    llm.generate(PROMPTS, GREEDY)
    prefill = PrefillHidden(target, (-1,))
    checked = 0
    for rows, live in drafts:
        for toks, got in zip(rows, live.tolist()):
            if len(toks) < 2:  # a one-token prompt: no state yet, nothing drafted
                assert got == [-1] * 3
                continue
            x = prefill(toks[:-1])[-1][-1]
            with torch.inference_mode():
                z = heads.features(x, torch.tensor(toks[-1]))
                want = [int(heads.logits(i, z).argmax()) for i in range(3)]
            assert got == want
            checked += 1
    assert checked > 10


@pytest.mark.parametrize("tree", [None, {"tree_topk": 2, "tree_depth": 3, "num_draft_tokens": 7}],
                         ids=["chain", "tree"])
@pytest.mark.parametrize("kind", ["token_trained", "seq_trained"], ids=["token-aware", "sequential"])
def test_token_aware_drafts_from_the_verdict_change_nothing(target, request, kind, tree):
    """Drafted from the device verdict (the new last token gathered there), the chains and
    trees of token-aware and sequential heads equal those of a run without overlap, and
    outputs plain decoding's."""
    spec = {"method": "medusa", "model": str(request.getfixturevalue(kind)), **(tree or {"num_speculative_tokens": 3})}
    _, loop = assert_overlap_changes_nothing(make_llm, target, spec, PROMPTS,
                                             SamplingParams(temperature=0, max_tokens=28, ignore_eos=True))
    assert loop.drafted_from_verdict > 10, loop.drafted_from_verdict


def test_token_aware_heads_grow_from_medusa_1_heads(target, trained, token_trained, parts, tmp_path, capsys):
    """--token-input --init-from Medusa-1 heads: a zero token map, so at a learning rate of 0 the
    exported heads give the checkpoint's logits; a token-aware checkpoint without --token-input
    is refused (its map would be dropped silently)."""
    out = train_tiny("medusa", target, tmp_path / "tok", steps=2, num_prompts=16, max_tokens=16,
                     extra=("--num-heads", "3", "--token-input", "--init-from", str(trained), "--lr", "0",
                            "--save-dtype", "float32"))
    after = read_weights(out)
    assert not after["token_proj.weight"].any()
    old, new = load_medusa(trained, parts), load_medusa(out, parts)
    assert new.token_input and not old.token_input
    h, tok = torch.randn(5, parts.hidden_size), torch.arange(5)
    for i in range(3):
        torch.testing.assert_close(new.logits(i, new.features(h, tok)), old.logits(i, h))
    with pytest.raises(RuntimeError):
        train_tiny("medusa", target, tmp_path / "drop", steps=2, num_prompts=16, max_tokens=16,
                   extra=("--num-heads", "3", "--init-from", str(token_trained)))
    assert "token-aware (speculum_token_input); give --token-input" in capsys.readouterr().err


# ------------------------------------------------------------------ sequential heads
@pytest.fixture(scope="module")
def seq_trained(target, tmp_path_factory):
    return train_tiny("medusa", target, tmp_path_factory.mktemp("train_seq"), extra=("--num-heads", "3", "--sequential"))


def random_seq_heads(parts, seed=0) -> MedusaHeads:
    heads = MedusaHeads(parts.hidden_size, parts.vocab_size, 3, 2, lm_head=parts.lm_head, embed=parts.embed,
                        sequential=True)
    torch.manual_seed(seed)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return heads


def test_sequential_heads_round_trip_and_read_the_drafted_tokens(parts, tmp_path):
    heads = random_seq_heads(parts)
    save_medusa(heads, tmp_path / "m", base_model="tiny")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["speculum_sequential"] is True and cfg["speculum_token_input"] is True
    assert {"seq_proj.0.weight", "seq_proj.1.weight"} <= set(read_weights(tmp_path / "m"))
    loaded = load_medusa(tmp_path / "m", parts)
    assert loaded.sequential
    h, tok, d0 = torch.randn(4, parts.hidden_size), torch.tensor([1, 2, 3, 4]), torch.tensor([9, 8, 7, 6])
    x = loaded.features(h, tok)
    assert torch.equal(loaded.advance(0, x, d0), heads.advance(0, heads.features(h, tok), d0))
    # the drafted token matters to the next head; head 0's features do not depend on it
    assert not torch.equal(loaded.advance(0, x, d0), loaded.advance(0, x, d0 + 1))
    assert torch.equal(random_heads(parts, own=False).advance(0, h, d0), h)  # Medusa-1 heads ignore it
    # teacher forcing: head i's features at t read the true tokens after t's, as a drafting loop
    # fed those tokens computes them
    seq = torch.randint(0, parts.vocab_size, (7,))
    xs = loaded.features(torch.randn(7, parts.hidden_size), seq)
    forced = list(loaded.teacher_forced(xs, seq, 3))
    assert len(forced) == 3 and all(f.shape == xs.shape for f in forced)
    for t in range(4):
        z = xs[t]
        for i in range(3):
            torch.testing.assert_close(forced[i][t], z)
            z = loaded.advance(i, z, seq[t + i + 1]) if i < 2 else z
    weights = read_weights(tmp_path / "m")
    del weights["seq_proj.1.weight"]
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp_path / "m" / "medusa_lm_head.safetensors"))
    with pytest.raises(ConfigError, match=r"missing \['seq_proj.1.weight'\]"):
        load_medusa(tmp_path / "m", parts)


def test_sequential_chains_read_each_draft_before_them(target, seq_trained):
    """Each chain equals a loop computed here from a fresh prefill: head 0 on (the state that
    produced the last token, that token), each next head on the features advanced by the
    draft before it. Drafting every head from head 0's features (the Medusa-1 way, the
    wrong variant) differs from the proposer's chains: the maps are trained, not zero."""
    llm = make_llm(target, {"method": "medusa", "model": str(seq_trained), "num_speculative_tokens": 3},
                   max_num_seqs=4)
    heads = llm.proposer.heads
    assert heads.sequential and all(lin.weight.abs().sum() > 0 for lin in heads.seq_proj)
    drafts = record_drafts(llm)
    llm.generate(PROMPTS, GREEDY)
    prefill = PrefillHidden(target, (-1,))
    checked = differs = 0
    for rows, live in drafts:
        for toks, got in zip(rows, live.tolist()):
            if len(toks) < 2:
                continue
            with torch.inference_mode():
                z0 = heads.features(prefill(toks[:-1])[-1][-1], torch.tensor(toks[-1]))
                z, want = z0, []
                for i in range(3):
                    want.append(int(heads.logits(i, z).argmax()))
                    z = heads.advance(i, z, torch.tensor(want[-1])) if i < 2 else z
                wrong = [int(heads.logits(i, z0).argmax()) for i in range(3)]
            assert got == want
            checked += 1
            differs += wrong != want
    assert checked > 10 and differs > 0, (checked, differs)


@pytest.mark.parametrize("tree", ["dynamic", "static"])
def test_sequential_tree_nodes_are_top_k_given_their_path(target, seq_trained, tree):
    """Each tree node's children are the top-k of the head of its depth on the features of
    its own path (computed here by a loop over the path's tokens), for every node."""
    llm = make_llm(target, {"method": "medusa", "model": str(seq_trained), **TREE_CONFIGS[tree]}, max_num_seqs=4)
    seen = record_trees(llm)
    llm.generate(PROMPTS, GREEDY)
    prefill, heads = PrefillHidden(target, (-1,)), llm.proposer.heads

    def topk_for(tokens):
        with torch.inference_mode():
            z0 = heads.features(prefill(tokens[:-1])[-1][-1], torch.tensor(tokens[-1]))

        def topk(path, width):
            with torch.inference_mode():
                z = z0
                for i, t in enumerate(path):
                    z = heads.advance(i, z, torch.tensor(t))
                lp, ids = topk_logprobs(heads.logits(len(path), z), width)
            return lp.tolist(), ids.tolist()
        return topk

    assert assert_trees_follow_reference(seen, llm.speculative_config.tree, topk_for) > 10


def test_sampled_sequential_drafts_report_the_distribution_given_the_drafts_before(target, seq_trained):
    """A sampled chain's reported distribution at position i is head i's processed
    distribution on the features advanced by the tokens actually drafted before it."""
    llm = make_llm(target, {"method": "medusa", "model": str(seq_trained), "num_speculative_tokens": 3})
    heads, prefill = llm.proposer.heads, PrefillHidden(target, (-1,))
    seen = []
    inner = llm.proposer.propose

    def propose(batch):  # copies: the loop masks drafts past a request's room in place
        d = inner(batch)
        seen.append(([list(s.token_ids) for s in batch.seqs], d.token_ids.clone(), d.probs.clone(), d.lengths))
        return d
    llm.proposer.propose = propose
    llm.generate(PROMPTS[1:3], SamplingParams(temperature=1.0, max_tokens=10, seed=3, ignore_eos=True))
    checked = 0
    for rows, drafted, probs, lengths in seen:
        for b, toks in enumerate(rows):
            if lengths[b] == 0:
                continue
            with torch.inference_mode():
                z = heads.features(prefill(toks[:-1])[-1][-1], torch.tensor(toks[-1]))
                for i in range(3):
                    torch.testing.assert_close(probs[b, i].double(), heads.logits(i, z).softmax(-1).double(),
                                               atol=1e-5, rtol=1e-4)
                    z = heads.advance(i, z, drafted[b, i]) if i < 2 else z
            checked += 1
    assert checked > 5


def test_sequential_heads_grow_from_token_aware_heads(target, token_trained, seq_trained, parts, tmp_path, capsys):
    """--sequential --init-from token-aware heads: zero maps, so at a learning rate of 0 the
    exported heads draft as the checkpoint's; a sequential checkpoint without --sequential
    is refused (its maps would be dropped silently)."""
    out = train_tiny("medusa", target, tmp_path / "seq", steps=2, num_prompts=16, max_tokens=16,
                     extra=("--num-heads", "3", "--sequential", "--init-from", str(token_trained), "--lr", "0",
                            "--save-dtype", "float32"))
    after = read_weights(out)
    assert not after["seq_proj.0.weight"].any() and not after["seq_proj.1.weight"].any()
    old, new = load_medusa(token_trained, parts), load_medusa(out, parts)
    assert new.sequential and not old.sequential
    h, tok, d = torch.randn(5, parts.hidden_size), torch.arange(5), torch.arange(5, 10)
    z_old, z_new = old.features(h, tok), new.features(h, tok)
    for i in range(3):
        torch.testing.assert_close(new.logits(i, z_new), old.logits(i, z_old))
        z_new = new.advance(i, z_new, d) if i < 2 else z_new
    with pytest.raises(RuntimeError):
        train_tiny("medusa", target, tmp_path / "drop", steps=2, num_prompts=16, max_tokens=16,
                   extra=("--num-heads", "3", "--token-input", "--init-from", str(seq_trained)))
    assert "sequential (speculum_sequential); give --sequential" in capsys.readouterr().err
