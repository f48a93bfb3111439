"""The live panel: sections, spikes, throttled redraws, and plain output when stdout is not a terminal."""

from __future__ import annotations

import io

import torch
from rich.console import Console
from typer.testing import CliRunner

from epikv_cli.cli.app import app
from epikv_cli.cli.ui import LivePanel, PanelState, PanelView, sparkline
from epikv_cli.config import CacheSettings, SamplingSettings
from epikv_cli.policies.registry import POLICIES
from epikv_cli.runtime.generation import Generation, StepEvent

from conftest import tiny_model

MODEL = tiny_model("llama", seed=1)


def small_recent(policy: str) -> bool:
    return POLICIES[policy].takes_recent and policy != "epikv2"


def run_state(tokenizer, policy="epikv", threshold=1.0, with_result=False):
    ids = tokenizer("Hello there, tell me a story", return_tensors="pt")["input_ids"]
    budget = 40 if policy != "full" else None
    generation = Generation(
        MODEL,
        tokenizer,
        ids,
        # a small recent window for the policies whose window is METHOD.md's R (epikv2's, a share of K, stays)
        CacheSettings(budget=budget, policy=policy, recent=8 if small_recent(policy) else None),
        SamplingSettings(max_new_tokens=120, ignore_eos=True),
    )
    state = PanelState(
        budget=budget,
        prompt_ids=ids[0].tolist(),
        has_scores=generation.policy_has_scores,
        spike_threshold=threshold,
        per_head=generation.policy_per_head,
    )
    for event in generation:
        state.update(event)
    return (state, generation.result) if with_result else state


def test_per_head_keep_sets_count_what_the_summary_counts(tokenizer):
    """With a keep-set per KV head (epikv2's default) a position leaves the model only once every head dropped
    it: the panel counts entries per head, as the summary does, and names the spans for what they are."""
    state, result = run_state(tokenizer, policy="epikv2", with_result=True)
    assert state.per_head and result.evicted == state.seen - 40  # one entry per head per step past K = 40
    assert state.spans.total < result.evicted  # heads keep different tokens: fewer positions are gone from all
    _, text = render(state, tokenizer)
    assert (
        f"evicted        {result.evicted} per KV head; by every head {state.spans.total}, in {len(state.spans)} spans"
        in text
    )
    assert "─ spans evicted by every KV head (newest first)" in text
    assert not run_state(tokenizer, policy="streaming").per_head


def render(state, tokenizer, terminal=False):
    console = Console(
        record=True,
        width=100,
        file=io.StringIO(),
        force_terminal=terminal,
        color_system="truecolor" if terminal else None,
    )
    console.print(PanelView(state, tokenizer).render())
    return console, console.export_text()


def test_panel_has_every_section(tokenizer):
    state = run_state(tokenizer)
    _, text = render(state, tokenizer)
    for title in ("text", "cache", "evicted spans (newest first)", "epiphany scores"):
        assert f"─ {title}" in text
    assert "40 / 40" in text and f"logical length {state.seen}" in text
    assert f"evicted        {state.spans.total} in {len(state.spans)} spans" in text
    newest = state.spans.newest(1)[0]
    assert f"{newest.start}–{newest.end}" in text
    assert "tok/s" in text


def event(index, token, scored=(), evicted=()):
    return StepEvent(
        index, token, chr(token), 3 + index, 3, 4 + index, list(evicted), list(scored), torch.zeros(1), 0.1 * index
    )


def test_spikes_are_listed_with_their_token(tokenizer):
    state = PanelState(budget=10, prompt_ids=[70, 71, 72], has_scores=True, spike_threshold=2.0)
    tokens = [65, 66, 67, 68, 69, 70]
    scores = [0.1, 2.5, -1.0, 1.9, 3.25, 0.0]
    for i, (token, score) in enumerate(zip(tokens, scores)):
        # the forward for token i scores the token before it (position 3 + i - 1)
        state.update(event(i, token, scored=[(3 + i - 1, score)] if i else []))
    assert [p for p, _ in state.spikes] == [3, 6]  # 2.5 at position 3 and 3.25 at position 6
    _, text = render(state, tokenizer)
    assert "▲ +3.25  @6" in text and "▲ +2.50  @3" in text
    assert text.index("+3.25") < text.index("+2.50")  # newest first
    assert repr(tokenizer.decode([state.token_at(6)])) in text


def test_policies_without_scores_have_no_sparkline(tokenizer):
    for policy in ("streaming", "full"):
        _, text = render(run_state(tokenizer, policy=policy), tokenizer)
        assert "─ cache" in text and "epiphany scores" not in text


def test_no_ansi_codes_without_a_terminal(tokenizer):
    state = run_state(tokenizer)
    console, _ = render(state, tokenizer, terminal=False)
    assert "\x1b[" not in console.file.getvalue()
    console, _ = render(state, tokenizer, terminal=True)
    assert "\x1b[" in console.file.getvalue()  # the same panel on a terminal is coloured


def test_sparkline_marks_spikes():
    line = sparkline([0.0, 1.0, 5.0, 1.0], spikes={2}, width=10)
    assert line.plain == "▁▂█▂"
    assert [span.style for span in line.spans if "red" in str(span.style)]


def test_redraws_at_most_ten_times_a_second(tokenizer, monkeypatch):
    clock = {"now": 0.0}
    monkeypatch.setattr("epikv_cli.cli.ui.time.perf_counter", lambda: clock["now"])
    state = PanelState(budget=10, prompt_ids=[1, 2], has_scores=True)
    console = Console(file=io.StringIO(), force_terminal=True, width=80)
    with LivePanel(console, state, PanelView(state, tokenizer)) as live:
        for i in range(1000):  # 1000 tokens in one simulated second
            clock["now"] = 0.05 + i / 1000
            live.update(StepEvent(i, 65, "a", 2 + i, 3, 3 + i, [], [], torch.zeros(1), clock["now"]))
    assert live.draws <= 11


def test_cli_stdout_gets_plain_text_only(tiny_model_dir):
    """Not a terminal: the panel, even forced, draws on stderr; stdout holds just the text."""
    runner = CliRunner()
    args = ["generate", "--model", str(tiny_model_dir), "-n", "30", "-b", "24", "--ignore-eos", "-q", "hi"]
    plain = runner.invoke(app, args)
    forced = runner.invoke(app, [*args, "--panel"])
    assert plain.exit_code == forced.exit_code == 0
    assert forced.stdout == plain.stdout and "\x1b[" not in forced.stdout
    assert "─ cache" in forced.stderr and "─ cache" not in plain.stderr


def test_the_live_panel_fits_an_80_by_24_terminal(tokenizer):
    """At 80x24 the panel with -p epikv was 41 rows: the terminal scrolled, rich cut it with '…' and every redraw left
    a frame behind. Every frame now fits (one row spare for the cursor), the bands cut to one row."""
    state = run_state(tokenizer)
    state.spikes.extend((position, 2.0 + i) for i, (position, _) in enumerate(list(state.scores)[:8]))
    state.bands = "9:+1, 20:-1 (calibrated (/root/.cache/epikv/bands/SmolLM2-135M-Instruct-0123456789ab.json))"
    assert len(state.spikes) >= 2 and len(state.spans) >= 2
    for width, height in ((80, 24), (100, 40), (60, 14)):
        console = Console(record=True, width=width, height=height, file=io.StringIO(), force_terminal=True)
        console.print(PanelView(state, tokenizer).render(console=console))
        rows = console.export_text().splitlines()
        assert len(rows) <= height - 1, (width, height, len(rows))
        assert "─ cache" in rows[0] or "─ text" in rows[0]
        assert not any(row.rstrip().endswith("…") and "bands" not in row for row in rows)
    tall = Console(record=True, width=100, height=60, file=io.StringIO(), force_terminal=True)
    tall.print(PanelView(state, tokenizer).render(console=tall))
    text = tall.export_text()
    for title in ("text", "cache", "evicted spans", "epiphany scores"):  # with room, every section is there
        assert f"─ {title}" in text
    assert PanelView(state, tokenizer).fit(23).spikes >= 1  # at 80x24 the epiphany scores still show


def test_ctrl_c_leaves_no_frame_above_the_text(tokenizer):
    """The live panel is transient: once it stops (Ctrl-C included), the terminal holds none of its rows."""
    state = run_state(tokenizer)
    console = Console(file=io.StringIO(), force_terminal=True, width=80, height=24)
    try:
        with LivePanel(console, state, PanelView(state, tokenizer)) as live:
            live.draw()
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    *_, last_frame, erase = console.file.getvalue().split("\r")  # each redraw starts by returning the cursor
    rows = last_frame.count("\n")
    assert 0 < rows <= 23 and erase.count("\x1b[1A") == rows  # every row of the frame is erased, none scrolled away
