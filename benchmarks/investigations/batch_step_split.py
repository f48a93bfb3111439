"""Where a batched decode step's time goes: the model forward against each piece of the policies' work.

B copies of a prompt of real text (the profile passage) are prefilled and decoded together, in one
process, for each policy in turn (``--rounds`` times, interleaved); the pieces named below are timed
with wrappers (their time includes what they call, so the lines overlap: ``decoder.forward`` holds
the model and everything run inside or after it, ``decoder.settle`` the eviction).

    .venv/bin/python benchmarks/investigations/batch_step_split.py --policies streaming,epikv2 --batch-size 8 \\
        --budget 512 --prompt-tokens 1024

``--trace`` also prints each timed step of the last round (a refresh step stands out from the others).
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import time

import torch

from epikv_cli.config import CacheSettings, ModelSettings
from epikv_cli.core import attention, keepsets, rows
from epikv_cli.experiments.profile import prompt_ids
from epikv_cli.models.loading import load
from epikv_cli.policies import epikv2
from epikv_cli.policies.registry import parse_policy_spec
from epikv_cli.runtime import batched
from epikv_cli.runtime.batched import BatchDecoder

TIMED = [
    (batched.BatchDecoder, "forward", "decoder.forward (model + stage)"),
    (batched.BatchDecoder, "_stage", "decoder._stage (policies observe)"),
    (batched.BatchDecoder, "settle", "decoder.settle (policies select, rows evict)"),
    (rows.RowsCache, "begin_step", "rows.begin_step"),
    (rows.RowsCache, "end_step", "rows.end_step"),
    (rows.RowsCache, "evict", "rows.evict"),
    (rows.RowsLayer, "update", "rows layer writes"),
    (attention.AttentionTaps, "observe", "attention taps (ring writes included)"),
    (attention.QueryRing, "write", "query ring writes"),
    (epikv2, "received_by_layers", "epikv2 refresh (received_by_layers)"),
    (keepsets.Shortlist, "pick", "epikv2 short-list pick"),
    (keepsets.Shortlist, "build", "epikv2 short-list build"),
    (keepsets.HeadSlots, "append", "head map append"),
    (keepsets.HeadSlots, "release", "head map release"),
]


def timed(seconds: dict[str, float], pieces=TIMED, calls: collections.Counter | None = None) -> None:
    """Wrap every ``(owner, name, label)`` of ``pieces`` so that it adds its wall time to ``seconds[label]``
    (and, given ``calls``, counts its calls there). A classmethod is wrapped bound: call it on the class."""
    for owner, name, label in pieces:
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapper(*args, _original=original, _label=label, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                seconds[_label] += time.perf_counter() - start
                if calls is not None:
                    calls[_label] += 1

        setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="streaming,epikv2")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=48, help="timed steps per run (after 8 untimed)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--trace", action="store_true", help="also print every timed step's ms (the last round)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load(ModelSettings())
    ids = prompt_ids(loaded.tokenizer, args.prompt_tokens)
    seconds: dict[str, float] = collections.defaultdict(float)
    timed(seconds)
    per_step: dict[str, dict[str, list[float]]] = {
        spec: collections.defaultdict(list) for spec in args.policies.split(",")
    }
    traces: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for spec in per_step:
            name, options = parse_policy_spec(spec)
            settings = CacheSettings(budget=None if name == "full" else args.budget, policy=name, options=options)
            with torch.inference_mode(), BatchDecoder(loaded.model, [settings]) as decoder:
                tokens = torch.stack([decoder.add(ids, settings) for _ in range(args.batch_size)]).argmax(dim=-1)
                for _ in range(8):
                    tokens = decoder.step(tokens).argmax(dim=-1)
                seconds.clear()
                start = time.perf_counter()
                steps = [start]
                for _ in range(args.steps):
                    tokens = decoder.step(tokens).argmax(dim=-1)
                    steps.append(time.perf_counter())
                per_step[spec]["whole step"].append((steps[-1] - start) / args.steps)
                traces[spec] = [1000 * (b - a) for a, b in zip(steps, steps[1:])]
            for label, total in seconds.items():
                per_step[spec][label].append(total / args.steps)
    labels = ["whole step"] + [label for _, _, label in TIMED]
    print(
        f"ms per step, median of {args.rounds} rounds; batch {args.batch_size}, K = {args.budget}, prompt "
        f"{args.prompt_tokens}"
    )
    print(f"{'':46s}" + "".join(f"{spec:>14s}" for spec in per_step))
    for label in labels:
        cells = [
            statistics.median(per_step[spec][label]) * 1000 if per_step[spec].get(label) else None for spec in per_step
        ]
        if any(cells):
            print(f"{label:46s}" + "".join(f"{cell:14.3f}" if cell is not None else f"{'-':>14s}" for cell in cells))
    if args.trace:
        for spec, trace in traces.items():
            print(f"{spec} ms per step: " + " ".join(f"{ms:.0f}" for ms in trace))


if __name__ == "__main__":
    main()
