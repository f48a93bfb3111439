"""Decode-step time of several policies, measured step against step: one generation per policy, all on one
model, advanced in turn (A B C, then C B A, ...), so that a slow second of a shared machine falls on every
policy alike. Reports each policy's mean and median step, the median of its per-step difference from the
first policy, and the ratio of mean step times (the first policy's over each one's: a decode tokens/s ratio).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/paired_steps.py --policies streaming,epikv2 --budget 512 \\
        --prompt-tokens 1024 --new-tokens 300

A prompt longer than K is cut to K at the prefill, so every step evicts (prompt-protecting policies such as
epikv then need --prompt-tokens below K).
"""

from __future__ import annotations

import argparse
import statistics
import time

from epikv_cli.config import ModelSettings, SamplingSettings
from epikv_cli.errors import UsageError
from epikv_cli.experiments.profile import ProfileSettings, prompt_ids
from epikv_cli.models.loading import load
from epikv_cli.runtime.generation import Generation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="as epikv's --model (default: the demo model)")
    parser.add_argument("--policies", default="streaming,epikv2", help="the first is the reference")
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=300)
    args = parser.parse_args()

    # profile's own parsing and budget checks: a policy that cannot hold the prompt is named before the model loads
    try:
        settings = ProfileSettings(
            ProfileSettings.parse_policies(args.policies), args.budget, args.prompt_tokens, args.new_tokens, repeats=1
        )
        settings.check_budgets()
    except UsageError as error:
        parser.error(str(error))
    if any(run.kernel for run in settings.runs):
        parser.error("--policies: every generation shares the model's kernel here; drop the @kernel")
    labels = [run.label for run in settings.runs]
    loaded = load(ModelSettings(model=args.model))
    ids = prompt_ids(loaded.tokenizer, args.prompt_tokens, None)
    sampling = SamplingSettings(max_new_tokens=args.new_tokens, ignore_eos=True)
    steps = [
        iter(Generation(loaded.model, loaded.tokenizer, ids, settings.cache_for(run), sampling))
        for run in settings.runs
    ]
    for generation in steps:
        next(generation)  # the prefill and the first token
    times: list[list[float]] = [[] for _ in labels]
    for step in range(args.new_tokens - 1):
        order = range(len(labels)) if step % 2 == 0 else reversed(range(len(labels)))
        for index in order:
            start = time.perf_counter()
            next(steps[index])
            times[index].append(time.perf_counter() - start)
    for generation in steps:
        generation.close()
    reference = times[0]
    print(f"{'policy':24} {'mean ms':>8} {'median ms':>9} {'paired median diff ms':>22} {'tok/s ratio':>11}")
    for label, own in zip(labels, times):
        difference = statistics.median(a - b for a, b in zip(own, reference))
        ratio = statistics.fmean(reference) / statistics.fmean(own)
        print(
            f"{label:24} {1000 * statistics.fmean(own):8.2f} {1000 * statistics.median(own):9.2f} "
            f"{1000 * difference:22.2f} {ratio:11.4f}"
        )


if __name__ == "__main__":
    main()
