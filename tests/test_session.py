"""The Python API: `attach` puts EpiKV on a model so that plain `model.generate` runs under the budget."""

from __future__ import annotations

import pytest
import torch

import epikv_cli
from epikv_cli.errors import UsageError
from epikv_cli.policies.registry import POLICIES

from conftest import tiny_model

MODEL = tiny_model("qwen3", seed=4)
IDS = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(9))
GEN = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


def test_generate_under_a_budget():
    with epikv_cli.attach(MODEL, budget=40, recent=8, policy="epikv") as cache:
        out = MODEL.generate(IDS, cache=cache, max_new_tokens=100, **GEN)
        assert out.shape[1] == 110
        assert cache.stored == 40 and cache.peak_stored == 41
        assert cache.evicted_total == 109 - 40
        live = set(cache.live_positions().tolist())
        assert set(range(10)) <= live and set(range(109 - 8, 109)) <= live
        assert epikv_cli.policy_of(cache).score_of(50) is not None


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_past_key_values_alias_gives_the_same_tokens():
    outputs = []
    for key in ("cache", "past_key_values"):
        with epikv_cli.attach(MODEL, budget=40, recent=8, policy="epikv") as cache:
            outputs.append(MODEL.generate(IDS, max_new_tokens=60, **{key: cache}, **GEN))
    assert torch.equal(*outputs)


def test_hooks_are_removed_on_exit():
    before = (len(MODEL._forward_hooks), sum(len(m._forward_hooks) for m in MODEL.modules()))
    with epikv_cli.attach(MODEL, budget=64, policy="epikv"):
        assert len(MODEL._forward_hooks) == before[0] + 1
    assert (len(MODEL._forward_hooks), sum(len(m._forward_hooks) for m in MODEL.modules())) == before


def test_the_refresh_buffers_live_while_the_session_does():
    """epikv2 keeps its refresh's logits, weights and gathered keys between refreshes, and the session frees them on
    exit (a later run, e.g. another policy's in `epikv profile`, must not carry them in its memory figures)."""
    from epikv_cli.policies.epikv2 import REFRESH_SCRATCH

    REFRESH_SCRATCH.clear()
    with epikv_cli.attach(MODEL, budget=40, policy="epikv2") as cache:
        MODEL.generate(IDS, cache=cache, max_new_tokens=40, **GEN)
        held = REFRESH_SCRATCH.nbytes()
    config = MODEL.config
    # the largest refresh: every layer's query heads x 16 queries over the most keys stored, K + 1 = 41
    largest = config.num_hidden_layers * config.num_attention_heads * 16 * 41
    head_dim = config.hidden_size // config.num_attention_heads
    keys = config.num_hidden_layers * config.num_key_value_heads * 41 * head_dim  # every layer's keys, one block
    assert held == (largest * 2 + keys) * 4  # float32 logits and weights, and the keys
    assert REFRESH_SCRATCH.nbytes() == 0


def test_closing_one_session_keeps_the_refresh_buffers_of_another_still_open():
    from epikv_cli.policies.epikv2 import REFRESH_SCRATCH

    REFRESH_SCRATCH.clear()
    with epikv_cli.attach(MODEL, budget=40, policy="epikv2") as cache:
        MODEL.generate(IDS, cache=cache, max_new_tokens=40, **GEN)
        held = REFRESH_SCRATCH.nbytes()
        with epikv_cli.attach(MODEL, budget=40, policy="streaming"):
            pass
        assert REFRESH_SCRATCH.nbytes() == held
    assert REFRESH_SCRATCH.nbytes() == 0


def test_compressed_positions_through_generate():
    seen = []
    with epikv_cli.attach(MODEL, budget=30, recent=4, positions="compressed", policy="epikv") as cache:
        # registered after attach's own pre-hook, so it sees the rewritten positions
        spy = MODEL.register_forward_pre_hook(
            lambda m, a, kw: seen.append(kw["position_ids"][0].tolist()), with_kwargs=True
        )
        try:
            MODEL.generate(IDS, cache=cache, max_new_tokens=40, **GEN)
        finally:
            spy.remove()
    assert seen[0] == list(range(10))
    assert [step[0] for step in seen[1:]] == [min(10 + i, 30) for i in range(39)]


def test_prompt_longer_than_the_budget_is_refused():
    with epikv_cli.attach(MODEL, budget=12, policy="epikv") as cache:
        with pytest.raises(UsageError, match="--budget 12 is too small for epikv"):
            MODEL.generate(IDS, cache=cache, max_new_tokens=5, **GEN)


def test_beam_search_and_no_cache_are_refused_by_name():
    with epikv_cli.attach(MODEL, budget=64, policy="epikv") as cache:
        with pytest.raises(UsageError, match="does no beam search; use num_beams=1, not 2"):
            MODEL.generate(IDS, cache=cache, max_new_tokens=5, num_beams=2, **GEN)
        with pytest.raises(UsageError, match="drop use_cache=False"):
            MODEL.generate(IDS, cache=cache, max_new_tokens=5, use_cache=False, **GEN)


# the last: one more than the 21 tokens cached, the length of a continuation (generate's output passed back)
@pytest.mark.parametrize("second_length", [IDS.shape[1] - 3, IDS.shape[1], IDS.shape[1] + 4, IDS.shape[1] + 12])
def test_a_second_generate_on_a_used_cache_is_refused_until_reset(second_length):
    """generate would feed a used cache only the tail of the next prompt (or nothing): refuse it by name;
    after reset() the cache serves the next call exactly as a fresh one does."""
    second = torch.arange(3, 3 + second_length).unsqueeze(0)
    with epikv_cli.attach(MODEL, budget=16, policy="streaming") as fresh:
        expected = MODEL.generate(second, cache=fresh, max_new_tokens=12, **GEN)
    with epikv_cli.attach(MODEL, budget=16, policy="streaming") as cache:
        MODEL.generate(IDS, cache=cache, max_new_tokens=12, **GEN)
        with pytest.raises(UsageError, match="still holds the sequence of an earlier generate call"):
            MODEL.generate(second, cache=cache, max_new_tokens=12, **GEN)
        cache.reset()
        assert torch.equal(MODEL.generate(second, cache=cache, max_new_tokens=12, **GEN), expected)
    assert "generate" not in MODEL.__dict__  # detaching restores the model's own generate


def test_passing_the_output_back_continues_the_same_sequence():
    """generate(out, cache=cache) after generate(IDS, cache=cache) is a continuation (generate feeds only the
    token sampled last): it runs, and equals one call of the combined length."""
    with epikv_cli.attach(MODEL, budget=16, policy="streaming") as cache:
        whole = MODEL.generate(IDS, cache=cache, max_new_tokens=24, **GEN)
    with epikv_cli.attach(MODEL, budget=16, policy="streaming") as cache:
        first = MODEL.generate(IDS, cache=cache, max_new_tokens=12, **GEN)
        assert torch.equal(MODEL.generate(first, cache=cache, max_new_tokens=12, **GEN), whole)


def test_chunked_prefill_is_refused():
    with epikv_cli.attach(MODEL, budget=64, policy="epikv") as cache:
        with pytest.raises(UsageError, match="whole prompt in the first forward"):
            MODEL.generate(IDS, cache=cache, max_new_tokens=5, prefill_chunk_size=4, **GEN)


def test_models_with_only_sliding_layers_are_refused():
    mistral = tiny_model("mistral", sliding_window=64)
    with pytest.raises(UsageError, match="sliding-window attention .window 64.*--policy full"):
        with epikv_cli.attach(mistral, budget=32, policy="epikv"):
            pass
    with epikv_cli.attach(mistral, budget=None, policy="full") as cache:
        mistral.generate(IDS, cache=cache, max_new_tokens=5, **GEN)


@pytest.mark.parametrize("window", [64, 8])
def test_full_on_a_sliding_only_model_reports_what_its_layers_hold(window):
    """No layer evicts, so the figures come from the sliding layers themselves: compared with what
    transformers' own DynamicCache holds after the same generate."""
    from transformers import DynamicCache

    mistral = tiny_model("mistral", sliding_window=window)
    reference = DynamicCache(config=mistral.config)
    mistral.generate(IDS, cache=reference, max_new_tokens=20, **GEN)
    held = reference.layers[0].keys.shape[-2]
    with epikv_cli.attach(mistral, budget=None, policy="full") as cache:
        mistral.generate(IDS, cache=cache, max_new_tokens=20, **GEN)
    assert cache.seen == IDS.shape[1] + 19  # the last token is sampled, not fed back
    assert cache.stored == held and cache.peak_stored == held
    assert held == cache.seen if window > cache.seen else held < cache.seen  # the window bounds it
    assert cache.live_positions().tolist() == list(range(cache.seen - held, cache.seen))


@pytest.mark.parametrize("policy", sorted(name for name, cls in POLICIES.items() if cls.evicts))
def test_every_evicting_policy_runs_under_plain_generate(policy):
    kernel = MODEL.config._attn_implementation
    with epikv_cli.attach(MODEL, budget=24, policy=policy) as cache:
        out = MODEL.generate(IDS, cache=cache, max_new_tokens=200, **GEN)
    assert out.shape[1] == 210
    assert cache.evicted_total >= 209 - 24 - epikv_cli.policy_of(cache).slack
    assert cache.peak_stored == 24 + max(
        1, epikv_cli.policy_of(cache).slack
    )  # K + 1 in a step; R-KV compresses at K + 128
    assert MODEL.config._attn_implementation == kernel  # the tapped kernel is gone with the session


def test_sessions_sharing_a_model_in_lockstep_match_each_run_alone(tokenizer):
    """Two generations stepped alternately on one model (as fidelity replays do) see only their own forwards."""
    from epikv_cli.config import CacheSettings, SamplingSettings
    from epikv_cli.runtime.generation import Generation

    def make(policy):
        return Generation(
            MODEL,
            tokenizer,
            IDS,
            CacheSettings(budget=24, policy=policy),
            SamplingSettings(max_new_tokens=60, ignore_eos=True),
        )

    alone = {policy: [(e.token_id, e.evicted) for e in make(policy)] for policy in ("h2o", "epikv", "tova")}
    runs = {policy: iter(make(policy)) for policy in alone}
    together = {policy: [] for policy in alone}
    for _ in range(60):
        for policy, run in runs.items():
            event = next(run)
            together[policy].append((event.token_id, event.evicted))
    assert together == alone
    assert all(next(run, None) is None for run in runs.values())  # each ends, and its session closes
    assert MODEL.config._attn_implementation == "sdpa" and not hasattr(MODEL, "_epikv_tap_users")


def test_a_reset_cache_starts_a_new_sequence_afresh():
    other = torch.randint(0, 256, (1, 14), generator=torch.Generator().manual_seed(21))
    with epikv_cli.attach(MODEL, budget=30, policy="epikv") as fresh:
        expected = MODEL.generate(other, cache=fresh, max_new_tokens=50, **GEN)
        expected_evicted = fresh.evicted_total
    with epikv_cli.attach(MODEL, budget=30, policy="epikv") as cache:
        MODEL.generate(IDS, cache=cache, max_new_tokens=70, **GEN)
        first_policy = epikv_cli.policy_of(cache)
        cache.reset()
        assert (cache.stored, cache.seen, cache.evicted_total, cache.peak_stored) == (0, 0, 0, 0)
        again = MODEL.generate(other, cache=cache, max_new_tokens=50, **GEN)
        assert torch.equal(again, expected) and cache.evicted_total == expected_evicted
        assert epikv_cli.policy_of(cache) is not first_policy  # the cache holds no policy: its session made a new one


@pytest.mark.parametrize("policy", ["streaming", "epikv2"])
def test_the_peak_of_a_prompt_longer_than_the_budget_is_the_prompt(policy):
    """docs/cli.md's definition: K + 1 in the decoding steps, but the prefill holds a prompt longer than K whole before
    it evicts down to K."""
    prompt = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(3))
    with epikv_cli.attach(MODEL, budget=24, policy=policy) as cache:
        MODEL.generate(prompt, cache=cache, max_new_tokens=8, **GEN)
        assert cache.peak_stored == 60 and cache.stored == 24
    with epikv_cli.attach(MODEL, budget=24, policy=policy) as cache:
        MODEL.generate(prompt[:, :20], cache=cache, max_new_tokens=8, **GEN)
        assert cache.peak_stored == 25
