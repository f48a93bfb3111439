"""What the copy and loop searches add to one ``epikv2`` refresh of every evicting layer (:func:`refresh_layers`).

A refresh computes the softmax weights of a layer's recent queries over its cached keys; ``copy`` also
finds, per query, the most-weighted key beyond the recent window, and ``loop`` the most-weighted key inside
it from ``--loop`` tokens back. The three variants (no search, ``copy``, ``copy`` and ``loop``) run on the same
synthetic keys, alternately, round by round; the medians over rounds are printed, in milliseconds per
refresh (a refresh comes every 16 decode steps by default). Shapes default to SmolLM2-135M's (30 layers,
9 query heads over 3 KV heads of 64 dimensions, 16 queries).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/refresh_search.py --keys 513,4096 --rounds 21
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from epikv_cli.policies.epikv2 import refresh_layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", default="513,4096", help="comma-separated numbers of cached keys per head")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--queries", type=int, default=16)
    parser.add_argument("--recent", type=float, default=0.75, help="the recent window's share of the keys")
    parser.add_argument("--loop", type=int, default=32)
    args = parser.parse_args()
    if args.rounds < 1 or args.heads % args.kv_heads:
        parser.error("--rounds must be 1 or more and --heads a multiple of --kv-heads")
    try:
        counts = [int(part) for part in args.keys.split(",")]
    except ValueError:
        parser.error(f"--keys {args.keys!r}: give whole numbers separated by commas, e.g. 513,4096")
    if min(counts) <= args.loop + args.queries:
        parser.error(f"--keys: each count must exceed --loop + --queries ({args.loop + args.queries})")

    torch.set_grad_enabled(False)
    generator = torch.Generator().manual_seed(0)
    layers, kv_heads, w = args.layers, args.kv_heads, args.queries
    print(
        f"ms per refresh ({layers} layers, {args.heads} query / {kv_heads} KV heads, {w} queries), median of "
        f"{args.rounds}"
    )
    print(f"{'keys':>6} {'no search':>10} {'copy':>10} {'copy+loop':>10}")
    for n in counts:
        seen = n + 100  # the oldest 100 positions (past the sinks) are gone, the rest held in scrambled slots
        queries = [torch.randn(args.heads, w, args.head_dim, generator=generator) for _ in range(layers)]
        keys = [torch.randn(kv_heads, n, args.head_dim, generator=generator) for _ in range(layers)]
        held = torch.stack([torch.randperm(n - 4, generator=generator) for _ in range(layers * kv_heads)]) + 104
        positions = torch.cat([torch.arange(4).expand(layers * kv_heads, 4), held], dim=1).view(layers, kv_heads, n)
        recent = int(args.recent * n)
        beyond = (positions >= 4) & (positions < seen - recent)
        inside = (positions >= seen - recent) & (positions < seen - args.loop)
        variants = {"no search": None, "copy": beyond, "copy+loop": torch.stack([beyond, inside])}
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, far in variants.items():
                start = time.perf_counter()
                refresh_layers(queries, keys, torch.arange(seen - w, seen), positions, [None] * layers, None, far)
                times[name].append(time.perf_counter() - start)
        print(f"{n:>6} " + " ".join(f"{statistics.median(times[name]) * 1e3:>10.2f}" for name in variants))


if __name__ == "__main__":
    main()
