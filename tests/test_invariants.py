"""Budget invariants over long generations, for random budgets, lengths and recent windows."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epikv_cli.config import CacheSettings, SamplingSettings
from epikv_cli.policies.baselines import Streaming
from epikv_cli.policies.epikv2 import EpiKV2
from epikv_cli.policies.h2o import H2O
from epikv_cli.policies.registry import POLICIES, make_policy, parse_policy_spec
from epikv_cli.policies.rkv import RKV
from epikv_cli.runtime.generation import Generation

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
    policy=st.sampled_from(["epikv", "lagkv", "lagkv:chunks=positions"]),
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
    name, options = parse_policy_spec(policy)
    settings_ = CacheSettings(budget=budget, policy=name, recent=recent, positions=positions, options=options)
    window = make_policy(settings_).recent_for(budget)
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
    total = prompt_len + new_tokens - 1
    assert result.peak_stored == min(total, budget + 1)  # the in-step peak: K + 1 before the keep-set
    assert result.generated_tokens == new_tokens
    flat = [p for step in log.seen for p in step]
    if positions == "logical":
        assert all(b > a for a, b in zip(flat, flat[1:])), "positions must strictly increase"
        assert flat == list(range(prompt_len + new_tokens - 1))
    else:  # paper-time harness: the next position is the stored length
        decode = [min(prompt_len + i, budget) for i in range(new_tokens - 1)]
        assert flat == list(range(prompt_len)) + decode
    assert result.evicted == max(0, total - budget)


@settings(max_examples=15, deadline=None)
@given(prompt_len=st.integers(1, 16), slack=st.integers(1, 20), new_tokens=st.integers(20, 120))
def test_prompt_and_recent_window_always_stored(tokenizer, prompt_len, slack, new_tokens):
    from epikv_cli.runtime.session import EpiKVSession

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


def protected(policy, prompt_len: int, seen: int, budget: int) -> set[int]:
    """The logical positions ``policy`` promises to keep after a step, from its own rule (METHOD.md)."""
    if policy.protects_prompt:
        return set(range(prompt_len)) | set(range(max(prompt_len, seen - policy.recent), seen))
    if isinstance(policy, (Streaming, H2O)):
        recent = budget - policy.sinks if isinstance(policy, Streaming) else policy.recent
        return set(range(min(policy.sinks, seen))) | set(range(max(0, seen - recent), seen))
    if isinstance(policy, RKV):
        return set(range(max(0, seen - policy.window), seen))
    if isinstance(policy, EpiKV2):
        return set(range(min(policy.sinks, seen))) | set(range(max(0, seen - policy.recent), seen))
    return {seen - 1}  # TOVA keeps the newest token


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from([*sorted(name for name, cls in POLICIES.items() if cls.evicts), "lagkv:chunks=positions"]),
    prompt_len=st.integers(1, 40),
    extra=st.integers(0, 30),
    new_tokens=st.integers(1, 220),
)
def test_every_policy_keeps_its_budget_and_its_promises(tokenizer, policy, prompt_len, extra, new_tokens):
    """stored <= K (+ R-KV's 128 between compressions) after every step, and nothing protected ever leaves."""
    policy, options = parse_policy_spec(policy)
    cls = POLICIES[policy]
    probe = make_policy(CacheSettings(budget=64, policy=policy, options=options))
    budget = (probe.min_budget(prompt_len) if cls.protects_prompt else probe.min_budget(0)) + extra
    # epikv2 with one keep-set (stored = seen - evicted); its per-head sets are checked in tests/test_keepsets.py
    options += (("keep", "global"),) if policy == "epikv2" else ()
    settings_ = CacheSettings(budget=budget, policy=policy, seed=new_tokens, options=options)
    ids = torch.randint(0, 256, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    run = Generation(MODEL, tokenizer, ids, settings_, SamplingSettings(max_new_tokens=new_tokens, ignore_eos=True))
    policy_ = make_policy(settings_)  # the same rule the run follows
    gone: set[int] = set()
    for event in run:
        assert event.stored <= budget + cls.slack
        assert not set(event.evicted) & gone, "a position was evicted twice"
        gone.update(event.evicted)
        assert not gone & protected(policy_, prompt_len, event.seen, budget), "a protected token was evicted"
        assert event.stored == event.seen - len(gone)
    assert run.result.peak_stored <= max(prompt_len, budget + 1 + cls.slack)  # a long prompt may overfill at prefill
