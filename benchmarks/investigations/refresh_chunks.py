"""Cost of a whole ``epikv2`` refresh (:func:`received_by_layers`, every layer at once) against how many bytes
of float32 logits it computes together, at several numbers of cached keys, in one process.

The refresh groups layers into chunks of at most ``REFRESH_CHUNK_BYTES`` of logits (per device type). This
sets the CPU's chunk to each value of ``--chunks`` in turn (MiB; 0: one layer per chunk), round by round,
and prints the median milliseconds per refresh. Shapes default to SmolLM2-135M's (30 layers, 9 query heads
over 3 KV heads of 64 dimensions, 16 queries).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/refresh_chunks.py --keys 513,1024,2048,4200,8192 --chunks 0,2,4,16,64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from epikv_cli.policies import epikv2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", default="513,4200", help="cached keys per KV head, comma-separated")
    parser.add_argument(
        "--chunks", default="0,2,4,16,64", help="chunk sizes in MiB, comma-separated (0: one layer each)"
    )
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--queries", type=int, default=16)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]
    generator = torch.Generator().manual_seed(0)
    print(f"{'keys':>6} " + " ".join(f"{f'{c} MiB ms':>11}" for c in chunks))
    for keys in (int(k) for k in args.keys.split(",")):
        queries = [torch.randn(args.heads, args.queries, args.dim, generator=generator) for _ in range(args.layers)]
        cached = [torch.randn(args.kv_heads, keys, args.dim, generator=generator) for _ in range(args.layers)]
        positions = torch.arange(keys).expand(args.layers, args.kv_heads, keys)
        query_positions = torch.arange(keys - args.queries, keys)
        times: dict[int, list[float]] = {c: [] for c in chunks}
        for _ in range(args.rounds):
            for chunk in chunks:
                epikv2.REFRESH_CHUNK_BYTES = {"cpu": chunk << 20}
                start = time.perf_counter()
                epikv2.received_by_layers(queries, cached, query_positions, positions, [None] * args.layers)
                times[chunk].append(time.perf_counter() - start)
        print(f"{keys:>6} " + " ".join(f"{1e3 * statistics.median(times[c]):11.2f}" for c in chunks), flush=True)


if __name__ == "__main__":
    main()
