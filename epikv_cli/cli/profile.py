"""``epikv profile``: load once, measure (:mod:`epikv_cli.experiments.profile`), print a table or one JSON object."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from epikv_cli.cli.ui import profile_table, progress_bar, wide_console
from epikv_cli.errors import writing
from epikv_cli.experiments.profile import ProfileSettings, prompt_ids, run_profile
from epikv_cli.models.loading import load


def profile_command(
    model_settings,
    settings: ProfileSettings,
    prompt_file: Path | None = None,
    json_output: bool = False,
    quiet: bool = False,
) -> int:
    """``epikv profile``: load once, measure, print a table (or ``--json``); return the exit status."""

    err = Console(stderr=True, highlight=False, soft_wrap=True)
    settings.check_budgets()  # before the model loads
    loaded = load(model_settings, None if quiet else (lambda message: err.print(f"[dim]{message}[/dim]")))
    settings.check_context(loaded.model)
    ids = prompt_ids(loaded.tokenizer, settings.prompt_tokens, prompt_file)
    total = len(settings.runs) * (settings.repeats + 1)
    with progress_bar(err, disable=quiet, transient=True) as progress:
        task = progress.add_task("profile", total=total, status="")
        reports = run_profile(
            loaded.model, loaded.tokenizer, settings, ids, lambda label: progress.update(task, advance=1, status=label)
        )
    model_name = model_settings.shape or model_settings.model or "SmolLM2-135M-Instruct"
    if model_settings.layers:
        model_name += f" ({model_settings.layers} layers)"
    if json_output:
        report = {
            "model": model_name,
            "budget": settings.budget,
            "prompt_tokens": settings.prompt_tokens,
            "new_tokens": settings.new_tokens,
            "repeats": settings.repeats,
            "batch_size": settings.batch_size,
            "attn": loaded.attn,
            "dtype": str(next(loaded.model.parameters()).dtype).removeprefix("torch."),
            "device": str(next(loaded.model.parameters()).device),
            "results": [r.to_dict() for r in reports],
        }
        with writing("stdout"):
            print(json.dumps(report), flush=True)
    else:
        title = (
            f"{model_name}: budget {settings.budget}, prompt {settings.prompt_tokens} tokens, {settings.new_tokens} new"
            + (f" x {settings.batch_size} rows decoded together (tok/s: all rows)" if settings.batch_size > 1 else "")
            + ", "
            f"median of {settings.repeats} runs; × is the ratio to {reports[0].policy}; peak memory is "
            f"{reports[0].peak_memory_kind} (prefill/decode); stored is the in-step peak"
        )
        out = wide_console()
        with writing("stdout"):
            out.print(profile_table(reports, title, compact=out.width < 110))
    return 0
