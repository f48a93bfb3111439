"""Shared machinery for policies that keep a frozen score per token: the book and the keep rule."""

from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING

import torch

from epikv_cli.policies.base import Policy, PolicyOptions

if TYPE_CHECKING:
    from epikv_cli.core.view import CacheView


class ScoreBook:
    """Frozen per-token scores indexed by logical position (float64, NaN where unscored).

    Indexing by position rather than slot means eviction never has to move scores: a score is written
    once, when its token is generated, and read back by position whenever the keep-set is chosen.
    """

    def __init__(self, capacity: int = 1024) -> None:
        self._scores = torch.full((capacity,), math.nan, dtype=torch.float64)

    def _reserve(self, end: int) -> None:
        if end > self._scores.numel():
            grown = torch.full((max(end, 2 * self._scores.numel()),), math.nan, dtype=torch.float64)
            grown[: self._scores.numel()] = self._scores
            self._scores = grown

    def set(self, position: int, score: float) -> None:
        self._reserve(position + 1)
        self._scores[position] = score

    def put(self, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Set the scores of ``positions`` ``[n]`` to ``values`` ``[n]``."""
        if not positions.numel():
            return
        self._reserve(int(positions.max()) + 1)
        self._scores[positions] = values.to(torch.float64)

    def add(self, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Accumulate ``values[i]`` onto the score of ``positions[i]`` (unscored counts as 0)."""
        if not positions.numel():
            return
        self._reserve(int(positions.max()) + 1)
        current = self._scores[positions]
        self._scores[positions] = torch.nan_to_num(current, nan=0.0) + values.to(torch.float64)

    def get(self, position: int) -> float | None:
        if position >= self._scores.numel():
            return None
        value = float(self._scores[position])
        return None if math.isnan(value) else value

    def gather(self, positions: torch.Tensor) -> torch.Tensor:
        """``[n]`` scores of the given logical positions (NaN when unscored)."""
        out = torch.full(positions.shape, math.nan, dtype=torch.float64)
        inside = positions < self._scores.numel()
        out[inside] = self._scores[positions[inside]]
        return out


class CandidateHeap:
    """Evictable tokens as ``(score, position)``, lowest first (ties: the older token).

    Tokens become evictable in position order as they leave the recent window, so each step
    :meth:`admit` pushes only the newcomers and :meth:`pop` takes the lowest: O(log K) per eviction
    while scores stay frozen. A policy whose scores change calls :meth:`rebuild` instead.

    Args:
        unscored: the score a token without one gets (``inf``: it leaves last; 0: neutral).
    """

    def __init__(self, unscored: float) -> None:
        self.unscored = unscored
        self.items: list[tuple[float, int]] = []
        self.next_candidate = 0  # every position below it was admitted already

    def admit(self, book: ScoreBook, floor: int, end: int) -> None:
        """Push the positions from ``floor`` (or the first not yet admitted) up to ``end`` with their scores."""
        for position in range(max(floor, self.next_candidate), end):
            score = book.get(position)
            heapq.heappush(self.items, (self.unscored if score is None else score, position))
        self.next_candidate = max(self.next_candidate, end)

    def rebuild(self, book: ScoreBook, live: torch.Tensor, floor: int, end: int) -> None:
        """Start over from the ``live`` positions ``[n]`` in ``[floor, end)`` with their current scores."""
        positions = live[(live >= floor) & (live < end)]
        scores = torch.nan_to_num(book.gather(positions), nan=self.unscored)
        self.items = list(zip(scores.tolist(), positions.tolist()))
        heapq.heapify(self.items)
        self.next_candidate = max(self.next_candidate, end)

    def pop(self, count: int) -> list[int]:
        """The positions of the ``count`` lowest scores, removed from the heap."""
        if count > len(self.items):
            raise RuntimeError(f"asked to evict {count} tokens but only {len(self.items)} are evictable")
        return [heapq.heappop(self.items)[1] for _ in range(count)]


class ScoredPolicy(Policy):
    """A policy whose tokens carry a frozen score; evicts the lowest-scoring evictable tokens.

    Scores never change and tokens become evictable in position order (when they leave the recent
    window), so the candidates live in a heap: each step pushes the newcomers and pops the lowest,
    O(log K) instead of sorting K scores. Ties go to the older token; unscored tokens leave last.
    A non-finite score (an fp16 overflow in the signal) is stored as 0, neither kept for ever nor
    evicted first, and counted in :attr:`nonfinite`, which generation results report.
    """

    def __init__(self, options: PolicyOptions | None = None, **values: object) -> None:
        super().__init__(options, **values)
        self.book = self.scores = ScoreBook()
        self.nonfinite = 0
        self.candidates = CandidateHeap(unscored=math.inf)

    def record_score(self, position: int, score: float) -> None:
        if not math.isfinite(score):
            self.nonfinite += 1
            score = 0.0
        self.book.set(position, score)

    def select(self, cache: CacheView, count: int) -> list[int]:
        self.candidates.admit(self.book, cache.prompt_len, cache.seen - self.recent)
        return cache.slots_of(self.candidates.pop(count))

    def report(self) -> dict:
        """``nonfinite_scores``: tokens whose score signal was NaN or infinite (scored 0 instead)."""
        return {"nonfinite_scores": self.nonfinite}
