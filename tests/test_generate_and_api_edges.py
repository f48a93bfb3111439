"""The single-prompt path and the Python API at their edges: closed stdin, a stdout encoding without the text's
characters, a refused prompt, batch rows' policies, a policy spec given to attach, Ctrl-C in the prefill."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

import epikv_cli
from epikv_cli.cli.app import app
from epikv_cli.errors import UsageError
from epikv_cli.runtime.generation import Generation

from conftest import make_tokenizer, tiny_model

MODEL = tiny_model("llama")
SHORT = torch.tensor([[256] + list(b"hello there")])
LONG = torch.tensor([[256] + list(b"x" * 40)])
GEN = dict(do_sample=False, eos_token_id=None, pad_token_id=270)


def test_a_prompt_refused_for_the_budget_leaves_the_cache_empty_for_the_next():
    """A prompt over the budget is refused; the cache must not keep it, so a prompt that fits then runs as on a
    fresh cache (it was refused as "still holds the sequence of an earlier generate call")."""
    with epikv_cli.attach(MODEL, budget=30, policy="epikv") as fresh:
        expected = MODEL.generate(SHORT, cache=fresh, max_new_tokens=24, **GEN)
    with epikv_cli.attach(MODEL, budget=30, policy="epikv") as cache:
        with pytest.raises(UsageError, match="--budget 30 is too small for epikv"):
            MODEL.generate(LONG, cache=cache, max_new_tokens=5, **GEN)
        assert cache.seen == 0
        assert torch.equal(MODEL.generate(SHORT, cache=cache, max_new_tokens=24, **GEN), expected)


@pytest.mark.parametrize("batch_size", [1, 2])
def test_a_cache_used_after_its_attach_block_is_refused_not_left_to_grow(batch_size):
    """After ``with attach(...)`` ends no policy evicts from the cache: a further generate on it must be refused, not
    run unbounded (it stored 51 entries under K = 30, evicting nothing) or on stale rows."""
    prompts = SHORT.expand(batch_size, -1)
    with epikv_cli.attach(MODEL, budget=30, policy="epikv", batch_size=batch_size) as cache:
        so_far = MODEL.generate(prompts, cache=cache, max_new_tokens=24, **GEN)  # 36 tokens, 6 evicted
    with pytest.raises(UsageError, match=r"attach\(\) block has ended"):
        MODEL.generate(so_far, cache=cache, max_new_tokens=24, **GEN)  # going on with the same cache


@pytest.mark.parametrize(("source", "message"), [(["-"], "stdin held no prompt text"), (["--prompts", "-"], "")])
def test_a_closed_stdin_for_the_prompt_is_one_line_and_exit_2(source, message):
    """``epikv generate - <&-`` (and ``--prompts -``): no stdin at all (Python's sys.stdin is None) is bad input, not
    a traceback."""
    result = subprocess.run(
        [sys.executable, "-m", "epikv_cli", "generate", "-n", "4", *source],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        preexec_fn=lambda: os.close(0),
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"epikv: error: {message}"), result.stderr


@pytest.mark.parametrize("as_json", [False, True])
def test_text_stdout_cannot_encode_is_escaped_not_a_traceback(tiny_model_dir, as_json):
    """stdout in an encoding without the generated characters (an ASCII or Latin-1 locale, a Windows code page):
    the run ends normally, the JSON stays valid and whole, the text's other characters come out as they are."""
    args = ["generate", "--model", str(tiny_model_dir), "-n", "24", "--ignore-eos", "-q", "hello"]
    args += ["--json"] if as_json else []
    utf8 = CliRunner().invoke(app, args)
    ascii_ = CliRunner(charset="ascii").invoke(app, args)
    assert utf8.exit_code == 0, utf8.stderr
    assert not utf8.stdout.isascii()  # the tiny model's bytes decode to characters ASCII lacks (U+FFFD)
    assert ascii_.exit_code == 0, ascii_.stderr
    if as_json:
        escaped, plain = json.loads(ascii_.stdout), json.loads(utf8.stdout)
        assert escaped["text"] == plain["text"] and escaped["generated_tokens"] == plain["generated_tokens"] == 24
    else:
        assert ascii_.stdout == utf8.stdout.encode("ascii", "backslashreplace").decode("ascii")


def test_batch_lines_on_stdout_that_cannot_encode_are_escaped_json(tiny_model_dir, tmp_path):
    """``--prompts`` with its JSONL on an ASCII stdout: every line is whole, valid JSON with the text a UTF-8 stdout
    gets (escaped as ``\\uXXXX``), not a UnicodeEncodeError after the model has run."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\nSay hi.\n")
    args = ["generate", "--model", str(tiny_model_dir), "-n", "12", "--ignore-eos", "-q", "--prompts", str(prompts)]
    utf8 = CliRunner().invoke(app, args)
    ascii_ = CliRunner(charset="ascii").invoke(app, args)
    assert utf8.exit_code == 0, utf8.stderr
    assert not utf8.stdout.isascii()
    assert ascii_.exit_code == 0, ascii_.stderr
    escaped = [json.loads(line) for line in ascii_.stdout.splitlines()]
    plain = [json.loads(line) for line in utf8.stdout.splitlines()]
    assert [(r["id"], r["text"]) for r in escaped] == [(r["id"], r["text"]) for r in plain] and len(plain) == 2


def test_a_policy_spec_given_to_attach_points_to_options_and_that_works():
    """``attach(model, policy="epikv2:recent=0.25")`` (the spelling of ``--policies``, and of the README's policy
    table) was refused as an "unknown policy"; it is refused with the call that works, which does."""
    with pytest.raises(UsageError, match=r"attach\(model, policy='epikv2', options=\{'recent': '0.25'\}\)"):
        with epikv_cli.attach(MODEL, budget=40, policy="epikv2:recent=0.25"):
            pass
    with epikv_cli.attach(MODEL, budget=40, policy="epikv2", options={"recent": "0.25"}) as cache:
        assert epikv_cli.policy_of(cache).recent == 10  # a quarter of K = 40


def test_policy_of_a_batch_row_is_that_rows_policy():
    """``epikv_cli.policy_of(cache.row(b))``, as its docstring and the README offer, raised a bare KeyError: each
    row's policy must score its tokens as the same prompt's policy does when run alone."""
    tokenizer = make_tokenizer()
    tokenizer.padding_side, tokenizer.pad_token = "left", "</s>"
    prompts = ["hello there", "a rather longer question"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    with epikv_cli.attach(MODEL, budget=40, policy="epikv", batch_size=2) as cache:
        with pytest.raises(UsageError, match="holds 0 rows, so it has no row 0: generate with it first"):
            cache.row(0)
        MODEL.generate(**batch, cache=cache, max_new_tokens=30, **GEN)
        rows = [epikv_cli.policy_of(cache.row(b)) for b in range(2)]
        with pytest.raises(UsageError, match="holds 2 rows, so it has no row 2"):
            cache.row(2)
        with pytest.raises(UsageError, match=r"policy_of\(cache.row\(b\)\)"):
            epikv_cli.policy_of(cache)
    for prompt, policy in zip(prompts, rows):
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with epikv_cli.attach(MODEL, budget=40, policy="epikv") as alone:
            MODEL.generate(ids, cache=alone, max_new_tokens=30, **GEN)
            expected = epikv_cli.policy_of(alone)
            positions = range(ids.shape[1] + 2, ids.shape[1] + 29)
            assert all(expected.score_of(p) is not None for p in positions)
            assert [policy.score_of(p) for p in positions] == pytest.approx(
                [expected.score_of(p) for p in positions], abs=1e-4
            )


def test_ctrl_c_in_the_prefill_prints_nothing_on_stdout(tiny_model_dir, monkeypatch):
    """Interrupted before the first token, as while loading: stdout stays empty (it got a lone newline)."""

    def interrupted(self, session, ids):
        raise KeyboardInterrupt

    monkeypatch.setattr(Generation, "_forward", interrupted)
    result = CliRunner().invoke(app, ["generate", "--model", str(tiny_model_dir), "--no-panel", "hello"])
    assert result.exit_code == 130
    assert result.stderr.strip().endswith("epikv: interrupted before the first token; nothing was generated")
    assert result.stdout == ""
