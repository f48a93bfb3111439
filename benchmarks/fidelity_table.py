"""Markdown tables from `epikv fidelity --output` files, means over the prompts every policy ran.

`epikv fidelity` itself averages each policy × budget over the prompts that policy could run; a
prompt whose prompt plus recent window does not fit the budget is skipped by prompt-protecting
policies only, so those means would be over different prompts. This script keeps, per budget, the
prompts on which every listed policy ran, so that each column compares like with like.

    .venv/bin/python benchmarks/fidelity_table.py run-a.jsonl run-b.jsonl            # KL and top-1
    .venv/bin/python benchmarks/fidelity_table.py run.jsonl --metrics kl_all,kept_age
    .venv/bin/python benchmarks/fidelity_table.py run.jsonl --policies streaming,epikv2
    .venv/bin/python benchmarks/fidelity_table.py run.jsonl --wins streaming     # prompts won, per budget

Several files are concatenated (a run split over processes by --offset); a prompt id found twice
is an error.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from epikv_cli.data.jsonl import read_results

# per metric of `epikv fidelity`: the column label and the decimals shown
COLUMNS = {
    "kl_after_full": ("KL", 4),
    "kl_all": ("KL all", 4),
    "top1_after_full": ("top-1", 3),
    "top1_all": ("top-1 all", 3),
    "perplexity": ("ppl", 3),
    "kept_age": ("age", 0),
}


def load(paths: list[Path]) -> list[dict]:
    """Every prompt record (lines with ``results``) of the files, in order; a line still being written is left out."""
    records, seen = [], set()
    for path in paths:
        for record in read_results(path):
            if "results" not in record:
                continue
            key = json.dumps(record["id"])
            if key in seen:
                raise SystemExit(f"fidelity_table: prompt {record['id']} appears twice; give each prompt once")
            seen.add(key)
            records.append(record)
    return records


def table(records: list[dict], policies: list[str], budgets: list[str], metrics: list[str]) -> str:
    """A markdown table: one row per policy, one column per metric × budget, and the prompt counts."""
    cells: dict[tuple[str, str, str], float | None] = {}
    counts = {}
    for budget in budgets:
        common = common_prompts(records, policies, budget)
        counts[budget] = len(common)
        for policy in policies:
            for metric in metrics:
                values = [c[policy][metric] for c in common if c[policy].get(metric) is not None]
                cells[policy, budget, metric] = statistics.fmean(values) if values else None
    head = ["policy"] + [f"{COLUMNS.get(m, (m, 4))[0]} {b}" for m in metrics for b in budgets]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for policy in policies:
        row = [f"`{policy}`"]
        for metric in metrics:
            for budget in budgets:
                value = cells[policy, budget, metric]
                row.append("–" if value is None else f"{value:.{COLUMNS.get(metric, (metric, 4))[1]}f}")
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lines.append("Prompts in each mean: " + ", ".join(f"{b}: {counts[b]}" for b in budgets) + f" (of {len(records)}).")
    return "\n".join(lines)


def common_prompts(records: list[dict], policies: list[str], budget: str) -> list[dict[str, dict]]:
    """Per prompt on which every one of ``policies`` ran at ``budget``: its results by policy."""
    common = []
    for record in records:
        by_policy = {r["policy"]: r for r in record["results"] if r["budget"] == budget}
        if all(p in by_policy and "error" not in by_policy[p] for p in policies):
            common.append(by_policy)
    return common


def wins(
    records: list[dict], policies: list[str], budgets: list[str], against: str, metric: str = "kl_after_full"
) -> str:
    """A markdown table: per policy and budget, on how many prompts it is strictly below ``against`` on
    ``metric`` (lower is better), out of the prompts both ran; ties count for neither."""
    lines = [
        "| policy | " + " | ".join(f"below `{against}` {b}" for b in budgets) + " |",
        "|---" + "|---:" * len(budgets) + "|",
    ]
    for policy in policies:
        if policy == against:
            continue
        row = [f"`{policy}`"]
        for budget in budgets:
            pairs = [
                (c[policy].get(metric), c[against].get(metric))
                for c in common_prompts(records, [policy, against], budget)
            ]
            pairs = [(mine, theirs) for mine, theirs in pairs if mine is not None and theirs is not None]
            row.append(f"{sum(mine < theirs for mine, theirs in pairs)} / {len(pairs)}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def repetition(records: list[dict]) -> str | None:
    """A line on how repetitive the references were (``reference_repeats`` of each prompt line), or None
    when the files predate that field."""
    shares = [r["reference_repeats"] for r in records if r.get("reference_repeats") is not None]
    if not shares:
        return None
    return (
        f"Reference tokens closing an 8-gram seen earlier (copy loops near 1): mean {statistics.fmean(shares):.3f}, "
        f"median {statistics.median(shares):.3f}, from {min(shares):.3f} to {max(shares):.3f} over {len(shares)} "
        "prompts."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--policies", help="comma-separated, in table order (default: as in the first record)")
    parser.add_argument("--metrics", default="kl_after_full,top1_after_full")
    parser.add_argument(
        "--wins", metavar="POLICY", help="instead: per budget, on how many prompts each policy's KL is below POLICY's"
    )
    args = parser.parse_args(argv)
    records = load(args.files)
    if not records:
        print("fidelity_table: no prompt records in the files", file=sys.stderr)
        return 2
    first = records[0]["results"]
    policies = args.policies.split(",") if args.policies else list(dict.fromkeys(r["policy"] for r in first))
    budgets = list(dict.fromkeys(r["budget"] for r in first))
    if args.wins and args.wins not in policies:
        print(
            f"fidelity_table: --wins {args.wins}: no such policy in the files; give one of {', '.join(policies)}",
            file=sys.stderr,
        )
        return 2
    if args.wins:
        print(wins(records, policies, budgets, args.wins))
        return 0
    print(table(records, policies, budgets, args.metrics.split(",")))
    if (line := repetition(records)) is not None:
        print("\n" + line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
