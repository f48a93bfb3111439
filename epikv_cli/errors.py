"""Errors that reach the user as one line on stderr, and the exit statuses of the CLI."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

EXIT_FAILED = 1  # a batch finished, some prompts failed
EXIT_USAGE = 2  # bad input
EXIT_CANNOT_WRITE = 74  # sysexits.h's EX_IOERR: an output could not be written (no space left on the device)
EXIT_INTERRUPTED = 130  # Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: stdout's reader went away, as a shell reports it for other tools


class UsageError(ValueError):
    """Bad input from the user: the CLI prints the message on one line and exits with status 2.

    The message says what is wrong and what to do about it.
    """


def failure_line(error: Exception) -> str:
    """One line for one prompt's failure: a usage error as it is, anything else with its type."""
    if isinstance(error, UsageError):
        return str(error)
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:300] if lines else 'no message'}"


class EpikvWarning(UserWarning):
    """Something the user should know that does not stop the run (an unreadable bands file, a prompt beyond the
    model's context): raised with :func:`warnings.warn` by any layer, shown by the CLI as one ``epikv: warning:``
    line on stderr."""


class ModelLoadError(RuntimeError):
    """A model could not be found or loaded; the CLI prints the message and exits with status 2."""


#: errno values that mean the device holding a file has no room left for it.
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def no_space_reason(error: OSError) -> str:
    """Why a write failed, in words: "no space left on the device", or the system's own message."""
    if error.errno in NO_SPACE:
        return "no space left on the device"
    return (error.strerror or str(error)).lower()


class WriteError(Exception):
    """An output could not be written (no space left on its device, say): the CLI prints one line and exits
    with status 74.

    Args:
        where: the file, or ``"stdout"``.
        error: what the system said.
        kept: what is still there, in words, for the user (e.g. the finished lines and how to continue).
    """

    def __init__(self, where: str | Path, error: OSError, kept: str = "") -> None:
        self.where = str(where)
        self.errno = error.errno
        message = f"cannot write {self.where}: {no_space_reason(error)}"
        super().__init__(f"{message}; {kept}" if kept else message)


@contextmanager
def writing(where: str | Path, kept: str = "") -> Iterator[None]:
    """Turn a failed write inside the block into :class:`WriteError` naming ``where``.

    A reader that closed the pipe (``BrokenPipeError``) is left as it is: the CLI ends that run quietly.
    """
    try:
        yield
    except BrokenPipeError:
        raise
    except OSError as error:
        raise WriteError(where, error, kept) from error
