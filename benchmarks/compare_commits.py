"""Two checkouts of epikv, the same measurements, interleaved: is the new code as fast as the old?

Each round runs ``epikv profile`` (decode tokens/s per policy) and ``benchmarks/step_cost.py`` (per-step cost of
the cache and policy without the model) once in each checkout, alternating which goes first, each in its own
process with its checkout's package first on the path. Reported: per figure, the median over rounds in each
checkout and the ratio new / old of the medians (tokens/s: above 1 is faster; step ms: below 1 is faster).

    git worktree add /tmp/epikv-old 5def55e
    .venv/bin/python benchmarks/compare_commits.py --old /tmp/epikv-old --new . --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

PROFILE = (
    "-m epikv_cli profile --policies {policies} --budget {budget} --prompt-tokens {prompt} --new-tokens {new} "
    "--repeats 1 --json -q"
)
STEP_COST = "benchmarks/step_cost.py --policies {policies} --budgets {budgets} --steps {steps} --rounds 1 --json"


def run(checkout: Path, arguments: str) -> dict:
    """``python ARGUMENTS`` in ``checkout`` with its package first on the path and one torch thread; its JSON."""
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, *arguments.split()], cwd=checkout, env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def figures(checkout: Path, args: argparse.Namespace) -> dict[str, float]:
    """One round's figures in ``checkout``: ``profile POLICY tok/s`` and ``step POLICY K ms``."""
    found = {}
    profile = run(
        checkout,
        PROFILE.format(policies=args.policies, budget=args.budget, prompt=args.prompt_tokens, new=args.new_tokens),
    )
    for row in profile["results"]:
        found[f"profile {row['policy']} decode tok/s"] = row["decode_tokens_per_s"]
    steps = run(checkout, STEP_COST.format(policies=args.step_policies, budgets=args.budgets, steps=args.steps))
    for row in steps["results"]:
        found[f"step {row['policy']} K={row['budget']} ms"] = row["step_ms"]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, required=True, help="the old checkout")
    parser.add_argument("--new", type=Path, required=True, help="the new checkout")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--policies", default="streaming,epikv,epikv2", help="for epikv profile")
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument(
        "--step-policies", default="streaming,epikv,lagkv:chunks=positions", help="for step_cost.py (attention-free)"
    )
    parser.add_argument("--budgets", default="1024,8192", help="for step_cost.py")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    old, new = args.old.resolve(), args.new.resolve()
    seen: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
    for round_ in range(args.rounds):
        order = [("old", old), ("new", new)] if round_ % 2 == 0 else [("new", new), ("old", old)]
        for label, checkout in order:
            for name, value in figures(checkout, args).items():
                seen[label].setdefault(name, []).append(value)
        print(f"round {round_ + 1} of {args.rounds} done", file=sys.stderr)
    print(f"{'figure':44s} {'old median':>11s} {'new median':>11s} {'new / old':>10s}")
    for name in seen["old"]:
        before, after = statistics.median(seen["old"][name]), statistics.median(seen["new"][name])
        print(f"{name:44s} {before:11.3f} {after:11.3f} {after / before:10.3f}")


if __name__ == "__main__":
    main()
