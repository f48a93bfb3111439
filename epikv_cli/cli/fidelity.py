"""``epikv fidelity``: load once, replay every prompt (:mod:`epikv_cli.experiments.fidelity`) with a progress bar,
append each prompt's record to ``--output``, print the table or one JSON object."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console

from epikv_cli.cli.ui import fidelity_table, progress_bar, wide_console
from epikv_cli.data.fingerprint import Fingerprint, model_run, problem_fingerprints, resumable
from epikv_cli.data.jsonl import JsonlWriter, id_key, write_records
from epikv_cli.data.problems import Problem
from epikv_cli.errors import EXIT_INTERRUPTED, UsageError, writing
from epikv_cli.experiments.fidelity import Config, SummaryRow, fidelity_records, summarise, unfinished
from epikv_cli.models.loading import load


def run_fidelity(
    loaded,
    problems: list[Problem],
    configs: list[Config],
    new_tokens: int,
    output: Path | None,
    previous: list[dict],
    fingerprints: dict[str, Fingerprint],
    quiet: bool = False,
    trace: bool = False,
) -> tuple[list[SummaryRow], int]:
    """Replay every problem and config not already in ``previous`` (the records of ``output`` being resumed);
    return the summary and exit status. Each record carries its prompt's fingerprint. ``trace``: each record
    also holds the reference token ids and every position's KL per config."""

    err = Console(stderr=True, highlight=False, soft_wrap=True)
    todo = unfinished(problems, configs, previous)
    finished = {id_key(r["id"]) for r in previous}
    again = sum(1 for problem, _ in todo if id_key(problem.id) in finished)
    if again and not quiet:
        print(
            f"epikv: resuming: {again} finished prompts run again for the policies and budgets added since",
            file=sys.stderr,
        )
    if output is not None and previous:  # --resume: its whole lines, not a line a crash cut short
        write_records(output, previous)
    elif output is not None:
        output.write_text("", encoding="utf-8")
    ids = {id_key(p.id) for p in problems}  # a resumed file may hold other prompts (--limit, --offset): not counted
    records = [r for r in previous if "results" in r and id_key(r["id"]) in ids]
    writer = JsonlWriter(output) if output is not None else None
    interrupted = False
    try:
        with progress_bar(err, disable=quiet, transient=True, eta=True) as progress:
            task = progress.add_task("fidelity", total=len(todo) * new_tokens, status="")
            for record in fidelity_records(
                loaded,
                todo,
                new_tokens,
                trace=trace,
                advance=lambda: progress.advance(task),
                status=lambda text: progress.update(task, status=text),
            ):
                fingerprints[id_key(record["id"])].stamp(record)
                records.append(record)
                if writer is not None:
                    writer.write(record)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if writer is not None:
            writer.close()
    if interrupted:
        where = f" in {output}; rerun with --resume to continue" if output else ""
        print(f"epikv: interrupted; every finished prompt is{where}", file=sys.stderr)
    return summarise(records, configs), EXIT_INTERRUPTED if interrupted else 0


def summary_json(model_name: str, new_tokens: int, prompts: int, rows: list[SummaryRow]) -> str:
    return json.dumps(
        {"model": model_name, "new_tokens": new_tokens, "prompts": prompts, "results": [r.to_dict() for r in rows]}
    )


def fidelity_command(
    model_settings,
    files,
    problems_from,
    configs: list[Config],
    new_tokens: int,
    json_output: bool = False,
    quiet: bool = False,
    trace: bool = False,
) -> int:
    """``epikv fidelity``: load once, replay every problem, print the table (or ``--json``)."""

    if new_tokens < 1:
        raise UsageError(f"--new-tokens must be at least 1, got {new_tokens}")
    if trace and files.output is None:
        raise UsageError("--trace writes every position's KL into the per-prompt records; give --output FILE")
    problems = problems_from()
    run = {**model_run(model_settings), "new_tokens": new_tokens}
    fingerprints = problem_fingerprints(problems, run, str(files.prompts))
    previous = resumable(files.output, files.resume, fingerprints)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    loaded = load(model_settings, None if quiet else (lambda message: err.print(f"[dim]{message}[/dim]")))
    rows, code = run_fidelity(
        loaded, problems, configs, new_tokens, files.output, previous, fingerprints, quiet=quiet, trace=trace
    )
    model_name = model_settings.shape or model_settings.model or "SmolLM2-135M-Instruct"
    if json_output:
        with writing("stdout"):
            print(summary_json(model_name, new_tokens, len(problems), rows), flush=True)
    else:
        title = (
            f"{model_name}: {len(problems)} prompts, {new_tokens} reference tokens; means over prompts of "
            "KL(full || policy) and top-1 agreement after the cache first filled (full) and over all positions; "
            "ppl of the reference; age of the kept generated tokens; n prompts that fit the budget"
        )
        out = wide_console()
        with writing("stdout"):
            out.print(fidelity_table(rows, title, compact=out.width < 100))
    return code
