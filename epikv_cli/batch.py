"""Prompt files in, JSONL out: ``epikv generate --prompts FILE [--output OUT.jsonl] [--resume]``.

FILE is plain text (one prompt per line) or JSONL (``{"id": ..., "prompt": ...}`` or
``{"id": ..., "messages": [...]}``, optionally with ``max_new_tokens``, ``temperature``, ``budget``).
Each finished prompt is one line of the output, appended and flushed at once, so an interrupted run
leaves valid JSONL holding every finished prompt, and ``--resume`` skips the ids already there.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from .engine import Generation
from .errors import EXIT_FAILED, EXIT_INTERRUPTED, UsageError
from .models import load
from .prompts import build_input_ids
from .scaleout import Ranks
from .settings import CacheSettings, ModelSettings, PromptSettings, SamplingSettings
from .ui import batch_progress

OVERRIDES = {"max_new_tokens": int, "temperature": (int, float), "budget": int}


@dataclass
class PromptItem:
    """One line of the prompt file; ``error`` is set when the line cannot be run."""

    line: int
    id: Any
    prompt: str | None = None
    messages: list | None = None
    overrides: dict = field(default_factory=dict)
    error: str | None = None


def _parse_json_line(number: int, line: str) -> PromptItem:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as error:
        return PromptItem(number, number, error=f"not valid JSON ({error.msg} at column {error.colno})")
    if not isinstance(data, dict):
        return PromptItem(number, number, error="a JSONL line must be an object with 'prompt' or 'messages'")
    item = PromptItem(number, data.get("id", number))
    prompt, messages = data.get("prompt"), data.get("messages")
    if isinstance(prompt, str) and messages is None:
        item.prompt = prompt
    elif prompt is None and isinstance(messages, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        item.messages = messages
    else:
        item.error = "needs either a 'prompt' string or a 'messages' list of {'role', 'content'} objects"
        return item
    for key, kind in OVERRIDES.items():
        if key in data:
            if isinstance(data[key], bool) or not isinstance(data[key], kind):
                item.error = f"'{key}' must be a number, got {data[key]!r}"
                return item
            item.overrides[key] = data[key]
    return item


def read_prompt_file(path: Path) -> list[PromptItem]:
    """All runnable and malformed lines of ``path`` (blank lines skipped)."""
    if not path.is_file():
        raise UsageError(f"prompt file not found: {path}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not UTF-8 text; save it as UTF-8") from None
    numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    if not numbered:
        raise UsageError(f"{path} holds no prompts")
    jsonl = path.suffix == ".jsonl" or all(line.lstrip().startswith("{") for _, line in numbered)
    if jsonl:
        return [_parse_json_line(n, line) for n, line in numbered]
    return [PromptItem(n, n, prompt=line) for n, line in numbered]


def finished_ids(path: Path) -> set:
    """Ids already in an output file (for ``--resume``)."""
    ids = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            ids.add(_key(json.loads(line)["id"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    return ids


def _key(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def repair_tail(path: Path) -> None:
    """Cut a last line left half-written by a crash, so the file is valid JSONL again."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])


def sort_by_line(path: Path) -> None:
    """Rewrite ``path`` in input-line order (atomically)."""
    records = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    records.sort(key=lambda line: json.loads(line).get("line", 0))
    temporary = path.with_name(path.name + ".sorting")
    temporary.write_text("".join(line + "\n" for line in records), encoding="utf-8")
    os.replace(temporary, path)


class JsonlWriter:
    """Appends one JSON object per line and flushes it; a file lock keeps ranks' lines whole."""

    def __init__(self, path: Path | None) -> None:
        self.file = open(path, "a", encoding="utf-8") if path is not None else sys.stdout
        self.locked = path is not None

    def write(self, record: dict) -> None:
        line = json.dumps(record, ensure_ascii=False) + "\n"
        if self.locked:
            fcntl.flock(self.file.fileno(), fcntl.LOCK_EX)
        try:
            self.file.write(line)
            self.file.flush()
        finally:
            if self.locked:
                fcntl.flock(self.file.fileno(), fcntl.LOCK_UN)

    def close(self) -> None:
        if self.locked:
            self.file.close()


def _settings_for(item: PromptItem, cache: CacheSettings, sampling: SamplingSettings):
    cache_changes = {"budget": item.overrides["budget"]} if "budget" in item.overrides else {}
    sampling_changes = {k: item.overrides[k] for k in ("max_new_tokens", "temperature") if k in item.overrides}
    return dataclasses.replace(cache, **cache_changes), dataclasses.replace(sampling, **sampling_changes)


def _generate(loaded, item: PromptItem, prompt_settings: PromptSettings, cache: CacheSettings, sampling: SamplingSettings):
    """Run one prompt to the end; bad settings or a prompt over the budget raise UsageError."""
    item_cache, item_sampling = _settings_for(item, cache, sampling)
    ids = build_input_ids(loaded.tokenizer, item.prompt, prompt_settings, messages=item.messages)
    generation = Generation(loaded.model, loaded.tokenizer, ids, item_cache, item_sampling)
    for _ in generation:
        pass
    return generation.result


def _record(item: PromptItem, text=None, stats=None, error=None, rank: Ranks | None = None) -> dict:
    record = {"id": item.id, "line": item.line}
    record.update({"messages": item.messages} if item.messages is not None else {"prompt": item.prompt})
    record.update({"text": text, "stats": stats, "error": error})
    if rank is not None and rank.world > 1:
        record["rank"] = rank.rank
    return record


def run_batch(
    model_settings: ModelSettings,
    prompt_settings: PromptSettings,
    cache: CacheSettings,
    sampling: SamplingSettings,
    prompts_path: Path,
    output_path: Path | None,
    resume: bool = False,
    quiet: bool = False,
) -> int:
    """Run every prompt of ``prompts_path``; return 0, 1 (some prompt failed) or 130 (interrupted)."""
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    ranks = Ranks.from_env()
    if ranks.world > 1 and output_path is None:
        raise UsageError("several processes need --output FILE.jsonl to write one merged result")
    if resume and output_path is None:
        raise UsageError("--resume needs --output FILE.jsonl (the file to resume)")
    items = read_prompt_file(prompts_path)
    if ranks.is_main and output_path is not None:
        if resume and output_path.exists():
            repair_tail(output_path)
        else:
            output_path.write_text("", encoding="utf-8")
    ranks.barrier()
    done = finished_ids(output_path) if resume and output_path is not None else set()
    todo = [item for item in items if _key(item.id) not in done]
    mine = ranks.shard(todo)
    if resume and ranks.is_main and not quiet:
        err.print(f"[dim]resuming: {len(items) - len(todo)} of {len(items)} prompts already in {output_path}[/dim]")

    def report(item: PromptItem, message: str) -> None:
        print(f"epikv: {prompts_path}:{item.line}: {message}", file=sys.stderr, flush=True)

    failures = 0
    interrupted = False
    writer = JsonlWriter(output_path)
    try:
        loaded = None
        if any(item.error is None for item in mine):
            placed = dataclasses.replace(model_settings, device_map=ranks.device_map(model_settings.device_map))
            loaded = load(placed, None if quiet else (lambda m: err.print(f"[dim]{m}[/dim]")))
        with batch_progress(err, disable=quiet or not ranks.is_main) as progress:
            task = progress.add_task("prompts", total=len(mine), status="")
            for item in mine:
                result = None
                if item.error is None:
                    try:
                        result = _generate(loaded, item, prompt_settings, cache, sampling)
                    except UsageError as error:
                        item.error = str(error)
                if result is None:
                    failures += 1
                    report(item, item.error)
                    writer.write(_record(item, error=item.error, rank=ranks))
                    progress.update(task, advance=1)
                    continue
                stats = result.to_dict()
                stats.pop("text")
                writer.write(_record(item, text=result.text, stats=stats, rank=ranks))
                speed = f"{result.decode_tokens_per_s:.1f} tok/s" if result.decode_tokens_per_s else ""
                progress.update(task, advance=1, status=speed)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        writer.close()
    if interrupted:
        ranks.close()
        where = f" in {output_path}" if output_path else ""
        print(f"epikv: interrupted; every finished prompt is{where}; rerun with --resume to continue", file=sys.stderr)
        return EXIT_INTERRUPTED
    ranks.barrier()
    failures = ranks.total(failures)
    if ranks.is_main and output_path is not None:
        sort_by_line(output_path)
    ranks.barrier()
    ranks.close()
    return EXIT_FAILED if failures else 0
