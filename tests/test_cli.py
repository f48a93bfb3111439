"""`epikv generate` through Typer's test runner: output, JSON, stdin, exit codes, interruption."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from transformers import AutoConfig
from typer.testing import CliRunner

from epikv_cli.cli.app import app
from epikv_cli.cli.entry import STARTUP_INTERRUPTED
from epikv_cli.cli.generate import LONG_PROMPT
from epikv_cli.core.cache import HEADROOM
from epikv_cli.policies.registry import POLICIES
from epikv_cli.runtime import generation as engine

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
    assert "40 tokens" in result.stderr and "peak stored 25 (budget 24)" in result.stderr  # K + 1 inside a step
    assert "tokens" not in result.stdout.splitlines()[-1] if result.stdout.strip() else True


def test_generate_json(tiny_model_dir):
    result = invoke(
        "generate", "--model", str(tiny_model_dir), "-n", "40", "--budget", "30", "--ignore-eos", "--json", "hello"
    )
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["generated_tokens"] == 40 and data["stop_reason"] == "length"
    assert data["evicted"] > 0 and data["peak_stored"] == 31 and data["budget"] == 30
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
    assert prompt_tokens("--system", "") == chat + 2  # an empty system message is sent, not the template's default


@pytest.mark.parametrize(
    "extra",
    [
        ["-p", "epikv", "--bands", "0:+1,3:-1"],
        ["--positions", "compressed"],
        ["-p", "lagkv", "--policy-option", "chunks=positions"],
        *(["--policy", name] for name in sorted(POLICIES) if name != "full"),
    ],
)
def test_every_policy_and_mode_runs(tiny_model_dir, extra):
    result = invoke(
        "generate", "--model", str(tiny_model_dir), "-n", "160", "-b", "24", "--json", "--ignore-eos", *extra, "hi"
    )
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


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("spelling", ["--policy-option", "--policies"])
def test_an_option_a_policy_does_not_have_is_refused(policy, spelling, tmp_path):
    """An option that would do nothing is refused, naming the policy's options (or none), before any model loads;
    fidelity would otherwise label its rows with it."""
    known = ", ".join(POLICIES[policy].Options.option_names()) or "none"
    if spelling == "--policy-option":
        result = invoke("generate", "--model", "/no/such/model", "-p", policy, "--policy-option", "foo=1", "hi")
    else:
        prompts = tmp_path / "p.txt"
        prompts.write_text("hi\n")
        result = invoke(
            "fidelity", "--model", "/no/such/model", "--prompts", str(prompts), "--policies", f"{policy}:foo=1"
        )
    assert_one_line_usage_error(result, f"policy {policy!r} has no option 'foo' (its options: {known})")


def test_a_policy_spec_given_to_policy_points_to_its_spelling():
    result = invoke("generate", "-p", "epikv2:period=32:decay=0.9", "hi")
    assert_one_line_usage_error(
        result, "--policy epikv2 --policy-option period=32 --policy-option decay=0.9", "--policy takes a policy name"
    )


def test_a_prompt_beyond_the_models_context_is_said_and_a_long_prefill_too(tiny_model_dir):
    """The tiny model was trained on 1024 positions: a longer prompt runs, with one warning saying so; a prompt of
    LONG_PROMPT tokens or more is announced before its prefill (which can take minutes on a real model)."""
    over = invoke("generate", "--model", str(tiny_model_dir), "-n", "2", "--no-chat-template", "x" * 1100)
    assert over.exit_code == 0, over.stderr
    warnings = [line for line in over.stderr.splitlines() if line.startswith("epikv: warning:")]
    assert warnings == [
        "epikv: warning: the prompt has 1100 tokens, more than the model's context of 1024 (max_position_embeddings): "
        "it runs, but the model was not trained on positions beyond it"
    ]
    assert "prefilling" not in over.stderr
    long = invoke("generate", "--model", str(tiny_model_dir), "-n", "2", "--no-chat-template", "x" * LONG_PROMPT)
    assert long.exit_code == 0, long.stderr
    assert f"epikv: prefilling the {LONG_PROMPT}-token prompt; the first new token comes after it" in long.stderr


def test_threads_sets_torchs_threads_and_refuses_zero(tiny_model_dir, monkeypatch):
    """--threads N is llama-cli's -t: torch's intra-op threads (one thread ran 4x faster on this shared machine)."""
    import torch

    asked = []
    monkeypatch.setattr(torch, "set_num_threads", asked.append)
    result = invoke("generate", "--model", str(tiny_model_dir), "-t", "3", "-n", "2", "--json", "hi")
    assert result.exit_code == 0, result.stderr
    assert asked == [3]
    assert_one_line_usage_error(invoke("generate", "--threads", "0", "hi"), "--threads must be at least 1, got 0")


def test_typers_pydantic_prefix_is_not_shown():
    result = invoke("generate", "--policy", "foo", "hi")
    assert_one_line_usage_error(result, "Invalid value for '--policy' / '-p': 'foo' is not one of 'epikv', 'epikv2'")


@pytest.mark.parametrize(
    "args, input, needles",
    [
        (
            ["-p", "epikv", "--budget", "20", "a long enough prompt"],
            None,
            ["--budget 20 is too small for", "use --budget"],
        ),
        ([""], None, ["prompt is empty"]),
        (["-"], "   \n", ["stdin held no prompt text"]),
        (["-"], "", ["stdin held no prompt text"]),
        (["-p", "epikv", "--bands", "0:+1,9:-1", "hi"], None, ["band layer 9 is out of range"]),
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

    command = [
        sys.executable,
        "-m",
        "epikv_cli",
        "generate",
        "--model",
        str(tiny_model_dir),
        "-b",
        "64",
        "-n",
        "1000000",
        "--ignore-eos",
        "hello",
    ]
    # a shell's background job inherits SIGINT ignored, and Python keeps it so: restore the default
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
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


# -- issue 6: crashes, lost work and misleading messages ------------------------------------------
@contextmanager
def address_space_limit(extra_bytes: int):
    """Let this process map at most ``extra_bytes`` more than it has now (a runaway allocation fails fast)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    mapped = int(re.search(r"VmSize:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mapped + extra_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def interrupt_after(monkeypatch, forwards: int) -> None:
    real_forward = engine.Generation._forward
    calls = {"n": 0}

    def forward(self, session, ids):
        calls["n"] += 1
        if calls["n"] > forwards:
            raise KeyboardInterrupt
        return real_forward(self, session, ids)

    monkeypatch.setattr(engine.Generation, "_forward", forward)


@pytest.mark.parametrize("args", [["--policy", "full"], ["--budget", "1000000000000"]])
def test_huge_max_new_tokens_allocates_as_the_cache_fills(tiny_model_dir, monkeypatch, args):
    interrupt_after(monkeypatch, 20)
    with address_space_limit(4 * 2**30):  # the old up-front allocation (~51 GB here) would fail inside it
        result = invoke(
            "generate", "--model", str(tiny_model_dir), "-n", "100000000", "--ignore-eos", "--json", *args, "hello"
        )
    assert result.exit_code == 130, result.stderr
    data = json.loads(result.stdout)
    assert data["generated_tokens"] == 20 and data["stop_reason"] == "interrupted"
    config = AutoConfig.from_pretrained(tiny_model_dir)
    head_dim = config.hidden_size // config.num_attention_heads
    bytes_per_slot = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4  # keys + values, float32
    assert data["kv_cache_bytes"] == (data["prompt_tokens"] + HEADROOM) * bytes_per_slot


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--temperature", "nan", "hi"], ["--temperature must be a finite number"]),
        (["--temperature", "inf", "hi"], ["--temperature must be a finite number"]),
        (["--temperature", "1", "--top-p", "nan", "hi"], ["--top-p must be a finite number"]),
        (["--seed", "100000000000000000000000", "hi"], ["--seed must be a whole number from 0"]),
        (["--seed", "-1", "--temperature", "1", "hi"], ["--seed must be a whole number from 0"]),
        (["--device-map", "cuda", "hi"], ["--device-map cuda", "no CUDA device"]),
        (["--device-map", "cuda:1", "hi"], ["--device-map cuda:1", "no CUDA device"]),
        (["--device-map", "gpu please", "hi"], ["is not a placement"]),
        (["--spike-threshold", "nan", "hi"], ["--spike-threshold must be a finite number"]),
        (["--spike-threshold", "inf", "hi"], ["--spike-threshold must be a finite number"]),
        (["--bands", "10:+2", "hi"], ["each SIGN is +1 or -1"]),
        (["--policy", "streaming", "--recent", "8", "hi"], ["--recent does not apply to policy 'streaming'"]),
        (["--policy", "full", "--recent", "8", "hi"], ["--recent does not apply to policy 'full'"]),
        (["--budget", "99999999999999999999", "hi"], ["--budget must be at most 4611686018427387904 tokens"]),
        (["--recent", "8", "--policy-option", "recent=0.5", "hi"], ["--recent and the option recent= both set"]),
        (["--policy-option", "period=0", "hi"], ["epikv2 option period=0 is out of range"]),
        (["--panel", "--json", "hi"], ["--panel", "--json"]),
        (["--attn", "flash", "hi"], ["--attn"]),
        (["--overwrite", "hi"], ["--output, --resume, --overwrite and --batch-size go with --prompts"]),
    ],
)
def test_more_bad_input_is_one_line(monkeypatch, args, needles):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # the same answer on a machine with GPUs
    assert_one_line_usage_error(invoke("generate", "--model", "/nonexistent/but/never/loaded", *args), *needles)


def test_non_utf8_prompt_bytes_become_replacement_characters(tiny_model_dir):
    def run(*args, input=None):
        return invoke("generate", "--model", str(tiny_model_dir), "-n", "6", "--json", *args, input=input)

    reference = run("caf\ufffd au lait")
    piped = run("-", input=b"caf\xe9 au lait")
    argv = run("caf\udce9 au lait")  # what Python makes of the byte 0xe9 in argv
    for result in (piped, argv):
        assert result.exit_code == 0 and "Traceback" not in result.stderr
        assert "not valid UTF-8" in result.stderr
        assert json.loads(result.stdout)["text"] == json.loads(reference.stdout)["text"]
        assert json.loads(result.stdout)["prompt_tokens"] == json.loads(reference.stdout)["prompt_tokens"]
    stop = run("--stop", "\udcff", "hello")
    assert stop.exit_code == 0 and "--stop is not valid UTF-8" in stop.stderr


@pytest.mark.parametrize("as_json", [False, True])
def test_ctrl_c_while_the_model_loads(tiny_model_dir, monkeypatch, as_json):
    def loading(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("epikv_cli.cli.generate.load", loading)
    result = invoke("generate", "--model", str(tiny_model_dir), *(["--json"] if as_json else []), "hello")
    assert result.exit_code == 130
    assert result.stderr.strip() == "epikv: interrupted before the first token; nothing was generated"
    if as_json:
        data = json.loads(result.stdout)
        assert data["stop_reason"] == "interrupted" and data["generated_tokens"] == 0 and data["text"] == ""
        assert set(data) == set(
            json.loads(invoke("generate", "--model", str(tiny_model_dir), "-n", "1", "--json", "hi").stdout)
        )
    else:
        assert result.stdout == ""


def test_ctrl_c_during_prefill_does_not_mention_text_above(tiny_model_dir, monkeypatch):
    interrupt_after(monkeypatch, 0)
    result = invoke("generate", "--model", str(tiny_model_dir), "hello")
    assert result.exit_code == 130
    assert "nothing was generated" in result.stderr and "text above" not in result.stderr


def test_real_sigint_while_starting_up(tiny_model_dir):
    """SIGINT while torch is being imported: exit 130 with one line, never a traceback or an abort."""
    command = [sys.executable, "-m", "epikv_cli", "generate", "--model", str(tiny_model_dir), "--json", "hello"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while "libtorch" not in Path(f"/proc/{process.pid}/maps").read_text() and time.monotonic() < deadline:
        time.sleep(0.002)  # torch's shared libraries are being mapped: the import is under way
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert err.decode().strip() == STARTUP_INTERRUPTED and out == b""


@pytest.mark.parametrize("batch", [False, True])
def test_a_reader_that_closes_the_pipe_ends_the_run_quietly_with_141(tiny_model_dir, tmp_path, batch):
    """``epikv generate ... | head -c 20``: the reader is gone before the first write; no traceback, no
    "Exception ignored" at exit, and the shell's SIGPIPE status rather than 1 (a batch with failed prompts)."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("one\ntwo\n")
    source = ["--prompts", str(prompts)] if batch else ["hello"]
    command = [
        sys.executable,
        "-m",
        "epikv_cli",
        "generate",
        "--model",
        str(tiny_model_dir),
        "-n",
        "8",
        "--ignore-eos",
        *source,
    ]
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has already gone
    try:
        process = subprocess.run(command, stdout=write_end, stderr=subprocess.PIPE, timeout=120)
    finally:
        os.close(write_end)
    assert process.returncode == 141, process.stderr
    assert b"Traceback" not in process.stderr and b"Exception ignored" not in process.stderr


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["generate", "--help"]])
def test_eager_options_to_a_closed_pipe_exit_141_too(args):
    """--help and --version print while the arguments are parsed, before any command runs."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        process = subprocess.run(
            [sys.executable, "-m", "epikv_cli", *args], stdout=write_end, stderr=subprocess.PIPE, timeout=120
        )
    finally:
        os.close(write_end)
    assert process.returncode == 141 and process.stderr == b"", process.stderr


def suggested_budget(stderr: str) -> int:
    return int(re.search(r"use --budget (\d+) or more", stderr).group(1))


@pytest.mark.parametrize(
    "prompt, extra",
    [
        ("hello", []),
        ("hello", ["-p", "epikv"]),
        ("a" * 300, ["-p", "epikv"]),
        ("hello", ["-p", "epikv", "--recent", "30"]),
        ("hello", ["-p", "streaming"]),
    ],
)
def test_the_suggested_budget_works_and_is_the_smallest(tiny_model_dir, prompt, extra):
    def run(budget):
        return invoke("generate", "--model", str(tiny_model_dir), "-n", "3", "-q", "-b", str(budget), *extra, prompt)

    first = run(1)
    assert_one_line_usage_error(first, "use --budget")
    suggested = suggested_budget(first.stderr)
    assert run(suggested).exit_code == 0
    below = run(suggested - 1)
    assert_one_line_usage_error(below, f"use --budget {suggested} or more")


def test_streaming_budget_message_names_its_own_numbers(tiny_model_dir):
    result = invoke("generate", "--model", str(tiny_model_dir), "-p", "streaming", "-b", "4", "hello")
    assert_one_line_usage_error(result, "too small for streaming", "4 sink tokens", "use --budget 5 or more")
    assert "prompt" not in result.stderr


def test_no_arguments_prints_help_and_succeeds():
    result = invoke()
    assert result.exit_code == 0 and result.stderr == ""
    assert "Usage: epikv" in result.stdout and "generate" in result.stdout


@pytest.mark.parametrize("args", [["--help"], ["generate", "--help"]])
def test_help_fits_80_columns(args):
    result = runner.invoke(app, args, env={"COLUMNS": "80"})
    assert result.exit_code == 0
    text = result.stdout
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "<bool>" not in text and "…" not in text
    if args[0] == "generate":
        for name in (*POLICIES, "compressed", "flash_attention_2", "bfloat16"):
            assert re.search(rf"(?<![\w-]){name}(?![\w-])", text), name  # whole, never broken mid-word
        for whole in ("SmolLM2-135M-Instruct", "--no-chat-template", "--no-panel", "--max-new-tokens", "EPIKV_MODEL"):
            assert whole in text


def test_model_without_a_chat_template_says_so_once(plain_model_dir):
    result = invoke("generate", "--model", str(plain_model_dir), "-n", "2", "hello")
    assert result.exit_code == 0
    assert result.stderr.count("has no chat template; the prompt is used as plain text") == 1
    quiet = invoke("generate", "--model", str(plain_model_dir), "-n", "2", "-q", "hello")
    assert quiet.stderr == ""
    chosen = invoke("generate", "--model", str(plain_model_dir), "-n", "2", "--no-chat-template", "hello")
    assert "chat template" not in chosen.stderr


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--policy", "h2o"], ["policy 'h2o' runs on --engine transformers only", "streaming, epikv, epikv2 and full"]),
        (["--panel"], ["--panel follows the transformers engine's steps"]),
        (["--device-map", "cpu"], ["--engine vllm does not take --device-map"]),
        (["--positions", "compressed"], ["--positions compressed is the transformers engine's paper harness"]),
        ([], ["--engine vllm needs vLLM, which lives in a venv of its own", "make vllm-venv"]),
    ],
)
def test_engine_vllm_refuses_what_it_cannot_run_before_anything_loads(args, needles):
    """This venv has no vLLM (its tests run in .venv-vllm): every refusal is one line, exit 2."""
    assert_one_line_usage_error(invoke("generate", "--engine", "vllm", *args, "hi"), *needles)


def test_serve_refuses_a_policy_vllm_does_not_run():
    assert_one_line_usage_error(invoke("serve", "--policy", "knorm"), "policy 'knorm' runs on --engine transformers")
