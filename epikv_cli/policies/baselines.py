"""Attention-free baselines: the full cache, StreamingLLM and random eviction."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from epikv_cli.policies.base import BudgetFloor, Policy, PolicyOptions, evictable_mask

if TYPE_CHECKING:
    from epikv_cli.core.view import CacheView


#: StreamingLLM's attention sinks: the first tokens, kept for ever.
SINKS = 4


class FullCache(Policy):
    """No eviction: the reference every budget is compared with."""

    name = "full"
    evicts = False
    takes_recent = False

    def select(self, cache: CacheView, count: int) -> list[int]:
        return []


class Streaming(Policy):
    """StreamingLLM (arXiv 2309.17453): the first ``sinks`` tokens plus the most recent ``K - sinks``."""

    name = "streaming"
    protects_prompt = False
    takes_recent = False

    def __init__(self, options: PolicyOptions | None = None, **values: object) -> None:
        super().__init__(options, **values)
        self.sinks = SINKS
        self._oldest = SINKS  # every position between the sinks and this one has left already

    def budget_floor(self, prompt_len: int) -> BudgetFloor:
        return BudgetFloor(self.sinks + 1, f"{self.sinks} sink tokens and at least one recent token")

    def select(self, cache: CacheView, count: int) -> list[int]:
        """The ``count`` oldest non-sink tokens: streaming evicts in position order, O(count) per step."""
        leaving = list(range(self._oldest, self._oldest + count))
        self._oldest += count
        return cache.slots_of(leaving)


class RandomEviction(Policy):
    """Uniform choice among evictable tokens (prompt and recent window kept), seeded."""

    name = "random"

    def __init__(self, options: PolicyOptions | None = None, **values: object) -> None:
        super().__init__(options, **values)
        self.generator = torch.Generator().manual_seed(self.options.seed)

    def select(self, cache: CacheView, count: int) -> list[int]:
        positions = cache.live_positions()
        slots = torch.nonzero(evictable_mask(positions, cache.prompt_len, cache.seen, self.recent), as_tuple=True)[0]
        pick = torch.randperm(slots.numel(), generator=self.generator)[:count]
        return slots[pick].tolist()
