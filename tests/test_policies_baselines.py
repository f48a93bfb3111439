"""The keep rules of h2o, tova, rkv and epikv2 on hand-made attention, queries and keys."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from epikv_cli.config import CacheSettings
from epikv_cli.core.attention import AttentionRecord
from epikv_cli.errors import UsageError
from epikv_cli.policies.base import Signals
from epikv_cli.policies.h2o import H2O
from epikv_cli.policies.registry import make_policy
from epikv_cli.policies.rkv import importance, redundancy
from epikv_cli.policies.tova import TOVA


def fake_cache(positions, seen, prompt_len=0):
    """What policies read of a cache: slots hold ``positions`` (scrambled orders allowed)."""
    listed = list(positions)
    return SimpleNamespace(
        live_positions=lambda: torch.tensor(listed),
        seen=seen,
        prompt_len=prompt_len,
        slots_of=lambda wanted: [listed.index(p) for p in wanted],
    )


def record(kind, *per_layer):
    return AttentionRecord(**{kind: {i: torch.tensor(v, dtype=torch.float32) for i, v in enumerate(per_layer)}})


def test_h2o_accumulates_received_attention_by_position_across_slot_moves():
    policy = H2O(recent=2)
    cache = fake_cache([0, 1, 2, 3, 4, 5, 6, 7], seen=8)
    # two layers; their mean is what accumulates
    policy.observe(
        Signals(
            range(0, 8),
            True,
            attention=record("received", [0, 0, 0, 0, 4, 1, 3, 0], [0, 0, 0, 0, 2, 1, 1, 0]),
            cache=cache,
        )
    )
    # slot 4 now holds position 8 (position 4's slot reused), positions otherwise in place
    cache = fake_cache([0, 1, 2, 3, 8, 5, 6, 7], seen=9)
    policy.observe(Signals(range(8, 9), False, attention=record("received", [0, 0, 0, 0, 0, 5, 0, 0]), cache=cache))
    # accumulated: 5 -> 1 + 5 = 6, 6 -> 2; sinks 0-3 and recent 7, 8 are kept
    assert policy.select(cache, 1) == [6]  # position 6 (2.0) before position 5 (6.0)
    assert policy.select(cache, 2) == [6, 5]
    with pytest.raises(RuntimeError, match="only 2 are evictable"):
        policy.select(cache, 3)


def test_h2o_default_recent_window_is_the_authors():
    policy = make_policy(CacheSettings(budget=100, policy="h2o"))
    assert policy.recent == 96 and policy.sinks == 4
    assert make_policy(CacheSettings(budget=4096, policy="h2o")).recent == 128
    assert policy.min_budget(500) == 5  # the prompt is not protected
    with pytest.raises(UsageError, match="too small for h2o.*use --budget 24 or more"):
        make_policy(CacheSettings(budget=10, policy="h2o", recent=20)).check_budget(3, 10)


def test_tova_evicts_the_least_attended_and_keeps_the_newest():
    policy = TOVA()
    cache = fake_cache([3, 0, 5, 1, 4], seen=6)  # slot order scrambled; position 5 is the newest
    policy.observe(
        Signals(range(5, 6), False, attention=record("last_row", [0.1, 0.5, 0.0, 0.3, 0.1], [0.1, 0.3, 0.0, 0.1, 0.5]))
    )
    # means per slot: [0.1, 0.4, 0.0, 0.2, 0.3]; slot 2 (the newest) has the least but is kept
    assert policy.select(cache, 1) == [0]
    assert policy.select(cache, 2) == [0, 3]


def test_rkv_importance_by_hand():
    query = torch.tensor([[[1.0, 0.0]]])  # [heads 1, w 1, dim 2]
    keys = torch.tensor([[[2.0, 0.0], [0.0, 0.0], [0.0, 2.0], [1.0, 1.0]]])  # [kv_heads 1, n 4, dim 2]
    logits = torch.tensor([2.0, 0.0, 0.0]) / math.sqrt(2)  # the past: all but the last (window 1)
    soft = torch.softmax(logits, dim=0)
    pooled = torch.tensor([max(soft[0], soft[1]), soft.max(), max(soft[1], soft[2])])  # kernel 3
    assert torch.allclose(importance(query, keys, window=1, kernel=3)[0], pooled)


def test_rkv_redundancy_keeps_the_latest_copy():
    keys = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]])  # three copies, then another key
    # row i drops itself and its latest look-alike: rows 0, 1 keep their similarity to the other copies
    # 0 -> {1}, 1 -> {0}, 2 -> {0}; column means over the 4 rows: [2/4, 1/4, 0, 0]
    expected = torch.softmax(torch.tensor([0.5, 0.25, 0.0, 0.0]), dim=0)
    assert torch.allclose(redundancy(keys)[0], expected, atol=1e-6)


def test_rkv_keeps_the_last_8_and_the_top_k_minus_8_of_the_mixed_score_at_each_compression():
    """select: nothing below K + 128 stored; then the lowest of 0.1 * importance - 0.9 * redundancy (mean over
    KV heads and layers, in logical order whatever the slots) leave, and never one of the last 8 tokens."""
    from epikv_cli.policies.rkv import RKV

    n, kv_heads, heads, dim = 150, 2, 4, 8
    generator = torch.Generator().manual_seed(0)
    slots_to_positions = torch.randperm(n, generator=generator)  # slot s holds position slots_to_positions[s]
    by_position = [torch.randn(kv_heads, n, dim, generator=generator) for _ in range(2)]  # two layers, logical order
    layers = [(k[:, slots_to_positions].unsqueeze(0), None) for k in by_position]
    queries = {0: torch.randn(heads, 8, dim, generator=generator), 1: torch.randn(heads, 8, dim, generator=generator)}
    cache = SimpleNamespace(
        live_positions=lambda: slots_to_positions.clone(), evicting_layers=[0, 1], layer_kv=layers.__getitem__
    )
    policy = RKV()
    policy.observe(SimpleNamespace(attention=SimpleNamespace(queries=queries, scaling={})))
    mixed = (
        sum(
            (0.1 * importance(queries[i], by_position[i]) - 0.9 * redundancy(by_position[i])[:, :-8]).mean(dim=0)
            for i in (0, 1)
        )
        / 2
    )  # [n - 8], positions 0 .. n - 9
    assert policy.select(cache, 127) == []  # K + 127 stored: not yet
    chosen_slots = policy.select(cache, 130)
    chosen_positions = slots_to_positions[chosen_slots].tolist()
    assert chosen_positions == torch.argsort(mixed, stable=True)[:130].tolist()
    assert max(chosen_positions) < n - 8


def test_received_attention_by_hand():
    from epikv_cli.policies.epikv2 import received_attention

    keys = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]])  # [kv_heads 1, n 3, dim 2]
    queries = torch.tensor([[[2.0, 0.0], [0.0, 2.0]]])  # [heads 1, w 2, dim 2], at positions 1 and 2
    got = received_attention(queries, keys, torch.tensor([1, 2]), torch.tensor([0, 1, 2]))
    first = torch.softmax(torch.tensor([2.0, 0.0]) / math.sqrt(2), 0)  # query at 1 sees keys 0, 1
    second = torch.softmax(torch.tensor([0.0, 2.0, 2.0]) / math.sqrt(2), 0)  # query at 2 sees all three
    assert torch.allclose(got, torch.tensor([first[0] + second[0], first[1] + second[1], second[2]]))


def test_epikv2_keeps_sinks_and_its_recent_share_and_evicts_the_least_attended():
    """The one keep-set for all layers (keep=global); tests/test_keepsets.py covers the per-head default."""
    from epikv_cli.policies.epikv2 import EpiKV2

    policy = EpiKV2(budget=8, sinks=2, recent=0.25, period=1, keep="global")  # recent window: 2 tokens
    # the prompt is not kept; the smallest K holds 2 sinks, round(0.25 K) recent tokens and one more: K = 4
    assert policy.recent == 2 and policy.min_budget(100) == 4
    policy.received.add(torch.tensor([2, 3, 4, 5, 6]), torch.tensor([0.9, 0.1, 0.5, 0.05, 0.3]))
    cache = fake_cache([0, 1, 2, 3, 4, 5, 6, 7, 8], seen=9)
    # sinks 0, 1 and the recent 7, 8 are kept; lowest received among 2..6: 5 (0.05), then 3 (0.1)
    assert policy.select(cache, 2) == [5, 3]
    keeping = EpiKV2(budget=8, sinks=2, recent=2, prompt="keep", keep="global")
    keeping.received.add(torch.tensor([2, 3, 4, 5, 6]), torch.tensor([0.9, 0.1, 0.5, 0.05, 0.3]))
    assert keeping.select(fake_cache([0, 1, 2, 3, 4, 5, 6, 7, 8], seen=9, prompt_len=4), 2) == [5, 6]
    assert keeping.min_budget(4) == 4 + 2 + 1  # the kept prompt (the 2 sinks inside it), 2 recent, one more


def test_epikv2_heap_picks_what_a_full_sort_picks_across_refreshes():
    from epikv_cli.policies.base import lowest
    from epikv_cli.policies.epikv2 import EpiKV2

    generator = torch.Generator().manual_seed(3)
    policy = EpiKV2(budget=12, sinks=2, recent=3, period=4, keep="global")
    live = list(range(13))  # K + 1 entries: one leaves per step
    for seen in range(13, 80):
        if seen % 4 == 0:  # a refresh re-scores every live token (ties included: scores in quarters)
            policy.credit(torch.tensor(live), torch.randint(0, 4, (len(live),), generator=generator) / 4)
        positions = torch.tensor(live)
        candidates = (positions >= 2) & (positions < seen - 3)
        scores = torch.nan_to_num(policy.received.gather(positions), nan=0.0)
        expected = [live[slot] for slot in lowest(scores, positions, candidates, 1)]
        cache = fake_cache(live, seen=seen)
        assert [live[slot] for slot in policy.select(cache, 1)] == expected
        live.remove(expected[0])
        live.append(seen)


def test_policy_options_are_typed_and_checked():
    from epikv_cli.policies.registry import parse_policy_spec

    assert parse_policy_spec("epikv2:period=8:decay=0.9") == ("epikv2", (("period", "8"), ("decay", "0.9")))
    policy = make_policy(CacheSettings(budget=100, policy="epikv2", options=(("period", "8"),)))
    assert policy.period == 8 and policy.attention_needs.queries == 8
    fewer = make_policy(CacheSettings(budget=100, policy="epikv2", options=(("period", "8"), ("queries", "3"))))
    assert fewer.period == 8 and fewer.attention_needs.queries == 3
    for bad, message in [
        ((("speed", "9"),), "has no option 'speed'"),
        ((("period", "x"),), "must be a whole number"),
        ((("decay", "2"),), r"option decay=2.0 is out of range: it must be above 0 and at most 1"),
        ((("decay", "nan"),), r"option decay=nan is out of range"),
        ((("period", "0"),), r"option period=0 is out of range: it must be a number of steps, 1 or more"),
        (
            (("period", "8"), ("queries", "9")),
            r"option queries=9 is out of range: it must be a number of queries from 1 to period \(8\)",
        ),
        ((("queries", "0"),), r"option queries=0 is out of range"),
        (
            (("recent", "1.5"),),
            r"option recent=1.5 is out of range: it must be a share of K .* or a whole number of tokens",
        ),
        ((("recent", "-1"),), r"option recent=-1.0 is out of range"),
        ((("recent", "0.995"),), r"option recent=0.995 is out of range: it must be a share of K from 0 to 0.99"),
        (
            (("sinks", str(2**31)),),
            rf"option sinks={2**31} is out of range: it must be a number of tokens from 0 to {2**31 - 1}",
        ),
        ((("pool", "4"),), r"option pool=4 is out of range: it must be an odd number"),
        ((("keep", "all"),), r"option keep='all' is out of range: it must be global, layer or head"),
        ((("adapt", "1"), ("keep", "global")), "adapt=1 needs keep=layer or keep=head"),
    ]:
        with pytest.raises(UsageError, match=message):
            make_policy(CacheSettings(budget=100, policy="epikv2", options=bad))
    with pytest.raises(UsageError, match="not KEY=VALUE"):
        parse_policy_spec("epikv2:period")


def test_epikv2_ablation_signals():
    from epikv_cli.policies.epikv2 import EpiKV2

    cache = fake_cache([0, 1, 2, 3, 4, 5, 6, 7, 8], seen=9)
    recency = EpiKV2(budget=8, sinks=2, recent=2, signal="none", keep="global")
    assert recency.attention_needs is None and recency.select(cache, 2) == [2, 3]  # no signal: the oldest candidates
    paper = EpiKV2(budget=8, sinks=2, recent=2, signal="epiphany", keep="global")
    paper.setup(32)
    assert paper.tap_layers() == [10, 21] and paper.attention_needs is None
    for position, score in {2: 1.0, 3: -2.0, 4: 0.5, 5: 3.0, 6: -1.0}.items():
        paper.epiphany.book.set(position, score)
    assert paper.select(cache, 2) == [3, 6]  # the lowest epiphany scores among the candidates


def test_epikv2_credit_rules_by_hand():
    from epikv_cli.policies.epikv2 import EpiKV2

    cache = fake_cache([0, 1, 2, 3, 4, 5, 6, 7, 8], seen=9)

    def refreshed(credit):
        policy = EpiKV2(budget=8, sinks=2, recent=2, period=1, credit=credit, keep="global")
        policy.credit(torch.tensor([2, 3, 4]), torch.tensor([0.3, 0.1, 0.5]))  # positions 2-4 seen twice,
        policy.credit(torch.tensor([2, 3, 4, 5, 6]), torch.tensor([0.3, 0.6, 0.0, 0.4, 0.2]))  # 5 and 6 once
        return policy

    # sum: 2 -> 0.6, 3 -> 0.7, 4 -> 0.5, 5 -> 0.4, 6 -> 0.2: the newcomers 6 and 5 leave first
    assert refreshed("sum").select(cache, 2) == [6, 5]
    # mean per refresh: 2 -> 0.3, 3 -> 0.35, 4 -> 0.25, 5 -> 0.4, 6 -> 0.2
    assert refreshed("mean").select(cache, 2) == [6, 4]
    # max of one refresh: 2 -> 0.3, 3 -> 0.6, 4 -> 0.5, 5 -> 0.4, 6 -> 0.2
    assert refreshed("max").select(cache, 2) == [6, 2]


def test_value_weighted_received_attention_by_hand():
    from epikv_cli.policies.epikv2 import received_attention

    keys = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # [kv_heads 1, n 2, dim 2]
    values = torch.tensor([[[3.0, 4.0], [0.0, 0.5]]])  # norms 5 and 0.5
    queries = torch.tensor([[[2.0, 0.0]]])  # one query at position 1 sees both keys
    weights = torch.softmax(torch.tensor([2.0, 0.0]) / math.sqrt(2), 0)
    got = received_attention(queries, keys, torch.tensor([1]), torch.tensor([0, 1]), values=values)
    assert torch.allclose(got, weights * torch.tensor([5.0, 0.5]))


def test_pooling_over_positions_follows_logical_order_not_slots():
    from epikv_cli.policies.epikv2 import pooled_over_positions

    positions = torch.tensor([4, 0, 3, 1, 2])  # slot order is not position order
    scores = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.9])  # the token at position 2 (slot 4) was attended
    # kernel 3: positions 1, 2, 3 (slots 3, 4, 2) take 0.9; positions 0 and 4 (slots 1, 0) keep 0
    assert pooled_over_positions(scores, positions, 3).tolist() == pytest.approx([0.0, 0.0, 0.9, 0.9, 0.9])


def far_sources_reference(queries, keys, query_positions, key_positions, eligible):
    """Per layer, KV head, query head and query: the position of the eligible key given the most weight, and the
    weight (one softmax per query head, written out plainly)."""
    found, weights = [], []
    for layer, (q, k) in enumerate(zip(queries, keys)):
        heads, w, dim = q.shape
        kv_heads = k.shape[0]
        group = heads // kv_heads
        layer_found = torch.full((kv_heads, group, w), -1)
        layer_weights = torch.zeros(kv_heads, group, w)
        for head in range(heads):
            kv = head // group
            for i in range(w):
                visible = key_positions[layer, kv] <= query_positions[i]
                logits = (k[kv] @ q[head, i]) * dim**-0.5
                attention = torch.softmax(logits.masked_fill(~visible, -math.inf), dim=0)
                if eligible[layer, kv].any():
                    masked = attention.masked_fill(~eligible[layer, kv], -1.0)
                    layer_found[kv, head % group, i] = key_positions[layer, kv, masked.argmax()]
                    layer_weights[kv, head % group, i] = masked.max()
        found.append(layer_found)
        weights.append(layer_weights)
    return torch.stack(found), torch.stack(weights)


def test_the_refresh_finds_where_each_query_looks_among_the_far_keys():
    """refresh_layers(far=...) against a plain per-query softmax: 3 layers (each its own chunk, as a CPU
    groups them under a small chunk size), 2 KV heads of 3 query heads, each head holding the 4 newest and its own
    26 of the older positions, one head with no far key at all; its received attention is unchanged by asking."""
    from epikv_cli.policies import epikv2
    from epikv_cli.policies.epikv2 import received_by_layers, refresh_layers

    generator = torch.Generator().manual_seed(3)
    layers, kv_heads, group, w, n, dim = 3, 2, 3, 4, 30, 8
    queries = [torch.randn(kv_heads * group, w, dim, generator=generator) * 2 for _ in range(layers)]
    keys = [torch.randn(kv_heads, n, dim, generator=generator) * 2 for _ in range(layers)]
    older = [[torch.randperm(36, generator=generator)[: n - w] for _ in range(kv_heads)] for _ in range(layers)]
    positions = torch.stack([torch.stack([torch.cat([torch.arange(36, 40), o]) for o in heads]) for heads in older])
    query_positions = torch.arange(36, 40)
    eligible = (positions >= 2) & (positions < 25)
    eligible[1, 0] = False  # nothing far in layer 1's first head
    want_sources, want_weights = far_sources_reference(queries, keys, query_positions, positions, eligible)
    chunk = epikv2.REFRESH_CHUNK_BYTES["cpu"]
    epikv2.REFRESH_CHUNK_BYTES["cpu"] = 1  # one layer per chunk
    try:
        received, sources, weights = refresh_layers(
            queries, keys, query_positions, positions, [None] * layers, far=eligible
        )
    finally:
        epikv2.REFRESH_CHUNK_BYTES["cpu"] = chunk
    assert torch.equal(sources, want_sources)
    assert torch.allclose(weights, want_weights, atol=1e-6)
    assert (sources[1, 0] == -1).all() and (sources[0] >= 2).all()
    assert torch.equal(received, received_by_layers(queries, keys, query_positions, positions, [None] * layers))
    # two sets at once (as copy and loop ask): each found as if alone, with a leading dimension per set
    near = (positions >= 25) & (positions < 34)
    both = refresh_layers(queries, keys, query_positions, positions, [None] * layers, far=torch.stack([eligible, near]))
    near_sources, near_weights = far_sources_reference(queries, keys, query_positions, positions, near)
    assert torch.equal(both[1], torch.stack([want_sources, near_sources]))
    assert torch.allclose(both[2], torch.stack([want_weights, near_weights]), atol=1e-6)
    assert torch.equal(both[0], received)


def test_copy_windows_stretch_only_heads_that_read_consecutive_tokens_of_an_old_passage():
    from epikv_cli.policies.epikv2 import copy_windows

    # [layers 1, kv_heads 3, group 1, w 5]: head 0 copies from 100 positions back, head 1 jumps about,
    # head 2 copies one step in two (pairs 0-1 and 2-3 advance by one) with weights too small to count
    sources = torch.tensor([[[[96, 97, 98, 99, 100]], [[40, 12, 80, 81, 7]], [[50, 51, 60, 61, 70]]]])
    weights = torch.tensor([[[[0.5] * 5], [[0.5] * 5], [[0.01] * 5]]])
    windows = copy_windows(sources, weights, last=200, share=0.5, min_weight=0.05, recent=75, longest=150, margin=8)
    assert windows.tolist() == [[200 - 100 + 8, 75, 75]]
    # the margin reaches further behind the source it reads now, up to the longest window allowed
    windows = copy_windows(sources, weights, last=200, share=0.5, min_weight=0.05, recent=75, longest=150, margin=32)
    assert windows.tolist() == [[132, 75, 75]]
    windows = copy_windows(sources, weights, last=200, share=0.5, min_weight=0.05, recent=75, longest=120, margin=32)
    assert windows.tolist() == [[120, 75, 75]]
    # head 1 advances on 1 pair of 4: a share of 0.25 counts it as copying, and its window reaches back to 7,
    # capped at the longest allowed
    windows = copy_windows(sources, weights, last=200, share=0.25, min_weight=0.05, recent=75, longest=150, margin=8)
    assert windows.tolist() == [[108, 150, 75]]


def test_copy_windows_with_loops_keep_the_period_before_a_source_inside_the_window():
    from epikv_cli.policies.epikv2 import copy_windows

    # [layers 1, kv_heads 4, group 1, w 4], newest query at 200, a 75-token window. Inside the window: head 0
    # repeats what it wrote 40 tokens back (a loop of period 40), head 2 from 72 back (a period whose double
    # passes the longest window), head 3 from 20 back (its double still inside the window); head 1 jumps about
    # inside but copies from 100 back, beyond the window
    near = torch.tensor(
        [[[[157, 158, 159, 160]], [[140, 170, 131, 150]], [[125, 126, 127, 128]], [[177, 178, 179, 180]]]]
    )
    far = torch.tensor([[[[10, 50, 20, 5]], [[97, 98, 99, 100]], [[10, 50, 20, 5]], [[10, 50, 20, 5]]]])
    weights = torch.full((1, 4, 1, 4), 0.5)
    looped = copy_windows(far, weights, 200, 0.5, 0.05, recent=75, longest=150, margin=8, near=(near, weights))
    assert looped.tolist() == [[2 * 40 + 8, 100 + 8, 150, 75]]
    # without the sources inside the window, only the copy from beyond it stretches
    assert copy_windows(far, weights, 200, 0.5, 0.05, recent=75, longest=150, margin=8).tolist() == [[75, 108, 75, 75]]
    # a head copying both ways keeps the longer reach: beyond the window 100 back, inside 60 back (2 x 60 + 8)
    both = copy_windows(
        far[:, 1:2], weights[:, :1], 200, 0.5, 0.05, 75, 150, 8, near=(near[:, :1] - 20, weights[:, :1])
    )
    assert both.tolist() == [[128]]
    # weights below the least weight count as no copy, inside the window as beyond it
    faint = torch.full((1, 4, 1, 4), 0.01)
    assert copy_windows(far, faint, 200, 0.5, 0.05, 75, 150, 8, near=(near, faint)).tolist() == [[75, 75, 75, 75]]


def test_epikv2_stretches_a_copying_heads_window_by_its_copymargin():
    """The policy's windows are copy_windows' with its own share, budget and ``copymargin`` (default 16)."""
    from epikv_cli.policies.epikv2 import EpiKV2

    # K = 400 (a 300-token default window), newest query at 500: [layers 1, kv_heads 2, group 1, w 4], head 0
    # reads 167..170 one query after another, head 1 does not copy
    sources = torch.tensor([[[[167, 168, 169, 170]], [[40, 12, 80, 7]]]])
    weights = torch.full((1, 2, 1, 4), 0.5)
    for margin, window in ((None, 500 - 170 + 16), (0, 330), (32, 362), (200, 400 - 4)):
        policy = EpiKV2(budget=400) if margin is None else EpiKV2(budget=400, copymargin=margin)
        policy._follow_copies(sources, weights, floor=4, seen=501)
        assert policy._window[..., 0].tolist() == [[window, 300]]
    with pytest.raises(UsageError, match="copymargin"):
        EpiKV2(budget=400, copymargin=-1)


def test_epikv2_loop_keeps_the_repetition_before_the_one_a_head_reads():
    """loop=G (default 32 with copy): a head repeating its own window's tokens from d >= G back keeps 2 d +
    copymargin (default 16); loop needs copy (which keys each loop setting searches: test_keepsets.py)."""
    from epikv_cli.policies.epikv2 import DEFAULT_LOOP, EpiKV2

    # K = 400 (a 300-token default window), newest query at 500: inside the window head 0 reads 337..340, 160
    # back; beyond it neither head copies. [2 (beyond, inside), layers 1, kv_heads 2, group 1, w 4]
    inside = torch.tensor([[[[337, 338, 339, 340]], [[340, 312, 380, 307]]]])
    beyond = torch.tensor([[[[40, 12, 80, 7]], [[40, 12, 80, 7]]]])
    sources, weights = torch.stack([beyond, inside]), torch.full((2, 1, 2, 1, 4), 0.5)
    for options, window in (({}, 2 * 160 + 16), ({"copymargin": 0}, 320)):
        policy = EpiKV2(budget=400, **options)
        policy._follow_copies(sources, weights, floor=4, seen=501)
        assert policy._window[..., 0].tolist() == [[window, 300]]
    assert EpiKV2(budget=400).loop == DEFAULT_LOOP == 32
    assert EpiKV2(budget=400, copy=0).loop == 0 and EpiKV2(budget=400, keep="global").loop == 0
    for options in ({"copy": 0, "loop": 32}, {"keep": "global", "loop": 32}, {"loop": -1}):
        with pytest.raises(UsageError, match="loop"):
            EpiKV2(budget=400, **options)


def test_epikv2_takes_recent_in_tokens_once():
    """``--recent R`` is epikv2's ``recent=R`` in tokens; giving both is refused, not silently resolved."""
    by_flag = make_policy(CacheSettings(budget=100, policy="epikv2", recent=30))
    by_option = make_policy(CacheSettings(budget=100, policy="epikv2", options=(("recent", "30"),)))
    default = make_policy(CacheSettings(budget=100, policy="epikv2"))
    assert by_flag.recent == by_option.recent == 30 and default.recent == 75
    assert by_flag.min_budget(0) == 4 + 30 + 1
    with pytest.raises(UsageError, match="--recent and the option recent= both set the recent window of 'epikv2'"):
        CacheSettings(budget=100, policy="epikv2", recent=30, options=(("recent", "0.5"),))


def test_epikv2_budget_advice_names_the_share_and_its_tokens():
    policy = make_policy(CacheSettings(budget=5, policy="epikv2"))
    with pytest.raises(UsageError) as refused:
        policy.check_budget(10, 5)
    # 4 sinks + round(0.75 K) + 1 <= K first holds at K = 19 (14 recent tokens there)
    assert str(refused.value) == (
        "--budget 5 is too small for epikv2, which keeps 4 sink tokens and 75% of K as its recent window "
        "(14 tokens at K = 19); use --budget 19 or more"
    )
