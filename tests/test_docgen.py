"""Shell completions and the man page are generated from the CLI, current, and work."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from epikv_cli.cli import docgen
from epikv_cli.policies.registry import POLICIES

ROOT = Path(__file__).resolve().parent.parent


def test_generated_files_are_current():
    assert docgen.stale() == [], "run: python -m epikv_cli.cli.docgen"


def test_stale_files_are_detected(tmp_path):
    docgen.write(tmp_path)
    assert docgen.stale(tmp_path) == []
    (tmp_path / "man/epikv.1").write_text("old")
    assert docgen.stale(tmp_path) == ["man/epikv.1"]


@pytest.mark.skipif(shutil.which("groff") is None, reason="groff is not installed")
def test_man_page_renders_without_warnings():
    done = subprocess.run(["groff", "-man", "-ww", "-z", str(ROOT / "man/epikv.1")], capture_output=True, text=True)
    assert done.returncode == 0 and done.stderr == ""


def test_man_page_lists_every_command_and_option():
    page = (ROOT / "man/epikv.1").read_text()
    root, commands = docgen.command_tree()
    for command in commands:
        assert f".SS epikv {command.name}" in page
        for option in command.options:
            for name in option.names + option.negations:
                assert f"\\fB{name.replace('-', chr(92) + '-')}\\fR" in page, name
    for section in ("EXAMPLES", "EXIT STATUS", "ENVIRONMENT"):
        assert f".SH {section}" in page
    for variable in ("EPIKV_CACHE_DIR", "EPIKV_MODEL"):
        assert variable in page
    assert "\\fB130\\fR" in page and "\\fB2\\fR" in page


def bash_complete(*words: str) -> list[str]:
    script = (
        f"source {ROOT / 'completions/epikv.bash'}; COMP_WORDS=({' '.join(repr(w) for w in words)}); "
        f"COMP_CWORD={len(words) - 1}; _epikv; printf '%s\\n' \"${{COMPREPLY[@]}}\""
    )
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.split()


def test_bash_completion():
    assert bash_complete("epikv", "") == [
        "calibrate",
        "eval",
        "fidelity",
        "generate",
        "profile",
        "serve",
        "--version",
        "--install-completion",
        "--show-completion",
        "--help",
        "-h",
    ]
    assert bash_complete("epikv", "profile", "--sha") == ["--shape"]
    assert bash_complete("epikv", "profile", "--shape", "qw") == ["qwen2.5-32b", "qwen3-8b", "qwq-32b"]
    assert bash_complete("epikv", "generate", "--pol") == ["--policy", "--policy-option"]
    assert bash_complete("epikv", "generate", "--policy", "") == sorted(POLICIES)
    assert bash_complete("epikv", "generate", "--positions", "c") == ["compressed"]
    assert "--no-chat-template" in bash_complete("epikv", "generate", "--no-")
    assert bash_complete("epikv", "generate", "--attn", "") == ["auto", "sdpa", "eager", "flash_attention_2"]
    assert bash_complete("epikv", "generate", "--device-map", "b") == ["balanced", "balanced_low_0"]
    assert bash_complete("epikv", "generate", "--device-map", "c") == ["cpu", "cuda"]


def bash_complete_lines(cwd, *words: str) -> list[str]:
    """COMPREPLY, one element per line (file names may hold spaces), completed in ``cwd``."""
    script = (
        f"source {ROOT / 'completions/epikv.bash'}; COMP_WORDS=({' '.join(repr(w) for w in words)}); "
        f"COMP_CWORD={len(words) - 1}; _epikv; printf '%s\\n' \"${{COMPREPLY[@]}}\""
    )
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True, cwd=cwd)
    return result.stdout.splitlines()


def test_bash_completes_file_names_with_spaces_as_one_word(tmp_path):
    (tmp_path / "my prompts.txt").write_text("hi\n")
    (tmp_path / "math500.jsonl").write_text("{}\n")
    assert bash_complete_lines(tmp_path, "epikv", "generate", "--prompts", "my") == ["my prompts.txt"]
    assert bash_complete_lines(tmp_path, "epikv", "profile", "--prompt-file", "my") == ["my prompts.txt"]
    assert sorted(bash_complete_lines(tmp_path, "epikv", "eval", "--dataset", "ma")) == ["math500", "math500.jsonl"]
    assert bash_complete_lines(tmp_path, "epikv", "eval", "--dataset", "gs") == ["gsm8k"]


def test_policies_complete_item_by_item():
    assert bash_complete("epikv", "profile", "--policies", "") == sorted(POLICIES)
    assert bash_complete("epikv", "fidelity", "--policies", "streaming,ep") == ["streaming,epikv", "streaming,epikv2"]
    assert bash_complete("epikv", "eval", "--policies", "full,h2o,r") == ["full,h2o,random", "full,h2o,rkv"]
    from epikv_cli.cli.app import _complete_policies

    assert _complete_policies("streaming,ep") == ["streaming,epikv", "streaming,epikv2"]  # Typer's own completion


def test_the_help_version_and_completion_start_without_torch():
    """llama-cli answers --help at once; importing torch and transformers took about 5 s of each."""
    probe = (
        "import sys, runpy; sys.argv = ['epikv'] + sys.argv[1:]\n"
        "from epikv_cli.cli.app import app\n"
        "try:\n    app()\nexcept SystemExit:\n    pass\n"
        "print('HEAVY', sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    env = {**os.environ, "_EPIKV_COMPLETE": ""}
    for args in (["--help"], ["--version"], ["generate", "--help"], ["profile", "--help"]):
        out = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, cwd=ROOT, env=env)
        assert out.stdout.strip().splitlines()[-1] == "HEAVY []", (args, out.stdout[-300:], out.stderr[-300:])
    complete = {
        **os.environ,
        "_EPIKV_COMPLETE": "complete_bash",
        "COMP_WORDS": "epikv generate --pol",
        "COMP_CWORD": "2",
    }
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, env=complete)
    assert "--policy" in out.stdout and out.stdout.strip().splitlines()[-1] == "HEAVY []", (out.stdout, out.stderr)


def test_man_page_says_repeatable_once():
    page = (ROOT / "man/epikv.1").read_text()
    # three options repeat (generate's --stop and --policy-option, serve's --policy-option); each says so once, with
    # no "(repeatable)" metavar
    assert "repeatable" not in page.lower() and page.count("May be repeated.") == 3


@pytest.mark.skipif(shutil.which("fish") is None, reason="fish is not installed")
def test_fish_completion():
    script = f"source {ROOT / 'completions/epikv.fish'}; complete -C 'epikv generate --policy '"
    out = subprocess.run(["fish", "-c", script], capture_output=True, text=True, check=True).stdout
    assert [line.split("\t")[0] for line in out.splitlines()] == sorted(POLICIES)


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed")
def test_zsh_completion_parses():
    subprocess.run(["zsh", "-n", str(ROOT / "completions/_epikv")], check=True)


def test_install_completion_still_works(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path), "SHELL": "/bin/bash"}
    epikv = str(Path(sys.executable).parent / "epikv")  # the installed console script, named as users type it
    # Typer detects the shell from the process's ancestors, so run it from bash as a user would
    # (the trailing command keeps bash from exec-ing epikv in its place)
    done = subprocess.run(
        ["bash", "-c", f"{epikv} --install-completion; exit $?"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / ".bash_completions/epikv.sh").exists()
    # and Typer's dynamic completion answers through the one-line-error wrapper
    env.update({"_EPIKV_COMPLETE": "complete_bash", "COMP_WORDS": "epikv generate --budg", "COMP_CWORD": "2"})
    done = subprocess.run([epikv], env=env, capture_output=True, text=True)
    assert done.stdout.split() == ["--budget"]


def test_no_user_facing_text_points_to_this_projects_data_directory():
    """`../shared/data/` is where this project keeps its datasets, not a path in a user's clone: the README, the CLI
    reference, the man page and every --help show paths a user can have."""
    from typer.testing import CliRunner

    from epikv_cli.cli.app import app

    texts = {name: (ROOT / name).read_text() for name in ("README.md", "docs/cli.md", "man/epikv.1")}
    for command in ("generate", "profile", "fidelity", "eval", "calibrate"):
        texts[f"{command} --help"] = CliRunner().invoke(app, [command, "--help"]).stdout
    assert [name for name, text in texts.items() if "shared/data" in text] == []


def test_the_readme_and_pyproject_agree_on_python():
    import tomllib

    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == ">=3.11" and "Python 3.11 or newer" in (ROOT / "README.md").read_text()
