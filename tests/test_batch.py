"""Batch files: good, malformed and over-budget lines; resume; interruption leaves valid JSONL."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from epikv_cli import engine
from epikv_cli.batch import read_prompt_file, repair_tail
from epikv_cli.cli import app

runner = CliRunner()


def write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def run(model_dir, prompts, output, *extra):
    args = ["generate", "--model", str(model_dir), "-n", "8", "-b", "48", "--ignore-eos", "-q", "--prompts", str(prompts)]
    if output is not None:
        args += ["--output", str(output)]
    return runner.invoke(app, [*args, *extra])


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_plain_text_file(tiny_model_dir, tmp_path):
    prompts = write(tmp_path / "p.txt", ["first prompt", "", "second prompt"])
    out = tmp_path / "out.jsonl"
    result = run(tiny_model_dir, prompts, out)
    assert result.exit_code == 0, result.stderr
    rows = records(out)
    assert [(r["id"], r["line"], r["prompt"]) for r in rows] == [(1, 1, "first prompt"), (3, 3, "second prompt")]
    assert all(r["error"] is None and r["stats"]["generated_tokens"] == 8 for r in rows)


def test_jsonl_with_good_malformed_and_over_budget_lines(tiny_model_dir, tmp_path):
    prompts = write(tmp_path / "p.jsonl", [
        json.dumps({"id": "a", "prompt": "hello", "max_new_tokens": 3}),
        "{not json",
        json.dumps({"id": "b", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.5}),
        json.dumps({"id": "c", "prompt": "x" * 200}),  # longer than the 48-token budget
        json.dumps({"id": "d"}),
        json.dumps({"id": "e", "prompt": "short", "budget": 64}),
    ])
    out = tmp_path / "out.jsonl"
    result = run(tiny_model_dir, prompts, out)
    assert result.exit_code == 1
    rows = {r["id"]: r for r in records(out)}
    assert list(rows) == ["a", 2, "b", "c", "d", "e"]  # input order; unreadable lines take their line number as id
    assert rows["a"]["stats"]["generated_tokens"] == 3
    assert rows["b"]["messages"][0]["content"] == "hi" and rows["b"]["error"] is None
    assert rows["e"]["stats"]["budget"] == 64
    assert "not valid JSON" in rows[2]["error"] and rows[2]["text"] is None
    assert "--budget 48 is not larger" in rows["c"]["error"]
    assert "'prompt'" in rows["d"]["error"]
    errors = result.stderr.strip().splitlines()
    assert [line.split(":")[2] for line in errors] == ["2", "4", "5"]  # epikv: FILE:LINE: message
    assert all(line.startswith(f"epikv: {prompts}:") for line in errors)


def test_results_to_stdout_without_output(tiny_model_dir, tmp_path):
    prompts = write(tmp_path / "p.txt", ["one", "two"])
    result = run(tiny_model_dir, prompts, None)
    assert result.exit_code == 0
    assert [json.loads(line)["id"] for line in result.stdout.splitlines()] == [1, 2]


def test_resume_skips_finished_ids(tiny_model_dir, tmp_path, monkeypatch):
    prompts = write(tmp_path / "p.txt", ["one", "two", "three"])
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"id": 2, "line": 2, "prompt": "two", "text": "kept", "stats": {}, "error": None}) + "\n{\"id\": 3, \"li")
    seen = []
    real = engine.Generation.__init__

    def spy(self, model, tokenizer, input_ids, *args, **kwargs):
        seen.append(input_ids.shape[1])
        real(self, model, tokenizer, input_ids, *args, **kwargs)

    monkeypatch.setattr(engine.Generation, "__init__", spy)
    result = run(tiny_model_dir, prompts, out, "--resume")
    assert result.exit_code == 0, result.stderr
    rows = records(out)  # the half-written last line was repaired
    assert [r["id"] for r in rows] == [1, 2, 3] and rows[1]["text"] == "kept"
    assert len(seen) == 2


def test_interrupted_batch_leaves_valid_jsonl(tiny_model_dir, tmp_path, monkeypatch):
    prompts = write(tmp_path / "p.txt", [f"prompt {i}" for i in range(6)])
    out = tmp_path / "out.jsonl"
    calls = {"n": 0}
    real = engine.Generation._forward

    def forward(self, session, ids):
        calls["n"] += 1
        if calls["n"] == 8 * 3 + 4:  # in the middle of the fourth prompt
            raise KeyboardInterrupt
        return real(self, session, ids)

    monkeypatch.setattr(engine.Generation, "_forward", forward)
    result = run(tiny_model_dir, prompts, out)
    assert result.exit_code == 130
    assert "--resume" in result.stderr
    assert [r["id"] for r in records(out)] == [1, 2, 3]
    monkeypatch.setattr(engine.Generation, "_forward", real)
    assert run(tiny_model_dir, prompts, out, "--resume").exit_code == 0
    assert [r["id"] for r in records(out)] == [1, 2, 3, 4, 5, 6]


def test_repair_tail(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"id": 1}\n{"id": 2')
    repair_tail(path)
    assert path.read_bytes() == b'{"id": 1}\n'


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--prompts", "/no/such/file.txt"], "prompt file not found"),
        (["--resume", "hi"], "--output and --resume go with --prompts"),
        (["--prompts", "PROMPTS", "hi"], "either a PROMPT or --prompts"),
    ],
)
def test_batch_usage_errors(tiny_model_dir, tmp_path, args, needle):
    prompts = write(tmp_path / "p.txt", ["one"])
    args = [str(prompts) if a == "PROMPTS" else a for a in args]
    result = runner.invoke(app, ["generate", "--model", str(tiny_model_dir), *args])
    assert result.exit_code == 2 and needle in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_read_prompt_file_detects_jsonl_without_the_suffix(tmp_path):
    items = read_prompt_file(write(tmp_path / "p.txt", ['{"prompt": "a"}', '{"prompt": "b", "id": 7}']))
    assert [(i.id, i.prompt) for i in items] == [(1, "a"), (7, "b")]
