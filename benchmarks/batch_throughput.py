"""Total tokens/s of a batch file against --batch-size, whole process timed, configurations interleaved.

Each run is ``epikv generate --prompts FILE -n T --ignore-eos --budget K --policy P --batch-size B -o OUT``
in a fresh process (model load and prefill included: what a user waits for). Runs go round-robin over
every (policy, batch size) pair, ``--rounds`` times; the median wall time of each pair is reported
with its tokens/s and the ratio to the first pair.

    .venv/bin/python benchmarks/batch_throughput.py --prompts /tmp/gsm32.jsonl          # B = 1, 2, 4, 8, 16
    .venv/bin/python benchmarks/batch_throughput.py --prompts /tmp/gsm8.jsonl --batch-sizes 1,8 \\
        --policies streaming,epikv --rounds 2

The prompt file is an epikv batch file; the first 32 GSM8K questions make one with::

    python -c 'import json,sys; [print(json.dumps({"id": str(i), "prompt": json.loads(line)["question"]}))
               for i, line in zip(range(32), open(sys.argv[1]))]' ../shared/data/gsm8k_test.jsonl > /tmp/gsm32.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EPIKV = str(Path(sys.executable).parent / "epikv")


def run_once(args, policy: str, batch: int, out: Path) -> tuple[float, int]:
    """Wall seconds and generated tokens of one whole-process run."""
    command = [
        EPIKV,
        "generate",
        "--prompts",
        args.prompts,
        "-n",
        str(args.new_tokens),
        "--ignore-eos",
        "--budget",
        str(args.budget),
        "--batch-size",
        str(batch),
        "-o",
        str(out),
        "--overwrite",
        "-q",
    ]
    name, *options = policy.split(":")  # a spec such as epikv2:keep=head
    command += ["--policy", name] + [part for option in options for part in ("--policy-option", option)]
    if args.model:
        command += ["--model", args.model]
    for flag in ("shape", "layers", "dtype"):  # a random model of a known shape (for a GPU run)
        if getattr(args, flag) is not None:
            command += [f"--{flag}", str(getattr(args, flag))]
    start = time.perf_counter()
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    seconds = time.perf_counter() - start
    tokens = sum(json.loads(line)["stats"]["generated_tokens"] for line in out.read_text().splitlines())
    return seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--model", default=None)
    parser.add_argument("--shape", default=None, help="a known shape with random weights, e.g. qwen2.5-32b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--policies", default="epikv")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    pairs = [(p, int(b)) for p in args.policies.split(",") for b in args.batch_sizes.split(",")]
    walls: dict[tuple[str, int], list[float]] = {pair: [] for pair in pairs}
    tokens: dict[tuple[str, int], int] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            for policy, batch in pairs:
                seconds, count = run_once(args, policy, batch, Path(scratch) / f"{policy}-{batch}.jsonl")
                walls[(policy, batch)].append(seconds)
                tokens[(policy, batch)] = count
                print(f"round {round_ + 1}: {policy} batch {batch}: {count} tokens in {seconds:.1f} s", file=sys.stderr)
    first = None
    print(f"{'policy':10s} {'batch':>5s} {'tokens':>7s} {'wall s':>8s} {'tokens/s':>9s} {'ratio':>6s}")
    for pair in pairs:
        wall = statistics.median(walls[pair])
        rate = tokens[pair] / wall
        first = first or rate
        print(f"{pair[0]:10s} {pair[1]:5d} {tokens[pair]:7d} {wall:8.1f} {rate:9.1f} {rate / first:6.2f}")


if __name__ == "__main__":
    main()
