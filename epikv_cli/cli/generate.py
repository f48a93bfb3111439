"""``epikv generate`` for one prompt: load, build the prompt, stream tokens (plain, panel or JSON), summarise."""

from __future__ import annotations

import sys
from contextlib import nullcontext

from rich.console import Console

from epikv_cli.cli.ui import DEFAULT_SPIKE_Z, LivePanel, PanelState, PanelView
from epikv_cli.config import (
    CacheSettings,
    ModelSettings,
    PromptSettings,
    SamplingSettings,
)
from epikv_cli.core.memory import peak_memory
from epikv_cli.data.jsonl import encodable, jsonl_line
from epikv_cli.data.prompts import (
    build_input_ids,
    decode_text,
    has_chat_template,
    require_text,
    stdin_bytes,
)
from epikv_cli.errors import EXIT_INTERRUPTED, UsageError, writing
from epikv_cli.models.loading import load
from epikv_cli.runtime.generation import Generation, GenerationResult
from epikv_cli.runtime.stream import input_device

NO_TEMPLATE_NOTE = "this model's tokenizer has no chat template; the prompt is used as plain text"

#: A prompt this long gets a note (and, on a terminal, a status line) before its prefill, which can take minutes.
LONG_PROMPT = 4096


def summary_line(result: GenerationResult) -> str:
    """One human line with the run's statistics (for stderr)."""
    speed = f"{result.decode_tokens_per_s:.1f} tok/s" if result.decode_tokens_per_s else "n/a tok/s"
    budget = f" (budget {result.budget})" if result.budget is not None else ""
    return (
        f"{result.generated_tokens} tokens, {speed} decode, evicted {result.evicted}, "
        f"peak stored {result.peak_stored}{budget}, stop: {result.stop_reason}, "
        f"peak memory {result.peak_memory_bytes / 2**20:.0f} MiB ({result.peak_memory_kind})"
    )


def interruption_line(generated: int, text_shown: bool) -> str:
    """What Ctrl-C prints on stderr, saying truthfully what was kept."""
    if generated == 0:
        return "epikv: interrupted before the first token; nothing was generated"
    kept = "; the text above is everything generated" if text_shown else ""
    return f"epikv: interrupted after {generated} tokens{kept}"


def report_nothing_generated(json_output: bool, policy: str, budget: int | None) -> int:
    """Ctrl-C before the first token: the zero-token JSON object (with ``--json``) and one line; exit 130."""
    if json_output:
        with writing("stdout"):
            print(jsonl_line(GenerationResult.nothing(policy, budget).to_dict(), sys.stdout), end="", flush=True)
    print(interruption_line(0, False), file=sys.stderr)
    return EXIT_INTERRUPTED


def read_prompt(prompt: str | None, warn) -> str:
    """The prompt argument, or stdin for ``-``; undecodable bytes become U+FFFD with one warning."""
    if prompt is None:
        return require_text(None)
    if prompt == "-":
        prompt = stdin_bytes()
        if not prompt.strip():
            raise UsageError(
                "stdin held no prompt text; pipe the prompt in (echo 'text' | epikv generate -) or give it as an "
                "argument"
            )
    text, replaced = decode_text(prompt)
    if replaced:
        warn("the prompt is not valid UTF-8; the bytes that could not be read became U+FFFD")
    return require_text(text)


def run_generate(
    model_settings: ModelSettings,
    prompt_settings: PromptSettings,
    cache: CacheSettings,
    sampling: SamplingSettings,
    prompt: str | None,
    json_output: bool = False,
    quiet: bool = False,
    panel: bool | None = None,
    spike_threshold: float = DEFAULT_SPIKE_Z,
) -> int:
    """Run one generation for the CLI; return the exit status. Bad input raises UsageError.

    ``prompt`` is the text, or ``-`` for stdin. The panel shows by default when stdout is a terminal.
    When stdout is not a terminal it only ever gets the plain text (or the JSON); a forced panel then
    draws on stderr. Ctrl-C at any point exits 130: with ``--json`` the object still prints (zero
    tokens if generation had not started), and no text already printed is lost.
    """
    out = sys.stdout
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    stdout_tty = out.isatty()
    use_panel = not json_output and (panel if panel is not None else stdout_tty)
    panel_console = (Console(highlight=False) if stdout_tty else err) if use_panel else None
    stream_text = not json_output and not (use_panel and stdout_tty)
    log = (lambda message: None) if quiet else (lambda message: err.print(f"[dim]{message}[/dim]"))

    def note(message: str) -> None:
        if not quiet:
            print(f"epikv: {message}", file=sys.stderr, flush=True)

    def emit(text: str) -> None:
        with writing("stdout"):
            out.write(encodable(text, out))
            out.flush()

    generation = view = waiting = None
    interrupted = False
    try:
        prompt = read_prompt(prompt, note)  # before loading the model: fail fast
        status = err.status("loading model…") if err.is_terminal and not quiet else nullcontext()
        with status:
            loaded = load(model_settings, log)
        if prompt_settings.chat_template and not has_chat_template(loaded.tokenizer):
            note(NO_TEMPLATE_NOTE)
        input_ids = build_input_ids(loaded.tokenizer, prompt, prompt_settings)
        generation = Generation(loaded.model, loaded.tokenizer, input_ids, cache, sampling)

        live = None
        if use_panel:
            state = PanelState(
                budget=cache.budget,
                prompt_ids=input_ids[0].tolist(),
                has_scores=generation.policy_has_scores,
                spike_threshold=spike_threshold,
                per_head=generation.policy_per_head,
            )
            view = PanelView(state, loaded.tokenizer)
            device = input_device(loaded.model)
            live = LivePanel(panel_console, state, view, memory_probe=lambda: peak_memory(device)[0])

        first = True
        prompt_len = input_ids.shape[1]
        waiting = None
        if prompt_len >= LONG_PROMPT:  # the prefill is one forward: say why nothing comes for a while
            note(f"prefilling the {prompt_len}-token prompt; the first new token comes after it")
            if err.is_terminal and not quiet and live is None:
                waiting = err.status(f"prefilling {prompt_len} tokens…")
                waiting.start()
        with live or nullcontext():
            for event in generation:
                if waiting is not None:
                    waiting.stop()
                    waiting = None
                if first and str(generation.policy.report().get("bands_source", "")).startswith("calibrated"):
                    note(f"EpiKV bands {generation.bands_description}")  # "9:+1, 20:-1 (calibrated (<file>))"
                first = False
                if stream_text and event.text:
                    emit(event.text)
                if live is not None:
                    view.state.bands = generation.bands_description
                    live.update(event)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if waiting is not None:
            waiting.stop()
    result = generation.result if generation is not None else None
    if result is None:  # interrupted before generation began: nothing to show but the truth
        return report_nothing_generated(json_output, cache.policy, cache.budget)
    if stream_text:
        if result.generated_tokens:  # close the streamed line (interrupted in the prefill: nothing to close)
            emit(generation.tail_text + "\n")
    elif use_panel:  # the live panel was transient: print the whole text now
        emit(result.text + "\n")
    if use_panel:
        view.state.memory_bytes = result.peak_memory_bytes  # the final panel says what the summary line says
        view.state.tokens_per_s = result.decode_tokens_per_s
        panel_console.print(view.render(with_text=False))
    if json_output:
        with writing("stdout"):
            print(jsonl_line(result.to_dict(), sys.stdout), end="", flush=True)
    elif not quiet:
        err.print(f"[dim]{summary_line(result)}[/dim]")
    if interrupted:
        print(interruption_line(result.generated_tokens, not json_output), file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def run_generate_vllm(
    model_settings: ModelSettings,
    prompt_settings: PromptSettings,
    cache: CacheSettings,
    sampling: SamplingSettings,
    prompt: str | None,
    json_output: bool = False,
    quiet: bool = False,
) -> int:
    """``epikv generate --engine vllm PROMPT``: the text as it comes (or the JSON object), then the summary line;
    the same results as :func:`run_generate`'s. Ctrl-C keeps what was generated (the text printed, or its JSON
    object) and exits 130."""
    from epikv_cli.cli.vllm_run import OnePrompt, print_text, vllm_results  # noqa: PLC0415 (vllm: only here)

    err = Console(stderr=True, highlight=False, soft_wrap=True)
    log = (lambda message: None) if quiet else (lambda message: err.print(f"[dim]{message}[/dim]"))
    item = OnePrompt(
        read_prompt(prompt, lambda message: None if quiet else print(f"epikv: {message}", file=sys.stderr)),
        cache,
        sampling,
    )
    result, interrupted = None, False
    try:
        with writing("stdout"):
            for _, outcome in vllm_results(
                model_settings, prompt_settings, cache, [item], 1, log, None if json_output else print_text
            ):
                result = outcome
    except KeyboardInterrupt as stop:  # what was generated stays: the text printed, or the JSON object of it
        result = next(iter(getattr(stop, "results", {}).values()), None)
        if result is None:
            return report_nothing_generated(json_output, cache.policy, cache.budget)
        interrupted = True
    if result is None:
        raise UsageError(item.error or "the vLLM engine returned no result")
    if json_output:
        with writing("stdout"):
            print(jsonl_line(result.to_dict(), sys.stdout), end="", flush=True)
    else:
        with writing("stdout"):
            print(flush=True)
        if not quiet:
            err.print(f"[dim]{summary_line(result)}[/dim]")
    if interrupted:
        print(interruption_line(result.generated_tokens, not json_output), file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0
