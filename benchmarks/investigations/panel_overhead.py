"""Does the live panel slow decoding? Decode tokens/s with the panel drawing vs without, interleaved.

    .venv/bin/python benchmarks/panel_overhead.py [--pairs 7] [--tokens 200] [--budget 128]

Loads the demo model once, then alternates runs with and without the panel (drawn to a terminal
console whose output is discarded, so the full rendering cost is paid) and prints the median decode
tokens/s of each and their ratio. The target is a ratio of at least 0.97.
"""

from __future__ import annotations

import argparse
import os
import statistics

from rich.console import Console

from epikv_cli.cli.ui import LivePanel, PanelState, PanelView
from epikv_cli.config import CacheSettings, ModelSettings, SamplingSettings
from epikv_cli.core.memory import peak_memory
from epikv_cli.data.prompts import build_input_ids
from epikv_cli.models.loading import load
from epikv_cli.runtime.generation import Generation
from epikv_cli.runtime.stream import input_device

PROMPT = "Explain step by step how a bicycle stays upright."


def one_run(loaded, ids, cache, sampling, panel: bool) -> tuple[float, int]:
    generation = Generation(loaded.model, loaded.tokenizer, ids, cache, sampling)
    if not panel:
        for _ in generation:
            pass
        return generation.result.decode_tokens_per_s, 0
    with open(os.devnull, "w") as sink:
        console = Console(file=sink, force_terminal=True, width=120, height=50)
        state = PanelState(budget=cache.budget, prompt_ids=ids[0].tolist(), has_scores=generation.policy_has_scores)
        device = input_device(loaded.model)
        with LivePanel(console, state, PanelView(state, loaded.tokenizer), lambda: peak_memory(device)[0]) as live:
            for event in generation:
                live.update(event)
    return generation.result.decode_tokens_per_s, live.draws


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--budget", type=int, default=128)
    args = parser.parse_args()
    loaded = load(ModelSettings())
    ids = build_input_ids(loaded.tokenizer, PROMPT)
    cache = CacheSettings(budget=args.budget, policy="epikv")
    sampling = SamplingSettings(max_new_tokens=args.tokens, ignore_eos=True)
    one_run(loaded, ids, cache, sampling, panel=True)  # warm-up
    with_panel, without, draws = [], [], []
    for pair in range(args.pairs):
        order = (True, False) if pair % 2 == 0 else (False, True)
        for panel in order:
            speed, drawn = one_run(loaded, ids, cache, sampling, panel)
            (with_panel if panel else without).append(speed)
            if panel:
                draws.append(drawn)
    a, b = statistics.median(with_panel), statistics.median(without)
    print(f"decode tok/s, median of {args.pairs}: panel {a:.2f}, no panel {b:.2f}; ratio {a / b:.3f}")
    print(f"panel draws per run: median {statistics.median(draws):.0f} for {args.tokens} tokens")


if __name__ == "__main__":
    main()
