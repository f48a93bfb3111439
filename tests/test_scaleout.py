"""The batch command under a launcher: prompts split across two CPU ranks, one merged output in input order."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from epikv_cli.cli.app import app
from epikv_cli.runtime.scaleout import Ranks

TORCHRUN = Path(sys.executable).parent / "torchrun"


def test_shard_is_round_robin():
    items = list(range(7))
    assert Ranks(rank=0, world=2).shard(items) == [0, 2, 4, 6]
    assert Ranks(rank=1, world=2).shard(items) == [1, 3, 5]
    assert Ranks().shard(items) == items


def test_single_process_by_default(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ranks = Ranks.from_env()
    assert (ranks.rank, ranks.world, ranks.device_map("auto")) == (0, 1, "auto")


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.long
def test_two_processes_write_one_merged_output(tiny_model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    lines = [json.dumps({"id": f"q{i}", "prompt": f"question {i}"}) for i in range(7)]
    lines.insert(3, "{broken")
    prompts.write_text("\n".join(lines) + "\n")
    common = [
        "generate",
        "--model",
        str(tiny_model_dir),
        "-n",
        "6",
        "-b",
        "48",
        "--ignore-eos",
        "-q",
        "--prompts",
        str(prompts),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    merged = tmp_path / "merged.jsonl"
    launched = subprocess.Popen(
        [str(TORCHRUN), "--nproc_per_node", "2", "-m", "epikv_cli", *common, "--output", str(merged)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    single = tmp_path / "single.jsonl"  # one process, this one, meanwhile
    alone = CliRunner().invoke(app, [*common, "--output", str(single)])
    _, stderr = launched.communicate(timeout=300)
    assert launched.returncode == 1, stderr[-2000:]  # the broken line fails; the rest ran
    assert alone.exit_code == 1, alone.stderr

    rows = read(merged)
    assert [r["line"] for r in rows] == list(range(1, 9))  # input order
    assert {r["rank"] for r in rows} == {0, 1}  # both ranks worked
    assert [r["id"] for r in rows] == [r["id"] for r in read(single)]
    assert [r["text"] for r in rows] == [r["text"] for r in read(single)]  # same greedy results as one process
    assert "not valid JSON" in rows[3]["error"]


def launch_with(tmp_path, tiny_model_dir, injection: str, prompts: list[str], timeout: int = 240):
    """torchrun over two CPU ranks with ``injection`` run at start-up of every rank (a sitecustomize)."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "import os\nif os.environ.get('RANK') is not None:\n"
        + "".join(f"    {line}\n" for line in injection.splitlines())
    )
    path = tmp_path / "p.txt"
    path.write_text("\n".join(prompts) + "\n")
    out = tmp_path / "out.jsonl"
    command = [
        str(TORCHRUN),
        "--nproc_per_node",
        "2",
        "-m",
        "epikv_cli",
        "generate",
        "--model",
        str(tiny_model_dir),
        "-n",
        "6",
        "-b",
        "48",
        "--ignore-eos",
        "-q",
        "--prompts",
        str(path),
        "--output",
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(inject)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    return done, out


def test_out_of_memory_on_one_rank_is_that_prompts_error(tiny_model_dir, tmp_path):
    injection = (
        "import torch, epikv_cli.cli.batch as batch\n"
        "real = batch._generate\n"
        "def flaky(loaded, item, settings):\n"
        "    if item.prompt == 'question 3':\n"
        "        raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')\n"
        "    return real(loaded, item, settings)\n"
        "batch._generate = flaky\n"
    )
    done, out = launch_with(tmp_path, tiny_model_dir, injection, [f"question {i}" for i in range(6)])
    assert done.returncode == 1, done.stderr[-2000:]
    rows = read(out)
    assert [r["line"] for r in rows] == list(range(1, 7)) and {r["rank"] for r in rows} == {0, 1}
    assert [r["line"] for r in rows if r["error"]] == [4]
    assert rows[3]["error"].startswith("OutOfMemoryError: CUDA out of memory")
    assert not re.search(r'File ".*epikv_cli', done.stderr)  # torchrun reports the exit status 1; no epikv traceback


def test_a_rank_that_dies_never_leaves_the_other_waiting(tiny_model_dir, tmp_path):
    """Rank 1 fails outside any prompt (here: its model load); the launch ends, it does not hang."""
    injection = (
        "if os.environ['RANK'] == '1':\n"
        "    import epikv_cli.cli.batch as batch\n"
        "    def broken(*args, **kwargs):\n"
        "        raise SystemExit(3)\n"
        "    batch.load = broken\n"
    )
    done, out = launch_with(tmp_path, tiny_model_dir, injection, [f"question {i}" for i in range(4)], timeout=120)
    assert done.returncode != 0  # and subprocess.run's timeout did not fire


def test_eval_splits_across_two_ranks(tiny_model_dir, tmp_path):
    data = tmp_path / "set.jsonl"
    data.write_text("".join(json.dumps({"problem": f"problem {i}", "answer": str(i)}) + "\n" for i in range(5)))
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') is not None:\n"
        "    import types, epikv_cli.experiments.evaluate as evaluate\n"
        "    class Scripted:\n"
        "        def __init__(self, model, tokenizer, ids, cache, sampling):\n"
        "            number = tokenizer.decode(ids[0]).split('problem ')[1][0]\n"
        "            self.text = '\\\\boxed{' + number + '}' if number != '3' else 'no idea'\n"
        "        def __iter__(self):\n"
        "            self.result = types.SimpleNamespace(text=self.text, prompt_tokens=5, generated_tokens=3, "
        "stop_reason='eos', decode_tokens_per_s=9.0)\n"
        "            return iter(())\n"
        "    evaluate.Generation = Scripted\n"
    )
    out = tmp_path / "eval.jsonl"
    command = [
        str(TORCHRUN),
        "--nproc_per_node",
        "2",
        "-m",
        "epikv_cli",
        "eval",
        "--model",
        str(tiny_model_dir),
        "--dataset",
        str(data),
        "--policies",
        "full,streaming",
        "--budgets",
        "64,+16",
        "-n",
        "8",
        "-o",
        str(out),
        "--json",
        "-q",
    ]
    done = subprocess.run(
        command,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(inject)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = read(out)
    # in input order, as one process writes it: by problem, then by config (the ranks' lines interleave within one)
    configs = [("full", "none"), ("streaming", "64"), ("streaming", "+16")]
    assert [(r["line"], r["policy"], r["budget"]) for r in rows] == [(i, *c) for i in range(1, 6) for c in configs]
    assert {r["rank"] for r in rows} == {0, 1}
    assert [r["correct"] for r in rows[::3]] == [True, True, True, False, True]
    summary = json.loads(done.stdout.strip().splitlines()[-1])  # printed once, by rank 0
    assert [(row["correct"], row["problems"]) for row in summary["results"]] == [(4, 5)] * 3


@pytest.mark.long
def test_two_nodes_on_localhost(tiny_model_dir, tmp_path):
    """The multi-node path: two torchrun "nodes" (one process each) meeting at a rendezvous endpoint."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(f"question {i}" for i in range(5)) + "\n")
    out = tmp_path / "out.jsonl"
    common = [
        "generate",
        "--model",
        str(tiny_model_dir),
        "-n",
        "5",
        "-b",
        "48",
        "--ignore-eos",
        "-q",
        "--prompts",
        str(prompts),
        "--output",
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            # the README's multi-node command: --nnodes, --node-rank, --rdzv-endpoint
            [
                str(TORCHRUN),
                "--nnodes",
                "2",
                "--node-rank",
                str(rank),
                "--nproc-per-node",
                "1",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "-m",
                "epikv_cli",
                *common,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    codes = [node.wait(timeout=240) for node in nodes]
    assert codes == [0, 0], [node.stderr.read()[-1500:] for node in nodes]
    rows = read(out)
    assert [r["line"] for r in rows] == [1, 2, 3, 4, 5] and {r["rank"] for r in rows} == {0, 1}


def test_world_size_without_a_launcher_is_one_line(tiny_model_dir, tmp_path, monkeypatch):
    """WORLD_SIZE left over in a shell (no torchrun): accelerate's ValueError was a traceback."""
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    prompts = tmp_path / "p.txt"
    prompts.write_text("one\n")
    args = ["generate", "--model", str(tiny_model_dir), "-n", "4", "--prompts", str(prompts), "-o", str(tmp_path / "o")]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 2
    assert done.stderr.strip().splitlines() == [
        "epikv: error: WORLD_SIZE is 2 but RANK, MASTER_ADDR, MASTER_PORT are not set: start the processes with "
        "torchrun or accelerate launch, or unset WORLD_SIZE"
    ]
