"""Medusa heads with a prefix layer (after Hydra++'s prefix attention) on tiny models: format,
losslessness in chains and trees, the layer's cache across steps, rewinds, preemption,
training against drafting, growth onto trained heads."""

from __future__ import annotations

import json

import pytest
import torch

from speculum import SamplingParams
from speculum.backends.torch.heads import HeadKVCache, arch_from_config
from speculum.errors import ConfigError
from speculum.interfaces import SequenceView
from speculum.proposers.head_checkpoint import read_weights
from speculum.testing import (make_llm, TOKEN_PROMPTS as PROMPTS, PrefillHidden, assert_drafts_equal_fresh_prefills,
                              assert_overlap_changes_nothing, assert_tree_greedy_lossless_under_preemption,
                              train_tiny)
from speculum_medusa import MedusaHeads, MedusaProposer
from speculum_medusa.formats import load_medusa, medusa_state, save_medusa

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
CHAIN = {"num_speculative_tokens": 3}
TREE = {"tree_topk": 3, "tree_depth": 3, "num_draft_tokens": 8}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def seq_trained(target, tmp_path_factory):
    return train_tiny("medusa", target, tmp_path_factory.mktemp("seq"), extra=("--num-heads", "3", "--sequential"))


@pytest.fixture(scope="module")
def prefixed(target, tmp_path_factory):
    """Sequential heads with a prefix layer, trained from scratch."""
    return train_tiny("medusa", target, tmp_path_factory.mktemp("prefix"),
                      extra=("--num-heads", "3", "--sequential", "--prefix-layer"))


def plain(target, prompts=PROMPTS, params=GREEDY):
    return [o.token_ids for o in make_llm(target, max_num_seqs=4).generate(prompts, params)]


def fresh_proposer(heads) -> MedusaProposer:
    a = heads.prefix_arch
    cache = HeadKVCache("medusa", 1, a.num_kv_heads, a.head_dim, torch.float32, "cpu", max_model_len=512)
    return MedusaProposer(heads, cache=cache)


# ------------------------------------------------------------------ format
def test_prefix_heads_round_trip_and_their_format_checks(parts, tmp_path):
    torch.manual_seed(0)
    heads = MedusaHeads(parts.hidden_size, parts.vocab_size, 3, 1, lm_head=parts.lm_head, embed=parts.embed,
                        sequential=True, prefix=arch_from_config(parts.config, num_layers=1))
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.1)
    save_medusa(heads, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    shape = cfg["speculum_prefix_layer"]
    assert shape["num_attention_heads"] == parts.config["num_attention_heads"]
    assert shape["intermediate_size"] == parts.config["intermediate_size"]
    sd = read_weights(tmp_path / "m")
    assert {"prefix.input_layernorm.weight", "prefix.self_attn.q_proj.weight", "prefix.mlp.down_proj.weight"} <= set(sd)
    loaded = load_medusa(tmp_path / "m", parts)
    assert loaded.prefixed and loaded.sequential
    a, b = medusa_state(loaded), medusa_state(heads)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    (tmp_path / "m" / "config.json").write_text(json.dumps({k: v for k, v in cfg.items()
                                                            if k != "speculum_prefix_layer"}))
    with pytest.raises(ConfigError, match="prefix layer .* no speculum_prefix_layer"):
        load_medusa(tmp_path / "m", parts)


# ------------------------------------------------------------------ drafting
@pytest.mark.parametrize("runner", ["native", "hf"])
@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
def test_prefix_greedy_output_is_identical_to_no_speculation(target, prefixed, runner, spec):
    llm = make_llm(target, {"method": "medusa", "model": str(prefixed), **spec}, runner=runner, max_num_seqs=2)
    assert llm.proposer.prefix is not None
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain(target)
    assert 0 < llm.metrics.num_accepted_tokens < llm.metrics.num_draft_tokens


def test_drafts_read_the_layer_over_the_whole_sequence(target, prefixed):
    """After any number of steps (the layer's cache fed a prefill, then each step's accepted
    states, rows joining mid-flight) the drafts equal those of a fresh proposer that feeds the
    layer the whole sequence at once."""
    llm = make_llm(target, {"method": "medusa", "model": str(prefixed), **CHAIN}, max_num_seqs=2)
    assert_drafts_equal_fresh_prefills(llm, target, fresh_proposer(llm.proposer.heads), PROMPTS, GREEDY, 3)


def test_the_layer_in_training_computes_what_drafting_reads(target, prefixed, parts):
    """The trainer's pass (``MedusaHeads.sequence_features``: causal attention over the whole
    sequence) gives, at every position, the output the drafting cache gives when the sequence
    arrives in pieces."""
    heads = load_medusa(prefixed, parts)
    tokens = [30, 31, 32, 30, 31, 32, 30, 11, 12, 13, 40, 41]
    h = PrefillHidden(target, (-1,))(tokens)[-1]  # [T, H]
    T = len(tokens) - 1
    nxt = torch.tensor(tokens[1:]).view(1, T)
    with torch.no_grad():  # what training and scripts/medusa_tree.py read
        want = heads.sequence_features(h[:T].view(1, T, -1), nxt)[0]

    def in_pieces(forget: bool) -> torch.Tensor:
        """``forget``: the wrong variant, a fresh cache for every piece (the context dropped)."""
        states, got, fed = fresh_proposer(heads).prefix, [], 0
        for cut in (4, 5, 9, T):  # a prefill, then steps accepting 0, 3 and 1 drafts
            if forget and fed:
                states = fresh_proposer(heads).prefix
                states.cache.add(7)
                states.cache.prepare([7], [fed], fed)  # the positions, at zero K/V
                states.z[7], states.pending[7] = None, h[fed:cut]
            else:
                states.add(7, h[:cut]) if fed == 0 else states.observe(7, h[fed:cut])
            rows, z = states.catch_up([SequenceView(7, tokens[: cut + 1], 1)])
            got.append(z[0])
            fed = cut
        return torch.stack(got)

    torch.testing.assert_close(in_pieces(False), want[[3, 4, 8, T - 1]], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(in_pieces(True)[1:], want[[4, 8, T - 1]], atol=1e-3)


@pytest.mark.parametrize("forward", [False, True], ids=["", "forward-from-verdict"])
@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
def test_prefix_drafts_from_the_verdict_and_rewinds_change_nothing(target, prefixed, spec, forward):
    """Overlapped steps (forced on): each next chain or tree starts from the verdict still on the
    device (the layer fed every verify column with the verdict's tokens, its output gathered at
    the accepted count; observe then cuts its cache to the accepted positions), is drafted ahead,
    and an abort or a join drops that step (a feed never observed is cut back; what a propose fed
    stays true). With ``forward`` the next verify forward starts from the verdict too. Outputs
    equal plain decoding, drafts and acceptance equal a run without overlap."""
    spec = {"method": "medusa", "model": str(prefixed), **spec}
    params = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)

    def build(target, spec=None, **kw):
        llm = make_llm(target, spec, **kw)
        llm.loop.forward_from_verdict = forward and spec is not None
        return llm

    _, loop = assert_overlap_changes_nothing(build, target, spec, PROMPTS, params)
    assert loop.rewindable and loop.drafted_from_verdict > 10, loop.drafted_from_verdict
    assert (loop.forwards_from_verdict > 10) == forward


def test_a_feed_from_the_verdict_kept_whole_drafts_differently(target, prefixed, monkeypatch):
    """The wrong variant: a settle that keeps every fed column in the layer's cache (the rejected
    ones too) drafts other tokens than a run without overlap, though outputs stay lossless: the
    equality above has power over the cut."""
    from speculum.testing import run_with_an_abort_and_a_join
    from speculum_medusa.prefix import PrefixStates
    spec = {"method": "medusa", "model": str(prefixed), **CHAIN}
    params = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)

    def run(overlap: bool):
        llm = make_llm(target, spec, max_num_seqs=4)
        llm.loop.overlap = overlap
        return run_with_an_abort_and_a_join(llm, PROMPTS, params)

    off = run(False)
    inner = PrefixStates.settle
    monkeypatch.setattr(PrefixStates, "settle", lambda self, sid, n, a, z: inner(self, sid, n, 3, z))
    bad = run(True)
    assert bad[0] == off[0] and bad[1:] != off[1:]


def test_prefix_drafts_from_the_verdict_under_preemption(target, prefixed):
    from speculum.testing import assert_drafts_from_verdict_under_preemption
    spec = {"method": "medusa", "model": str(prefixed), **TREE}
    assert_drafts_from_verdict_under_preemption(target, spec, 20 * 16 * (512 + 256))


def test_prefix_tree_lossless_under_preemption(target, prefixed):
    """A KV budget that forces preemption (the target's cache and the layer's, 512 + 256 bytes a
    token): rows leave, come back with a fresh prefill of the layer, and outputs still equal
    plain decoding."""
    spec = {"method": "medusa", "model": str(prefixed), **TREE}
    assert_tree_greedy_lossless_under_preemption(target, spec, 512 + 256)


def test_sampled_prefix_drafts_come_with_their_distribution(target, prefixed):
    llm = make_llm(target, {"method": "medusa", "model": str(prefixed), **CHAIN})
    seen, inner = [], llm.proposer.propose
    llm.proposer.propose = lambda b: seen.append(inner(b)) or seen[-1]
    outs = llm.generate(PROMPTS[1:3], SamplingParams(temperature=0.8, max_tokens=12, seed=1, ignore_eos=True))
    assert all(len(o.token_ids) == 12 for o in outs) and seen
    for d in seen:
        assert torch.allclose(d.probs.sum(-1), torch.ones(d.token_ids.shape), atol=1e-5)


# ------------------------------------------------------------------ growth
def test_a_prefix_layer_grows_onto_trained_heads(target, seq_trained, tmp_path, capsys):
    """--init-from sequential heads with --prefix-layer: the heads are copied and the layer's
    output projections are zero, so at --lr 0 the grown heads draft exactly the tokens the
    checkpoint drafted (and are lossless). The wrong variant (the layer's output projections
    random) drafts other tokens, so the comparison has power. A checkpoint with a prefix layer
    continued without --prefix-layer is refused."""
    from speculum.testing import assert_grown_head_drafts_as_before
    out = train_tiny("medusa", target, tmp_path / "grown", steps=2, num_prompts=16, max_tokens=16,
                     extra=("--num-heads", "3", "--sequential", "--prefix-layer", "--init-from", str(seq_trained),
                            "--lr", "0", "--save-dtype", "float32"))
    base, grown = assert_grown_head_drafts_as_before(
        lambda spec: make_llm(target, spec), {"method": "medusa", **CHAIN}, seq_trained, out,
        ["prefix.self_attn.o_proj.weight", "prefix.mlp.down_proj.weight"], PROMPTS, GREEDY, plain(target), tmp_path)
    assert (base.proposer.prefix is None, grown.proposer.prefix is not None) == (True, True)
    with pytest.raises(RuntimeError):  # the CLI prints the ConfigError and exits 1
        train_tiny("medusa", target, tmp_path / "dropped", steps=1, num_prompts=16, max_tokens=16,
                   extra=("--num-heads", "3", "--sequential", "--init-from", str(out)))
    assert "its heads have a prefix layer" in capsys.readouterr().err
