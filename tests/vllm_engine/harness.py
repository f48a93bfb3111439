"""Helpers of the vLLM engine's tests: stock vLLM and epikv's engines on the demo model, greedy sampling, and the
transformers engine's record of the same prompts (run in the project's main venv)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import tempfile
from pathlib import Path

from epikv_cli.config import CacheSettings
from epikv_cli.vllm.engine import VllmSettings, build_engine

ROOT = Path(__file__).resolve().parents[2]
#: The project's evaluation data, in ``shared/data`` beside the clone or above it (never copied into it).
GSM8K = next(
    (
        folder / "shared" / "data" / "gsm8k_test.jsonl"
        for folder in ROOT.parents
        if (folder / "shared" / "data").is_dir()
    ),
    ROOT.parent / "shared" / "data" / "gsm8k_test.jsonl",
)
#: KV memory each test engine takes (vLLM would take most of the machine's memory, and zero it, by default).
KV_BYTES = 512 << 20


class TransformersReference:
    """The transformers engine's greedy runs of several jobs, in the main venv (``reference.py``), started at once in
    the background on one core (vLLM's engine keeps to another) and read as each is needed.

    Args:
        model: the model's directory.
        jobs: per job its ``policy``, ``budget`` (K), ``new`` tokens and ``prompts`` (token ids), run in this order.

    ``result(i)`` waits for job ``i``: per prompt its ``tokens``, each step's ``evicted`` positions and top-2 logit
    ``gaps``.
    """

    def __init__(self, model: str, jobs: list[dict]) -> None:
        python = os.environ.get("EPIKV_TRANSFORMERS_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
        self.errors = tempfile.TemporaryFile("w+")  # not a pipe: nobody reads it until the end
        self.process = subprocess.Popen(
            [python, str(Path(__file__).with_name("reference.py"))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.errors,
            text=True,
        )
        self.process.stdin.write(json.dumps({"model": model, "dtype": "float32", "threads": 1, "jobs": jobs}))
        self.process.stdin.close()
        self.results: list[list[dict]] = []

    def result(self, index: int) -> list[dict]:
        while len(self.results) <= index:
            line = self.process.stdout.readline()
            if not line:
                self.process.wait(timeout=60)
                self.errors.seek(0)
                raise AssertionError(f"reference.py ended early: {self.errors.read()[-3000:]}")
            self.results.append(json.loads(line))
        return self.results[index]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=60)
        self.process.stdout.close()
        self.errors.close()


def transformers_reference(policy: str, budget: int, new: int, prompts: list[list[int]], model: str) -> list[dict]:
    """One job of :class:`TransformersReference`, waited for."""
    reference = TransformersReference(model, [{"policy": policy, "budget": budget, "new": new, "prompts": prompts}])
    try:
        return reference.result(0)
    finally:
        reference.close()


class Engines:
    """vLLM engines on the demo model in fp32, one at a time (the last one built is kept for the next test)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.key = None
        self.llm = None

    def get(self, policy: str, budget: int | None, max_model_len: int = 1024):
        key = (policy, budget, max_model_len)
        if key != self.key:
            self.close()
            cache = CacheSettings(budget=budget, policy=policy)
            engine = VllmSettings(
                self.model, dtype="float32", max_model_len=max_model_len, kv_cache_bytes=KV_BYTES, trace=True
            )
            self.llm, self.key = build_engine(cache, engine), key
        return self.llm

    def close(self) -> None:
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = self.key = None
            gc.collect()


def greedy(max_tokens: int):
    """vLLM's greedy sampling of exactly ``max_tokens`` tokens."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def token_prompts(prompts: list[list[int]]):
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=ids) for ids in prompts]
