"""Every policy gives today exactly what it gave before the restructure (issue 36): token ids, evicted positions
per step and the cache's counts, alone and in a batch of four, on two tiny random models and the demo model.

The outputs were recorded at commit 5def55e by ``python tests/golden_cases.py --write``; see
:mod:`golden_cases`."""

from __future__ import annotations

import json

import pytest

from epikv_cli.policies.registry import POLICIES, parse_policy_spec

from golden_cases import DEMO, GOLDEN, TINY, load_model, replay

#: Every recorded case whose policy is registered (a policy removed from the registry takes its cases with it).
CASES = {key: case for key, case in json.loads(GOLDEN.read_text()).items() if case["spec"].split(":")[0] in POLICIES}
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


def test_the_recording_covers_every_policy_and_evicts():
    """Every registered policy is recorded, alone and in a batch, on all three models, and every evicting policy
    evicted in some row of each model's batch."""
    recorded = {(case["model"], parse_policy_spec(case["spec"])[0], case["batch"]) for case in CASES.values()}
    assert recorded == {(model, name, batch) for model in (*TINY, DEMO) for name in POLICIES for batch in (1, 4)}
    for key, case in CASES.items():
        if case["spec"] != "full" and case["batch"] == 4:
            assert any(row["evicted_total"] for row in case["rows"]), key
