"""Peak memory per phase: a batch's later prompt does not inherit an earlier peak."""

from __future__ import annotations

import mmap
import re
from pathlib import Path

import torch

from epikv_cli.config import CacheSettings, SamplingSettings
from epikv_cli.core.memory import peak_memory, reset_peak
from epikv_cli.runtime.generation import Generation

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
    run = Generation(
        MODEL,
        tokenizer,
        ids,
        CacheSettings(budget=32, policy="epikv"),
        SamplingSettings(max_new_tokens=30, ignore_eos=True),
    )
    list(run)
    result = run.result
    assert result.peak_memory_kind == "process_rss"
    assert result.peak_memory_bytes < lifetime - 300 * 2**20
    assert result.peak_memory_bytes == max(result.prefill_peak_memory_bytes, result.decode_peak_memory_bytes)


def test_on_cuda_the_peak_is_the_allocators_reset_and_summed_over_gpus(monkeypatch):
    """The CUDA branch, with the allocator stood in for (no GPU here): reset every device's peak, then sum them."""
    from epikv_cli.core import memory

    peaks = {0: 5 * 2**30, 1: 3 * 2**30}
    resets = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda index: resets.append(index))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda index: peaks[index])
    memory.reset_peak(torch.device("cuda", 0))
    assert resets == [0, 1]
    assert memory.peak_memory(torch.device("cuda", 0)) == (8 * 2**30, "cuda_allocated")


def test_memory_freed_by_an_earlier_run_is_not_part_of_the_next_peak():
    """Blocks freed to the C allocator stay resident until it is told to give them back; a profile's later
    policy would otherwise report an earlier one's garbage (a full cache) as its own peak."""
    cpu = torch.device("cpu")
    blocks, pins = [], []
    for _ in range(2000):  # 200 MB of 100 KB tensors (from the heap, not mmap), each followed by a small
        blocks.append(torch.ones(25_000))  # live one, so that the heap cannot shrink from its top
        pins.append(torch.ones(16))
    reset_peak(cpu)
    held = peak_memory(cpu)[0]
    del blocks
    reset_peak(cpu)
    assert peak_memory(cpu)[0] < held - 150 * 2**20


def test_a_generation_starts_after_the_last_ones_cache_is_gone(tokenizer, monkeypatch):
    """A session's cache sits in a reference cycle; the next prompt of a batch must not start with it alive."""
    import weakref

    from epikv_cli.runtime import generation as engine

    caches, alive_at_start = [], []
    enter, reset = engine.EpiKVSession.__enter__, engine.reset_peak

    def recording_enter(self):
        caches.append(weakref.ref(self.cache))
        return enter(self)

    def checking_reset(device):
        alive_at_start.append(sum(ref() is not None for ref in caches))
        reset(device)

    monkeypatch.setattr(engine.EpiKVSession, "__enter__", recording_enter)
    monkeypatch.setattr(engine, "reset_peak", checking_reset)
    for seed in range(3):
        ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(seed))
        list(
            Generation(
                MODEL,
                tokenizer,
                ids,
                CacheSettings(budget=None, policy="full"),
                SamplingSettings(max_new_tokens=5, ignore_eos=True),
            )
        )
    # each generation resets at its start (no earlier cache alive) and after its prefill (its own)
    assert alive_at_start == [0, 1] * 3
