"""What every eviction policy provides, and the keep rule most of them share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

from ..errors import UsageError
from ..settings import default_recent

if TYPE_CHECKING:
    from ..cache import BudgetCache
    from ..settings import CacheSettings


class Policy(ABC):
    """Turns signals from the forward pass into the slots to evict.

    Class attributes:
        name: the registry key (``--policy``).
        evicts: False for the unbounded ``full`` cache.
        has_scores: True when each token gets a frozen score worth plotting.
        protects_prompt: True when prompt tokens and the recent window are never evicted.
        uses_recent: False when the policy has no recent window, so ``--recent`` means nothing to it.

    Instance attributes:
        recent: R, the recent window in force.
        recent_follows_budget: True when R is the default ``min(128, K // 4)`` rather than a fixed ``--recent``.
    """

    name: ClassVar[str]
    evicts: ClassVar[bool] = True
    has_scores: ClassVar[bool] = False
    protects_prompt: ClassVar[bool] = True
    uses_recent: ClassVar[bool] = True
    recent: int = 0
    recent_follows_budget: bool = False

    @classmethod
    @abstractmethod
    def from_settings(cls, settings: CacheSettings) -> Policy:
        """Build the policy from the CLI/API cache settings."""

    def setup(self, num_layers: int) -> None:
        """Resolve anything that depends on the model's depth (called once, before the first forward)."""

    def tap_layers(self) -> list[int]:
        """Decoder blocks whose outputs :meth:`observe` needs."""
        return []

    def observe(self, hidden: dict[int, torch.Tensor], appended: range, prompt: bool) -> None:
        """See one forward: ``hidden[layer]`` is that block's output ``[1, q, hidden]`` for the
        ``q = len(appended)`` tokens at logical positions ``appended``; ``prompt`` marks the prefill."""

    @abstractmethod
    def select(self, cache: BudgetCache, count: int) -> list[int]:
        """Return ``count`` live slots of ``cache`` to evict."""

    def recent_for(self, budget: int) -> int:
        """R under a budget of ``budget`` tokens (the default window grows with K)."""
        return default_recent(budget) if self.recent_follows_budget else self.recent

    def min_budget(self, prompt_len: int) -> int:
        """Smallest K with K > prompt + R(K): room for the prompt, the recent window and one new token.

        K - R(K) never decreases as K grows, so iterating K <- prompt + R(K) + 1 from below climbs to
        the smallest fixed point without overshooting it.
        """
        budget = prompt_len + 1
        while budget < (needed := prompt_len + self.recent_for(budget) + 1):
            budget = needed
        return budget

    def check_budget(self, prompt_len: int, budget: int | None) -> None:
        """Raise :class:`UsageError` when ``budget`` cannot hold the prompt and the recent window."""
        if budget is None or not self.evicts:
            return
        needed = self.min_budget(prompt_len)
        if budget < needed:
            raise UsageError(self.budget_advice(prompt_len, budget, needed))

    def budget_advice(self, prompt_len: int, budget: int, needed: int) -> str:
        """The message for a budget below :meth:`min_budget`."""
        return (
            f"--budget {budget} is not larger than the {prompt_len}-token prompt plus the "
            f"{self.recent_for(budget)}-token recent window; use --budget {needed} or more "
            f"(its recent window is {self.recent_for(needed)}), a shorter prompt, or a smaller --recent"
        )

    def score_of(self, position: int) -> float | None:
        """The frozen score of the token at ``position``, if this policy keeps one."""
        return None


def evictable_mask(positions: torch.Tensor, prompt_len: int, seen: int, recent: int) -> torch.Tensor:
    """``[n]`` bool: generated tokens outside the recent window (the last ``recent`` generated tokens).

    Args:
        positions: ``[n]`` logical positions of the live slots.
        prompt_len: prompt tokens, always kept.
        seen: logical length (prompt + generated so far).
        recent: R.
    """
    return (positions >= prompt_len) & (positions < seen - recent)


def lowest(scores: torch.Tensor, positions: torch.Tensor, candidates: torch.Tensor, count: int) -> list[int]:
    """Slots of the ``count`` lowest ``scores`` among ``candidates``; ties go to the older token.

    Args:
        scores: ``[n]`` per-slot scores.
        positions: ``[n]`` logical positions (the tie-break).
        candidates: ``[n]`` bool mask of evictable slots.
        count: how many to return; at most ``candidates.sum()``.
    """
    slots = torch.nonzero(candidates, as_tuple=True)[0]
    if count > slots.numel():
        raise RuntimeError(f"asked to evict {count} tokens but only {slots.numel()} are evictable")
    by_position = slots[torch.argsort(positions[slots], stable=True)]
    by_score = by_position[torch.argsort(scores[by_position], stable=True)]
    return by_score[:count].tolist()
