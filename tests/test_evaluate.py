"""`epikv eval`: answers in several LaTeX forms judged by math-verify, intervals, the summary and resume."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from epikv_cli.cli import evaluate as eval_cli
from epikv_cli.cli.app import app
from epikv_cli.errors import UsageError
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
        if isinstance(self.text, Exception):  # scripted to fail as a budget too small for the prompt does
            raise self.text
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


def test_batched_eval_gives_the_same_records(tiny_model_dir, tmp_path, monkeypatch):
    """Batched, and batched with a step that runs out of memory (the unfinished problems then run one at a time, as
    batch files do): the records of one at a time."""
    from epikv_cli.runtime import batched

    data = tmp_path / "set.jsonl"
    data.write_text(
        "".join(json.dumps({"problem": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n" for i in range(4))
    )
    real, calls = batched.BatchDecoder.forward, []

    def failing(self, tokens):
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory in a batched step")
        return real(self, tokens)

    outputs = []
    for batch in ("1", "3", "3"):
        if len(outputs) == 2:
            monkeypatch.setattr(batched.BatchDecoder, "forward", failing)
        out = tmp_path / f"eval{len(outputs)}.jsonl"
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
    assert outputs[0] == outputs[1] == outputs[2] and len(outputs[0]) == 8
    assert len(calls) == 3  # the third batched step failed; the rest ran one at a time


THREE = [
    {"problem": "What is 6 times 7?", "answer": "42"},
    {"problem": "What is 1 plus 1?", "answer": "2"},
    {"problem": "What is 3 minus 3?", "answer": "0"},
]


def scripted_eval(tiny_model_dir, tmp_path, monkeypatch, answers: dict, rows=THREE):
    """A dataset of ``rows``, scripted ``answers`` and ``run(*extra)``: ``epikv eval --json`` with policy full into
    ``out``; returns (run, out)."""
    data = tmp_path / "set.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ScriptedGeneration.answers = answers
    monkeypatch.setattr(evaluate, "Generation", ScriptedGeneration)
    out = tmp_path / "eval.jsonl"

    def run(*extra: str):
        args = ["eval", "--model", str(tiny_model_dir), "--dataset", str(data), "--policies", "full", "-n", "8"]
        return runner.invoke(app, [*args, "-o", str(out), "--json", "-q", *extra])

    return run, out


def lines_of(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


RIGHT = {"6 times 7": r"\boxed{42}", "1 plus 1": r"\boxed{2}", "3 minus 3": r"\boxed{1}"}


def test_resume_after_a_line_cut_short_rewrites_the_file(tiny_model_dir, tmp_path, monkeypatch):
    """A crash left half a line without its newline: the resumed records went onto its end, and the next --resume
    refused the file."""
    run, out = scripted_eval(tiny_model_dir, tmp_path, monkeypatch, RIGHT)
    assert run("--limit", "1").exit_code == 0
    with out.open("a") as file:
        file.write('{"id": 2, "line": 2, "policy": "fu')  # cut short by a crash
    resumed = run("--resume")
    assert resumed.exit_code == 0, resumed.stderr
    assert [(r["id"], r["correct"]) for r in lines_of(out)] == [(1, True), (2, True), (3, False)]
    again = run("--resume")
    assert again.exit_code == 0, again.stderr
    assert json.loads(again.stdout)["results"][0]["correct"] == 2 and len(lines_of(out)) == 3


def test_resume_replaces_the_error_lines_it_retries(tiny_model_dir, tmp_path, monkeypatch):
    failing = {**RIGHT, "1 plus 1": UsageError("--budget 4 is too small")}
    run, out = scripted_eval(tiny_model_dir, tmp_path, monkeypatch, failing)
    assert run().exit_code == 0
    still = run("--resume")  # problem 2 fails again: one error line, counted once
    assert still.exit_code == 0, still.stderr
    assert [(r["id"], r["error"]) for r in lines_of(out)] == [
        (1, None),
        (3, None),
        (2, "--budget 4 is too small"),
    ]
    row = json.loads(still.stdout)["results"][0]
    assert (row["problems"], row["correct"], row["errors"]) == (2, 1, 1)
    ScriptedGeneration.answers = RIGHT
    fixed = run("--resume")
    assert fixed.exit_code == 0, fixed.stderr
    assert [(r["id"], r["error"]) for r in lines_of(out)] == [(1, None), (3, None), (2, None)]
    row = json.loads(fixed.stdout)["results"][0]
    assert (row["problems"], row["correct"], row["errors"]) == (3, 2, 0)


def test_a_runtime_error_is_that_records_error_and_the_rest_runs(tiny_model_dir, tmp_path, monkeypatch):
    """As a batch line's: out of memory or any other failure of one problem is its record's error, with its type,
    and the other problems are answered (no traceback)."""
    failing = {**RIGHT, "1 plus 1": RuntimeError("the device fell over\nmore details")}
    run, out = scripted_eval(tiny_model_dir, tmp_path, monkeypatch, failing)
    done = run()
    assert done.exit_code == 0 and "Traceback" not in done.stderr, done.stderr
    assert [(r["id"], r["error"]) for r in lines_of(out)] == [
        (1, None),
        (2, "RuntimeError: the device fell over"),
        (3, None),
    ]


def test_resume_with_another_range_summarises_only_its_problems(tiny_model_dir, tmp_path, monkeypatch):
    run, out = scripted_eval(tiny_model_dir, tmp_path, monkeypatch, RIGHT)
    assert run().exit_code == 0
    part = run("--resume", "--offset", "2", "--limit", "1")  # problem 3 alone, answered wrong
    assert part.exit_code == 0, part.stderr
    data = json.loads(part.stdout)
    assert data["problems"] == 1
    row = data["results"][0]
    assert (row["problems"], row["correct"], row["accuracy"]) == (1, 0, 0.0)
    assert len(lines_of(out)) == 3  # the file keeps the other problems


def reject_constant(name: str):
    raise AssertionError(f"{name} is not JSON")


def test_every_problem_an_error_gives_null_accuracy(tiny_model_dir, tmp_path, monkeypatch):
    """--json printed NaN for accuracy and its interval, which no strict JSON reader accepts."""
    failing = dict.fromkeys(RIGHT, UsageError("--budget 4 is too small"))
    run, out = scripted_eval(tiny_model_dir, tmp_path, monkeypatch, failing)
    result = run()
    assert result.exit_code == 0, result.stderr
    row = json.loads(result.stdout, parse_constant=reject_constant)["results"][0]
    assert (row["accuracy"], row["low"], row["high"], row["problems"], row["errors"]) == (None, None, None, 0, 3)
    table = runner.invoke(
        app,
        [
            "eval",
            "--model",
            str(tiny_model_dir),
            "--dataset",
            str(tmp_path / "set.jsonl"),
            "--policies",
            "full",
            "-n",
            "8",
            "-q",
        ],
    )
    assert table.exit_code == 0, table.stderr
    row_line = next(line for line in table.stdout.splitlines() if line.lstrip().startswith("full"))
    assert row_line.split() == ["full", "none", "–", "–", "0/0", "0", "3", "–", "–"]


def refuse_to_load(*args, **kwargs):
    raise AssertionError("the model loaded before the input was checked")


@pytest.mark.parametrize(
    "line, needle",
    [
        ({"id": 1.5}, "'id' must be a string or a whole number, got 1.5"),
        ({"id": None}, "'id' must be a string or a whole number, got null"),
        ({"id": [2]}, "'id' must be a string or a whole number, got [2]"),
        ({"id": {"a": 1}}, "'id' must be a string or a whole number, got {\"a\": 1}"),
        ({"id": True}, "'id' must be a string or a whole number, got true"),
        ({"unique_id": 2.5}, "'unique_id' must be a string or a whole number, got 2.5"),
        ({"messages": "hello"}, "'messages' must be a non-empty list of {'role', 'content'} objects"),
        ({"messages": [{"role": "user"}]}, "'messages' must be a non-empty list of {'role', 'content'} objects"),
        ({"messages": []}, "'messages' must be a non-empty list of {'role', 'content'} objects"),
        ({"messages": None}, "'messages' must be a non-empty list of {'role', 'content'} objects"),
    ],
)
def test_a_bad_id_or_messages_is_refused_before_the_model_loads(tiny_model_dir, tmp_path, monkeypatch, line, needle):
    data = tmp_path / "set.jsonl"
    data.write_text(
        json.dumps({"problem": "1+1?", "answer": "2"})
        + "\n"
        + json.dumps({"problem": "2+2?", "answer": "4", **line})
        + "\n"
    )
    monkeypatch.setattr(eval_cli, "load", refuse_to_load)
    result = runner.invoke(app, ["eval", "--model", str(tiny_model_dir), "--dataset", str(data), "-n", "4"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"epikv: error: {data}:2: {needle}"), result.stderr
