"""EpiKV-Flat arithmetic pinned against hand-computed values (METHOD.md)."""

from __future__ import annotations

import math

import pytest
import torch

import epikv_cli
from epikv_cli.errors import UsageError
from epikv_cli.policies.base import Signals
from epikv_cli.policies.epikv import EpiKV, RollingZScore, default_bands

from conftest import tiny_model


# -- the causal rolling z-score ----------------------------------------------------------------
def test_zscore_is_zero_below_two_values():
    assert RollingZScore().push(5.0) == 0.0


def test_zscore_uses_population_std():
    z = RollingZScore()
    z.push(5.0)
    # values [5, 1]: mean 3, population std 2 (the sample std would be 2.83)
    assert z.push(1.0) == pytest.approx(-2 / (2 + 1e-6), abs=1e-12)


def test_zscore_two_values_exact():
    z = RollingZScore()
    z.push(5.0)
    assert z.push(1.0) == pytest.approx(-0.99999950000025, abs=1e-12)
    # [5, 1, 3]: the value equals the mean
    assert z.push(3.0) == 0.0


def test_zscore_epsilon_is_1e_minus_6():
    z = RollingZScore()
    z.push(0.0)
    # [0, 2e-6]: mean 1e-6, std 1e-6 -> 1e-6 / (1e-6 + 1e-6) = 0.5 (without epsilon it would be 1)
    assert z.push(2e-6) == pytest.approx(0.5, abs=1e-9)


def test_zscore_window_holds_the_last_64_values():
    z = RollingZScore()
    for value in range(69):
        z.push(float(value))
    # window 6..69: mean 37.5, population std sqrt((64^2 - 1) / 12) = 18.4729532...
    assert z.push(69.0) == pytest.approx(1.7051955878687277, abs=1e-12)
    assert len(z.values) == 64 and z.values[0] == 6.0


# -- default bands ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "layers, bands",
    [
        (32, ((10, 1.0), (21, -1.0))),
        (30, ((9, 1.0), (20, -1.0))),
        (4, ((1, 1.0), (2, -1.0))),
        (64, ((20, 1.0), (43, -1.0))),
    ],
)
def test_default_bands_follow_depth_fractions(layers, bands):
    assert default_bands(layers) == bands


def test_band_out_of_range_is_a_usage_error():
    policy = EpiKV(recent=4, given_bands=((40, 1.0),))
    with pytest.raises(UsageError, match="out of range"):
        policy.setup(30)


# -- scores from hidden states ---------------------------------------------------------------
def hidden(rows):
    return torch.tensor([rows], dtype=torch.float32)  # [1, q, hidden]


def test_score_is_signed_sum_of_band_zscores():
    policy = EpiKV(recent=4, given_bands=((0, 1.0), (1, -1.0)))
    policy.setup(2)
    # prefill: the last prompt token's state is what the first generated token differs from
    policy.observe(Signals(range(0, 2), True, {0: hidden([[9, 9], [0, 0]]), 1: hidden([[7, 7], [0, 0]])}))
    policy.observe(Signals(range(2, 3), False, {0: hidden([[3, 4]]), 1: hidden([[1, 0]])}))
    first = policy.last[0]
    assert first.changes == pytest.approx((5.0, 1.0))  # ||[3,4]-[0,0]||, ||[1,0]-[0,0]||
    assert first.zscores == (0.0, 0.0) and first.score == 0.0
    policy.observe(Signals(range(3, 4), False, {0: hidden([[3, 4]]), 1: hidden([[1, 2]])}))
    second = policy.last[0]
    assert second.changes == pytest.approx((0.0, 2.0))
    # layer 0: [5, 0] -> z = -2.5 / (2.5 + 1e-6); layer 1: [1, 2] -> z = 0.5 / (0.5 + 1e-6); s = z0 - z1
    assert second.score == pytest.approx(-1.99999760000416, abs=1e-12)
    assert policy.score_of(3) == second.score
    assert policy.score_of(0) is None  # prompt tokens carry no score


def test_multi_token_forward_scores_like_single_steps():
    rows = torch.randn(6, 8).tolist()
    one = EpiKV(recent=1, given_bands=((0, 1.0),))
    many = EpiKV(recent=1, given_bands=((0, 1.0),))
    for p in (one, many):
        p.setup(1)
        p.observe(Signals(range(0, 1), True, {0: hidden([rows[0]])}))
    for i in range(1, 6):
        one.observe(Signals(range(i, i + 1), False, {0: hidden([rows[i]])}))
    many.observe(Signals(range(1, 6), False, {0: hidden(rows[1:])}))
    for position in range(1, 6):
        assert many.score_of(position) == pytest.approx(one.score_of(position), abs=1e-9)


def test_changes_are_token_to_token_at_the_same_layer():
    """d uses the block output (hidden_states[l + 1]) of consecutive tokens."""
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 10))
    full = model(ids, output_hidden_states=True).hidden_states
    with epikv_cli.attach(model, budget=512, policy="epikv", bands=((1, 1.0), (2, -1.0))) as cache:
        with torch.inference_mode():
            model(ids[:, :7], cache=cache, use_cache=True)
            for t in range(7, 10):
                model(ids[:, t : t + 1], cache=cache, use_cache=True)
                step = epikv_cli.policy_of(cache).last[0]
                expected = tuple(float((full[layer + 1][0, t] - full[layer + 1][0, t - 1]).norm()) for layer in (1, 2))
                assert step.changes == pytest.approx(expected, rel=1e-4)


def test_scores_are_frozen_through_eviction():
    model = tiny_model("llama", seed=5)
    ids = torch.randint(0, 256, (1, 8))
    at_birth: dict[int, float] = {}
    with epikv_cli.attach(model, budget=30, recent=4, policy="epikv") as cache:
        with torch.inference_mode():
            out = model(ids, cache=cache, use_cache=True)
            for _ in range(80):
                out = model(out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
                for step in epikv_cli.policy_of(cache).last:
                    at_birth[step.position] = step.score
        assert cache.evicted_total > 0
        for position in cache.live_positions().tolist():
            if position >= 8:
                assert epikv_cli.policy_of(cache).score_of(position) == at_birth[position]


def test_lowest_scores_leave_first():
    model = tiny_model("llama", seed=6)
    ids = torch.randint(0, 256, (1, 5))
    with epikv_cli.attach(model, budget=20, recent=3, policy="epikv") as cache:
        with torch.inference_mode():
            out = model(ids, cache=cache, use_cache=True)
            for _ in range(40):
                before = {p: epikv_cli.policy_of(cache).score_of(p) for p in cache.live_positions().tolist()}
                out = model(out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
                evicted = set(before) - set(cache.live_positions().tolist())
                if not evicted:
                    continue
                (gone,) = evicted
                candidates = [p for p in before if 5 <= p < cache.seen - 3]
                assert before[gone] == min(before[p] for p in candidates)
                assert not math.isnan(before[gone])


def test_a_non_finite_change_does_not_poison_the_window():
    poisoned, clean = RollingZScore(window=4), RollingZScore(window=4)
    for value in (1.0, 2.0):
        poisoned.push(value)
        clean.push(value)
    assert poisoned.push(math.inf) == 0.0 and poisoned.push(math.nan) == 0.0
    assert poisoned.push(3.0) == clean.push(3.0)  # the next z-scores are those of the finite values
    policy = EpiKV(recent=1, given_bands=((0, 1.0),))
    policy.setup(1)
    policy.observe(Signals(range(0, 1), True, {0: hidden([[0.0, 0.0]])}))
    policy.observe(Signals(range(1, 2), False, {0: hidden([[math.inf, 0.0]])}))
    policy.observe(Signals(range(2, 3), False, {0: hidden([[1.0, 0.0]])}))
    assert policy.nonfinite >= 1 and math.isfinite(policy.score_of(1)) and math.isfinite(policy.score_of(2))


def test_bands_option_picks_default_or_calibrated_whatever_else_is_there():
    from epikv_cli.config import CacheSettings
    from epikv_cli.models.calibration import Calibration
    from epikv_cli.policies.registry import make_policy

    saved = Calibration("m", [(3, 1.0), (7, -1.0)], [0.0] * 32, 10, 2, 64, path="bands.json")

    def bands(option, requested=None, calibration=saved):
        options = (("bands", option),) if option else ()
        policy = make_policy(CacheSettings(budget=100, policy="epikv", bands=requested, options=options))
        policy.setup(32, calibration)
        return [(b.layer, b.sign) for b in policy.bands], policy.bands_source

    assert bands(None) == ([(3, 1.0), (7, -1.0)], "calibrated (bands.json)")  # auto: the calibration
    assert bands(None, requested=((5, 1.0),)) == ([(5, 1.0)], "--bands")  # --bands overrides it
    assert bands("default")[0] == [(10, 1.0), (21, -1.0)]  # the paper's, although a calibration exists
    assert bands("calibrated", requested=((5, 1.0),))[0] == [(3, 1.0), (7, -1.0)]
    with pytest.raises(UsageError, match="no saved calibration"):
        bands("calibrated", calibration=None)
    with pytest.raises(UsageError, match="choose auto, default or calibrated"):
        bands("best")


def test_a_calibration_measured_on_a_model_of_another_depth_is_not_used():
    """Bands saved for another model at the same path (a directory replaced, 28 layers measured, 32 here) whose
    layers happen to fit: auto takes the depth-fraction default, bands=calibrated refuses naming both depths."""
    from epikv_cli.config import CacheSettings
    from epikv_cli.models.calibration import Calibration
    from epikv_cli.policies.registry import make_policy

    other = Calibration("m", [(3, 1.0), (7, -1.0)], [0.0] * 28, 10, 2, 64, path="bands.json")
    policy = make_policy(CacheSettings(budget=100, policy="epikv"))
    policy.setup(32, other)
    assert [(b.layer, b.sign) for b in policy.bands] == [(10, 1.0), (21, -1.0)]
    assert policy.bands_source.startswith("default")
    chosen = make_policy(CacheSettings(budget=100, policy="epikv", options=(("bands", "calibrated"),)))
    with pytest.raises(UsageError, match=r"\(bands.json\) was measured on a model of 28 layers and this one has 32"):
        chosen.setup(32, other)
