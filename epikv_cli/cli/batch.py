"""Prompt files in, JSONL out: ``epikv generate --prompts FILE [--output OUT.jsonl] [--resume | --overwrite]``.

The contract (also in the README):

- FILE is plain text (one prompt per line; the id is the line number) or JSONL, one object per line:
  ``{"id": ..., "prompt": ...}`` or ``{"id": ..., "messages": [...]}``, optionally with per-line
  settings (:data:`LINE_SETTINGS`). Any other key is that line's error. Blank lines are skipped.
- Ids are strings or integers and must be unique in the file (a line without one takes its line
  number); a file with a repeated id is refused before anything runs (exit 2).
- Each prompt ends as exactly one line of the output, appended and flushed as soon as it finishes:
  ``{"id", "line", "prompt" | "messages", "text", "stats", "error"}``. A line that cannot run (bad
  JSON, not UTF-8, a bad setting, a prompt over the budget, a runtime error such as out of memory)
  gets ``"error"`` and a message on stderr (``epikv: FILE:LINE: ...``); the other prompts still run
  and the exit status is 1.
- ``--resume`` keeps the finished lines of OUT (those without an error), retries the rest, and
  never skips a prompt that did not run; ``--overwrite`` starts OUT afresh. Without either, a
  non-empty OUT is refused. Ctrl-C leaves OUT valid JSONL holding every finished prompt (exit 130).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from epikv_cli.cli.generate import NO_TEMPLATE_NOTE
from epikv_cli.cli.ui import progress_bar
from epikv_cli.cli.vllm_run import vllm_results
from epikv_cli.config import (
    CacheSettings,
    ModelSettings,
    PromptSettings,
    SamplingSettings,
)
from epikv_cli.data.fingerprint import (
    Fingerprint,
    cache_run,
    check_resume,
    model_run,
    prompt_digest,
    prompt_run,
    sampling_run,
)
from epikv_cli.data.jsonl import (
    JsonlWriter,
    finished_ids,
    id_key,
    read_results,
    sort_by_line,
    valid_id,
    write_records,
)
from epikv_cli.data.prompts import (
    build_input_ids,
    decode_text,
    has_chat_template,
    no_prompts,
    prompt_file_missing,
    stdin_bytes,
    valid_messages,
)
from epikv_cli.errors import EXIT_FAILED, EXIT_INTERRUPTED, UsageError, failure_line
from epikv_cli.models.loading import load
from epikv_cli.policies.registry import check_settings
from epikv_cli.runtime.batchgen import BatchedGeneration, Request
from epikv_cli.runtime.generation import Generation
from epikv_cli.runtime.scaleout import PeerFailed, Ranks

STDIN = Path("-")

#: Per-line settings of a JSONL prompt file: key -> (settings object, accepted JSON types, type name).
LINE_SETTINGS: dict[str, tuple[str, tuple[type, ...], str]] = {
    "max_new_tokens": ("sampling", (int,), "a whole number"),
    "temperature": ("sampling", (int, float), "a number"),
    "top_p": ("sampling", (int, float), "a number"),
    "top_k": ("sampling", (int,), "a whole number"),
    "seed": ("sampling", (int,), "a whole number"),
    "stop": ("sampling", (str, list), "a string or a list of strings"),
    "ignore_eos": ("sampling", (bool,), "true or false"),
    "budget": ("cache", (int,), "a whole number"),
    "recent": ("cache", (int,), "a whole number"),
}
LINE_KEYS = ("id", "prompt", "messages", *LINE_SETTINGS)


@dataclass
class PromptItem:
    """One prompt line; ``error`` is set when the line cannot be run.

    ``cache`` and ``sampling`` are the run's settings with this line's own settings applied.
    """

    line: int
    id: Any
    prompt: str | None = None
    messages: list | None = None
    cache: CacheSettings | None = None
    sampling: SamplingSettings | None = None
    error: str | None = None


def _kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a named pipe"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


@dataclass(frozen=True)
class BatchFiles:
    """The prompt file and the results file of a batch, checked before any model loads."""

    prompts: Path
    output: Path | None
    resume: bool = False
    overwrite: bool = False

    @classmethod
    def check(
        cls,
        prompts: Path,
        output: Path | None,
        resume: bool = False,
        overwrite: bool = False,
        option: str = "--prompts",
    ) -> BatchFiles:
        """Refuse (with :class:`UsageError`) anything that would fail later or lose results; ``option`` is the
        flag that named ``prompts``, for messages."""
        if prompts != STDIN:
            try:
                mode = prompts.stat().st_mode
            except FileNotFoundError:
                raise prompt_file_missing(option, prompts) from None
            except OSError as error:
                raise UsageError(f"cannot read the prompt file {prompts}: {error.strerror}") from None
            if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
                raise UsageError(f"{option} {prompts} is {_kind(mode)}, not a file of prompts")
        if resume and overwrite:
            raise UsageError("--resume continues --output and --overwrite replaces it; give one of them")
        if output is None:
            if resume or overwrite:
                raise UsageError(f"--{'resume' if resume else 'overwrite'} needs --output FILE.jsonl")
            return cls(prompts, None)
        cls._check_output(prompts, output, resume, overwrite)
        return cls(prompts, output, resume, overwrite)

    @staticmethod
    def _check_output(prompts: Path, output: Path, resume: bool, overwrite: bool) -> None:
        try:
            info = output.stat()
        except FileNotFoundError:
            parent = output.parent
            if not parent.exists():
                raise UsageError(f"--output {output}: the directory {parent} does not exist; create it first") from None
            if not parent.is_dir():
                raise UsageError(f"--output {output}: {parent} is not a directory") from None
            if not os.access(parent, os.W_OK | os.X_OK):
                raise UsageError(f"--output {output}: cannot create files in {parent} (permission denied)") from None
            return
        if not stat.S_ISREG(info.st_mode):
            raise UsageError(
                f"--output {output} is {_kind(info.st_mode)}; results need a regular file they can be appended to "
                "and rewritten in place (leave out --output to print them on stdout)"
            )
        if prompts != STDIN and prompts.exists() and os.path.samefile(prompts, output):
            raise UsageError(f"--output {output} is the prompt file itself; write the results to another file")
        try:
            with open(output, "ab"):
                pass
        except OSError as error:
            raise UsageError(f"--output {output} cannot be written ({error.strerror.lower()})") from None
        if info.st_size and not (resume or overwrite):
            raise UsageError(
                f"--output {output} already holds results; add --resume to continue it or --overwrite to replace it"
            )


# -- reading the prompt file ------------------------------------------------------------------------
def _typed(key: str, value: Any, kinds: tuple[type, ...], name: str) -> str | None:
    """Why ``value`` is not of ``kinds`` (booleans are not numbers), or None."""
    if isinstance(value, bool) != (bool in kinds) or not isinstance(value, kinds):
        return f"'{key}' must be {name}, got {json.dumps(value)}"
    if key == "stop" and isinstance(value, list) and not all(isinstance(s, str) for s in value):
        return f"'stop' must be {name}, got {json.dumps(value)}"
    return None


def _apply_settings(item: PromptItem, data: dict, cache: CacheSettings, sampling: SamplingSettings) -> None:
    """Per-line settings on top of the run's; a bad one becomes the line's error."""
    changes: dict[str, dict] = {"cache": {}, "sampling": {}}
    for key, (target, kinds, name) in LINE_SETTINGS.items():
        if key not in data:
            continue
        problem = _typed(key, data[key], kinds, name)
        if problem:
            item.error = problem
            return
        value = data[key]
        if key == "stop":
            value = tuple([value] if isinstance(value, str) else value)
        changes[target][key] = value
    if "seed" in changes["sampling"]:  # as --seed: the sampling's seed and the policy's (-p random draws with it)
        changes["cache"]["seed"] = changes["sampling"]["seed"]
    try:
        item.cache = check_settings(dataclasses.replace(cache, **changes["cache"]))
        item.sampling = dataclasses.replace(sampling, **changes["sampling"])
    except UsageError as error:
        item.error = _in_line_keys(str(error), [*changes["cache"], *changes["sampling"]])


def _in_line_keys(message: str, keys: list[str]) -> str:
    """``message`` with the flags of the line's own settings named as the line names them
    (``--top-p`` -> ``'top_p'``): the settings checks speak in flags."""
    for key in keys:
        message = re.sub(rf"--{key.replace('_', '-')}\b(?!-)", f"'{key}'", message)
    return message


def _parse_json_line(number: int, line: str, cache: CacheSettings, sampling: SamplingSettings) -> PromptItem:
    item = PromptItem(number, number)
    try:
        data = json.loads(line)
    except json.JSONDecodeError as error:
        item.error = f"not valid JSON ({error.msg} at column {error.colno})"
        return item
    if not isinstance(data, dict):
        item.error = "a JSONL line must be an object with 'prompt' or 'messages'"
        return item
    if "id" in data:
        if not valid_id(data["id"]):
            item.error = f"'id' must be a string or a whole number, got {json.dumps(data['id'])}"
            return item
        item.id = data["id"]
    unknown = sorted(set(data) - set(LINE_KEYS))
    if unknown:
        item.error = f"unknown key {', '.join(repr(k) for k in unknown)}; a line may hold {', '.join(LINE_KEYS)}"
        return item
    prompt, messages = data.get("prompt"), data.get("messages")
    if isinstance(prompt, str) and messages is None and not prompt.strip():
        item.error = "'prompt' is empty; give the text to generate from, or drop the line"
        return item
    if isinstance(prompt, str) and messages is None:
        item.prompt = decode_text(prompt)[0]
    elif prompt is None and valid_messages(messages):
        item.messages = [{**m, "content": decode_text(m["content"])[0]} for m in messages]
    else:
        item.error = "needs either a 'prompt' string or a 'messages' list of {'role', 'content'} objects"
        return item
    _apply_settings(item, data, cache, sampling)
    return item


def _read_bytes(source: Path) -> bytes:
    if source == STDIN:
        data = stdin_bytes()
        return data.encode() if isinstance(data, str) else data
    try:
        return source.read_bytes()
    except OSError as error:
        raise UsageError(f"cannot read the prompt file {source}: {error.strerror}") from None


def read_prompt_file(
    source: Path, cache: CacheSettings | None = None, sampling: SamplingSettings | None = None
) -> list[PromptItem]:
    """Every non-blank line of ``source`` (``-`` for stdin) as a :class:`PromptItem`.

    A line that is not UTF-8, not valid JSON or carries a bad setting becomes an item with ``error``;
    a repeated id refuses the whole file (:class:`UsageError`), before anything runs.
    """
    cache, sampling = cache or CacheSettings(), sampling or SamplingSettings()
    raw = _read_bytes(source).removeprefix(b"\xef\xbb\xbf").split(b"\n")
    numbered = [(n, line.rstrip(b"\r")) for n, line in enumerate(raw, 1) if line.strip()]
    if not numbered:
        raise no_prompts(source)
    jsonl = source.suffix == ".jsonl" or all(line.lstrip().startswith(b"{") for _, line in numbered)
    items = []
    for number, data in numbered:
        try:
            line = data.decode("utf-8")
        except UnicodeDecodeError as error:
            items.append(
                PromptItem(
                    number,
                    number,
                    error=f"not UTF-8 text (byte 0x{data[error.start]:02x} at column {error.start + 1}); save the "
                    "file as UTF-8",
                )
            )
            continue
        if jsonl:
            items.append(_parse_json_line(number, line, cache, sampling))
        else:
            items.append(PromptItem(number, number, prompt=line, cache=cache, sampling=sampling))
    _refuse_duplicate_ids(source, items)
    return items


def _refuse_duplicate_ids(source: Path, items: list[PromptItem]) -> None:
    first: dict[str, int] = {}
    for item in items:
        key = id_key(item.id)
        if key in first:
            raise UsageError(
                f"{source}: lines {first[key]} and {item.line} have the same id {item.id!r}; "
                "give every prompt its own id (ids decide what --resume skips)"
            )
        first[key] = item.line


# -- running -------------------------------------------------------------------------------------------
def _generate(loaded, item: PromptItem, prompt_settings: PromptSettings):
    """Run one prompt to the end; bad settings or a prompt over the budget raise UsageError."""
    ids = build_input_ids(loaded.tokenizer, item.prompt, prompt_settings, messages=item.messages)
    generation = Generation(loaded.model, loaded.tokenizer, ids, item.cache, item.sampling)
    for _ in generation:
        pass
    return generation.result


def _outcomes(loaded, items: list[PromptItem], prompt_settings: PromptSettings, batch_size: int):
    """``(item, result)`` for every item, ``result`` None with ``item.error`` set when it failed.

    With ``batch_size`` > 1 the runnable items are decoded together (continuous batching); if a
    batched step fails (out of memory, say), the items still unfinished are run one at a time, so
    that only the prompt that fails records the error.
    """
    if batch_size == 1:  # in input order, one at a time
        yield from _one_at_a_time(loaded, items, prompt_settings)
        return
    pending = []
    for item in items:
        if item.error is not None:
            yield item, None
            continue
        try:
            ids = build_input_ids(loaded.tokenizer, item.prompt, prompt_settings, messages=item.messages)
        except Exception as error:  # noqa: BLE001 - a chat template that raises for this line: its error alone
            item.error = failure_line(error)
            yield item, None
            continue
        pending.append((item, ids))
    if pending:
        finished: set[int] = set()
        requests = [Request(index, ids, item.cache, item.sampling) for index, (item, ids) in enumerate(pending)]
        try:
            for index, outcome in BatchedGeneration(
                loaded.model, loaded.tokenizer, requests, batch_size, [item.cache for item, _ in pending]
            ):
                finished.add(index)
                item = pending[index][0]
                if isinstance(outcome, UsageError):
                    item.error = str(outcome)
                    yield item, None
                else:
                    yield item, outcome
            return
        except Exception as error:  # noqa: BLE001 - the unfinished items are retried one by one below
            _release_memory(error)
            yield from _one_at_a_time(
                loaded, [item for index, (item, _) in enumerate(pending) if index not in finished], prompt_settings
            )


def _one_at_a_time(loaded, items: list[PromptItem], prompt_settings: PromptSettings):
    for item in items:
        if item.error is not None:
            yield item, None
            continue
        try:
            yield item, _generate(loaded, item, prompt_settings)
        except Exception as error:  # one prompt's failure (out of memory included) is its line's error
            _release_memory(error)
            item.error = failure_line(error)
            yield item, None


def _release_memory(error: Exception) -> None:

    if isinstance(error, torch.OutOfMemoryError) and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _record(
    item: PromptItem, fingerprint: Fingerprint, text=None, stats=None, error=None, rank: Ranks | None = None
) -> dict:
    record = {"id": item.id, "line": item.line}
    record.update({"messages": item.messages} if item.messages is not None else {"prompt": item.prompt})
    record.update({"text": text, "stats": stats, "error": error})
    fingerprint.stamp(record)
    if rank is not None and rank.world > 1:
        record["rank"] = rank.rank
    return record


def _run(model_settings: ModelSettings, prompt_settings: PromptSettings, item: PromptItem) -> dict:
    """The settings that shape ``item``'s result (its line's own settings included): ``run`` in its record."""
    if item.cache is None or item.sampling is None:  # a line refused before its settings were read
        return model_run(model_settings)
    return {
        **model_run(model_settings),
        **prompt_run(prompt_settings),
        **cache_run(item.cache),
        **sampling_run(item.sampling),
    }


def _prepare_output(files: BatchFiles, items: list[PromptItem], previous: list[dict]) -> None:
    """Rank 0 before any prompt runs: an empty OUT, or with --resume only its finished lines."""
    if files.output is None:
        return
    if files.resume:
        # a line of the file runs again where its last result was an error, and a finished result of a line that is
        # now an error itself (edited since) leaves: that line's error line replaces it
        rerun = {id_key(item.id) for item in items}
        failing = {id_key(item.id) for item in items if item.error is not None}
        kept = [
            r
            for r in previous
            if id_key(r["id"]) not in failing and (r.get("error") is None or id_key(r["id"]) not in rerun)
        ]
        write_records(files.output, kept)
    else:
        files.output.write_text("", encoding="utf-8")


def run_batch(
    model_settings: ModelSettings,
    prompt_settings: PromptSettings,
    cache: CacheSettings,
    sampling: SamplingSettings,
    files: BatchFiles,
    quiet: bool = False,
    batch_size: int = 1,
) -> int:
    """Run every prompt of ``files.prompts``; return 0, 1 (some prompt failed) or 130 (interrupted).

    ``batch_size`` > 1 decodes that many prompts together (continuous batching; same greedy results).
    """
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    ranks = Ranks.from_env()
    if ranks.world > 1 and files.output is None:
        raise UsageError("several processes need --output FILE.jsonl to write one merged result")
    if ranks.world > 1 and files.prompts == STDIN:
        raise UsageError("several processes cannot share stdin; give --prompts a file")
    if ranks.world > 1 and model_settings.engine == "vllm":
        raise UsageError(
            "--engine vllm runs as one process (vLLM parallelises itself: docs/vllm.md); drop the launcher"
        )
    log = None if quiet else (lambda m: err.print(f"[dim]{m}[/dim]"))
    items = read_prompt_file(files.prompts, cache, sampling)
    previous = read_results(files.output) if files.resume and files.output is not None else []
    fingerprints = {
        id_key(item.id): Fingerprint(
            prompt_digest(item.prompt, item.messages),
            _run(model_settings, prompt_settings, item),
            f"{files.prompts} line {item.line}",
        )
        for item in items
    }
    check_resume(files.output, previous, {id_key(i.id): fingerprints[id_key(i.id)] for i in items if i.error is None})
    if ranks.is_main:
        _prepare_output(files, items, previous)
    done = finished_ids(previous)
    todo = [item for item in items if item.error is not None or id_key(item.id) not in done]
    mine = ranks.shard(todo)
    if files.resume and ranks.is_main and not quiet:
        err.print(f"[dim]resuming: {len(items) - len(todo)} of {len(items)} prompts already in {files.output}[/dim]")

    def report(item: PromptItem, message: str) -> None:
        print(f"epikv: {files.prompts}:{item.line}: {message}", file=sys.stderr, flush=True)

    failures = 0
    interrupted = False
    writer = None
    try:
        ranks.barrier()  # OUT is ready before anyone appends to it
        writer = JsonlWriter(files.output)
        loaded = None
        if model_settings.engine == "vllm":
            outcomes = vllm_results(model_settings, prompt_settings, cache, mine, batch_size, log)
        elif any(item.error is None for item in mine):
            placed = dataclasses.replace(model_settings, device_map=ranks.device_map(model_settings.device_map))
            loaded = load(placed, log)
            if (
                prompt_settings.chat_template
                and not has_chat_template(loaded.tokenizer)
                and ranks.is_main
                and not quiet
            ):
                print(f"epikv: {NO_TEMPLATE_NOTE}", file=sys.stderr, flush=True)
        with progress_bar(err, disable=quiet or not ranks.is_main) as progress:
            task = progress.add_task("prompts", total=len(mine), status="")
            if model_settings.engine != "vllm":
                outcomes = _outcomes(loaded, mine, prompt_settings, batch_size)
            for item, result in outcomes:
                if result is None:
                    failures += 1
                    report(item, item.error)
                    writer.write(_record(item, fingerprints[id_key(item.id)], error=item.error, rank=ranks))
                    progress.update(task, advance=1)
                    continue
                stats = result.to_dict()
                stats.pop("text")
                writer.write(_record(item, fingerprints[id_key(item.id)], text=result.text, stats=stats, rank=ranks))
                speed = f"{result.decode_tokens_per_s:.1f} tok/s" if result.decode_tokens_per_s else ""
                progress.update(task, advance=1, status=speed)
        ranks.barrier()  # everyone has written
        failures = ranks.total(failures)
    except KeyboardInterrupt:
        interrupted = True
    except PeerFailed:
        ranks.close()
        print(
            f"epikv: rank {ranks.rank}: another process of this launch stopped early; "
            "every finished prompt is in the output; rerun with --resume to continue",
            file=sys.stderr,
        )
        return EXIT_FAILED
    finally:
        if writer is not None:
            writer.close()
    if interrupted:
        ranks.close()
        where = f" in {files.output}" if files.output else ""
        print(f"epikv: interrupted; every finished prompt is{where}; rerun with --resume to continue", file=sys.stderr)
        return EXIT_INTERRUPTED
    if ranks.is_main and files.output is not None:
        sort_by_line(files.output)
    ranks.close()
    return EXIT_FAILED if failures else 0
