"""``speculum bench serve`` against a real server: JSON keys, acceptance from /metrics, --compare."""

from __future__ import annotations

import json

import pytest

from speculum import LLM
from speculum.cli import main
from speculum.server.app import create_app
from speculum.server.runner import ServerThread

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4}'
RUN_KEYS = {"duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
            "output_throughput", "request_rate", "max_concurrency", "spec_decode",
            *(f"{s}_{m}_ms" for s in ("mean", "median", "p99") for m in ("ttft", "tpot", "itl", "e2el"))}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "prompts.jsonl"
    rows = [{"prompt": [5, 6, 7, 8, 5, 6, 7]}, {"prompt": [100, 200, 300, 100, 200]}, {"prompt": list(range(10, 30))}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _bench_args(dataset, out, *extra):
    return ["bench", "serve", "--endpoint", "completions", "--dataset", str(dataset), "--num-prompts", "6",
            "--max-tokens", "16", "--ignore-eos", "--extra-body", '{"return_token_ids": true}', "--warmup", "1",
            "--result-json", str(out), *extra]


def test_bench_serve_writes_results_with_acceptance(tiny_llama, dataset, tmp_path, capsys):
    llm = LLM(str(tiny_llama), speculative_config=NGRAM, dtype="float32", device="cpu", max_num_seqs=8)
    app = create_app(llm, model_names=["tiny"], log_interval_s=0)
    out = tmp_path / "result.json"
    with ServerThread(app) as server:
        rc = main(_bench_args(dataset, out, "--base-url", server.url, "--sweep", "inf,50", "--max-concurrency", "4"))
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["num_prompts"] == 6 and len(result["runs"]) == 2
    for run in result["runs"]:
        assert RUN_KEYS <= set(run), RUN_KEYS - set(run)
        assert run["completed"] == 6 and run["failed"] == 0
        assert run["total_output_tokens"] == 6 * 16
        assert run["mean_ttft_ms"] > 0 and run["mean_tpot_ms"] > 0 and run["mean_itl_ms"] > 0
        sd = run["spec_decode"]
        assert sd["requests"] == 6 and sd["generation_tokens"] == 6 * 16
        assert sd["num_draft_tokens"] > 0 and 0 <= sd["acceptance_rate"] <= 1
        assert sd["mean_acceptance_length"] >= 1
    assert [r["request_rate"] for r in result["runs"]] == [50.0, "inf"]
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Mean TPOT (ms)" in printed and "Draft acceptance rate" in printed


def test_bench_serve_compare_starts_both_servers_and_plots(tiny_llama, dataset, tmp_path, capsys):
    out = tmp_path / "compare.json"
    rc = main(_bench_args(dataset, out, "--compare", "--model", str(tiny_llama), "--speculative-config", NGRAM,
                          "--sweep", "inf,100", "--max-num-seqs", "4", "--dtype", "float32", "--device", "cpu",
                          "--server-log-dir", str(tmp_path / "logs")))
    assert rc == 0
    result = json.loads(out.read_text())
    assert len(result["baseline"]["runs"]) == len(result["speculative"]["runs"]) == 2
    assert result["baseline"]["runs"][0]["spec_decode"]["num_draft_tokens"] == 0
    assert result["speculative"]["runs"][0]["spec_decode"]["num_draft_tokens"] > 0
    metrics = [row["metric"] for row in result["comparison"]]
    assert metrics[:2] == ["TPOT (low load, rate 100.0)", "TPOT (high load, rate inf)"]
    assert "Acceptance rate" in metrics
    for name in ("throughput_vs_tpot", "ttft_vs_rate", "tpot_vs_rate", "baseline_vs_speculation"):
        png = tmp_path / f"{name}.png"
        assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "With speculation" in printed and "What it means" in printed


def test_bench_serve_compare_runs_several_configs_side_by_side(tiny_llama, dataset, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPECULUM_CACHE", str(tmp_path / "cache"))
    auto = '{"method": "ngram", "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size": "auto"}'
    out = tmp_path / "compare.json"
    rc = main(_bench_args(dataset, out, "--compare", "--model", str(tiny_llama), "--speculative-config", auto,
                          "--speculative-config", NGRAM, "--sweep", "inf,100", "--max-num-seqs", "4",
                          "--dtype", "float32", "--device", "cpu"))
    assert rc == 0
    result = json.loads(out.read_text())
    assert [c["label"] for c in result["configs"]] == ["ngram(auto,k<=4)", "ngram(k=4)"]
    assert result["speculative"]["runs"] == result["configs"][0]["runs"]
    for c in result["configs"]:
        assert len(c["throughput_ratio"]) == 2 and all(r > 0 for r in c["throughput_ratio"])
        steps = c["runs"][0]["spec_decode"]["steps_per_k"]
        assert sum(steps) > 0 and len(steps) == 5
    assert sum(result["configs"][1]["runs"][0]["spec_decode"]["steps_per_k"][:4]) == 0  # fixed k=4: only k=4
    printed = capsys.readouterr().out
    assert "output throughput against no speculation" in printed and "mean k" in printed


def test_bench_serve_compare_repeats_servers_in_turns_and_pools_them(tiny_llama, dataset, tmp_path, capsys):
    """--repeats 2: every server twice, in turns; each rate's two runs pooled as one
    (tokens and seconds summed, acceptance counters summed), both kept in the JSON."""
    out = tmp_path / "compare.json"
    rc = main(_bench_args(dataset, out, "--compare", "--model", str(tiny_llama), "--speculative-config", NGRAM,
                          "--sweep", "inf", "--max-num-seqs", "4", "--dtype", "float32", "--device", "cpu",
                          "--repeats", "2", "--server-log-dir", str(tmp_path / "logs")))
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["repeats"] == 2
    reps = result["repeat_runs"]
    assert set(reps) == {"baseline", "ngram(k=4)"} and all(len(v) == 2 for v in reps.values())
    for label, pooled in (("baseline", result["baseline"]["runs"][0]), ("ngram(k=4)", result["speculative"]["runs"][0])):
        runs = [sweep[0] for sweep in reps[label]]
        assert pooled["total_output_tokens"] == sum(r["total_output_tokens"] for r in runs)
        assert pooled["output_throughput"] == pytest.approx(
            sum(r["total_output_tokens"] for r in runs) / sum(r["duration"] for r in runs))
        assert pooled["output_throughput_per_repeat"] == [r["output_throughput"] for r in runs]
    spec = result["speculative"]["runs"][0]["spec_decode"]
    parts = [sweep[0]["spec_decode"] for sweep in reps["ngram(k=4)"]]
    assert spec["num_accepted_tokens"] == sum(p["num_accepted_tokens"] for p in parts) > 0
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_accepted_tokens"] / spec["num_drafts"])
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == \
        ["baseline-r2.log", "baseline.log", "speculative-r2.log", "speculative.log"]
    printed = capsys.readouterr().out
    assert "(2 repeats pooled)" in printed and "== repeat 2 alone" in printed


def _result(labels_cfgs, base_tps, spec_tps):
    return {"baseline": {"runs": [{"request_rate": r, "output_throughput": t} for r, t in base_tps]},
            "configs": [{"label": lab, "speculative_config": cfg,
                         "runs": [{"request_rate": r, "output_throughput": t, "spec_decode": {"steps_per_k": [1, 2]}}
                                  for (r, _), t in zip(base_tps, tps)],
                         "throughput_ratio": [t / b for (_, b), t in zip(base_tps, tps)]}
                        for (lab, cfg), tps in zip(labels_cfgs, spec_tps)]}


def test_load_check_verdicts(tmp_path):
    from speculum.bench.load_check import check, format_check, main as check_main
    auto = ("ngram(auto,k<=4)", {"method": "ngram", "num_speculative_tokens": 4,
                                 "num_speculative_tokens_per_batch_size": "auto"})
    fixed = [(f"ngram(k={k})", {"method": "ngram", "num_speculative_tokens": k}) for k in (1, 2, 3, 4)]
    sweep = _result([auto, fixed[3]], [(1.0, 100.0), ("inf", 1000.0)], [[120.0, 980.0], [125.0, 700.0]])
    c1 = _result([auto] + fixed, [("inf", 100.0)], [[118.0], [105.0], [112.0], [120.0], [119.0]])
    v = check(sweep, c1)
    assert v["sweep"]["worst_ratio"] == pytest.approx(0.98) and v["sweep"]["ok"]
    assert v["concurrency_1"]["best_fixed"] == "ngram(k=3)" and v["concurrency_1"]["auto_share_of_best"] == \
        pytest.approx(118 / 120) and v["ok"]
    assert "FAIL" not in format_check(v)
    bad = _result([auto, fixed[3]], [(1.0, 100.0), ("inf", 1000.0)], [[120.0, 900.0], [125.0, 700.0]])
    (tmp_path / "s.json").write_text(json.dumps(bad))
    (tmp_path / "c.json").write_text(json.dumps(c1))
    assert check_main([str(tmp_path / "s.json"), str(tmp_path / "c.json")]) == 1


@pytest.mark.parametrize("burst", [True, False])
def test_a_sweep_starts_with_an_uncounted_burst(tiny_llama, dataset, tmp_path, burst):
    """Before the timed runs, the prompts go out at once (up to --max-concurrency), so shapes
    first met at high load are captured before any run is timed; --no-warmup-burst skips it.
    Counted by the tokens the server generated: warm-up 1 x 8, burst 4 x 16, runs 6 x 16."""
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", max_num_seqs=8)
    app = create_app(llm, model_names=["tiny"], log_interval_s=0)
    out = tmp_path / "result.json"
    extra = [] if burst else ["--no-warmup-burst"]
    with ServerThread(app) as server:
        rc = main(_bench_args(dataset, out, "--base-url", server.url, "--sweep", "inf", "--max-concurrency", "4",
                              *extra))
    assert rc == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["completed"] == 6 and run["total_output_tokens"] == 6 * 16  # the burst is not in the results
    assert llm.num_generated_tokens == 8 + (4 * 16 if burst else 0) + 6 * 16


def test_num_prompts_per_rate(tiny_llama, dataset, tmp_path):
    """--num-prompts N1,N2 pairs with --sweep R1,R2 in the order given (runs come out low
    load first); a count list of another length is an error that says what to give."""
    from speculum.bench.cli import rate_counts
    from speculum.errors import ConfigError
    assert rate_counts([float("inf"), 50.0], [7]) == [(50.0, 7), (float("inf"), 7)]
    assert rate_counts([float("inf"), 50.0], [9, 4]) == [(50.0, 4), (float("inf"), 9)]
    with pytest.raises(ConfigError, match="one per rate of --sweep"):
        rate_counts([1.0, 2.0, 4.0], [3, 4])
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--num-prompts", "4,x"])
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", max_num_seqs=8)
    app = create_app(llm, model_names=["tiny"], log_interval_s=0)
    out = tmp_path / "result.json"
    with ServerThread(app) as server:
        args = _bench_args(dataset, out, "--base-url", server.url, "--sweep", "inf,50", "--no-warmup-burst")
        args[args.index("--num-prompts") + 1] = "5,2"
        assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["num_prompts"] == [2, 5]
    assert [(r["request_rate"], r["completed"]) for r in result["runs"]] == [(50.0, 2), ("inf", 5)]
