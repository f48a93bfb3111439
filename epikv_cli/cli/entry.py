"""The ``epikv`` executable: imports the CLI (torch, transformers: seconds) with Ctrl-C held back.

A KeyboardInterrupt raised inside torch's import can land in C++ initialisation code and abort the
process (``terminate called after throwing ...``). So while the CLI is imported, SIGINT only sets a
flag; once the import is done, a pending Ctrl-C exits with status 130 and one line, and from then on
Ctrl-C is an ordinary KeyboardInterrupt that each command handles.
"""

from __future__ import annotations

import signal
import sys

from epikv_cli.errors import EXIT_INTERRUPTED

#: What Ctrl-C during start-up prints (before arguments are read, so also with ``--json``).
STARTUP_INTERRUPTED = "epikv: interrupted while starting; nothing was generated"


def main() -> None:
    """Console-script entry point: ``epikv``, ``python -m epikv_cli``."""
    pending: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
    try:
        from epikv_cli.cli.app import main as cli_main  # noqa: PLC0415 (torch and transformers: imported while Ctrl-C is held back (see above))
    finally:
        signal.signal(signal.SIGINT, previous)
    if pending:
        print(STARTUP_INTERRUPTED, file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    cli_main()
