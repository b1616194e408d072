"""The device scripts' bookkeeping, on the CPU: which checkpoint each method of
``scripts/device/train_heads.sh`` starts from, and ``scripts/device/tree.sh``'s round trip
(what a device call's tree carries; a commit after ``restore`` must hold every head).

A mistake here costs a device call (ten minutes of a thirty-minute session) or a commit
without the shipped heads, so it is checked where it is cheap."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAIN_HEADS = ROOT / "scripts" / "device" / "train_heads.sh"
EAGLE_HEAD = "plugins/speculum-eagle/speculum_eagle/heads/eagle-smollm2-135m-instruct"
MTP_HEAD = "plugins/speculum-mtp/speculum_mtp/heads/mtp-smollm2-135m-instruct"
MEDUSA_HEAD = "plugins/speculum-medusa/speculum_medusa/heads/medusa-smollm2-135m-instruct"
DRAFT = "plugins/speculum-draft-model/speculum_draft_model/drafts/draft-smollm2-135m-instruct"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("git") is None,
                                reason="needs bash and git")


def run_excerpt(tmp_path: Path, start: str, end: str, stubs: dict[str, str], env: dict, unset=(), tail: str = ""):
    """Run train_heads.sh's lines from the one beginning ``start`` up to ``end`` (plus ``tail``)
    in bash from the checkout, with stub commands (name -> bash body) first on PATH and ``env``
    over this process's environment, less the ``unset`` names."""
    text = TRAIN_HEADS.read_text()
    (tmp_path / "excerpt.sh").write_text(text[text.index(start):text.index(end)] + tail)
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    for name, body in stubs.items():
        (bin_ / name).write_text("#!/usr/bin/env bash\n" + body)
        (bin_ / name).chmod(0o755)
    full = {k: v for k, v in os.environ.items() if k not in unset}
    full.update({"PATH": f"{bin_}:{os.environ['PATH']}", **{k: str(v) for k, v in env.items()}})
    return subprocess.run(["bash", str(tmp_path / "excerpt.sh")], cwd=ROOT, env=full, capture_output=True, text=True)


def launch_loop(tmp_path: Path, **env) -> dict[str, list[str]]:
    """Run train_heads.sh's trainer launches (the lines from ``PIDS=()`` to the wait) with a
    stub ``speculum`` that records its arguments; returns each method's arguments by its output
    folder's name."""
    calls = tmp_path / "calls"
    calls.write_text("")
    tr = tmp_path / "tr"
    tr.mkdir(exist_ok=True)
    out = run_excerpt(tmp_path, "PIDS=()", 'for p in "${PIDS[@]}"', {"speculum": f'echo "$*" >> {calls}\n'},
                      {"TR": tr, "T": "", "SHAPE": "", "EMB": "", **env}, tail="wait\n")
    assert out.returncode == 0, out.stderr
    found = {}
    for line in calls.read_text().splitlines():
        args = line.split()
        found[Path(args[args.index("--out") + 1]).name] = args
    return found


def shipped_config(head: str) -> dict:
    """config.json of a head (or draft) shipped in this checkout."""
    return json.loads((ROOT / head / "config.json").read_text())


def init_of(args: list[str]) -> str | None:
    return args[args.index("--init-from") + 1] if "--init-from" in args else None


HEADS_SHIPPED = pytest.mark.skipif(not all((ROOT / h / "config.json").exists() for h in (EAGLE_HEAD, MTP_HEAD, MEDUSA_HEAD)),
                                   reason="the shipped heads are not in this checkout")


def option(args: list[str], name: str, default: str | None = None) -> str | None:
    return args[len(args) - 1 - args[::-1].index(name) + 1] if name in args else default  # the last one wins


@HEADS_SHIPPED
def test_the_default_entries_train_the_kinds_shipped(tmp_path):
    """train_heads.sh's default methods continue the shipped heads (INIT_FROM_SHIPPED=1) with the
    options their kind needs, read from the shipped configs: as many EAGLE-1 or MTP layers, sequential
    or token-aware Medusa heads as shipped. (The trainers refuse a mismatch, e.g. a two-layer head
    continued with --num-layers 1, but only after a device call has started.)"""
    runs = launch_loop(tmp_path, METHODS="eagle medusa mtp eagle2 eaglece medusa4 medusatok mtp2 mtp6 medusapre mtpregled",
                       INIT_FROM_SHIPPED=1)
    eagle = shipped_config(EAGLE_HEAD)
    assert init_of(runs["eagle"]) == EAGLE_HEAD
    assert option(runs["eagle"], "--num-layers", "1") == str(eagle["num_hidden_layers"])
    assert (option(runs["eagle"], "--ce-weight"), option(runs["eagle"], "--reg-weight")) == ("1", "0.1")
    medusa = shipped_config(MEDUSA_HEAD)
    for m in ("medusa", "medusa4"):
        assert init_of(runs[m]) == MEDUSA_HEAD
        assert ("--prefix-layer" in runs[m]) == bool(medusa.get("speculum_prefix_layer"))
        assert ("--sequential" in runs[m]) == bool(medusa.get("speculum_sequential"))
        assert ("--sequential" in runs[m] or "--token-input" in runs[m]) == bool(medusa.get("speculum_token_input"))
    assert int(option(runs["medusa"], "--num-layers")) == medusa["medusa_num_layers"]
    assert init_of(runs["mtp"]) == MTP_HEAD
    mtp = shipped_config(MTP_HEAD)
    assert option(runs["mtp"], "--num-layers", "1") == str(mtp.get("speculum_mtp_num_layers", 1))
    assert init_of(runs["mtp2"]) == MTP_HEAD and option(runs["mtp2"], "--num-layers") == "2"  # grown
    assert init_of(runs["mtp6"]) == MTP_HEAD and option(runs["mtp6"], "--num-positions") == "6"  # continued
    assert init_of(runs["mtpregled"]) == MTP_HEAD  # continued regression-led, as many layers as shipped
    assert option(runs["mtpregled"], "--num-layers", "1") == str(mtp.get("speculum_mtp_num_layers", 1))
    assert (option(runs["mtpregled"], "--reg-weight"), option(runs["mtpregled"], "--ce-weight")) == ("1", "0.1")
    assert init_of(runs["medusapre"]) == MEDUSA_HEAD and "--prefix-layer" in runs["medusapre"]  # grown
    assert ("--prefix-layer" in runs["medusa"]) == bool(medusa.get("speculum_prefix_layer"))
    # variants the shipped heads cannot be grown into start from scratch (or INIT_DIR)
    if eagle["num_hidden_layers"] > 1:
        assert init_of(runs["eaglece"]) is None
    if medusa.get("speculum_sequential"):
        assert init_of(runs["medusatok"]) is None
    assert init_of(runs["eagle2"]) == EAGLE_HEAD and option(runs["eagle2"], "--num-layers") == "2"
    assert all(option(r, "--loss-vocab") == "0" for r in runs.values())


@HEADS_SHIPPED
def test_each_method_starts_where_asked(tmp_path):
    """INIT_FROM_SHIPPED: each head from the head shipped for its method, the draft from the draft
    shipped (the draft-model plugin's ``drafts/``), a method with nothing shipped from scratch;
    every one of these on the whole vocabulary. INIT_DIR (an earlier call's
    output) wins where it has the method; DRAFT_INIT wins for the draft; ARGS_<method> are that
    trainer's own options."""
    runs = launch_loop(tmp_path, METHODS="eagle eagle2 mtp medusaseq draft", INIT_FROM_SHIPPED=1)
    assert set(runs) == {"eagle", "eagle2", "mtp", "medusaseq", "draft"}
    medusa = shipped_config(MEDUSA_HEAD)
    # the sequential heads alone: grown from the shipped ones unless those have a prefix layer (no part is dropped)
    assert init_of(runs["medusaseq"]) == (None if medusa.get("speculum_prefix_layer") else MEDUSA_HEAD)
    assert "--sequential" in runs["medusaseq"]
    assert init_of(runs["eagle"]) == init_of(runs["eagle2"]) == EAGLE_HEAD
    assert runs["eagle2"][:2] == ["train", "eagle"] and option(runs["eagle2"], "--num-layers") == "2"
    assert init_of(runs["mtp"]) == MTP_HEAD
    assert init_of(runs["draft"]) == (DRAFT if (ROOT / DRAFT / "config.json").exists() else None)
    assert all(option(r, "--loss-vocab") == "0" for r in runs.values())  # the whole vocabulary
    runs = launch_loop(tmp_path, METHODS="draft3", INIT_FROM_SHIPPED=1)
    assert init_of(runs["draft3"]) == (DRAFT if (ROOT / DRAFT / "config.json").exists() else None)
    assert option(runs["draft3"], "--num-layers") == "3" and runs["draft3"][:2] == ["train", "draft"]
    runs = launch_loop(tmp_path, METHODS="eagle3own", INIT_FROM_SHIPPED=1)
    assert init_of(runs["eagle3own"]) is None  # a kind the shipped head cannot be continued into: from scratch
    # ARGS_<method>: that trainer's own options, after the shared ones (argparse: the last wins)
    runs = launch_loop(tmp_path, METHODS="mtp medusaseq", T="--lr 2e-4", ARGS_medusaseq="--lr 1e-3")
    assert runs["mtp"].count("--lr") == 1 and runs["mtp"][runs["mtp"].index("--lr") + 1] == "2e-4"
    lrs = [runs["medusaseq"][i + 1] for i, a in enumerate(runs["medusaseq"]) if a == "--lr"]
    assert lrs == ["2e-4", "1e-3"]

    earlier = tmp_path / "earlier"
    for m in ("eagle2", "draft"):
        (earlier / m).mkdir(parents=True)
        (earlier / m / "config.json").write_text("{}")
    runs = launch_loop(tmp_path, METHODS="eagle2 mtp draft", INIT_FROM_SHIPPED=1, INIT_DIR=earlier)
    assert init_of(runs["eagle2"]) == str(earlier / "eagle2")
    assert init_of(runs["mtp"]) == MTP_HEAD  # nothing of it in INIT_DIR: the shipped head
    assert init_of(runs["draft"]) == str(earlier / "draft")
    runs = launch_loop(tmp_path, METHODS="draft", INIT_DIR=earlier, DRAFT_INIT=tmp_path / "mine")
    assert init_of(runs["draft"]) == str(tmp_path / "mine")


def test_a_call_is_refused_to_continue_from_its_own_output(tmp_path):
    """INIT_DIR equal to TR would read the checkpoints the call overwrites: refused before
    anything runs, with what to do."""
    env = {**os.environ, "M": str(tmp_path / "model.gguf"), "OUT": str(tmp_path), "SPECULUM_CACHE": str(tmp_path / "sc"),
           "TR": str(tmp_path / "tr"), "INIT_DIR": str(tmp_path / "tr") + "/"}
    out = subprocess.run(["bash", str(TRAIN_HEADS)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "give the call another TR" in out.stdout


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout


def test_tree_round_trip_leaves_every_head_tracked(tmp_path):
    """tree.sh in a repository laid out like this one: ``small`` leaves the heads, drafts,
    results and corpora out of the tree (and ignored, so the device's copy lacks them), ``heads``
    brings the heads and drafts back alone, ``restore`` leaves the index as committed and the
    ignore file as it was (a commit then holds every head)."""
    repo = tmp_path / "repo"
    files = ["core/a.py", "plugins/speculum-eagle/speculum_eagle/heads/h/config.json",
             "plugins/speculum-draft-model/speculum_draft_model/drafts/d/config.json", "docs/results/r.json",
             "plugins/speculum-ngram/speculum_ngram/corpora/c.npy", "docs/guide.md"]
    for f in files:
        (repo / f).parent.mkdir(parents=True, exist_ok=True)
        (repo / f).write_text(f)
    (repo / "scripts" / "device").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "device" / "tree.sh", repo / "scripts" / "device" / "tree.sh")
    git(repo, "init", "-q")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "add", ".")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "all")
    exclude = repo / ".git" / "info" / "exclude"
    exclude_before = exclude.read_text() if exclude.exists() else ""

    def run(mode):
        out = subprocess.run(["bash", "scripts/device/tree.sh", mode], cwd=repo, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return set(git(repo, "ls-files").split()), set(git(repo, "status", "--porcelain", "--untracked-files=all").split("\n"))

    tracked, status = run("small")
    assert tracked == {"core/a.py", "docs/guide.md", "scripts/device/tree.sh"}
    assert not any(line.startswith("??") for line in status)  # the rest is ignored, not merely untracked
    tracked, _ = run("heads")
    assert tracked == {"core/a.py", "docs/guide.md", "scripts/device/tree.sh", files[1], files[2]}
    tracked, status = run("restore")
    assert tracked == set(files) | {"scripts/device/tree.sh"}
    assert status == {""}  # nothing staged, nothing untracked
    assert (exclude.read_text() if exclude.exists() else "") == exclude_before


def trainers_guard(tmp_path: Path, gpu_mib: int | None, **env) -> subprocess.CompletedProcess:
    """Run train_heads.sh's check of how many trainers fit the GPU, with a stub ``nvidia-smi``
    reporting ``gpu_mib`` MiB (None: one that fails, as on a machine without a GPU)."""
    return run_excerpt(tmp_path, "# METHODS: which trainers", "# answers generated in an earlier call",
                       {"nvidia-smi": "exit 1\n" if gpu_mib is None else f"echo {gpu_mib}\n"}, env,
                       unset=("METHODS", "MAX_TRAINERS", "PREP_ONLY", "DATA_ONLY"))


def test_more_trainers_than_the_gpu_holds_are_refused_before_any_work(tmp_path):
    """Four trainers on an 80 GB H100 (the fourth ran out of memory at its first step,
    2026-12-05) are refused at once with what to do; three run; an H200 (141 GB) takes the
    default five; MAX_TRAINERS overrides; calls that train nothing (PREP_ONLY, DATA_ONLY) and
    machines without nvidia-smi are not checked."""
    h100, h200 = 81559, 143771
    four = "draft draft3 medusapre mtp6"
    refused = trainers_guard(tmp_path, h100, METHODS=four)
    assert refused.returncode == 2 and "holds about 3" in refused.stdout and "MAX_TRAINERS=4" in refused.stdout
    assert trainers_guard(tmp_path, h100, METHODS="draft draft3 medusa").returncode == 0
    assert trainers_guard(tmp_path, h100).returncode == 2  # the default five
    assert trainers_guard(tmp_path, h200).returncode == 0
    assert trainers_guard(tmp_path, h100, METHODS=four, MAX_TRAINERS=4).returncode == 0
    assert trainers_guard(tmp_path, h100, PREP_ONLY=1).returncode == 0
    assert trainers_guard(tmp_path, h100, DATA_ONLY=1).returncode == 0
    assert trainers_guard(tmp_path, None, METHODS=four).returncode == 0
