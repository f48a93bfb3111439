"""The vLLM engine's rings without vLLM (epikv_cli/vllm/ring.py is plain torch): a step's decode attention, one call
over a range of blocks or one per request, against a softmax written out and against one SDPA call per request
(the same numbers); the recent queries a policy reads."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from epikv_cli.config import CacheSettings
from epikv_cli.vllm.ring import DecodeRows, RecentQueries, RingCache, Row, page_slots

HEADS, KV_HEADS, DIM, BUDGET, BLOCKS = 4, 2, 8, 6, 8
SCALE = DIM**-0.5


def rings() -> RingCache:
    """Rings of C = K + 1 slots for ``BLOCKS`` request blocks, one layer, streaming (it reads nothing of a step)."""
    cache = RingCache(CacheSettings(budget=BUDGET, policy="streaming"), 1, BUDGET + 1, SCALE)
    cache.bind(0, torch.zeros(BLOCKS, KV_HEADS, BUDGET + 1, 2 * DIM))
    return cache


def forward(cache: RingCache, rows: list[Row], generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of ``rows`` through the rings (random queries, keys and values); its queries and output."""
    tokens = max(row.last for row in rows)
    query = torch.randn(tokens, HEADS, DIM, generator=generator)
    key = torch.randn(tokens, KV_HEADS, DIM, generator=generator)
    value = torch.randn(tokens, KV_HEADS, DIM, generator=generator)
    output = torch.empty_like(query)
    cache.begin(rows)
    cache.attend(0, query, key, value, output)
    cache.finish()
    return query, output


def prefill(cache: RingCache, lengths: dict[int, int], generator: torch.Generator) -> None:
    """Start a request of ``lengths[block]`` prompt tokens in each block (one forward)."""
    rows, first = [], 0
    for block, length in lengths.items():
        rows.append(Row(block, 0, first, first + length))
        first += length
    forward(cache, rows, generator)


def written_out(cache: RingCache, query: torch.Tensor, block: int) -> torch.Tensor:
    """``[heads, dim]``: ``query`` ``[heads, dim]``'s attention over block ``block``'s live slots, as a float64
    softmax (query head h reads KV head h // (HEADS // KV_HEADS))."""
    keys, values = cache.kv(0)
    used = cache.requests[block].table.used
    k = keys[block, :, :used].double().repeat_interleave(HEADS // KV_HEADS, dim=0)  # [heads, used, dim]
    v = values[block, :, :used].double().repeat_interleave(HEADS // KV_HEADS, dim=0)
    weights = torch.softmax((k @ query.double()[:, :, None])[..., 0] * SCALE, dim=-1)  # [heads, used]
    return (weights[:, :, None] * v).sum(dim=1)


def one_call_each(cache: RingCache, query: torch.Tensor, token: int, block: int) -> torch.Tensor:
    """``[heads, dim]``: the attention of token ``token`` as one SDPA call over its block's live slots."""
    keys, values = cache.kv(0)
    used = cache.requests[block].table.used
    q = query[token : token + 1, :, None]
    k, v = keys[block : block + 1, :, :used], values[block : block + 1, :, :used]
    return F.scaled_dot_product_attention(q, k, v, scale=SCALE, enable_gqa=True)[0, :, 0]


def decode(cache: RingCache, blocks: list[int], generator: torch.Generator) -> DecodeRows:
    """One decode step of the requests in ``blocks`` (in that order in the forward); its plan, after checking its
    output: each token's equals one SDPA call of its own, exactly, and the softmax written out."""
    rows = [Row(block, cache.requests[block].table.seen, i, i + 1) for i, block in enumerate(blocks)]
    query, output = forward(cache, rows, generator)
    for token, block in enumerate(blocks):
        assert torch.equal(output[token], one_call_each(cache, query, token, block))
        torch.testing.assert_close(output[token], written_out(cache, query[token], block).float())
    return cache._decode


def shape(plan: DecodeRows) -> tuple[list[tuple], list[int]]:
    """Each group's ``(blocks, used, ordered, first, span)``, and the blocks of the rows left alone."""
    groups = [([block for _, block in g.rows], g.used, g.ordered, g.first, g.span) for g in plan.groups]
    return groups, [block for _, block, _ in plan.alone]


def test_requests_in_consecutive_blocks_attend_in_one_call_with_each_ones_numbers():
    generator = torch.Generator().manual_seed(0)
    cache = rings()
    prefill(cache, {1: 3, 2: 3, 3: 3}, generator)
    plans = [shape(decode(cache, [1, 2, 3], generator)) for _ in range(6)]  # rings fill (4 .. 7 used), then evict
    assert plans == [([([1, 2, 3], used, True, 1, 3)], []) for used in (4, 5, 6, 7, 7, 7)]


def test_blocks_out_of_order_or_with_a_gap_are_scattered_into_one_call():
    generator = torch.Generator().manual_seed(1)
    cache = rings()
    prefill(cache, {4: 2, 1: 2, 3: 2}, generator)  # block 2 holds no request
    for _ in range(7):
        plan = decode(cache, [4, 1, 3], generator)
    assert shape(plan) == ([([4, 1, 3], 7, False, 1, 4)], [])
    assert plan.groups[0].offsets.tolist() == [3, 0, 2]


def test_rows_attend_in_one_call_per_length_and_alone_when_far_apart_or_single():
    generator = torch.Generator().manual_seed(2)
    cache = rings()
    prefill(cache, {1: 2, 2: 4, 3: 2, 4: 4, 5: 3}, generator)
    plan = decode(cache, [1, 2, 3, 4, 5], generator)
    assert shape(plan) == ([([1, 3], 3, False, 1, 3), ([2, 4], 5, False, 2, 3)], [5])
    for _ in range(4):
        plan = decode(cache, [1, 2, 3, 4, 5], generator)  # every ring full: 7 slots each
    assert shape(plan) == ([([1, 2, 3, 4, 5], 7, True, 1, 5)], [])
    assert shape(DecodeRows.plan([(0, 1, 7), (1, 7, 7)], "cpu")) == ([], [1, 7])  # 7 blocks for 2 rows


def test_recent_queries_are_the_newest_oldest_first_across_laps():
    """A 20-token prompt keeps its last 16 queries; decode steps overwrite the oldest; a request read before a lap
    reads what it has."""
    width, heads, dim = 16, 3, 4
    queries = RecentQueries(width)
    queries.bind(0, torch.zeros(4, heads, width, dim))
    history = torch.randn(40, heads, dim)
    taken = 0
    for count in (20, *([1] * 20)):
        new = history[taken : taken + count]
        columns = queries.columns(taken, count)
        queries.write(0, torch.full((columns.numel(),), 2), columns, new[-columns.numel() :])
        taken += count
        assert torch.equal(queries.of(2, taken)[0], history[max(0, taken - width) : taken].transpose(0, 1))
    queries.write(0, torch.tensor([1, 1, 1]), queries.columns(0, 3), history[:3])
    assert torch.equal(queries.of(1, 3)[0], history[:3].transpose(0, 1))


def test_the_queries_a_policy_reads_live_in_its_page_behind_the_keys_and_values():
    """epikv2 reads its 16 newest queries: each page holds them after the ring's keys and values, in slots vLLM
    allocates (and counts) with the page, and writing them leaves the keys and values as they were."""
    budget = 20  # epikv2's smallest is 19
    settings = CacheSettings(budget=budget, policy="epikv2")
    cache = RingCache(settings, 1, budget + 1, SCALE, heads=(HEADS, KV_HEADS))
    assert cache.page_slots == page_slots(settings, HEADS, KV_HEADS) == budget + 1 + 16  # 4 heads x 16 / (2 x 2)
    pages = torch.zeros(BLOCKS, KV_HEADS, cache.page_slots, 2 * DIM)
    cache.bind(0, pages)
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(5, HEADS, DIM, generator=generator)
    key, value = torch.randn(2, 5, KV_HEADS, DIM, generator=generator)
    cache.begin([Row(2, 0, 0, 5)])
    cache.attend(0, query, key, value, torch.empty_like(query))
    cache.finish()
    keys, values = cache.kv(0)
    assert torch.equal(keys[2, :, :5], key.transpose(0, 1)) and torch.equal(values[2, :, :5], value.transpose(0, 1))
    assert torch.equal(cache.queries.of(2, 5)[0], query.transpose(0, 1))
    page = pages[2].flatten()
    ring = KV_HEADS * 2 * (budget + 1) * DIM  # each KV head's keys, then its values, then the queries
    assert torch.equal(page[ring : ring + HEADS * 16 * DIM].view(HEADS, 16, DIM)[:, :5], query.transpose(0, 1))
    assert cache.request_bytes() == KV_HEADS * cache.page_slots * 2 * DIM * 4


def test_a_granular_policys_head_map_holds_the_rings_slots_and_no_more():
    """epikv2 keeps a position map and scores per (layer, KV head) beside each ring, on the pages' device: at
    K = 300 they hold the ring's C = 301 slots (doubling from 256 would hold 512, outside vLLM's memory plan)."""
    budget = 300
    cache = RingCache(CacheSettings(budget=budget, policy="epikv2"), 1, budget + 1, SCALE, heads=(HEADS, KV_HEADS))
    cache.bind(0, torch.zeros(2, KV_HEADS, cache.page_slots, 2 * DIM))
    generator = torch.Generator().manual_seed(5)
    forward(cache, [Row(1, 0, 0, 290)], generator)
    for step in range(30):
        forward(cache, [Row(1, 290 + step, 0, 1)], generator)
    request = cache.requests[1]
    assert request.evicted_total == 20 and request.table.used == budget + 1
    assert request.heads.positions.shape == request.heads.companions[0].shape == (1, KV_HEADS, budget + 1)
