"""JSONL results files: one record per line, written whole and flushed, read back for --resume."""

from __future__ import annotations

import fcntl
import json
import os
import sys
from pathlib import Path
from typing import Any

from epikv_cli.errors import UsageError


# -- the results file --------------------------------------------------------------------------------
def read_results(path: Path) -> list[dict]:
    """The result lines of ``path`` (a last line left half-written by a crash is ignored).

    Raises :class:`UsageError` when a complete line is not an epikv result (a JSON object with an id).
    """
    if not path.exists():
        return []
    data = path.read_bytes()
    lines = data.split(b"\n")
    complete = lines[:-1]  # after the last newline: empty, or a line cut short
    records = []
    for number, line in enumerate(complete, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            record = None
        if not isinstance(record, dict) or not valid_id(record.get("id")):
            raise UsageError(
                f"--output {path}: line {number} is not an epikv result line; check the file, or use --overwrite "
                "to replace it"
            )
        records.append(record)
    return records


def finished_ids(records: list[dict]) -> set[str]:
    """Ids (as keys) of the records that finished without an error: what ``--resume`` skips."""
    return {id_key(record["id"]) for record in records if record.get("error") is None}


#: Characters that JSON allows raw in strings but that many line readers (Python's ``splitlines``,
#: JavaScript) take for line breaks: written escaped, so one record is always one line.
_LINE_BREAKERS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def jsonl_line(record: dict) -> str:
    """``record`` as one JSONL line (UTF-8 text kept readable, line-breaking characters escaped)."""
    return json.dumps(record, ensure_ascii=False).translate(_LINE_BREAKERS) + "\n"


def write_records(path: Path, records: list[dict]) -> None:
    """Replace ``path`` with ``records`` (atomically: a crash leaves the old file or the new one)."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text("".join(jsonl_line(r) for r in records), encoding="utf-8")
    os.replace(temporary, path)


class JsonlWriter:
    """Appends one JSON object per line and flushes it; a file lock keeps ranks' lines whole."""

    def __init__(self, path: Path | None) -> None:
        self.file = open(path, "a", encoding="utf-8") if path is not None else sys.stdout
        self.locked = path is not None

    def write(self, record: dict) -> None:
        line = jsonl_line(record)
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


def sort_by_line(path: Path) -> None:
    """Rewrite ``path`` in input-line order (atomically)."""
    records = read_results(path)
    records.sort(key=lambda record: record.get("line", 0) if isinstance(record.get("line"), int) else 0)
    write_records(path, records)


def valid_id(value: Any) -> bool:
    """Whether ``value`` can be a prompt's id: a string or a whole number (not a bool)."""
    return isinstance(value, (str, int)) and not isinstance(value, bool)


def id_key(value: Any) -> str:
    """An id as a comparable key (``1`` and ``"1"`` differ)."""
    return json.dumps(value, sort_keys=True)
