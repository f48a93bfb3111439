"""Lag-KV arithmetic: causal previous-chunk normalisation, unbiased std, head mean, keys + values."""

from __future__ import annotations

import pytest
import torch

import epikv_cli
from epikv_cli.policies.lagkv import lag_scores, layer_mean

from conftest import tiny_model

# One head, five tokens of dimension 3, chunks of 2 (hand-computed below).
TOKENS = [
    [0, 0, 0],  # chunk 0, raw: std 0
    [2, 4, 6],  # chunk 0, raw: unbiased std 2
    [2, 0, 3],  # chunk 1 / range of chunk 0 [0..2, 0..4, 0..6] -> [1, 0, .5]: std .5
    [0, 4, 0],  # -> [0, 1, 0]: std sqrt(1/3)
    [1, 1, 3],  # chunk 2 / range of chunk 1 [0..2, 0..4, 0..3] -> [.5, .25, 1]: std .3818813
]
EXPECTED = [0.0, 2.0, 0.5, 0.5773502691896257, 0.3818813079129867]


def test_lag_scores_hand_computed():
    x = torch.tensor([TOKENS], dtype=torch.float32)
    assert lag_scores(x, chunk=2).tolist() == pytest.approx(EXPECTED, abs=1e-6)


def test_lag_scores_normalise_with_the_previous_chunk_not_the_next():
    x = torch.tensor([TOKENS], dtype=torch.float32)
    changed_future = x.clone()
    changed_future[0, 4] = torch.tensor([100.0, -50.0, 7.0])
    # chunk 1's scores depend only on chunks 0 and 1
    assert lag_scores(changed_future, chunk=2)[:4].tolist() == pytest.approx(EXPECTED[:4], abs=1e-6)


def test_lag_scores_mean_over_heads():
    one = torch.tensor([TOKENS], dtype=torch.float32)
    other = torch.randn(1, 5, 3)
    both = torch.cat([one, other])
    expected = (lag_scores(one, chunk=2) + lag_scores(other, chunk=2)) / 2
    assert torch.allclose(lag_scores(both, chunk=2), expected, atol=1e-6)


def test_lag_scores_default_chunk_is_128():
    x = torch.randn(2, 300, 4)
    assert torch.allclose(lag_scores(x), lag_scores(x, chunk=128))
    assert not torch.allclose(lag_scores(x), lag_scores(x, chunk=64))


def test_layer_mean_and_token_scores_follow_logical_order():
    model = tiny_model("llama", seed=2)
    ids = torch.randint(0, 256, (1, 6))
    with epikv_cli.attach(model, budget=24, recent=4, policy="lagkv") as cache:
        with torch.inference_mode():
            out = model(ids, cache=cache, use_cache=True)
            for _ in range(30):
                out = model(out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
        assert cache.evicted_total > 0
        keys, values = layer_mean(cache)
        manual = torch.stack([layer.live()[0][0] for layer in cache.budget_layers]).mean(0)
        assert torch.allclose(keys, manual, atol=1e-6)
        order = torch.argsort(cache.live_positions())
        expected = lag_scores(keys[:, order]) + lag_scores(values[:, order])
        # the policy's means, accumulated at append and moved with the slots, equal a fresh pass over the cache
        scores = cache.policy.token_scores(cache)
        assert torch.allclose(scores[order], expected, atol=1e-6)
