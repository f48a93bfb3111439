"""`epikv eval`: answers in several LaTeX forms judged by math-verify, intervals, the summary and resume."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from epikv_cli.cli.app import app
from epikv_cli.experiments import evaluate
from epikv_cli.experiments.evaluate import is_correct, last_boxed, model_answer, reference_answer, wilson

runner = CliRunner()


@pytest.mark.parametrize(
    "output, reference, correct",
    [
        (r"so the answer is \boxed{4}.", "4", True),
        (r"\boxed{\frac{1}{2}}", "0.5", True),
        (r"\boxed{0.5}", r"\frac12", True),
        (r"\boxed{(3,\frac{\pi}{2})}", r"\left( 3, \frac{\pi}{2} \right)", True),
        (r"\boxed{10\sqrt{2}}", r"10\sqrt2", True),
        (r"first \boxed{3} then, correcting, \boxed{\dfrac{7}{2}}", "3.5", True),  # the last box counts
        (r"\boxed{\text{Evelyn}}", r"\text{Evelyn}", True),
        (r"\boxed{x^2+2x}", "x^2 + 2x", True),
        (r"\boxed{5}", "6", False),
        ("The answer is 4.", "4", False),  # no box: no answer
        ("She makes 9 * 2 = 18 dollars.\n#### 18", "Janet sells 16 - 3 - 4 = 9 eggs.\n#### 18", True),  # GSM8K forms
        (r"\boxed{1,000}", "#### 1000", True),
    ],
)
def test_answers_in_several_forms(output, reference, correct):
    assert is_correct(model_answer(output), reference_answer(reference)) is correct


def test_boxes_with_nested_braces():
    assert last_boxed(r"\boxed{\frac{a}{b^{2}}} and \boxed{x_{1}}") == "x_{1}"
    assert last_boxed(r"\boxed{unclosed") is None and last_boxed("none") is None


def test_wilson_interval_by_hand():
    low, high = wilson(7, 10)  # p = 0.7, n = 10, z = 1.96: the textbook 0.3968 to 0.8922
    assert low == pytest.approx(0.3968, abs=1e-4) and high == pytest.approx(0.8922, abs=1e-4)
    assert wilson(0, 5)[0] == 0.0 and math.isnan(wilson(0, 0)[0])
    # none or all correct: the bound is exactly 0 or 1, never the 5.55e-17 the float sum leaves (n = 3, 6, 7, ...)
    assert {wilson(0, n)[0] for n in range(1, 200)} == {0.0} and {wilson(n, n)[1] for n in range(1, 200)} == {1.0}


class ScriptedGeneration:
    """Stands in for the engine: answers each problem with a scripted text (a tiny random model cannot reason)."""

    answers: dict = {}

    def __init__(self, model, tokenizer, input_ids, cache, sampling):
        self.text = next(text for needle, text in self.answers.items() if needle in tokenizer.decode(input_ids[0]))
        self.sampling = sampling

    def __iter__(self):
        self.result = SimpleNamespace(
            text=self.text,
            prompt_tokens=10,
            generated_tokens=len(self.text),
            stop_reason="eos",
            decode_tokens_per_s=20.0,
        )
        return iter(())


def test_eval_end_to_end_with_scripted_answers(tiny_model_dir, tmp_path, monkeypatch):
    data = tmp_path / "set.jsonl"
    rows = [
        {"problem": "Compute 1/2 + 1/4.", "answer": r"\frac{3}{4}"},
        {"problem": "What is 6 times 7?", "answer": "42"},
        {"question": "How many legs do 3 cats have?", "answer": "Each cat has 4 legs.\n#### 12"},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ScriptedGeneration.answers = {
        "1/2 + 1/4": r"so \boxed{0.75}",
        "6 times 7": r"\boxed{41}",
        "3 cats": "3 * 4 = 12\n#### 12",
    }
    monkeypatch.setattr(evaluate, "Generation", ScriptedGeneration)
    out = tmp_path / "eval.jsonl"
    args = [
        "eval",
        "--model",
        str(tiny_model_dir),
        "--dataset",
        str(data),
        "--policies",
        "full,streaming",
        "--budgets",
        "+64",
        "-n",
        "16",
        "-o",
        str(out),
        "--json",
        "-q",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    summary = {r["policy"]: r for r in json.loads(result.stdout)["results"]}
    assert (
        summary["full"]["correct"] == 2
        and summary["full"]["problems"] == 3
        and summary["full"]["accuracy"] == pytest.approx(2 / 3)
    )
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], r["policy"], r["correct"]) for r in lines] == [
        (1, "full", True),
        (1, "streaming", True),
        (2, "full", False),
        (2, "streaming", False),
        (3, "full", True),
        (3, "streaming", True),
    ]
    assert lines[2]["prediction"] == "41" and lines[2]["reference"] == "42"
    resumed = runner.invoke(app, [*args[:-4], "-o", str(out), "--resume", "--json", "-q"])
    assert resumed.exit_code == 0 and len(out.read_text().splitlines()) == 6  # nothing ran twice
    shorter = [*args[:-4], "-o", str(out), "--resume", "--json", "-q"]
    shorter[shorter.index("-n") + 1] = "8"  # -n 8 over -n 16 results: the summary would mix both
    refused = runner.invoke(app, shorter)
    assert refused.exit_code == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "max_new_tokens = 16, this run has max_new_tokens = 8" in refused.stderr


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--dataset", "math500"], "Hugging Face Hub"),
        (["--dataset", "DATA", "--answer-field", "solution"], "no 'solution' field"),
        (["--dataset", "DATA", "--limit", "0"], "--limit must be at least 1"),
        (["--dataset", "DATA", "--budgets", "+x"], "is not a budget"),
        (
            ["--dataset", "/no/such.jsonl"],
            "--dataset /no/such.jsonl: file not found; give a JSONL file with a question",
        ),
        (["--dataset", "DUPLICATES"], "lines 1 and 2 have the same id 7"),
        (["--dataset", "DATA", "--budgets", "64,64"], "--budgets lists 64 twice"),
    ],
)
def test_bad_input(tiny_model_dir, tmp_path, args, needle):
    data = tmp_path / "set.jsonl"
    data.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    duplicates = tmp_path / "dup.jsonl"
    duplicates.write_text('{"id": 7, "problem": "1+1?", "answer": "2"}\n{"id": 7, "problem": "2+2?", "answer": "4"}\n')
    args = [str(data) if a == "DATA" else str(duplicates) if a == "DUPLICATES" else a for a in args]
    result = runner.invoke(app, ["eval", "--model", str(tiny_model_dir), "-n", "4", *args])
    assert result.exit_code == 2 and needle in result.stderr and len(result.stderr.strip().splitlines()) == 1, (
        result.stderr
    )


def test_batched_eval_gives_the_same_records(tiny_model_dir, tmp_path):
    data = tmp_path / "set.jsonl"
    data.write_text(
        "".join(json.dumps({"problem": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n" for i in range(4))
    )
    outputs = []
    for batch in ("1", "3"):
        out = tmp_path / f"eval{batch}.jsonl"
        result = runner.invoke(
            app,
            [
                "eval",
                "--model",
                str(tiny_model_dir),
                "--dataset",
                str(data),
                "--policies",
                "full,epikv",
                "--budgets",
                "+12",
                "-n",
                "20",
                "-o",
                str(out),
                "--batch-size",
                batch,
                "-q",
            ],
        )
        assert result.exit_code == 0, result.stderr
        rows = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: (r["id"], r["policy"]))
        outputs.append([(r["id"], r["policy"], r.get("text"), r.get("error")) for r in rows])
    assert outputs[0] == outputs[1] and len(outputs[0]) == 8
