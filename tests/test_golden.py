"""Every policy gives today exactly what it gave before the restructure (issue 36): token ids, evicted positions
per step and the cache's counts, alone and in a batch of four, on two tiny random models and the demo model.

The outputs were recorded at commit 5def55e by ``python tests/golden_cases.py --write``; see
:mod:`golden_cases`."""

from __future__ import annotations

import json

import pytest

from golden_cases import DEMO, GOLDEN, TINY, load_model, replay

CASES = json.loads(GOLDEN.read_text())
_MODELS: dict = {}


def loaded(name: str):
    if name not in _MODELS:
        _MODELS[name] = load_model(name)
    return _MODELS[name]


def _params(models):
    return [pytest.param(key, id=key) for key, case in CASES.items() if case["model"] in models]


def check(key: str) -> None:
    case = CASES[key]
    rows = replay(case, loaded(case["model"]))
    assert len(rows) == len(case["rows"])
    for index, (got, want) in enumerate(zip(rows, case["rows"])):
        for field in ("tokens", "evicted", "evicted_total", "peak_stored", "stored"):
            assert got[field] == want[field], f"{key} row {index}: {field} differs"


@pytest.mark.parametrize("key", _params(TINY))
def test_tiny_models_match_the_recording(key):
    check(key)


@pytest.mark.slow
@pytest.mark.parametrize("key", _params((DEMO,)))
def test_demo_model_matches_the_recording(key):
    check(key)


def test_the_recording_covers_every_case_and_evicts():
    """Every registered policy, the documented variants, both batch sizes and all three models are recorded,
    and every evicting policy evicted in some row of each model's batch."""
    from golden_cases import all_cases, case_id

    assert set(CASES) == {case_id(*case) for case in all_cases()}
    for key, case in CASES.items():
        if case["spec"] != "full" and case["batch"] == 4:
            assert any(row["evicted_total"] for row in case["rows"]), key
