"""Exactness after eviction, for every policy: each step's logits equal one full-sequence forward whose
attention mask hides, for the query at position p, exactly the positions evicted before p was fed."""

from __future__ import annotations

import pytest
import torch

from epikv_cli.config import CacheSettings, SamplingSettings
from epikv_cli.policies.registry import POLICIES, parse_policy_spec
from epikv_cli.runtime.generation import Generation

from conftest import tiny_model

NEW = 60


def masked_reference(model, tokens: list[int], prompt_len: int, evicted_by_step: list[list[int]]) -> torch.Tensor:
    """``[len(evicted_by_step), vocab]``: logits of one forward over ``tokens`` with the eviction mask.

    Step i's logits come from the forward that fed position ``prompt_len - 1 + i`` (the prefill for
    i = 0). The query at position p = prompt_len + k sees every j <= p except the positions evicted
    by steps 0..k; prompt queries see the whole causal prefix.
    """
    total = len(tokens)
    visible = torch.tril(torch.ones(total, total, dtype=torch.bool))
    hidden: set[int] = set()
    for k, evicted in enumerate(evicted_by_step):
        hidden.update(evicted)
        p = prompt_len + k
        if p < total and hidden:
            visible[p, sorted(hidden)] = False
    mask = torch.zeros(1, 1, total, total).masked_fill(~visible, float("-inf"))
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([tokens]),
            attention_mask=mask,
            position_ids=torch.arange(total).unsqueeze(0),
            use_cache=False,
        )
    return out.logits[0, prompt_len - 1 : prompt_len - 1 + len(evicted_by_step)]


EVICTING = sorted(name for name, cls in POLICIES.items() if cls.evicts)  # `full` is pinned by test_equivalence
#: policies whose options pick another rule, not just another setting
VARIANTS = ["lagkv:chunks=positions"]


def budget_for(policy: str, prompt_len: int) -> int:
    if POLICIES[policy].protects_prompt:
        return prompt_len + 24  # the default recent window (6) plus room to evict
    return 20  # below the prompt: these policies evict prompt tokens at the prefill


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("spec", EVICTING + VARIANTS)
def test_logits_equal_a_masked_full_forward(arch, spec, tokenizer):
    model = tiny_model(arch, seed=5)
    prompt_len = 30
    ids = torch.randint(0, 256, (1, prompt_len), generator=torch.Generator().manual_seed(11))
    # epikv2: a small recent window, so that its scores decide most evictions, and one keep-set for every
    # layer, which this reference masks (the per-head default is pinned by tests/test_keepsets.py)
    policy, options = parse_policy_spec(spec)
    small_recent = (("recent", "0.25"), ("keep", "global")) if policy == "epikv2" else ()
    settings = CacheSettings(budget=budget_for(policy, prompt_len), policy=policy, options=small_recent + options)
    new_tokens = NEW + POLICIES[policy].slack  # R-KV compresses only after K + 128 entries
    run = Generation(
        model, tokenizer, ids, settings, SamplingSettings(max_new_tokens=new_tokens, ignore_eos=True), keep_logits=True
    )
    events = list(run)
    evicted = [event.evicted for event in events]
    assert sum(map(len, evicted)) > 20  # eviction really happened
    tokens = ids[0].tolist() + [event.token_id for event in events][:-1]  # the last token is never fed back
    reference = masked_reference(model, tokens, prompt_len, evicted)
    ours = torch.stack([event.logits for event in events])
    assert torch.allclose(ours, reference, atol=1e-4, rtol=0), (ours - reference).abs().max()
