"""Review of `epikv profile` and `--max-context`: the figures' arithmetic against hand computations (timings are
injected through a fake clock, never measured)."""

from __future__ import annotations

import io
import json
import os
import sys
import types
from dataclasses import asdict

import pytest

from epikv_cli.config import CacheSettings, ModelSettings
from epikv_cli.experiments import maxcontext as maxcontext_module
from epikv_cli.experiments import profile as profile_module
from epikv_cli.runtime import generation as generation_module

from conftest import make_tokenizer, tiny_model

PREFILL_SECONDS = 100.0  # what the fake clock charges one prefill forward
STEP_SECONDS = 1.0  # ... and one decode forward
RESET_SECONDS = 0.5  # ... and one reset of the peak-memory window (a heap trim: real time on a CPU)


@pytest.fixture
def fake_clock(monkeypatch):
    """A clock that moves only when the model runs a forward or the peak-memory window is reset."""
    now = [0.0]
    clock = types.SimpleNamespace(perf_counter=lambda: now[0])
    for module in (profile_module, generation_module):
        monkeypatch.setattr(module, "time", clock)

        def reset(device, real=module.reset_peak):
            now[0] += RESET_SECONDS
            real(device)

        monkeypatch.setattr(module, "reset_peak", reset)
    model = tiny_model("llama")

    def charge(module, args, kwargs):
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        now[0] += PREFILL_SECONDS if ids.shape[1] > 1 else STEP_SECONDS

    model.register_forward_pre_hook(charge, with_kwargs=True)
    return model


def test_a_batch_decode_is_timed_from_its_first_tokens_not_from_before_the_memory_reset(fake_clock):
    """9 tokens per row, 3 rows: 8 decode steps of 1 s each, so 3 x 8 / 8 = 3 tok/s, flatness 1, as one row
    decodes at 1 tok/s. The reset of the peak-memory window after the prefills (0.5 s here) belonged to the
    decode's first step: 24 / 8.5 = 2.82 tok/s and a flatness of (2 / 2) / (2 / 2.5) = 1.25."""
    tokenizer = make_tokenizer()
    ids = profile_module.prompt_ids(tokenizer, 20)
    cache = CacheSettings(budget=None, policy="full")
    single = profile_module.measure(fake_clock, tokenizer, ids, profile_module.PolicyRun("full"), cache, 9)
    assert (single.decode_tokens_per_s, single.flatness) == (1.0, 1.0)
    batch = profile_module.measure(fake_clock, tokenizer, ids, profile_module.PolicyRun("full"), cache, 9, 3)
    assert batch.decode_tokens_per_s == pytest.approx(3 * 8 / (8 * STEP_SECONDS))
    assert batch.flatness == pytest.approx(1.0)
    # the three prefills and the reset after them, as a single row's prefill counts its own reset
    assert batch.prefill_seconds == pytest.approx(3 * PREFILL_SECONDS + RESET_SECONDS)
    assert single.prefill_seconds == pytest.approx(PREFILL_SECONDS + 2 * RESET_SECONDS)


def run_worker(monkeypatch, setup: dict, lengths: list[int]) -> list[dict]:
    """The probe worker's loop in this process, on the tiny Llama (no memory cap): its replies, one per line."""
    model, tokenizer = tiny_model("llama"), make_tokenizer()
    loaded = types.SimpleNamespace(model=model, tokenizer=tokenizer, attn="sdpa")
    monkeypatch.setattr(maxcontext_module, "load", lambda settings: loaded)
    monkeypatch.setattr(maxcontext_module, "_cap_memory", lambda limit, cuda: None)
    lines = [json.dumps(setup), *(json.dumps({"length": length}) for length in lengths)]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
    read_end, write_end = os.pipe()
    maxcontext_module._worker(write_end)  # closes the writing end when stdin ends
    with os.fdopen(read_end, encoding="utf-8") as replies:
        return [json.loads(line) for line in replies.read().splitlines()]


@pytest.mark.parametrize("options", [[["prompt", "keep"]], [["recent", "2000"]]])
def test_a_probe_prefills_under_options_that_keep_more_than_twice_the_prompt(monkeypatch, options):
    """epikv2:prompt=keep keeps the prompt beside a recent window of 75 % of K, so it needs K >= 4 x (prompt + 1)
    (2051 at 512 tokens); recent=2000 needs K >= 2005 at any length. The probe's budget of 2 x prompt + 256 (1280
    at 512 tokens, 384 at 64) was refused by the policy, which ended the worker: the probe counted as out of
    memory, and the search halved down to 64 tokens (prompt=keep) or 0 (recent=2000) within any limit."""
    setup = {
        "model": asdict(ModelSettings(model="m")),
        "policy": "epikv2",
        "kernel": None,
        "limit": 1 << 50,
        "options": options,
    }
    replies = run_worker(monkeypatch, setup, [64, 512])
    assert replies[0] == {"attn": "sdpa", "max_positions": 1024}
    assert [(reply["length"], reply["ok"], reply["error"]) for reply in replies[1:]] == [
        (64, True, None),
        (512, True, None),
    ]
