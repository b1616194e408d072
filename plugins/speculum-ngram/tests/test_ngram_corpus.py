"""The n-gram corpus (``options.corpus``): what a lookup drafts, when the proposer uses it, the
file format, and greedy output identical to no speculation on a tiny target."""

from __future__ import annotations

import importlib.util
import json
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from speculum.config import SpeculativeConfig
from speculum.errors import ConfigError
from speculum.interfaces import ProposeBatch, SequenceView
from speculum.sampling import SamplingBatch, SamplingParams
from speculum.testing import make_llm, tiny_model_dir
from speculum_ngram import NgramOptions, NgramProposer
from speculum_ngram.corpus import Corpus, build, load_corpus

SEP = -1
SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "ngram_ceiling.py"


def corpus(*streams, n_min=1, n_max=3) -> Corpus:
    return Corpus(np.array([t for s in streams for t in (*s, SEP)]), n_min, n_max)


def test_the_longest_suffix_found_wins_and_its_continuation_is_voted():
    c = corpus([1, 2, 3, 7, 8], [9, 2, 3, 5, 6], [4, 2, 3, 5, 6], [0, 3, 4])
    assert c.draft([1, 2, 3], k=2) == [7, 8]  # [1, 2, 3] occurs once: its continuation
    assert c.draft([0, 2, 3], k=2) == [5, 6]  # [2, 3]: 7 once, 5 twice; then 6 after the 5s
    assert c.draft([8, 3], k=3) == [5, 6]  # [3]: 7, 5, 5, 4 -> 5; 6 twice; then the separator
    assert c.draft([42], k=2) == [] and c.draft([], k=2) == []


def test_votes_follow_the_occurrences_that_agree_so_far():
    # after [1]: 2 three times (then 3, 3, 4) and 5 twice (then 4, 4): 2 wins, then 3 (of the 2s)
    c = corpus([1, 2, 3], [1, 2, 3], [1, 2, 4], [1, 5, 4], [1, 5, 4], n_min=1, n_max=1)
    assert c.draft([1], k=2) == [2, 3]


def test_the_proposer_asks_the_corpus_only_when_the_request_has_no_match():
    c = corpus([5, 6, 70, 71], n_min=1, n_max=3)
    p = NgramProposer(1, 3, corpus=c)
    params = [SamplingParams(temperature=0)] * 2
    views = [SequenceView(0, [5, 6, 9, 5, 6], 1), SequenceView(1, [8, 5, 6], 1)]
    d = p.propose(ProposeBatch(views, 2, SamplingBatch.from_params(params, [None, None])))
    assert d.token_ids.tolist() == [[9, 5], [70, 71]]  # the request's own match first


def test_options_and_errors(tmp_path):
    out = tmp_path / "c.npy"
    np.save(out, np.array([1, 2, 3, SEP], dtype=np.int32))
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    p = NgramProposer.from_context(types.SimpleNamespace(config=cfg, options=NgramOptions(corpus=str(out))))
    assert p.corpus is load_corpus(str(out), 2, 5, depth=2) and len(p.corpus) == 3  # made once per process
    with pytest.raises(ConfigError, match="python -m speculum_ngram.corpus build"):
        NgramProposer.from_context(types.SimpleNamespace(config=cfg, options=NgramOptions(corpus=str(tmp_path / "x"))))
    tree = SpeculativeConfig(method="ngram", tree_topk=2, tree_depth=2, num_draft_tokens=5)
    with pytest.raises(ConfigError, match="drafts chains"):
        NgramProposer.from_context(types.SimpleNamespace(config=tree, options=NgramOptions(corpus=str(out))))


def test_build_writes_answers_caches_as_streams(tmp_path):
    from safetensors.numpy import save_file
    d = tmp_path / "cache"
    d.mkdir()
    save_file({"tokens": np.array([1, 2, 3, 4, 5, 6, 7], dtype=np.int32), "offsets": np.array([0, 4, 7]),
               "prompt_lens": np.array([2, 1], dtype=np.int32), "prompt_index": np.array([0, 1], dtype=np.int32)},
              str(d / "shard_00000.safetensors"))
    (d / "meta.json").write_text(json.dumps({"shards": ["shard_00000.safetensors"]}))
    assert build([str(d)], str(tmp_path / "all.npy"))["tokens"] == 7
    assert np.load(tmp_path / "all.npy").tolist() == [1, 2, 3, 4, SEP, 5, 6, 7, SEP]
    build([str(d)], str(tmp_path / "ans.npy"), answers_only=True)
    assert np.load(tmp_path / "ans.npy").tolist() == [3, 4, SEP, 6, 7, SEP]
    (d / "meta.json").write_text(json.dumps({"shards": ["shard_00000.safetensors"],
                                             "spec": {"prompts": "/x/speculum/data/mt_bench.jsonl"}}))
    with pytest.raises(ConfigError, match="evaluation set"):  # the evaluation answers never enter a corpus
        build([str(d)], str(tmp_path / "bench.npy"))
    from speculum_ngram.corpus import main
    assert main(["build", "--cache-root", str(tmp_path), "--out", str(tmp_path / "root.npy")]) == 2  # none left


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("target"), "llama", seed=0)


def test_greedy_output_with_a_corpus_is_identical_to_no_speculation(target, tmp_path):
    """The corpus: the target's own greedy answers to other prompts (as `build` makes from
    the training answers). The drafts it adds are accepted (the test is not vacuous: more
    tokens per forward than the request-only lookup) and the output is the target's."""
    g = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(3, 500, (n,), generator=g).tolist()} for n in (4, 9, 5, 12, 7, 6)]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(max_num_seqs=3)
    base = [o.token_ids for o in make_llm(target, **kw).generate(prompts, greedy)]
    seen = [o.token_ids for o in make_llm(target, **kw).generate(
        [{"prompt_token_ids": p["prompt_token_ids"][:2]} for p in prompts], greedy)]
    np.save(tmp_path / "c.npy", np.array([t for s in seen for t in (*s, SEP)], dtype=np.int32))
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    plain = make_llm(target, spec, **kw)
    with_corpus = make_llm(target, {**spec, "options": {"corpus": str(tmp_path / "c.npy")}}, **kw)
    outs = with_corpus.generate(prompts, greedy)
    assert [o.token_ids for o in outs] == base
    assert [o.token_ids for o in plain.generate(prompts, greedy)] == base
    assert with_corpus.metrics.num_accepted_tokens > plain.metrics.num_accepted_tokens
    # scripts/ngram_ceiling.py --corpus replays exactly these steps (after the prefill's token)
    spec_ = importlib.util.spec_from_file_location("ngram_ceiling", SCRIPT)
    mod = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(mod)
    c = load_corpus(str(tmp_path / "c.npy"), 2, 4)
    for p, o in zip(prompts, outs):
        r = mod.replay([{"prompt": p["prompt_token_ids"] + o.token_ids[:1], "output": o.token_ids[1:]}], 2, 4, 4, c)
        m = o.metrics
        assert (m.num_steps - 1, m.num_accepted_tokens) == (r["steps"], r["tokens"] - r["steps"])


def test_a_large_corpus_tables_are_cached_on_disk_and_read_back(tmp_path, monkeypatch, caplog):
    """Voted once (the shipped corpus: ~20-30 s), then read from $SPECULUM_CACHE/ngram/ by a
    later process: the same tables and drafts, no vote; another file, range or depth is
    another key; a damaged cache file is voted again and rewritten."""
    from speculum_ngram import corpus as cmod
    monkeypatch.setenv("SPECULUM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cmod, "CACHE_MIN_TOKENS", 10)
    rng = np.random.default_rng(0)
    toks = np.concatenate([np.r_[rng.integers(0, 20, 40), SEP] for _ in range(30)]).astype(np.int32)
    path = tmp_path / "c.npy"
    np.save(path, toks)
    load_corpus.cache_clear()
    first = load_corpus(str(path), 2, 4, depth=3)
    cached = cmod.table_cache(path, 2, 4, 3)
    assert cached.is_file() and cached.parent == tmp_path / "cache" / "ngram"
    assert cmod.table_cache(path, 2, 4, 3, data=path.read_bytes()) == cached  # load_corpus reads the file once
    load_corpus.cache_clear()  # a new process: reads the file, votes nothing
    monkeypatch.setattr(cmod, "_voted_table", lambda *a: pytest.fail("voted again"))
    again = load_corpus(str(path), 2, 4, depth=3)
    assert again is not first and len(again) == len(first) and again.depth == 3
    for n in range(2, 5):
        for a, b in zip(first.tables[n], again.tables[n]):
            assert np.array_equal(a, b)
    ctxs = [rng.integers(0, 20, 6).tolist() for _ in range(200)]
    assert [again.draft(c, 3) for c in ctxs] == [first.draft(c, 3) for c in ctxs]
    assert sum(bool(d) for d in (first.draft(c, 3) for c in ctxs)) > 50  # (the check has drafts to compare)
    assert len({cached, cmod.table_cache(path, 1, 4, 3), cmod.table_cache(path, 2, 4, 4)}) == 3
    np.save(tmp_path / "d.npy", toks[::-1].copy())
    assert cmod.table_cache(tmp_path / "d.npy", 2, 4, 3) != cached
    monkeypatch.undo()  # the real vote back; a damaged file is voted again and replaced
    monkeypatch.setenv("SPECULUM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cmod, "CACHE_MIN_TOKENS", 10)
    cached.write_bytes(b"not a table")
    load_corpus.cache_clear()
    with caplog.at_level("WARNING", logger="speculum_ngram.corpus"):
        third = load_corpus(str(path), 2, 4, depth=3)
    assert "unreadable" in caplog.text
    assert [third.draft(c, 3) for c in ctxs] == [first.draft(c, 3) for c in ctxs]
    assert cmod.Corpus.load(cached).num_tokens == len(first)
    load_corpus.cache_clear()


def test_a_small_corpus_is_not_cached_and_an_unwritable_cache_is_only_a_warning(tmp_path, monkeypatch, caplog):
    from speculum_ngram import corpus as cmod
    monkeypatch.setenv("SPECULUM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "c.npy"
    np.save(path, np.array([1, 2, 3, 4, SEP, 2, 3, 5, SEP], dtype=np.int32))
    load_corpus.cache_clear()
    load_corpus(str(path), 2, 3, depth=2)
    assert not (tmp_path / "cache").exists()  # below CACHE_MIN_TOKENS
    monkeypatch.setattr(cmod, "CACHE_MIN_TOKENS", 1)
    (tmp_path / "cache").write_text("a file where the folder would go")
    load_corpus.cache_clear()
    with caplog.at_level("WARNING", logger="speculum_ngram.corpus"):
        c = load_corpus(str(path), 2, 3, depth=2)
    assert "not cached" in caplog.text and c.draft([9, 2, 3], 2) in ([4], [5])
    (tmp_path / "cache").unlink()  # a disk nearly full: not written either
    monkeypatch.setattr(cmod.shutil, "disk_usage", lambda p: types.SimpleNamespace(free=100))
    load_corpus.cache_clear()
    caplog.clear()
    with caplog.at_level("WARNING", logger="speculum_ngram.corpus"):
        load_corpus(str(path), 2, 3, depth=2)
    assert "MB free" in caplog.text and not list((tmp_path / "cache").rglob("*.npz"))
    load_corpus.cache_clear()
