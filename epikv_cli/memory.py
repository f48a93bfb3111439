"""Peak memory: the CUDA allocator's peak on GPUs, the process's peak RSS elsewhere."""

from __future__ import annotations

import resource
import sys

import torch


def reset_peak(device: torch.device) -> None:
    """Start a new peak window (CUDA only: the RSS peak of a process cannot be reset)."""
    if device.type == "cuda":
        for index in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(index)


def peak_memory(device: torch.device) -> tuple[int, str]:
    """``(bytes, kind)``: ``cuda_allocated`` peak since :func:`reset_peak`, summed over the GPUs (a model
    spread by ``--device-map`` uses several), or the process's ``process_rss`` peak."""
    if device.type == "cuda":
        total = sum(torch.cuda.max_memory_allocated(index) for index in range(torch.cuda.device_count()))
        return int(total), "cuda_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024), "process_rss"
