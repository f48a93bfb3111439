"""The live panel of ``epikv generate``: what it shows on a narrow terminal, which sparkline cells it marks as spikes,
and that a draw's work does not grow with the tokens generated (text) or the spans evicted."""

from __future__ import annotations

import io
import sys

from rich.console import Console
from rich.text import Text

from epikv_cli.cli.spans import EvictedSpans
from epikv_cli.cli.ui import SPARK_BLOCKS, PanelState, PanelView
from epikv_cli.runtime.generation import StepEvent

WORDS = ["the", "cache", "holds", "été", "漢字", "tokens,", "and", "evicts", "a", "span."]


def step(index: int, text: str, prompt: int, budget: int, evicted=(), scored=()) -> StepEvent:
    seen = prompt + index
    return StepEvent(
        index=index,
        token_id=65,
        text=text,
        position=seen,
        stored=min(seen, budget),
        seen=seen,
        evicted=list(evicted),
        scored=list(scored),
        logits=None,
        elapsed=0.01 * index,
        evicted_total=max(0, seen - budget) * 3,
    )


def rows_of(console: Console) -> list[str]:
    """The rows the terminal shows (split on newlines only: str.splitlines also splits on control characters)."""
    return console.export_text().rstrip("\n").split("\n")


def test_every_frame_fits_a_narrow_terminal(tokenizer):
    """At 60 columns the per-KV-head line ("evicted 561 per KV head; by every head 187, in 41 spans") and the
    30-cell bar with "4096 / 4096" wrapped to two rows each, which fit() counted as one: the frame was taller than
    the terminal, which scrolls and leaves a fragment of every redraw above the text. Each row is now one row (the
    bar narrower first), and the numbers stay readable."""
    budget, prompt = 4096, 4090
    state = PanelState(budget=budget, prompt_ids=[65] * prompt, has_scores=True, spike_threshold=1.0, per_head=True)
    for i in range(200):
        evicted = [2 * i] if i > 6 else []  # isolated positions: one span each
        scored = [(prompt + i - 1, 3.0 if i % 9 == 0 else 0.1)] if i else []
        state.update(step(i, " " + WORDS[i % len(WORDS)], prompt, budget, evicted, scored))
    assert len(state.spans) > 6 and len(state.spikes) == 8
    for width in (50, 60, 70):
        for height in range(12, 36):
            console = Console(record=True, width=width, height=height, file=io.StringIO(), force_terminal=True)
            console.print(PanelView(state, tokenizer).render(console=console))
            rows = rows_of(console)
            assert len(rows) <= height - 1, (width, height, len(rows))
            assert "4096 / 4096" in "\n".join(rows)


def test_the_sparkline_marks_every_spike_it_shows(tokenizer):
    """The sparkline drew in red only the scores of the newest 8 spikes (the ones listed): an older score above
    the threshold, still on the line, was drawn as if it were not a spike."""
    threshold = 2.0
    scores = [3.0 if i % 5 == 0 else 0.5 for i in range(60)]  # 12 spikes
    state = PanelState(budget=10, prompt_ids=[65] * 4, has_scores=True, spike_threshold=threshold)
    for i, score in enumerate(scores):
        state.update(step(i, "a", 4, 10, scored=[(4 + i, score)]))
    console = Console(width=100, file=io.StringIO(), force_terminal=True, color_system="truecolor")
    lines = console.render_lines(PanelView(state, tokenizer).scores_panel(), console.options)
    red = []
    for segment in lines[1]:  # the row under the top border: the sparkline
        for char in segment.text:
            if char in SPARK_BLOCKS:
                red.append(
                    segment.style is not None and segment.style.color is not None and "red" in str(segment.style)
                )
    assert red == [score > threshold for score in scores]


def long_state(paragraphs: int, words: int) -> tuple[PanelState, str]:
    state = PanelState(budget=None, prompt_ids=[65], has_scores=False)
    pieces = []
    for p in range(paragraphs):
        pieces += [(" " if w else "") + WORDS[(p * 7 + w) % len(WORDS)] for w in range(words)]
        pieces.append("\n")
    for i, piece in enumerate(pieces):
        state.update(step(i, piece, 1, 10**9))
    return state, "".join(pieces)


def wrapped_lengths(monkeypatch) -> list[int]:
    """Records the length of every text rich wraps."""
    seen: list[int] = []
    wrap = Text.wrap

    def counting(self, *args, **kwargs):
        seen.append(len(self.plain))
        return wrap(self, *args, **kwargs)

    monkeypatch.setattr(Text, "wrap", counting)
    return seen


def test_a_draw_wraps_only_the_end_of_the_text(tokenizer, monkeypatch):
    """Each draw wrapped the whole text so far (0.5 s at 50,000 tokens here), and the live panel waits 100 times a
    draw between draws: it froze for longer and longer. A draw now wraps the end only, and shows the same rows."""
    state, text = long_state(paragraphs=1000, words=40)
    console = Console(width=80, height=40, file=io.StringIO(), force_terminal=True)
    reference = [row.plain for row in list(Text(text).wrap(console, 76))[-12:]]  # 80 columns less border, padding
    seen = wrapped_lengths(monkeypatch)
    panel = PanelView(state, tokenizer).text_panel(12, console, 80)
    assert panel.renderable.plain.split("\n") == reference
    assert len(text) > 150_000 and 0 < sum(seen) < 10_000


def test_one_long_paragraph_shows_its_end_unbroken(tokenizer, monkeypatch):
    """A text with no line break at all (one long paragraph): the rows shown are its last characters, word for
    word, without wrapping all of it."""
    state, text = long_state(paragraphs=1, words=60_000)
    console = Console(width=80, height=40, file=io.StringIO(), force_terminal=True)
    seen = wrapped_lengths(monkeypatch)
    shown = PanelView(state, tokenizer).text_panel(12, console, 80).renderable.plain.split("\n")
    assert len(shown) == 12 and 0 < sum(seen) < 10_000
    assert " ".join(shown).split() == text.split()[-len(" ".join(shown).split()) :]
    assert len(" ".join(shown).split()) > 12 * 5


def test_newest_spans_do_not_sort_every_span():
    """``newest`` (called at each draw) sorted every span by recency, however many a long run had made; it now
    reads only the spans it lists, in the same order: the most recently extended first."""
    spans = EvictedSpans()
    for position in range(0, 40_000, 2):  # 20,000 spans of one position
        spans.add(position)
    for position in (11, 3, 39_999, 101, 5):  # extend (and bridge) a few old ones, in this order
        spans.add(position)
    # by hand: 11 bridges 10 and 12, 3 bridges 2 and 4, 39,999 extends 39,998, 101 bridges 100 and 102, 5 bridges
    # 2-4 and 6
    assert [(s.start, s.end) for s in spans.newest(4)] == [(2, 6), (100, 102), (39_998, 39_999), (10, 12)]
    assert len(spans) == 20_000 - 4 and spans.total == 20_005
    calls = []

    def profile(frame, event, arg):
        if event == "call":
            calls.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        spans.newest(6)
    finally:
        sys.setprofile(None)
    assert len(calls) < 20, len(calls)


def test_the_final_panel_gives_the_summary_lines_speed(tiny_model_dir):
    """After the run the panel's decode speed is the result's (the summary line's and --json's), not the one the
    live panel last computed from its step events."""
    import re

    from typer.testing import CliRunner

    from epikv_cli.cli.app import app

    args = ["generate", "--model", str(tiny_model_dir), "-n", "40", "-b", "24", "--ignore-eos", "--panel", "hi"]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.stderr
    panel = re.findall(r"decode\s+([\d.]+) tok/s", done.stderr)
    summary = re.findall(r"tokens, ([\d.]+) tok/s decode", done.stderr)
    assert len(panel) == 1 and len(summary) == 1, done.stderr
    assert panel == summary
