"""Where one ``epikv2`` refresh of one request goes: :func:`refresh_layers` over every layer, as the default policy
runs it (``copy`` on: the largest weight each query gives the keys beyond the recent window, and inside it from
``loop`` tokens back), on the demo model's shapes (30 layers, 9 query heads over 3 KV heads of 64 dimensions, 16
queries, 513 keys). Prints the median time of a refresh and the torch operations that take it (cProfile).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/refresh_parts.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

from epikv_cli.policies.epikv2 import refresh_layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--keys", type=int, default=513)
    parser.add_argument("--queries", type=int, default=16)
    parser.add_argument("--seen", type=int, default=2000, help="tokens seen so far (positions of the keys)")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    heads, kv_heads, dim, width, seen = 9, 3, 64, args.queries, args.seen
    pages = torch.randn(args.layers, kv_heads, 2, args.keys, dim, generator=generator).to(dtype)
    keys = [pages[layer, :, 0] for layer in range(args.layers)]  # the ring's layout: a head's keys, then its values
    queries = [torch.randn(heads, width, dim, generator=generator).to(dtype) for _ in range(args.layers)]
    positions = torch.stack(
        [torch.randperm(seen - width, generator=generator)[: args.keys - width] for _ in range(args.layers * kv_heads)]
    ).view(args.layers, kv_heads, -1)
    newest = torch.arange(seen - width, seen).expand(args.layers, kv_heads, width)
    positions = torch.cat([positions, newest], dim=-1)
    sinks, recent, loop = 4, 384, 32  # epikv2's defaults at K = 512
    scored, old = positions >= sinks, positions < seen - recent
    far = torch.stack([scored & old, scored & ~old & (positions < seen - loop)])

    def refresh() -> None:
        refresh_layers(queries, keys, torch.arange(seen - width, seen), positions, [dim**-0.5] * args.layers, None, far)

    refresh()
    times = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        for _ in range(5):
            refresh()
        times.append((time.perf_counter() - start) / 5 * 1e3)
    print(f"one refresh ({args.dtype}, {args.layers} layers, {args.keys} keys): {statistics.median(times):.2f} ms")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(20):
        refresh()
    profile.disable()
    print("per refresh, the operations (ms, cProfile: 20 refreshes):")
    stats = pstats.Stats(profile).stats
    rows = sorted(((own, name) for (_, _, name), (_, _, own, _, _) in stats.items()), reverse=True)
    for own, name in rows[:8]:
        print(f"  {own / 20 * 1e3:6.2f}  {name}")


if __name__ == "__main__":
    main()
