"""Evicted logical positions merged into contiguous spans, newest first."""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass
class Span:
    """Positions ``start .. end`` (inclusive) have left the cache; ``touched`` orders spans by recency."""

    start: int
    end: int
    touched: int

    def __len__(self) -> int:
        return self.end - self.start + 1


class EvictedSpans:
    """Keeps evicted positions as merged ranges; adding a position is O(log spans)."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._spans: list[Span] = []
        self._clock = 0
        self.total = 0

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
            left.touched = self._clock
            del self._starts[i], self._spans[i]
        elif left:
            left.end = position
            left.touched = self._clock
        elif right:
            right.start = position
            right.touched = self._clock
            self._starts[i] = position
        else:
            self._starts.insert(i, position)
            self._spans.insert(i, Span(position, position, self._clock))

    def newest(self, count: int) -> list[Span]:
        """The ``count`` most recently extended spans, newest first."""
        return sorted(self._spans, key=lambda span: span.touched, reverse=True)[:count]

    def __len__(self) -> int:
        return len(self._spans)

    def ranges(self) -> list[tuple[int, int]]:
        """All spans as ``(start, end)`` in position order."""
        return [(span.start, span.end) for span in self._spans]
