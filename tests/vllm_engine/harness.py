"""Helpers of the vLLM engine's tests: stock vLLM and epikv's engines on the demo model, greedy sampling, and the
transformers engine's record of the same prompts (run in the project's main venv)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
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


def transformers_reference(policy: str, budget: int, new: int, prompts: list[list[int]], model: str) -> list[dict]:
    """The transformers engine's greedy run of ``prompts`` (token ids) under ``policy`` and K = ``budget``, in the main
    venv (``reference.py``, on every core: vLLM's engine waits meanwhile): per prompt its ``tokens``, each step's
    ``evicted`` positions and top-2 logit ``gaps``."""
    python = os.environ.get("EPIKV_TRANSFORMERS_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
    job = {"model": model, "dtype": "float32", "policy": policy, "budget": budget, "new": new, "prompts": prompts}
    done = subprocess.run(
        [python, str(Path(__file__).with_name("reference.py"))],
        input=json.dumps({**job, "threads": len(os.sched_getaffinity(0))}),
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


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
