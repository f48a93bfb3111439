"""The vLLM engine's tests: run in the vLLM venv (``make test`` runs them after the rest, with ``--confcutdir``).

They compare the vLLM engine with stock vLLM (the same venv) and with the transformers engine, which needs a newer
transformers and so runs in the project's main venv: ``EPIKV_TRANSFORMERS_PYTHON`` names its python, and
:func:`harness.transformers_reference` runs ``reference.py`` there.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: seconds to start

import json

import pytest
import torch
from harness import GSM8K, Engines

from epikv_cli.models.demo import demo_model_dir

# The engines these tests build run in this process (no engine-core process) on torch's threads, one per core unless
# told. One thread: the other core runs the transformers engine's reference alongside (harness.TransformersReference).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def demo() -> str:
    """The demo model's directory (``make test`` fetches it first)."""
    path = demo_model_dir()
    assert (path / "config.json").is_file(), f"run `python -m epikv_cli.models.demo` first ({path})"
    return str(path)


@pytest.fixture(scope="session")
def gsm8k_chats(demo) -> list[list[int]]:
    """The first 8 GSM8K questions as the demo model's chat prompts (token ids), 56 to 140 tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo)
    with GSM8K.open() as lines:
        questions = [json.loads(next(lines))["question"] for _ in range(8)]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for question in questions
    ]


@pytest.fixture(scope="session")
def engines(demo):
    pool = Engines(demo)
    yield pool
    pool.close()
