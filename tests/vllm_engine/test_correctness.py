"""The vLLM engine against stock vLLM and against the transformers engine (demo model, fp32, greedy)."""

from __future__ import annotations

import pytest
import torch
from harness import TransformersReference, greedy, token_prompts

from epikv_cli.config import CacheSettings, SamplingSettings
from epikv_cli.runtime.batchgen import Request
from epikv_cli.vllm.engine import ring_of
from epikv_cli.vllm.generation import GenerationInterrupted, VllmGeneration, sampling_params

#: The issue's check under eviction: K = 200, 160 new tokens, the first 8 GSM8K questions.
BUDGET, NEW = 200, 160
#: A first differing token is accepted only where the transformers engine's top-2 logits were this close.
NEAR_TIE = 1e-3
#: Without eviction: K above every length, the first 4 prompts, 48 tokens.
FREE, FREE_NEW = 1024, 48
#: The transformers engine's runs, in the order the tests below read them.
JOBS = {
    "free": ("epikv2", FREE, FREE_NEW, 4),
    "streaming": ("streaming", BUDGET, NEW, 8),
    "epikv2": ("epikv2", BUDGET, NEW, 8),
}


@pytest.fixture(scope="module")
def reference(demo, gsm8k_chats):
    """The transformers engine's records of every job in :data:`JOBS`, computed in the background on the core vLLM's
    engine leaves free while the tests below run vLLM: ``reference(name)`` waits for one."""
    names = list(JOBS)
    jobs = [
        {"policy": policy, "budget": budget, "new": new, "prompts": gsm8k_chats[:count]}
        for policy, budget, new, count in JOBS.values()
    ]
    runs = TransformersReference(demo, jobs)
    yield lambda name: runs.result(names.index(name))
    runs.close()


def generated(llm, prompts: list[list[int]], new: int) -> list[list[int]]:
    """``llm``'s greedy tokens for each prompt, all in one batch."""
    return [list(out.outputs[0].token_ids) for out in llm.generate(token_prompts(prompts), greedy(new), use_tqdm=False)]


def test_without_eviction_the_plugin_changes_nothing(engines, reference, gsm8k_chats):
    """K above every sequence's length: the plugin's greedy tokens are stock vLLM's and the transformers engine's."""
    prompts = gsm8k_chats[:4]
    stock = generated(engines.get("full", None), prompts, FREE_NEW)
    llm = engines.get("epikv2", FREE)
    ours = generated(llm, prompts, FREE_NEW)
    assert [request.evicted_total for request in ring_of(llm).admitted[-len(prompts) :]] == [0] * len(prompts)
    assert ours == stock
    assert ours == [record["tokens"] for record in reference("free")]


def test_a_batch_is_each_prompt_alone(engines, gsm8k_chats):
    """8 prompts of different lengths decoded together, each with its own per-head keep-sets: the same tokens and the
    same evictions (how many each (layer, KV head) dropped, and the positions none holds any more, step by step) as
    each prompt alone."""
    budget, prompts, new = 150, gsm8k_chats, 64
    llm = engines.get("epikv2", budget)
    together = generated(llm, prompts, new)
    batch = ring_of(llm).admitted[-len(prompts) :]
    alone, singles = [], []
    for ids in prompts:
        alone += generated(llm, [ids], new)
        singles.append(ring_of(llm).admitted[-1])
    assert len({len(ids) for ids in prompts}) == len(prompts)
    assert together == alone
    assert [request.trace for request in batch] == [request.trace for request in singles]
    counts = [request.evicted_total for request in batch]
    assert counts == [request.evicted_total for request in singles]
    # a prompt evicts when it and the 63 tokens before the last one exceed K = 150: some do, some do not
    assert [count > 0 for count in counts] == [len(ids) + new - 1 > budget for ids in prompts]


@pytest.mark.parametrize("policy", ["streaming", "epikv2"])
def test_under_eviction_the_tokens_and_evictions_are_the_transformers_engines(engines, reference, gsm8k_chats, policy):
    """K = 200, 160 tokens, 8 GSM8K prompts: at least 6 of 8 identical; where one differs, the first differing token
    was a near-tie for the transformers engine (top-2 logit gap below 1e-3), and every step before it and that step
    evicted the same positions on both engines."""
    llm = engines.get(policy, BUDGET)
    ours = generated(llm, gsm8k_chats, NEW)
    traces = [request.trace for request in ring_of(llm).admitted[-len(gsm8k_chats) :]]
    records = reference(policy)
    assert sum(len(step) for record in records for step in record["evicted"]) > 0  # eviction did happen
    same = 0
    for tokens, trace, record in zip(ours, traces, records):
        differ = next((step for step, (a, b) in enumerate(zip(tokens, record["tokens"])) if a != b), None)
        if differ is None:
            same += 1
            assert trace == record["evicted"]
            continue
        assert record["gaps"][differ] < NEAR_TIE, f"step {differ}: top-2 gap {record['gaps'][differ]}"
        assert trace[: differ + 1] == record["evicted"][: differ + 1]
    assert same >= 6


def test_ctrl_c_keeps_what_each_request_had_generated(engines, gsm8k_chats):
    """Ctrl-C while two requests decode: each one's tokens and text so far come back, as the text shown had them,
    with ``stop_reason`` ``interrupted``, and both leave the engine."""
    llm = engines.get("epikv2", BUDGET)
    cache = CacheSettings(budget=BUDGET, policy="epikv2")
    sampling = SamplingSettings(max_new_tokens=NEW, ignore_eos=True)
    requests = [Request(key, torch.tensor([ids]), cache, sampling) for key, ids in enumerate(gsm8k_chats[:2])]
    shown: dict[int, str] = {0: "", 1: ""}

    def on_text(key: int, text: str) -> None:
        shown[key] += text
        if len(shown[0]) + len(shown[1]) > 150:
            raise KeyboardInterrupt

    with pytest.raises(GenerationInterrupted) as stop:
        list(VllmGeneration(llm, requests, cache, set(), on_text))
    results = stop.value.results
    assert sorted(results) == [0, 1]
    for key, result in results.items():
        assert result.stop_reason == "interrupted"
        assert result.text == shown[key] != ""
        assert 0 < result.generated_tokens == len(result.token_ids) < NEW
    assert not llm.llm_engine.has_unfinished_requests()


def test_sampling_without_a_seed_draws_one_and_keeps_stop_strings():
    """As on the transformers engine: a sampled request without --seed gets a fresh seed (vLLM's default, the
    engine's seed, would give the same text at every run), a seeded one keeps its own, greedy needs none; stop
    strings stay in the text."""
    drawn = [sampling_params(SamplingSettings(temperature=0.7), set()).seed for _ in range(2)]
    assert None not in drawn and drawn[0] != drawn[1]
    assert sampling_params(SamplingSettings(temperature=0.7, seed=5), set()).seed == 5
    assert sampling_params(SamplingSettings(), set()).seed is None
    assert sampling_params(SamplingSettings(stop=("math",)), set()).include_stop_str_in_output
