"""``epikv profile``: load once, measure (:mod:`epikv_cli.experiments.profile`), print a table or one JSON object."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console

from epikv_cli.cli.ui import profile_table, progress_bar, wide_console
from epikv_cli.errors import EXIT_INTERRUPTED, writing
from epikv_cli.experiments.profile import (
    ProfileSettings,
    machine_info,
    measure_vllm,
    prompt_ids,
    reports_of,
    run_profile,
)
from epikv_cli.models.loading import load


class VllmEngines:
    """One vLLM engine per policy of the run (an engine's policy and budget are fixed), built before any is measured,
    so that the runs can interleave; each holds the KV memory of ``--batch-size`` requests."""

    def __init__(self, model_settings, settings: ProfileSettings, log) -> None:
        from epikv_cli.cli.vllm_run import open_engine, tokenizer_for  # noqa: PLC0415 (vllm: only here)

        path, self.tokenizer = tokenizer_for(model_settings, log)
        longest = settings.prompt_tokens + settings.new_tokens
        self.settings = settings
        self.engines = {
            run.label: open_engine(
                path, self.tokenizer, model_settings, settings.cache_for(run), longest, settings.batch_size
            ).llm
            for run in settings.runs
        }
        first = next(iter(self.engines.values()))
        self.dtype = str(first.llm_engine.vllm_config.model_config.dtype).removeprefix("torch.")
        self.device = str(first.llm_engine.vllm_config.device_config.device)

    def measurer(self, ids):
        """:func:`run_profile`'s ``measurer`` for these engines."""

        def measure(run, cache, new_tokens: int):
            return measure_vllm(self.engines[run.label], ids, cache, new_tokens, self.settings.batch_size)

        return measure


def check_rings(settings: ProfileSettings) -> None:
    """On ``--engine vllm``: the prompt must fit each evicting run's ring (the whole prompt is one forward into it)."""
    from epikv_cli.vllm.ring import check_prompt  # noqa: PLC0415 (the vLLM engine's: only for it)

    for cache, policy in settings.evicting():
        check_prompt(policy, cache, settings.prompt_tokens)


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
    log = None if quiet else (lambda message: err.print(f"[dim]{message}[/dim]"))
    if model_settings.engine == "vllm":
        check_rings(settings)  # before the engines are built
        loaded, engines = None, VllmEngines(model_settings, settings, log)
        ids = prompt_ids(engines.tokenizer, settings.prompt_tokens, prompt_file)
        measurer = engines.measurer(ids)
    else:
        loaded, measurer = load(model_settings, log), None
        settings.check_context(loaded.model)
        ids = prompt_ids(loaded.tokenizer, settings.prompt_tokens, prompt_file)
    total = len(settings.runs) * (settings.repeats + 1)
    measured: dict = {}
    interrupted = False
    try:
        with progress_bar(err, disable=quiet, transient=True) as progress:
            task = progress.add_task("profile", total=total, status="")
            reports = run_profile(
                loaded.model if loaded is not None else None,
                loaded.tokenizer if loaded is not None else None,
                settings,
                ids,
                lambda label: progress.update(task, advance=1, status=label),
                measured,
                measurer,
            )
    except KeyboardInterrupt:
        interrupted = True
        reports = reports_of(measured)
    if interrupted and not reports:
        print("epikv: interrupted before any measured run finished; nothing to report", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    model_name = model_settings.shape or model_settings.model or "SmolLM2-135M-Instruct"
    if model_settings.engine == "vllm":
        model_name += " on vLLM"
    if model_settings.layers:
        model_name += f" ({model_settings.layers} layers)"
    first = next(loaded.model.parameters()) if loaded is not None else None
    dtype = str(first.dtype).removeprefix("torch.") if first is not None else engines.dtype
    device = str(first.device) if first is not None else engines.device
    machine = machine_info(device)
    if json_output:
        report = {
            "model": model_name,
            "budget": settings.budget,
            "prompt_tokens": settings.prompt_tokens,
            "new_tokens": settings.new_tokens,
            "repeats": settings.repeats,
            "interrupted": interrupted,
            "batch_size": settings.batch_size,
            "attn": loaded.attn if loaded is not None else "epikv ring (vllm)",
            "dtype": dtype,
            "device": device,
            "engine": model_settings.engine,
            "machine": machine,
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
            f"{reports[0].peak_memory_kind} (prefill/decode); stored is the in-step peak; "
            + (machine["gpu"] or f"{machine['cpu']} ({machine['cpu_capability']})")
            + f", {machine['threads']} thread{'s' if machine['threads'] != 1 else ''}"
        )
        out = wide_console()
        with writing("stdout"):
            out.print(profile_table(reports, title, compact=out.width < 110))
    if interrupted:
        runs = sum(len(runs) for runs in measured.values())
        print(
            f"epikv: interrupted after {runs} measured runs; the medians above are over the runs that finished",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_INTERRUPTED
    return 0
