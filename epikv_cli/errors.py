"""Errors that reach the user as one line on stderr, and the exit statuses of the CLI."""

from __future__ import annotations

EXIT_FAILED = 1  # a batch finished, some prompts failed
EXIT_USAGE = 2  # bad input
EXIT_INTERRUPTED = 130  # Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: stdout's reader went away, as a shell reports it for other tools


class UsageError(ValueError):
    """Bad input from the user: the CLI prints the message on one line and exits with status 2.

    The message says what is wrong and what to do about it.
    """


class ModelLoadError(RuntimeError):
    """A model could not be found or loaded; the CLI prints the message and exits with status 2."""
