"""Batched decoding: every row of a batch is exactly the sequence it would be alone, whatever the policy."""

from __future__ import annotations

import pytest
import torch

from epikv_cli.config import CacheSettings
from epikv_cli.policies.registry import POLICIES, parse_policy_spec
from epikv_cli.runtime.batched import BatchDecoder
from epikv_cli.runtime.stream import CacheStream

from conftest import tiny_model

STEPS = 150  # long enough for R-KV to compress once at budget 16
# Greedy choice on the logits plus a fixed random bias per step, the same alone and in the batch: a
# tiny random model left alone falls into a loop of one repeated token, and then frozen scores tie
# exactly, so which of two equal tokens leaves would be decided by rounding, not by the policy.
BIAS = torch.randn(STEPS, 272, generator=torch.Generator().manual_seed(0)) * 2


def choose(logits: torch.Tensor, step: int) -> torch.Tensor:
    return (logits + BIAS[step]).argmax(-1)


def settings_for(spec: str, prompt_len: int) -> CacheSettings:
    policy, options = parse_policy_spec(spec)
    if policy == "full":
        return CacheSettings(budget=None, policy="full")
    cls = POLICIES[policy]
    small_recent = (("recent", "0.25"),) if policy == "epikv2" else ()  # so that its scores decide most evictions
    return CacheSettings(
        budget=prompt_len + 24 if cls.protects_prompt else 16, policy=policy, options=small_recent + options
    )


def alone(model, ids, settings, steps=STEPS, biased=True):
    """Chosen tokens and logits of one sequence decoded by itself."""
    tokens, logits = [], []
    with CacheStream(model, settings, max_tokens=ids.shape[1] + steps) as stream:
        out = stream.feed(ids)
        for step in range(steps):
            token = int(choose(out, step) if biased else out.argmax())
            tokens.append(token)
            logits.append(out)
            out = stream.feed(torch.tensor([[token]]))
    return tokens, torch.stack(logits)


# Qwen 3 and Gemma 3 normalise keys (RMSNorm), so every key has nearly the same norm and knorm's order
# is decided by rounding there; knorm is checked on Llama, whose key norms differ.
# lagkv:chunks=positions is another rule (scores frozen at append), not just another setting.
SPECS = [*sorted(POLICIES), "lagkv:chunks=positions"]
CASES = [
    (arch, policy) for arch in ("llama", "qwen3", "gemma3") for policy in SPECS if arch == "llama" or policy != "knorm"
]


@pytest.mark.parametrize("arch, policy", CASES)
def test_a_batch_of_prompts_equals_each_prompt_alone(arch, policy):
    model = tiny_model(arch, seed=3)
    prompts = [torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(n)) for n in (9, 20, 5, 31)]
    settings = [settings_for(policy, ids.shape[1]) for ids in prompts]
    expected = [alone(model, ids, s) for ids, s in zip(prompts, settings)]
    with BatchDecoder(model, settings) as decoder:
        logits = torch.stack([decoder.add(ids, s, ids.shape[1] + STEPS) for ids, s in zip(prompts, settings)])
        tokens, seen = [[] for _ in prompts], [[] for _ in prompts]
        for step in range(STEPS):
            chosen = choose(logits, step)
            for row in range(len(prompts)):
                tokens[row].append(int(chosen[row]))
                seen[row].append(logits[row])
            logits = decoder.step(chosen)
        evicted = [row.evicted_total for row in decoder.cache.rows]
    for row, (want_tokens, want_logits) in enumerate(expected):
        assert tokens[row] == want_tokens, (policy, row)
        assert torch.allclose(torch.stack(seen[row]), want_logits, atol=1e-4, rtol=0), (
            (torch.stack(seen[row]) - want_logits).abs().max()
        )
    assert (min(evicted) > 0) == POLICIES[
        parse_policy_spec(policy)[0]
    ].evicts  # rows really evicted (none under the full cache)


def test_rows_leave_and_join_without_disturbing_the_others():
    """Continuous batching: a finished row leaves, a queued prompt takes its place mid-way."""
    model = tiny_model("llama", seed=4)
    prompts = [torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(n)) for n in (6, 14, 9)]
    settings = CacheSettings(budget=40, policy="h2o")
    expected = [alone(model, ids, settings, 80, biased=False) for ids in prompts]  # plain greedy: H2O's sums do not tie
    with BatchDecoder(model, [settings]) as decoder:
        logits = torch.stack([decoder.add(ids, settings, ids.shape[1] + 80) for ids in prompts[:2]])
        owners, done = [0, 1], {0: [], 1: [], 2: []}
        step = 0
        while owners:
            chosen = logits.argmax(-1)
            for row, owner in enumerate(owners):
                done[owner].append(int(chosen[row]))
            finished = [row for row, owner in enumerate(owners) if len(done[owner]) == (30 if owner == 0 else 80)]
            if finished:
                keep = [row for row in range(len(owners)) if row not in finished]
                decoder.keep(keep)
                owners = [owners[row] for row in keep]
                logits = logits[keep]
            if step == 30:  # the queue: prompt 2 joins the running batch
                joined = decoder.add(prompts[2], settings, prompts[2].shape[1] + 80)
                owners.append(2)
                done[2].append(int(joined.argmax()))
                logits = torch.cat([logits, joined.unsqueeze(0)])
            if not owners:
                break
            logits = decoder.step(torch.tensor([done[owner][-1] for owner in owners]))
            step += 1
    assert done[0] == expected[0][0][:30] and done[1] == expected[1][0] and done[2] == expected[2][0]


def test_rows_with_different_policies_and_budgets_in_one_batch():
    """Attention weights are computed only for the rows that read them; every row still equals its run alone."""
    model = tiny_model("qwen3", seed=5)
    prompts = [torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(n)) for n in (11, 17, 8, 23, 14)]
    settings = [
        CacheSettings(budget=20, policy="h2o"),
        CacheSettings(budget=48, policy="epikv"),
        CacheSettings(budget=16, policy="tova"),
        CacheSettings(budget=30, policy="streaming"),
        CacheSettings(budget=40, policy="epikv2"),
    ]
    expected = [alone(model, ids, s) for ids, s in zip(prompts, settings)]
    with BatchDecoder(model, settings) as decoder:
        logits = torch.stack([decoder.add(ids, s, ids.shape[1] + STEPS) for ids, s in zip(prompts, settings)])
        tokens = [[] for _ in prompts]
        for step in range(STEPS):
            chosen = choose(logits, step)
            for row in range(len(prompts)):
                tokens[row].append(int(chosen[row]))
            logits = decoder.step(chosen)
    assert tokens == [want for want, _ in expected]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("options", [(("keep", "head"),), (("keep", "head"), ("adapt", "1"))])
def test_granular_rows_equal_each_prompt_alone(arch, options):
    """epikv2 with a keep-set per layer and KV head: each row's tokens and logits are its own alone."""
    model = tiny_model(arch, seed=3, initializer_range=0.15)  # sharp enough that heads choose differently
    prompts = [torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(n)) for n in (9, 20, 5, 31)]
    settings = [CacheSettings(budget=16, policy="epikv2", options=(("recent", "0.25"), *options)) for _ in prompts]
    expected = [alone(model, ids, s) for ids, s in zip(prompts, settings)]
    with BatchDecoder(model, settings) as decoder:
        logits = torch.stack([decoder.add(ids, s, ids.shape[1] + STEPS) for ids, s in zip(prompts, settings)])
        tokens, seen = [[] for _ in prompts], [[] for _ in prompts]
        for step in range(STEPS):
            chosen = torch.stack([choose(row, step) for row in logits])
            for row in range(len(prompts)):
                tokens[row].append(int(chosen[row]))
                seen[row].append(logits[row])
            logits = decoder.step(chosen)
        held = decoder.row(1).head_slots.live(decoder.row(1).stored)
    for row, (want_tokens, want_logits) in enumerate(expected):
        assert tokens[row] == want_tokens
        assert torch.allclose(torch.stack(seen[row]), want_logits, atol=1e-4, rtol=0)
    if arch != "gemma3":  # its one global layer's two heads may agree; the others have 8 keep-sets
        assert len({tuple(sorted(keep.tolist())) for keep in held.flatten(0, 1)}) > 1


def test_a_granular_row_whose_prompt_fills_the_budget_exactly_joins_a_batch():
    """A prompt of exactly K tokens joins mid-way: its first step evicts from keep-sets built by a prefill
    that evicted nothing, and the rows already decoding are not disturbed."""
    model = tiny_model("qwen3", seed=3, initializer_range=0.15)
    settings = CacheSettings(budget=16, policy="epikv2", options=(("recent", "0.25"),))
    prompts = [torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(n)) for n in (9, 20, 16)]
    steps = 60
    expected = [alone(model, ids, settings, steps)[0] for ids in prompts]
    with BatchDecoder(model, [settings]) as decoder:
        logits = torch.stack([decoder.add(ids, settings, ids.shape[1] + steps) for ids in prompts[:2]])
        owners, done, step = [0, 1], {0: [], 1: [], 2: []}, {0: 0, 1: 0, 2: 0}
        while owners:
            chosen = torch.stack([choose(row, step[owner]) for row, owner in zip(logits, owners)])
            for row, owner in enumerate(owners):
                done[owner].append(int(chosen[row]))
                step[owner] += 1
            keep = [row for row, owner in enumerate(owners) if len(done[owner]) < steps]
            if len(keep) < len(owners):
                decoder.keep(keep)
                owners, logits, chosen = [owners[row] for row in keep], logits[keep], chosen[keep]
            if step[0] == 10 and 2 not in owners and not done[2]:  # prompt 2 (16 tokens = K) joins
                logits = decoder.step(chosen) if owners else logits
                joined = decoder.add(prompts[2], settings, prompts[2].shape[1] + steps)
                owners.append(2)
                logits = torch.cat([logits, joined.unsqueeze(0)])
                continue
            if not owners:
                break
            logits = decoder.step(chosen)
    assert [done[0], done[1], done[2]] == expected


def test_a_granular_rows_next_token_fills_each_heads_victim_slot_and_nothing_moves():
    """In the steady state a granular row's victims leave their slots vacant, and the next token's key is
    written into each (layer, KV head)'s own vacant slot: every other entry stays where it was."""
    model = tiny_model("llama", seed=3, initializer_range=0.15)
    settings = CacheSettings(budget=16, policy="epikv2", options=(("recent", "0.25"),))
    prompts = [torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(n)) for n in (9, 20)]
    with BatchDecoder(model, [settings]) as decoder:
        logits = torch.stack([decoder.add(ids, settings, ids.shape[1] + 40) for ids in prompts])
        for step in range(30):  # both rows are over their budget and evict one token per step
            logits = decoder.step(choose(logits, step))
        heads = decoder.row(1).head_slots
        vacant = heads.vacant.clone()  # [layers, kv_heads]: the slots last step's victims left
        stored = decoder.row(1).stored
        layers = [decoder.cache.layers[i] for i in decoder.cache.full_layer_indices]
        before = torch.stack(
            [layer.keys[1, :, : stored + 1].clone() for layer in layers]
        )  # [layers, kv_heads, slots, dim]
        logits = decoder.step(choose(logits, 30))
        after = torch.stack([layer.keys[1, :, : stored + 1] for layer in layers])
        position = decoder.row(1).seen - 1
    assert heads.vacant is not None  # this step evicted again: new vacancies wait for the next token
    written = torch.zeros(after.shape[:3], dtype=torch.bool)
    written.scatter_(-1, vacant[..., None], True)
    assert torch.equal(after[~written], before[~written])  # no entry moved
    assert not torch.equal(after[written], before[written])  # the vacant slots took the new token's keys
    assert torch.equal(
        torch.gather(heads.positions[:, :, : stored + 1], -1, vacant[..., None])[..., 0],
        torch.full(vacant.shape, position),
    )


def test_a_row_joining_the_batch_leaves_the_refresh_buffers_in_place():
    """A row joins through a session of its own, closed once the row is adopted: the batch's refresh
    buffers stay while the decoder is open (not re-allocated at every join) and go when it closes."""
    from epikv_cli.policies.epikv2 import REFRESH_SCRATCH

    model = tiny_model("llama")
    settings = CacheSettings(budget=16, policy="epikv2", options=(("recent", "0.25"),))
    prompts = [torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(n)) for n in (20, 9)]
    REFRESH_SCRATCH.clear()
    with BatchDecoder(model, [settings]) as decoder:
        decoder.add(prompts[0], settings, 60)  # its prefill refresh takes the buffers
        buffer = REFRESH_SCRATCH.take("weights", (1,), torch.float32, "cpu").data_ptr()
        held = REFRESH_SCRATCH.nbytes()
        decoder.add(prompts[1], settings, 60)  # a shorter prompt: the buffers are large enough already
        assert REFRESH_SCRATCH.nbytes() == held
        assert REFRESH_SCRATCH.take("weights", (1,), torch.float32, "cpu").data_ptr() == buffer
    assert REFRESH_SCRATCH.nbytes() == 0


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("path", ["prefill", "adopt"])
def test_a_batchs_buffers_grow_to_what_a_row_uses_and_no_further(path, arch):
    """Rows grow their buffers by doubling, but stop at the most slots a row uses: K + 1 in a full layer (with a
    granular row's per-head map), the window in a sliding one. At K = 300 and a window of 150, 20 + 320 tokens reach
    301 and 150 slots, where doubling from the prompt's would give 336 (a 512-slot map) and 168. Both ways rows
    join: one padded prefill (``attach``), or adopted one by one."""
    import epikv_cli

    model = tiny_model(arch, seed=0, **({"sliding_window": 150} if arch == "gemma3" else {}))
    ids = torch.randint(3, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    settings = CacheSettings(budget=300, policy="epikv2")
    if path == "prefill":
        with epikv_cli.attach(model, budget=300, policy="epikv2", batch_size=2) as cache:
            # generate feeds every token but its last: 20 + 320 in all, as below
            model.generate(ids, cache=cache, max_new_tokens=321, do_sample=False, eos_token_id=None, pad_token_id=0)
            rows = cache
    else:
        with BatchDecoder(model, [settings, settings]) as decoder:
            logits = [decoder.add(ids[i : i + 1], settings, 20 + 320) for i in range(2)]
            tokens = torch.stack(logits).argmax(-1)
            for _ in range(320):
                tokens = decoder.step(tokens).argmax(-1)
            rows = decoder.cache
    assert [row.evicted_total for row in rows.rows] == [40, 40]
    sizes = {(layer.group, layer.keys.shape[2]) for layer in rows.layers}
    assert sizes == ({("full", 301), ("sliding", 150)} if arch == "gemma3" else {("full", 301)})
    assert [row.heads.capacity for row in rows.rows] == [301, 301]
