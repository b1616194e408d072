"""scripts/cpu_step_cost.py on the tiny model: a row per dtype, a figure per q, JSON written."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "cpu_step_cost.py"


def test_cpu_step_cost_writes_a_figure_per_dtype_and_q(tiny_llama, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("cpu_step_cost", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "cost.json"
    assert mod.main(["--model", str(tiny_llama), "--dtypes", "float32", "--query-lens", "1,3", "--iters", "2",
                     "--threads", "1", "--unpacked", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["ms"]
    assert set(rows) == {"float32", "float32 F.linear"}  # oneDNN's packed weights, and F.linear in the same run
    assert all(set(ms) == {"1", "3"} and all(v > 0 for v in ms.values()) for ms in rows.values())
    assert "q=3" in capsys.readouterr().out
    assert "SPECULUM_GEMM_TUNE" not in os.environ  # the switch was put back
