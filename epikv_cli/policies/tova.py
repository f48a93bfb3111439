"""TOVA, Token Omission Via Attention (Oren et al., arXiv 2401.06104).

At every step, keep the tokens the current query attends to most: its attention averaged over
heads and evicting layers (the original is per layer). The newest token is always kept, as in
kvpress. No sinks, no recent window, no protected prompt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from epikv_cli.config import CacheSettings
from epikv_cli.core.attention import AttentionNeeds, AttentionRecord
from epikv_cli.policies.base import Policy, Signals, lowest

if TYPE_CHECKING:
    from epikv_cli.core.view import CacheView


class TOVA(Policy):
    """The current query's attention decides; needs attention weights (computed beside SDPA/flash kernels)."""

    name = "tova"
    protects_prompt = False
    takes_recent = False
    attention_needs = AttentionNeeds(last_row=True)
    staged = True

    def __init__(self) -> None:
        self.current: torch.Tensor | None = None  # [stored] slot order, from the latest forward

    @classmethod
    def from_settings(cls, settings: CacheSettings) -> TOVA:
        return cls()

    def stage(self, signals: Signals) -> list[torch.Tensor]:
        return [AttentionRecord.layer_mean(signals.attention.last_row)]  # [stored], slot order

    def settle(self, signals: Signals, values: list[torch.Tensor]) -> None:
        self.current = values[0]

    def min_budget(self, prompt_len: int) -> int:
        return 2

    def budget_advice(self, prompt_len: int, budget: int, needed: int) -> str:
        return (
            f"--budget {budget} is too small for tova, which keeps the newest token and at least one other; use "
            f"--budget {needed} or more"
        )

    def select(self, cache: CacheView, count: int) -> list[int]:
        positions = cache.live_positions()
        return lowest(self.current, positions, positions != cache.seen - 1, count)
