"""scripts/ngram_ceiling.py: the replay counts steps as lossless greedy speculation would."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("speculum_ngram")
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ngram_ceiling.py"


def _module():
    spec = importlib.util.spec_from_file_location("ngram_ceiling", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_replay_counts_steps_by_hand():
    mod = _module()
    # prompt 1 2 3 4, answer 1 2 3 4 9. Lookup n = 2..5, k = 2: no earlier "4" (step 1
    # emits 1); no earlier [4, 1] (step 2 emits 2); [1, 2] ends at 1: draft [3, 4], both
    # accepted, then 9 (step 3: 3 tokens)
    data = [{"category": "x", "prompt": [1, 2, 3, 4], "output": [1, 2, 3, 4, 9]}]
    r = mod.replay(data, 2, 5, 2)
    assert (r["steps"], r["tokens"]) == (3, 5)
    assert r["tokens_per_forward"] == pytest.approx(5 / 3) and r["drafting_share"] == pytest.approx(1 / 3)
    # n = 1..5: step 2 matches [1] alone: draft [2, 3] accepted, then 4; step 3 drafts [1, 2]
    # after [1, 2, 3, 4], rejected by 9
    r = mod.replay(data, 1, 5, 2)
    assert (r["steps"], r["tokens"], r["drafting_share"]) == (3, 5, pytest.approx(2 / 3))


def test_the_command_replays_saved_answers(tmp_path, capsys):
    mod = _module()
    answers = tmp_path / "a.json"
    answers.write_text(json.dumps({"answers": [{"category": "x", "prompt": [5, 6, 7], "output": [5, 6, 7, 5, 6]}]}))
    out = tmp_path / "out.json"
    assert mod.main(["--outputs", str(answers), "--json", str(out), "-k", "2"]) == 0
    rows = json.loads(out.read_text())["replay"]
    assert [(r["n_min"], r["n_max"], r["k"]) for r in rows] == [(2, 5, 2), (1, 5, 2), (3, 5, 2), (2, 8, 2)]
    assert "tokens/forward" in capsys.readouterr().out


def test_tree_replay_takes_the_longest_path_of_several_continuations(tmp_path):
    mod = _module()
    # "1 2" occurred twice, followed by 3 then by 4: the chain drafts the latest (4 ...), the
    # answer goes on with 3 7: a tree of both continuations accepts [3, 7]
    data = [{"category": "x", "prompt": [1, 2, 3, 7, 0, 1, 2, 4, 5, 0, 1, 2], "output": [3, 7, 9]}]
    assert mod.continuations(data[0]["prompt"], 2, 5, 2, 4) == [(4, 5), (3, 7)]
    chain = mod.replay(data, 2, 5, 2)
    assert (chain["steps"], chain["tokens"]) == (2, 3)  # [4, 5] rejected; then "2 3" drafts [7, 0]: 7, 9
    tree = mod.replay_tree(data, 2, 5, 2, 4, 32)
    assert (tree["steps"], tree["tokens"]) == (1, 3) and tree["mean_nodes"] == 4
    # one candidate and the chain agree; a budget of 3 nodes keeps only the first path
    one = mod.replay_tree(data, 2, 5, 2, 1, 32)
    assert (one["steps"], one["tokens"]) == (chain["steps"], chain["tokens"])
    assert mod.replay_tree(data, 2, 5, 2, 4, 3)["steps"] == 2
    assert mod.trie_nodes([(1, 2), (1, 3), (4,)]) == 4


def test_answers_cache_replays_its_greedy_first_turns(tmp_path):
    """--answers-cache: the greedy first turns (kind 0) of an answers cache, cut at --max-tokens;
    second turns and sampled answers left out."""
    np = pytest.importorskip("numpy")
    from safetensors.numpy import save_file
    mod = _module()
    save_file({"tokens": np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3], dtype=np.int32),
               "offsets": np.array([0, 5, 9, 12]), "prompt_lens": np.array([2, 1, 1], dtype=np.int32),
               "prompt_index": np.array([0, 0, 1], dtype=np.int32),
               "kind": np.array([0, 4, 0], dtype=np.int32), "temperature": np.array([0, 0, 0.7], dtype=np.float32)},
              str(tmp_path / "shard_00000.safetensors"))
    (tmp_path / "meta.json").write_text(json.dumps({"shards": ["shard_00000.safetensors"]}))
    assert mod.from_cache(str(tmp_path), 2) == [{"category": None, "prompt": [1, 2], "output": [3, 4]}]
