"""A full disk while writing (issue 36 item 10): one line on stderr that says no space is left on the device and
names the file (or stdout), exit status 74, no traceback, and the JSONL lines written before are whole, so that
``--resume`` continues from them once there is room.

stdout on a full device is /dev/full, in a child process; a full filesystem is a real 64 KiB tmpfs mounted in the
test's directory (root is needed to mount it, as in CI: the fixture fails, never skips, where it cannot mount).
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from epikv_cli.cli.app import app

runner = CliRunner()
NO_SPACE = "no space left on the device"
STDOUT_FULL = f"epikv: error: cannot write stdout: {NO_SPACE}"
PAGE = 4096  # tmpfs hands out space in pages


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 64 KiB tmpfs mounted at ``tmp_path / "full"``, unmounted after the test."""
    mount = tmp_path / "full"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs (these tests need root, as in CI): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def fill(directory: Path, leave: int = 0) -> Path:
    """Fill ``directory``'s filesystem, then free ``leave`` bytes (whole pages) again; returns the filler file."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    size = 0
    try:
        while True:
            size += os.write(fd, b"\0" * PAGE)
    except OSError as error:
        assert error.errno == errno.ENOSPC
    finally:
        os.close(fd)
    os.truncate(filler, max(size - leave, 0))
    return filler


def assert_one_line(stderr: str, start: str) -> None:
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(start), stderr


def whole_lines(path: Path) -> list[dict]:
    """Every line of ``path``, each a JSON object, the last one ended."""
    text = path.read_text()
    assert text == "" or text.endswith("\n"), text[-200:]
    return [json.loads(line) for line in text.splitlines()]


def run_into_dev_full(args: list[str], buffered: bool = True) -> subprocess.CompletedProcess:
    """``epikv ARGS > /dev/full`` in a child process (``buffered``: stdout as a user's shell gives it)."""
    assert Path("/dev/full").exists(), "this machine has no /dev/full"
    env = dict(os.environ)
    if buffered:
        env.pop("PYTHONUNBUFFERED", None)
    else:
        env["PYTHONUNBUFFERED"] = "1"
    with open("/dev/full", "w") as full:
        return subprocess.run(
            [sys.executable, "-m", "epikv_cli", *args],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=300,
        )


# -- stdout on a full device ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "extra, buffered",
    [([], True), (["--json"], True), (["--json"], False)],
    ids=["text", "json", "json-unbuffered"],
)
def test_generate_into_dev_full(tiny_model_dir, extra, buffered):
    done = run_into_dev_full(
        ["generate", "--model", str(tiny_model_dir), "-n", "16", *extra, "Tell me a story."], buffered=buffered
    )
    assert done.returncode == 74, done.stderr
    assert_one_line(done.stderr, STDOUT_FULL)


def test_a_batch_on_stdout_into_dev_full(tiny_model_dir, tmp_path):
    prompts = tmp_path / "two.txt"
    prompts.write_text("Tell me a story.\nAnd another.\n")
    done = run_into_dev_full(["generate", "--model", str(tiny_model_dir), "-n", "16", "--prompts", str(prompts)])
    assert done.returncode == 74, done.stderr
    assert_one_line(done.stderr, STDOUT_FULL)  # the progress bar leaves nothing behind either


@pytest.mark.parametrize("command", ["fidelity", "eval"])
def test_a_summary_into_dev_full_keeps_the_output_file(tiny_model_dir, tmp_path, command):
    data = problems(tmp_path, 2)
    out = tmp_path / "out.jsonl"
    source = ["--prompts", str(data), "--budgets", "+8"] if command == "fidelity" else ["--dataset", str(data)]
    done = run_into_dev_full(
        [command, "--model", str(tiny_model_dir), *source, "--policies", "full", "-n", "8", "-o", str(out), "-q"]
    )
    assert done.returncode == 74, done.stderr
    assert_one_line(done.stderr, STDOUT_FULL)
    assert [row["id"] for row in whole_lines(out)] == [1, 2]


# -- a full filesystem -----------------------------------------------------------------------------------
def problems(directory: Path, count: int) -> Path:
    path = directory / "set.jsonl"
    path.write_text(
        "".join(
            json.dumps({"problem": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n" for i in range(1, count + 1)
        )
    )
    return path


def check_full_then_resume(out: Path, filler: Path, run, count: int) -> None:
    """``run(resume)`` fails on the full filesystem with one line naming ``out`` and keeps whole lines; with room
    again, ``--resume`` adds the rest and leaves the earlier lines as they were."""
    failed = run(False)
    assert failed.exit_code == 74, (failed.exit_code, failed.stderr)
    assert_one_line(failed.stderr, f"epikv: error: cannot write {out}: {NO_SPACE}")
    assert "--resume" in failed.stderr
    kept = whole_lines(out)
    assert 0 < len(kept) < count
    filler.unlink()
    resumed = run(True)
    assert resumed.exit_code == 0, resumed.stderr
    rows = whole_lines(out)
    assert len(rows) == count and rows[: len(kept)] == kept


def test_a_batch_output_on_a_full_filesystem(tiny_model_dir, tmp_path, tiny_tmpfs):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"Tell me story number {i}.\n" for i in range(12)))
    out = tiny_tmpfs / "out.jsonl"
    filler = fill(tiny_tmpfs, leave=PAGE)  # room for a few lines, not for twelve

    def run(resume: bool):
        args = ["generate", "--model", str(tiny_model_dir), "-n", "4", "--prompts", str(prompts), "-o", str(out)]
        return runner.invoke(app, [*args, "-q", *(["--resume"] if resume else [])])

    check_full_then_resume(out, filler, run, 12)


@pytest.mark.parametrize("command", ["fidelity", "eval"])
def test_fidelity_and_eval_output_on_a_full_filesystem(tiny_model_dir, tmp_path, tiny_tmpfs, command):
    data = problems(tmp_path, 24)
    out = tiny_tmpfs / "out.jsonl"
    filler = fill(tiny_tmpfs, leave=PAGE)
    source = ["--prompts", str(data), "--budgets", "+8"] if command == "fidelity" else ["--dataset", str(data)]

    def run(resume: bool):
        args = [command, "--model", str(tiny_model_dir), *source, "--policies", "full", "-n", "4", "-o", str(out)]
        return runner.invoke(app, [*args, "-q", "--json", *(["--resume"] if resume else [])])

    check_full_then_resume(out, filler, run, 24)


def test_calibrate_with_its_cache_on_a_full_filesystem(tiny_model_dir, tmp_path, tiny_tmpfs, monkeypatch):
    monkeypatch.setenv("EPIKV_CACHE_DIR", str(tiny_tmpfs / "cache"))
    (tiny_tmpfs / "cache" / "bands").mkdir(parents=True)
    fill(tiny_tmpfs)
    prompts = tmp_path / "p.txt"
    prompts.write_text("The first prompt.\nA second one, longer than the first.\n")
    result = runner.invoke(app, ["calibrate", "--model", str(tiny_model_dir), "--prompts", str(prompts), "-n", "64"])
    assert result.exit_code == 74, (result.exit_code, result.stderr)
    # the table's warning (4 windows are few), then one line for the error
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1].startswith(f"epikv: error: cannot write {tiny_tmpfs / 'cache' / 'bands'}/")
    assert NO_SPACE in result.stderr
    assert list((tiny_tmpfs / "cache" / "bands").iterdir()) == []  # no half-written bands file to be read later
    assert "nowhere (not saved)" in " ".join(result.stdout.split())  # what was measured is shown all the same


def test_calibrate_with_its_cache_under_a_file(tiny_model_dir, tmp_path, monkeypatch):
    """The cache folder cannot be made (a file stands in its path): one line naming the file, the table shown."""
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("EPIKV_CACHE_DIR", str(tmp_path / "afile" / "cache"))
    prompts = tmp_path / "p.txt"
    prompts.write_text("The first prompt.\nA second one, longer than the first.\n")
    result = runner.invoke(app, ["calibrate", "--model", str(tiny_model_dir), "--prompts", str(prompts), "-n", "64"])
    assert result.exit_code == 74, (result.exit_code, result.stderr)
    assert "Traceback" not in result.stderr
    last = result.stderr.splitlines()[-1]
    assert last.startswith(f"epikv: error: cannot write {tmp_path / 'afile' / 'cache' / 'bands'}/"), last
    assert "nowhere (not saved)" in " ".join(result.stdout.split())
