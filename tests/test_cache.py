"""The budget cache: preallocated slots, O(evicted) moves, logical masks, sliding layers untouched."""

from __future__ import annotations

import pytest
import torch

from epikv_cli.core.cache import HEADROOM, BudgetCache, BudgetLayer, SlotTable, move_entries
from epikv_cli.errors import UsageError

from conftest import ARCHITECTURES


def states(n, heads=2, dim=4, start=0):
    """[1, heads, n, dim] states whose every entry encodes its token index."""
    base = torch.arange(start, start + n, dtype=torch.float32).view(1, 1, n, 1)
    return base.expand(1, heads, n, dim).clone(), (base + 0.5).expand(1, heads, n, dim).clone()


def test_slot_table_fills_holes_with_the_newest_entries():
    table = SlotTable(8)
    table.append(6)
    holes, movers = table.plan_eviction([1, 4])
    assert (holes, movers) == ([1], [5])
    assert table.live_positions().tolist() == [0, 5, 2, 3]
    assert table.stored == 4 and table.seen == 6


def test_layer_append_and_evict_touch_only_the_slots_involved():
    layer = BudgetLayer(limit=9)
    layer.update(*states(8))
    buffer = layer.keys.data_ptr()
    before = layer.keys.clone()
    move_entries([(layer.keys, layer.values)], [0], [2], [7], layer.keys.device)
    layer.length = 7
    assert layer.keys.data_ptr() == buffer  # no reallocation, no whole-cache copy
    changed = (layer.keys != before).any(dim=-1).any(dim=1)[0]
    assert torch.nonzero(changed).flatten().tolist() == [2]
    assert layer.keys[0, 0, 2, 0] == 7
    layer.update(*states(1, start=8))  # the freed slot 7 is reused
    assert layer.keys.data_ptr() == buffer
    assert layer.keys[0, 0, 7, 0] == 8 and layer.length == 8


def test_layer_grows_past_its_limit_only_when_one_forward_needs_it():
    layer = BudgetLayer(limit=4)
    k, v = layer.update(*states(3))
    assert layer.capacity == 4  # first forward: its tokens plus headroom, capped by the limit
    k, v = layer.update(*states(3, start=3))
    assert layer.capacity == 6 and k.shape[-2] == 6
    assert k[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5]


def test_unbounded_layer_allocates_as_it_fills():
    """An unbounded (or huge) limit never allocates up front: prompt + HEADROOM, then doubling."""
    layer = BudgetLayer(limit=10**6)  # e.g. --budget 10**12 -n 10**6: 10**6 slots must not be allocated now
    layer.update(*states(5))
    assert layer.capacity == 5 + HEADROOM
    for t in range(5, 5 + HEADROOM + 1):
        layer.update(*states(1, start=t))
    assert layer.capacity == 2 * (5 + HEADROOM)  # one doubling
    assert layer.keys[0, 0, : layer.length, 0].tolist() == list(range(6 + HEADROOM))
    unbounded = BudgetLayer(limit=None)
    unbounded.update(*states(3))
    assert unbounded.capacity == 3 + HEADROOM


def test_layer_reports_logical_length_and_offsets_the_mask():
    layer = BudgetLayer(limit=8)
    layer.update(*states(6))
    move_entries([(layer.keys, layer.values)], [0], [1], [5], layer.keys.device)
    layer.length = 5
    assert layer.get_seq_length() == 6  # tokens seen, like sliding-window layers
    assert layer.get_mask_sizes(1) == (6, 1)  # 5 stored + 1 new, first slot counts as logical 1


def test_batch_size_above_one_is_refused():
    layer = BudgetLayer(limit=4)
    k, v = states(2)
    with pytest.raises(UsageError, match="batch size 2"):
        layer.update(k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1))


def test_cache_evicts_the_same_slots_in_every_layer():
    config = ARCHITECTURES["llama"]()
    cache = BudgetCache(config, budget=6)
    for layer_idx in range(config.num_hidden_layers):
        cache.update(*states(8), layer_idx)
    cache.commit()
    evicted = cache.evict([0, 3]).positions
    assert evicted == [0, 3]
    assert cache.stored == 6 and cache.seen == 8
    for layer in cache.budget_layers:
        assert layer.live()[0][0, 0, :, 0].tolist() == cache.live_positions().tolist()
    assert cache.evicted_total == 2


def test_gemma3_keeps_sliding_layers_and_budgets_global_ones():
    cache = BudgetCache(ARCHITECTURES["gemma3"](), budget=16)
    assert [type(layer).__name__ for layer in cache.layers] == ["DynamicSlidingWindowLayer"] * 5 + ["BudgetLayer"]
    assert cache.budget_layer_indices == [5]


def test_preallocates_budget_plus_one_slots():
    cache = BudgetCache(ARCHITECTURES["llama"](), budget=32)
    cache.update(*states(10), 0)
    assert cache.layers[0].keys.shape[-2] == 33
    assert cache.kv_bytes() == 2 * 33 * 2 * 4 * 4


def test_never_more_slots_than_the_sequence_can_hold():
    cache = BudgetCache(ARCHITECTURES["llama"](), budget=10**12, max_tokens=20)
    cache.update(*states(10), 0)
    assert cache.layers[0].keys.shape[-2] == 20  # min(K + 1, prompt + max new tokens)
    full = BudgetCache(ARCHITECTURES["llama"](), budget=None, max_tokens=10**8)
    full.update(*states(10), 0)
    assert full.layers[0].keys.shape[-2] == 10 + HEADROOM


def test_single_eviction_leaves_its_slot_free_for_the_next_token():
    table = SlotTable(8)
    table.append(5)
    assert table.plan_eviction([2]) == ([], [])  # nothing moves
    assert table.free == 2 and table.stored == 4 and table.used == 5
    assert table.live_positions().tolist() == [0, 1, 3, 4]
    plan = table.append(1)
    assert plan.start == 2 and plan.close is None
    assert table.free is None and table.live_positions().tolist() == [0, 1, 5, 3, 4]
    assert table.slot_of[5] == 2 and 2 not in table.slot_of


def test_a_free_slot_is_closed_before_several_tokens_are_appended():
    table = SlotTable(8)
    table.append(5)
    table.plan_eviction([1])
    plan = table.append(2)
    assert plan.close == (1, 4) and plan.start == 4  # the last entry fills the hole, then two at the end
    assert table.live_positions().tolist() == [0, 4, 2, 3, 5, 6]
    assert {p: table.slot_of[p] for p in (4, 5, 6)} == {4: 1, 5: 4, 6: 5}


def test_evicting_with_a_free_slot_compacts_it_too():
    table = SlotTable(8)
    table.append(6)
    table.plan_eviction([4])
    holes, movers = table.plan_eviction([0])
    assert (holes, movers) == ([0], [5])
    assert table.free is None and table.live_positions().tolist() == [5, 1, 2, 3]


def test_steady_state_eviction_moves_nothing_and_the_next_token_takes_the_slot():
    config = ARCHITECTURES["llama"]()
    cache = BudgetCache(config, budget=6)
    for layer_idx in range(config.num_hidden_layers):
        cache.update(*states(7), layer_idx)
    cache.commit()
    before = [layer.keys.clone() for layer in cache.budget_layers]
    assert cache.evict([3]).positions == [3]
    for layer, old in zip(cache.budget_layers, before):
        assert torch.equal(layer.keys, old)  # eviction touched no buffer
    assert cache.live_positions().tolist() == [0, 1, 2, 4, 5, 6]
    assert cache.get_mask_sizes(1, 0) == (7, 1)  # 6 live + the new one, written into the free slot
    for layer_idx in range(config.num_hidden_layers):
        k, _ = cache.update(*states(1, start=7), layer_idx)
        assert k[0, 0, :, 0].tolist() == [0, 1, 2, 7, 4, 5, 6]
    cache.commit()
    assert cache.stored == 7 and cache.live_positions().tolist() == [0, 1, 2, 7, 4, 5, 6]
