"""Where a granular ``epikv2`` decode step spends its own time, inside a real generation: wall-clock
timers around the refresh's product (:func:`received_by_layers`), the short list's rebuild and pick, the
release of the victims and the whole of the policy's stage, per decode step (amortised over the steps).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/stage_parts.py --model /tmp/smol-long/config.json \\
        --budget 4096 --policy epikv2:queries=4

The prompt is ``budget + 100`` tokens of the bundled passage (cut to K at the prefill), so every step
evicts. The timers add a few microseconds per call of their own.
"""

from __future__ import annotations

import argparse
import collections
import time

from batch_step_split import timed  # run as a script: benchmarks/ is on the path

from epikv_cli.config import ModelSettings, SamplingSettings
from epikv_cli.core import keepsets
from epikv_cli.experiments.profile import ProfileSettings, prompt_ids
from epikv_cli.models.loading import load
from epikv_cli.policies import epikv2
from epikv_cli.runtime.generation import Generation

PIECES = [
    (epikv2, "received_by_layers", "refresh product (received_by_layers)"),
    (keepsets.Shortlist, "build", "short list rebuild"),
    (keepsets.Shortlist, "pick", "short list pick"),
    (keepsets.HeadSlots, "release", "release"),
    (epikv2.EpiKV2, "_stage_heads", "stage, in all"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="as epikv's --model (default: the demo model)")
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--policy", default="epikv2", help="an epikv2 spec, e.g. epikv2:queries=4")
    parser.add_argument("--steps", type=int, default=96, help="decode steps timed (after the first)")
    args = parser.parse_args()
    settings = ProfileSettings(
        ProfileSettings.parse_policies(args.policy), args.budget, args.budget + 100, args.steps + 1, repeats=1
    )
    if settings.runs[0].policy != "epikv2":
        parser.error("--policy: an epikv2 spec")

    spent: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    timed(spent, PIECES, calls)

    loaded = load(ModelSettings(model=args.model))
    ids = prompt_ids(loaded.tokenizer, settings.prompt_tokens, None)
    sampling = SamplingSettings(max_new_tokens=args.steps + 1, ignore_eos=True)
    steps = iter(Generation(loaded.model, loaded.tokenizer, ids, settings.cache_for(settings.runs[0]), sampling))
    next(steps)  # the prefill and the first token
    spent.clear()
    calls.clear()
    start = time.perf_counter()
    for _ in steps:
        pass
    step_ms = (time.perf_counter() - start) * 1000 / args.steps
    print(f"{args.policy} at K = {args.budget}: {step_ms:.2f} ms per decode step over {args.steps} steps")
    for label, seconds in spent.items():
        print(
            f"  {label:36} {seconds * 1000 / args.steps:7.3f} ms/step  ({calls[label]} calls, "
            f"{seconds * 1000 / calls[label]:.3f} ms each)"
        )


if __name__ == "__main__":
    main()
