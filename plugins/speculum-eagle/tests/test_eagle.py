"""Tests of the EAGLE plugin on tiny models: formats, detection, errors, losslessness, rollback.

Heads are trained for a few seconds on a tiny random target (``speculum.testing.train_tiny``),
so they agree with the target often but not always: drafts are accepted and rejected,
which is what the rollback and losslessness checks need.
"""

from __future__ import annotations

import json

import pytest
import torch

from speculum import SamplingParams
from speculum.backends.torch.heads import ChainHeadProposer, TargetParts, arch_from_config, init_layer
from speculum.errors import ConfigError
from speculum.interfaces import ProposeBatch, SequenceView
from speculum.proposers.head_checkpoint import read_weights
from speculum.sampling import SamplingBatch
from speculum.testing import (make_llm, TOKEN_PROMPTS as PROMPTS, TREE_CONFIGS, HeadPathReference, PrefillHidden,
                              assert_static_draft_matches_eager, assert_tree_greedy_lossless,
                              assert_tree_greedy_lossless_under_preemption, assert_trees_follow_reference,
                              record_drafts, record_trees, assert_drafting_ahead_changes_nothing,
                              run_with_an_abort_and_a_join, static_output_buffers, tiny_model_dir, train_tiny,
                              assert_training_starts_from)
from speculum_eagle.formats import (default_aux_ids, detect, eagle1_state, eagle3_state, load_eagle1, load_eagle3,
                                    save_eagle1, save_eagle3)
from speculum_eagle.model import Eagle1Head, Eagle3Head

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
RUNNERS = ["native", "hf"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory):
    work = tmp_path_factory.mktemp("train")
    return {"eagle": train_tiny("eagle", target, work), "eagle3": train_tiny("eagle3", target, work,
                                                                           extra=("--draft-vocab", "384"))}


def random_eagle1(parts, seed=0) -> Eagle1Head:
    torch.manual_seed(seed)
    head = Eagle1Head(arch_from_config(parts.config, num_layers=1), parts.embed, parts.lm_head)
    init_layer(head.layers[0], 0.1)
    torch.nn.init.normal_(head.fc.weight, std=0.1)
    torch.nn.init.normal_(head.fc.bias, std=0.1)
    return head


def random_eagle3(parts, seed=0, draft_vocab=200) -> Eagle3Head:
    torch.manual_seed(seed)
    layers = (1, 1, 0)  # aux ids (2, 2, 1) of a 4-layer target
    head = Eagle3Head(arch_from_config(parts.config, num_layers=1), parts.embed, parts.hidden_size, draft_vocab, layers)
    init_layer(head.layer, 0.1)
    for p in (head.fc.weight, head.lm_head.weight, head.norm.weight, head.hidden_norm.weight):
        torch.nn.init.normal_(p, std=0.1)
    head.set_vocab(torch.arange(0, 2 * draft_vocab, 2))
    return head


def same_state(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k].float(), b[k].float()), k


# ------------------------------------------------------------------ formats
def test_eagle1_round_trip_in_the_eagle_layout(parts, tmp_path):
    head = random_eagle1(parts)
    save_eagle1(head, tmp_path / "e1")
    names = set(read_weights(tmp_path / "e1"))
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
            "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight", "layers.0.mlp.gate_proj.weight",
            "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
            "layers.0.post_attention_layernorm.weight"} == names  # no input norm, no embedding, no LM head
    cfg = json.loads((tmp_path / "e1" / "config.json").read_text())
    assert cfg["architectures"] == ["EagleLlamaForCausalLM"] and cfg["hidden_size"] == 64
    same_state(eagle1_state(load_eagle1(tmp_path / "e1", parts)), eagle1_state(head))


def test_eagle1_reads_pytorch_model_bin(parts, tmp_path):
    head = random_eagle1(parts, seed=3)
    save_eagle1(head, tmp_path / "st")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "st" / "config.json").read_text())
    torch.save({k: v.clone() for k, v in eagle1_state(head).items()}, tmp_path / "bin" / "pytorch_model.bin")
    same_state(eagle1_state(load_eagle1(tmp_path / "bin", parts)), eagle1_state(head))


def test_eagle3_round_trip_with_vocabulary_maps(parts, tmp_path):
    head = random_eagle3(parts)
    save_eagle3(head, tmp_path / "e3")
    sd = read_weights(tmp_path / "e3")
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight",
            "midlayer.input_layernorm.weight", "midlayer.self_attn.q_proj.weight"} <= set(sd)
    assert sd["fc.weight"].shape == (64, 3 * 64) and sd["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * 64
    assert sd["t2d"].dtype == torch.bool and int(sd["t2d"].sum()) == 200
    assert torch.equal(torch.arange(200) + sd["d2t"], torch.arange(0, 400, 2))  # target id = draft id + d2t
    cfg = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 200
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 2, 1]
    loaded = load_eagle3(tmp_path / "e3", parts)
    assert loaded.feature_layers == (1, 1, 0)
    same_state(eagle3_state(loaded), eagle3_state(head))
    # logits live on the draft vocabulary only
    logits = loaded.logits(torch.randn(3, 64))
    assert torch.isfinite(logits[:, :400:2]).all() and torch.isinf(logits[:, 1::2]).all()
    assert torch.isinf(logits[:, 400:]).all()


def test_default_aux_layers_follow_vllm():
    assert default_aux_ids(30) == (2, 15, 27)


# ------------------------------------------------------------------ detection
def test_detection_from_config_and_from_weights(parts, tmp_path):
    assert detect("x", {"architectures": ["EagleLlamaForCausalLM"]}) == "eagle"
    assert detect("x", {"architectures": ["LlamaForCausalLMEagle3"]}) == "eagle3"
    assert detect("x", {"architectures": ["LlamaForCausalLM"]}) is None
    save_eagle1(random_eagle1(parts), tmp_path / "e1")
    save_eagle3(random_eagle3(parts), tmp_path / "e3")
    for d in ("e1", "e3"):  # configs without architectures: the weight names decide
        cfg = json.loads((tmp_path / d / "config.json").read_text())
        cfg.pop("architectures")
        (tmp_path / d / "config.json").write_text(json.dumps(cfg))
    assert detect(str(tmp_path / "e1"), {}) == "eagle"
    assert detect(str(tmp_path / "e3"), {}) == "eagle3"


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_engine_detects_the_method_from_the_checkpoint(target, trained, method):
    llm = make_llm(target, {"model": str(trained[method]), "num_speculative_tokens": 2})
    assert llm.speculative_config.method == method
    assert isinstance(llm.proposer, ChainHeadProposer)


# ------------------------------------------------------------------ errors
def test_mismatched_head_is_a_config_error(target, parts, tmp_path):
    other = TargetParts.from_checkpoint(tiny_model_dir(tmp_path / "wide", "llama", hidden=32, num_layers=4))
    save_eagle1(random_eagle1(other), tmp_path / "narrow1")
    save_eagle3(random_eagle3(other), tmp_path / "narrow3")
    with pytest.raises(ConfigError, match="hidden size 32, but the target's is 64"):
        make_llm(target, {"model": str(tmp_path / "narrow1"), "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="hidden size 32, but the target's is 64"):
        make_llm(target, {"model": str(tmp_path / "narrow3"), "num_speculative_tokens": 2})
    small = TargetParts.from_checkpoint(tiny_model_dir(tmp_path / "small", "llama", vocab_size=256, num_layers=4))
    save_eagle1(random_eagle1(small), tmp_path / "smallvocab")
    with pytest.raises(ConfigError, match="vocabulary size 256 differs from the target's 512"):
        make_llm(target, {"model": str(tmp_path / "smallvocab"), "num_speculative_tokens": 2})
    save_eagle3(random_eagle3(parts), tmp_path / "ok3")
    with pytest.raises(ConfigError, match=r"aux hidden-state layer ids \[0, 1, 2\] must be in 1..4"):
        make_llm(target, {"method": "eagle3", "model": str(tmp_path / "ok3"), "num_speculative_tokens": 2,
                          "options": {"aux_hidden_state_layer_ids": [0, 1, 2]}})


def test_no_shipped_head_for_another_target_is_a_config_error(target):
    with pytest.raises(ConfigError, match="needs 'model'.*ships heads only for"):
        make_llm(target, {"method": "eagle", "num_speculative_tokens": 2})


# ------------------------------------------------------------------ losslessness
@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_greedy_output_is_identical_to_no_speculation(target, trained, runner, method):
    base = make_llm(target, runner=runner, max_num_seqs=4).generate(PROMPTS, GREEDY)
    llm = make_llm(target, {"method": method, "model": str(trained[method]), "num_speculative_tokens": 3},
                   runner=runner, max_num_seqs=2)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    m = llm.metrics
    assert 0 < m.num_accepted_tokens < m.num_draft_tokens  # accepted and rejected drafts: rollbacks happened
    # the head's cache joined the memory plan and is empty again
    cache = llm.proposer.cache
    assert cache in llm.backend.caches and cache.allocator in llm.scheduler.caches
    assert cache.allocator.num_free_blocks == cache.allocator.num_usable_blocks


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_rolled_back_head_cache_drafts_like_a_fresh_prefill(target, trained, method):
    """After many accept/reject rounds the head proposes what a fresh one would, given the
    whole sequence at once: its KV cache kept exactly the accepted positions."""
    llm = make_llm(target, {"method": method, "model": str(trained[method]), "num_speculative_tokens": 3},
                   max_num_seqs=4)
    drafts = record_drafts(llm)
    llm.generate(PROMPTS, GREEDY)
    assert 0 < llm.metrics.num_accepted_tokens < llm.metrics.num_draft_tokens
    assert not fresh_mismatches(llm, target, drafts)


def fresh_mismatches(llm, target, drafts) -> list:
    """The recorded drafts (``record_drafts``) that differ from a fresh head's, given each
    sequence's tokens at once (target states by prefill): its steps' drafts, indices."""
    proposer = llm.proposer
    prefill = PrefillHidden(target, proposer.hidden_layers)
    fresh = ChainHeadProposer(proposer.head, proposer.hidden_layers, type(proposer.cache)(
        "fresh", proposer.head.num_layers, proposer.head.num_kv_heads, proposer.head.head_dim, torch.float32,
        "cpu", 256))
    sid, bad = 10_000, []
    for i, (rows, live) in enumerate(drafts):
        views = []
        for toks in rows:
            sid += 1
            views.append(SequenceView(sid, toks, 1))
            fresh.add_request(views[-1], hidden_states=prefill(toks[:-1]))
        sampling = SamplingBatch.from_params([SamplingParams(temperature=0)] * len(rows), [None] * len(rows))
        d = fresh.propose(ProposeBatch(views, 3, sampling))
        if d.token_ids.tolist() != live.tolist():
            bad.append(i)
        for v in views:
            fresh.remove_request(v.seq_id)
    return bad


def test_cache_is_truncated_to_the_accepted_positions(target, trained):
    llm = make_llm(target, {"method": "eagle", "model": str(trained["eagle"]), "num_speculative_tokens": 3})
    for i, p in enumerate(PROMPTS):
        llm.add_request(f"r{i}", p, GREEDY)
    while llm.has_unfinished_requests():
        llm.step()
        for s in llm.scheduler.running:
            # true-feature positions only: everything but the last accepted run + new token
            assert llm.proposer.cache.length(s.seq_id) + llm.proposer.pending[s.seq_id].shape[0] == len(s.token_ids) - 1


# ------------------------------------------------------------------ sampling
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_sampled_drafts_come_with_their_distribution(target, trained, method):
    llm = make_llm(target, {"method": method, "model": str(trained[method]), "num_speculative_tokens": 3})
    seen = []
    inner = llm.proposer.propose
    llm.proposer.propose = lambda b: seen.append(inner(b)) or seen[-1]
    outs = llm.generate(PROMPTS[1:3], SamplingParams(temperature=0.8, max_tokens=12, seed=1, ignore_eos=True))
    assert all(len(o.token_ids) == 12 for o in outs)
    for d in seen:
        rows = d.token_ids[:, 0] >= 0
        assert d.probs.shape == (*d.token_ids.shape, 512)
        p = d.probs[rows]
        assert torch.allclose(p.sum(-1), torch.ones(p.shape[:2]), atol=1e-5)
        ids = d.token_ids[rows]  # the loop masks drafts past max_tokens with -1
        assert bool((p.gather(-1, ids.clamp_min(0).unsqueeze(-1)).squeeze(-1)[ids >= 0] > 0).all())
        if method == "eagle3":  # no mass outside the draft vocabulary
            t2d = llm.proposer.head.t2d
            assert float(p[..., ~t2d].sum()) == 0.0


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_static_draft_function_drafts_like_the_eager_loop(target, trained, method):
    """The static-shape greedy draft (replayed as a CUDA graph on a GPU) drafts exactly what
    the eager loop drafts, in a batch whose rows accept different numbers of tokens."""
    assert_static_draft_matches_eager(lambda spec: make_llm(target, spec, max_num_seqs=4),
                                      {"method": method, "model": str(trained[method]), "num_speculative_tokens": 3},
                                      PROMPTS, GREEDY)


def test_two_layer_eagle_head_trains_loads_and_is_lossless(target, tmp_path):
    out = train_tiny("eagle", target, tmp_path, steps=20, num_prompts=16, max_tokens=16, extra=("--num-layers", "2"))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2
    llm = make_llm(target, {"method": "eagle", "model": str(out), "num_speculative_tokens": 3})
    assert llm.proposer.head.num_layers == 2
    base = make_llm(target).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [b.token_ids for b in base]


# ------------------------------------------------------------------ token trees
@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("max_num_seqs", [2, 4], ids=["joins-mid-flight", "all-at-once"])
@pytest.mark.parametrize("tree", ["dynamic", "static", "chain"])
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_tree_greedy_output_is_identical_to_no_speculation(target, trained, runner, method, tree, max_num_seqs):
    spec = {"method": method, "model": str(trained[method]), **TREE_CONFIGS[tree]}
    llm = assert_tree_greedy_lossless(lambda sp, **kw: make_llm(target, sp, runner=runner, **kw), spec, PROMPTS,
                                      GREEDY, max_num_seqs=max_num_seqs)
    cache = llm.proposer.cache  # the head's tree regions were rolled back with the rest
    assert cache.allocator.num_free_blocks == cache.allocator.num_blocks - 1


@pytest.mark.parametrize("tree", ["dynamic", "static"])
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_tree_greedy_lossless_under_preemption(target, trained, method, tree):
    """A KV budget of ~2.5 sequences for 6 requests: sequences are preempted and
    recomputed; output is still identical."""
    spec = {"method": method, "model": str(trained[method]), **TREE_CONFIGS[tree]}
    # target 4 layers + head 1 layer, K and V, 2 heads x 16 dims, fp32: 1280 bytes per token
    assert_tree_greedy_lossless_under_preemption(target, spec, 1280)


@pytest.mark.parametrize("tree", ["dynamic", "static"])
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_tree_drafts_follow_the_head_along_every_path(target, trained, method, tree):
    """The batched, tree-masked drafting (one head forward per depth, the static function
    a GPU replays as a CUDA graph) drafts the same tree as running the head along each
    path on its own, for static ranks and for EAGLE-2's rerank."""
    spec = {"method": method, "model": str(trained[method]), **TREE_CONFIGS[tree]}
    llm = make_llm(target, spec, max_num_seqs=4)
    seen = record_trees(llm)
    llm.generate(PROMPTS, GREEDY)
    p = llm.proposer
    ref = HeadPathReference(p.head, target, p.hidden_layers)
    assert assert_trees_follow_reference(seen, llm.speculative_config.tree, ref.topk_fn) > 10


def test_sampled_requests_with_trees_are_deterministic_per_seed(target, trained):
    llm = make_llm(target, {"method": "eagle", "model": str(trained["eagle"]), **TREE_CONFIGS["dynamic"]},
                   max_num_seqs=4)

    def run(seed):
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=seed,
                                                    ignore_eos=True))
        assert all(len(o.token_ids) == 20 for o in outs)
        return [o.token_ids for o in outs]

    first = run(3)
    assert run(3) == first and run(4) != first
    assert llm.metrics.num_tree_steps > 0 and llm.metrics.num_accepted_tokens > 0


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("static", [False, True, "tree", "forward", "tree+forward"],
                         ids=["eager", "static-draft", "tree", "forward-from-verdict", "tree-forward-from-verdict"])
def test_drafting_ahead_with_rewinds_drafts_what_a_plain_step_would(target, trained, method, static):
    """Overlapped steps with a head (forced on: a CPU engine does not overlap): each step's
    drafts (a chain or a token tree) and forward are made at the end of the step before,
    after the head observed it.
    An abort and a request joining drop a step drafted ahead, and the head rewinds it.
    Outputs equal plain decoding, and acceptance equals a run without overlap on the same
    schedule: the rewound head drafts exactly as if nothing had been drafted ahead. A head
    that does not rewind (the wrong variant) accepts differently. "forward": the static
    chain (or the tree) with its next verify forward launched from the device verdict too."""
    from speculum.backends.torch.heads import HeadDraftGraphs
    spec = {"method": method, "model": str(trained[method]), "num_speculative_tokens": 3}
    if static in ("tree", "tree+forward"):  # a token tree drafted ahead: its forward goes out with the tree
        spec = {"method": method, "model": str(trained[method]), "tree_topk": 3, "tree_depth": 3,
                "num_draft_tokens": 8}
    prompts = [{"prompt_token_ids": [3 + i, 17, 29, 41, 3 + i, 17]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)

    def build(overlap: bool, rewind: bool = True):
        llm = make_llm(target, spec, max_num_seqs=4)
        llm.loop.overlap = overlap
        p = llm.proposer
        if static in (True, "forward"):
            p.graphs = HeadDraftGraphs(p.head, p.cache, 3, p.dtype, p.device, use_graphs=False)
        llm.loop.forward_from_verdict = static in ("forward", "tree+forward")
        if not rewind:
            p.rewind = lambda seq_ids: None
        return llm

    # an abort drops the step drafted ahead (the batch changes); a join drops it too
    plain = [o.outputs[0].token_ids for o in make_llm(target).generate(prompts, params)]
    off, loop = assert_drafting_ahead_changes_nothing(build, prompts, params, plain)
    if static:  # the static function's chains and trees started from the verdict on the device, settled or rewound
        assert loop.drafted_from_verdict > 10, loop.drafted_from_verdict
        assert (loop.forwards_from_verdict > 10) == (static in ("forward", "tree+forward")), loop.forwards_from_verdict
    else:  # the eager chain loop drafts after the verdict's copy
        assert loop.drafted_from_verdict == 0, loop.drafted_from_verdict
    _, drafts_bad, acc_bad = run_with_an_abort_and_a_join(build(True, rewind=False), prompts, params)
    assert (drafts_bad, acc_bad) != off


def record_observed_states(llm) -> list:
    """Wrap the proposer's ``observe``; returns the list it appends (sequence tokens then,
    first position the states stand for, {layer: [n, H]}) to, per observed row."""
    seen, inner = [], llm.proposer.observe

    def observe(fb):
        running = {s.seq_id: s for s in llm.scheduler.running}
        for b, (sid, a, n) in enumerate(zip(fb.seq_ids, fb.num_accepted, fb.new_lengths)):
            # the states of the step's inputs: the old last token (position n - a - 2) and the accepted drafts
            seen.append((list(running[sid].token_ids), n - a - 2,
                         {l: h[b, : a + 1].clone() for l, h in fb.hidden_states.items()}))
        inner(fb)

    llm.proposer.observe = observe
    return seen


def wrong_states(target, layers, seen) -> list:
    """Indices of the ``record_observed_states`` rows whose states are not the target's at
    those positions (a fresh prefill of the sequence's tokens)."""
    prefill, bad = PrefillHidden(target, layers), []
    for i, (tokens, first, states) in enumerate(seen):
        truth = prefill(tokens[:-1])
        for layer, h in states.items():
            if not torch.allclose(h, truth[layer][first: first + h.shape[0]], atol=1e-4, rtol=1e-4):
                bad.append(i)
                break
    return bad


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_plain_steps_of_a_head_run_ahead_and_the_head_keeps_up(target, trained, method):
    """A schedule that switches drafting off at 3-4 rows (as "auto" does under load): those
    plain steps run the next forward ahead like decoding without speculation, although the
    head still reads each step's hidden states (they join its backlog). The runner reuses
    its output buffers, as CUDA graphs do, so a state read after the forward run ahead would
    be the next step's. Outputs equal plain decoding and a run without overlap; most plain
    steps ran ahead; every state the head observed is the target's at its position (a fresh
    prefill); every step's drafts are a fresh head's given each sequence's tokens at once.
    The wrong variant (the states not copied before the forward run ahead) hands the head
    the next step's states."""
    import speculum.loop as loop_mod
    spec = {"method": method, "model": str(trained[method]), "num_speculative_tokens": 3,
            "num_speculative_tokens_per_batch_size": {"1-2": 3, "3-64": 0}}
    prompts = [{"prompt_token_ids": [3 + i, 17, 29, 41, 3 + i, 17]} for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=8 + 6 * i, ignore_eos=True) for i in range(6)]

    def run(overlap: bool):
        llm = make_llm(target, spec, max_num_seqs=4)
        llm.loop.overlap = overlap
        static_output_buffers(llm.loop.target)
        drafts, states = record_drafts(llm), record_observed_states(llm)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        return outs, drafts, states, llm

    on, drafts, states, llm = run(True)
    assert on == run(False)[0] == [o.outputs[0].token_ids for o in make_llm(target).generate(prompts, params)]
    loop, layers = llm.loop, llm.proposer.hidden_layers
    assert loop.k_counts[0] > 10 and loop.ahead_used >= 0.8 * loop.k_counts[0], (loop.k_counts, loop.ahead_used)
    assert len(drafts) > 10 and llm.stats.num_accepted_tokens > 0
    assert len(states) > 50 and not wrong_states(target, layers, states)
    assert not fresh_mismatches(llm, target, drafts)
    keep = loop_mod._keep_states
    loop_mod._keep_states = lambda out: out
    try:
        bad, _, bad_states, _ = run(True)
    finally:
        loop_mod._keep_states = keep
    assert bad == on  # lossless still (the target verifies), but the head was misled
    assert len(wrong_states(target, layers, bad_states)) > 20


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                                    SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True, seed=3)],
                         ids=["greedy", "seeded"])
def test_batch_invariant_trees_give_plain_decodings_tokens(target, trained, params):
    """EAGLE-3's dynamic tree in batch-invariant mode with exact-match verification: the
    tokens of plain batch-invariant decoding, greedy and seeded (fp32 here; bf16 on the GPU
    in tests/test_batch_invariant_cuda.py), in a batch of 3 with mixed prompt lengths."""
    prompts = [{"prompt_token_ids": [3 + i, 17, 29, 41, 3 + i, 17] * (1 + i)} for i in range(5)]
    base = make_llm(target, batch_invariant=True, max_num_seqs=1)
    ref = [o.outputs[0].token_ids for o in base.generate(prompts, params)]
    llm = make_llm(target, {"method": "eagle3", "model": str(trained["eagle3"]), "tree_topk": 4, "tree_depth": 3,
                            "num_draft_tokens": 10, "acceptance_method": "exact_match"},
                   batch_invariant=True, max_num_seqs=3)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == ref
    assert llm.stats.num_accepted_tokens > 5


# ------------------------------------------------------------------ "ngram+<head>"
def _lookup_then_head(method, trained):
    return {"method": f"ngram+{method}", "model": str(trained[method]), "num_speculative_tokens": 3,
            "prompt_lookup_min": 1}


REPEATS = [{"prompt_token_ids": [3 + i, 17, 29, 41, 3 + i, 17, 29, 41, 3 + i, 17]} for i in range(3)]


def _head_drafts(llm) -> list:
    """(sequence tokens, first draft token) of every row the head drafted for."""
    head, seen = llm.proposer.parts[-1], []
    inner = head.propose

    def propose(batch):
        d = inner(batch)
        seen.extend((list(s.token_ids), int(t)) for s, t in zip(batch.seqs, d.token_ids[:, 0].tolist()) if t >= 0)
        return d

    head.propose = propose
    return seen


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_lookup_then_head_is_lossless_and_the_head_keeps_up(target, trained, method):
    """``"ngram+<head>"``: rows with a lookup match draft by lookup, the others with the
    head. Greedy output equals plain decoding (joins mid-flight), both kinds of draft are
    made and accepted, and every head draft is the head's top token after the sequence's
    tokens computed from scratch (HeadPathReference): the states of tokens that lookup
    drafted and the target accepted reach the head. The wrong variant (a head that keeps
    only the new token's state of a step it did not draft for, as before the composite)
    drafts differently."""
    prompts = PROMPTS + REPEATS

    def run(wrong=False):
        llm = make_llm(target, _lookup_then_head(method, trained), max_num_seqs=3)
        seen = _head_drafts(llm)
        if wrong:
            head = llm.proposer.parts[-1]
            observe = head.observe

            def forgetful(fb):  # rows the head did not draft for: as if nothing was accepted
                idle = [head.pending.get(s) is not None and head.pending[s].shape[0] > 0 for s in fb.seq_ids]
                fb.num_accepted = [0 if i else a for i, a in zip(idle, fb.num_accepted)]
                observe(fb)
            head.observe = forgetful
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        return outs, seen, llm

    outs, seen, llm = run()
    assert outs == [o.outputs[0].token_ids for o in make_llm(target).generate(prompts, GREEDY)]
    assert len(seen) > 20 and llm.stats.num_accepted_tokens > 0
    lookup_rows = llm.stats.num_drafts - len(seen)
    assert lookup_rows > 10, lookup_rows
    ref = HeadPathReference(llm.proposer.parts[-1].head, target, llm.proposer.hidden_layers)
    mismatch = [len(t) for t, d in seen if ref.topk_fn(t)([], 1)[1][0] != d]
    assert not mismatch, mismatch
    _, bad, bad_llm = run(wrong=True)
    assert any(ref.topk_fn(t)([], 1)[1][0] != d for t, d in bad)


def test_lookup_then_head_drafts_ahead_and_rewinds(target, trained):
    """With overlap, the composite is rewindable (its head is; lookup has no state): an
    abort and a join drop steps drafted ahead; outputs, drafts and acceptance equal a run
    without overlap."""
    params = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)
    prompts = REPEATS + PROMPTS[:1]

    def build(overlap):
        llm = make_llm(target, _lookup_then_head("eagle3", trained), max_num_seqs=4)
        llm.loop.overlap = overlap
        return llm

    _, loop = assert_drafting_ahead_changes_nothing(build, prompts, params)
    assert loop.rewindable


def test_lookup_then_head_sampled_drafts_carry_their_distribution(target, trained):
    """Sampled requests: lookup rows' drafts are one-hot in the composite's probabilities,
    the head's rows carry the head's distribution; seeded runs repeat."""
    from speculum.proposers.first_draft import FirstDraft
    llm = make_llm(target, _lookup_then_head("eagle3", trained), max_num_seqs=4)
    drafts = []
    inner = FirstDraft.propose

    def spy(self, batch):
        d = inner(self, batch)
        drafts.append(d)
        return d

    llm.proposer.propose = lambda batch: spy(llm.proposer, batch)
    params = SamplingParams(temperature=0.9, max_tokens=24, seed=5, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS + REPEATS, params)]
    assert first == [o.outputs[0].token_ids for o in llm.generate(PROMPTS + REPEATS, params)]
    mixed = [d for d in drafts if d.probs is not None]
    assert mixed
    one_hot = head_rows = 0
    for d in mixed:
        for b in range(d.token_ids.shape[0]):
            n = d.lengths[b]
            for i in range(n):
                if int(d.token_ids[b, i]) < 0:  # masked by the loop afterwards (past the request's room)
                    continue
                p = d.probs[b, i]
                assert float(p.sum()) == pytest.approx(1.0, abs=1e-4) and float(p[d.token_ids[b, i]]) > 0
                if float(p.max()) == 1.0 and int(p.argmax()) == int(d.token_ids[b, i]):
                    one_hot += 1
                else:
                    head_rows += 1
    assert one_hot > 0 and head_rows > 0


@pytest.mark.parametrize("method, error", [
    ("eagle3+ngram", "only the last method may keep per-request state"),
    ("ngram+", "write methods joined by"),
])
def test_lookup_then_head_config_errors(target, trained, method, error):
    with pytest.raises(ConfigError, match=error):
        make_llm(target, {"method": method, "model": str(trained["eagle3"]), "num_speculative_tokens": 3})
    with pytest.raises(ConfigError, match="chains only"):
        cfg = {k: v for k, v in _lookup_then_head("eagle3", trained).items() if k != "num_speculative_tokens"}
        make_llm(target, {**cfg, **TREE_CONFIGS["dynamic"]})


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_training_starts_from_a_checkpoint(target, trained, tmp_path, method, capsys):
    """--init-from: the run starts from the checkpoint's weights (and EAGLE-3's draft
    vocabulary): with a learning rate of 0 it exports them unchanged; a checkpoint whose
    shapes the options do not build is a ConfigError that says what to pass."""
    extra = ("--draft-vocab", "384") if method == "eagle3" else ()
    assert_training_starts_from(method, target, trained[method], tmp_path / "again", extra)
    if method == "eagle":
        wrong = tmp_path / "wrong"  # a 1-layer head read as a 2-layer one by a plain load: the error
        wrong.mkdir()
        cfg = json.loads((trained[method] / "config.json").read_text())
        (wrong / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 2}))
        sd = {k: v for k, v in read_weights(trained[method]).items()}
        sd.update({k.replace("layers.0.", "layers.1."): v.clone() for k, v in sd.items() if k.startswith("layers.0.")})
        sd["layers.1.input_layernorm.weight"] = torch.ones_like(sd["layers.1.post_attention_layernorm.weight"])
        from safetensors.torch import save_file
        save_file(sd, str(wrong / "model.safetensors"))
        with pytest.raises(RuntimeError):  # the CLI prints the ConfigError and exits 1
            train_tiny(method, target, tmp_path / "narrow", steps=1, num_prompts=16, max_tokens=16,
                       extra=("--init-from", str(wrong), "--num-layers", "1"))
        err = capsys.readouterr().err
        assert "the head has 2 layers, --num-layers asks for 1" in err and "give --num-layers 2" in err


def test_eagle_head_grows_a_layer_that_starts_as_the_identity(target, trained, tmp_path):
    """--init-from a 1-layer EAGLE head with --num-layers 2: its fc and layer are copied, the new
    layer's output projections are zero, so at --lr 0 the exported 2-layer head drafts exactly
    the tokens the 1-layer one drafted (and is lossless). The wrong variant, a new layer with
    random output projections, drafts differently (so the comparison has power)."""
    from speculum.testing import assert_grown_head_drafts_as_before
    one = trained["eagle"]
    out = train_tiny("eagle", target, tmp_path / "grown", steps=2, num_prompts=16, max_tokens=16,
                     extra=("--init-from", str(one), "--num-layers", "2", "--lr", "0", "--save-dtype", "float32"))
    plain = [o.token_ids for o in make_llm(target).generate(PROMPTS, GREEDY)]
    base, grown = assert_grown_head_drafts_as_before(
        lambda spec: make_llm(target, spec), {"method": "eagle", "num_speculative_tokens": 3}, one, out,
        ["layers.1.self_attn.o_proj.weight", "layers.1.mlp.down_proj.weight"], PROMPTS, GREEDY, plain, tmp_path)
    assert (base.proposer.head.num_layers, grown.proposer.head.num_layers) == (1, 2)
