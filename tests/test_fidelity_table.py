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
    a = record(
        "a",
        [
            ("streaming", "+64", {"kl_after_full": 0.1}),
            ("h2o", "+64", {"kl_after_full": 0.3}),
            ("streaming", "+128", {"kl_after_full": 0.02}),
            ("h2o", "+128", {"kl_after_full": 0.04}),
        ],
    )
    b = record(
        "b",
        [
            ("streaming", "+64", {"kl_after_full": 0.5}),
            ("h2o", "+64", {"error": "budget too small"}),
            ("streaming", "+128", {"kl_after_full": 0.06}),
            ("h2o", "+128", {"kl_after_full": 0.08}),
        ],
    )
    records = fidelity_table.load(
        [write(tmp_path / "one.jsonl", [a]), write(tmp_path / "two.jsonl", [b, {"id": "c", "error": "x"}])]
    )
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


def test_wins_count_prompts_strictly_below_the_reference_among_those_both_ran(tmp_path):
    a = record(
        "a",
        [
            ("streaming", "+64", {"kl_after_full": 0.1}),
            ("epikv2", "+64", {"kl_after_full": 0.05}),
            ("h2o", "+64", {"kl_after_full": 0.1}),
        ],
    )
    b = record(
        "b",
        [
            ("streaming", "+64", {"kl_after_full": 0.2}),
            ("epikv2", "+64", {"kl_after_full": 0.3}),
            ("h2o", "+64", {"error": "budget too small"}),
        ],
    )
    c = record(
        "c",
        [
            ("streaming", "+64", {"kl_after_full": 0.4}),
            ("epikv2", "+64", {"kl_after_full": 0.1}),
            ("h2o", "+64", {"kl_after_full": 0.3}),
        ],
    )
    text = fidelity_table.wins([a, b, c], ["streaming", "epikv2", "h2o"], ["+64"], "streaming")
    # epikv2 is below on a and c (not b); h2o ties on a, is below on c, and did not run b
    assert text.splitlines() == [
        "| policy | below `streaming` +64 |",
        "|---|---:|",
        "| `epikv2` | 2 / 3 |",
        "| `h2o` | 1 / 2 |",
    ]


def test_wins_against_a_policy_not_in_the_files_is_refused(tmp_path, capsys):
    path = write(tmp_path / "one.jsonl", [record("a", [("streaming", "+64", {"kl_after_full": 0.1})])])
    assert fidelity_table.main([str(path), "--wins", "h2o"]) == 2
    assert "no such policy" in capsys.readouterr().err


def test_the_references_repetition_is_summarised_when_recorded(tmp_path):
    rows = [("streaming", "+64", {"kl_after_full": 0.1})]
    records = [
        {**record(name, rows), "reference_repeats": share} for name, share in (("a", 0.2), ("b", 0.9), ("c", 0.4))
    ]
    line = fidelity_table.repetition(records)
    assert line.endswith("mean 0.500, median 0.400, from 0.200 to 0.900 over 3 prompts.")
    assert fidelity_table.repetition([record("a", rows)]) is None  # files written before the field existed
