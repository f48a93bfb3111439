"""Per-step cost of the cache and its policy, without the model: does it grow with K?

Builds a :class:`~epikv_cli.cache.BudgetCache` on a model's KV layout (default: QwQ-32B, 64 layers,
8 KV heads, head_dim 128) with synthetic keys and values, fills it to K, then times steady-state
decode steps. A step is what the session does after each forward, minus the forward itself: append
one token's key and value to every layer, let the policy observe it (synthetic hidden states at its
tap layers), select, evict. Sizes and policies are interleaved round by round; each round's median
and mean step time are kept and their medians over rounds reported, with the ratios to the smallest K.
The median is a typical step; the mean counts the work some policies do every few steps (``epikv2``
rebuilds its short list from all K scores at each refresh), amortised, which the median leaves out.

    .venv/bin/python benchmarks/step_cost.py                      # K = 1024, 8192, 32768; streaming, epikv, lagkv
    .venv/bin/python benchmarks/step_cost.py --budgets 1024,8192 --policies epikv2,h2o --steps 50

Memory: a bfloat16 cache of K = 32768 on this layout holds 8.6 GB of keys and values.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoConfig

from epikv_cli.config import CacheSettings
from epikv_cli.core.cache import BudgetCache
from epikv_cli.core.hostread import host_copies
from epikv_cli.core.view import Moves
from epikv_cli.models.shapes import shape_config
from epikv_cli.policies.base import Signals
from epikv_cli.policies.registry import make_policy, parse_policy_spec
from epikv_cli.runtime.step import choose, follow, observe


def build(config, budget: int, policy_name: str, dtype: torch.dtype, seed: int):
    """A cache of ``budget`` live entries per layer under ``policy_name``, ready for steady-state steps."""
    text = config.get_text_config(decoder=True)
    heads, dim = (
        text.num_key_value_heads,
        getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
    )
    name, options = parse_policy_spec(policy_name)
    policy = make_policy(CacheSettings(budget=budget, policy=name, seed=seed, options=options))
    if policy.attention_needs is not None:
        raise SystemExit(f"{policy_name} reads attention from the forward; this benchmark has no forward")
    policy.setup(text.num_hidden_layers)
    cache = BudgetCache(config, budget, slack=policy.slack, granular=policy.granular)
    generator = torch.Generator().manual_seed(seed)
    prompt = budget // 2
    block = torch.randn(1, heads, prompt, dim, generator=generator).to(dtype)
    for layer in range(text.num_hidden_layers):
        cache.update(block, block, layer)
    appended = cache.commit()
    taps = policy.tap_layers()
    last = {layer: torch.randn(1, 1, text.hidden_size, generator=generator) for layer in taps}
    policy.observe(Signals(appended, True, last, None, cache))
    token = torch.randn(1, heads, 1, dim, generator=generator).to(dtype)
    states = [{layer: torch.randn(1, 1, text.hidden_size, generator=generator) for layer in taps} for _ in range(8)]

    def step(i: int) -> None:
        for layer in range(text.num_hidden_layers):
            cache.update(token, token, layer)
        new = cache.commit()
        observed = observe(policy, Signals(new, False, states[i % len(states)], None, cache))
        evicted = cache.evict(choose(policy, observed, host_copies(observed.reads), cache))
        follow(policy, Moves(evicted.holes, evicted.movers))

    while cache.stored < budget:  # fill to K; from here every step evicts one token
        step(0)
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwq-32b", help="a known shape, or a config.json or model directory")
    parser.add_argument("--budgets", default="1024,8192,32768")
    parser.add_argument("--policies", default="streaming,epikv,lagkv")
    parser.add_argument("--steps", type=int, default=100, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steady on a shared machine)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # a known shape, or a model's config.json / directory (e.g. the demo model's)
    config = AutoConfig.from_pretrained(args.shape) if Path(args.shape).exists() else shape_config(args.shape)
    budgets = [int(b) for b in args.budgets.split(",")]
    policies = args.policies.split(",")
    dtype = getattr(torch, args.dtype)
    times: dict[tuple[str, int], list[float]] = {(p, k): [] for p in policies for k in budgets}
    means: dict[tuple[str, int], list[float]] = {(p, k): [] for p in policies for k in budgets}
    for round_ in range(args.rounds):
        for budget in budgets:
            for name in policies:
                step = build(config, budget, name, dtype, seed=round_)
                for i in range(5):  # warm-up
                    step(i)
                per_step = []
                for i in range(args.steps):
                    start = time.perf_counter()
                    step(i)
                    per_step.append(time.perf_counter() - start)
                times[(name, budget)].append(statistics.median(per_step))
                means[(name, budget)].append(statistics.fmean(per_step))
                del step
                gc.collect()
    rows = []
    for name in policies:
        base = statistics.median(times[(name, budgets[0])])
        base_mean = statistics.median(means[(name, budgets[0])])
        for budget in budgets:
            ms = statistics.median(times[(name, budget)]) * 1e3
            mean_ms = statistics.median(means[(name, budget)]) * 1e3
            rows.append(
                {
                    "policy": name,
                    "budget": budget,
                    "step_ms": round(ms, 3),
                    "ratio_to_first_budget": round(ms / (base * 1e3), 2),
                    "mean_step_ms": round(mean_ms, 3),
                    "mean_ratio_to_first_budget": round(mean_ms / (base_mean * 1e3), 2),
                }
            )
    if args.json:
        print(
            json.dumps(
                {"shape": args.shape, "dtype": args.dtype, "steps": args.steps, "rounds": args.rounds, "results": rows}
            )
        )
        return
    print(
        f"{args.shape} KV layout, {args.dtype}, {args.threads} thread(s), median of {args.rounds} rounds x "
        f"{args.steps} steps"
    )
    print(
        f"{'policy':10s} {'K':>7s} {'median ms':>10s} {'vs K=' + str(budgets[0]):>10s} {'mean ms':>9s} "
        f"{'vs K=' + str(budgets[0]):>10s}"
    )
    for row in rows:
        print(
            f"{row['policy']:10s} {row['budget']:7d} {row['step_ms']:10.3f} {row['ratio_to_first_budget']:10.2f}"
            f" {row['mean_step_ms']:9.3f} {row['mean_ratio_to_first_budget']:10.2f}"
        )


if __name__ == "__main__":
    main()
