"""``bench serve --compare``: start a baseline and a speculative server, sweep both, plot.

Each server is a ``speculum serve`` subprocess on a free 127.0.0.1 port; they run one
after the other (never together), so they do not compete for the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(model: str | None, speculative_config: str | None, *, served_name: str, max_num_seqs: int,
           dtype: str = "auto", device: str = "auto", log_path: Path | None = None,
           startup_timeout_s: float = 600.0, extra_args: list[str] | None = None) -> Iterator[str]:
    """Run ``speculum serve`` in a subprocess until the block ends; yields its base URL."""
    port = _free_port()
    cmd = [sys.executable, "-m", "speculum.cli", "serve", *( [model] if model else []),
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", served_name,
           "--max-num-seqs", str(max_num_seqs), "--dtype", dtype, "--device", device,
           "--disable-access-log", *(extra_args or [])]
    if speculative_config:
        cmd += ["--speculative-config", speculative_config]
    log = open(log_path, "w") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, startup_timeout_s, log_path)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        if log_path:
            log.close()


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, log_path: Path | None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            where = f"; see {log_path}" if log_path else ""
            raise RuntimeError(f"the server ({' '.join(proc.args[3:6])}...) exited with {proc.returncode}{where}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server at {url} was not healthy after {timeout_s:.0f} s")


def plot(base: list[dict], spec, out_dir: Path, title: str = "") -> list[Path]:
    """Four PNGs: throughput vs TPOT, TTFT vs rate, TPOT vs rate, and throughput side by side.

    ``spec``: one sweep (runs of one speculative server) or ``[(label, runs), ...]``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if spec and isinstance(spec[0], dict):
        spec = [("speculation", spec)]
    out_dir.mkdir(parents=True, exist_ok=True)
    labels = [str(r["request_rate"]) for r in base]
    x = list(range(len(labels)))
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")
    markers = ("s", "^", "D", "v", "P", "X")
    series = [("baseline", base, "tab:gray", "o")] + [
        (name, runs, colors[i % len(colors)], markers[i % len(markers)]) for i, (name, runs) in enumerate(spec)]
    paths = []

    def save(fig, ax, name, xlabel, ylabel, categorical=True):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if categorical:
            ax.set_xticks(x, labels)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(name.replace("_", " ") + (f" ({title})" if title else ""), fontsize=10)
        fig.tight_layout()
        p = out_dir / f"{name}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, runs, color, marker in series:
        ax.plot([r["output_throughput"] for r in runs], [r["mean_tpot_ms"] or 0 for r in runs],
                marker=marker, color=color, label=name)
        for r in runs:
            ax.annotate(str(r["request_rate"]), (r["output_throughput"], r["mean_tpot_ms"] or 0), fontsize=7)
    save(fig, ax, "throughput_vs_tpot", "output throughput (tok/s)", "mean TPOT (ms)", categorical=False)

    for key, name, ylabel in (("mean_ttft_ms", "ttft_vs_rate", "mean TTFT (ms)"),
                              ("mean_tpot_ms", "tpot_vs_rate", "mean TPOT (ms)")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for sname, runs, color, marker in series:
            ax.plot(x, [r[key] or 0 for r in runs], marker=marker, color=color, label=sname)
        save(fig, ax, name, "request rate (req/s)", ylabel)

    fig, ax = plt.subplots(figsize=(6, 4))
    w = 0.8 / len(series)
    for i, (sname, runs, color, _m) in enumerate(series):
        off = (i - (len(series) - 1) / 2) * w
        ax.bar([j + off for j in x], [r["output_throughput"] for r in runs], w, color=color, label=sname)
    save(fig, ax, "baseline_vs_speculation", "request rate (req/s)", "output throughput (tok/s)")
    return paths


def write_json(path: str | Path, obj: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=2, default=str))
