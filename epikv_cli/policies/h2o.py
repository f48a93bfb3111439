"""H2O, Heavy-Hitter Oracle (Zhang et al., arXiv 2306.14048), as the EpiKV authors ran it.

Each cached token accumulates the attention it receives: at prefill the column sums over all prompt
queries, then at every step the new query's row, each averaged over heads and evicting layers.
Kept: the first 4 tokens (sinks), the most recent ``min(128, K - 4)`` tokens, then the highest
accumulated scores. The prompt is not protected. (The original is per layer and per head with a
50/50 heavy/recent split; this is the global keep-set variant of METHOD.md.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from epikv_cli.policies.base import AttentionNeeds, AttentionRecord, BudgetFloor, Policy, PolicyOptions, Signals, lowest
from epikv_cli.policies.keep_scored import ScoreBook

if TYPE_CHECKING:
    from epikv_cli.core.view import CacheView

SINKS = 4


def authors_recent(budget: int) -> int:
    """``min(128, K - 4)``: the authors' recent window."""
    return max(0, min(128, budget - SINKS))


class H2O(Policy):
    """Accumulated received attention; needs attention weights (computed beside SDPA/flash kernels)."""

    name = "h2o"
    protects_prompt = False
    attention_needs = AttentionNeeds(received=True)
    default_recent = staticmethod(authors_recent)

    def __init__(self, options: PolicyOptions | None = None, **values: object) -> None:
        super().__init__(options, **values)
        self.sinks = SINKS
        self.accumulated = ScoreBook()

    def stage(self, signals: Signals) -> list[torch.Tensor]:
        return [AttentionRecord.layer_mean(signals.attention.received)]  # [stored], slot order

    def settle(self, signals: Signals, values: list[torch.Tensor]) -> None:
        self.accumulated.add(signals.cache.live_positions(), values[0])

    def budget_floor(self, prompt_len: int) -> BudgetFloor:
        """Smallest K that leaves one evictable entry after a step: K >= sinks + R(K) (and K > sinks).

        With the default R = min(128, K - 4) that is 5; below K = 133 no heavy hitter fits, so H2O
        then keeps exactly what StreamingLLM keeps.
        """
        budget = self.sinks + 1
        while budget < (needed := self.sinks + self.recent_for(budget)):
            budget = needed
        window = f"a {self.recent_for(budget)}-token recent window"
        return BudgetFloor(budget, f"{self.sinks} sink tokens and {window}", ", or a smaller --recent")

    def candidates(self, positions: torch.Tensor, seen: int) -> torch.Tensor:
        """``[n]`` bool: neither a sink nor in the recent window."""
        return (positions >= self.sinks) & (positions < seen - self.recent)

    def select(self, cache: CacheView, count: int) -> list[int]:
        positions = cache.live_positions()
        scores = torch.nan_to_num(self.accumulated.gather(positions), nan=0.0)
        return lowest(scores, positions, self.candidates(positions, cache.seen), count)
