"""``epikv calibrate``: load, measure and save the bands (:mod:`epikv_cli.experiments.calibrate`), print the
per-layer table or one JSON object."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict

from rich.console import Console

from epikv_cli.cli.ui import calibration_table, status_line, wide_console
from epikv_cli.errors import writing
from epikv_cli.experiments.calibrate import calibrate_bands
from epikv_cli.models.loading import load


def calibrate_command(model_settings, problems, new_tokens: int, json_output: bool = False, quiet: bool = False) -> int:
    """``epikv calibrate``: measure, print the per-layer table, save the bands."""

    err = Console(stderr=True, highlight=False, soft_wrap=True)
    loaded = load(model_settings, None if quiet else (lambda message: err.print(f"[dim]{message}[/dim]")))
    started = time.perf_counter()
    with status_line(err, quiet) as status:
        measured = calibrate_bands(loaded, problems, new_tokens, lambda text: status.update(text))
    calibration, note = measured.calibration, measured.note
    if json_output:
        with writing("stdout"):
            print(
                json.dumps({**asdict(calibration), "note": note, "seconds": round(time.perf_counter() - started, 1)}),
                flush=True,
            )
        if note:
            print(f"epikv: warning: {note}", file=sys.stderr, flush=True)
    else:
        with writing("stdout"):
            wide_console().print(
                calibration_table(
                    measured.rho,
                    calibration.bands,
                    f"{calibration.model}: Spearman ρ of each layer's smoothed change with window importance "
                    f"({calibration.windows} windows)",
                    calibration.path,
                )
            )
        if note:
            print(f"epikv: warning: {note}", file=sys.stderr, flush=True)
        err.print(
            f"bands {','.join(f'{layer}:{sign:+.0f}' for layer, sign in calibration.bands)} saved to "
            f"{calibration.path}; generate, eval, fidelity and profile use them for --policy epikv (--bands overrides)"
        )
    return 0
