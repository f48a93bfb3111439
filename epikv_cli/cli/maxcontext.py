"""``epikv profile --max-context``: search (:mod:`epikv_cli.experiments.maxcontext`), then a table or one JSON
object."""

from __future__ import annotations

import json
from dataclasses import asdict

from rich.console import Console

from epikv_cli.cli.ui import max_context_table, status_line
from epikv_cli.errors import UsageError, writing
from epikv_cli.experiments.maxcontext import parse_memory, run_max_context


def max_context_command(
    model_settings, runs, limit_text: str | None, json_output: bool = False, quiet: bool = False
) -> int:
    """``epikv profile --max-context``: search, then a table (or ``--json``) with ratios to the first policy."""

    if limit_text is None:
        raise UsageError("--max-context needs --memory-limit, e.g. --memory-limit 16GiB")
    limit = parse_memory(limit_text)
    err = Console(stderr=True, highlight=False)
    with status_line(err, quiet) as status:
        results = run_max_context(model_settings, runs, limit, progress=lambda text: status.update(text))
    first = results[0].max_prompt_tokens
    rows = [{**asdict(r), "ratio": round(r.max_prompt_tokens / first, 3) if first else None} for r in results]
    model_name = model_settings.shape or model_settings.model or "SmolLM2-135M-Instruct"
    with writing("stdout"):
        if json_output:
            print(
                json.dumps(
                    {"model": model_name, "layers": model_settings.layers, "memory_limit_bytes": limit, "results": rows}
                ),
                flush=True,
            )
        else:
            Console(highlight=False).print(
                max_context_table(rows, f"{model_name}: longest prefill within {limit / 2**30:.2f} GiB")
            )
    return 0
