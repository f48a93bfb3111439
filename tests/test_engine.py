"""The decode loop: sampling through logits processors, stopping, events, interruption."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import GenerationConfig

from epikv_cli.config import CacheSettings, SamplingSettings
from epikv_cli.errors import UsageError
from epikv_cli.runtime.generation import Generation, build_logits_processors, end_of_sequence_ids

from conftest import tiny_model

MODEL = tiny_model("llama", seed=11)
IDS = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))


def run(tokenizer, cache=None, **sampling):
    generation = Generation(
        MODEL,
        tokenizer,
        IDS,
        cache or CacheSettings(budget=512, policy="epikv"),
        SamplingSettings(**{"ignore_eos": True, **sampling}),
    )
    events = list(generation)
    return events, generation.result


def test_seeded_sampling_is_reproducible(tokenizer):
    a, _ = run(tokenizer, max_new_tokens=20, temperature=1.0, seed=3)
    b, _ = run(tokenizer, max_new_tokens=20, temperature=1.0, seed=3)
    c, _ = run(tokenizer, max_new_tokens=20, temperature=1.0, seed=4)
    assert [e.token_id for e in a] == [e.token_id for e in b]
    assert [e.token_id for e in a] != [e.token_id for e in c]


def test_top_k_one_is_greedy(tokenizer):
    greedy, _ = run(tokenizer, max_new_tokens=15)
    sampled, _ = run(tokenizer, max_new_tokens=15, temperature=0.7, top_k=1, seed=0)
    assert [e.token_id for e in greedy] == [e.token_id for e in sampled]


def test_processors_are_transformers_warpers():
    names = [type(p).__name__ for p in build_logits_processors(SamplingSettings(temperature=0.8, top_k=5, top_p=0.9))]
    assert names == ["TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper"]
    assert len(build_logits_processors(SamplingSettings())) == 0


def test_eos_stops_generation(tokenizer):
    events, _ = run(tokenizer, max_new_tokens=30)
    target = events[9].token_id
    first = next(i for i, e in enumerate(events) if e.token_id == target)
    MODEL.generation_config.eos_token_id = target
    try:
        stopped, result = run(tokenizer, max_new_tokens=30, ignore_eos=False)
    finally:
        MODEL.generation_config.eos_token_id = None
    assert len(stopped) == first + 1 and result.stop_reason == "eos"


def test_stop_string_ends_generation(tokenizer):
    events, result = run(tokenizer, max_new_tokens=40)
    index, char = next(
        (i, tokenizer.decode([e.token_id]))
        for i, e in enumerate(events)
        if i >= 5 and tokenizer.decode([e.token_id]).isascii() and tokenizer.decode([e.token_id]).isalnum()
    )
    stopped, stopped_result = run(tokenizer, max_new_tokens=40, stop=(char,))
    assert stopped_result.stop_reason == "stop"
    assert char in stopped_result.text
    assert len(stopped) <= index + 1
    assert result.stop_reason == "length" and result.generated_tokens == 40


def test_events_report_the_cache(tokenizer):
    events, result = run(tokenizer, cache=CacheSettings(budget=40, recent=8, policy="epikv"), max_new_tokens=60)
    assert [e.index for e in events] == list(range(60))
    assert [e.position for e in events] == list(range(8, 68))
    assert max(e.stored for e in events) == 40 and result.peak_stored == 41  # K + 1 inside the step
    assert sum(len(e.evicted) for e in events) == result.evicted > 0
    assert all(len(e.scored) == 1 for e in events[1:])  # every decode forward scores the token it appended
    assert result.kv_cache_bytes > 0 and result.peak_memory_bytes > 0


def test_streamed_text_adds_up_to_the_result(tokenizer):
    generation = Generation(
        MODEL,
        tokenizer,
        IDS,
        CacheSettings(budget=64, policy="epikv"),
        SamplingSettings(max_new_tokens=50, ignore_eos=True),
    )
    streamed = "".join(e.text for e in generation) + generation.tail_text
    assert streamed == generation.result.text


def test_closing_early_leaves_an_interrupted_result(tokenizer):
    generation = Generation(
        MODEL, tokenizer, IDS, CacheSettings(budget=64, policy="epikv"), SamplingSettings(max_new_tokens=50)
    )
    stream = iter(generation)
    for _ in range(7):
        next(stream)
    stream.close()
    assert generation.result.stop_reason == "interrupted"
    assert generation.result.generated_tokens == 7


def test_tiny_temperature_gives_the_greedy_tokens(tokenizer):
    _, greedy = run(tokenizer, max_new_tokens=12)
    _, tiny = run(tokenizer, max_new_tokens=12, temperature=3.7e-181, seed=1)
    assert tiny.token_ids == greedy.token_ids


def test_a_prompt_longer_than_the_slot_headroom_and_the_budget_is_cut_at_the_prefill(tokenizer):
    """The slot map grows during the prefill's forward (inference mode) and is cut right after it: a
    300-token prompt (more than the 256 slots a cache starts with) under a 64-token budget."""
    ids = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(5))
    for policy in ("streaming", "epikv2", "h2o"):
        run = Generation(
            MODEL,
            tokenizer,
            ids,
            CacheSettings(budget=64, policy=policy),
            SamplingSettings(max_new_tokens=3, ignore_eos=True),
        )
        events = list(run)
        assert [event.stored for event in events] == [64, 64, 64], policy
        evicted = [position for event in events for position in event.evicted]
        assert len(evicted) == len(set(evicted)), policy
        if policy != "epikv2":  # (whose KV heads keep different tokens: it names only those no head holds)
            assert len(evicted) == 302 - 64, policy  # positions 0-301 were fed (the last token is not)
        if policy == "streaming":  # the 4 sinks and the newest 60 stay
            assert sorted(evicted) == list(range(4, 242))


def test_a_batch_of_input_ids_is_refused_with_the_batched_way(tokenizer):
    with pytest.raises(
        UsageError, match=r"Generation decodes one sequence: input_ids must be \[1, prompt_len\], got \[2, 8\]"
    ):
        Generation(
            MODEL,
            tokenizer,
            torch.cat([IDS, IDS]),
            CacheSettings(budget=24, policy="epikv"),
            SamplingSettings(max_new_tokens=3),
        )


def test_a_generation_left_unfinished_at_exit_lets_the_interpreter_exit_cleanly(tmp_path):
    """An iterator stopped midway and still referenced when the script ends is finalised during interpreter
    shutdown; building its result then (a tensor view and tolist) aborted the process with status 134."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "abandon.py"
    script.write_text(
        "import torch\n"
        "from conftest import tiny_model, make_tokenizer\n"
        "from epikv_cli.runtime.generation import Generation\n"
        "from epikv_cli.config import CacheSettings, SamplingSettings\n"
        "steps = iter(Generation(tiny_model('llama'), make_tokenizer(), torch.arange(3, 40)[None],\n"
        "                        CacheSettings(budget=20, policy='streaming'), "
        "SamplingSettings(max_new_tokens=50, ignore_eos=True)))\n"
        "for _ in range(5):\n"
        "    next(steps)\n"
        "print('stopped after 5')\n"
    )
    tests = Path(__file__).parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tests), str(tests.parent), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert (done.returncode, done.stdout) == (0, "stopped after 5\n"), done.stderr[-2000:]


def test_events_carry_logits_only_when_asked(tokenizer):
    plain, _ = run(tokenizer, max_new_tokens=6)
    assert all(event.logits is None for event in plain)
    kept = list(
        Generation(
            MODEL,
            tokenizer,
            IDS,
            CacheSettings(budget=512, policy="epikv"),
            SamplingSettings(max_new_tokens=6, ignore_eos=True),
            keep_logits=True,
        )
    )
    assert [tuple(event.logits.shape) for event in kept] == [(MODEL.config.vocab_size,)] * 6
    assert [e.token_id for e in kept] == [e.token_id for e in plain] == [int(e.logits.argmax()) for e in kept]


def test_a_non_finite_score_signal_is_counted_in_the_result(tokenizer, monkeypatch):
    """An fp16 overflow in EpiKV's hidden-state change (here: the third generated token's) is reported."""
    from epikv_cli.policies.epikv import EpiKV

    real, calls = EpiKV.stage, []

    def overflowing(self, signals):
        staged = real(self, signals)
        calls.append(signals.prompt)
        if calls.count(False) == 3:
            staged[0][:, 0] = float("inf")  # every band
        return staged

    monkeypatch.setattr(EpiKV, "stage", overflowing)
    events, result = run(tokenizer, cache=CacheSettings(budget=24, policy="epikv"), max_new_tokens=30)
    assert result.policy_report["nonfinite_scores"] == 1 and result.evicted == 8 + 30 - 1 - 24
    # the top-level key of earlier releases repeats it, for one release
    assert result.to_dict()["nonfinite_scores"] == 1 and result.to_dict()["policy_report"] == result.policy_report
    scores = dict(pair for event in events for pair in event.scored)
    assert sorted(scores) == list(range(8, 8 + 30 - 1)) and all(math.isfinite(score) for score in scores.values())
    # position 10 (fed by the third decoding forward) scores 0, neither kept for ever nor evicted first; the
    # first generated token has no earlier change to z-score against and scores 0 too; no other does
    assert [p for p, score in scores.items() if score == 0.0] == [8, 10]


def test_end_of_sequence_ids_gather_every_source():
    """A generation config's list (Qwen2.5 and QwQ name <|endoftext|> only there), a model config's id, a tokenizer's,
    and sources that have none or are missing."""
    sources = (GenerationConfig(eos_token_id=[2, 17]), SimpleNamespace(eos_token_id=2), SimpleNamespace(eos_token_id=5))
    assert end_of_sequence_ids(*sources) == {2, 5, 17}
    assert end_of_sequence_ids(None, SimpleNamespace(eos_token_id=None), SimpleNamespace()) == set()
