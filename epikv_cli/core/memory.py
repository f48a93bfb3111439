"""Peak memory per phase: the CUDA allocator's peak on GPUs, the process's peak RSS elsewhere.

On Linux the RSS peak is resettable (writing 5 to ``/proc/self/clear_refs`` resets ``VmHWM``), so
prefill and decode are measured apart and a batch's later prompts do not inherit the model load's
peak. Where that is impossible the process-lifetime peak (``ru_maxrss``) is reported under its own
name, ``process_rss_lifetime``.

Before the reset, glibc is asked to give back the heap memory it holds for freed blocks
(``malloc_trim``): otherwise what an earlier run freed (a full cache of gigabytes, in ``profile``)
stays resident, and every later run's peak starts from it.
"""

from __future__ import annotations

import ctypes
import re
import resource
import sys
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_HWM = re.compile(r"^VmHWM:\s+(\d+)\s+kB", re.MULTILINE)


def _rss_peak_resettable() -> bool:
    try:
        _CLEAR_REFS.write_text("5")
        return _HWM.search(_STATUS.read_text()) is not None
    except OSError:
        return False


_RESETTABLE = _rss_peak_resettable()


def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (macOS, musl)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _malloc_trim()


def reset_peak(device: torch.device) -> None:
    """Start a new peak window: the CUDA allocator's peak, or (Linux) the process's RSS high-water mark."""
    if device.type == "cuda":
        for index in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(index)
    elif _RESETTABLE:
        if _MALLOC_TRIM is not None:
            _MALLOC_TRIM(0)  # freed heap back to the system: an earlier run's garbage is not this run's peak
        _CLEAR_REFS.write_text("5")


def peak_memory(device: torch.device) -> tuple[int, str]:
    """``(bytes, kind)`` since the last :func:`reset_peak`.

    ``cuda_allocated``: the allocator's peak summed over the GPUs (a model spread by ``--device-map``
    uses several); ``process_rss``: the RSS high-water mark; ``process_rss_lifetime``: the
    process-lifetime peak, where the high-water mark cannot be reset.
    """
    if device.type == "cuda":
        total = sum(torch.cuda.max_memory_allocated(index) for index in range(torch.cuda.device_count()))
        return int(total), "cuda_allocated"
    if _RESETTABLE:
        return int(_HWM.search(_STATUS.read_text()).group(1)) * 1024, "process_rss"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024), "process_rss_lifetime"
