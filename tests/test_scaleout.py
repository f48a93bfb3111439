"""The batch command under a launcher: prompts split across two CPU ranks, one merged output in input order."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from epikv_cli.scaleout import Ranks

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


def test_two_processes_write_one_merged_output(tiny_model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    lines = [json.dumps({"id": f"q{i}", "prompt": f"question {i}"}) for i in range(7)]
    lines.insert(3, "{broken")
    prompts.write_text("\n".join(lines) + "\n")
    common = ["generate", "--model", str(tiny_model_dir), "-n", "6", "-b", "48", "--ignore-eos", "-q", "--prompts", str(prompts)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    merged = tmp_path / "merged.jsonl"
    launched = subprocess.run(
        [str(TORCHRUN), "--nproc_per_node", "2", "-m", "epikv_cli", *common, "--output", str(merged)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert launched.returncode == 1, launched.stderr[-2000:]  # the broken line fails; the rest ran
    single = tmp_path / "single.jsonl"
    alone = subprocess.run([sys.executable, "-m", "epikv_cli", *common, "--output", str(single)], env=env, capture_output=True, text=True)
    assert alone.returncode == 1

    rows = read(merged)
    assert [r["line"] for r in rows] == list(range(1, 9))  # input order
    assert {r["rank"] for r in rows} == {0, 1}  # both ranks worked
    assert [r["id"] for r in rows] == [r["id"] for r in read(single)]
    assert [r["text"] for r in rows] == [r["text"] for r in read(single)]  # same greedy results as one process
    assert "not valid JSON" in rows[3]["error"]
