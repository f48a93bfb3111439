"""``epikv calibrate``: load, measure and save the bands (:mod:`epikv_cli.experiments.calibrate`), print the
per-layer table or one JSON object. Ctrl-C prints what the prompts finished so far say (not saved) and exits 130."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict

from rich.console import Console

from epikv_cli.cli.ui import calibration_table, status_line, wide_console
from epikv_cli.errors import EXIT_INTERRUPTED, UsageError, WriteError, writing
from epikv_cli.experiments.calibrate import BandsMeasured, WindowSamples, bands_so_far, calibrate_bands, save_bands
from epikv_cli.models.loading import load


def calibrate_command(model_settings, problems, new_tokens: int, json_output: bool = False, quiet: bool = False) -> int:
    """``epikv calibrate``: measure, print the per-layer table, save the bands; return the exit status."""

    if model_settings.model is not None and model_settings.model.endswith(".json"):
        raise UsageError(
            "calibrate measures a model's trained weights; a config.json builds random ones, for which generate reads "
            "no saved bands: give the model's directory"
        )
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    loaded = load(model_settings, None if quiet else (lambda message: err.print(f"[dim]{message}[/dim]")))
    started = time.perf_counter()
    samples = WindowSamples()
    try:
        with status_line(err, quiet) as status:
            measured = calibrate_bands(loaded, problems, new_tokens, lambda text: status.update(text), samples)
    except KeyboardInterrupt:
        partial = bands_so_far(loaded, samples, new_tokens)
        if partial is not None:
            show(partial, json_output, time.perf_counter() - started)
        finished = f"after {samples.prompts} of {len(problems)} prompts"
        said = "; these bands were not saved" if partial is not None else "; no prompt finished, nothing was saved"
        print(f"epikv: interrupted {finished}{said}", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    try:
        save_bands(measured)
    except WriteError:  # what was measured is shown all the same, then the one line that says why it was not saved
        show(measured, json_output, time.perf_counter() - started)
        raise
    show(measured, json_output, time.perf_counter() - started)
    if not json_output:
        bands = ",".join(f"{layer}:{sign:+.0f}" for layer, sign in measured.calibration.bands)
        err.print(
            f"bands {bands} saved to {measured.calibration.path}; generate, eval, fidelity and profile use them for "
            "--policy epikv (--bands overrides)"
        )
    return 0


def show(measured: BandsMeasured, json_output: bool, seconds: float) -> None:
    """The per-layer table (or the JSON object) of ``measured``, and its note as a warning line; ``path`` is empty
    (JSON: null) for bands that were not saved."""
    calibration, note = measured.calibration, measured.note
    if json_output:
        data = {**asdict(calibration), "path": calibration.path or None, "note": note, "seconds": round(seconds, 1)}
        with writing("stdout"):
            print(json.dumps(data), flush=True)
    else:
        with writing("stdout"):
            wide_console().print(
                calibration_table(
                    measured.rho,
                    calibration.bands,
                    f"{calibration.model}: Spearman ρ of each layer's smoothed change with window importance "
                    f"({calibration.windows} windows)",
                    calibration.path or "nowhere (not saved)",
                )
            )
    if note:
        print(f"epikv: warning: {note}", file=sys.stderr, flush=True)
