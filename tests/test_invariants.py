"""Budget invariants over long generations, for random budgets, lengths and recent windows."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epikv_cli.engine import Generation
from epikv_cli.settings import CacheSettings, SamplingSettings

from conftest import tiny_model

MODEL = tiny_model("llama", seed=3)


class PositionLog:
    """Records the position ids every forward receives."""

    def __init__(self, model):
        self.seen: list[list[int]] = []
        self.handle = model.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs):
        self.seen.append(kwargs["position_ids"][0].tolist())


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(["epikv", "lagkv"]),
    prompt_len=st.integers(1, 20),
    slack=st.integers(1, 30),
    recent=st.one_of(st.none(), st.integers(0, 12)),
    new_tokens=st.integers(1, 150),
    positions=st.sampled_from(["logical", "compressed"]),
)
def test_budget_invariants(tokenizer, policy, prompt_len, slack, recent, new_tokens, positions):
    r = recent
    # smallest budget whose default recent window still leaves `slack` evictable slots
    budget = prompt_len + (r if r is not None else 0) + slack
    if r is None:
        while prompt_len + min(128, budget // 4) + slack > budget:
            budget += 1
    settings_ = CacheSettings(budget=budget, policy=policy, recent=recent, positions=positions)
    window = settings_.recent_window
    ids = torch.randint(0, 256, (1, prompt_len), generator=torch.Generator().manual_seed(new_tokens))
    log = PositionLog(MODEL)
    try:
        run = Generation(MODEL, tokenizer, ids, settings_, SamplingSettings(max_new_tokens=new_tokens, ignore_eos=True))
        for event in run:
            # the cache after the forward that produced this token: at most K entries
            assert event.stored <= budget
            live = set(event.evicted)
            assert not live & set(range(prompt_len)), "a prompt token was evicted"
            recent_start = max(prompt_len, event.seen - window)
            assert not live & set(range(recent_start, event.seen)), "a recent token was evicted"
    finally:
        log.handle.remove()
    result = run.result
    assert result.peak_stored <= budget
    assert result.generated_tokens == new_tokens
    flat = [p for step in log.seen for p in step]
    if positions == "logical":
        assert all(b > a for a, b in zip(flat, flat[1:])), "positions must strictly increase"
        assert flat == list(range(prompt_len + new_tokens - 1))
    else:  # paper-time harness: the next position is the stored length
        decode = [min(prompt_len + i, budget) for i in range(new_tokens - 1)]
        assert flat == list(range(prompt_len)) + decode
    total = prompt_len + new_tokens - 1
    assert result.evicted == max(0, total - budget)


@settings(max_examples=15, deadline=None)
@given(prompt_len=st.integers(1, 16), slack=st.integers(1, 20), new_tokens=st.integers(20, 120))
def test_prompt_and_recent_window_always_stored(tokenizer, prompt_len, slack, new_tokens):
    from epikv_cli.session import EpiKVSession

    recent = 6
    budget = prompt_len + recent + slack
    settings_ = CacheSettings(budget=budget, policy="epikv", recent=recent)
    with EpiKVSession(MODEL, settings_) as session:
        ids = torch.randint(0, 256, (1, prompt_len))
        cache = session.cache
        with torch.inference_mode():
            out = MODEL(input_ids=ids, cache=cache, use_cache=True)
            for _ in range(new_tokens):
                token = out.logits[:, -1:].argmax(-1)
                out = MODEL(input_ids=token, cache=cache, use_cache=True)
                live = set(cache.live_positions().tolist())
                assert cache.stored <= budget and len(live) == cache.stored
                assert set(range(prompt_len)) <= live
                assert set(range(max(prompt_len, cache.seen - recent), cache.seen)) <= live
