"""Tests of the MTP plugin on tiny models: DeepSeek-V3 layout, MTP inside a target checkpoint,
concatenation order, detection, errors, losslessness and KV rollback."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from speculum import SamplingParams
from speculum.backends.torch.heads import ChainHeadProposer, TargetParts, arch_from_config, init_layer
from speculum.errors import ConfigError
from speculum.proposers.head_checkpoint import read_weights
from speculum.testing import (make_llm, TOKEN_PROMPTS as PROMPTS, TREE_CONFIGS, HeadPathReference,
                              assert_drafts_equal_fresh_prefills, assert_static_draft_matches_eager,
                              assert_tree_greedy_lossless, assert_tree_greedy_lossless_under_preemption,
                              assert_trees_follow_reference, record_trees, tiny_model_dir, train_tiny,
                              assert_training_starts_from)
from speculum_mtp import MTPHead
from speculum_mtp.formats import detect, load_mtp, mtp_state, save_mtp

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")
#: a KV budget that forces preemption with trees: 20 blocks of the target's cache and the head's (bytes per token)
KV_TIGHT = 20 * 16 * (512 + 256)


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory):
    return train_tiny("mtp", target, tmp_path_factory.mktemp("train"))


def random_mtp(parts, order="embed_hidden", own_head=False, seed=0) -> MTPHead:
    torch.manual_seed(seed)
    head = MTPHead(arch_from_config(parts.config, num_layers=1), parts.embed, None if own_head else parts.lm_head,
                   order)
    for layer in head.layers:
        init_layer(layer, 0.1)
    for p in (head.eh_proj.weight, head.enorm.weight, head.hnorm.weight, head.head_norm.weight):
        torch.nn.init.normal_(p, std=0.1)
    return head


# ------------------------------------------------------------------ format
def test_round_trip_in_the_deepseek_v3_layout(parts, tmp_path):
    head = random_mtp(parts, "hidden_embed")
    save_mtp(head, tmp_path / "m", parts.config)
    sd = read_weights(tmp_path / "m")
    pre = "model.layers.2."  # after the target's 2 layers
    assert {pre + n for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                              "input_layernorm.weight", "self_attn.q_proj.weight", "mlp.down_proj.weight",
                              "post_attention_layernorm.weight")} <= set(sd)
    assert not any("shared_head.head" in n or "embed_tokens" in n for n in sd)  # shared with the target
    assert sd[pre + "eh_proj.weight"].shape == (64, 128)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["speculum_mtp_concat_order"] == "hidden_embed"
    loaded = load_mtp(tmp_path / "m", parts)
    assert loaded.concat_order == "hidden_embed"
    a, b = mtp_state(loaded, 2), mtp_state(head, 2)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_own_shared_head_is_loaded(parts, tmp_path):
    head = random_mtp(parts, own_head=True)
    torch.nn.init.normal_(head.own_head.weight, std=0.1)
    save_mtp(head, tmp_path / "m", parts.config)
    loaded = load_mtp(tmp_path / "m", parts)
    assert loaded.own_head is not None and torch.equal(loaded.own_head.weight, head.own_head.weight)


def test_concat_order_option_changes_the_module(parts, tmp_path):
    head = random_mtp(parts, "embed_hidden")
    save_mtp(head, tmp_path / "m", parts.config)
    a = load_mtp(tmp_path / "m", parts)
    b = load_mtp(tmp_path / "m", parts, concat_order="hidden_embed")
    assert (a.concat_order, b.concat_order) == ("embed_hidden", "hidden_embed")
    feats, toks, pos = torch.randn(1, 3, 64), torch.tensor([[5, 6, 7]]), torch.arange(3).view(1, 3)
    from speculum.backends.torch.heads import TrainContext
    ca, cb = TrainContext(), TrainContext()
    ca.next_step(), cb.next_step()
    assert not torch.allclose(a(feats, toks, pos, ca), b(feats, toks, pos, cb))


@pytest.fixture(scope="module")
def target_with_mtp(target, trained, tmp_path_factory):
    """The tiny target with the trained MTP layer stored inside its own checkpoint."""
    d = tmp_path_factory.mktemp("target_mtp")
    sd = load_file(str(target / "model.safetensors"))
    sd.update(load_file(str(trained / "model.safetensors")))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(d / "model.safetensors"))
    cfg = json.loads((target / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_detection(target, trained):
    assert detect("x", {"num_nextn_predict_layers": 1}) == "mtp"
    assert detect("x", {"num_nextn_predict_layers": 0}) is None
    llm = make_llm(target, {"model": str(trained), "num_speculative_tokens": 2})
    assert llm.speculative_config.method == "mtp"


@pytest.mark.parametrize("runner", ["native", "hf"])
def test_mtp_layers_inside_the_target_checkpoint(target_with_mtp, runner):
    base = make_llm(target_with_mtp, runner=runner, max_num_seqs=4).generate(PROMPTS, GREEDY)
    llm = make_llm(target_with_mtp, {"method": "mtp", "num_speculative_tokens": 3}, runner=runner, max_num_seqs=4)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    assert 0 < llm.metrics.num_accepted_tokens < llm.metrics.num_draft_tokens


# ------------------------------------------------------------------ errors
def test_mismatches_are_config_errors(target, tmp_path):
    other = TargetParts.from_checkpoint(tiny_model_dir(tmp_path / "narrow", "llama", hidden=32))
    save_mtp(random_mtp(other), tmp_path / "narrow_mtp", other.config)
    with pytest.raises(ConfigError, match="hidden size 32, but the target's is 64"):
        make_llm(target, {"model": str(tmp_path / "narrow_mtp"), "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="needs 'model'"):
        make_llm(target, {"method": "mtp", "num_speculative_tokens": 2})  # no MTP in the target, none shipped
    with pytest.raises(ConfigError, match="invalid options for method 'mtp'"):
        make_llm(target, {"method": "mtp", "model": str(tmp_path / "narrow_mtp"), "num_speculative_tokens": 2,
                          "options": {"concat_order": "sideways"}})


# ------------------------------------------------------------------ losslessness and rollback
@pytest.mark.parametrize("runner", ["native", "hf"])
def test_greedy_output_is_identical_to_no_speculation(target, trained, runner):
    base = make_llm(target, runner=runner, max_num_seqs=4).generate(PROMPTS, GREEDY)
    llm = make_llm(target, {"method": "mtp", "model": str(trained), "num_speculative_tokens": 4},
                   runner=runner, max_num_seqs=2)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    assert 0 < llm.metrics.num_accepted_tokens < llm.metrics.num_draft_tokens


def test_rolled_back_cache_drafts_like_a_fresh_prefill(target, trained):
    llm = make_llm(target, {"method": "mtp", "model": str(trained), "num_speculative_tokens": 3}, max_num_seqs=4)
    p = llm.proposer
    fresh = ChainHeadProposer(p.head, p.hidden_layers, type(p.cache)("fresh", 1, p.head.num_kv_heads,
                                                                     p.head.head_dim, torch.float32, "cpu", 256))
    assert_drafts_equal_fresh_prefills(llm, target, fresh, PROMPTS, GREEDY, 3, p.hidden_layers)


def test_static_draft_function_drafts_like_the_eager_loop(target, trained):
    """The static-shape greedy draft (replayed as a CUDA graph on a GPU) drafts exactly what
    the eager loop drafts, in a batch whose rows accept different numbers of tokens."""
    assert_static_draft_matches_eager(lambda spec: make_llm(target, spec, max_num_seqs=4),
                                      {"method": "mtp", "model": str(trained), "num_speculative_tokens": 3},
                                      PROMPTS, GREEDY)


# ------------------------------------------------------------------ token trees
@pytest.mark.parametrize("runner", ["native", "hf"])
@pytest.mark.parametrize("max_num_seqs", [2, 4], ids=["joins-mid-flight", "all-at-once"])
@pytest.mark.parametrize("tree", ["dynamic", "static"])
def test_tree_greedy_output_is_identical_to_no_speculation(target, trained, runner, tree, max_num_seqs):
    spec = {"method": "mtp", "model": str(trained), **TREE_CONFIGS[tree]}
    assert_tree_greedy_lossless(lambda sp, **kw: make_llm(target, sp, runner=runner, **kw), spec, PROMPTS, GREEDY,
                                max_num_seqs=max_num_seqs)


def test_tree_greedy_lossless_under_preemption(target, trained):
    spec = {"method": "mtp", "model": str(trained), **TREE_CONFIGS["dynamic"]}
    # target 2 layers + module 1 layer, K and V, 2 heads x 16 dims, fp32: 768 bytes per token
    assert_tree_greedy_lossless_under_preemption(target, spec, 768)


@pytest.mark.parametrize("tree", ["dynamic", "static"])
def test_tree_drafts_follow_the_module_along_every_path(target, trained, tree):
    llm = make_llm(target, {"method": "mtp", "model": str(trained), **TREE_CONFIGS[tree]}, max_num_seqs=4)
    seen = record_trees(llm)
    llm.generate(PROMPTS, GREEDY)
    ref = HeadPathReference(llm.proposer.head, target, llm.proposer.hidden_layers)
    assert assert_trees_follow_reference(seen, llm.speculative_config.tree, ref.topk_fn) > 10


def test_training_starts_from_a_checkpoint(target, trained, tmp_path):
    """--init-from: a run with a learning rate of 0 exports the checkpoint it started from."""
    assert_training_starts_from("mtp", target, trained, tmp_path / "again", ())


#: an MTP chain (drafted by the static function, as a GPU does: ``use_static_chain_drafts``) and a tree
FROM_VERDICT = {"chain": {"num_speculative_tokens": 3},
                "tree": {"tree_topk": 3, "tree_depth": 3, "num_draft_tokens": 8}}


@pytest.mark.parametrize("forward", [False, True], ids=["", "forward"])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_mtp_drafts_made_from_the_device_verdict_change_nothing(target, trained, shape, forward):
    """Overlapped greedy steps (forced on: a CPU engine does not overlap) with an MTP head
    drafting chains or token trees: each next draft starts from the verdict still on the
    device (``VerdictDrafter``), is settled by observe, taken by the plan ahead or rewound
    when an abort or a join changes the batch. With ``forward`` the next verify forward is
    launched from the verdict as well (``from_verdict: "forward"``: the runner moves
    a tree's accepted path into place and places each row's tokens from its accepted count).
    Outputs equal plain decoding, and every verified draft and acceptance equal a run
    without overlap on the same schedule."""
    from speculum.testing import assert_overlap_changes_nothing, use_static_chain_drafts
    spec = {"method": "mtp", "model": str(trained), "from_verdict": "forward" if forward else "draft",
            **FROM_VERDICT[shape]}
    prompts = [{"prompt_token_ids": [3 + i, 17, 29, 41, 3 + i, 17]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)

    def build(target, spec=None, **kw):
        llm = make_llm(target, spec, **kw)
        if spec is not None:
            if shape == "chain":
                use_static_chain_drafts(llm)
            assert llm.loop.forward_from_verdict == forward  # the config's; used only where the loop overlaps
        return llm

    _, loop = assert_overlap_changes_nothing(build, target, spec, prompts, params)
    assert loop.drafted_from_verdict > 10, loop.drafted_from_verdict
    if forward:
        assert loop.forwards_from_verdict > 10 and loop.drafted_from_verdict >= loop.forwards_from_verdict
    else:
        assert loop.forwards_from_verdict == 0


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_a_failing_forward_from_the_verdict_is_turned_off(target, trained, shape):
    """A runner whose forward from the verdict raises: the feature is off from then on and the
    engine serves on. After a chain verify nothing was moved, so no request fails; after a
    tree verify the path's K/V may have moved already, so that step's requests finish with
    an error rather than risk a second move. Every other output equals plain decoding."""
    from speculum.testing import use_static_chain_drafts
    spec = {"method": "mtp", "model": str(trained), **FROM_VERDICT[shape]}
    prompts = [{"prompt_token_ids": [3 + i, 17, 29, 41, 3 + i, 17]} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = make_llm(target, spec, max_num_seqs=4)
    if shape == "chain":
        use_static_chain_drafts(llm)
    llm.loop.overlap = llm.loop.forward_from_verdict = True
    calls = []

    def boom(*a, **kw):
        calls.append(1)
        raise RuntimeError("boom")

    llm.loop.target.forward_from_verdict = boom
    outs = llm.generate(prompts, params)
    plain = [o.outputs[0].token_ids for o in make_llm(target).generate(prompts, params)]
    assert calls == [1] and not llm.loop.forward_from_verdict
    failed = [o.outputs[0].finish_reason == "error" for o in outs]
    if shape == "tree":  # the step's three rows
        assert all(failed) and all("launched from the verdict failed" in o.error for o in outs)
    else:  # drafting from the verdict goes on
        assert not any(failed) and llm.loop.drafted_from_verdict > 5
        assert [o.outputs[0].token_ids for o in outs] == plain


@pytest.mark.parametrize("shape", ["chain", "tree", "chain+forward", "tree+forward"])
def test_mtp_drafts_made_from_the_verdict_under_preemption(target, trained, shape):
    """The same with a KV budget that forces preemption (rows leave and come back while
    their drafts, and with "+forward" the chain's next verify forward, are made from the
    verdict): outputs equal plain decoding."""
    from speculum.testing import assert_drafts_from_verdict_under_preemption
    spec = {"method": "mtp", "model": str(trained), **FROM_VERDICT[shape.split("+")[0]]}
    assert_drafts_from_verdict_under_preemption(target, spec, KV_TIGHT, forward_from_verdict="+" in shape)


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_from_verdict_off_drafts_after_the_copy(target, trained, shape):
    """``from_verdict: "off"`` (a benchmark's "before"): with overlap forced on, no draft and
    no forward starts from the device verdict, and the outputs still equal plain decoding."""
    spec = {"method": "mtp", "model": str(trained), "from_verdict": "off", **FROM_VERDICT[shape]}
    prompts = [{"prompt_token_ids": [3 + i, 17, 29, 41, 3 + i, 17]} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = make_llm(target, spec, max_num_seqs=4)
    llm.loop.overlap = True
    assert not llm.loop.from_verdict and not llm.loop.forward_from_verdict
    outs = llm.generate(prompts, params)
    plain = make_llm(target).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert llm.loop.drafted_from_verdict == llm.loop.forwards_from_verdict == 0
    assert llm.metrics.num_accepted_tokens > 0


def test_a_full_head_cache_makes_the_tree_wait_for_the_verdict(target, trained):
    """When the head cache cannot hold the longest outcome (``KVCacheFull`` from the
    drafting from the verdict), that step's tree is drafted after the verdict's copy as
    before: outputs still equal plain decoding, and the other steps still draft early."""
    from speculum.interfaces import KVCacheFull
    spec = {"method": "mtp", "model": str(trained), "tree_topk": 3, "tree_depth": 3, "num_draft_tokens": 8}
    prompts = [{"prompt_token_ids": [3 + i, 17, 29, 41, 3 + i, 17]} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = make_llm(target, spec, max_num_seqs=4)
    llm.loop.overlap = True
    graphs, calls = llm.proposer.graphs, []
    inner = graphs.run_from_device

    def every_other(seq_ids, bases, *a):
        calls.append(1)
        if len(calls) % 2:
            for sid, base in zip(seq_ids, bases):  # as a full allocator leaves them: cut back to the base
                graphs.cache.allocator.truncate(sid, base)
            raise KVCacheFull("no room (test)")
        return inner(seq_ids, bases, *a)
    graphs.run_from_device = every_other
    outs = llm.generate(prompts, params)
    plain = make_llm(target).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert len(calls) > 4 and llm.loop.drafted_from_verdict == len(calls) // 2 and llm.loop.from_verdict
    assert llm.metrics.num_accepted_tokens > 0


# ------------------------------------------------------------------ modules of more than one decoder layer
def test_two_layer_module_round_trip_and_its_format_checks(parts, tmp_path):
    """A module of two decoder layers (speculum's extension): the first where DeepSeek-V3 keeps
    it, the second under ``model.layers.{N}.layers.1.``, the config saying how many; loaded back
    exactly; a config that disagrees with the weights, or a gap in their numbering, is an error."""
    torch.manual_seed(0)
    head = MTPHead(arch_from_config(parts.config, num_layers=2), parts.embed, parts.lm_head)
    for layer in head.layers:
        init_layer(layer, 0.1)
    save_mtp(head, tmp_path / "m", parts.config)
    sd = read_weights(tmp_path / "m")
    assert "model.layers.2.self_attn.q_proj.weight" in sd and "model.layers.2.layers.1.self_attn.q_proj.weight" in sd
    assert "model.layers.2.layers.1.input_layernorm.weight" in sd and not any(".layers.2.layers.2." in n for n in sd)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["speculum_mtp_num_layers"] == 2 and cfg["num_nextn_predict_layers"] == 1
    loaded = load_mtp(tmp_path / "m", parts)
    assert loaded.num_layers == 2
    a, b = mtp_state(loaded, 2), mtp_state(head, 2)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    # a one-layer module writes no key (DeepSeek-V3's layout exactly)
    save_mtp(random_mtp(parts), tmp_path / "one", parts.config)
    assert "speculum_mtp_num_layers" not in json.loads((tmp_path / "one" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "speculum_mtp_num_layers": 3}))
    with pytest.raises(ConfigError, match="speculum_mtp_num_layers=3, the weights hold 2"):
        load_mtp(tmp_path / "m", parts)
    (tmp_path / "m" / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "speculum_mtp_num_layers"}))
    gap = {k.replace(".layers.1.", ".layers.2."): v for k, v in sd.items()}
    save_file({k: v.contiguous() for k, v in gap.items()}, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"numbered \[2\]"):
        load_mtp(tmp_path / "m", parts)


def test_two_layer_module_trains_loads_and_is_lossless(target, tmp_path):
    out = train_tiny("mtp", target, tmp_path, steps=20, num_prompts=16, max_tokens=16, extra=("--num-layers", "2"))
    assert json.loads((out / "config.json").read_text())["speculum_mtp_num_layers"] == 2
    base = [o.token_ids for o in make_llm(target, max_num_seqs=4).generate(PROMPTS, GREEDY)]
    for spec in ({"num_speculative_tokens": 3}, {"tree_topk": 3, "tree_depth": 3, "num_draft_tokens": 8}):
        llm = make_llm(target, {"method": "mtp", "model": str(out), **spec}, max_num_seqs=2)
        assert llm.proposer.head.num_layers == 2
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == base
        assert llm.metrics.num_draft_tokens > 0


def test_module_grows_a_layer_that_starts_as_the_identity(target, trained, tmp_path, capsys):
    """--init-from a one-layer module with --num-layers 2: everything of the module is copied and
    the new layer's output projections are zero, so at --lr 0 the two-layer module drafts exactly
    the tokens the one-layer one drafted. The wrong variant (the new layer's output projections
    random) drafts other tokens, so the comparison has power. Shrinking is refused."""
    from speculum.testing import assert_grown_head_drafts_as_before
    out = train_tiny("mtp", target, tmp_path / "grown", steps=2, num_prompts=16, max_tokens=16,
                     extra=("--init-from", str(trained), "--num-layers", "2", "--lr", "0", "--save-dtype", "float32"))
    new = "model.layers.2.layers.1."
    plain = [o.token_ids for o in make_llm(target).generate(PROMPTS, GREEDY)]
    base, grown = assert_grown_head_drafts_as_before(
        lambda spec: make_llm(target, spec), {"method": "mtp", "num_speculative_tokens": 3}, trained, out,
        [new + "self_attn.o_proj.weight", new + "mlp.down_proj.weight"], PROMPTS, GREEDY, plain, tmp_path)
    assert (base.proposer.head.num_layers, grown.proposer.head.num_layers) == (1, 2)
    with pytest.raises(RuntimeError):  # the CLI prints the ConfigError and exits 1
        train_tiny("mtp", target, tmp_path / "narrow", steps=1, num_prompts=16, max_tokens=16,
                   extra=("--init-from", str(out), "--num-layers", "1"))
    err = capsys.readouterr().err
    assert "the module has 2 layers, --num-layers asks for 1" in err and "give --num-layers 2" in err
