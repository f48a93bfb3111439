"""The ``epikv`` executable: imports the CLI, and for a command that runs a model torch and transformers
(seconds), with Ctrl-C held back.

A KeyboardInterrupt raised inside torch's import can land in C++ initialisation code and abort the
process (``terminate called after throwing ...``, or a segmentation fault). So while the CLI and what its command
will run are imported, SIGINT only sets a flag; once the imports are done, a pending Ctrl-C exits with status 130
and one line, and from then on Ctrl-C is an ordinary KeyboardInterrupt that each command handles. ``--help``,
``--version`` and Tab completion import no torch at all (:mod:`epikv_cli.cli.app`), so they start at once.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys

from epikv_cli.errors import EXIT_INTERRUPTED

#: What Ctrl-C during start-up prints (before arguments are read, so also with ``--json``).
STARTUP_INTERRUPTED = "epikv: interrupted while starting; nothing was generated"


#: What a command that runs imports (torch and transformers with them), loaded up front with Ctrl-C held back.
COMMAND_MODULES = (
    "epikv_cli.cli.batch",
    "epikv_cli.cli.generate",
    "epikv_cli.cli.profile",
    "epikv_cli.cli.maxcontext",
    "epikv_cli.cli.fidelity",
    "epikv_cli.cli.evaluate",
    "epikv_cli.cli.calibrate",
)


def runs_a_command(argv: list[str]) -> bool:
    """Whether ``argv`` asks for more than the help, the version or a completion (which need no torch)."""
    if os.environ.get("_EPIKV_COMPLETE") or not argv:
        return False
    return not any(arg in ("--help", "-h", "--version", "--install-completion", "--show-completion") for arg in argv)


def main() -> None:
    """Console-script entry point: ``epikv``, ``python -m epikv_cli``."""
    pending: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
    try:
        from epikv_cli.cli.app import main as cli_main  # noqa: PLC0415 (the CLI: imported while Ctrl-C is held back (see above))

        if runs_a_command(sys.argv[1:]):
            for module in COMMAND_MODULES:
                importlib.import_module(module)
    finally:
        signal.signal(signal.SIGINT, previous)
    if pending:
        print(STARTUP_INTERRUPTED, file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    cli_main()
