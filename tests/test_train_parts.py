"""Parts of ``speculum train``: the data mix, overlap checks, chain scores, the learning-rate
schedule, the training-time test against drafting, draft shapes and training curves."""

from __future__ import annotations

import json
import math

import pytest
import torch

from speculum.errors import ConfigError
from speculum.train.base import Score, chain_score
from speculum.train.mix import (ANSWER, FOLLOWUP, LONG, QUESTION, SAMPLED, TURN, Row, clean_question,
                                drop_overlaps, first_jobs, next_jobs, normalise, read_rows)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def spec_factory(tmp_path):
    from speculum.train.distill import DistillSpec

    def make(**kw):
        return DistillSpec(model=str(tmp_path), prompts=str(tmp_path / "p.jsonl"), **kw)
    return make


def test_rows_in_every_accepted_form(tmp_path):
    f = tmp_path / "d.jsonl"
    rows = [{"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi?"},
                               {"from": "gpt", "value": "Hello."}, {"from": "human", "value": "Why?"}]},
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "Part one."}]},
                          {"role": "assistant", "content": "ok"}]},
            {"prompt": "Plain.", "source": "t0/x"},
            {"turns": ["T1", "T2"]},
            {"instruction": "Do it", "input": "with this"},
            {"prompt_token_ids": [5, 6]}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    got = read_rows(f, base=100)
    assert [r.index for r in got] == [100, 101, 102, 103, 104, 105]
    assert got[0].turns == ("Hi?", "Why?") and got[0].system == "Be brief."
    assert got[1].turns == ("Part one.",) and got[2].turns == ("Plain.",) and got[3].turns == ("T1", "T2")
    assert got[4].turns == ("Do it\n\nwith this",) and got[5].token_ids == (5, 6)
    assert not got[2].instruction and got[0].instruction
    f.write_text(json.dumps({"messages": [{"role": "assistant", "content": "no user"}]}) + "\n")
    with pytest.raises(ConfigError, match="no user turn"):
        read_rows(f)


def test_evaluation_prompts_are_dropped_after_normalising():
    bench = {normalise("Compose an engaging travel blog post about a recent trip to Hawaii."), normalise("Hi")}
    rows = [Row(0, "user_oriented", ("compose an ENGAGING travel-blog post about a recent trip to Hawaii",)),
            Row(1, "data:x", ("Hello", "Q: Compose an engaging travel blog post about a recent trip to Hawaii!")),
            Row(2, "user_oriented", ("Hi there, how are you?",)),  # a short eval prompt is only matched exactly
            Row(3, "user_oriented", (" hi ",))]
    kept, dropped = drop_overlaps(rows, bench)
    assert [r.index for r in kept] == [2] and dropped == 3


def test_template_rows_get_explained_long_answers(spec_factory):
    """--template-long-form N: a task-template (T0) row gets N long-form answers with a request
    to explain appended (the first greedy, then sampled); instruction rows keep --long-form;
    left at 0 it adds nothing and leaves the cache key as before."""
    from speculum.train.mix import EXPLAIN
    base = spec_factory(temperature=0.0, extra_temperature=(0.7, 1.0), long_form=1)
    spec = spec_factory(temperature=0.0, extra_temperature=(0.7, 1.0), long_form=1, template_long_form=2)
    t0 = Row(8, "t0/task", ("Is it positive?\nAnswer:",))
    jobs = first_jobs(t0, spec)
    assert [j.kind for j in jobs] == [ANSWER, LONG, LONG] and [j.temperature for j in jobs] == [0.0, 0.0, 0.7]
    for j in jobs[1:]:
        head, ask = j.messages[-1]["content"].split("\n\n")
        assert head == "Is it positive?\nAnswer:" and ask in EXPLAIN
    assert [j.kind for j in first_jobs(t0, base)] == [ANSWER]
    instr = Row(7, "user_oriented", ("Explain tides.",))
    assert [j.kind for j in first_jobs(instr, spec)] == [j.kind for j in first_jobs(instr, base)] == [ANSWER, LONG]
    assert base.key() != spec.key() and base.key() == spec_factory(temperature=0.0, extra_temperature=(0.7, 1.0),
                                                                   long_form=1, template_long_form=0).key()


def test_jobs_of_the_mix(spec_factory):
    spec = spec_factory(temperature=0.0, extra_answers=3, extra_temperature=(0.7, 1.0), long_form=2,
                        second_turns=1.0, max_turns=2)
    instr = Row(7, "user_oriented", ("Explain tides.",))
    jobs = first_jobs(instr, spec)
    assert [j.kind for j in jobs] == [ANSWER, SAMPLED, SAMPLED, SAMPLED, LONG, LONG]
    assert [j.temperature for j in jobs] == [0.0, 0.7, 1.0, 0.7, 0.0, 0.7]
    assert jobs[0].followup and not any(j.followup for j in jobs[1:])
    assert all(j.messages[-1]["content"].startswith("Explain tides.\n\n") for j in jobs[4:])
    assert len({j.seed for j in jobs}) == len(jobs)
    t0 = first_jobs(Row(8, "t0/task", ("Is it positive?",)), spec)
    assert [j.kind for j in t0] == [ANSWER] and t0[0].followup  # second turns for every source
    # the answer with a follow-up: the target writes a question (forced first words), then answers it
    q = next_jobs(jobs[0], "Tides come from the moon.", spec)
    assert len(q) == 1 and q[0].kind == QUESTION and q[0].start and q[0].max_tokens
    assert q[0].history[-1] == {"role": "assistant", "content": "Tides come from the moon."}
    f = next_jobs(q[0], " is the moon so strong? It is big.", spec)
    assert len(f) == 1 and f[0].kind == FOLLOWUP and f[0].turn == 1
    assert f[0].messages[:-1] == q[0].history
    assert f[0].messages[-1] == {"role": "user", "content": q[0].start + " is the moon so strong?"}
    assert next_jobs(f[0], "Because.", spec) == []
    # given later turns (MT-bench, conversations) come after the target's own answers, up to max_turns
    conv = Row(9, "data:c", ("A?", "B?", "C?"), system="Be brief.")
    a = first_jobs(conv, spec)[0]
    assert not a.followup and a.messages[0] == {"role": "system", "content": "Be brief."}
    b = next_jobs(a, "a.", spec)
    assert [j.kind for j in b] == [TURN] and b[0].messages[-2:] == (
        {"role": "assistant", "content": "a."}, {"role": "user", "content": "B?"})
    assert next_jobs(b[0], "b.", spec) == []  # max_turns=2
    assert clean_question("Why\nnot") == "Why" and clean_question("", "How") == "How that in more detail?"


def test_the_spec_key_keeps_old_caches_and_separates_new_mixes(spec_factory):
    base = spec_factory()
    assert base.key() == spec_factory(extra_temperature=0.8, long_form=0).key()
    keys = {base.key(), spec_factory(long_form=1).key(), spec_factory(second_turns=0.5).key(),
            spec_factory(extra_answers=2, extra_temperature=(0.7, 1.0)).key(), spec_factory(max_turns=2).key()}
    assert len(keys) == 5


def test_chain_score_counts_greedy_chains():
    ok = [torch.tensor([[1, 1, 0, 1]]).bool(), torch.tensor([[1, 0, 1, 1]]).bool(), torch.tensor([[1, 1, 1, 0]]).bool()]
    scored = [torch.ones(1, 4, dtype=torch.bool)] * 3
    s = chain_score(ok, scored, None)
    assert s.accuracy() == [0.75, 0.75, 0.75]
    # chains from the 4 anchors are accepted for 3, 0, 0 and 2 drafts
    assert s.acceptance() == [0.75, round(2 / 3, 4), 0.5] and s.acceptance_length() is None  # not replayed
    assert chain_score(ok, scored, torch.tensor([False])).acceptance() == [0.0, 0.0, 0.0]  # sampled: no chains
    part = [o[:, :3] for o in ok]
    s2 = chain_score(part, [torch.tensor([[1, 1, 0]]).bool()] * 3, None)
    assert float(s2.anchors) == 2 and (s + s2).runs.tolist() == [5, 3, 2]
    assert Score.coerce((torch.tensor([1.0]), torch.tensor([2.0]))).accuracy() == [0.5]


def test_replay_of_chain_drafting():
    """Greedy chain drafting replayed over an answer: each step accepts the leading agreeing
    drafts (never past the answer) and adds the target's token."""
    from speculum.train.base import replay_chains
    lead = torch.tensor([[2, 0, 1, 2, 0, 0, 0, 0], [4, 4, 4, 4, 4, 4, 4, 4]])
    # row 0: anchors 0, 3, 6 -> 3 + 3 + 1 tokens in 3 steps; row 1: capped at the answer's 3 tokens
    assert replay_chains(lead, torch.tensor([0, 0]), torch.tensor([7, 3])) == (10.0, 4.0)
    assert replay_chains(lead, torch.tensor([-1, 5]), torch.tensor([0, 2])) == (2.0, 1.0)
    # through chain_score: K = 2 drafts, an answer of 6 tokens after x_1
    ok = [torch.tensor([[1, 0, 1, 1, 0, 0, 0]]).bool(), torch.tensor([[1, 0, 0, 1, 0, 0]]).bool()]
    scored = [torch.ones(1, 7, dtype=torch.bool), torch.ones(1, 6, dtype=torch.bool)]
    valid = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0]]).bool()
    s = chain_score(ok, scored, None, valid)
    assert (s.tokens, s.steps) == (6.0, 2.0) and s.acceptance_length() == 3.0
    assert chain_score(ok, scored, torch.tensor([False]), valid).acceptance_length() is None


def test_learning_rate_decays_over_the_time_budget():
    from speculum.train.loop import lr_factor
    assert lr_factor(0, 10, 1000) == 0.1 and lr_factor(9, 10, 1000) == 1.0
    assert lr_factor(10, 10, 100000, elapsed=50, time_limit=100) == pytest.approx(0.55)
    assert lr_factor(10, 10, 100000, elapsed=100, time_limit=100) == pytest.approx(0.1)
    assert lr_factor(505, 10, 1000) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_training_time_test_sees_what_drafting_sees(tiny_llama, method):
    """The unrolled training forward (TrainContext) gives, at every anchor and step, the
    hidden state the head computes when drafting over its paged cache: true features up to
    the anchor, then its own outputs."""
    from speculum.backends.torch.heads import HeadKVCache, TargetParts, arch_from_config, init_layer
    from speculum.train.base import chain_unroll
    from speculum.train.data import Batch
    parts = TargetParts.from_checkpoint(tiny_llama)
    arch = arch_from_config(parts.config, num_layers=1)
    torch.manual_seed(0)
    if method == "eagle3":
        model = pytest.importorskip("speculum_eagle.model")
        head = model.Eagle3Head(arch, parts.embed, parts.hidden_size, 100, (0, 1, 0))
        torch.nn.init.normal_(head.fc.weight, std=0.2)
    else:
        model = pytest.importorskip("speculum_mtp.model")
        head = model.MTPHead(arch, parts.embed, parts.lm_head)
        torch.nn.init.normal_(head.eh_proj.weight, std=0.2)
    init_layer(head.layer if method == "eagle3" else head.layers[0], 0.2)
    head.train()
    T, K, H = 12, 3, parts.hidden_size
    g = torch.Generator().manual_seed(1)
    hidden = {l: torch.randn(1, T, H, generator=g) for l in (-1, 0, 1)}
    tokens = torch.randint(3, 500, (1, T), generator=g)
    ones = torch.ones(1, T, dtype=torch.bool)
    outs = [o.detach() for _, o in chain_unroll(head, Batch(tokens, hidden, ones, ones), K)]
    head.eval()
    cache = HeadKVCache("t", 1, arch.num_kv_heads, arch.head_dim, torch.float32, "cpu", 64)
    with torch.no_grad():
        for t in range(T - K):
            cache.add(t)
            feats = head.features({l: h[:, : t + 1] for l, h in hidden.items()})  # [1, t + 1, H]
            pos, ctx = cache.prepare([t], [t + 1], t + 1)
            out = head(feats, tokens[:, 1: t + 2], pos, ctx)[:, -1]  # anchor t: step 0
            torch.testing.assert_close(out, outs[0][:, t], atol=1e-5, rtol=1e-4)
            for j in range(1, K):  # step j reads its own output of step j - 1 and x_{t+j+1}
                pos, ctx = cache.prepare([t], [1], 1)
                out = head(out.unsqueeze(1), tokens[:, t + j + 1: t + j + 2], pos, ctx)[:, 0]
                torch.testing.assert_close(out, outs[j][:, t], atol=1e-5, rtol=1e-4)
            cache.remove(t)


def test_draft_shapes_are_measured_and_recommended(tiny_llama, tmp_path):
    import attrs

    from speculum.train.draft_shapes import SMOLLM2, candidate, main, measure, params_of, target_arch
    c = candidate(target_arch(None), 2, 384)
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.intermediate_size) == (2, 384, 6, 2, 1024)
    assert params_of(target_arch(None)) == pytest.approx(134.5e6, rel=0.01)  # SmolLM2-135M
    tiny = attrs.evolve(target_arch(None), vocab_size=512, num_layers=3, hidden_size=64, intermediate_size=128,
                        num_heads=4, num_kv_heads=2, head_dim=16)
    res = measure(tiny, [1, 2], [32, 64], k=3, context=16, iters=2, device="cpu", dtype="float32",
                  max_break_even=100.0)
    assert len(res["rows"]) == 4 and all(r["chain_ms"] > 0 and r["break_even_mal"] > 0 for r in res["rows"])
    assert res["recommended"] == {"num_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4,
                                  "num_kv_heads": 2}  # every shape fits: the largest
    assert SMOLLM2["vocab_size"] == 49152
    # wider MLPs at the target's width (--mlp-widths): the same attention, the MLP a multiple of the target's
    assert candidate(target_arch(None), 2, 576, 2.0).intermediate_size == 3072
    res = measure(tiny, [2], [64], k=3, context=16, iters=2, device="cpu", dtype="float32", max_break_even=100.0,
                  mlps=(1.0, 3.0))
    assert [r["intermediate_size"] for r in res["rows"]] == [128, 384]
    assert res["recommended"]["intermediate_size"] == 384  # the most parameters that fit
    out = tmp_path / "shapes.json"
    assert main(["--model", str(tiny_llama), "--layers", "1", "--widths", "64", "--iters", "1", "--context", "8", "--device", "cpu",
                 "--dtype", "float32", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["recommended"]["hidden_size"] == 64


def test_curves_are_collected_and_plotted(tmp_path):
    from speculum.train.curves import main
    run = tmp_path / "eagle3"
    run.mkdir()
    hist = [{"step": 10, "seconds": 5.0, "val_accuracy": [0.5, 0.3], "val_acceptance_length": 1.6,
             "eval_accuracy": [0.4, 0.2], "eval_acceptance_length": 1.5},
            {"step": 20, "seconds": 10.0, "val_accuracy": [0.6, 0.4], "val_acceptance_length": 1.9}]
    (run / "training.json").write_text(json.dumps({"method": "eagle3", "history": hist, "train_seconds": 10}))
    out, png = tmp_path / "curves.json", tmp_path / "plots" / "curves.png"
    assert main([str(run), str(tmp_path / "missing"), "--json", str(out), "--plot", str(png)]) == 0
    c = json.loads(out.read_text())["eagle3"]
    assert c["seconds"] == [5.0, 10.0] and c["val_accuracy_1"] == [0.5, 0.6]
    assert c["eval_acceptance_length"] == [1.5, None] and png.stat().st_size > 1000


def test_mtp_feature_regression_adds_eagle1_term(tiny_llama):
    """``speculum train mtp --reg-weight w`` adds, to the token loss, w x (per step, weighted
    decay**j) SmoothL1 of the module's normed output (its shared head's norm) onto the target's
    next final normed state, the state the module reads at the next position; ``--ce-weight``
    scales the token loss (a regression-led phase); a token loss weighed 0 is refused."""
    import argparse

    import torch.nn.functional as F
    model = pytest.importorskip("speculum_mtp.model")
    from speculum.backends.torch.heads import TargetParts, arch_from_config, init_layer
    from speculum.train.base import chain_unroll
    from speculum.train.cli import common_arguments, trainers
    from speculum.train.data import Batch
    parts = TargetParts.from_checkpoint(tiny_llama)
    torch.manual_seed(0)
    head = model.MTPHead(arch_from_config(parts.config, num_layers=1), parts.embed, parts.lm_head)
    torch.nn.init.normal_(head.eh_proj.weight, std=0.2)
    init_layer(head.layers[0], 0.2)
    head.train()
    trainer = trainers()["mtp"].create()
    p = argparse.ArgumentParser()
    common_arguments(p)
    trainer.add_arguments(p)
    T, H = 10, parts.hidden_size
    g = torch.Generator().manual_seed(2)
    batch = Batch(torch.randint(3, 500, (2, T), generator=g), {-1: torch.randn(2, T, H, generator=g)},
                  torch.ones(2, T, dtype=torch.bool), torch.ones(2, T, dtype=torch.bool))

    def loss_at(reg, ce=1.0):
        return trainer.loss(head, batch, parts, p.parse_args(["--num-positions", "3", "--reg-weight", str(reg),
                                                              "--ce-weight", str(ce), "--loss-vocab", "0"]))[0]
    loss = {w: loss_at(w) for w in (0.0, 0.5)}
    args = p.parse_args(["--num-positions", "3"])
    assert args.reg_weight == 0.0  # DeepSeek-V3's loss by default
    want = 0.0
    for j, out in chain_unroll(head, batch, 3):
        m = batch.target_mask(j + 1, args.loss_on)
        o = out[:, : T - j - 1][m]
        want += args.step_decay ** j * F.smooth_l1_loss(head.head_norm(o), batch.hidden[-1][:, j + 1:][m])
    assert float(want.detach()) > 0.01
    torch.testing.assert_close(loss[0.5] - loss[0.0], 0.5 * want, rtol=1e-4, atol=1e-6)
    # a regression-led loss (EAGLE-1's paper: 0.1 x tokens + 1 x regression)
    torch.testing.assert_close(loss_at(1.0, 0.1), 0.1 * loss[0.0] + want, rtol=1e-4, atol=1e-6)
    with pytest.raises(ConfigError, match="positive weight"):
        trainer.build(p.parse_args(["--ce-weight", "0"]), parts, {}, None, [])


def test_no_keep_best_after_keep_best_turns_it_off():
    """`train_heads.sh` passes --keep-best to every trainer; a phase that lowers the token
    acceptance on purpose (regression-led) gives --no-keep-best after it, and the last wins,
    so that phase exports its last step rather than its start."""
    import argparse

    from speculum.train.cli import common_arguments
    p = argparse.ArgumentParser()
    common_arguments(p)
    assert p.parse_args([]).keep_best is False
    assert p.parse_args(["--keep-best"]).keep_best is True
    assert p.parse_args(["--keep-best", "--no-keep-best"]).keep_best is False
    assert p.parse_args(["--no-keep-best", "--keep-best"]).keep_best is True
