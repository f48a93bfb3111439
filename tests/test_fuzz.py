"""Whatever a user types: exit status 0, 1 or 2, never a traceback; a batch accounts for every line once; into a
full stdout, one line and status 74; an empty list is refused."""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from epikv_cli.cli.app import app
from epikv_cli.policies.registry import POLICIES

runner = CliRunner()
FUZZ = settings(
    max_examples=int(
        os.environ.get("FUZZ_EXAMPLES", "60")
    ),  # more on demand: FUZZ_EXAMPLES=1000 pytest tests/test_fuzz.py
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


def mostly(valid, bad):
    """Five draws in six from ``valid``, one from ``bad``: enough runs get as far as generating."""
    return st.integers(0, 5).flatmap(lambda i: bad if i == 0 else valid)


text = st.text(
    st.characters(codec="utf-8", exclude_categories=["Cs"]) | st.sampled_from(["\udce9", "\udcff"]), max_size=12
)
unusable_floats = st.sampled_from([float("nan"), float("inf"), -float("inf"), -1.0, 1e308])

OPTIONS = {
    "--budget": mostly(st.integers(8, 120), st.sampled_from([-3, 0, 1, 10**12, "x", "1e3"])),
    "--policy": mostly(st.sampled_from(sorted(POLICIES)), st.just("h2o")),
    "--recent": mostly(st.integers(0, 40), st.sampled_from([-2, 10**6, "abc"])),
    "--bands": mostly(
        st.sampled_from(["0:+1,3:-1", "2:-1", "1:-1.0"]), st.sampled_from(["1:+2", "9:+1", "x", "0:+1,0:-1"])
    ),
    "--positions": mostly(st.sampled_from(["logical", "compressed"]), st.just("absolute")),
    "--max-new-tokens": mostly(st.integers(1, 5), st.sampled_from([-1, 0, "many"])),
    "--temperature": mostly(st.floats(0, 2), unusable_floats),
    "--top-p": mostly(st.floats(0.05, 1), unusable_floats),
    "--top-k": mostly(st.integers(0, 10**6), st.just(-1)),
    "--seed": mostly(st.integers(0, 2**64 - 1), st.sampled_from([-5, 2**64, 2**70])),
    "--stop": text,
    "--system": text,
    "--spike-threshold": mostly(st.floats(-5, 5), unusable_floats),
    "--device-map": mostly(
        st.sampled_from(["auto", "cpu", "sequential"]), st.sampled_from(["cuda", "cuda:3", "mps", "tpu"])
    ),
    "--dtype": mostly(st.sampled_from(["auto", "float32", "bfloat16"]), st.just("int4")),
    "--attn": mostly(st.sampled_from(["auto", "sdpa", "eager"]), st.sampled_from(["flash_attention_2", "fast"])),
}
FLAGS = ["--ignore-eos", "--no-chat-template", "--json", "-q", "--no-panel", "--panel", "--overwrite"]


@st.composite
def generate_command(draw):
    args = []
    for option, values in OPTIONS.items():
        if draw(st.integers(0, 3)) == 0:
            args += [option, str(draw(values))]
    args += [flag for flag in FLAGS if draw(st.integers(0, 6)) == 0]
    piped = draw(st.booleans())
    prompt = draw(st.binary(min_size=0, max_size=20)) if piped else draw(text)
    return args, piped, prompt


def assert_no_traceback(result):
    assert result.exit_code in (0, 1, 2), (result.exit_code, result.stderr[-2000:])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.stderr


@FUZZ
@given(command=generate_command())
def test_generate_options(tiny_model_dir, command):
    args, piped, prompt = command
    base = ["generate", "--model", str(tiny_model_dir), "-n", "3", "--budget", "4096"]
    if piped:
        result = runner.invoke(app, [*base, *args, "-"], input=prompt)
    else:
        result = runner.invoke(app, [*base, *args, "--", prompt])
    assert_no_traceback(result)
    if result.exit_code == 2:
        lines = result.stderr.strip().splitlines()
        assert lines[-1].startswith("epikv: error: ") and lines[-1] != "epikv: error: "


SETTING_VALUES = st.one_of(
    st.integers(-3, 60),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    text,
    st.lists(st.text(max_size=3), max_size=2),
)
LINE_KEYS = [
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "ignore_eos",
    "budget",
    "recent",
    "bogus",
]


@st.composite
def prompt_line(draw):
    """One non-blank line of a prompt file, as bytes."""
    kind = draw(st.sampled_from(["json", "json", "messages", "text", "bad json", "not utf8", "array"]))
    if kind in ("json", "messages"):
        data = (
            {"prompt": draw(text) or "x"} if kind == "json" else {"messages": [{"role": "user", "content": draw(text)}]}
        )
        if draw(st.booleans()):
            data["id"] = draw(
                st.one_of(st.integers(1000, 10**9), st.text(min_size=6, max_size=10), st.booleans(), st.none())
            )
        for key in draw(st.lists(st.sampled_from(LINE_KEYS), max_size=3, unique=True)):
            data[key] = draw(SETTING_VALUES)
        return json.dumps(data).encode()
    if kind == "text":
        return ("w" + draw(text)).encode("utf-8", "surrogateescape").replace(b"\n", b" ").replace(b"\r", b" ")
    if kind == "bad json":
        return b'{"prompt": "unfinished'
    if kind == "array":
        return b'["prompt", 1]'
    return b"caf\xe9 " + draw(st.binary(max_size=6)).replace(b"\n", b"").replace(b"\r", b"")


@FUZZ
@given(
    lines=st.lists(st.one_of(prompt_line(), st.sampled_from([b"", b"   "])), min_size=1, max_size=7),
    suffix=st.sampled_from([".jsonl", ".txt"]),
)
def test_batch_lines(tiny_model_dir, tmp_path_factory, lines, suffix):
    folder = tmp_path_factory.mktemp("fuzz")
    prompts = folder / f"p{suffix}"
    prompts.write_bytes(b"\n".join(lines) + b"\n")
    out = folder / "out.jsonl"
    args = [
        "generate",
        "--model",
        str(tiny_model_dir),
        "-n",
        "2",
        "-b",
        "64",
        "-q",
        "--prompts",
        str(prompts),
        "-o",
        str(out),
    ]
    result = runner.invoke(app, args)
    assert_no_traceback(result)
    expected = [number for number, line in enumerate(lines, 1) if line.strip()]
    if result.exit_code == 2:  # refused before anything ran: one line, nothing written
        assert len(result.stderr.strip().splitlines()) == 1 and (not out.exists() or out.read_text() == "")
        assert not expected or "same id" in result.stderr
        return
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["line"] for row in rows] == expected  # every input line exactly once, in order
    failed = [row["line"] for row in rows if row["error"] is not None]
    assert result.exit_code == (1 if failed else 0)


class FullStdoutRunner(CliRunner):
    """Typer's test runner, with stdout on a full device: /dev/full itself, as ``> /dev/full`` gives it."""

    @contextmanager
    def isolation(self, *args, **kwargs):
        with super().isolation(*args, **kwargs) as streams, open("/dev/full", "w") as full:
            own = sys.stdout  # kept, or the runner's stream is closed as it is dropped
            sys.stdout = full
            try:
                yield streams
            finally:
                sys.stdout = own


@settings(FUZZ, max_examples=max(1, FUZZ.max_examples // 3))
@given(command=generate_command())
def test_generate_into_a_full_stdout(tiny_model_dir, command):
    """Whatever the options: refused (2), or one line saying stdout's device is full (74); never a traceback."""
    args, piped, prompt = command
    base = ["generate", "--model", str(tiny_model_dir), "-n", "3", "--budget", "4096"]
    full = FullStdoutRunner()
    if piped:
        result = full.invoke(app, [*base, *args, "-"], input=prompt)
    else:
        result = full.invoke(app, [*base, *args, "--", prompt])
    assert result.exit_code in (2, 74), (result.exit_code, repr(result.exception), result.stderr[-2000:])
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    if result.exit_code == 74:
        assert last == "epikv: error: cannot write stdout: no space left on the device"
    else:
        assert last.startswith("epikv: error: ") and last != "epikv: error: "


EMPTY_LIST = st.lists(st.sampled_from(["", " ", "\t"]), min_size=1, max_size=3).map(",".join)


@FUZZ
@given(
    where=st.sampled_from(
        [
            ("profile", "--policies"),
            ("profile --max-context --memory-limit 1GiB", "--policies"),
            ("fidelity", "--policies"),
            ("fidelity", "--budgets"),
            ("eval", "--policies"),
            ("eval", "--budgets"),
        ]
    ),
    empty=EMPTY_LIST,
)
def test_an_empty_list_is_refused(tiny_model_dir, tmp_path_factory, where, empty):
    """``--policies ''`` (or only blanks and commas) is refused with one line, never read as the default set."""
    command, option = where
    data = tmp_path_factory.mktemp("empty") / "set.jsonl"
    data.write_text(json.dumps({"problem": "What is 1 + 1?", "answer": "2"}) + "\n")
    source = {
        "profile": ["--new-tokens", "8", "--repeats", "1", "--prompt-tokens", "16"],
        "fidelity": ["--prompts", str(data), "-n", "2"],
        "eval": ["--dataset", str(data), "-n", "2"],
    }[command.split()[0]]
    result = runner.invoke(app, [*command.split(), "--model", str(tiny_model_dir), *source, option, empty])
    assert_no_traceback(result)
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, (result.exit_code, result.stderr)
    assert lines[0].startswith(f"epikv: error: {option} ") and "empty" in lines[0]


@settings(FUZZ, max_examples=max(1, FUZZ.max_examples // 3))
@given(
    first=st.lists(st.sampled_from(["alpha", "beta", "gamma", "delta"]), min_size=1, max_size=4),
    second=st.lists(st.sampled_from(["alpha", "beta", "gamma", "delta"]), min_size=1, max_size=4),
    budgets=st.tuples(st.sampled_from(["40", "48"]), st.sampled_from(["40", "48"])),
    tokens=st.tuples(st.sampled_from(["2", "3"]), st.sampled_from(["2", "3"])),
)
def test_resume_never_mixes_prompts_or_settings(tiny_model_dir, tmp_path_factory, first, second, budgets, tokens):
    """Any first batch, then any second batch resumed into the same file: refused (one line, the file untouched)
    exactly when a finished id holds another prompt or other settings; otherwise every line answers its prompt."""
    folder = tmp_path_factory.mktemp("resume")
    out = folder / "out.jsonl"

    def run(lines, budget, new_tokens, *extra):
        prompts = folder / f"p{len(list(folder.iterdir()))}.txt"
        prompts.write_text("\n".join(lines) + "\n")
        args = ["generate", "--model", str(tiny_model_dir), "-n", new_tokens, "-b", budget, "-q"]
        return runner.invoke(app, [*args, "--prompts", str(prompts), "-o", str(out), *extra])

    assert run(first, budgets[0], tokens[0]).exit_code == 0
    before = out.read_bytes()
    result = run(second, budgets[1], tokens[1], "--resume")
    assert_no_traceback(result)
    overlap = range(min(len(first), len(second)))  # ids are line numbers
    clash = any(first[i] != second[i] for i in overlap) or (budgets[0], tokens[0]) != (budgets[1], tokens[1])
    if clash:
        assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert out.read_bytes() == before
    else:
        assert result.exit_code == 0, result.stderr
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        assert [row["prompt"] for row in rows] == (second + first[len(second) :])[: max(len(first), len(second))]
