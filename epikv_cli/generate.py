"""``epikv generate`` for one prompt: load, build the prompt, stream tokens (or print JSON), summarise."""

from __future__ import annotations

import json
import sys

from rich.console import Console

from .engine import Generation, GenerationResult
from .models import load
from .prompts import build_input_ids
from .settings import CacheSettings, ModelSettings, PromptSettings, SamplingSettings

EXIT_INTERRUPTED = 130


def summary_line(result: GenerationResult) -> str:
    """One human line with the run's statistics (for stderr)."""
    speed = f"{result.decode_tokens_per_s:.1f} tok/s" if result.decode_tokens_per_s else "n/a tok/s"
    budget = f"/{result.budget}" if result.budget is not None else ""
    return (
        f"{result.generated_tokens} tokens, {speed} decode, evicted {result.evicted}, "
        f"peak stored {result.peak_stored}{budget}, stop: {result.stop_reason}, "
        f"peak memory {result.peak_memory_bytes / 2**20:.0f} MiB ({result.peak_memory_kind})"
    )


def run_generate(
    model_settings: ModelSettings,
    prompt_settings: PromptSettings,
    cache: CacheSettings,
    sampling: SamplingSettings,
    prompt: str,
    json_output: bool = False,
    quiet: bool = False,
) -> int:
    """Run one generation for the CLI; return the exit status. Bad input raises UsageError."""
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    log = (lambda message: None) if quiet else (lambda message: err.print(f"[dim]{message}[/dim]"))
    if not prompt.strip():
        from .errors import UsageError

        raise UsageError("the prompt is empty; pass the text as an argument or pipe it in with '-'")
    if err.is_terminal and not quiet:
        with err.status("loading model…"):
            loaded = load(model_settings, log)
    else:
        loaded = load(model_settings, log)
    input_ids = build_input_ids(loaded.tokenizer, prompt, prompt_settings)
    generation = Generation(loaded.model, loaded.tokenizer, input_ids, cache, sampling)
    out = sys.stdout
    interrupted = False
    try:
        for event in generation:
            if not json_output and event.text:
                out.write(event.text)
                out.flush()
    except KeyboardInterrupt:
        interrupted = True
    result = generation.result
    if not json_output:
        out.write(generation.tail_text + "\n")
        out.flush()
    if result is None:  # interrupted before the first token
        return EXIT_INTERRUPTED
    if json_output:
        print(json.dumps(result.to_dict(), ensure_ascii=False), flush=True)
    elif not quiet:
        err.print(f"[dim]{summary_line(result)}[/dim]")
    if interrupted:
        err.print("interrupted: the text above is everything generated so far")
        return EXIT_INTERRUPTED
    return 0
