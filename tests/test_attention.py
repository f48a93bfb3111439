"""Attention taps: weights computed beside SDPA equal eager attention's; the model is left as it was."""

from __future__ import annotations

import math

import pytest
import torch

from epikv_cli.core.attention import AttentionNeeds, AttentionTaps, attention_rows

from conftest import tiny_model


def reference_rows(query, key, mask):
    """Plain softmax(q k^T / sqrt(d) + mask) with the key heads repeated, row by row."""
    heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[-1]
    keys = key[0].repeat_interleave(heads // kv_heads, dim=0)
    scores = query[0] @ keys.transpose(-1, -2) / math.sqrt(dim) + mask
    return torch.softmax(scores, dim=-1)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_rows_match_plain_softmax_for_every_mask_form(kv_heads):
    torch.manual_seed(0)
    query, key = torch.randn(1, 4, 5, 8), torch.randn(1, kv_heads, 9, 8)
    causal = torch.zeros(5, 9).masked_fill(torch.arange(9)[None] > torch.arange(4, 9)[:, None], -math.inf)
    expected = reference_rows(query, key, causal)
    as_bool = (causal == 0)[None, None]
    for mask in (None, as_bool, causal[None, None]):  # None: causal from the shapes
        got = attention_rows(query, key, mask, 8**-0.5, slice(1, 4))
        assert torch.allclose(got[0], expected[:, 1:4], atol=1e-6)


def run_taps(model, ids, needs):
    layers = list(range(model.config.num_hidden_layers))
    taps = AttentionTaps(model, layers, needs)
    try:
        with torch.no_grad():
            logits = model(ids).logits
        return logits, taps.record
    finally:
        taps.remove()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_taps_beside_sdpa_equal_eager_weights(arch):
    model = tiny_model(arch, seed=2)
    ids = torch.randint(0, 256, (1, 300))  # more rows than one query chunk
    with torch.no_grad():
        plain = model(ids).logits
    logits, record = run_taps(model, ids, AttentionNeeds(received=True, last_row=True, queries=8))
    assert torch.equal(logits, plain)  # the output is the kernel's own
    assert model.config._attn_implementation == "sdpa"  # restored
    eager = tiny_model(arch, seed=2, _attn_implementation="eager")
    with torch.no_grad():
        weights = eager(ids, output_attentions=True).attentions  # per layer [1, heads, q, n]
    for layer, w in enumerate(weights):
        assert torch.allclose(record.received[layer][0], w[0].sum(dim=1).mean(dim=0), atol=1e-4)
        assert torch.allclose(record.last_row[layer][0], w[0, :, -1].mean(dim=0), atol=1e-6)
        assert record.row(0, w.shape[-1]).queries[layer].shape == (
            model.config.num_attention_heads,
            8,
            8,
        )  # [heads, last 8, head_dim]


def test_eager_kernel_weights_are_used_as_they_are():
    model = tiny_model("llama", seed=2, _attn_implementation="eager")
    ids = torch.randint(0, 256, (1, 12))
    _, record = run_taps(model, ids, AttentionNeeds(last_row=True))
    with torch.no_grad():
        weights = model(ids, output_attentions=True).attentions
    assert model.config._attn_implementation == "eager"
    assert all(torch.equal(record.last_row[i][0], w[0, :, -1].float().mean(dim=0)) for i, w in enumerate(weights))


def test_query_ring_keeps_the_last_queries_in_order():
    from epikv_cli.core.attention import QueryRing

    ring = QueryRing(width=3)
    ring.write(torch.arange(2.0).view(1, 1, 2, 1))  # a 2-token prefill: queries 0, 1
    assert ring.ordered(0).flatten().tolist() == [0.0, 1.0]
    for value in (2.0, 3.0, 4.0):
        ring.write(torch.tensor(value).view(1, 1, 1, 1))
    assert ring.ordered(0).flatten().tolist() == [2.0, 3.0, 4.0]
    ring.add_row(torch.tensor([[7.0, 8.0, 9.0, 10.0]]).unsqueeze(-1), heads=1, dim=1, dtype=torch.float32, device="cpu")
    ring.write(torch.tensor([5.0, 11.0]).view(2, 1, 1, 1))
    assert ring.ordered(0).flatten().tolist() == [3.0, 4.0, 5.0] and ring.ordered(1).flatten().tolist() == [
        9.0,
        10.0,
        11.0,
    ]
    ring.keep_rows(torch.tensor([1]))
    assert ring.ordered(0).flatten().tolist() == [9.0, 10.0, 11.0]


def test_query_ring_reads_what_a_copy_at_once_ring_holds():
    """Decode-step queries are copied in only when the ring is read: any mix of prefills, single and
    multi-query writes and reads, across wrap-arounds, reads the last ``width`` queries in order."""
    import random

    from epikv_cli.core.attention import QueryRing

    rng = random.Random(3)
    for width in (1, 3, 8):
        ring, history, value = QueryRing(width=width), [], 0.0
        for _ in range(60):
            count = rng.choice([1, 1, 1, 1, 2, width + 2])
            ring.write(torch.arange(value, value + count).view(1, 1, count, 1).expand(2, 2, count, 1))
            history += [value + i for i in range(count)]
            value += count
            if rng.random() < 0.3:
                expected = history[-width:]
                assert ring.ordered(0)[0].flatten().tolist() == expected
                assert ring.ordered(1)[1].flatten().tolist() == expected


def test_stored_queries_come_with_the_kernels_scale():
    """Gemma's softmax scale is query_pre_attn_scalar ** -0.5, not head_dim ** -0.5: attention
    recomputed from the stored queries (epikv2, rkv) must use the scale the kernel used."""
    from transformers import DynamicCache

    from epikv_cli.policies.epikv2 import received_attention

    model = tiny_model("gemma3", seed=5, query_pre_attn_scalar=2)  # head_dim 8: scale 0.71, not 0.35
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    global_layer = 5
    taps = AttentionTaps(model, [global_layer], AttentionNeeds(queries=4))
    try:
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids, cache=cache)
        record = taps.record
    finally:
        taps.remove()
    assert record.scaling[global_layer] == pytest.approx(2**-0.5)
    keys = cache.layers[global_layer].keys[0]  # [kv_heads, 12, dim], after RoPE and norm
    got = received_attention(
        record.queries[global_layer].ordered(0),
        keys,
        torch.arange(8, 12),
        torch.arange(12),
        scaling=record.scaling[global_layer],
    )
    eager = tiny_model("gemma3", seed=5, query_pre_attn_scalar=2, _attn_implementation="eager")
    with torch.no_grad():
        weights = eager(ids, output_attentions=True).attentions[global_layer][0]  # [heads, 12, 12]
    assert torch.allclose(got, weights[:, 8:].sum(dim=1).mean(dim=0), atol=1e-5)
    unscaled = received_attention(record.queries[global_layer].ordered(0), keys, torch.arange(8, 12), torch.arange(12))
    assert not torch.allclose(unscaled, got, atol=1e-3)  # the head_dim default would be wrong here
