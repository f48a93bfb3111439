"""Peak memory per phase: a batch's later prompt does not inherit an earlier peak."""

from __future__ import annotations

import mmap
import re
from pathlib import Path

import torch

from epikv_cli.engine import Generation
from epikv_cli.memory import peak_memory, reset_peak
from epikv_cli.settings import CacheSettings, SamplingSettings

from conftest import tiny_model

MODEL = tiny_model("llama", seed=8)


def high_water_mark() -> int:
    return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def test_the_peak_resets_and_follows_real_allocations():
    cpu = torch.device("cpu")
    reset_peak(cpu)
    before, kind = peak_memory(cpu)
    assert kind == "process_rss"
    # 300 MiB of fresh pages, touched: an anonymous map, not the allocator, which may hand back memory
    # that earlier tests freed but the process still holds (then nothing new becomes resident)
    ballast = mmap.mmap(-1, 300 * 2**20)
    torch.frombuffer(ballast, dtype=torch.uint8).fill_(1)
    during = peak_memory(cpu)[0]
    ballast.close()
    assert during - before >= 290 * 2**20
    reset_peak(cpu)
    assert peak_memory(cpu)[0] < during - 250 * 2**20  # the process-lifetime peak would not go down


def test_generation_reports_its_own_phases_not_the_process_peak(tokenizer):
    ballast = torch.ones(400 * 2**20 // 4)  # an earlier, larger peak (like loading a model)
    lifetime = high_water_mark()
    del ballast
    ids = torch.randint(0, 256, (1, 20))
    run = Generation(MODEL, tokenizer, ids, CacheSettings(budget=32), SamplingSettings(max_new_tokens=30, ignore_eos=True))
    list(run)
    result = run.result
    assert result.peak_memory_kind == "process_rss"
    assert result.peak_memory_bytes < lifetime - 300 * 2**20
    assert result.peak_memory_bytes == max(result.prefill_peak_memory_bytes, result.decode_peak_memory_bytes)
