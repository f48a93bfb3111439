"""``epikv eval``: load, judge every problem x policy x budget (:mod:`epikv_cli.experiments.evaluate`) with a
progress bar, across processes when launched so, appending each record to ``--output``; print the accuracy table
or one JSON object."""

from __future__ import annotations

import dataclasses
import json
import sys

from rich.console import Console

from epikv_cli.cli.ui import eval_table, progress_bar, wide_console
from epikv_cli.data.fingerprint import Fingerprint, model_run, problem_fingerprints, resumable
from epikv_cli.data.jsonl import JsonlWriter, id_key, read_results, sort_by_line, write_records
from epikv_cli.data.problems import Problem
from epikv_cli.errors import EXIT_INTERRUPTED, UsageError, writing
from epikv_cli.experiments.evaluate import (
    check_references,
    eval_records,
    load_eval_problems,
    remaining,
    summarise,
    without_retried,
)
from epikv_cli.experiments.fidelity import Config
from epikv_cli.models.loading import load
from epikv_cli.runtime.scaleout import PeerFailed, Ranks


def run_eval(
    loaded,
    problems: list[Problem],
    configs: list[Config],
    max_new_tokens: int,
    files,
    ranks,
    previous: list[dict],
    fingerprints: dict[str, Fingerprint],
    quiet: bool = False,
    batch_size: int = 1,
) -> tuple[list[dict], int]:
    """Every problem x config not yet in ``previous`` (the records of the output being resumed); returns all
    records and the exit status. Each record carries its prompt's fingerprint."""

    err = Console(stderr=True, highlight=False, soft_wrap=True)
    work = remaining(problems, configs, previous)
    records = without_retried(previous, work)  # a retried error's new record replaces it
    if ranks.is_main and files.output is not None:
        if files.resume:  # its whole lines (not a line a crash cut short), less the errors run again
            write_records(files.output, records)
        else:
            files.output.write_text("", encoding="utf-8")
    mine = ranks.shard(work)
    interrupted = False
    writer = None
    try:
        ranks.barrier()
        writer = JsonlWriter(files.output) if files.output is not None else None
        with progress_bar(err, disable=quiet or not ranks.is_main, transient=True, eta=True) as progress:
            task = progress.add_task("eval", total=len(mine), status="")
            for record in eval_records(loaded, mine, max_new_tokens, batch_size):
                progress.update(task, status=f"{record['id']} {record['policy']} {record['budget']}")
                fingerprints[id_key(record["id"])].stamp(record)
                if ranks.world > 1:
                    record["rank"] = ranks.rank
                records.append(record)
                if writer is not None:
                    writer.write(record)
                progress.advance(task)
        ranks.barrier()
    except KeyboardInterrupt:
        interrupted = True
    except PeerFailed:
        ranks.close()
        print(
            f"epikv: rank {ranks.rank}: another process of this launch stopped early; rerun with --resume",
            file=sys.stderr,
        )
        return records, 1
    finally:
        if writer is not None:
            writer.close()
    if interrupted:
        ranks.close()
        where = f" in {files.output}; rerun with --resume to continue" if files.output else ""
        print(f"epikv: interrupted; every finished problem is{where}", file=sys.stderr)
        return records, EXIT_INTERRUPTED
    if ranks.world > 1 and files.output is not None:
        records = read_results(files.output)  # every rank's lines
        if ranks.is_main:  # input order: by problem, then by config as one process writes them
            order = {(config.policy, config.budget.text): index for index, config in enumerate(configs)}
            sort_by_line(files.output, lambda record: order.get((record.get("policy"), record.get("budget")), -1))
    ranks.close()
    return records, 0


def eval_command(
    model_settings,
    dataset: str,
    field: str | None,
    answer_field: str,
    limit: int | None,
    offset: int,
    configs: list[Config],
    max_new_tokens: int,
    files,
    json_output: bool = False,
    quiet: bool = False,
    batch_size: int = 1,
) -> int:
    """``epikv eval``: load, run every problem x config, print the accuracy table (or ``--json``)."""

    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1, got {batch_size}")
    problems = load_eval_problems(dataset, field, answer_field, limit, offset)
    ranks = Ranks.from_env()
    if ranks.world > 1 and files.output is None:
        raise UsageError("several processes need --output FILE.jsonl to write one merged result")
    run = {**model_run(model_settings), "max_new_tokens": max_new_tokens}
    fingerprints = problem_fingerprints(problems, run, dataset)
    previous = resumable(files.output, files.resume, fingerprints)
    check_references(files.output, previous, problems, dataset)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    placed = dataclasses.replace(model_settings, device_map=ranks.device_map(model_settings.device_map))
    loaded = load(placed, None if quiet else (lambda message: err.print(f"[dim]{message}[/dim]")))
    records, code = run_eval(
        loaded,
        problems,
        configs,
        max_new_tokens,
        files,
        ranks,
        previous,
        fingerprints,
        quiet=quiet,
        batch_size=batch_size,
    )
    if not ranks.is_main:
        return code
    ids = {id_key(p.id) for p in problems}  # a resumed file may hold other problems (--limit, --offset): not counted
    rows = summarise([r for r in records if "policy" in r and id_key(r["id"]) in ids], configs)
    model_name = model_settings.shape or model_settings.model or "SmolLM2-135M-Instruct"
    if json_output:
        with writing("stdout"):
            print(
                json.dumps(
                    {
                        "model": model_name,
                        "dataset": dataset,
                        "problems": len(problems),
                        "max_new_tokens": max_new_tokens,
                        "results": [r.to_dict() for r in rows],
                    }
                ),
                flush=True,
            )
    else:
        title = (
            f"{model_name} on {dataset}: {len(problems)} problems, greedy, {max_new_tokens} new tokens at most; "
            "accuracy with its 95% Wilson interval"
        )
        with writing("stdout"):
            wide_console().print(eval_table(rows, title))
    return code
