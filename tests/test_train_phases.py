"""``speculum train --profile-steps N``: each phase's time lands in its own phase, and profiling
does not change what is trained. Tiny random target, token-id prompts, CPU (fp32)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from speculum.cli import main
from speculum.testing import token_prompts_file
from speculum.train.phases import PHASES, SKIP, StepPhases

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run_steps(phases: StepPhases, n: int, sleeps: dict[str, float]) -> None:
    for _ in range(n):
        for p in PHASES:
            with phases.phase(p):
                time.sleep(sleeps.get(p, 0.0))
        time.sleep(sleeps.get("other", 0.0))
        phases.end_step()


def test_each_phase_gets_its_own_time():
    sleeps = {"batch": 0.03, "backward": 0.015, "other": 0.01}
    phases = StepPhases(3, "cpu")
    run_steps(phases, SKIP + 5, sleeps)  # steps past the profiled ones are not timed
    r = phases.result
    assert r is not None and r["steps"] == 3
    assert list(r) == ["steps", *PHASES, "other", "step"]
    # lower bounds from the sleeps; the phases that slept nothing stay well under the one that slept
    # most (medians of three, so a busy machine's odd slow step does not decide)
    assert r["batch"] >= 30 and r["backward"] >= 15 and r["other"] >= 10
    assert r["forward"] < r["batch"] / 2 and r["optimizer"] < r["batch"] / 2
    assert r["step"] >= r["batch"] + r["backward"] + r["other"] - 1
    assert all(len(t) == 3 for t in phases.times.values())


def test_a_run_shorter_than_asked_reports_the_steps_it_profiled():
    phases = StepPhases(10, "cpu")
    run_steps(phases, SKIP + 3, {"batch": 0.005})
    assert phases.result is None
    phases.finish()
    assert phases.result["steps"] == 3 and phases.result["batch"] >= 5
    empty = StepPhases(10, "cpu")
    run_steps(empty, SKIP, {})  # nothing past the skipped steps: nothing to report
    empty.finish()
    assert empty.result is None


def test_off_by_default_times_nothing():
    phases = StepPhases(0, "cpu")
    run_steps(phases, 4, {"batch": 0.001})
    assert phases.result is None and not any(phases.times.values())


def test_training_reports_its_phases_and_trains_the_same(tiny_llama, tmp_path):
    from safetensors.torch import load_file

    prompts = token_prompts_file(tmp_path / "prompts.jsonl", n=24)

    def run(out, *extra):
        assert main(["train", "mtp", "--model", str(tiny_llama), "--prompts", str(prompts), "--num-prompts", "10",
                     "--max-tokens", "12", "--device", "cpu", "--cache-dir", str(tmp_path / "c"), "--out",
                     str(tmp_path / out), "--steps", "5", "--batch-size", "4", "--eval-every", "0", "--warmup", "1",
                     "--states", "online", *extra]) == 0
        return (load_file(str(tmp_path / out / "model.safetensors")),
                json.loads((tmp_path / out / "training.json").read_text()))

    w_plain, r_plain = run("plain")
    w_prof, r_prof = run("profiled", "--profile-steps", "2")
    assert "step_phases_ms" not in r_plain
    ph = r_prof["step_phases_ms"]
    assert ph["steps"] == 2 and set(ph) == {"steps", *PHASES, "other", "step"}
    assert all(ph[p] >= 0 for p in (*PHASES, "other")) and ph["step"] > 0
    assert ph["batch"] > 0  # the online states: a prefill of the batch through the target
    for k in w_plain:  # synchronising between phases changes no result
        torch.testing.assert_close(w_prof[k], w_plain[k], atol=0, rtol=0)
