"""Where a policy's largest KL spikes come from: the full cache's attention on the tokens it evicted.

Reads one prompt's record from `epikv fidelity --trace --output FILE` (its reference tokens and every
position's KL per policy), replays the reference under the policy and under `streaming` at the
record's budget, and, at the policy's N largest KL positions, prints for each evicting layer and KV
head the attention the full cache's query there gives (mean over the head's query heads, eager
attention over the whole sequence) to the tokens that streaming still holds and the policy has
evicted, with the heaviest of them (position, text, weight, and the step at which the policy evicted it
there).

    epikv fidelity --model gemma-3-270m-q4_k_m.gguf --prompts ../shared/data/math500.jsonl --offset 4 \\
        --limit 1 -n 384 --budgets +64 --policies streaming,epikv2 --trace --output p4.jsonl
    .venv/bin/python benchmarks/lost_attention.py --model gemma-3-270m-q4_k_m.gguf \\
        --prompts ../shared/data/math500.jsonl --offset 4 --trace p4.jsonl --policy epikv2 --spikes 3

The held sets are read before the forward whose logits predict the spike's token (the query also sees
the token evicted in that step); the policy's options go after its name as on the command line
(`epikv2:copymargin=8`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from epikv_cli.config import ModelSettings
from epikv_cli.data.problems import load_problems, protocol_ids
from epikv_cli.experiments.fidelity import BudgetSpec, Config
from epikv_cli.models.loading import load
from epikv_cli.runtime.stream import CacheStream


def held_by_head(cache, layers: int, kv_heads: int) -> list[list[set[int]]]:
    """Per evicting layer and KV head, the positions it holds (one set for all of them under a shared keep-set)."""
    if getattr(cache, "head_slots", None) is not None:
        held = cache.head_slots.held(cache.stored)
        return [[set(held[layer, head].tolist()) for head in range(kv_heads)] for layer in range(layers)]
    shared = set(cache.live_positions().tolist())
    return [[shared] * kv_heads for _ in range(layers)]


def when(step: int | None) -> str:
    """When a token left: the step whose forward evicted it (the one that appended reference token ``step``)."""
    return "the prefill" if step is None else f"step {step}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument(
        "--offset", type=int, required=True, help="the prompt's index in --prompts (as fidelity's --offset)"
    )
    parser.add_argument(
        "--trace", type=Path, required=True, help="fidelity --trace output holding that prompt's record"
    )
    parser.add_argument("--policy", required=True, help="a policy of the record, e.g. epikv2")
    parser.add_argument("--budget", default=None, help="one of the record's budgets (default: the policy's first)")
    parser.add_argument("--spikes", type=int, default=3, help="how many of the largest KL positions to explain")
    parser.add_argument("--top", type=int, default=6, help="evicted tokens listed per layer and head")
    args = parser.parse_args()

    torch.set_grad_enabled(False)
    problem = load_problems(args.prompts, limit=1, offset=args.offset)[0]
    record = next((r for r in map(json.loads, args.trace.read_text().splitlines()) if r["id"] == problem.id), None)
    if record is None or "reference_tokens" not in record:
        parser.error(f"{args.trace} holds no --trace record of {problem.id}; run epikv fidelity --trace on that prompt")
    reference = record["reference_tokens"]
    result = next(
        (r for r in record["results"] if r["policy"] == args.policy and args.budget in (None, r["budget"])), None
    )
    if result is None or "kl_by_position" not in result:
        parser.error(
            f"the record of {problem.id} has no traced result of {args.policy} at budget {args.budget or 'any'}"
        )
    kl = result["kl_by_position"]
    spikes = sorted(sorted(range(1, len(reference)), key=lambda step: -kl[step])[: args.spikes])
    loaded = load(ModelSettings(model=args.model, attn="eager"))
    model, tokenizer = loaded.model, loaded.tokenizer
    ids = protocol_ids(tokenizer, problem)
    prompt_len = ids.shape[1]
    budget = BudgetSpec.parse(result["budget"])
    configs = {name: Config(name, budget).settings(prompt_len) for name in (args.policy, "streaming")}

    text_config = model.config.get_text_config()
    kv_heads = text_config.num_key_value_heads
    group = text_config.num_attention_heads // kv_heads
    held: dict[int, dict[str, list[list[set[int]]]]] = {step: {} for step in spikes}
    left_at: dict[tuple[int, int, int], int] = {}  # (evicting layer index, KV head, position): the policy's step
    for name, settings in configs.items():
        with CacheStream(model, settings, max_tokens=prompt_len + len(reference)) as stream:
            stream.feed(ids)
            layers = stream.cache.budget_layer_indices
            before = held_by_head(stream.cache, len(layers), kv_heads)
            for step in range(len(reference) - 1):
                if step + 1 in held:  # the next feed's logits predict reference[step + 1]
                    held[step + 1][name] = before
                stream.feed(torch.tensor([[reference[step]]]))
                now = held_by_head(stream.cache, len(layers), kv_heads)
                if name == args.policy:
                    for index, heads in enumerate(now):
                        for head, positions in enumerate(heads):
                            left_at.update(((index, head, p), step) for p in before[index][head] - positions)
                before = now

    sequence = torch.cat([ids[0], torch.tensor(reference)])[None]
    attentions = model(sequence, output_attentions=True).attentions
    texts = [tokenizer.decode([token]) for token in sequence[0].tolist()]
    print(f"{problem.id}: {prompt_len}-token prompt, K = {configs[args.policy].budget}, evicting layers {layers}")
    for step in spikes:
        query = prompt_len + step - 1  # the position whose logits predict reference[step]
        print(
            f"\nstep {step}: KL {kl[step]:.3f} predicting {texts[query + 1]!r} after {texts[query]!r} (position "
            f"{query})"
        )
        for index, layer in enumerate(layers):
            for head in range(kv_heads):
                weights = (
                    attentions[layer][0, head * group : (head + 1) * group, query, : query + 1].float().mean(dim=0)
                )
                lost = sorted(
                    p for p in held[step]["streaming"][index][head] - held[step][args.policy][index][head] if p <= query
                )
                mass = float(weights[lost].sum()) if lost else 0.0
                heaviest = sorted(lost, key=lambda p: -float(weights[p]))[: args.top]
                listed = ", ".join(
                    f"{p} {texts[p]!r} {float(weights[p]):.3f} (left at {when(left_at.get((index, head, p)))})"
                    for p in heaviest
                )
                print(
                    f"  layer {layer} KV head {head}: {mass:.3f} on {len(lost)} tokens evicted here, held by "
                    f"streaming: {listed}"
                )


if __name__ == "__main__":
    main()
