"""Tensor parallel 2 (two worker processes, gloo on this CPU) against tensor parallel 1, under eviction."""

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


POLICIES = ("epikv2", "epikv2:keep=global")


def start(model: str, tp: int) -> subprocess.Popen:
    """Each policy's greedy tokens for :data:`PROMPTS` on ``tp`` ranks, in a process of its own (started at once:
    the tiny model's compute is nothing beside vLLM's start-up, so the two runs overlap)."""
    command = [sys.executable, str(Path(__file__).with_name("tp_run.py")), model, ",".join(POLICIES), str(BUDGET)]
    command += [str(tp), str(NEW), json.dumps(PROMPTS)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def tokens_of(process: subprocess.Popen) -> dict[str, list[list[int]]]:
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_two_ranks_give_the_tokens_of_one(tiny_llama):
    """Per-head keep-sets (each rank's own KV heads, no communication) and a shared keep-set (its attention scores
    averaged over the ranks): the same greedy tokens as on one rank, while the rings evict (K = 40, 60-75 tokens)."""
    two_ranks, one_rank = start(tiny_llama, 2), start(tiny_llama, 1)
    one, two = tokens_of(one_rank), tokens_of(two_ranks)
    assert [[len(tokens) for tokens in one[policy]] for policy in POLICIES] == [[NEW] * len(PROMPTS)] * len(POLICIES)
    assert two == one
