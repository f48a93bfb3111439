"""Everything drawn with rich: the live generation panel, its sparkline, the batch progress bar."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from epikv_cli.cli.spans import EvictedSpans
from epikv_cli.runtime.generation import StepEvent

SPARK_BLOCKS = "▁▂▃▄▅▆▇█"
MAX_REFRESH_PER_S = 10
MAX_DRAW_SHARE = 0.01
DEFAULT_SPIKE_Z = 2.0


def sparkline(values: list[float], spikes: set[int] | None = None, width: int = 80) -> Text:
    """Block-character sparkline of the last ``width`` values; indices in ``spikes`` drawn in red."""
    offset = max(0, len(values) - width)
    values = values[offset:]
    text = Text()
    if not values:
        return text
    low, high = min(values), max(values)
    scale = (len(SPARK_BLOCKS) - 1) / (high - low) if high > low else 0.0
    for i, value in enumerate(values):
        block = SPARK_BLOCKS[int(round((value - low) * scale))]
        text.append(block, style="bold red" if spikes and (i + offset) in spikes else "cyan")
    return text


class Sparkline:
    """A :func:`sparkline` as wide as the space rich gives it."""

    def __init__(self, values: list[float], spikes: set[int]) -> None:
        self.values, self.spikes = values, spikes

    def __rich_console__(self, console: Console, options):
        yield sparkline(self.values, self.spikes, width=max(1, options.max_width))


def _snippet(text: str, limit: int = 40) -> str:
    text = text.replace("\n", "⏎").replace("\r", "")
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass
class PanelState:
    """What the panel shows, updated once per :class:`StepEvent`; rendering reads it, never the engine."""

    budget: int | None
    prompt_ids: list[int]
    has_scores: bool
    spike_threshold: float = DEFAULT_SPIKE_Z
    history: int = 240
    pieces: list[str] = field(default_factory=list)  # streamed text, joined only when drawn
    generated: list[int] = field(default_factory=list)
    stored: int = 0
    seen: int = 0
    spans: EvictedSpans = field(default_factory=EvictedSpans)
    scores: deque = field(default_factory=deque)  # (position, score)
    spikes: deque = field(default_factory=lambda: deque(maxlen=8))  # (position, score), newest last
    tokens_per_s: float | None = None
    memory_bytes: int | None = None
    bands: str | None = None  # EpiKV's bands and their source
    per_head: bool = False  # each KV head keeps its own set: spans then hold the positions every head dropped
    evicted_total: int = 0  # entries each evicting layer (or KV head) has dropped, as the summary counts them
    _decode_start: float | None = None

    def update(self, event: StepEvent) -> None:
        self.pieces.append(event.text)
        self.generated.append(event.token_id)
        self.stored, self.seen = event.stored, event.seen
        self.evicted_total = event.evicted_total
        for position in event.evicted:
            self.spans.add(position)
        for position, score in event.scored:
            self.scores.append((position, score))
            if len(self.scores) > self.history:
                self.scores.popleft()
            if score > self.spike_threshold:
                self.spikes.append((position, score))
        if event.index == 0:
            self._decode_start = event.elapsed
        elif self._decode_start is not None and event.elapsed > self._decode_start:
            self.tokens_per_s = event.index / (event.elapsed - self._decode_start)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def tail(self, chars: int) -> tuple[str, bool]:
        """At least the last ``chars`` characters of the text (whole pieces), and whether that is all of it: what a
        draw reads, instead of joining every piece so far."""
        size, start = 0, len(self.pieces)
        while start and size < chars:
            start -= 1
            size += len(self.pieces[start])
        return "".join(self.pieces[start:]), start == 0

    def token_at(self, position: int) -> int:
        prompt = len(self.prompt_ids)
        return self.prompt_ids[position] if position < prompt else self.generated[position - prompt]


#: Rows of the cache panel (four lines and the border); the spans and spikes listed when there is room.
CACHE_ROWS = 6
SPANS_SHOWN = 6
SPIKES_SHOWN = 8


@dataclass
class PanelLayout:
    """Rows given to the text, and how many evicted spans and spikes are listed (0: the section is left out)."""

    text: int
    spans: int
    spikes: int


class PanelView:
    """Renders a :class:`PanelState` as rich renderables."""

    def __init__(self, state: PanelState, tokenizer, text_lines: int = 12) -> None:
        self.state = state
        self.tokenizer = tokenizer
        self.text_lines = text_lines

    def _decode(self, start: int, end: int) -> str:
        ids = [self.state.token_at(p) for p in range(start, min(end, start + 12) + 1)]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def text_panel(self, lines: int | None = None, console: Console | None = None, width: int | None = None) -> Panel:
        """The newest ``lines`` lines of text (default :attr:`text_lines`); with ``console`` and ``width``, the
        newest rows as the panel wraps them, so that the panel is exactly that tall."""
        lines = self.text_lines if lines is None else lines
        if console is None or width is None:
            shown = Text("\n".join(self.state.text.splitlines()[-lines:]))
        else:
            shown = Text("\n").join(self._last_rows(console, max(1, width - 4), lines))  # inside border and padding
        return Panel(shown, title="text", title_align="left", border_style="white")

    def _last_rows(self, console: Console, width: int, count: int) -> list[Text]:
        """The last ``count`` rows of the text wrapped to ``width`` cells, wrapping only the end of it, so that a
        draw costs as much after 100,000 tokens as after 100 (wrapping all of it made each draw slower, and the
        live panel, which waits 100 times a draw's time between draws, froze for longer and longer). Lines read
        whole are wrapped as in the whole text; a line that starts before what was read is wrapped from the first
        word boundary read (the same characters, its line breaks possibly elsewhere)."""
        if count <= 0:
            return []
        chars = 2 * (count + 1) * (width + 1)
        while True:
            text, whole = self.state.tail(chars)
            if whole:
                return list(Text(text).wrap(console, width))[-count:]
            cut = text.find("\n")
            rows = list(Text(text[cut + 1 :]).wrap(console, width)) if cut >= 0 else []
            head = text[:cut] if cut >= 0 else text
            if len(rows) < count and head:
                space = head.find(" ")
                head = head[space + 1 :] if 0 <= space < len(head) - 1 else head
                rows = list(Text(head).wrap(console, width)) + rows
            if len(rows) >= count:
                return rows[-count:]
            chars *= 2  # zero-width characters, or a line that ended just before what was read

    def cache_panel(self, width: int | None = None) -> Panel:
        """Stored / K, logical length, evicted, speed. With the terminal's ``width`` (the live panel), each is one
        row, as :meth:`fit` counts them: cut with "…" rather than wrapped, the bar narrower first."""
        s = self.state
        if s.budget:
            fill = min(1.0, s.stored / s.budget)
            numbers = f" {s.stored} / {s.budget}"
            bar = 30 if width is None else max(0, min(30, width - 4 - 15 - len(numbers)))
            cells = int(bar * fill)
            stored = Text.assemble(("█" * cells + "░" * (bar - cells), "green" if fill < 1 else "yellow"), numbers)
        else:
            stored = Text(f"{s.stored} (no budget)")
        speed = f"{s.tokens_per_s:.1f} tok/s" if s.tokens_per_s else "…"
        memory = f"{s.memory_bytes / 2**20:.0f} MiB peak" if s.memory_bytes else "…"
        lines = Text.assemble(
            ("stored         ", "bold"),
            stored,
            "\n",
            ("logical length ", "bold"),
            str(s.seen),
            "\n",
            ("evicted        ", "bold"),
            self._evicted_line(),
            "\n",
            ("decode         ", "bold"),
            f"{speed}   {memory}",
        )
        if width is not None:
            lines.no_wrap, lines.overflow = True, "ellipsis"
        return Panel(lines, title="cache", title_align="left", border_style="blue")

    def _evicted_line(self) -> str:
        s = self.state
        if not s.per_head:
            return f"{s.spans.total} in {len(s.spans)} spans"
        return f"{s.evicted_total} per KV head; by every head {s.spans.total}, in {len(s.spans)} spans"

    def spans_panel(self, count: int = SPANS_SHOWN, crop: bool = False) -> Panel:
        """The ``count`` newest spans; ``crop``: one row each, cut with "…" (the live panel: :meth:`fit`)."""
        lines = Text(
            f"{'positions':>13}  {'n':>5}  text",
            style="dim",
            no_wrap=crop or None,
            overflow="ellipsis" if crop else None,
        )
        for span in self.state.spans.newest(count):
            where = f"{span.start}–{span.end}"
            lines.append(f"\n{where:>13}  {len(span):>5}  {_snippet(self._decode(span.start, span.end))}")
        if not len(self.state.spans):
            nothing = "no position evicted by every KV head yet" if self.state.per_head else "nothing evicted yet"
            lines.append("\n" + " " * 13 + "  " + nothing, style="dim")
        title = (
            "spans evicted by every KV head (newest first)" if self.state.per_head else "evicted spans (newest first)"
        )
        return Panel(lines, title=title, title_align="left", border_style="magenta")

    def scores_panel(self, spikes: int = SPIKES_SHOWN, crop: bool = False) -> Panel:
        """The sparkline, the newest ``spikes`` spikes and the bands (one row, cut to the width); ``crop``: every
        row one row, cut with "…" (the live panel: :meth:`fit`)."""
        s = self.state
        values = [score for _, score in s.scores]
        # every score above the threshold is a spike, not only the newest few that are listed
        spike_index = {i for i, score in enumerate(values) if score > s.spike_threshold}
        rows: list[RenderableType] = [Sparkline(values, spike_index)]
        if s.spikes:
            listed = Text(no_wrap=crop or None, overflow="ellipsis" if crop else None)
            for i, (position, score) in enumerate(list(reversed(s.spikes))[:spikes]):
                token = self.tokenizer.decode([s.token_at(position)], skip_special_tokens=True)
                listed.append(("\n" if i else "") + f"▲ {score:+.2f}", style="bold red")
                listed.append(f"  @{position:<6} {token!r}")
            rows.append(listed)
        else:
            rows.append(
                Text(
                    f"no spikes above z = {s.spike_threshold:g} yet",
                    style="dim",
                    no_wrap=crop or None,
                    overflow="ellipsis" if crop else None,
                )
            )
        if s.bands:
            rows.append(Text(f"bands {s.bands}", style="dim", no_wrap=True, overflow="ellipsis"))
        return Panel(
            Group(*rows),
            title=f"epiphany scores (spikes: z > {s.spike_threshold:g})",
            title_align="left",
            border_style="red",
        )

    def render(self, with_text: bool = True, console: Console | None = None) -> Group:
        """Every section; with ``console``, no taller than its terminal (a live display taller than the screen
        cannot be redrawn in place: it would scroll, and leave fragments of frames above the text)."""
        if console is None:
            layout = self.full_layout(with_text)
        else:
            layout = self.fit(console.height - 1, with_text)  # the last row holds the cursor
        width = console.width if console is not None else None
        parts: list[RenderableType] = [self.text_panel(layout.text, console, width)] if layout.text else []
        parts.append(self.cache_panel(width))
        if layout.spans:
            parts.append(self.spans_panel(layout.spans, crop=console is not None))
        if layout.spikes:
            parts.append(self.scores_panel(layout.spikes, crop=console is not None))
        return Group(*parts)

    def full_layout(self, with_text: bool = True) -> PanelLayout:
        """Every section at its full size (a static print, or a terminal tall enough)."""
        spikes = SPIKES_SHOWN if self.state.has_scores else 0
        return PanelLayout(text=self.text_lines if with_text else 0, spans=SPANS_SHOWN, spikes=spikes)

    def fit(self, rows: int, with_text: bool = True) -> PanelLayout:
        """How many text rows, evicted spans and spikes fit in ``rows`` terminal rows: the cache panel always,
        then as much as fits, shrinking the lists of spikes, spans and text in that order, then leaving out the
        scores panel, then the spans panel."""
        s = self.state
        layout = self.full_layout(with_text)

        def height(layout: PanelLayout) -> int:
            total = CACHE_ROWS
            if layout.text:
                total += 2 + layout.text
            if layout.spans:
                total += 3 + max(1, min(layout.spans, len(s.spans)))  # border, header, rows (or "nothing yet")
            if layout.spikes:  # border, sparkline, spikes (or "no spikes yet"), the bands
                total += 3 + max(1, min(layout.spikes, len(s.spikes))) + (1 if s.bands else 0)
            return total

        for name, floor in (("spikes", 1), ("spans", 1), ("text", 1), ("spikes", 0), ("spans", 0), ("text", 0)):
            while height(layout) > rows and getattr(layout, name) > floor:
                setattr(layout, name, getattr(layout, name) - 1)
        return layout


class LivePanel:
    """Shows the panel while tokens stream in, redrawing at most ``MAX_REFRESH_PER_S`` times a second.

    Drawing happens on the decoding thread, between tokens, and only when the last draw is old
    enough: at least 1/10 s, and at least ``1 / MAX_DRAW_SHARE`` times as long as the last draw took,
    so drawing never takes more than about 1% of the time whatever the machine.
    """

    def __init__(self, console: Console, state: PanelState, view: PanelView, memory_probe=None) -> None:
        self.console = console
        self.state = state
        self.view = view
        self.memory_probe = memory_probe
        self._live = Live(
            console=console, auto_refresh=False, transient=True, redirect_stdout=False, redirect_stderr=False
        )
        self._last_draw = 0.0
        self._interval = 1.0 / MAX_REFRESH_PER_S
        self.draws = 0

    def __enter__(self) -> LivePanel:
        self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._live.__exit__(*exc)

    def update(self, event: StepEvent) -> None:
        self.state.update(event)
        now = time.perf_counter()
        if now - self._last_draw >= self._interval:
            self.draw()
            self._last_draw = now
            cost = time.perf_counter() - now
            self._interval = max(1.0 / MAX_REFRESH_PER_S, cost / MAX_DRAW_SHARE)

    def draw(self) -> None:
        if self.memory_probe is not None:
            self.state.memory_bytes = self.memory_probe()
        self._live.update(self.view.render(console=self.console), refresh=True)
        self.draws += 1


def _mib(value: int) -> str:
    return f"{value / 2**20:,.0f}"


def _ratio(value: float | None) -> str:
    """A ratio to the reference policy, or a dash where the reference's figure was 0."""
    return "–" if value is None else f"{value:.2f}"


def profile_table(reports, title: str, compact: bool = False) -> Table:
    """The ``epikv profile`` results: medians, the decode spread, and ratios (×) to the first policy.

    ``compact`` (a terminal under 110 columns) leaves out the spread and the KV ratio.
    """
    table = Table(title=title, title_justify="left", header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False)
    columns = {
        "policy": lambda r: r.policy,
        "prefill s": lambda r: f"{r.prefill_seconds:.3f}",
        "tok/s": lambda r: f"{r.decode_tokens_per_s:.2f}",
        "min–max": lambda r: f"{r.decode_tokens_per_s_min:.1f}–{r.decode_tokens_per_s_max:.1f}",
        "×": lambda r: _ratio(r.ratio_decode_tokens_per_s),
        "flat": lambda r: f"{r.flatness:.2f}",
        "peak MiB": lambda r: f"{_mib(r.prefill_peak_memory_bytes)}/{_mib(r.decode_peak_memory_bytes)}",
        "KV MiB": lambda r: f"{r.kv_cache_bytes / 2**20:,.1f}",
        "KV ×": lambda r: _ratio(r.ratio_kv_cache_bytes),
        "stored": lambda r: str(r.peak_stored),
    }
    if compact:
        del columns["min–max"], columns["KV ×"]
        columns["peak MiB"] = lambda r: _mib(r.decode_peak_memory_bytes)
    for name in columns:
        table.add_column(name, justify="left" if name == "policy" else "right", no_wrap=True)
    for r in reports:
        table.add_row(*(cell(r) for cell in columns.values()))
    return table


def max_context_table(rows: list[dict], title: str) -> Table:
    """``epikv profile --max-context``: the longest prompt per set-up, and its ratio to the first."""
    table = Table(title=title, title_justify="left", header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False)
    for name in ("policy", "kernel", "max prompt tokens", "peak MiB", "×", "probes"):
        table.add_column(name, justify="left" if name in ("policy", "kernel") else "right", no_wrap=True)
    for row in rows:
        table.add_row(
            row["policy"],
            row["kernel"],
            f"≥ {row['max_prompt_tokens']:,} (model limit)"
            if row["reached_model_limit"]
            else f"{row['max_prompt_tokens']:,}",
            _mib(row["peak_memory_bytes"]),
            f"{row['ratio']:.2f}" if row["ratio"] is not None else "–",
            str(len(row["probes"])),
        )
    return table


def progress_bar(console: Console, disable: bool = False, transient: bool = False, eta: bool = False) -> Progress:
    """The progress bar of batch files, ``profile`` and ``fidelity`` on stderr (``eta``: time remaining too)."""
    columns = [
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
    ]
    if eta:
        columns.append(TimeRemainingColumn())
    return _Progress(*columns, console=console, disable=disable, transient=transient)


class _Progress(Progress):
    """rich's progress bar, except that a run ended by an error leaves no bar behind: its one error line is the
    last word. Ctrl-C still leaves the bar where it stopped."""

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        if exc_type is None or issubclass(exc_type, KeyboardInterrupt) or self.disable:
            super().__exit__(exc_type, exc_value, traceback)
            return
        self.live.transient = True  # erased from a terminal, never drawn into a file
        self.live.stop()  # and without the empty line rich's own stop leaves in a file


def fidelity_table(rows, title: str, compact: bool = False) -> Table:
    """``epikv fidelity``: per policy and budget, distance from the full cache, means over prompts.

    ``compact`` (a terminal under 100 columns) leaves out the all-positions columns.
    """
    table = Table(title=title, title_justify="left", header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False)

    def number(value, digits):
        return "–" if value is None else fixed(value, digits)

    columns = {
        "policy": lambda r: r.policy,
        "budget": lambda r: r.budget,
        "KL full": lambda r: number(r.values["kl_after_full"], 4),
        "KL all": lambda r: number(r.values["kl_all"], 4),
        "top-1 full": lambda r: number(r.values["top1_after_full"], 3),
        "top-1 all": lambda r: number(r.values["top1_all"], 3),
        "ppl": lambda r: number(r.values["perplexity"], 2),
        "age": lambda r: number(r.values["kept_age"], 1),
        "n": lambda r: str(r.prompts),
    }
    if compact:
        del columns["KL all"], columns["top-1 all"]
    for name in columns:
        table.add_column(name, justify="left" if name in ("policy", "budget") else "right", no_wrap=True)
    for row in rows:
        table.add_row(*(cell(row) for cell in columns.values()))
    return table


def eval_table(rows, title: str) -> Table:
    """``epikv eval``: accuracy per policy and budget, with its 95% interval."""
    table = Table(title=title, title_justify="left", header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False)
    for name in ("policy", "budget", "accuracy", "95% CI", "correct", "no answer", "errors", "mean tokens", "tok/s"):
        table.add_column(name, justify="left" if name in ("policy", "budget") else "right", no_wrap=True)
    for r in rows:
        table.add_row(
            r.policy,
            r.budget,
            f"{r.accuracy:.3f}" if r.problems else "–",
            f"{r.low:.2f}–{r.high:.2f}" if r.problems else "–",
            f"{r.correct}/{r.problems}",
            str(r.no_answer),
            str(r.errors),
            f"{r.mean_generated_tokens:.0f}" if r.mean_generated_tokens is not None else "–",
            f"{r.mean_tokens_per_s:.1f}" if r.mean_tokens_per_s is not None else "–",
        )
    return table


class _NoStatus:
    """What :func:`status_line` gives where nothing is shown: the same interface, doing nothing."""

    def __enter__(self) -> _NoStatus:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def update(self, text: str) -> None:
        return None


def status_line(console: Console, quiet: bool = False):
    """A one-line rich status on a terminal (``with ... as status: status.update(text)``); silent otherwise."""
    return console.status("…") if console.is_terminal and not quiet else _NoStatus()


def calibration_table(rho: list[float], bands: list[tuple[int, float]], title: str, saved: str) -> Table:
    """``epikv calibrate``: Spearman correlation per layer, chosen bands marked, and where they were saved."""
    chosen = dict(bands)
    table = Table(
        title=title,
        title_justify="left",
        caption=f"bands saved to {saved}",
        caption_justify="left",
        header_style="bold",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    for name in ("layer", "ρ", "", "band"):
        table.add_column(name, justify="right" if name != "" else "left", no_wrap=True)
    scale = max((abs(r) for r in rho), default=1.0) or 1.0
    for layer, value in enumerate(rho):
        bar = "█" * int(round(12 * abs(value) / scale))
        table.add_row(
            str(layer),
            f"{value:+.3f}",
            Text(bar, style="green" if value > 0 else "red"),
            f"{chosen[layer]:+.0f}" if layer in chosen else "",
        )
    return table


def fixed(value: float, digits: int) -> str:
    """``value`` with ``digits`` decimals, never a negative zero: a KL of -3e-9 (float error about an exact 0) is
    0.0000, not -0.0000."""
    text = f"{value:.{digits}f}"
    return text[1:] if text.startswith("-") and float(text) == 0 else text


def wide_console() -> Console:
    """stdout for tables: the terminal as it is, or 160 columns when it is a file or a pipe."""
    out = Console(highlight=False)
    return out if out.is_terminal else Console(highlight=False, width=160)
