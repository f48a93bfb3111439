"""benchmarks/fidelity_table.py: means over the prompts every policy ran, per budget."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "fidelity_table.py"
spec = importlib.util.spec_from_file_location("fidelity_table", SCRIPT)
fidelity_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fidelity_table)


def record(prompt_id, rows):
    return {"id": prompt_id, "results": [{"policy": p, "budget": b, **values} for p, b, values in rows]}


def write(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_a_prompt_one_policy_could_not_run_leaves_that_budgets_mean(tmp_path):
    a = record("a", [("streaming", "+64", {"kl_after_full": 0.1}), ("h2o", "+64", {"kl_after_full": 0.3}),
                     ("streaming", "+128", {"kl_after_full": 0.02}), ("h2o", "+128", {"kl_after_full": 0.04})])
    b = record("b", [("streaming", "+64", {"kl_after_full": 0.5}), ("h2o", "+64", {"error": "budget too small"}),
                     ("streaming", "+128", {"kl_after_full": 0.06}), ("h2o", "+128", {"kl_after_full": 0.08})])
    records = fidelity_table.load([write(tmp_path / "one.jsonl", [a]), write(tmp_path / "two.jsonl", [b, {"id": "c", "error": "x"}])])
    text = fidelity_table.table(records, ["streaming", "h2o"], ["+64", "+128"], ["kl_after_full"])
    lines = text.splitlines()
    # +64: only prompt a counts (h2o failed on b), so streaming's mean is 0.1, not (0.1 + 0.5) / 2
    assert lines[2] == "| `streaming` | 0.1000 | 0.0400 |"
    assert lines[3] == "| `h2o` | 0.3000 | 0.0600 |"
    assert lines[-1] == "Prompts in each mean: +64: 1, +128: 2 (of 2)."


def test_a_prompt_given_twice_is_refused(tmp_path):
    a = record("a", [("streaming", "+64", {"kl_after_full": 0.1})])
    with pytest.raises(SystemExit, match="appears twice"):
        fidelity_table.load([write(tmp_path / "one.jsonl", [a]), write(tmp_path / "two.jsonl", [a])])
