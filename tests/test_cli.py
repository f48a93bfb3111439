"""`epikv generate` through Typer's test runner: output, JSON, stdin, exit codes, interruption."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from epikv_cli import engine
from epikv_cli.cli import app

runner = CliRunner()


def invoke(*args, input=None):
    return runner.invoke(app, list(args), input=input)


def assert_one_line_usage_error(result, *needles):
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("epikv: error: "), result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0]


def test_generate_streams_text(tiny_model_dir):
    result = invoke("generate", "--model", str(tiny_model_dir), "-n", "12", "--ignore-eos", "-q", "hello")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip() and result.stderr == ""


def test_generate_summary_goes_to_stderr(tiny_model_dir):
    result = invoke("generate", "--model", str(tiny_model_dir), "-n", "40", "--budget", "24", "--ignore-eos", "hi")
    assert result.exit_code == 0
    assert "40 tokens" in result.stderr and "peak stored 24/24" in result.stderr
    assert "tokens" not in result.stdout.splitlines()[-1] if result.stdout.strip() else True


def test_generate_json(tiny_model_dir):
    result = invoke(
        "generate", "--model", str(tiny_model_dir), "-n", "40", "--budget", "30", "--ignore-eos", "--json", "hello"
    )
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["generated_tokens"] == 40 and data["stop_reason"] == "length"
    assert data["evicted"] > 0 and data["peak_stored"] <= 30 and data["budget"] == 30
    assert set(data) >= {"text", "prompt_tokens", "decode_tokens_per_s", "peak_memory_bytes", "policy"}


def test_prompt_from_stdin(tiny_model_dir):
    piped = invoke("generate", "--model", str(tiny_model_dir), "-n", "5", "--json", "-", input="hello there\n")
    direct = invoke("generate", "--model", str(tiny_model_dir), "-n", "5", "--json", "hello there\n")
    assert piped.exit_code == 0
    assert json.loads(piped.stdout)["text"] == json.loads(direct.stdout)["text"]


def test_chat_template_and_system_change_the_prompt(tiny_model_dir):
    def prompt_tokens(*extra):
        out = invoke("generate", "--model", str(tiny_model_dir), "-n", "1", "--json", *extra, "hello")
        return json.loads(out.stdout)["prompt_tokens"]

    plain, chat, system = prompt_tokens("--no-chat-template"), prompt_tokens(), prompt_tokens("--system", "Be brief.")
    assert plain == 5 and chat == plain + 3 and system == chat + len("Be brief.") + 2


def test_lagkv_and_bands_run(tiny_model_dir):
    for extra in (["--policy", "lagkv"], ["--bands", "0:+1,3:-1"], ["--positions", "compressed"]):
        result = invoke("generate", "--model", str(tiny_model_dir), "-n", "30", "-b", "24", "--json", "--ignore-eos", *extra, "hi")
        assert result.exit_code == 0, (extra, result.stderr)
        assert json.loads(result.stdout)["evicted"] > 0


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--model", "/no/such/model", "hi"], ["model path not found", "/no/such/model"]),
        (["--model", "missing.gguf", "hi"], ["model file not found"]),
        (["--policy", "h3o", "hi"], ["--policy", "h3o"]),
        (["--bands", "10+1", "hi"], ["--bands", "LAYER:SIGN"]),
        (["--budget", "abc", "hi"], ["--budget"]),
        (["--top-p", "0", "hi"], ["--top-p"]),
        ([], ["no prompt given"]),
    ],
)
def test_bad_input_before_loading(args, needles):
    assert_one_line_usage_error(invoke("generate", *args), *needles)


@pytest.mark.parametrize(
    "args, input, needles",
    [
        (["--budget", "20", "a long enough prompt"], None, ["--budget 20 is not larger than", "use --budget"]),
        ([""], None, ["prompt is empty"]),
        (["-"], "   \n", ["prompt is empty"]),
        (["--bands", "0:+1,9:-1", "hi"], None, ["band layer 9 is out of range"]),
        (["--no-chat-template", "--system", "x", "hi"], None, ["--system needs a chat template"]),
    ],
)
def test_bad_input_with_a_model(tiny_model_dir, args, input, needles):
    assert_one_line_usage_error(invoke("generate", "--model", str(tiny_model_dir), *args, input=input), *needles)


def test_hub_id_without_network_is_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = invoke("generate", "--model", "nobody-here/no-such-model", "hi")
    assert_one_line_usage_error(result, "Hugging Face Hub", "nobody-here/no-such-model")


@pytest.mark.parametrize("as_json", [False, True])
def test_ctrl_c_keeps_what_was_printed(tiny_model_dir, monkeypatch, as_json):
    real_forward = engine.Generation._forward
    calls = {"n": 0}

    def interrupted_forward(self, session, ids):
        calls["n"] += 1
        if calls["n"] > 20:
            raise KeyboardInterrupt
        return real_forward(self, session, ids)

    monkeypatch.setattr(engine.Generation, "_forward", interrupted_forward)
    args = ["generate", "--model", str(tiny_model_dir), "-n", "100", "--ignore-eos", "hello"]
    result = invoke(*args, *(["--json"] if as_json else []))
    assert result.exit_code == 130
    assert "Traceback" not in result.stderr
    if as_json:
        data = json.loads(result.stdout)
        assert data["stop_reason"] == "interrupted" and data["generated_tokens"] == 20
    else:
        assert result.stdout.strip() and "interrupted" in result.stderr


def test_version_and_help():
    assert invoke("--version").stdout.startswith("epikv ")
    help_text = invoke("generate", "--help").stdout
    for option in ("--budget", "--policy", "--recent", "--bands", "--positions", "--stop", "--json", "--attn"):
        assert option in help_text


def test_real_sigint_stops_cleanly(tiny_model_dir):
    """A real Ctrl-C (SIGINT) mid-generation: exit 130, printed text kept, no traceback."""
    import os
    import select
    import signal
    import subprocess
    import sys
    import time

    command = [sys.executable, "-m", "epikv_cli", "generate", "--model", str(tiny_model_dir),
               "-b", "64", "-n", "1000000", "--ignore-eos", "hello"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    first = b""
    deadline = time.monotonic() + 120
    while not first.strip() and time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], 1.0)
        if ready:
            first += os.read(process.stdout.fileno(), 4096)
    process.send_signal(signal.SIGINT)
    rest, err = process.communicate(timeout=60)
    assert first.strip(), "no text was streamed before the interrupt"
    assert process.returncode == 130, err
    assert b"Traceback" not in err and b"interrupted" in err
    assert (first + rest).endswith(b"\n")  # the line is closed, the shell prompt starts clean
