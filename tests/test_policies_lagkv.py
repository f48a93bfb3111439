"""Lag-KV arithmetic: causal previous-chunk normalisation, unbiased std, head mean, keys + values."""

from __future__ import annotations

import pytest
import torch

import epikv_cli
from epikv_cli.config import CacheSettings
from epikv_cli.errors import UsageError
from epikv_cli.policies.lagkv import FrozenLagKV, LagChunks, LagKV, lag_scores, layer_mean
from epikv_cli.policies.registry import make_policy

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
        scores = epikv_cli.policy_of(cache).token_scores(cache)
        assert torch.allclose(scores[order], expected, atol=1e-6)


# -- lagkv:chunks=positions: chunks of logical positions, each score frozen at append -----------------


@pytest.mark.parametrize("blocks", [[700], [1] * 700, [300, 1, 1, 126, 128, 1, 143], [127, 1, 128, 444]])
def test_lag_chunks_fed_in_blocks_equal_lag_scores_of_the_whole_sequence(blocks):
    x = torch.randn(3, 700, 16, generator=torch.Generator().manual_seed(len(blocks)))
    chunks, scores, start = LagChunks(), [], 0
    for size in blocks:
        scores.append(chunks.push(x[:, start : start + size]))
        start += size
    assert torch.equal(torch.cat(scores), lag_scores(x))


def test_lag_chunks_hand_computed_one_token_at_a_time():
    chunks = LagChunks(chunk=2)
    x = torch.tensor([TOKENS], dtype=torch.float32)
    got = [float(chunks.push(x[:, i : i + 1])) for i in range(len(TOKENS))]
    assert got == pytest.approx(EXPECTED, abs=1e-6)


def test_the_option_picks_the_rule_and_refuses_other_values():
    assert type(make_policy(CacheSettings(budget=64, policy="lagkv"))) is LagKV
    frozen = make_policy(CacheSettings(budget=64, policy="lagkv", options=(("chunks", "positions"),)))
    assert type(frozen) is FrozenLagKV and frozen.recent == 16
    assert type(make_policy(CacheSettings(budget=64, policy="lagkv", options=(("chunks", "cache"),)))) is LagKV
    with pytest.raises(UsageError, match="chunks='tokens': choose cache"):
        make_policy(CacheSettings(budget=64, policy="lagkv", options=(("chunks", "tokens"),)))


def test_frozen_scores_are_lag_scores_of_every_token_appended_evicted_ones_included():
    """Each token's frozen score equals lag_scores over the layer-mean keys and values of all tokens as they
    were appended (read back from the cache right after each forward), and the evictions are the lowest."""
    model = tiny_model("llama", seed=2)
    ids = torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(3))
    means_k, means_v = [], []
    with epikv_cli.attach(model, budget=180, recent=8, policy="lagkv", options={"chunks": "positions"}) as cache:
        with torch.inference_mode():
            out = model(ids, cache=cache, use_cache=True)
            keys, values = layer_mean(cache)  # nothing evicted yet: the prompt in slot (= position) order
            means_k.append(keys), means_v.append(values)
            for _ in range(200):
                out = model(out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
                slot = cache.slots_of([cache.seen - 1])[0]
                keys, values = layer_mean(cache, slot, slot + 1)
                means_k.append(keys), means_v.append(values)
        assert cache.evicted_total == 150 + 200 - 180
        expected = lag_scores(torch.cat(means_k, dim=1)) + lag_scores(torch.cat(means_v, dim=1))
        got = torch.tensor([epikv_cli.policy_of(cache).score_of(p) for p in range(cache.seen)], dtype=torch.float32)
        assert torch.allclose(got, expected, atol=1e-5)
        # what is left is what the keep rule leaves, replayed on these scores: after each token enters, the
        # lowest-scoring generated token outside the recent window leaves (ties: the older)
        live = set(range(150))
        for position in range(150, cache.seen):
            live.add(position)
            if len(live) > 180:
                candidates = [p for p in live if 150 <= p < position + 1 - 8]
                live.remove(min(candidates, key=lambda p: (float(expected[p]), p)))
        assert set(cache.live_positions().tolist()) == live
