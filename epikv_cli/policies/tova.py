"""TOVA, Token Omission Via Attention (Oren et al., arXiv 2401.06104).

At every step, keep the tokens the current query attends to most: its attention averaged over
heads and evicting layers (the original is per layer). The newest token is always kept, as in
kvpress. No sinks, no recent window, no protected prompt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from epikv_cli.policies.base import AttentionNeeds, AttentionRecord, BudgetFloor, Policy, PolicyOptions, Signals, lowest

if TYPE_CHECKING:
    from epikv_cli.core.view import CacheView


class TOVA(Policy):
    """The current query's attention decides; needs attention weights (computed beside SDPA/flash kernels)."""

    name = "tova"
    protects_prompt = False
    takes_recent = False
    attention_needs = AttentionNeeds(last_row=True)

    def __init__(self, options: PolicyOptions | None = None, **values: object) -> None:
        super().__init__(options, **values)
        self.current: torch.Tensor | None = None  # [stored] slot order, from the latest forward

    def stage(self, signals: Signals) -> list[torch.Tensor]:
        return [AttentionRecord.layer_mean(signals.attention.last_row)]  # [stored], slot order

    def settle(self, signals: Signals, values: list[torch.Tensor]) -> None:
        self.current = values[0]

    def budget_floor(self, prompt_len: int) -> BudgetFloor:
        return BudgetFloor(2, "the newest token and at least one other")

    def select(self, cache: CacheView, count: int) -> list[int]:
        positions = cache.live_positions()
        return lowest(self.current, positions, positions != cache.seen - 1, count)
