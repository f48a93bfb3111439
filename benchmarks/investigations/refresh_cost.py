"""Cost of one layer's ``epikv2`` refresh (:func:`received_by_head`) against the number of cached keys,
optionally interleaved with another checkout's, in one process.

The refresh computes, every ``period`` steps, the attention of a layer's last queries to each of its
cached keys (one ``[queries x K]`` product per KV head, the causal mask, a softmax, sums). Shapes default
to SmolLM2-135M's (9 query heads over 3 KV heads of 64 dimensions, 16 queries). With ``--baseline DIR``
the same inputs go through ``DIR``'s ``epikv_cli`` too, alternately, round by round, so that both see the
same machine; the medians over rounds are printed, and whether the two results are equal.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/refresh_cost.py --keys 513,4096 --baseline /tmp/head
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

from epikv_cli.policies.epikv2 import received_by_head


def baseline_function(checkout: Path):
    """``received_by_head`` of the ``epikv_cli`` package in ``checkout``, imported under another name."""
    package = checkout / "epikv_cli"
    spec = importlib.util.spec_from_file_location(
        "epikv_baseline", package / "__init__.py", submodule_search_locations=[str(package)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["epikv_baseline"] = module
    spec.loader.exec_module(module)
    return importlib.import_module("epikv_baseline.policies.epikv2").received_by_head


def inputs(keys: int, heads: int, kv_heads: int, queries: int, dim: int, dtype: torch.dtype):
    """Queries at the newest positions; each KV head holds them and older tokens, in a shuffled slot order."""
    generator = torch.Generator().manual_seed(keys)
    seen = keys + 1000
    query_positions = torch.arange(seen - queries, seen)
    key_positions = torch.stack(
        [
            torch.cat([torch.randperm(seen - queries, generator=generator)[: keys - queries], query_positions])[
                torch.randperm(keys, generator=generator)
            ]
            for _ in range(kv_heads)
        ]
    )
    q = torch.randn(heads, queries, dim, generator=generator).to(dtype)
    k = torch.randn(kv_heads, keys, dim, generator=generator).to(dtype)
    return q, k, query_positions, key_positions


def seconds_per_call(function, arguments, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        function(*arguments, scaling=0.125)
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", default="513,4096", help="cached keys per KV head, comma-separated")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--queries", type=int, default=16)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--baseline", type=Path, help="another checkout, whose received_by_head is timed alternately")
    args = parser.parse_args()
    functions = {"this tree": received_by_head}
    if args.baseline is not None:
        functions["baseline"] = baseline_function(args.baseline)
    print(
        f"{'keys':>6} "
        + " ".join(f"{name + ' us':>14}" for name in functions)
        + ("   equal" if len(functions) > 1 else "")
    )
    for keys in (int(k) for k in args.keys.split(",")):
        arguments = inputs(keys, args.heads, args.kv_heads, args.queries, args.dim, getattr(torch, args.dtype))
        calls = max(3, 100_000 // keys)
        times: dict[str, list[float]] = {name: [] for name in functions}
        for _ in range(args.rounds):
            for name, function in functions.items():
                times[name].append(seconds_per_call(function, arguments, calls))
        line = f"{keys:>6} " + " ".join(f"{1e6 * statistics.median(times[name]):14.1f}" for name in functions)
        if len(functions) > 1:
            results = [function(*arguments, scaling=0.125) for function in functions.values()]
            line += f"   {torch.equal(results[0], results[1])}"
        print(line)


if __name__ == "__main__":
    main()
