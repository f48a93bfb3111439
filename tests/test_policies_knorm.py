"""knorm's rule on hand-made keys (its own tests: removing the policy removes this file with it)."""

from __future__ import annotations

import pytest
import torch

from epikv_cli.core.cache import BudgetCache
from epikv_cli.policies.base import Signals
from epikv_cli.policies.knorm import KeyNorm

from conftest import ARCHITECTURES


def states(values, heads=2, dim=4):
    """[1, heads, n, dim] keys whose row t has every entry equal to values[t]."""
    v = torch.tensor(values, dtype=torch.float32).view(1, 1, -1, 1)
    return v.expand(1, heads, -1, dim).clone(), torch.zeros(1, heads, len(values), dim)


def test_knorm_scores_minus_the_mean_key_norm_and_evicts_the_largest():
    config = ARCHITECTURES["llama"]()
    cache = BudgetCache(config, budget=6)
    values = [1.0, 1.0, 3.0, 0.5, 2.0, 1.0, 0.2]  # position 0 is the prompt
    for layer in range(config.num_hidden_layers):
        cache.update(*states(values[:1]), layer)
    cache.commit()
    policy = KeyNorm(recent=1)
    policy.observe(Signals(range(0, 1), True, cache=cache))
    for t in range(1, len(values)):
        for layer in range(config.num_hidden_layers):
            cache.update(*states([values[t]]), layer)
        policy.observe(Signals(cache.commit(), False, cache=cache))
    assert policy.score_of(2) == pytest.approx(-3.0 * 2)  # norm of [3, 3, 3, 3]
    # evictable: positions 1..5 (0 is the prompt, 6 the recent window); largest norms first: 2 (3.0), 4 (2.0)
    assert policy.select(cache, 2) == [2, 4]
