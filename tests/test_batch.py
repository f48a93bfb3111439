"""Batch files: every line ends as exactly one output line, bad lines never end the batch, resume
never skips a prompt that did not run, and the output file is checked before any model loads."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from epikv_cli.cli import batch
from epikv_cli.cli.app import app
from epikv_cli.cli.batch import read_prompt_file
from epikv_cli.data.jsonl import read_results
from epikv_cli.errors import UsageError
from epikv_cli.policies.registry import POLICIES
from epikv_cli.runtime import generation as engine

runner = CliRunner()


def write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def run(model_dir, prompts, output, *extra, input=None):
    args = [
        "generate",
        "--model",
        str(model_dir),
        "-n",
        "8",
        "-b",
        "48",
        "--ignore-eos",
        "-q",
        "--prompts",
        str(prompts),
    ]
    if output is not None:
        args += ["--output", str(output)]
    return runner.invoke(app, [*args, *extra], input=input)


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def error_lines(result):
    """Line numbers named by ``epikv: FILE:LINE: message`` lines on stderr."""
    return [
        int(line.split(":")[2])
        for line in result.stderr.strip().splitlines()
        if line.startswith("epikv: ") and "error:" not in line
    ]


def assert_one_line_usage_error(result, *needles):
    assert result.exit_code == 2, (result.exit_code, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("epikv: error: ") and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in lines[0]


@pytest.fixture
def no_model_load(monkeypatch):
    """Fails the test if a model is loaded: checks must happen before."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr(batch, "load", refuse)


def test_plain_text_file(tiny_model_dir, tmp_path):
    prompts = write(tmp_path / "p.txt", ["first prompt", "", "second prompt"])
    out = tmp_path / "out.jsonl"
    result = run(tiny_model_dir, prompts, out)
    assert result.exit_code == 0, result.stderr
    rows = records(out)
    assert [(r["id"], r["line"], r["prompt"]) for r in rows] == [(1, 1, "first prompt"), (3, 3, "second prompt")]
    assert all(r["error"] is None and r["stats"]["generated_tokens"] == 8 for r in rows)


def test_jsonl_with_good_malformed_and_over_budget_lines(tiny_model_dir, tmp_path):
    prompts = write(
        tmp_path / "p.jsonl",
        [
            json.dumps({"id": "a", "prompt": "hello", "max_new_tokens": 3}),
            "{not json",
            json.dumps({"id": "b", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.5}),
            json.dumps({"id": "c", "prompt": "x" * 200}),  # longer than the 48-token budget
            json.dumps({"id": "d"}),
            json.dumps({"id": "e", "prompt": "short", "budget": 64}),
        ],
    )
    out = tmp_path / "out.jsonl"
    result = run(tiny_model_dir, prompts, out, "-p", "epikv")  # epikv protects the prompt: line c cannot fit
    assert result.exit_code == 1
    rows = {r["id"]: r for r in records(out)}
    assert list(rows) == ["a", 2, "b", "c", "d", "e"]  # input order; unreadable lines take their line number as id
    assert rows["a"]["stats"]["generated_tokens"] == 3
    assert rows["b"]["messages"][0]["content"] == "hi" and rows["b"]["error"] is None
    assert rows["e"]["stats"]["budget"] == 64
    assert "not valid JSON" in rows[2]["error"] and rows[2]["text"] is None
    assert "--budget 48 is too small for" in rows["c"]["error"]
    assert "'prompt'" in rows["d"]["error"]
    assert error_lines(result) == [2, 4, 5]
    assert all(line.startswith(f"epikv: {prompts}:") for line in result.stderr.strip().splitlines())


def test_bad_per_line_settings_are_that_lines_error(tiny_model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "\n".join(
            [
                '{"id": "nan", "prompt": "hi", "temperature": NaN, "top_p": 0.9}',
                json.dumps({"id": "neg", "prompt": "hi", "max_new_tokens": -3}),
                json.dumps({"id": "unknown", "prompt": "hi", "max_tokens": 5}),
                json.dumps({"id": "type", "prompt": "hi", "budget": "64"}),
                json.dumps({"id": "bool", "prompt": "hi", "top_k": True}),
                json.dumps({"id": "ok", "prompt": "hi", "stop": ["zzz"], "seed": 3}),
                json.dumps({"id": "recent", "prompt": "hi", "recent": -1}),
                json.dumps({"id": ["not", "an", "id"], "prompt": "hi"}),
                json.dumps({"id": "huge", "prompt": "hi", "budget": 10**20}),
                json.dumps({"id": "blank", "prompt": "  \n"}),
            ]
        )
        + "\n"
    )
    out = tmp_path / "out.jsonl"
    result = run(tiny_model_dir, prompts, out)
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    rows = records(out)
    assert [r["line"] for r in rows] == list(range(1, 11))
    errors = {r["id"]: r["error"] for r in rows}
    # the line's own keys are named as the line names them, not as the flags
    assert errors["nan"].startswith("'temperature' must be a finite number")
    assert errors["neg"].startswith("'max_new_tokens' must be at least 1")
    assert errors["huge"].startswith(f"'budget' must be at most {2**62} tokens, got {10**20}")
    assert errors["blank"] == "'prompt' is empty; give the text to generate from, or drop the line"
    assert "unknown key 'max_tokens'" in errors["unknown"]
    assert "'budget' must be a whole number" in errors["type"]
    assert "'top_k' must be a whole number" in errors["bool"]
    assert errors["recent"] == "'recent' must be 0 or more, got -1"
    assert "'id' must be a string or a whole number" in errors[8]
    assert errors["ok"] is None and rows[5]["stats"]["generated_tokens"] == 8
    assert error_lines(result) == [1, 2, 3, 4, 5, 7, 8, 9, 10]


def test_a_non_utf8_line_is_that_lines_error(tiny_model_dir, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_bytes(b"first\ncaf\xe9 au lait\nthird\n")
    out = tmp_path / "out.jsonl"
    result = run(tiny_model_dir, prompts, out)
    assert result.exit_code == 1
    rows = records(out)
    assert [(r["line"], r["error"] is None) for r in rows] == [(1, True), (2, False), (3, True)]
    assert "not UTF-8 text (byte 0xe9 at column 4)" in rows[1]["error"]
    assert error_lines(result) == [2]


@pytest.mark.parametrize(
    "lines, named",
    [
        ([{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}, {"id": "a", "prompt": "z"}], "lines 1 and 3"),
        ([{"prompt": "x"}, {"id": 1, "prompt": "y"}], "lines 1 and 2"),  # line 1's id is its line number
    ],
)
def test_duplicate_ids_refuse_the_file_up_front(tiny_model_dir, tmp_path, no_model_load, lines, named):
    prompts = write(tmp_path / "p.jsonl", [json.dumps(line) for line in lines])
    out = tmp_path / "out.jsonl"
    assert_one_line_usage_error(run(tiny_model_dir, prompts, out), named, "same id")
    assert not out.exists() or out.read_text() == ""


def test_results_to_stdout_without_output(tiny_model_dir, tmp_path):
    prompts = write(tmp_path / "p.txt", ["one", "two"])
    result = run(tiny_model_dir, prompts, None)
    assert result.exit_code == 0
    assert [json.loads(line)["id"] for line in result.stdout.splitlines()] == [1, 2]


def test_prompts_from_stdin(tiny_model_dir, tmp_path):
    out = tmp_path / "out.jsonl"
    result = run(tiny_model_dir, "-", out, input='{"id": "s", "prompt": "from a pipe"}\n')
    assert result.exit_code == 0, result.stderr
    assert [(r["id"], r["prompt"]) for r in records(out)] == [("s", "from a pipe")]


def spy_on_prompts(monkeypatch):
    seen = []
    real = engine.Generation.__init__

    def spy(self, model, tokenizer, input_ids, *args, **kwargs):
        seen.append(input_ids.shape[1])
        real(self, model, tokenizer, input_ids, *args, **kwargs)

    monkeypatch.setattr(engine.Generation, "__init__", spy)
    return seen


def test_resume_skips_finished_ids(tiny_model_dir, tmp_path, monkeypatch):
    prompts = write(tmp_path / "p.txt", ["one", "two", "three"])
    out = tmp_path / "out.jsonl"
    assert run(tiny_model_dir, prompts, out).exit_code == 0
    second = {**records(out)[1], "text": "kept"}  # as if only id 2 had finished, and id 3 was cut off
    out.write_text(json.dumps(second) + '\n{"id": 3, "li')
    seen = spy_on_prompts(monkeypatch)
    result = run(tiny_model_dir, prompts, out, "--resume")
    assert result.exit_code == 0, result.stderr
    rows = records(out)  # the half-written last line is gone
    assert [r["id"] for r in rows] == [1, 2, 3] and rows[1]["text"] == "kept"
    assert len(seen) == 2


def test_resume_refuses_results_of_other_prompts(tiny_model_dir, tmp_path, monkeypatch):
    """Ten prompts finished, then six other prompts resumed into the same file: ids 1-6 are taken, but by other
    prompts. Refused, before any model loads, and the file is left as it was."""
    ten = write(tmp_path / "ten.txt", [f"question {i}" for i in range(1, 11)])
    out = tmp_path / "res.jsonl"
    assert run(tiny_model_dir, ten, out).exit_code == 0
    before = out.read_bytes()
    six = write(tmp_path / "six.txt", [f"another question {i}" for i in range(1, 7)])
    monkeypatch.setattr(batch, "load", lambda *a, **k: pytest.fail("loaded a model for a refused resume"))
    assert_one_line_usage_error(
        run(tiny_model_dir, six, out, "--resume"), f"id 1 in {out} answers a different prompt than {six} line 1"
    )
    assert out.read_bytes() == before


@pytest.mark.parametrize(
    "changed, named",
    [
        (["-n", "6"], "max_new_tokens = 8, this run has max_new_tokens = 6"),
        (["-b", "40"], "budget = 48, this run has budget = 40"),
        (["--policy", "h2o"], 'policy = "epikv2", this run has policy = "h2o"'),
        (["--temperature", "0.7"], "temperature = 0.0, this run has temperature = 0.7"),
        (["--system", "Be brief."], 'system = null, this run has system = "Be brief."'),
        (["--attn", "eager"], 'attn = null, this run has attn = "eager"'),
    ],
)
def test_resume_refuses_other_settings(tiny_model_dir, tmp_path, changed, named):
    prompts = write(tmp_path / "p.txt", ["one", "two"])
    out = tmp_path / "out.jsonl"
    assert run(tiny_model_dir, prompts, out).exit_code == 0
    rows = records(out)
    assert rows[0]["run"]["max_new_tokens"] == 8 and rows[0]["prompt_sha256"] != rows[1]["prompt_sha256"]
    out.write_text(json.dumps(rows[0]) + "\n")  # id 2 still to run
    assert_one_line_usage_error(run(tiny_model_dir, prompts, out, "--resume", *changed), named)
    assert run(tiny_model_dir, prompts, out, "--resume").exit_code == 0  # the same settings go on


def test_resume_refuses_results_that_carry_no_fingerprint(tiny_model_dir, tmp_path, no_model_load):
    prompts = write(tmp_path / "p.txt", ["one", "two"])
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"id": 1, "line": 1, "prompt": "one", "text": "x", "stats": {}, "error": None}) + "\n")
    assert_one_line_usage_error(run(tiny_model_dir, prompts, out, "--resume"), "cannot be checked", "--overwrite")


def test_resume_retries_lines_that_failed(tiny_model_dir, tmp_path, monkeypatch):
    prompts = write(tmp_path / "p.txt", ["one", "two", "three"])
    out = tmp_path / "out.jsonl"
    real = batch._generate

    def flaky(loaded, item, prompt_settings):
        if item.prompt == "two":
            raise RuntimeError("the device fell over")
        return real(loaded, item, prompt_settings)

    monkeypatch.setattr(batch, "_generate", flaky)
    first = run(tiny_model_dir, prompts, out)
    assert first.exit_code == 1 and "RuntimeError: the device fell over" in records(out)[1]["error"]
    again = run(tiny_model_dir, prompts, out, "--resume")  # still failing: reported, exit 1, one line per id
    assert again.exit_code == 1 and error_lines(again) == [2]
    assert [r["id"] for r in records(out)] == [1, 2, 3]
    monkeypatch.setattr(batch, "_generate", real)
    seen = spy_on_prompts(monkeypatch)
    fixed = run(tiny_model_dir, prompts, out, "--resume")
    assert fixed.exit_code == 0, fixed.stderr
    assert len(seen) == 1  # only the failed prompt ran again
    rows = records(out)
    assert [r["id"] for r in rows] == [1, 2, 3] and all(r["error"] is None for r in rows)


def test_resume_replaces_a_finished_result_whose_line_is_now_an_error(tiny_model_dir, tmp_path, monkeypatch):
    """A line edited after it finished, into one that cannot run: its old answer leaves the output and the line's
    error takes its place (exit 1), instead of the answer to the prompt the line no longer holds."""
    prompts = write(tmp_path / "p.jsonl", ['{"id": "a", "prompt": "one"}', '{"id": "b", "prompt": "two"}'])
    out = tmp_path / "out.jsonl"
    assert run(tiny_model_dir, prompts, out).exit_code == 0
    write(prompts, ['{"id": "a", "prompt": "one"}', '{"id": "b", "prompt": "changed", "budget": "x"}'])
    seen = spy_on_prompts(monkeypatch)
    again = run(tiny_model_dir, prompts, out, "--resume")
    assert again.exit_code == 1 and error_lines(again) == [2]
    rows = records(out)
    assert [(r["id"], r["error"] is None) for r in rows] == [("a", True), ("b", False)]
    assert "'budget' must be a whole number" in rows[1]["error"] and len(seen) == 0


def test_a_lines_seed_seeds_its_policy_as_seed_does(tiny_model_dir, tmp_path):
    """``"seed"`` on a line is ``--seed`` for that line: the sampling's seed and the random policy's."""
    prompts = write(tmp_path / "p.jsonl", ['{"id": "s", "prompt": "one two three four", "seed": 7}'])
    out = tmp_path / "out.jsonl"
    assert run(tiny_model_dir, prompts, out, "-p", "random", "-n", "40").exit_code == 0
    line = records(out)[0]
    flag = runner.invoke(
        app,
        ["generate", "--model", str(tiny_model_dir), "-n", "40", "-b", "48", "--ignore-eos", "-q", "--json"]
        + ["-p", "random", "--seed", "7", "one two three four"],
    )
    assert flag.exit_code == 0, flag.stderr
    alone = json.loads(flag.stdout)
    assert line["run"]["policy_seed"] == 7 and alone["evicted"] > 0
    assert line["text"] == alone["text"]


def test_system_is_the_first_message_of_a_messages_line_without_one(tiny_model_dir, tmp_path):
    """``--system`` reaches a ``messages`` line as it reaches a prompt line (the same token count); a line's own
    system message stays."""
    lines = [
        '{"id": "p", "prompt": "Hi"}',
        '{"id": "m", "messages": [{"role": "user", "content": "Hi"}]}',
        '{"id": "o", "messages": [{"role": "system", "content": "Own."}, {"role": "user", "content": "Hi"}]}',
    ]
    prompts = write(tmp_path / "p.jsonl", lines)
    out = tmp_path / "out.jsonl"
    assert run(tiny_model_dir, prompts, out, "--system", "Be brief.").exit_code == 0
    counts = {r["id"]: r["stats"]["prompt_tokens"] for r in records(out)}
    assert counts["m"] == counts["p"]
    assert counts["o"] == counts["p"] - len("Be brief.") + len("Own.")  # a byte-level tokenizer


def test_a_runtime_error_on_one_prompt_is_recorded_and_the_batch_goes_on(tiny_model_dir, tmp_path, monkeypatch):
    prompts = write(tmp_path / "p.txt", ["one", "two", "three"])
    out = tmp_path / "out.jsonl"
    real = engine.Generation._forward
    calls = {"n": 0}

    def forward(self, session, ids):
        calls["n"] += 1
        if calls["n"] == 8 + 3:  # inside the second prompt
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB\nmore details")
        return real(self, session, ids)

    monkeypatch.setattr(engine.Generation, "_forward", forward)
    result = run(tiny_model_dir, prompts, out)
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    rows = records(out)
    assert rows[1]["error"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB"
    assert rows[0]["error"] is None and rows[2]["error"] is None and rows[2]["stats"]["generated_tokens"] == 8


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


def test_read_results_ignores_a_cut_line_and_refuses_a_foreign_file(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"id": 1, "error": null}\n{"id": 2')
    assert read_results(path) == [{"id": 1, "error": None}]
    path.write_bytes(b'{"id": 1}\nhello world\n{"id": 2}\n')
    with pytest.raises(UsageError, match="line 2 is not an epikv result line"):
        read_results(path)


def test_existing_output_needs_resume_or_overwrite(tiny_model_dir, tmp_path, monkeypatch):
    prompts = write(tmp_path / "p.txt", ["one"])
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "someone else\'s", "text": "precious"}\n')
    with monkeypatch.context() as patch:
        patch.setattr(batch, "load", lambda *a, **k: pytest.fail("loaded before refusing"))
        assert_one_line_usage_error(
            run(tiny_model_dir, prompts, out), "already holds results", "--resume", "--overwrite"
        )
        assert_one_line_usage_error(run(tiny_model_dir, prompts, out, "--resume", "--overwrite"), "give one of them")
        assert_one_line_usage_error(run(tiny_model_dir, prompts, None, "--overwrite"), "--overwrite needs --output")
    assert "precious" in out.read_text()  # nothing was touched
    replaced = run(tiny_model_dir, prompts, out, "--overwrite")
    assert replaced.exit_code == 0
    assert [r["id"] for r in records(out)] == [1]


def test_output_onto_the_prompt_file_is_refused(tiny_model_dir, tmp_path, no_model_load):
    prompts = write(tmp_path / "p.jsonl", [json.dumps({"prompt": "precious"})])
    before = prompts.read_text()
    for flag in ((), ("--resume",), ("--overwrite",)):
        assert_one_line_usage_error(run(tiny_model_dir, prompts, prompts, *flag), "is the prompt file itself")
        link = tmp_path / "link.jsonl"
        link.unlink(missing_ok=True)
        link.symlink_to(prompts)
        assert_one_line_usage_error(run(tiny_model_dir, prompts, link, *flag), "is the prompt file itself")
    assert prompts.read_text() == before


@pytest.mark.parametrize("kind", ["missing directory", "directory", "fifo", "proc"])
def test_unusable_output_is_refused_before_loading(tiny_model_dir, tmp_path, no_model_load, kind):
    prompts = write(tmp_path / "p.txt", ["one"])
    if kind == "missing directory":
        target, needle = tmp_path / "nowhere" / "out.jsonl", "does not exist"
    elif kind == "directory":
        target, needle = tmp_path, "is a directory"
    elif kind == "fifo":
        target, needle = tmp_path / "pipe", "is a named pipe"
        os.mkfifo(target)
    else:  # a special file that even root cannot write
        target, needle = Path("/proc/version"), "cannot be written"
    assert_one_line_usage_error(run(tiny_model_dir, prompts, target), str(target), needle)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--prompts", "/no/such/file.txt"], "--prompts /no/such/file.txt: file not found; give a plain-text file"),
        (["--prompts", "DIR"], "is a directory, not a file of prompts"),
        (["--prompts", "/dev/null"], "is a character device, not a file of prompts"),
        (["--resume", "hi"], "--output, --resume, --overwrite and --batch-size go with --prompts"),
        (["--prompts", "PROMPTS", "hi"], "either a PROMPT or --prompts"),
        (["--prompts", "PROMPTS", "--resume"], "--resume needs --output"),
        (["--prompts", "PROMPTS", "--panel"], "--panel shows one streamed generation"),
        (
            ["--prompts", "PROMPTS", "--json"],
            "--json is for one prompt; with --prompts every result is already one JSON",
        ),
    ],
)
def test_batch_usage_errors(tiny_model_dir, tmp_path, no_model_load, args, needle):
    prompts = write(tmp_path / "p.txt", ["one"])
    args = [str(prompts) if a == "PROMPTS" else str(tmp_path) if a == "DIR" else a for a in args]
    result = runner.invoke(app, ["generate", "--model", str(tiny_model_dir), *args])
    assert_one_line_usage_error(result, needle)


def test_no_chat_template_is_said_once(tmp_path, plain_model_dir):
    prompts = write(tmp_path / "p.txt", ["one", "two", "three"])
    result = runner.invoke(
        app,
        [
            "generate",
            "--model",
            str(plain_model_dir),
            "-n",
            "2",
            "--prompts",
            str(prompts),
            "-o",
            str(tmp_path / "o.jsonl"),
        ],
    )
    assert result.exit_code == 0, result.stderr
    assert result.stderr.count("has no chat template; the prompt is used as plain text") == 1


def test_read_prompt_file_detects_jsonl_without_the_suffix(tmp_path):
    items = read_prompt_file(write(tmp_path / "p.txt", ['{"prompt": "a"}', '{"prompt": "b", "id": 7}']))
    assert [(i.id, i.prompt) for i in items] == [(1, "a"), (7, "b")]


def test_read_prompt_file_keeps_unicode_line_separators_inside_a_line(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("one\u2028still one\r\ntwo\n", encoding="utf-8")
    assert [item.prompt for item in read_prompt_file(path)] == ["one\u2028still one", "two"]


def test_a_lines_budget_suggestion_works_for_that_line(tiny_model_dir, tmp_path):
    prompts = write(tmp_path / "p.jsonl", [json.dumps({"id": "tight", "prompt": "y" * 60, "budget": 8})])
    out = tmp_path / "out.jsonl"
    assert run(tiny_model_dir, prompts, out).exit_code == 1
    error = records(out)[0]["error"]
    suggested = int(re.search(r"use --budget (\d+) or more", error).group(1))
    write(prompts, [json.dumps({"id": "tight", "prompt": "y" * 60, "budget": suggested})])
    assert run(tiny_model_dir, prompts, out, "--resume").exit_code == 0
    write(prompts, [json.dumps({"id": "tight", "prompt": "y" * 60, "budget": suggested - 1})])
    assert run(tiny_model_dir, prompts, out, "--overwrite").exit_code == 1
    assert f"use --budget {suggested} or more" in records(out)[0]["error"]


@pytest.mark.parametrize(
    "policy, options",
    [
        *((name, []) for name, cls in sorted(POLICIES.items()) if cls.evicts),
        ("lagkv", ["--policy-option", "chunks=positions"]),
    ],
)
def test_every_evicting_policy_runs_a_batch(tiny_model_dir, tmp_path, policy, options):
    prompts = write(
        tmp_path / "p.jsonl",
        [json.dumps({"id": i, "prompt": f"question {i}", "max_new_tokens": 200}) for i in range(2)],
    )
    out = tmp_path / "out.jsonl"
    result = run(tiny_model_dir, prompts, out, "--policy", policy, *options)
    assert result.exit_code == 0, result.stderr
    rows = records(out)
    assert [r["stats"]["policy"] for r in rows] == [policy, policy] and all(r["stats"]["evicted"] > 0 for r in rows)


def test_batch_size_gives_the_same_results_as_one_at_a_time(tiny_model_dir, tmp_path):
    lines = [
        json.dumps({"id": f"q{i}", "prompt": f"question number {i} " * (i + 1), "max_new_tokens": 6 + 5 * i})
        for i in range(5)
    ]
    lines.insert(2, "{broken")
    prompts = write(tmp_path / "p.jsonl", lines)
    one, four = tmp_path / "one.jsonl", tmp_path / "four.jsonl"
    first = run(tiny_model_dir, prompts, one, "--policy", "h2o")
    assert first.exit_code == 1, first.stderr
    assert run(tiny_model_dir, prompts, four, "--policy", "h2o", "--batch-size", "4").exit_code == 1

    def strip(rows):
        return [(r["id"], r["text"], r["error"], (r["stats"] or {}).get("evicted")) for r in rows]

    assert strip(records(four)) == strip(records(one))
    assert [r["stats"]["generated_tokens"] for r in records(four) if r["stats"]] == [6, 11, 16, 21, 26]
    # per-phase memory is a row's own alone; in a batch the phases of the rows overlap: null, not 0
    for alone, batched in zip(records(one), records(four)):
        if alone["stats"]:
            stats = alone["stats"]
            assert stats["peak_memory_bytes"] == max(
                stats["prefill_peak_memory_bytes"], stats["decode_peak_memory_bytes"]
            )
            assert batched["stats"]["prefill_peak_memory_bytes"] is None
            assert batched["stats"]["decode_peak_memory_bytes"] is None


def test_a_chat_template_that_raises_for_one_line_is_that_lines_error_in_a_batch(tiny_model_dir, tmp_path, monkeypatch):
    """With --batch-size, a prompt whose template raises (a Jinja ``raise_exception``) fails alone, as one at a
    time."""
    real = batch.build_input_ids

    def template(tokenizer, prompt, settings, messages=None):
        if prompt == "two":
            raise ValueError("Conversation roles must alternate user/assistant/user/assistant")
        return real(tokenizer, prompt, settings, messages=messages)

    monkeypatch.setattr(batch, "build_input_ids", template)
    prompts = write(tmp_path / "p.txt", ["one", "two", "three"])
    out = tmp_path / "out.jsonl"
    result = run(tiny_model_dir, prompts, out, "--batch-size", "2")
    assert result.exit_code == 1 and "Traceback" not in result.stderr, result.stderr
    assert [(r["id"], r["error"]) for r in sorted(records(out), key=lambda r: r["id"])] == [
        (1, None),
        (2, "ValueError: Conversation roles must alternate user/assistant/user/assistant"),
        (3, None),
    ]


def test_a_failing_batched_step_falls_back_to_one_prompt_at_a_time(tiny_model_dir, tmp_path, monkeypatch):
    from epikv_cli.runtime import batched

    prompts = write(tmp_path / "p.txt", ["one", "two", "three"])
    real = batched.BatchDecoder.step
    calls = {"n": 0}

    def failing(self, tokens):
        calls["n"] += 1
        if calls["n"] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory in a batched step")
        return real(self, tokens)

    monkeypatch.setattr(batched.BatchDecoder, "step", failing)
    out = tmp_path / "out.jsonl"
    result = run(tiny_model_dir, prompts, out, "--batch-size", "3")
    assert result.exit_code == 0, result.stderr  # every prompt finished, one by one after the failure
    assert [r["error"] for r in records(out)] == [None, None, None]


def test_sort_by_line_orders_within_a_line_by_then(tmp_path):
    """Two ranks append a problem's records in either order: rank 0 puts them back by line, then by ``then``."""
    from epikv_cli.data.jsonl import sort_by_line, write_records

    path = tmp_path / "out.jsonl"
    written = [{"id": 2, "line": 2, "c": 1}, {"id": 1, "line": 1, "c": 2}, {"id": 1, "line": 1, "c": 0}]
    write_records(path, [*written, {"id": 2, "line": 2, "c": 0}])
    sort_by_line(path, lambda record: record["c"])
    assert [(r["line"], r["c"]) for r in records(path)] == [(1, 0), (1, 2), (2, 0), (2, 1)]
