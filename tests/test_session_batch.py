"""`attach(batch_size=B)`: a left-padded batch through plain `model.generate` gives each row what it
gets alone, under every policy, on three architectures (Gemma 3's sliding layers included)."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

import epikv_cli
from epikv_cli.errors import UsageError
from epikv_cli.policies.registry import POLICIES

from conftest import tiny_model

STEPS = 150  # R-KV compresses once at budget 20 (it waits for K + 128 entries)
LENGTHS = (9, 20, 5, 31)
GEN = dict(do_sample=False, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True, output_logits=True)


class StepBias(LogitsProcessor):
    """A fixed random bias per decoding step, the same alone and in the batch: left alone a tiny random
    model repeats one token, and frozen scores then tie exactly (see tests/test_batched.py)."""

    def __init__(self) -> None:
        self.bias = torch.randn(STEPS, 272, generator=torch.Generator().manual_seed(0)) * 2
        self.step = 0

    def __call__(self, input_ids, scores):
        scores = scores + self.bias[self.step]
        self.step += 1
        return scores


def budget_for(policy: str) -> int | None:
    if policy == "full":
        return None
    return max(LENGTHS) + 24 if POLICIES[policy].protects_prompt else 20


def generate(model, ids, mask, cache):
    out = model.generate(
        ids,
        attention_mask=mask,
        cache=cache,
        max_new_tokens=STEPS,
        logits_processor=LogitsProcessorList([StepBias()]),
        **GEN,
    )
    return out.sequences[:, ids.shape[1] :], torch.stack(out.logits, dim=1)  # [B, T], [B, T, vocab]


def left_padded(prompts):
    width = max(p.numel() for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.numel() :] = prompt
        mask[row, width - prompt.numel() :] = 1
    return ids, mask


# Every policy on Llama; on Qwen 3 and Gemma 3 one of each kind of signal (hidden states, attention
# weights, stored queries, none). tests/test_batched.py runs every policy on all three.
CASES = [("llama", policy) for policy in sorted(POLICIES)] + [
    (arch, policy) for arch in ("qwen3", "gemma3") for policy in ("epikv", "h2o", "epikv2", "streaming")
]


@pytest.mark.parametrize("arch, policy", CASES)
def test_a_padded_batch_through_generate_equals_each_prompt_alone(arch, policy):
    model = tiny_model(arch, seed=3)
    prompts = [torch.randint(1, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in LENGTHS]
    budget = budget_for(policy)
    expected = []
    for prompt in prompts:
        with epikv_cli.attach(model, budget=budget, policy=policy) as cache:
            tokens, logits = generate(model, prompt[None], torch.ones(1, prompt.numel(), dtype=torch.long), cache)
            expected.append((tokens[0], logits[0], cache.evicted_total))
    ids, mask = left_padded(prompts)
    with epikv_cli.attach(model, budget=budget, policy=policy, batch_size=len(prompts)) as cache:
        tokens, logits = generate(model, ids, mask, cache)
        rows = [cache.row(b) for b in range(len(prompts))]
        for row, (want_tokens, want_logits, want_evicted) in enumerate(expected):
            assert torch.equal(tokens[row], want_tokens), (policy, row)
            assert torch.allclose(logits[row], want_logits, atol=1e-4, rtol=0), (logits[row] - want_logits).abs().max()
            assert rows[row].evicted_total == want_evicted
            if budget is not None:
                assert rows[row].stored <= budget + POLICIES[policy].slack
    assert (min(r.evicted_total for r in rows) > 0) == POLICIES[policy].evicts


def test_right_padding_and_a_wrong_batch_size_are_refused():
    model = tiny_model("llama", seed=3)
    ids = torch.randint(1, 256, (2, 8))
    right = torch.ones(2, 8, dtype=torch.long)
    right[0, 6:] = 0
    with epikv_cli.attach(model, budget=16, policy="streaming", batch_size=2) as cache:
        with pytest.raises(UsageError, match="padded on the left"):
            model.generate(ids, attention_mask=right, cache=cache, max_new_tokens=3, **GEN)
    with epikv_cli.attach(model, budget=16, policy="streaming", batch_size=3) as cache:
        with pytest.raises(UsageError, match="batch_size=3, but the batch holds 2"):
            model.generate(ids, cache=cache, max_new_tokens=3, **GEN)
    with epikv_cli.attach(model, budget=16, policy="streaming") as cache:
        with pytest.raises(UsageError, match="attach with batch_size=N"):
            model.generate(ids, cache=cache, max_new_tokens=3, **GEN)


@pytest.mark.parametrize("policy", ["streaming", "epikv2"])
def test_a_batch_cache_refuses_a_second_generate_and_serves_it_after_reset(policy):
    """A second call on a used batch cache used to continue the old rows with generate's one-token tail of
    the new prompts (wrong tokens, no error); after reset() the rows start afresh."""
    model = tiny_model("llama", seed=3)
    ids, mask = left_padded([torch.arange(3, 3 + n) for n in (12, 7, 15)])
    with epikv_cli.attach(model, budget=22, policy=policy, batch_size=3) as fresh:
        expected = generate(model, ids, mask, fresh)
    with epikv_cli.attach(model, budget=22, policy=policy, batch_size=3) as cache:
        generate(model, ids, mask, cache)
        with pytest.raises(UsageError, match="still holds the sequence of an earlier generate call"):
            generate(model, ids, mask, cache)
        cache.reset()
        again = generate(model, ids, mask, cache)
    assert torch.equal(again[0], expected[0]) and torch.equal(again[1], expected[1])


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_padded_batch_under_granular_epikv2_equals_each_prompt_alone(arch):
    """The batched prefill hands each row its own per (layer, KV head) keep-sets."""
    model = tiny_model(arch, seed=3, initializer_range=0.15)
    prompts = [torch.randint(1, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in LENGTHS]
    options = {"keep": "head", "adapt": 1, "recent": 0.25}
    expected = []
    for prompt in prompts:
        with epikv_cli.attach(model, budget=20, policy="epikv2", options=options) as cache:
            tokens, logits = generate(model, prompt[None], torch.ones(1, prompt.numel(), dtype=torch.long), cache)
            expected.append((tokens[0], logits[0], cache.evicted_total))
    ids, mask = left_padded(prompts)
    with epikv_cli.attach(model, budget=20, policy="epikv2", options=options, batch_size=len(prompts)) as cache:
        tokens, logits = generate(model, ids, mask, cache)
        for row, (want_tokens, want_logits, want_evicted) in enumerate(expected):
            assert torch.equal(tokens[row], want_tokens)
            assert torch.allclose(logits[row], want_logits, atol=1e-4, rtol=0), (logits[row] - want_logits).abs().max()
            assert cache.row(row).evicted_total == want_evicted > 0
            assert cache.row(row).head_slots.live(cache.row(row).stored).shape[-1] == 20
