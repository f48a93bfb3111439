"""``epikv profile --engine vllm``'s arithmetic, on a scripted engine (no model): what counts as decode."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from epikv_cli.config import CacheSettings
from epikv_cli.experiments import profile
from epikv_cli.vllm import engine as vllm_engine


class ScriptedEngine:
    """An engine whose ``step()`` gives each request's cumulative tokens from a script: ``script[i]`` is how many each
    request (in the order added) holds after step ``i + 1``."""

    def __init__(self, script: list[tuple[int, ...]]) -> None:
        self.script, self.names, self.steps = script, [], 0
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(model="scripted", dtype=torch.float32))

    def add_request(self, name, prompt, params) -> None:
        self.names.append(name)

    def has_unfinished_requests(self) -> bool:
        return self.steps < len(self.script)

    def step(self) -> list:
        counts = self.script[self.steps]
        self.steps += 1
        return [
            SimpleNamespace(request_id=name, outputs=[SimpleNamespace(token_ids=list(range(count)))])
            for name, count in zip(self.names, counts)
        ]


def test_decode_counts_only_the_tokens_made_after_every_request_had_its_first(monkeypatch):
    """Two requests of 9 tokens, the second's first token one step after the first's (one second per step): by the
    step where both have one, 3 tokens exist; the 15 made after it took 8 s, 15/8 tokens/s (not 2 x 8 / 8 = 2)."""
    clock = iter(range(100))
    monkeypatch.setattr(profile.time, "perf_counter", lambda: float(next(clock)))
    monkeypatch.setattr(vllm_engine, "request_bytes", lambda *args: 1000)
    scripted = ScriptedEngine([(1, 0)] + [(n, n - 1) for n in range(2, 10)] + [(9, 9)])
    measured = profile.measure_vllm(
        SimpleNamespace(llm_engine=scripted), torch.tensor([[1, 2, 3]]), CacheSettings(budget=None, policy="full"), 9, 2
    )
    assert measured.prefill_seconds == 2.0  # started at 0, the second request's first token at 2
    assert measured.decode_tokens_per_s == 15 / 8
    assert measured.kv_cache_bytes == 2000
