"""Load-aware speculation length: num_speculative_tokens_per_batch_size (ranges and "auto").

- the ranges parse as vLLM writes them (dict or list), gaps take the range before, k is
  clamped, malformed ranges are errors that show the form;
- "auto" maximises predicted tokens per second from a cost curve and acceptance: it picks
  the longest k when verifying is nearly free, none when verifying k+1 tokens costs
  k+1 single steps, less as the batch grows; it probes now and then when it chose 0;
- through the engine, any sequence of per-step lengths (including 0, and switching
  back) keeps greedy output identical, for model-free, draft-model and head proposers;
- the chosen length per step is counted; a varying schedule captures every verify
  width up front; the verify cost profile is cached on disk and read back.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from speculum import LLM, SamplingParams
from speculum.config import SpeculativeConfig
from speculum.cost_model import VerifyCost, load_or_profile, profile_verify_cost
from speculum.errors import ConfigError
from speculum.spec_length import Acceptance, AutoLength, expected_tokens, k_for_batch

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [{"prompt_token_ids": [17, 4, 30, 9, 17, 4, 30, 9, 17, 4]},
           {"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7, 5, 6]},
           {"prompt_token_ids": [100, 200, 300, 100, 200]}]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
ENGINE = dict(device="cpu", dtype="float32", max_num_seqs=8)


def cfg(schedule, k=4):
    return SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": k,
                                        "num_speculative_tokens_per_batch_size": schedule})


# -- the ranges -----------------------------------------------------------------------------
def test_vllm_ranges_with_gaps_and_clamping():
    s = cfg({"1-16": 3, "64-128": 9, "256-4096": 0}).length_schedule
    assert s == ((1, 16, 3), (64, 128, 4), (256, 4096, 0))  # 9 clamped to num_speculative_tokens
    ks = {b: k_for_batch(s, b, 4) for b in (1, 16, 17, 63, 64, 200, 256, 9999)}
    assert ks == {1: 3, 16: 3, 17: 3, 63: 3, 64: 4, 200: 4, 256: 0, 9999: 0}
    assert k_for_batch(cfg({"8-16": 2}).length_schedule, 3, 4) == 4  # below the first range: the engine's k


def test_vllm_disable_by_batch_size_is_a_two_range_schedule():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 8})
    assert [k_for_batch(c.length_schedule, b, 3) for b in (1, 7, 8, 500)] == [3, 3, 0, 0]
    with pytest.raises(ConfigError, match="not both"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 8,
                                     "num_speculative_tokens_per_batch_size": "auto"})


def test_list_form_and_round_trip():
    c = cfg([[1, 4, 2], [5, 1000, 0]])
    assert c.length_schedule == ((1, 4, 2), (5, 1000, 0))
    assert SpeculativeConfig.from_dict(json.loads(json.dumps(c.to_dict()))).length_schedule == c.length_schedule
    assert cfg("auto").length_schedule == "auto"


@pytest.mark.parametrize("bad, words", [
    ({"1-16": 3, "10-20": 2}, ["overlap"]),
    ({"16-1": 3}, ["not a range"]),
    ({"1-4": -1}, ["k must be >= 0"]),
    ({"a-b": 1}, ["cannot read", "1-16"]),
    ("fast", ["'auto'", "1-16"]),
    ({}, ["empty"]),
    ([[1, 2]], ["cannot read"]),
])
def test_malformed_ranges_are_config_errors_that_show_the_form(bad, words):
    with pytest.raises(ConfigError) as info:
        cfg(bad)
    assert all(w in str(info.value) for w in words), str(info.value)


# -- the cost model ---------------------------------------------------------------------------
def test_expected_tokens_per_step():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12
    assert expected_tokens(0.9, 0) == 1.0


def test_acceptance_is_the_geometric_estimate():
    a = Acceptance()
    for _ in range(50):
        a.update(4, 4, 2, 0.9)  # two accepted, the third rejected: a = 2 / 3
    assert abs(a.estimate(0.5) - 2 / 3) < 0.02 and abs(a.availability() - 1.0) < 1e-9
    b = Acceptance()
    b.update(0, 0, 0, 0.9)
    assert b.estimate(0.4) == 0.4  # never asked: the prior
    c = Acceptance()
    for i in range(200):  # n-gram-like: a draft one step in four, fully accepted when there
        c.update(4, 4 if i % 4 == 0 else 0, 4 if i % 4 == 0 else 0, 0.99)
    assert abs(c.availability() - 0.25) < 0.03 and c.estimate(0.5) > 0.95
    d = Acceptance()
    for _ in range(50):
        d.update(4, 2, 2, 0.9)  # a short draft, all accepted: the run ended at position 3
    assert abs(d.estimate(0.5) - 2 / 3) < 0.02


class _Seq:
    def __init__(self, acceptance: float, speculative=True, max_k=None):
        self.speculative, self.max_k = speculative, max_k
        self.acceptance = Acceptance(successes=1000 * acceptance, trials=1000.0, asked=1000.0, offered=1000.0)


def _cost(fn) -> VerifyCost:
    return VerifyCost({b: {q: fn(b, q) for q in range(1, 6)} for b in (1, 2, 4, 8, 16, 32, 64)})


def test_auto_picks_long_drafts_when_verifying_is_free_and_none_when_it_costs_per_token():
    free = AutoLength(4, _cost(lambda b, q: 0.01))
    assert free.choose([_Seq(0.7)]) == 4
    linear = AutoLength(4, _cost(lambda b, q: 0.01 * q))
    assert linear.choose([_Seq(0.7)]) == 0
    assert linear.choose([_Seq(0.99)]) == 0  # E(k) < k + 1 always: never worth it


def test_auto_shortens_with_load_and_follows_acceptance():
    # memory-bound until batch * q tokens reach 32, compute-bound past it (a GPU's shape)
    auto = AutoLength(4, _cost(lambda b, q: 0.01 * max(1.0, b * q / 32)))
    ks = [auto.choose([_Seq(0.6)] * b) for b in (1, 4, 8, 16, 32, 64)]
    assert ks[0] == 4 and ks[-1] == 0 and ks == sorted(ks, reverse=True), ks
    assert AutoLength(4, _cost(lambda b, q: 0.01 * (1 + 0.3 * (q - 1)))).choose([_Seq(0.1)]) == 0
    assert AutoLength(4, _cost(lambda b, q: 0.01 * (1 + 0.3 * (q - 1)))).choose([_Seq(0.9)]) >= 3


def test_auto_weighs_drafts_by_how_often_they_come():
    cost = _cost(lambda b, q: 0.01 * (1 + 0.25 * (q - 1)))
    always = _Seq(0.8)
    rarely = _Seq(0.8)
    rarely.acceptance.offered = 100.0  # a draft one step in ten
    assert AutoLength(4, cost).choose([always]) >= 2
    # alone, a rare drafter pays the wide verify only when it drafts: worth it
    assert AutoLength(4, cost).choose([rarely]) >= 2
    # sixteen of them: most steps have some row drafting (1 - 0.9^16 = 0.81), each row
    # gains a token one step in ten: not worth it; sixteen that always draft: worth it
    assert AutoLength(4, cost).choose([rarely] * 16) == 0
    assert AutoLength(4, cost).choose([always] * 16) >= 2


def test_auto_counts_requests_without_speculation_as_one_token():
    auto = AutoLength(4, _cost(lambda b, q: 0.01 * (1 + 0.1 * (q - 1))))
    assert auto.choose([_Seq(0.9, speculative=False)] * 4) == 0
    assert auto.choose([_Seq(0.9, max_k=1)]) == 1 or auto.last_rates[1] >= max(auto.last_rates[2:])


def test_auto_probes_after_choosing_zero_only_when_speculation_could_pay():
    cheap = AutoLength(4, _cost(lambda b, q: 0.01 * (1 + 0.05 * (q - 1))))
    ks = [cheap.choose([_Seq(0.0)]) for _ in range(32 + 64 + 128)]
    assert [i for i, k in enumerate(ks) if k] == [31, 95, 223]  # after 32, then 64, then 128 steps at 0
    costly = AutoLength(4, _cost(lambda b, q: 0.01 * q))
    assert set(costly.choose([_Seq(0.0)]) for _ in range(64)) == {0}


def test_a_batch_size_where_speculation_cannot_pay_is_not_weighed_every_step():
    """At a batch size where no k pays even at a high acceptance (verifying costs per token:
    a loaded server), the policy weighs the k once, then answers 0 for ``off_for`` choices
    without weighing (at batch 64 a weighing costs a few hundred microseconds of a host
    that a loaded server shares), then weighs again. Estimates age as if weighed every
    step; another batch size is weighed as before."""
    auto = AutoLength(4, _cost(lambda b, q: 0.01 * q if b >= 32 else 0.01))
    weighed = []
    inner = auto.rates
    auto.rates = lambda seqs, acceptance=None: weighed.append(len(seqs)) or inner(seqs, acceptance)
    rows = [_Seq(0.5) for _ in range(64)]
    ks = [auto.choose(rows) for _ in range(1 + auto.off_for)]
    assert set(ks) == {0}
    first = len(weighed)
    assert first >= 1 and weighed == [64] * first  # the first choice only
    auto.choose(rows)
    assert len(weighed) > first  # off_for choices later: weighed again
    # ages as if forgotten every step: 2 + off_for forgettings of each row's evidence
    assert rows[0].acceptance.trials == pytest.approx(1000.0 * auto.availability_decay ** (2 + auto.off_for))
    assert auto.choose([_Seq(0.9)]) > 0  # batch 1: verifying is free there, speculation pays
    # the wrong variant (no bucket ever off) weighs at every fresh choice: every 4th step
    on = AutoLength(4, _cost(lambda b, q: 0.01 * q if b >= 32 else 0.01))
    on.off_for = 0
    calls = []
    inner_on = on._choose
    on._choose = lambda seqs: calls.append(1) or inner_on(seqs)
    for _ in range(1 + auto.off_for):
        on.choose(rows)
    assert len(calls) >= (1 + auto.off_for) // on.every


def test_measured_drafting_cost_lowers_k():
    auto = AutoLength(4, _cost(lambda b, q: 0.01 * (1 + 0.05 * (q - 1))))
    auto.every = 1  # choose afresh every step
    assert auto.choose([_Seq(0.5)]) >= 3
    for _ in range(30):
        auto.observe_step(1, 4, 5, draft_seconds=0.04, step_seconds=0.04 + 0.012)  # a draft token costs a step
    assert auto.choose([_Seq(0.5)]) == 0


def test_a_noisy_profile_is_made_monotone():
    c = VerifyCost({1: {1: 9.0, 2: 1.3, 5: 1.9}, 4: {1: 2.0, 2: 9.0, 5: 7.0}}).monotone()
    assert c.table == {1: {1: 9.0, 2: 9.0, 5: 9.0}, 4: {1: 9.0, 2: 9.0, 5: 9.0}}
    d = VerifyCost({1: {1: 1.0, 2: 1.1}, 4: {1: 2.0, 2: 2.5}}).monotone()
    assert d.table == {1: {1: 1.0, 2: 1.1}, 4: {1: 2.0, 2: 2.5}}


def test_auto_rechooses_every_few_steps_and_when_the_batch_changes():
    auto = AutoLength(4, _cost(lambda b, q: 0.01 * max(1.0, b * q / 32)))
    calls = []
    inner = auto._choose
    auto._choose = lambda seqs: calls.append(len(seqs)) or inner(seqs)
    for B in (1, 1, 1, 1, 1, 64, 64, 1):
        auto.choose([_Seq(0.6)] * B)
    assert calls == [1, 1, 64, 1]


def test_verify_cost_interpolates_and_extrapolates():
    c = VerifyCost({1: {1: 1.0, 3: 3.0}, 4: {1: 2.0, 3: 6.0}})
    assert c(1, 2) == 2.0 and c(2, 1) == pytest.approx(4 / 3) and c(8, 1) == pytest.approx(10 / 3)
    assert c(1, 5) == pytest.approx(5.0)


# -- through the engine -----------------------------------------------------------------------
class Alternating:
    """Test policy: k = 0, max, 1, 0, max, ... whatever the batch (every switch exercised)."""

    kind, varies, decay, times_drafting = "test", True, 0.8, False

    def __init__(self, k):
        self.seq, self.i = [0, k, 1, 0, 0, k, 2], 0

    def choose(self, seqs):
        self.i += 1
        return self.seq[self.i % len(self.seq)]

    def observe_acceptance(self, seq, asked, drafted, accepted):
        seq.acceptance.update(asked, drafted, accepted, self.decay)

    def observe_step(self, *a, **kw):
        pass

    def needs_timing(self, batch_size):
        return False


class LongPause(Alternating):
    """Test policy: 70 steps without drafts (a head's backlog folds at 64), then k."""

    def __init__(self, k):
        self.seq, self.i = [0] * 70 + [k], -1

    def choose(self, seqs):
        self.i += 1
        return self.seq[min(self.i, len(self.seq) - 1)]


def _specs(tiny_llama, tmp_path):
    specs = {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
             "draft_model": {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 3}}
    if importlib.util.find_spec("speculum_eagle") is not None:
        from speculum.testing import train_tiny
        specs["eagle"] = {"method": "eagle", "model": str(train_tiny("eagle", tiny_llama, tmp_path)),
                          "num_speculative_tokens": 3}
    return specs


def test_any_sequence_of_lengths_keeps_greedy_output_identical(tiny_llama, tmp_path):
    base = [o.token_ids for o in LLM(str(tiny_llama), None, **ENGINE).generate(PROMPTS, GREEDY)]
    long = SamplingParams(temperature=0, max_tokens=90, ignore_eos=True)
    base_long = [o.token_ids for o in LLM(str(tiny_llama), None, **ENGINE).generate(PROMPTS[:1], long)]
    for name, spec in _specs(tiny_llama, tmp_path).items():
        llm = LLM(str(tiny_llama), spec, **ENGINE)
        llm.loop.length = LongPause(3)
        assert [o.token_ids for o in llm.generate(PROMPTS[:1], long)] == base_long, name
        llm.loop.length = Alternating(3)
        llm.loop.k_counts = [0] * 4
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == base, name
        counts = llm.loop.k_counts
        assert counts[0] > 0 and counts[3] > 0, (name, counts)
        if name == "draft_model":  # the target as its own draft: runs of drafts accepted
            assert llm.metrics.num_accepted_tokens > 0, name


def test_batch_size_schedule_through_the_engine(tiny_llama):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "num_speculative_tokens_per_batch_size": {"1-1": 3, "2-64": 0}}
    llm = LLM(str(tiny_llama), spec, **ENGINE)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (8, 12, 30)]
    outs = llm.generate(PROMPTS, params)
    base = LLM(str(tiny_llama), None, **ENGINE).generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    counts = llm.loop.k_counts
    assert counts[0] == 12 and counts[3] > 0 and counts[1] == counts[2] == 0, counts
    m = {x.name: x for x in llm.get_metrics()}
    assert m["speculum:spec_decode_speculation_length_steps"].values == counts


def test_a_varying_length_captures_every_verify_width(tiny_llama, monkeypatch):
    from speculum.backends.torch.backend import TorchBackend
    seen = []
    monkeypatch.setattr(TorchBackend, "capture", lambda self, runner, sizes, qs, hidden=(): seen.append(list(qs)) or 0)
    LLM(str(tiny_llama), cfg({"1-4": 2, "5-64": 4}).to_dict(), **ENGINE)
    LLM(str(tiny_llama), {"method": "ngram", "num_speculative_tokens": 4}, **ENGINE)
    assert seen == [[1, 2, 3, 4, 5], [1, 5]]


def test_auto_through_the_engine_profiles_once_and_caches(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULUM_CACHE", str(tmp_path / "cache"))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "num_speculative_tokens_per_batch_size": "auto"}
    llm = LLM(str(tiny_llama), spec, **ENGINE)
    files = list((tmp_path / "cache" / "verify_cost").glob("*.json"))
    assert len(files) == 1
    table = json.loads(files[0].read_text())["table"]
    assert set(table) == {"1", "4", "8"} and set(table["1"]) == {"1", "2", "4"}
    outs = llm.generate(PROMPTS, GREEDY)
    base = LLM(str(tiny_llama), None, **ENGINE).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    assert sum(llm.loop.k_counts) == max(o.metrics.num_steps for o in outs) or sum(llm.loop.k_counts) > 0
    # a second engine reads the profile instead of measuring again
    import speculum.cost_model as cm
    monkeypatch.setattr(cm, "profile_verify_cost", lambda *a, **k: pytest.fail("profiled again"))
    LLM(str(tiny_llama), spec, **ENGINE)


def test_profiling_leaves_the_runner_as_it_was(tiny_llama):
    llm = LLM(str(tiny_llama), None, **ENGINE)
    before = llm.target.allocator.num_free_blocks
    cost = profile_verify_cost(llm.target, [1, 3], [1, 2], context=20, reps=1)
    assert set(cost.table) == {1, 3} and all(v > 0 for row in cost.table.values() for v in row.values())
    assert llm.target.allocator.num_free_blocks == before
    assert llm.generate(PROMPTS[:1], GREEDY)[0].token_ids  # still serves


def test_load_or_profile_cache_is_keyed_by_the_machine(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULUM_CACHE", str(tmp_path))
    llm = LLM(str(tiny_llama), None, **ENGINE)
    load_or_profile(llm.target, llm.model_path, 2, 2, context=16)
    load_or_profile(llm.target, llm.model_path, 4, 2, context=16)  # another batch range: another profile
    assert len(list((tmp_path / "verify_cost").glob("*.json"))) == 2


# ------------------------------------------------------------------ trees: the whole tree or nothing
def _tree_seq(accepted_per_step: float, steps: float = 100.0):
    s = _Seq(0.0)
    s.acceptance = Acceptance(successes=accepted_per_step * steps, trials=steps * (accepted_per_step + 1),
                              asked=steps, offered=steps)
    return s


def _tree_cost(fn, nodes: int = 15) -> VerifyCost:
    return VerifyCost({b: {q: fn(b, q) for q in (1, nodes + 1)} for b in (1, 4, 16, 64)})


def test_tree_auto_runs_the_tree_where_its_measured_gain_beats_its_cost():
    from speculum.spec_length import TreeAutoLength
    gpu = _tree_cost(lambda b, q: 0.01 * max(1.0, b * q / 64))  # flat until 64 tokens, then per token
    auto = TreeAutoLength(15, gpu)
    # batch 1: the tree costs as much as a step; 1.2 accepted nodes per step pays
    assert auto.choose([_tree_seq(1.2)]) == 15
    # batch 16: 256 tokens cost 4 steps; 1.2 accepted nodes (2.2 tokens) do not pay
    assert TreeAutoLength(15, gpu).choose([_tree_seq(1.2)] * 16) == 0
    # a tree that accepts little does not pay even where verifying is cheap
    assert TreeAutoLength(15, _tree_cost(lambda b, q: 0.01 * (1 + 0.2 * (q > 1)))).choose([_tree_seq(0.1)]) == 0
    # only 0 and the whole tree are ever chosen; the chain's k in between are never run
    auto = TreeAutoLength(15, gpu)
    ks = {auto.choose([_tree_seq(a)] * b) for a in (0.1, 1.0, 3.0) for b in (1, 4, 16, 64)}
    assert ks <= {0, 15} and ks == {0, 15}


def test_tree_auto_learns_accepted_nodes_per_step_from_the_loop():
    from speculum.spec_length import TreeAutoLength
    auto = TreeAutoLength(15, _tree_cost(lambda b, q: 0.01 * (1 + 0.5 * (q > 1))))
    s = _tree_seq(0.0, steps=0.0)
    assert auto.choose([s]) == 15  # before any step: the prior (1 accepted node) would pay 2/1.5
    for _ in range(30):
        auto.observe_acceptance(s, 15, 15, 0)  # the tree never accepted anything
    auto._last_k = None
    assert auto.choose([s]) == 0
    for _ in range(30):
        auto.observe_acceptance(s, 15, 15, 3)
    auto._last_k = None
    assert auto.choose([s]) == 15


def test_tree_auto_through_the_engine_keeps_greedy_output_identical(tiny_llama, tmp_path, monkeypatch):
    import importlib.util
    from speculum.testing import train_tiny
    if importlib.util.find_spec("speculum_eagle") is None:
        pytest.skip("needs speculum-eagle (trees are drafted by head methods)")
    monkeypatch.setenv("SPECULUM_CACHE", str(tmp_path / "cache"))
    head = train_tiny("eagle", tiny_llama, tmp_path / "train")
    spec = {"method": "eagle", "model": str(head), "tree_topk": 2, "tree_depth": 3, "num_draft_tokens": 6,
            "num_speculative_tokens_per_batch_size": "auto"}
    llm = LLM(str(tiny_llama), spec, **ENGINE)
    assert type(llm.spec_length).__name__ == "TreeAutoLength"
    outs = llm.generate(PROMPTS, GREEDY)
    base = LLM(str(tiny_llama), None, **ENGINE).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    k = llm.loop.k
    assert all(n == 0 for i, n in enumerate(llm.loop.k_counts) if i not in (0, k)), llm.loop.k_counts


def test_auto_pays_the_wide_verify_only_when_some_row_drafts():
    """A proposer that drafts one step in five (n-gram lookup) costs a wide verify one step
    in five: at batch 1 it pays although a wide step every time would not."""
    cost = _cost(lambda b, q: 0.01 * (1 + 0.3 * (q > 1)))
    rare = _Seq(0.8)
    rare.acceptance = Acceptance(successes=800.0, trials=1000.0, asked=1000.0, offered=200.0)  # u = 0.2
    # k = 4: 1 + 0.2 * (0.8 + 0.64 + 0.51 + 0.41) = 1.47 tokens per step, for
    # 1 + 0.2 * 0.3 = 1.06x the time (not 1.3x: four steps in five verify one token)
    r = AutoLength(4, cost).rates([rare])
    assert abs(r[4] / r[0] - 1.472 / 1.06) < 0.01  # (the estimates carry a weak prior)
    assert AutoLength(4, cost).choose([rare]) == 4
    # at batch 16 nearly every step has some row with a draft: the full price again
    assert AutoLength(4, _cost(lambda b, q: 0.01 * (1 + 0.6 * (q > 1)))).choose([rare] * 16) == 0


def test_a_per_step_drafting_cost_is_not_multiplied_by_k():
    """n-gram lookup costs the same per step whatever k: measured at k = 1 (a probe), it
    is not charged four times at k = 4; a cost measured at k = 4 is not divided at k = 1."""
    auto = AutoLength(4, _cost(lambda b, q: 0.0014 * (1 + 0.1 * (q > 1))))
    auto.observe_step(1, 1, 2, 0.0002, None)
    assert auto.draft_seconds(1, 1) == auto.draft_seconds(1, 4) == 0.0002
    auto.observe_step(1, 4, 5, 0.0008, None)  # a model: four times the cost at k = 4
    assert auto.draft_seconds(1, 4) == 0.0008 and auto.draft_seconds(1, 2) == 0.0002  # nearest: k = 1
    # nearest measured (4) is never divided, but three tokens cost at most 3x one (k = 1's)
    assert auto.draft_seconds(1, 3) == pytest.approx(0.0006)
    # another batch size, not measured yet: bounded by what 1 row costs, times 16 (n-gram
    # lookup runs row by row), rather than free (seen on the H200: "auto" speculated on all
    # 32 requests arriving at once before their drafting was ever timed)
    assert auto.draft_seconds(16, 4) == pytest.approx(16 * 0.0008)
    auto.observe_step(16, 4, 5, 0.003, None)
    assert auto.draft_seconds(16, 4) == 0.003  # measured: its own figure
    assert auto.draft_seconds(8, 4) == pytest.approx(0.003)  # fewer rows cost no more than 16
    assert auto.draft_seconds(2, 1) == pytest.approx(2 * 0.0002)
    assert AutoLength(4, _cost(lambda b, q: 0.001)).draft_seconds(16, 4) == 0.0  # nothing measured anywhere


def test_a_run_of_misses_does_not_switch_a_request_off_for_good():
    """n-gram lookup finds nothing at the start of an answer: the request goes to k = 0,
    its evidence ages while it drafts nothing, and it is asked again later."""
    auto = AutoLength(4, _cost(lambda b, q: 0.01 * (1 + 0.6 * (q > 1))))
    for k in range(1, 5):
        auto.observe_step(1, k, k + 1, 0.002, None)  # drafting costs a fifth of a step
    auto.global_acceptance = Acceptance(successes=60.0, trials=100.0, asked=100.0, offered=60.0)  # u 0.6, a 0.6
    s = _Seq(0.6)
    s.acceptance = Acceptance()
    for _ in range(20):
        auto.observe_acceptance(s, 4, 0, 0)  # twenty misses in a row
    assert auto.choose([s]) == 0
    ks = [auto.choose([s]) for _ in range(200)]
    # a choice, not a probe (probes draft one token): the aged evidence lets the prior speak
    first = next((i for i, k in enumerate(ks) if k >= 2), None)
    assert first is not None and 4 <= first <= 120, (first, ks[:40])


def test_one_stalled_drafting_measurement_does_not_rule_a_k_out():
    """Seen on the H200 (n-gram, concurrency 1): one k = 3 step took 2.8 ms to draft
    (0.2-0.3 ms at k = 1 and 4); predicted at that cost k = 3, the best fixed k, was
    never chosen again. Drafting k costs at most k/k' times drafting k'."""
    auto = AutoLength(4, _cost(lambda b, q: 0.0015 + 0.0001 * (q > 1)))
    auto.observe_step(1, 1, 2, 0.00025, None)
    auto.observe_step(1, 4, 5, 0.00021, None)
    auto.observe_step(1, 3, 4, 0.0028, None)  # the stall
    assert auto.draft_seconds(1, 3) == pytest.approx(0.00021)  # bounded by k = 4's (cost per step: no growth)
    assert auto.draft_seconds(1, 2) == pytest.approx(0.00021)
    model = AutoLength(4, _cost(lambda b, q: 0.0015))
    model.observe_step(1, 1, 2, 0.001, None)
    assert model.draft_seconds(1, 3) == pytest.approx(0.001)  # unmeasured: the nearest k's figure
    model.observe_step(1, 3, 4, 0.02, None)  # a stall at k = 3
    assert model.draft_seconds(1, 3) == pytest.approx(0.003)  # at most 3x k = 1's


def test_auto_weighs_the_measured_cycle_of_each_kind_of_step():
    """Seen on the H200 behind the server, 61 requests at once: in-step costs (verify 1.8 ms,
    drafting 5.4 ms) predicted k=4 1.06x faster, but a speculative step's cycle (outputs,
    streaming, the event loop) cost so much more than a plain one's that fixed k=4 served
    0.81x. The rest of a cycle is measured apart for steps with and without drafts."""
    auto = AutoLength(4, _cost(lambda b, q: 0.002))
    auto.every = 1
    seqs = [_Seq(0.6)] * 64
    assert auto.choose(seqs) == 4  # nothing measured: verifying is free, so draft
    for _ in range(40):
        auto.observe_step(64, 4, 5, 0.001, 0.050)  # a speculative cycle: 50 ms
    assert auto.other_seconds(64, 0) == auto.other_seconds(64, 4) == pytest.approx(0.047, rel=0.01)
    ks = [auto.choose(seqs) for _ in range(2 * auto.refresh_every + 2)]
    # one plain step, to measure what one costs here, and again every refresh_every steps
    assert [i for i, k in enumerate(ks) if k == 0] == [0, auto.refresh_every + 1]
    for _ in range(40):
        auto.observe_step(64, 0, 1, None, 0.012)  # a plain cycle: 12 ms
    assert auto.other_seconds(64, 0) == pytest.approx(0.010, rel=0.01)
    assert auto.other_seconds(64, 4) == pytest.approx(0.047, rel=0.01)
    assert auto.choose(seqs) == 0  # 64 tokens / 12 ms beat 64 * 2.3 tokens / 50 ms
    assert auto.choose([_Seq(0.6)]) == 4  # batch 1: nothing measured there


class _Recorder(Alternating):
    def __init__(self, k):
        super().__init__(k)
        self.steps = []

    def observe_step(self, batch_size, k, q, draft_seconds, step_seconds):
        self.steps.append((batch_size, k, step_seconds))


def test_the_loop_reports_each_steps_cycle_less_prefills_and_idle_time(tiny_llama, monkeypatch):
    """What the policy is told a step cost: from its start to the next step's start (the
    engine's work between them included), less the prefills in between; the wait for new
    work after the engine ran dry is nobody's."""
    import time as _time

    from speculum.loop import DraftVerifyLoop
    llm = LLM(str(tiny_llama), {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}, **ENGINE)
    rec = llm.loop.length = _Recorder(3)
    step = DraftVerifyLoop.step

    def slow_engine(self, seqs, ahead=True):  # 30 ms of "engine work" after each step
        step(self, seqs, ahead)
        _time.sleep(0.03)
    monkeypatch.setattr(DraftVerifyLoop, "step", slow_engine)
    start = DraftVerifyLoop._start
    monkeypatch.setattr(DraftVerifyLoop, "_start", lambda self, seqs: _time.sleep(0.2) or start(self, seqs))
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(rec.steps) == 5  # the last step's cycle ends with the engine running dry
    assert all(0.03 <= s < 0.03 + 0.2 for _, _, s in rec.steps), rec.steps
    # a second request: its 200 ms prefill is not in the cycle of the step before it
    llm.add_request("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    llm.step()
    llm.step()
    llm.add_request("b", PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    llm.step()
    llm.step()
    assert all(s < 0.2 for _, _, s in rec.steps), rec.steps


def test_one_stalled_first_cycle_does_not_switch_speculation_off_for_good():
    """Seen on the H200 (server, concurrency 1): the first speculative step's cycle cost
    47 ms beyond its verify and drafting (a plain one's: 0.2 ms), was the only speculative
    figure, and priced speculation out for the rest of the run (0.88x of no speculation,
    where fixed k=3 served 1.17x).
    Probes go on until a few speculative cycles are known, and a median forgets the stall."""
    auto = AutoLength(4, _cost(lambda b, q: 0.001))
    auto.every = 1
    seq = [_Seq(0.7)]
    assert auto.choose(seq) == 4
    auto.observe_step(1, 4, 5, 0.0002, 0.048)  # the stall
    ks = []
    for _ in range(400):
        k = auto.choose(seq)
        ks.append(k)
        auto.observe_step(1, k, k + 1, 0.0002 if k else None, 0.0012 + 0.0002 * (k > 0))
    assert ks[0] == 0  # priced out at first ...
    assert ks[-50:].count(4) >= 45, ks[-50:]  # ... back to drafting once probes measured the truth
    assert auto.other_seconds(1, 4) < 0.001


def test_a_host_bound_step_does_not_speculate_on_host_work_it_cannot_save():
    """Seen on the H200 behind the server, 64 requests at once: a plain cycle 11.5 ms of
    which the forward 1.3 ms; the speculative cycles measured 8 ms of host work against
    10 ms for the (rare, one-off) plain ones, so the policy drafted k = 4 and served 0.74x
    of no speculation. The host's work grows with the tokens a step emits: a speculative
    step's rest is priced at least at the plain one's per token, and drafting must then
    pay for itself in forwards saved."""
    auto = AutoLength(4, _cost(lambda b, q: 0.0013 + 0.00005 * (q - 1)))
    auto.every = 1
    seqs = [_Seq(0.66)] * 64
    for _ in range(9):
        auto.observe_step(64, 4, 5, 0.0015, 0.0015 + 0.0015 + 0.008)
        auto.observe_step(64, 0, 1, None, 0.0013 + 0.010)
    assert auto.choose(seqs) == 0
    # priced with the speculative cycles' own rest (8 ms), k = 4 looked 2.6x faster
    assert 64 * expected_tokens(0.66, 4) / (0.0015 + 0.0015 + 0.008) > 2.5 * 64 / (0.0013 + 0.010)
    # the same in-step costs with little host work: the forwards saved pay for the drafts
    light = AutoLength(4, _cost(lambda b, q: 0.0013 + 0.00005 * (q - 1)))
    for _ in range(9):
        light.observe_step(1, 4, 5, 0.0002, 0.0015 + 0.0002 + 0.0001)
        light.observe_step(1, 0, 1, None, 0.0013 + 0.0001)
    rates = light.rates([_Seq(0.66)])
    assert max(range(5), key=rates.__getitem__) == 4 and rates[4] > 1.5 * rates[0]
