"""With a budget no smaller than prompt + generated, nothing is evicted and the result is transformers'."""

from __future__ import annotations

import pytest
import torch

import epikv_cli
from epikv_cli.config import CacheSettings, SamplingSettings
from epikv_cli.runtime.generation import Generation

from conftest import ARCHITECTURES, tiny_model

PROMPT_LEN = 12
NEW = 24


def reference(model, ids):
    out = model.generate(
        ids,
        max_new_tokens=NEW,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out.sequences[0, ids.shape[1] :], torch.stack([row[0] for row in out.logits])


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("policy", ["epikv", "lagkv"])
def test_engine_matches_generate_when_nothing_is_evicted(arch, policy, tokenizer):
    model = tiny_model(arch)
    ids = torch.randint(0, 256, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    tokens, logits = reference(model, ids)

    budget = PROMPT_LEN + NEW + 128  # room for the recent window too
    run = Generation(
        model,
        tokenizer,
        ids,
        CacheSettings(budget=budget, policy=policy),
        SamplingSettings(max_new_tokens=NEW, ignore_eos=True),
        keep_logits=True,
    )
    events = list(run)
    assert [e.token_id for e in events] == tokens.tolist()
    ours = torch.stack([e.logits for e in events])
    assert torch.allclose(ours, logits, atol=1e-5, rtol=0), (ours - logits).abs().max()
    assert run.result.evicted == 0
    assert run.result.peak_stored == PROMPT_LEN + NEW - 1  # the last token is never fed back


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_attach_matches_generate_when_nothing_is_evicted(arch):
    model = tiny_model(arch)
    ids = torch.randint(0, 256, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(2))
    tokens, logits = reference(model, ids)
    with epikv_cli.attach(model, budget=4096, policy="epikv") as cache:
        out = model.generate(
            ids,
            cache=cache,
            max_new_tokens=NEW,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=None,
            pad_token_id=0,
        )
    assert out.sequences[0, PROMPT_LEN:].tolist() == tokens.tolist()
    assert torch.allclose(torch.stack([row[0] for row in out.logits]), logits, atol=1e-5, rtol=0)
    assert cache.evicted_total == 0


def test_gemma3_sliding_layers_are_left_alone():
    model = tiny_model("gemma3")
    ids = torch.randint(0, 256, (1, PROMPT_LEN))
    with epikv_cli.attach(model, budget=PROMPT_LEN + 20, recent=4, policy="epikv") as cache:
        model.generate(ids, cache=cache, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds == ["DynamicSlidingWindowLayer"] * 5 + ["BudgetLayer"]
    assert cache.evicted_total > 0
    assert cache.stored == PROMPT_LEN + 20
    assert cache.layers[5].length == PROMPT_LEN + 21  # K live entries and the slot the next token takes
    # the sliding layers still count every token seen
    assert all(layer.get_seq_length() == cache.seen for layer in cache.layers)
