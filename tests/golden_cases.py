"""Golden outputs: what every policy does, recorded before the code was restructured (issue 36).

Each case runs one policy spec on one model, alone (batch 1) or in a batch of four rows, and records the
chosen token ids, the logical positions evicted at every step and the summary counts. The recorded file,
``tests/golden/outputs.json``, was written by ``python tests/golden_cases.py --write`` at commit 5def55e,
before any module moved; ``tests/test_golden.py`` replays every case with the code of today and requires
the same outputs exactly. Only :func:`run_case` knows the engine's API.

Runs on one torch thread (the recording did too), so that reductions happen in one order. The tiny models run in
float64: their float32 recording held on Intel CPUs (AVX-512) but not on AMD ones (AVX2), where one knorm decision in
a batch (a near-tie in float32) went the other way. Their cases were recorded again in float64 by the code
of b68b429 (5def55e's engine): ``tests/golden/record_tiny_float64.py`` says how. 99 of the 100 equal the float32
recording; the demo model's cases (float32) hold on both CPUs as recorded.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from conftest import make_tokenizer, tiny_model  # noqa: E402

GOLDEN = HERE / "golden" / "outputs.json"
#: Tiny models: Llama (every layer evicts) and Gemma 3 (five sliding layers, one global).
TINY = ("llama", "gemma3")
DEMO = "demo"
#: The documented epikv2 variants (its docstring and docs/policies.md), each a spec of its own.
EPIKV2_VARIANTS = (
    "epikv2:keep=global",
    "epikv2:keep=layer",
    "epikv2:adapt=1",
    "epikv2:copy=0",
    "epikv2:loop=0",
    "epikv2:keep=global:signal=epiphany",
    "epikv2:signal=none",
    "epikv2:keep=global:credit=mean",
    "epikv2:keep=global:credit=max",
    "epikv2:values=1",
    "epikv2:keep=global:pool=7",
    "epikv2:prompt=keep:recent=0.25",
    "epikv2:period=8:queries=4",
    "epikv2:decay=0.5",
)
POLICY_NAMES = ("epikv", "epikv2", "full", "h2o", "knorm", "lagkv", "random", "rkv", "streaming", "tova")
SPECS = POLICY_NAMES + ("lagkv:chunks=positions",) + EPIKV2_VARIANTS
TINY_LENGTHS = (9, 20, 5, 31)
#: 186 tokens with the chat template: R-KV, which waits for K + 128 entries, evicts at its prefill (alone, and in
#: the batch), and every policy decides over a long prompt in one row of the batch.
LONG_QUESTION = (
    "A farmer keeps chickens, goats and cows on a small farm beside a river. Every morning she counts the animals "
    "before letting them out to graze. On Monday she counted 34 heads and 98 legs among the chickens and goats alone, "
    "and she knows that there are four more cows than goats. On Tuesday two of the goats wandered off along the river "
    "bank and were found the next day near the old mill, together with a cow from the neighbouring farm that had "
    "followed them. The farmer decided to keep that cow until its owner came back from the market on Friday. "
    "How many chickens, goats and cows did she have on Wednesday evening, counting the visiting cow, and how many "
    "legs did all of these animals have together? Explain each step of your reasoning carefully before answering."
)
DEMO_QUESTIONS = (
    "What is 17 times 23? Think step by step.",
    "Why is the sum of two odd numbers even?",
    "List three prime numbers.",
    LONG_QUESTION,
)
STEPS = {"tiny": 48, "demo": 32}
#: K above the policy's smallest workable budget for each row's prompt (the demo model: evictions start sooner).
MARGIN = {"tiny": 12, "demo": 4}
#: R-KV compresses only once K + 128 entries are stored.
RKV_EXTRA = 128
#: A fixed random bias per step on the tiny models' logits: left alone a tiny random model repeats one token.
BIAS = torch.randn(STEPS["tiny"] + RKV_EXTRA, 272, generator=torch.Generator().manual_seed(0)) * 2


def case_id(model: str, spec: str, batch: int) -> str:
    return f"{model}|{spec}|b{batch}"


def all_cases() -> list[tuple[str, str, int]]:
    return [(model, spec, batch) for model in (*TINY, DEMO) for spec in SPECS for batch in (1, 4)]


# ---- the only part that knows the engine ------------------------------------------------------------------
def _api():
    from epikv_cli.config import CacheSettings, SamplingSettings
    from epikv_cli.policies.registry import make_policy, parse_policy_spec
    from epikv_cli.runtime.batched import BatchDecoder
    from epikv_cli.runtime.generation import Generation
    from epikv_cli.runtime.stream import CacheStream

    return BatchDecoder, CacheStream, Generation, make_policy, parse_policy_spec, CacheSettings, SamplingSettings


def settings_for(spec: str, budget: int | None):
    *_, parse_policy_spec, CacheSettings, _ = _api()
    name, options = parse_policy_spec(spec)
    return CacheSettings(budget=None if name == "full" else budget, policy=name, options=options)


def smallest_budget(spec: str, prompt_len: int, margin: int) -> int | None:
    """What the recording used: the policy's smallest workable K for the prompt, plus ``margin``."""
    *_, make_policy, parse_policy_spec, CacheSettings, _ = _api()
    name, options = parse_policy_spec(spec)
    if name == "full":
        return None
    policy = make_policy(CacheSettings(budget=1 << 20, policy=name, options=options))
    return policy.min_budget(prompt_len) + margin


def _row_record(tokens: list[int], evicted: list[list[int]], evicted_total: int, peak: int, stored: int) -> dict:
    return {"tokens": tokens, "evicted": evicted, "evicted_total": evicted_total, "peak_stored": peak, "stored": stored}


def run_case(
    model, tokenizer, prompts: list[torch.Tensor], spec: str, budgets: list[int | None], steps: int, biased: bool
) -> list[dict]:
    """Per row: chosen tokens, evicted positions per step, and the cache's counts at the end. One prompt runs
    alone, several as the rows of one batch, row ``i`` under ``budgets[i]``."""
    BatchDecoder, CacheStream, Generation, _, _, _, SamplingSettings = _api()
    settings = [settings_for(spec, budget) for budget in budgets]

    def choose(logits: torch.Tensor, step: int) -> torch.Tensor:
        return (logits + BIAS[step]).argmax(-1) if biased else logits.argmax(-1)

    if len(prompts) == 1 and not biased:  # the user's path: Generation (deferred host reads, greedy sampler)
        run = Generation(
            model, tokenizer, prompts[0], settings[0], SamplingSettings(max_new_tokens=steps, ignore_eos=True)
        )
        events = list(run)
        result = run.result
        return [
            _row_record(
                [e.token_id for e in events],
                [sorted(e.evicted) for e in events],
                result.evicted,
                result.peak_stored,
                events[-1].stored,
            )
        ]
    if len(prompts) == 1:  # the replay primitive: one sequence, its reads settled at once
        tokens, evicted = [], []
        with CacheStream(model, settings[0], max_tokens=prompts[0].shape[1] + steps) as stream:
            out = stream.feed(prompts[0])
            for step in range(steps):
                evicted.append(sorted(stream.session.last.evicted))
                token = int(choose(out, step))
                tokens.append(token)
                out = stream.feed(torch.tensor([[token]]))
            cache = stream.cache
            return [_row_record(tokens, evicted, cache.evicted_total, cache.peak_stored, cache.stored)]
    rows = [{"tokens": [], "evicted": []} for _ in prompts]
    with BatchDecoder(model, settings) as decoder:
        logits = [decoder.add(ids, row, ids.shape[1] + steps) for ids, row in zip(prompts, settings)]
        for index in range(len(prompts)):
            rows[index]["evicted"].append(sorted(decoder.cache.rows[index].last_evicted))
        out = torch.stack(logits)
        for step in range(steps):
            tokens = choose(out, step)
            for index, token in enumerate(tokens.tolist()):
                rows[index]["tokens"].append(token)
            out = decoder.step(tokens)
            if step + 1 < steps:
                for index in range(len(prompts)):
                    rows[index]["evicted"].append(sorted(decoder.cache.rows[index].last_evicted))
        for index in range(len(prompts)):
            view = decoder.row(index)
            rows[index].update(evicted_total=view.evicted_total, peak_stored=view.peak_stored, stored=view.stored)
    return rows


# ---- models and inputs --------------------------------------------------------------------------------------
def load_model(name: str):
    """``(model, tokenizer, prompts)``: a tiny random model with random prompts, or the demo model with questions."""
    if name == DEMO:
        from epikv_cli.config import ModelSettings
        from epikv_cli.data.prompts import build_input_ids
        from epikv_cli.models.loading import load

        loaded = load(ModelSettings(device_map="cpu"))
        loaded.model.epikv_calibration = None  # the default bands, whatever was calibrated on this machine
        prompts = [build_input_ids(loaded.tokenizer, q) for q in DEMO_QUESTIONS]
        return loaded.model, loaded.tokenizer, prompts
    model = tiny_model(name, seed=3).to(torch.float64)  # the float32 weights, exactly; see the module's docstring
    prompts = [torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(n)) for n in TINY_LENGTHS]
    return model, make_tokenizer(), prompts


def replay(case: dict, loaded) -> list[dict]:
    """Run a recorded case (its prompts, budgets and steps) on ``loaded`` ``(model, tokenizer, prompts)``."""
    model, tokenizer, prompts = loaded
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        chosen = [prompts[i] for i in case["prompts"]]
        return run_case(
            model, tokenizer, chosen, case["spec"], case["budgets"], case["steps"], biased=case["model"] != DEMO
        )
    finally:
        torch.set_num_threads(threads)


def plan(model_name: str, spec: str, batch: int, prompts: list[torch.Tensor]) -> dict:
    """A case: which prompts (alone: the first, or the long one for R-KV on the demo model, which evicts only
    past K + 128), each row's K and the steps."""
    kind = "demo" if model_name == DEMO else "tiny"
    rkv = spec.startswith("rkv")
    if batch == 1:
        chosen = [len(prompts) - 1] if rkv and kind == "demo" else [0]
    else:
        chosen = list(range(len(prompts)))
    budgets = [smallest_budget(spec, prompts[i].shape[1], MARGIN[kind]) for i in chosen]
    steps = STEPS[kind] + (RKV_EXTRA if rkv and kind == "tiny" else 0)
    return {"model": model_name, "spec": spec, "batch": batch, "prompts": chosen, "budgets": budgets, "steps": steps}


def record() -> dict:
    out = {}
    loaded = {}
    for model_name, spec, batch in all_cases():
        if model_name not in loaded:
            loaded[model_name] = load_model(model_name)
        case = plan(model_name, spec, batch, loaded[model_name][2])
        case["rows"] = replay(case, loaded[model_name])
        out[case_id(model_name, spec, batch)] = case
        evicted = [row["evicted_total"] for row in case["rows"]]
        print(f"{case_id(model_name, spec, batch)}: K={case['budgets']} evicted {evicted}", file=sys.stderr)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"record every case into {GOLDEN}")
    args = parser.parse_args()
    if args.write:
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(record(), separators=(",", ":")) + "\n")
