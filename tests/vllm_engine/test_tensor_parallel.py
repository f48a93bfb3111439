"""Tensor parallel 2 (two worker processes, gloo on this CPU) against tensor parallel 1, and a compiled engine against
an eager one, under eviction (a tiny random Llama)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

#: 4 query heads and 2 KV heads: each of two ranks holds 2 and 1.
CONFIG = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.2,  # peaked logits: greedy choices that float sums in another order do not flip
    tie_word_embeddings=False,
)
BUDGET, NEW = 40, 48
PROMPTS = [[(7 * i + 3 * row) % 500 + 5 for i in range(length)] for row, length in enumerate((12, 20, 27))]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(folder)
    return str(folder)


#: Per-head keep-sets, a shared keep-set that reads attention, and EpiKV (hidden states, through the block taps).
POLICIES = ("epikv2", "epikv2:keep=global", "epikv")
#: Tensor parallel 2 runs the two that read attention (what each rank holds differs); compiled, the two that keep
#: something of the forward (epikv2: recent queries; epikv: decoder block outputs).
TWO_RANKS = POLICIES[:2]
COMPILED = ("epikv2", "epikv")


#: Request pages of the one-rank run: vLLM's null block and 2 requests' rings, so that the third prompt waits.
PAGES = 3


def start(model: str, tp: int, policies: tuple[str, ...], mode: str | None = None) -> subprocess.Popen:
    """Each policy's greedy tokens for :data:`PROMPTS` on ``tp`` ranks, in a process of its own (started together:
    the tiny model's compute is nothing beside vLLM's start-up, so the runs overlap). ``mode``: ``compile``, or
    ``pages=N`` (KV memory for N request pages)."""
    command = [sys.executable, str(Path(__file__).with_name("tp_run.py")), model, ",".join(policies), str(BUDGET)]
    command += [str(tp), str(NEW), json.dumps(PROMPTS)] + ([mode] if mode else [])
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result_of(process: subprocess.Popen) -> dict[str, dict]:
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(tiny_llama) -> dict[str, dict]:
    """One rank eager (with KV memory for fewer requests than prompts), two ranks eager, one rank compiled: each
    run's result per policy."""
    processes = {
        "two": start(tiny_llama, 2, TWO_RANKS),
        "compiled": start(tiny_llama, 1, COMPILED, "compile"),
        "one": start(tiny_llama, 1, POLICIES, f"pages={PAGES}"),
    }
    return {name: result_of(process) for name, process in processes.items()}


def test_two_ranks_give_the_tokens_of_one(runs):
    """Per-head keep-sets (each rank's own KV heads, no communication) and a shared keep-set (its attention scores
    averaged over the ranks): the same greedy tokens as on one rank, while the rings evict (K = 40, 60-75 tokens)."""
    one, two = runs["one"], runs["two"]
    assert [[len(tokens) for tokens in one[policy]["tokens"]] for policy in POLICIES] == [[NEW] * len(PROMPTS)] * 3
    assert all(count > 0 for policy in POLICIES for count in one[policy]["evicted"])  # every request evicts
    assert {policy: two[policy]["tokens"] for policy in TWO_RANKS} == {
        policy: one[policy]["tokens"] for policy in TWO_RANKS
    }


def test_a_request_waiting_for_memory_gives_the_tokens_of_one_run_at_once(runs):
    """KV memory for two requests' rings (the one-rank run): the third prompt waits until one finishes and is then
    admitted, not preempted or squeezed (a ring request never asks for a second page); every prompt's tokens are
    those of the two-rank and compiled runs, which had memory for all three at once."""
    one, two, compiled = runs["one"], runs["two"], runs["compiled"]
    assert {one[policy]["blocks"] for policy in POLICIES} == {PAGES}
    assert min(
        run[policy]["blocks"] for run, names in ((two, TWO_RANKS), (compiled, COMPILED)) for policy in names
    ) > len(PROMPTS)
    assert [two[policy]["tokens"] for policy in TWO_RANKS] == [one[policy]["tokens"] for policy in TWO_RANKS]
    assert [compiled[policy]["tokens"] for policy in COMPILED] == [one[policy]["tokens"] for policy in COMPILED]


def test_a_compiled_engine_gives_the_tokens_and_evictions_of_an_eager_one(runs):
    """vLLM's compiled forward (one Inductor graph on this CPU) reaches the rings through epikv's ops only: the same
    greedy tokens and the same evicted positions at every step as the eager engine, for a policy that keeps queries
    and one that reads decoder block outputs."""
    compiled, eager = runs["compiled"], runs["one"]
    assert {compiled[policy]["mode"] for policy in COMPILED} == {"DYNAMO_TRACE_ONCE"}
    assert {eager[policy]["mode"] for policy in COMPILED} == {"NONE"}
    for policy in COMPILED:
        assert compiled[policy]["tokens"] == eager[policy]["tokens"], policy
        assert compiled[policy]["trace"] == eager[policy]["trace"], policy
