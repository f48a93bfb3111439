"""JSONL results files: one record per line, written whole and flushed, read back for --resume.

A line that cannot be written completely (no space left on the device) is cut off again, so the file only ever
holds whole lines and ``--resume`` continues from them; the failure is raised as
:class:`~epikv_cli.errors.WriteError`, naming the file (or stdout).
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

from epikv_cli.errors import UsageError, WriteError, writing

#: What a results file keeps when a line cannot be written, and how to go on.
KEPT = "every finished line is kept; rerun with --resume when there is room"


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


def jsonl_line(record: dict, stream=None) -> str:
    """``record`` as one JSONL line (UTF-8 text kept readable, line-breaking characters escaped); for ``stream``
    (stdout), all non-ASCII escaped where its encoding cannot write the text as is."""
    line = json.dumps(record, ensure_ascii=False)
    if stream is not None and encodable(line, stream) != line:
        line = json.dumps(record)
    return line.translate(_LINE_BREAKERS) + "\n"


def encodable(text: str, stream=None) -> str:
    """``text`` as ``stream`` (default stdout) can write it: a character its encoding lacks (a Latin-1 or ASCII locale,
    a Windows code page) becomes a backslash escape instead of a UnicodeEncodeError that would lose the output."""
    encoding = getattr(stream or sys.stdout, "encoding", None) or "utf-8"
    try:
        text.encode(encoding)
    except UnicodeEncodeError:
        return text.encode(encoding, "backslashreplace").decode(encoding)
    except LookupError:  # an encoding Python does not know: write as is
        pass
    return text


def write_records(path: Path, records: list[dict]) -> None:
    """Replace ``path`` with ``records`` (atomically: a crash, or a full disk, leaves the old file or the new one)."""
    temporary = path.with_name(path.name + ".tmp")
    try:
        with writing(path, KEPT):
            temporary.write_text("".join(jsonl_line(r) for r in records), encoding="utf-8")
            os.replace(temporary, path)
    except WriteError:
        temporary.unlink(missing_ok=True)
        raise


class JsonlWriter:
    """Appends one JSON object per line, whole, and flushes it; a file lock keeps ranks' lines whole.

    ``path`` None writes to stdout. A line that does not fit on the device is removed again from the file
    (stdout cannot take back what it passed on) and :class:`~epikv_cli.errors.WriteError` is raised.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.fd: int | None = None
        if path is not None:
            with writing(path, KEPT):
                self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)

    def write(self, record: dict) -> None:
        line = jsonl_line(record, sys.stdout if self.fd is None else None)
        if self.fd is None:
            with writing("stdout"):
                sys.stdout.write(line)
                sys.stdout.flush()
            return
        data = line.encode("utf-8")
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            end = os.lseek(self.fd, 0, os.SEEK_END)  # where this line starts (no other rank appends meanwhile)
            try:
                written = 0
                while written < len(data):  # a full device may take part of the line before it refuses
                    written += os.write(self.fd, data[written:])
            except OSError as error:
                with suppress(OSError):
                    os.ftruncate(self.fd, end)  # no half line stays behind
                raise WriteError(self.path, error, KEPT) from error
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def sort_by_line(path: Path, then: Callable[[dict], int] = lambda record: 0) -> None:
    """Rewrite ``path`` in input-line order, and by ``then`` within a line (atomically); a file already in order is
    left as it is."""
    records = read_results(path)

    def place(record: dict) -> tuple[int, int]:
        line = record.get("line", 0)
        return (line if isinstance(line, int) else 0, then(record))

    ordered = sorted(records, key=place)
    if ordered != records:
        write_records(path, ordered)


def valid_id(value: Any) -> bool:
    """Whether ``value`` can be a prompt's id: a string or a whole number (not a bool)."""
    return isinstance(value, (str, int)) and not isinstance(value, bool)


def id_key(value: Any) -> str:
    """An id as a comparable key (``1`` and ``"1"`` differ)."""
    return json.dumps(value, sort_keys=True)
