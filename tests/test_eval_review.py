"""`epikv eval` review: where the model's answer is read, Hub ranges and ids, and what --resume continues."""

from __future__ import annotations

import json
import sys
import types
from types import SimpleNamespace

from typer.testing import CliRunner

from epikv_cli.cli import evaluate as eval_cli
from epikv_cli.cli.app import app
from epikv_cli.experiments import evaluate
from epikv_cli.experiments.evaluate import is_correct, last_boxed, load_eval_problems, model_answer

runner = CliRunner()


def test_a_markdown_heading_is_not_a_gsm8k_answer():
    """``#### 2. Add them`` is a markdown heading, not GSM8K's ``#### N``: it was read as the answer "2. Add them",
    which math-verify judged equal to 2 (a correct answer the model never gave)."""
    text = "Let me think.\n#### 2. Add the numbers\n3 + 4 = 7, so she has 7."
    assert model_answer(text) is None
    assert is_correct(model_answer(text), "2") is False
    assert model_answer("#### Step 1: read\nstuff") is None
    # GSM8K's own form still counts: the last '#### N' line, commas dropped, signs and a dollar sign kept apart
    assert model_answer("So 1,000 + 234 = 1,234.\n#### 1,234") == "1234"
    assert model_answer("#### -5\n\n#### Summary\nabove") == "-5"
    assert model_answer("#### $18.50") == "18.50"


def test_an_escaped_brace_in_the_box_is_not_a_group_brace():
    r"""``\left\{ ... \right.`` (a piecewise function) holds one escaped brace: counted as a group brace, the box never
    closed and the answer was lost."""
    assert last_boxed(r"so \boxed{f(x) = \left\{ x + 1 \right.} done") == r"f(x) = \left\{ x + 1 \right."
    assert last_boxed(r"\boxed{\{1,2\}} and more }") == r"\{1,2\}"
    assert last_boxed(r"\boxed{\begin{matrix} 1 \\ 2 \end{matrix}}") == r"\begin{matrix} 1 \\ 2 \end{matrix}"


ROWS = [
    {"question": "What is 1 + 1?", "answer": "2", "final": "two"},
    {"question": "What is 2 + 2?", "answer": "4", "final": "four"},
    {"question": "What is 3 + 3?", "answer": "6", "final": "six"},
]


def fake_hub(monkeypatch, rows=ROWS):
    """A stand-in for the ``datasets`` library whose ``load_dataset`` gives ``rows`` (the Hub is unreachable)."""
    module = types.ModuleType("datasets")
    module.load_dataset = lambda *args, **kwargs: [dict(row) for row in rows]
    monkeypatch.setitem(sys.modules, "datasets", module)


def test_hub_rows_are_numbered_as_their_local_copy(monkeypatch, tmp_path):
    """A Hub dataset's rows without an id had ids from 0 (their ``line`` from 1), a local copy's lines from 1: the
    same problem had two ids, and a run moved from the Hub to its local copy was refused by --resume."""
    fake_hub(monkeypatch)
    hub = load_eval_problems("gsm8k", None, "answer", 2, 1)
    copy = tmp_path / "gsm8k.jsonl"
    copy.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    local = load_eval_problems(str(copy), None, "answer", 2, 1)
    assert [(p.id, p.line, p.prompt, p.answer) for p in hub] == [
        (2, 2, "What is 2 + 2?", "4"),
        (3, 3, "What is 3 + 3?", "6"),
    ]
    assert [(p.id, p.line, p.prompt, p.answer) for p in local] == [(p.id, p.line, p.prompt, p.answer) for p in hub]


def test_a_hub_dataset_takes_the_answer_field_given(monkeypatch):
    """``--answer-field`` was ignored for a Hub name: every problem was judged against its 'answer' field."""
    fake_hub(monkeypatch)
    assert [p.answer for p in load_eval_problems("gsm8k", None, "final", None, 0)] == ["two", "four", "six"]


def refuse_to_load(*args, **kwargs):
    raise AssertionError("the model loaded before the input was checked")


def test_a_hub_range_is_checked_as_a_files(monkeypatch, tiny_model_dir):
    """For a Hub name, --limit 0 and an --offset past the end evaluated no problem (an empty table, exit 0), and
    --offset -1 took one problem fewer than --limit."""
    fake_hub(monkeypatch)
    monkeypatch.setattr(eval_cli, "load", refuse_to_load)
    for extra, needle in [
        (["--limit", "0"], "--limit must be at least 1, got 0"),
        (["--offset", "-1", "--limit", "2"], "--offset must be 0 or more, got -1"),
        (["--offset", "3"], "holds no problems from --offset 3 on"),
    ]:
        result = runner.invoke(app, ["eval", "--model", str(tiny_model_dir), "--dataset", "gsm8k", "-n", "4", *extra])
        lines = result.stderr.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1 and needle in lines[0], (extra, result.stderr)


class ScriptedGeneration:
    """Stands in for the engine: answers each problem with a scripted text (a tiny random model cannot reason)."""

    answers: dict = {}

    def __init__(self, model, tokenizer, input_ids, cache, sampling):
        self.text = next(text for needle, text in self.answers.items() if needle in tokenizer.decode(input_ids[0]))

    def __iter__(self):
        self.result = SimpleNamespace(
            text=self.text, prompt_tokens=10, generated_tokens=5, stop_reason="eos", decode_tokens_per_s=20.0
        )
        return iter(())


def test_resume_refuses_records_judged_against_another_answer(tiny_model_dir, tmp_path, monkeypatch):
    """The dataset's answer to problem 1 was corrected between two runs: --resume kept problem 1's record, judged
    against the old answer, and counted it beside the new answers without a word."""
    data = tmp_path / "set.jsonl"
    rows = [{"problem": "What is 6 times 7?", "answer": "41"}, {"problem": "What is 1 plus 1?", "answer": "2"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ScriptedGeneration.answers = {"6 times 7": r"\boxed{42}", "1 plus 1": r"\boxed{2}"}
    monkeypatch.setattr(evaluate, "Generation", ScriptedGeneration)
    out = tmp_path / "eval.jsonl"
    args = ["eval", "--model", str(tiny_model_dir), "--dataset", str(data), "--policies", "full", "-n", "8"]
    first = runner.invoke(app, [*args, "-o", str(out), "--json", "-q", "--limit", "1"])
    assert first.exit_code == 0, first.stderr
    assert [(r["id"], r["reference"], r["correct"]) for r in map(json.loads, out.read_text().splitlines())] == [
        (1, "41", False)
    ]
    rows[0]["answer"] = "42"  # corrected
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = out.read_text()
    resumed = runner.invoke(app, [*args, "-o", str(out), "--json", "-q", "--resume"])
    lines = resumed.stderr.strip().splitlines()
    assert resumed.exit_code == 2 and len(lines) == 1, resumed.stderr
    assert "id 1 in" in lines[0] and 'was judged against the answer "41"' in lines[0] and 'gives "42"' in lines[0]
    assert out.read_text() == before  # nothing was run or rewritten
    same = runner.invoke(app, [*args, "-o", str(tmp_path / "fresh.jsonl"), "--json", "-q"])
    row = json.loads(same.stdout)["results"][0]
    assert (row["problems"], row["correct"]) == (2, 2)


def test_resume_with_the_same_answers_still_continues(tiny_model_dir, tmp_path, monkeypatch):
    """The check above compares the reference as judged: a GSM8K answer (its whole solution in the file) resumes."""
    data = tmp_path / "set.jsonl"
    rows = [{"question": "What is 1,000 plus 1?", "answer": "1000 + 1 = 1001\n#### 1,001"}]
    rows.append({"question": "What is 2 plus 2?", "answer": "#### 4"})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ScriptedGeneration.answers = {"1,000 plus 1": "#### 1001", "2 plus 2": r"\boxed{5}"}
    monkeypatch.setattr(evaluate, "Generation", ScriptedGeneration)
    out = tmp_path / "eval.jsonl"
    args = ["eval", "--model", str(tiny_model_dir), "--dataset", str(data), "--policies", "full", "-n", "8"]
    assert runner.invoke(app, [*args, "-o", str(out), "-q", "--limit", "1"]).exit_code == 0
    resumed = runner.invoke(app, [*args, "-o", str(out), "--json", "-q", "--resume"])
    assert resumed.exit_code == 0, resumed.stderr
    row = json.loads(resumed.stdout)["results"][0]
    assert (row["problems"], row["correct"]) == (2, 1)
    assert [(r["id"], r["reference"]) for r in map(json.loads, out.read_text().splitlines())] == [(1, "1001"), (2, "4")]
