"""Keep-sets per evicting layer and KV head (epikv_cli/keepsets.py) and the granular epikv2 that uses them:
the map's arithmetic by hand, exactness against a full forward masked per layer and head, budget
invariants, and the adaptive recent window."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from epikv_cli.config import CacheSettings, SamplingSettings
from epikv_cli.core.keepsets import HeadSlots, order_keys
from epikv_cli.errors import UsageError
from epikv_cli.policies import epikv2
from epikv_cli.policies.epikv2 import EpiKV2, received_by_head, received_by_layers
from epikv_cli.policies.registry import make_policy
from epikv_cli.policies.shortlist import gone_positions
from epikv_cli.runtime.generation import Generation
from epikv_cli.runtime.stream import CacheStream

from conftest import tiny_model


def slots_holding(rows: list[list[list[int]]]) -> HeadSlots:
    """A map whose (layer, head) slot s holds ``rows[layer][head][s]`` (all rows the same length)."""
    layers, heads, stored = len(rows), len(rows[0]), len(rows[0][0])
    slots = HeadSlots(layers, heads, "cpu")
    slots.append(0, stored, 0)
    slots.positions[:, :, :stored] = torch.tensor(rows)
    return slots


def test_lowest_is_per_head_and_breaks_ties_by_age():
    slots = slots_holding([[[5, 1, 3, 2], [0, 1, 2, 3]]])
    scores = torch.tensor([[[0.5, 0.1, 0.1, 0.9], [0.3, 0.3, 0.2, 0.3]]])
    candidates = torch.ones(1, 2, 4, dtype=torch.bool)
    # head 0: slots 1 and 2 tie at 0.1, slot 1 holds the older position (1 < 3); head 1: slot 2 is lowest
    assert slots.lowest(scores, candidates, 4, 1).tolist() == [[[1], [2]]]
    # two each: by score, then by age (head 1: 0.2 first, then the oldest of the three 0.3s, position 0)
    assert slots.lowest(scores, candidates, 4, 2).tolist() == [[[1, 2], [2, 0]]]
    candidates[0, 0, 1] = False  # not evictable: the next lowest of head 0 is slot 2
    assert slots.lowest(scores, candidates, 4, 1).tolist() == [[[2], [2]]]


def test_one_victim_per_head_is_replaced_by_that_heads_last_entry():
    slots = slots_holding([[[0, 1, 2, 3], [0, 1, 2, 3]], [[0, 1, 2, 3], [0, 1, 2, 3]]])
    scores = slots.companions[slots.companion()]
    scores[:, :, :4] = torch.arange(16, dtype=torch.float32).view(2, 2, 4)
    keys = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)  # one layer's [heads, slots, dim]
    moves = slots.plan(torch.tensor([[[1], [3]], [[0], [2]]]), 4)
    moves.apply(keys, 0)
    assert slots.live(3).tolist() == [[[0, 3, 2], [0, 1, 2]], [[3, 1, 2], [0, 1, 3]]]
    assert scores[:, :, :3].tolist() == [[[0, 3, 2], [4, 5, 6]], [[11, 9, 10], [12, 13, 15]]]
    expected = torch.arange(24, dtype=torch.float32).view(2, 4, 3)
    expected[0, 1] = expected[0, 3]  # head 0 of layer 0: slot 1 takes slot 3; head 1 dropped its last slot
    assert torch.equal(keys, expected)


def test_several_victims_are_gathered_in_slot_order():
    slots = slots_holding([[[10, 11, 12, 13, 14], [10, 11, 12, 13, 14]]])
    keys = torch.arange(10, dtype=torch.float32).view(2, 5, 1)
    moves = slots.plan(torch.tensor([[[0, 3], [4, 1]]]), 5)
    moves.apply(keys, 0)
    assert slots.live(3).tolist() == [[[11, 12, 14], [10, 12, 13]]]
    assert keys[:, :3, 0].tolist() == [[1, 2, 4], [5, 7, 8]]


def test_a_single_victim_per_head_leaves_its_slot_to_the_next_token():
    slots = slots_holding([[[0, 1, 2, 3], [0, 1, 2, 3]]])
    scores = slots.companions[slots.companion()]
    scores[:, :, :4] = 1.0
    slots.vacate(torch.tensor([[1, 3]]))
    assert slots.held(3).tolist() == [[[0, 3, 2], [0, 1, 2]]]  # what it holds, as if the vacancies were closed
    assert slots.append(4, 1, 4).tolist() == [[1, 3]]  # position 4 goes where each head's victim was
    assert slots.vacant is None
    assert slots.live(4).tolist() == [[[0, 4, 2, 3], [0, 1, 2, 4]]]
    assert scores[:, :, :4].tolist() == [[[1, 0, 1, 1], [1, 1, 1, 0]]]  # the newcomer starts unscored
    slots.vacate(torch.tensor([[0, 2]]))
    with pytest.raises(RuntimeError, match="close the vacant"):
        slots.append(4, 2, 5)
    keys = torch.arange(8, dtype=torch.float32).view(2, 4, 1)
    slots.close_vacant(3).apply(keys, 0)  # each head's last used slot (3) fills its vacancy
    assert slots.live(3).tolist() == [[[3, 4, 2], [0, 1, 4]]]
    assert keys[:, :3, 0].tolist() == [[3, 1, 2], [4, 5, 7]]
    assert slots.close_vacant(3) is None


def test_the_map_grows_to_its_limit_and_past_it_only_for_one_append_that_needs_more():
    """Doubling stops at the limit (a ring's K + 1 slots), for the positions and the policy's companions alike;
    without a limit it doubles."""
    slots = HeadSlots(2, 3, "cpu", limit=300)
    scores = slots.companion()
    slots.append(0, 256, 0)
    assert slots.capacity == 256
    slots.append(256, 1, 256)  # 257 slots: 300, not 512
    assert slots.positions.shape == slots.companions[scores].shape == (2, 3, 300)
    assert slots.live(257)[0, 0, 250:].tolist() == list(range(250, 257))
    slots.append(257, 48, 257)  # one append needing 305 slots gets them
    assert slots.capacity == 305 and slots.live(305)[1, 2, -1] == 304
    small = HeadSlots(1, 1, "cpu", limit=20)
    assert small.capacity == 20
    unbounded = HeadSlots(1, 1, "cpu")
    unbounded.append(0, 257, 0)
    assert unbounded.capacity == 512


def test_a_granular_cache_holds_its_map_in_as_many_slots_as_its_keys():
    """At K = 300 the key buffers hold K + 1 slots; the per-head map and epikv2's scores beside it hold as many."""
    ids = torch.randint(0, 256, (1, 290), generator=torch.Generator().manual_seed(1))
    with CacheStream(MODEL, CacheSettings(budget=300, policy="epikv2"), max_tokens=330) as stream:
        out = stream.feed(ids)
        for _ in range(30):
            out = stream.feed(out.argmax().view(1, 1))
        cache = stream.cache
        assert cache.evicted_total == 20
        assert cache.head_slots.capacity == cache.budget_layers[0].keys.shape[-2] == 301
        assert [tuple(c.shape[-1:]) for c in cache.head_slots.companions] == [(301,)]


def test_steady_state_steps_move_no_entry():
    """Once the cache is full, a step writes the new token's key into each head's victim slot and touches no
    other slot of the buffers."""
    settings_ = CacheSettings(budget=20, policy="epikv2", options=(("keep", "head"), ("recent", "0.25")))
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(2))
    with CacheStream(MODEL, settings_, max_tokens=60) as stream:
        out = stream.feed(ids)  # 30 tokens into 20: the prefill gathers what each head keeps
        out = stream.feed(out.argmax().view(1, 1))  # the first step leaves each head's victim slot vacant
        layer = stream.cache.budget_layers[0]
        changed_slots = []
        for _ in range(20):
            before, vacant = layer.keys[0].clone(), stream.cache.head_slots.vacant.clone()
            out = stream.feed(out.argmax().view(1, 1))
            changed = (layer.keys[0] != before).any(dim=-1)  # [kv_heads, slots]
            assert torch.equal(changed.nonzero()[:, 1].view(-1), vacant[0])  # one slot per head: its vacancy
            changed_slots.append(vacant[0].tolist())
    assert len({tuple(slots) for slots in changed_slots}) > 1


def test_a_token_is_gone_only_when_no_layer_or_head_holds_it():
    slots = slots_holding([[[0, 1, 2], [0, 1, 2]], [[0, 1, 2], [0, 1, 2]]])
    first, gone = slots.release(torch.tensor([[[1], [1]], [[1], [2]]]), 3)
    assert first.tolist() == [1, 1, 1, 2]
    assert gone_positions(first, gone) == []  # position 1 is still in layer 1 head 1
    second, gone = slots.release(torch.tensor([[[0], [0]], [[0], [1]]]), 3)
    assert gone_positions(second, gone) == [1]
    assert slots.holders[:3].tolist() == [1, 0, 3]


def test_received_by_head_by_hand():
    queries = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])  # 2 query heads, one query each, 1 KV head
    keys = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]])
    got = received_by_head(queries, keys, torch.tensor([5]), torch.tensor([[1, 2, 6]]), scaling=1.0)
    # the key at position 6 comes after the query: hidden; the two heads' softmaxes over the others mirror
    # each other ([e, 1] / (e + 1) and [1, e] / (e + 1)), so their mean is a half each
    assert torch.allclose(got, torch.tensor([[0.5, 0.5, 0.0]]))
    two = received_by_head(
        queries, keys.expand(2, 3, 2), torch.tensor([5]), torch.tensor([[1, 2, 3], [1, 2, 3]]), scaling=1.0
    )
    e = torch.softmax(torch.tensor([1.0, 0.0, 1.0]), 0)  # with 2 KV heads each query head reads its own
    assert torch.allclose(two, torch.stack([e, e[[1, 0, 2]]]))


def test_received_by_head_equals_a_dense_causal_softmax():
    """The causal mask is applied to each head's newest keys alone; against a softmax per query over every key,
    masked where the key is newer (queries at the newest positions, keys in shuffled slots, 3 query heads per KV
    head)."""
    generator = torch.Generator().manual_seed(0)
    for width, stored in ((1, 5), (4, 4), (16, 40), (8, 300)):
        seen = stored + 50
        queries = torch.randn(6, width, 8, generator=generator)
        keys = torch.randn(2, stored, 8, generator=generator)
        query_positions = torch.arange(seen - width, seen)
        # each KV head holds its own tokens: the newest `width` (the queries' own) and older ones, in any slot order
        key_positions = torch.stack(
            [
                torch.cat([torch.randperm(seen - width, generator=generator)[: stored - width], query_positions])[
                    torch.randperm(stored, generator=generator)
                ]
                for _ in range(2)
            ]
        )
        expected = torch.zeros(2, stored)
        for kv in range(2):
            for head in range(3 * kv, 3 * kv + 3):
                for i in range(width):
                    logits = keys[kv] @ queries[head, i] * 0.3
                    logits[key_positions[kv] > query_positions[i]] = -math.inf
                    expected[kv] += torch.softmax(logits, 0) / 3
        got = received_by_head(queries, keys, query_positions, key_positions, scaling=0.3)
        assert torch.allclose(got, expected, atol=1e-6), (width, stored)
        # a bfloat16 cache: the product in bfloat16 (as eager attention's), the softmax and the sums in float32
        low = received_by_head(queries.bfloat16(), keys.bfloat16(), query_positions, key_positions, scaling=0.3)
        assert low.dtype == torch.float32
        assert torch.allclose(low, expected, atol=1e-2), (width, stored)
        assert torch.allclose(
            low.sum(dim=-1), torch.full((2,), float(width)), atol=1e-4
        )  # each query's weights sum to 1


def test_granular_options_are_checked():
    for options in (
        (("keep", "rows"),),
        (("keep", "global"), ("adapt", "1")),
        (("credit", "mean"),),
        (("keep", "head"), ("signal", "epiphany")),
    ):
        with pytest.raises(UsageError, match="epikv2"):
            make_policy(CacheSettings(budget=64, policy="epikv2", options=options))
    assert make_policy(CacheSettings(budget=64, policy="epikv2")).keep == "head"  # the default
    # copy follows the keep rule: on by default where a head's window can stretch, refused where it cannot
    assert make_policy(CacheSettings(budget=64, policy="epikv2")).copy == 0.3
    for options in ((("keep", "global"),), (("adapt", "1"),), (("signal", "none"),)):
        assert make_policy(CacheSettings(budget=64, policy="epikv2", options=options)).copy == 0
        with pytest.raises(UsageError, match="option copy needs"):
            make_policy(CacheSettings(budget=64, policy="epikv2", options=(*options, ("copy", "0.3"))))
    assert not make_policy(
        CacheSettings(budget=64, policy="epikv2", options=(("keep", "global"), ("signal", "epiphany")))
    ).granular


def test_adaptive_window_moves_towards_what_is_attended():
    policy = EpiKV2(budget=64, keep="head", adapt=1)
    policy._recent_by_layer = torch.tensor([48, 48])
    seen = 100
    positions = torch.cat([torch.arange(4), torch.arange(40, 52), torch.arange(52, 100)]).expand(
        2, 1, 64
    )  # sinks, 12 heavy, 48 recent
    received = torch.zeros(2, 1, 64)
    received[0, 0, 4:16] = 1.0  # layer 0: the heavy hitters are attended
    received[1, 0, 16:28] = 1.0  # layer 1: the oldest recent tokens are
    received[1, 0, 5] = 1.0  # (position 41: a heavy hitter now, the oldest recent token once the window is 59)
    policy._adapt_recent(received, positions, 4, seen)
    assert policy._recent_by_layer.tolist() == [44, 52]  # K/16 = 4 each way
    policy._recent_by_layer = torch.tensor([33, 59])
    policy._adapt_recent(received, positions, 4, seen)
    assert policy._recent_by_layer.tolist() == [32, 60]  # bounded by K/2 and K - sinks


# -- the granular policy inside the model ------------------------------------------------------------------

MASKS: dict[int, torch.Tensor] = {}


def masked_per_head(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention that also hides, per KV head of the layers in MASKS, what that head evicted."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask[..., : key.shape[2]]
    visible = MASKS.get(module.layer_idx)
    if visible is not None:
        scores = scores.masked_fill(~visible.repeat_interleave(groups, 0)[None], -math.inf)
    weights = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


AttentionInterface.register("epikv_test_masked_per_head", masked_per_head)
AttentionMaskInterface.register("epikv_test_masked_per_head", ALL_MASK_ATTENTION_FUNCTIONS["eager"])


# grouped-query Llama and Qwen 2, and multi-query (one KV head: a layer's only set moves into itself)
SHAPES = {"llama": ("llama", {}), "qwen2": ("qwen2", {}), "llama-mqa": ("llama", {"num_key_value_heads": 1})}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize(
    "options",
    [
        (("keep", "head"),),
        (("keep", "layer"),),
        (("keep", "head"), ("adapt", "1")),
        (("copy", "0.3"), ("copyweight", "0")),
    ],
)
def test_granular_logits_equal_a_full_forward_masked_per_layer_and_head(shape, options):
    """Each step's logits equal one forward over the whole sequence in which every (layer, KV head) hides,
    from the query at position p, what it had evicted before p was fed."""
    arch, overrides = SHAPES[shape]
    model = tiny_model(arch, seed=5, initializer_range=0.15, **overrides)  # sharp enough that heads choose differently
    prompt_len, steps, budget = 30, 60, 20
    ids = torch.randint(0, 256, (1, prompt_len), generator=torch.Generator().manual_seed(11))
    settings_ = CacheSettings(budget=budget, policy="epikv2", options=(("recent", "0.25"), *options))
    held, logits, tokens = [], [], ids[0].tolist()
    with CacheStream(model, settings_, max_tokens=prompt_len + steps) as stream:
        out = stream.feed(ids)
        for step in range(steps):
            logits.append(out)
            held.append(stream.cache.head_slots.held(stream.cache.stored).clone())
            tokens.append(int(out.argmax()))
            if step < steps - 1:
                out = stream.feed(torch.tensor([[tokens[-1]]]))
        layers = stream.cache.budget_layer_indices
    final = [[sorted(keep.tolist()) for keep in layer] for layer in held[-1]]
    if ("keep", "layer") in options or len(final[0]) == 1:
        assert all(all(keep == layer[0] for keep in layer) for layer in final)  # one set per layer, shared by its heads
        assert final[0][0] != final[1][0]
    else:
        assert len({tuple(keep) for layer in final for keep in layer}) > 1  # the heads did keep different tokens
    assert all(keep.shape[-1] == budget for keep in held)
    total = prompt_len + steps - 1
    heads = held[0].shape[1]
    for j, layer in enumerate(layers):
        visible = torch.tril(torch.ones(heads, total, total, dtype=torch.bool))
        for k in range(steps - 1):  # the query at prompt_len + k sees what every head held after step k, and itself
            row = torch.zeros(heads, total, dtype=torch.bool)
            row.scatter_(1, held[k][j], True)
            row[:, prompt_len + k] = True
            visible[:, prompt_len + k] = row
        MASKS[layer] = visible
    base = model.config._attn_implementation
    model.set_attn_implementation("epikv_test_masked_per_head")
    try:
        with torch.no_grad():
            reference = model(input_ids=torch.tensor([tokens[:total]]), position_ids=torch.arange(total)[None]).logits[
                0, prompt_len - 1 :
            ]
    finally:
        model.set_attn_implementation(base)
        MASKS.clear()
    ours = torch.stack(logits)
    assert torch.allclose(ours, reference, atol=1e-4, rtol=0), (ours - reference).abs().max()


MODEL = tiny_model("qwen2", seed=7, initializer_range=0.15)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt_len=st.integers(1, 40),
    extra=st.integers(0, 30),
    new_tokens=st.integers(1, 120),
    adapt=st.sampled_from(["0", "1"]),
    keep=st.sampled_from(["head", "layer"]),
)
def test_granular_budget_invariants(prompt_len, extra, new_tokens, adapt, keep):
    """After every step each (layer, head) holds exactly min(seen, K) tokens, never loses a sink or its
    recent window, and the step names as evicted exactly the positions no (layer, head) holds any more."""
    options = (("keep", keep), ("adapt", adapt))
    budget = make_policy(CacheSettings(budget=64, policy="epikv2", options=options)).min_budget(0) + extra
    settings_ = CacheSettings(budget=budget, policy="epikv2", options=options)
    smallest_window = budget // 2 if adapt == "1" else int(round(0.75 * budget))
    ids = torch.randint(0, 256, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    gone: set[int] = set()
    with CacheStream(MODEL, settings_, max_tokens=prompt_len + new_tokens) as stream:
        out = stream.feed(ids)
        for step in range(new_tokens):
            evicted = set(stream.session.last.evicted)
            assert not evicted & gone, "a position was evicted twice"
            gone |= evicted
            cache = stream.cache
            held = [set(keep.tolist()) for keep in cache.head_slots.held(cache.stored).flatten(0, 1)]
            assert all(len(keep) == min(cache.seen, budget) for keep in held)
            protected = set(range(min(4, cache.seen))) | set(range(max(0, cache.seen - smallest_window), cache.seen))
            assert protected <= set.intersection(*held)
            assert gone == set(range(cache.seen)) - set.union(*held)
            out = stream.feed(out.argmax().view(1, 1))


def test_a_copying_head_evicts_nothing_inside_its_stretched_window():
    """copy=S: whenever a refresh finds a (layer, KV head) copying from beyond its window, that head evicts
    only tokens older than the stretched window until the next refresh (what it had evicted before the
    stretch stays evicted); the windows do stretch in this run (any consecutive step counts: copy=0.05 of
    15 pairs, no least weight), stay within K - sinks, and change what is evicted; so with ``loop``."""
    budget = 24
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(2))

    def run(options) -> tuple[list, int]:
        settings_ = CacheSettings(budget=budget, policy="epikv2", options=(("recent", "0.25"), *options))
        stretched, evictions = 0, []
        with CacheStream(MODEL, settings_, max_tokens=130) as stream:
            out = stream.feed(ids)
            before = stream.cache.head_slots.held(stream.cache.stored).clone()
            for _ in range(100):
                out = stream.feed(out.argmax().view(1, 1))
                policy, cache = stream.session.policy, stream.cache
                held = cache.head_slots.held(cache.stored).clone()
                window = policy._window[..., 0] if policy.copy else torch.full(held.shape[:2], policy.recent)
                stretched += int((window > policy.recent).sum())
                assert int(window.max()) <= budget - 4 and int(window.min()) >= policy.recent
                for layer in range(held.shape[0]):
                    for head in range(held.shape[1]):
                        lost = set(before[layer, head].tolist()) - set(held[layer, head].tolist())
                        assert all(p < cache.seen - int(window[layer, head]) for p in lost)
                        evictions.append(sorted(lost))
                before = held
        return evictions, stretched

    copying, stretched = run((("copy", "0.05"), ("copyweight", "0"), ("loop", "0")))
    plain, _ = run((("copy", "0"),))
    assert stretched > 0
    assert copying != plain
    # loop=G also follows repeats from G or more tokens back inside the window: other windows, other victims
    looping, stretched_looping = run((("copy", "0.05"), ("copyweight", "0"), ("loop", "3")))
    assert stretched_looping > 0
    assert looping != copying


@pytest.mark.parametrize("loop", [0, 5, 40])
def test_copy_looks_beyond_the_window_and_with_loop_inside_it_from_loop_back(monkeypatch, loop):
    """Each refresh asks where the queries look among the tokens past the sinks and older than the recent window,
    and, with 0 < loop < the window, also among the window's tokens from ``loop`` back: checked against the
    positions each head holds at that refresh."""
    asked = []
    real = epikv2.refresh_layers

    def recording(queries, keys, query_positions, key_positions, scaling, values=None, far=None):
        asked.append((int(query_positions[-1]) + 1, key_positions.clone(), None if far is None else far.clone()))
        return real(queries, keys, query_positions, key_positions, scaling, values, far)

    monkeypatch.setattr(epikv2, "refresh_layers", recording)
    settings_ = CacheSettings(budget=24, policy="epikv2", options=(("recent", "0.5"), ("loop", str(loop))))
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(7))
    with CacheStream(MODEL, settings_, max_tokens=80) as stream:
        out = stream.feed(ids)
        for _ in range(60):
            out = stream.feed(out.argmax().view(1, 1))
    assert len(asked) >= 4
    recent = 12
    for seen, positions, far in asked:
        beyond = (positions >= 4) & (positions < seen - recent)
        if 0 < loop < recent:
            inside = (positions >= 4) & (positions >= seen - recent) & (positions < seen - loop)
            assert torch.equal(far, torch.stack([beyond, inside]))
            assert inside.any()
        else:
            assert torch.equal(far, beyond)


def test_generation_reads_the_victims_with_the_token(tokenizer):
    """The engine (one host read per step, victims named with the sampled token) makes the same tokens and
    evictions as a stream that settles after each forward."""
    settings_ = CacheSettings(budget=24, policy="epikv2", options=(("keep", "head"), ("adapt", "1"), ("recent", "0.5")))
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(3))
    run = Generation(MODEL, tokenizer, ids, settings_, SamplingSettings(max_new_tokens=50, ignore_eos=True))
    events = list(run)
    tokens, evicted = [], []
    with CacheStream(MODEL, settings_, max_tokens=70) as stream:
        out = stream.feed(ids)
        for _ in range(50):
            evicted.append(stream.session.last.evicted)
            tokens.append(int(out.argmax()))
            out = stream.feed(torch.tensor([[tokens[-1]]]))
    assert [e.token_id for e in events] == tokens
    assert [e.evicted for e in events] == evicted
    assert sum(map(len, evicted)) > 10


@pytest.mark.parametrize(
    "options",
    [
        (("period", "4"),),
        (("period", "4"), ("adapt", "1")),
        (("recent", "0.5"),),
        (("period", "4"), ("copy", "0.05"), ("copyweight", "0")),
        (("period", "4"), ("copy", "0.05"), ("copyweight", "0"), ("loop", "4")),
    ],
)
def test_the_short_list_picks_what_a_search_of_all_k_picks(monkeypatch, options):
    """Between refreshes each step picks among a few listed candidates; searching all K every step must
    give the same victims, step by step, in every (layer, head)."""
    settings_ = CacheSettings(budget=24, policy="epikv2", options=(("keep", "head"), *options))
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(5))

    def run() -> tuple[list, list]:
        held, gone = [], []
        with CacheStream(MODEL, settings_, max_tokens=130) as stream:
            out = stream.feed(ids)
            for _ in range(120):
                out = stream.feed(out.argmax().view(1, 1))
                held.append(
                    sorted(
                        map(
                            tuple,
                            stream.cache.head_slots.held(stream.cache.stored)
                            .sort(dim=-1)
                            .values.flatten(0, 1)
                            .tolist(),
                        )
                    )
                )
                gone.append(stream.session.last.evicted)
        return held, gone

    listed = run()
    monkeypatch.setattr(EpiKV2, "shortlisted", False)
    searched = run()
    assert listed == searched
    assert sum(map(len, listed[1])) > 40


@pytest.mark.parametrize("chunk_bytes", [1, 1 << 30])
def test_received_by_layers_equals_each_layers_dense_causal_softmax(monkeypatch, chunk_bytes):
    """Several layers at once (each with its own queries, keys, slot order and softmax scale, one value-weighted
    run too), in one chunk or one layer per chunk: each layer's result equals a softmax per query over every
    key, masked where the key is newer, mean over the query heads that read the KV head."""
    monkeypatch.setattr(epikv2, "REFRESH_CHUNK_BYTES", {"cpu": chunk_bytes})
    generator = torch.Generator().manual_seed(4)
    layers, width, stored, seen = 3, 6, 30, 70
    queries = [torch.randn(4, width, 8, generator=generator) for _ in range(layers)]
    keys = [torch.randn(2, stored, 8, generator=generator) for _ in range(layers)]
    values = [torch.randn(2, stored, 8, generator=generator) for _ in range(layers)]
    query_positions = torch.arange(seen - width, seen)
    key_positions = torch.stack(
        [
            torch.stack(
                [
                    torch.cat([torch.randperm(seen - width, generator=generator)[: stored - width], query_positions])[
                        torch.randperm(stored, generator=generator)
                    ]
                    for _ in range(2)
                ]
            )
            for _ in range(layers)
        ]
    )
    scaling = [0.3, None, 0.5]
    for weighted in (False, True):
        expected = torch.zeros(layers, 2, stored)
        for layer in range(layers):
            scale = scaling[layer] if scaling[layer] is not None else 8**-0.5
            for kv in range(2):
                norms = values[layer][kv].norm(dim=-1) if weighted else torch.ones(stored)
                for head in range(2 * kv, 2 * kv + 2):
                    for i in range(width):
                        logits = keys[layer][kv] @ queries[layer][head, i] * scale
                        logits[key_positions[layer, kv] > query_positions[i]] = -math.inf
                        expected[layer, kv] += torch.softmax(logits, 0) * norms / 2
        got = received_by_layers(queries, keys, query_positions, key_positions, scaling, values if weighted else None)
        assert got.shape == (layers, 2, stored)
        assert torch.allclose(got, expected, atol=1e-5), weighted


def test_cpu_refresh_groups_layers_up_to_its_cache_sized_chunk(monkeypatch):
    """On the CPU a refresh computes as many layers together as fit REFRESH_CHUNK_BYTES["cpu"] of float32 logits
    (4 query heads x 8 queries x 6144 keys = 0.75 MiB per layer: 2 layers per 2 MiB chunk, 7 layers in 4 chunks),
    and a device type not named falls back to the default (here 1 MiB: one layer per chunk)."""
    chunks = []
    original = epikv2._received_chunk

    def recorded(queries, *args):
        chunks.append(len(queries))
        return original(queries, *args)

    monkeypatch.setattr(epikv2, "_received_chunk", recorded)
    layers, n = 7, 6144
    queries = [torch.randn(4, 8, 8) for _ in range(layers)]
    keys = [torch.randn(2, n, 8) for _ in range(layers)]
    positions = torch.arange(n).expand(layers, 2, n)
    got = received_by_layers(queries, keys, torch.arange(n - 8, n), positions, [None] * layers)
    assert chunks == [2, 2, 2, 1]
    assert got.shape == (layers, 2, n)
    chunks.clear()
    monkeypatch.setattr(epikv2, "REFRESH_CHUNK_BYTES", {"cuda": 2 << 20})
    monkeypatch.setattr(epikv2, "DEFAULT_REFRESH_CHUNK_BYTES", 1 << 20)
    received_by_layers(queries, keys, torch.arange(n - 8, n), positions, [None] * layers)
    assert chunks == [1] * layers


def test_order_keys_sort_like_score_then_position():
    """One integer per slot whose order is (score, position): negative, zero, tiny and huge scores, and ties
    broken by the older position, against Python's tuple sort."""
    generator = torch.Generator().manual_seed(11)
    scores = torch.cat(
        [
            torch.randn(40, generator=generator) * 1e3,
            torch.tensor([0.0, 0.0, 1e-40, -1e-40, 3.5, 3.5, -2.0, -2.0, float("inf"), -float("inf"), 1e30, -1e30]),
        ]
    )
    positions = torch.randperm(scores.numel(), generator=generator) * 1000 + 7
    keys = order_keys(scores, positions)
    expected = sorted(range(scores.numel()), key=lambda i: (float(scores[i]), int(positions[i])))
    assert torch.argsort(keys).tolist() == expected


@pytest.mark.parametrize("queries", [None, 4])
def test_a_refresh_adds_the_attention_of_the_newest_queries(queries):
    """Per (layer, KV head), the scores after the prefill and one decode refresh equal the attention that
    transformers' eager attention gives from the newest ``queries`` positions (16 by default) at the
    prefill and at the refresh, mean over the head's query group, with nothing evicted yet."""
    model = tiny_model("llama", seed=5, initializer_range=0.15)
    options = (("period", "16"),) + ((("queries", str(queries)),) if queries else ())
    width = queries or 16
    prompt_len, steps = 30, 16
    tokens = torch.randint(0, 256, (prompt_len + steps,), generator=torch.Generator().manual_seed(2)).tolist()
    with CacheStream(model, CacheSettings(budget=64, policy="epikv2", options=options), max_tokens=64) as stream:
        stream.feed(torch.tensor([tokens[:prompt_len]]))
        policy = stream.session.policy
        after_prefill = stream.cache.head_slots.companions[policy._head_scores][:, :, :prompt_len].clone()
        for token in tokens[prompt_len:]:
            stream.feed(torch.tensor([[token]]))
        after_refresh = stream.cache.head_slots.companions[policy._head_scores][:, :, : prompt_len + steps].clone()
    base = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attentions = model(input_ids=torch.tensor([tokens]), output_attentions=True).attentions
    finally:
        model.set_attn_implementation(base)
    kv_heads = after_prefill.shape[1]

    def received(end: int) -> torch.Tensor:
        """[layers, kv_heads, end]: attention from the `width` positions before `end`, summed, mean over each group."""
        rows = torch.stack(
            [layer[0, :, end - width : end, :end].sum(dim=1) for layer in attentions]
        )  # [layers, heads, end]
        return rows.view(rows.shape[0], kv_heads, -1, end).mean(dim=2)

    assert torch.allclose(after_prefill, received(prompt_len), atol=1e-5)
    expected = received(prompt_len + steps)
    expected[:, :, :prompt_len] += received(prompt_len)
    assert torch.allclose(after_refresh, expected, atol=1e-5)
    assert after_refresh.sum(dim=-1).sub(2 * width).abs().max() < 1e-4  # each query's weights sum to 1


def test_refresh_writes_its_logits_into_reused_buffers_without_changing_results():
    """Refreshes of several sizes in a row reuse the same three buffers (no new multi-MiB tensor, which page-faults
    on every touch on a CPU), and each result equals the one computed from freshly made buffers."""
    generator = torch.Generator().manual_seed(11)

    def inputs(n):
        queries = [torch.randn(4, 8, 16, generator=generator) for _ in range(3)]
        keys = [torch.randn(2, n, 16, generator=generator) for _ in range(3)]
        positions = torch.stack(
            [torch.stack([torch.randperm(n, generator=generator) for _ in range(2)]) for _ in range(3)]
        )
        return queries, keys, torch.arange(n - 8, n), positions, [None] * 3

    cases = [inputs(n) for n in (300, 40, 300, 120)]
    epikv2.REFRESH_SCRATCH.clear()
    fresh = []
    for case in cases:
        epikv2.REFRESH_SCRATCH.clear()
        fresh.append(received_by_layers(*case))
    epikv2.REFRESH_SCRATCH.clear()
    reused, pointers = [], set()
    for case in cases:
        reused.append(received_by_layers(*case))
        pointers.add(epikv2.REFRESH_SCRATCH.take("logits", (1,), torch.float32, "cpu").data_ptr())
    assert len(pointers) == 1  # the first (largest) call's buffer served every later one
    # the largest chunk's logits and weights (3 layers x 2 KV heads x 2 query heads x 8 queries x 300 keys) and its
    # keys gathered into one block (3 layers x 2 KV heads x 300 keys x 16 dimensions), float32
    assert epikv2.REFRESH_SCRATCH.nbytes() == 2 * 3 * 2 * 2 * 8 * 300 * 4 + 3 * 2 * 300 * 16 * 4
    for got, expected in zip(reused, fresh):
        assert torch.equal(got, expected)
