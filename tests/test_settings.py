"""Settings validation and --bands parsing."""

from __future__ import annotations

import pytest

from epikv_cli.errors import UsageError
from epikv_cli.settings import CacheSettings, ModelSettings, SamplingSettings, default_recent, parse_bands


def test_parse_bands():
    assert parse_bands("10:+1,21:-1") == ((10, 1.0), (21, -1.0))
    assert parse_bands(" 3:1 , 7:-0.5") == ((3, 1.0), (7, -0.5))


@pytest.mark.parametrize("text", ["", "10", "10:", "a:+1", "10:+1;21:-1", "10:0", "-1:+1", "3:+1,3:-1"])
def test_malformed_bands(text):
    with pytest.raises(UsageError):
        parse_bands(text)


def test_recent_window_default():
    assert default_recent(8192) == 128
    assert default_recent(128) == 32
    assert CacheSettings(budget=100).recent_window == 25
    assert CacheSettings(budget=100, recent=7).recent_window == 7


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
    with pytest.raises(UsageError, match=message):
        CacheSettings(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [{"max_new_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"stop": ("",)}, {"top_k": 5}, {"top_p": 0.9}],
)
def test_sampling_settings_errors(kwargs):
    with pytest.raises(UsageError):
        SamplingSettings(**kwargs)


def test_model_settings_errors():
    with pytest.raises(UsageError):
        ModelSettings(dtype="int4")
