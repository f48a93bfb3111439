"""The keep rule and the attention-free baselines."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from epikv_cli.config import CacheSettings
from epikv_cli.errors import UsageError
from epikv_cli.policies.base import evictable_mask, lowest
from epikv_cli.policies.baselines import RandomEviction, Streaming
from epikv_cli.policies.epikv import EpiKV
from epikv_cli.policies.registry import POLICIES, make_policy


def fake_cache(positions, prompt_len, seen):
    """What policies read of a cache: slots hold ``positions`` (scrambled orders allowed)."""
    return SimpleNamespace(
        live_positions=lambda: torch.tensor(positions),
        prompt_len=prompt_len,
        seen=seen,
        slots_of=lambda wanted: [positions.index(p) for p in wanted],
    )


def test_evictable_excludes_prompt_and_recent_window():
    positions = torch.arange(12)
    mask = evictable_mask(positions, prompt_len=3, seen=12, recent=2)
    assert torch.nonzero(mask).flatten().tolist() == list(range(3, 10))


def test_lowest_breaks_ties_by_age():
    scores = torch.tensor([1.0, 0.5, 0.5, 2.0, 0.5])
    positions = torch.tensor([10, 7, 3, 1, 9])
    candidates = torch.tensor([True, True, True, True, False])
    assert lowest(scores, positions, candidates, 2) == [2, 1]  # positions 3, then 7


def test_scored_keep_rule_on_scrambled_slots():
    policy = EpiKV(recent=2, given_bands=((0, 1.0),))
    for position, score in {3: 0.2, 4: 0.3, 5: 0.3, 6: -1.0, 7: 0.3, 8: 0.0, 9: -5.0, 10: -9.0, 11: -9.0}.items():
        policy.book.set(position, score)
    # slots hold positions in scrambled order (as after earlier moves)
    positions = [0, 1, 2, 11, 4, 9, 6, 10, 8, 3, 5, 7]
    cache = fake_cache(positions, prompt_len=3, seen=12)
    # 10 and 11 are the recent window, 0-2 the prompt: the lowest of 3..9 are 9 (slot 5), 6 (slot 6)
    assert policy.select(cache, 2) == [5, 6]
    # one step later (12 generated, 10 leaves the recent window): 10 (-9.0) goes next, then 8 (0.0), then 3 (0.2)
    cache = fake_cache([0, 1, 2, 11, 4, 12, 10, 8, 3, 5, 7], prompt_len=3, seen=13)
    assert policy.select(cache, 3) == [6, 7, 8]
    # ties go to the older token: 4, 5 and 7 all score 0.3
    assert policy.select(cache, 2) == [4, 9]


def test_streaming_keeps_sinks_and_most_recent():
    cache = fake_cache([0, 1, 2, 3, 4, 5, 6, 7, 8], prompt_len=6, seen=9)
    assert Streaming().select(cache, 2) == [4, 5]  # sinks 0-3 stay, oldest others leave, prompt included


def test_random_is_seeded_and_respects_protection():
    cache = fake_cache(list(range(20)), prompt_len=4, seen=20)
    a = RandomEviction(recent=5, seed=1).select(cache, 4)
    b = RandomEviction(recent=5, seed=1).select(cache, 4)
    assert a == b and all(4 <= s < 15 for s in a)


def test_registry_builds_each_policy():
    for name in POLICIES:
        budget = None if name == "full" else 64
        policy = make_policy(CacheSettings(budget=budget, policy=name))
        assert policy.name == name


def test_budget_check_names_the_fix():
    policy = make_policy(CacheSettings(budget=40, policy="epikv"))
    with pytest.raises(UsageError, match="use --budget 41 or more"):
        policy.check_budget(prompt_len=30, budget=40)  # recent = min(128, 40 // 4) = 10
    policy.check_budget(prompt_len=29, budget=40)


def smallest_budget_by_search(prompt_len: int, recent_for) -> int:
    """Reference: try every budget from 1 up."""
    budget = 1
    while not budget > prompt_len + recent_for(budget):
        budget += 1
    return budget


@pytest.mark.parametrize("recent", [None, 0, 7, 300])
def test_min_budget_is_the_smallest_that_works(recent):
    settings = CacheSettings(budget=64, policy="epikv", recent=recent)
    policy = make_policy(settings)
    recent_for = (lambda k: min(128, k // 4)) if recent is None else (lambda k: recent)
    for prompt_len in range(0, 700, 7):
        expected = smallest_budget_by_search(prompt_len, recent_for)
        assert policy.min_budget(prompt_len) == expected, prompt_len
        policy.check_budget(prompt_len, expected)
        with pytest.raises(UsageError, match=f"use --budget {expected} or more"):
            policy.check_budget(prompt_len, expected - 1)


def test_default_recent_window_makes_the_old_suggestion_wrong():
    """The bug this replaces: prompt + R(K) + 1 with R taken at the too-small K (32, then 40, then 42)."""
    policy = make_policy(CacheSettings(budget=1, policy="epikv"))
    assert policy.min_budget(31) == 42  # R(42) = 10: 31 + 10 + 1 = 42
    assert policy.recent_for(41) == 10 and not 41 > 31 + 10
