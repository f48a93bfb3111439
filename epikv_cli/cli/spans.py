"""Evicted logical positions merged into contiguous spans, newest first."""

from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass
from itertools import islice


@dataclass
class Span:
    """Positions ``start .. end`` (inclusive) have left the cache; ``touched`` orders spans by recency."""

    start: int
    end: int
    touched: int

    def __len__(self) -> int:
        return self.end - self.start + 1


class EvictedSpans:
    """Keeps evicted positions as merged ranges; adding a position is O(log spans), listing the newest spans costs
    what is listed, however many spans there are."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._spans: list[Span] = []
        self._recent: OrderedDict[int, Span] = OrderedDict()  # id(span) -> span, least recently extended first
        self._clock = 0
        self.total = 0

    def _touch(self, span: Span) -> None:
        span.touched = self._clock
        self._recent[id(span)] = span
        self._recent.move_to_end(id(span))

    def add(self, position: int) -> None:
        self._clock += 1
        self.total += 1
        i = bisect.bisect_right(self._starts, position)
        left = self._spans[i - 1] if i > 0 and self._spans[i - 1].end >= position - 1 else None
        right = self._spans[i] if i < len(self._spans) and self._spans[i].start == position + 1 else None
        if left is not None and left.end >= position:
            return  # already evicted (cannot happen twice, but stay idempotent)
        if left and right:
            left.end = right.end
            self._touch(left)
            del self._recent[id(right)]
            del self._starts[i], self._spans[i]
        elif left:
            left.end = position
            self._touch(left)
        elif right:
            right.start = position
            self._touch(right)
            self._starts[i] = position
        else:
            span = Span(position, position, self._clock)
            self._starts.insert(i, position)
            self._spans.insert(i, span)
            self._touch(span)

    def newest(self, count: int) -> list[Span]:
        """The ``count`` most recently extended spans, newest first (without sorting every span: the panel asks at
        each draw, and a long run has tens of thousands)."""
        return list(islice(reversed(self._recent.values()), max(0, count)))

    def __len__(self) -> int:
        return len(self._spans)

    def ranges(self) -> list[tuple[int, int]]:
        """All spans as ``(start, end)`` in position order."""
        return [(span.start, span.end) for span in self._spans]
