"""Where a model's calibrated EpiKV bands are kept: ``<cache dir>/bands/<name>-<hash>.json`` (see
:func:`bands_path`).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from contextlib import suppress
from dataclasses import asdict
from pathlib import Path

from epikv_cli.config import Calibration
from epikv_cli.errors import EpikvWarning, WriteError, writing
from epikv_cli.models.demo import cache_dir


def bands_path(model_key: str) -> Path:
    """Where a model's calibrated bands live: ``<cache dir>/bands/<name>-<hash>.json``."""
    readable = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(model_key).name or model_key)[:60]
    digest = hashlib.sha256(model_key.encode()).hexdigest()[:12]
    return cache_dir() / "bands" / f"{readable}-{digest}.json"


def load_calibration(model_key: str) -> Calibration | None:
    """The saved calibration of ``model_key`` (a resolved model path or Hub id), if any; a file that cannot be read
    is said (an :class:`~epikv_cli.errors.EpikvWarning` naming it) and left out."""
    path = bands_path(model_key)
    if not path.exists():
        return None
    try:
        return Calibration.from_record({**json.loads(path.read_text()), "path": str(path)})
    except (OSError, ValueError, KeyError, TypeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else "not a saved calibration"
        warnings.warn(
            f"cannot read the calibrated bands {path} ({reason}); epikv uses its default bands. Run `epikv calibrate` "
            "again, or delete the file",
            EpikvWarning,
            stacklevel=2,
        )
        return None


def save_calibration(calibration: Calibration, model_key: str) -> Path:
    """Write ``calibration`` where :func:`bands_path` keeps it, atomically: a full disk leaves the bands saved
    before (if any) and raises :class:`~epikv_cli.errors.WriteError` naming the file."""
    path = bands_path(model_key)
    data = asdict(calibration)
    data.pop("path")
    temporary = path.with_name(path.name + ".tmp")
    try:
        with writing(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary.write_text(json.dumps(data, indent=1))
            os.replace(temporary, path)
    except WriteError:
        with suppress(OSError):  # nothing to remove where the folder could not be made
            temporary.unlink()
        raise
    return path


def model_key(source) -> str:
    """A stable name for a model: the resolved directory or file, or the Hub id."""
    if source.kind in ("dir", "gguf", "config"):
        return str(Path(source.location).resolve())
    return source.location
