"""epikv2 at the edges of its options: a kept prompt with the adaptive window, the smallest budget with a kept
prompt, one keep-set per layer with copies followed (each test fails on the code before its fix)."""

from __future__ import annotations

import pytest
import torch

from epikv_cli.config import CacheSettings
from epikv_cli.errors import UsageError
from epikv_cli.policies.registry import make_policy
from epikv_cli.runtime.stream import CacheStream

from conftest import tiny_model

MODEL = tiny_model("qwen2", seed=7, initializer_range=0.15)


def held_per_head(options: tuple, prompt_len: int, budget: int, steps: int):
    """Run epikv2 with ``options`` greedily; yield ``(seen, [set of positions held by each (layer, head)])``
    after every decode step."""
    settings = CacheSettings(budget=budget, policy="epikv2", options=options)
    ids = torch.randint(0, 256, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    with CacheStream(MODEL, settings, max_tokens=prompt_len + steps + 1) as stream:
        out = stream.feed(ids)
        for _ in range(steps):
            out = stream.feed(out.argmax().view(1, 1))
            cache = stream.cache
            yield cache.seen, [set(keep.tolist()) for keep in cache.head_slots.held(cache.stored).flatten(0, 1)]


@pytest.mark.parametrize("keep", ["head", "layer"])
def test_adapt_with_prompt_keep_never_evicts_the_prompt_or_the_recent_window(keep):
    """epikv2:adapt=1:prompt=keep: the adaptive window was clamped to [K/2, K - sinks], so with a kept prompt
    longer than the sinks a head could be left with no candidate and silently evicted a recent token."""
    prompt_len, budget, recent = 20, 33, 8  # recent = round(0.25 * 33)
    options = (("keep", keep), ("prompt", "keep"), ("adapt", "1"), ("recent", "0.25"))
    for seen, held in held_per_head(options, prompt_len, budget, 60):
        assert all(len(positions) == min(seen, budget) for positions in held)
        protected = set(range(prompt_len)) | set(range(seen - recent, seen))
        missing = protected - set.intersection(*held)
        assert not missing, f"at length {seen} a (layer, head) lost protected positions {sorted(missing)}"


@pytest.mark.parametrize(("prompt_len", "smallest"), [(20, 28), (2, 7)])
def test_prompt_keep_budget_floor_counts_the_sinks_once(prompt_len, smallest):
    """By hand, recent=0.25 (R = round(K / 4)), prompt=keep, 4 sinks: K must hold max(sinks, prompt) + R + 1.
    Prompt 20: K = 28 gives R = 7 and 20 + 7 + 1 = 28; K = 27 gives R = 7, 28 > 27. Prompt 2 (the sinks cover
    it): K = 7 gives R = 2 and 4 + 2 + 1 = 7; K = 6 gives R = 2, 7 > 6. The floor used to add the sinks on top of
    the prompt (33 and 9)."""
    options = (("prompt", "keep"), ("recent", "0.25"))
    policy = make_policy(CacheSettings(budget=64, policy="epikv2", options=options))
    assert policy.min_budget(prompt_len) == smallest
    with pytest.raises(UsageError, match=f"use --budget {smallest} or more"):
        make_policy(CacheSettings(budget=smallest - 1, policy="epikv2", options=options)).check_budget(
            prompt_len, smallest - 1
        )
    # and the smallest budget works: every head keeps the prompt, the sinks and its recent window
    recent = round(smallest / 4)
    for seen, held in held_per_head(options, prompt_len, smallest, 40):
        assert all(len(positions) == min(seen, smallest) for positions in held)
        protected = set(range(min(max(4, prompt_len), seen))) | set(range(seen - recent, seen))
        assert protected <= set.intersection(*held)


def test_keep_layer_with_copy_keeps_one_set_per_layer():
    """keep=layer promises one keep-set per layer; with copy on (the default where allowed), a copying KV head
    used to stretch only its own window, so the heads of one layer evicted different tokens. Here copy=0.05 with
    no least weight makes heads copy in most refreshes (the same run as tests/test_keepsets.py's copy test)."""
    options = (("keep", "layer"), ("recent", "0.25"), ("copy", "0.05"), ("copyweight", "0"))
    settings = CacheSettings(budget=24, policy="epikv2", options=options)
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(2))
    stretched = 0
    with CacheStream(MODEL, settings, max_tokens=140) as stream:
        out = stream.feed(ids)
        for _ in range(100):
            out = stream.feed(out.argmax().view(1, 1))
            held = stream.cache.head_slots.held(stream.cache.stored).sort(dim=-1).values  # [layers, heads, K]
            assert torch.equal(held, held[:, :1].expand_as(held)), "heads of one layer hold different tokens"
            stretched += int((stream.session.policy._window > stream.session.policy.recent).sum())
    assert stretched > 0  # windows did stretch: the copy rule was exercised
