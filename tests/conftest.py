"""Shared fixtures: a byte-level tokenizer and tiny random models built from configs (no Hub access)."""

from __future__ import annotations

import gc
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: no test may need the Hub

# Under pytest-xdist the workers share the cores: each worker's torch (and the CLI subprocesses its tests start)
# gets its share of them, one thread per worker on two cores, instead of every worker running a thread per core
# and waiting on the others' threads. Threads change only the order of float reductions, and no test compares
# against numbers recorded with another thread count (the golden test runs on one thread whatever is set here).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT") and not os.environ.get("OMP_NUM_THREADS"):
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ["OMP_NUM_THREADS"] = str(max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from epikv_cli.models.loading import byte_tokenizer

if os.environ.get("PYTEST_XDIST_WORKER_COUNT") and os.environ["OMP_NUM_THREADS"].isdigit():
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # in case torch was imported before this file

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIALS = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]


def make_tokenizer():
    """Byte-level tokenizer: one token per byte plus a few specials, with a chat template."""
    return byte_tokenizer(CHAT_TEMPLATE, tuple(SPECIALS))


VOCAB = 272  # 256 bytes + 5 specials, rounded up

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    max_position_embeddings=1024,
    bos_token_id=256,
    eos_token_id=257,
    pad_token_id=257,
)

ARCHITECTURES = {
    "llama": lambda: LlamaConfig(**COMMON, num_key_value_heads=2),
    "qwen2": lambda: Qwen2Config(**COMMON, num_key_value_heads=2),
    "qwen3": lambda: Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=8),
    "mistral": lambda: MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=None),
    "phi3": lambda: Phi3Config(**COMMON, num_key_value_heads=2),
    "gpt_neox": lambda: GPTNeoXConfig(**COMMON),
    # Gemma 3: layers 0-4 sliding (window 8), layer 5 global.
    "gemma3": lambda: Gemma3TextConfig(
        **{**COMMON, "num_hidden_layers": 6}, num_key_value_heads=2, head_dim=8, sliding_window=8
    ),
}


def tiny_model(arch: str = "llama", seed: int = 0, **overrides):
    """A random float32 model of the given architecture, in eval mode."""
    config = ARCHITECTURES[arch]()
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def pytest_collection_modifyitems(items):
    """The long tests first, then the demo model's, then the rest (each group in its order): xdist's workers then
    end together, instead of one running a long test alone at the end."""
    items.sort(key=lambda item: (item.get_closest_marker("long") is None, item.get_closest_marker("slow") is None))


def pytest_collection_finish(session):
    """What is imported and collected by now (torch, transformers, the test modules: some 400k objects) lives to
    the end of the session: freeze it out of the garbage collector's sight. Each full collection (a Generation runs
    one before it starts, and Python runs its own as objects pile up) then scans only what the tests made since,
    instead of 0.2 s over everything; all of that is collected as before."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    """A tiny Llama saved with its tokenizer, loadable by ``epikv generate --model DIR``."""
    path = tmp_path_factory.mktemp("tiny-llama")
    model = tiny_model("llama")
    model.generation_config.eos_token_id = 257
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def plain_model_dir(tmp_path_factory, tokenizer):
    """The tiny Llama with a tokenizer that has no chat template (like the Gemma-3-270M GGUF)."""
    path = tmp_path_factory.mktemp("tiny-llama-plain")
    model = tiny_model("llama")
    model.generation_config.eos_token_id = 257
    model.save_pretrained(path)
    plain = make_tokenizer()
    plain.chat_template = None
    plain.save_pretrained(path)
    return path
