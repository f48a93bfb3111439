"""Attention-free baselines: the full cache, StreamingLLM and random eviction."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from epikv_cli.config import CacheSettings
from epikv_cli.policies.base import Policy, evictable_mask

if TYPE_CHECKING:
    from epikv_cli.core.view import CacheView


class FullCache(Policy):
    """No eviction: the reference every budget is compared with."""

    name = "full"
    evicts = False
    takes_recent = False

    @classmethod
    def from_settings(cls, settings: CacheSettings) -> FullCache:
        return cls()

    def select(self, cache: CacheView, count: int) -> list[int]:
        return []


class Streaming(Policy):
    """StreamingLLM (arXiv 2309.17453): the first ``sinks`` tokens plus the most recent ``K - sinks``."""

    name = "streaming"
    protects_prompt = False
    takes_recent = False

    def __init__(self, sinks: int = 4) -> None:
        self.sinks = sinks
        self._oldest = sinks  # every position between the sinks and this one has left already

    @classmethod
    def from_settings(cls, settings: CacheSettings) -> Streaming:
        return cls()

    def min_budget(self, prompt_len: int) -> int:
        return self.sinks + 1

    def budget_advice(self, prompt_len: int, budget: int, needed: int) -> str:
        return (
            f"--budget {budget} is too small for streaming, which keeps {self.sinks} sink tokens and "
            f"at least one recent token; use --budget {needed} or more"
        )

    def select(self, cache: CacheView, count: int) -> list[int]:
        """The ``count`` oldest non-sink tokens: streaming evicts in position order, O(count) per step."""
        leaving = list(range(self._oldest, self._oldest + count))
        self._oldest += count
        return cache.slots_of(leaving)


class RandomEviction(Policy):
    """Uniform choice among evictable tokens (prompt and recent window kept), seeded."""

    name = "random"

    def __init__(self, recent: int, seed: int = 0) -> None:
        self.recent = recent
        self.generator = torch.Generator().manual_seed(seed)

    @classmethod
    def from_settings(cls, settings: CacheSettings) -> RandomEviction:
        return cls(recent=cls.recent_from(settings), seed=settings.seed)

    def select(self, cache: CacheView, count: int) -> list[int]:
        positions = cache.live_positions()
        slots = torch.nonzero(evictable_mask(positions, cache.prompt_len, cache.seen, self.recent), as_tuple=True)[0]
        pick = torch.randperm(slots.numel(), generator=self.generator)[:count]
        return slots[pick].tolist()
