"""Settings validation and --bands parsing."""

from __future__ import annotations

import pytest

from epikv_cli.config import CacheSettings, ModelSettings, SamplingSettings, parse_bands
from epikv_cli.errors import UsageError
from epikv_cli.policies.base import method_recent as default_recent
from epikv_cli.policies.registry import check_settings, make_policy


def test_parse_bands():
    assert parse_bands("10:+1,21:-1") == ((10, 1.0), (21, -1.0))
    assert parse_bands(" 3:1 , 7:-1.0") == ((3, 1.0), (7, -1.0))


@pytest.mark.parametrize(
    "text", ["", "10", "10:", "a:+1", "10:+1;21:-1", "10:0", "-1:+1", "3:+1,3:-1", "10:+2", "10:-0.5", "10:nan"]
)
def test_malformed_bands(text):
    with pytest.raises(UsageError):
        parse_bands(text)


def test_recent_window_default():
    assert default_recent(8192) == 128
    assert default_recent(128) == 32
    assert make_policy(CacheSettings(budget=100, policy="epikv")).recent_for(100) == 25
    assert make_policy(CacheSettings(budget=100, policy="epikv", recent=7)).recent_for(100) == 7


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"policy": "h3o"}, "unknown policy"),
        ({"budget": 0}, "positive"),
        ({"recent": -1}, "--recent"),
        ({"positions": "absolute"}, "--positions"),
        ({"policy": "lagkv", "bands": ((1, 1.0),)}, "--bands only applies"),
        ({"budget": None}, "needs a --budget"),
    ],
)
def test_cache_settings_errors(kwargs, message):
    """Field checks fail when the settings are made; checks against the policy when the registry reads them."""
    with pytest.raises(UsageError, match=message):
        check_settings(CacheSettings(**kwargs))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_new_tokens": 0},
        {"temperature": -1},
        {"top_p": 0},
        {"top_k": -2},
        {"stop": ("",)},
        {"top_k": 5},
        {"top_p": 0.9},
    ],
)
def test_sampling_settings_errors(kwargs):
    with pytest.raises(UsageError):
        SamplingSettings(**kwargs)


def test_model_settings_errors():
    with pytest.raises(UsageError):
        ModelSettings(dtype="int4")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": float("nan")}, "--temperature must be a finite number"),
        ({"temperature": float("inf")}, "--temperature must be a finite number"),
        ({"temperature": 1.0, "top_p": float("nan")}, "--top-p must be a finite number"),
        ({"temperature": 1.0, "seed": 2**64}, "--seed"),
        ({"temperature": 1.0, "seed": -1}, "--seed"),
    ],
)
def test_sampling_numbers_must_be_usable(kwargs, message):
    with pytest.raises(UsageError, match=message):
        SamplingSettings(**kwargs)


def test_largest_seed_is_accepted():
    assert SamplingSettings(temperature=1.0, seed=2**64 - 1).seed == 2**64 - 1
    with pytest.raises(UsageError, match="--seed"):
        CacheSettings(budget=64, policy="random", seed=2**64)


@pytest.mark.parametrize("spec", ["auto", "balanced", "balanced_low_0", "sequential", "cpu"])
def test_device_maps_this_machine_has(spec):
    assert ModelSettings(device_map=spec).device_map == spec


@pytest.mark.parametrize(
    "spec, message",
    [
        ("cuda", "no CUDA device"),
        ("cuda:0", "no CUDA device"),
        ("0", "no CUDA device"),
        ("cpu:1", "has no index"),
        ("tpu", "not a placement"),
        ("", "not a placement"),
    ],
)
def test_device_maps_this_machine_lacks(monkeypatch, spec, message):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(UsageError, match=message):
        ModelSettings(device_map=spec)


def test_device_index_beyond_the_gpus(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    assert ModelSettings(device_map="cuda:1").device_map == "cuda:1"
    with pytest.raises(UsageError, match="there is no cuda device 2; this machine has 2"):
        ModelSettings(device_map="cuda:2")


@pytest.mark.parametrize("policy", ["streaming", "full"])
def test_recent_is_refused_where_it_means_nothing(policy):
    with pytest.raises(UsageError, match=f"--recent does not apply to policy '{policy}'") as refused:
        check_settings(CacheSettings(budget=None if policy == "full" else 64, policy=policy, recent=8))
    named = str(refused.value).rsplit("choose one of: ", 1)[1].split(", ")  # the policies that take --recent
    assert {"epikv", "epikv2", "h2o", "lagkv", "random"} <= set(named) and named == sorted(named)
    assert not {"streaming", "full", "tova", "rkv"} & set(named)


@pytest.mark.parametrize("budget", [2**62 + 1, 10**20])
def test_budgets_beyond_int64_positions_are_refused_with_the_way_out(budget):
    with pytest.raises(
        UsageError, match=rf"--budget must be at most {2**62} tokens, got {budget}; for no eviction use --policy full"
    ):
        CacheSettings(budget=budget, policy="epikv2")
    assert make_policy(CacheSettings(budget=2**62, policy="epikv2")).recent == 3 * 2**60


def test_recent_windows_beyond_int32_are_refused():
    with pytest.raises(UsageError, match=r"--recent must be at most 2147483647 tokens, got 2147483648"):
        CacheSettings(budget=64, policy="epikv", recent=2**31)


def test_tiny_temperatures_decode_greedily():
    """1e-40 would overflow float32 logits into NaN probabilities; below 1e-5 is greedy (as in vLLM)."""
    assert SamplingSettings(temperature=1e-40).greedy and SamplingSettings(temperature=0.0).greedy
    assert not SamplingSettings(temperature=1e-5).greedy
    with pytest.raises(UsageError, match="only apply when sampling"):
        SamplingSettings(temperature=1e-9, top_k=5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(budget=24.0), "--budget must be a whole number, got 24.0"),
        (dict(budget=True), "--budget must be a whole number, got True"),
        (dict(budget="16"), "--budget must be a whole number, got '16'"),
        (dict(budget=64, policy="epikv", recent=2.5), "--recent must be a whole number, got 2.5"),
        (dict(budget=64, seed="a"), "--seed must be a whole number, got 'a'"),
        (dict(budget=64, policy="epikv", bands=((0, 2.0),)), "--bands must be (layer, sign) pairs with sign +1 or -1"),
        (dict(budget=64, policy="epikv", bands="10:+1"), "--bands must be (layer, sign) pairs"),
    ],
)
def test_python_callers_get_the_type_named_not_a_torch_error(kwargs, message):
    with pytest.raises(UsageError) as refused:
        CacheSettings(**kwargs)
    assert str(refused.value).startswith(message)


def test_attach_takes_bands_as_lists_too():
    import epikv_cli

    from conftest import tiny_model

    model = tiny_model("llama", seed=3)
    with epikv_cli.attach(model, budget=64, policy="epikv", bands=[[0, 1], [1, -1]]) as cache:
        assert [(band.layer, band.sign) for band in epikv_cli.policy_of(cache).bands] == [(0, 1.0), (1, -1.0)]


def test_numpy_and_torch_integers_are_whole_numbers():
    import numpy as np
    import torch

    settings = CacheSettings(
        budget=np.int64(64), policy="epikv", recent=torch.tensor(8), seed=np.int32(3), bands=((np.int64(0), 1),)
    )
    assert (settings.budget, settings.recent, settings.seed, settings.bands) == (64, 8, 3, ((0, 1.0),))
    assert all(type(value) is int for value in (settings.budget, settings.recent, settings.seed, settings.bands[0][0]))
