"""What every eviction policy provides, and the keep rule most of them share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from epikv_cli.core.hostread import host_copies
from epikv_cli.errors import UsageError

if TYPE_CHECKING:
    from epikv_cli.config import CacheSettings
    from epikv_cli.core.attention import AttentionNeeds, AttentionRecord
    from epikv_cli.core.keepsets import HeadVictims
    from epikv_cli.core.view import CacheView

#: The recent window's cap in METHOD.md: R = min(128, K // 4).
RECENT_CAP = 128


def default_recent(budget: int) -> int:
    """The recent window R = min(128, K // 4) of METHOD.md."""
    return min(RECENT_CAP, budget // 4)


@dataclass
class Signals:
    """What one forward shows a policy, before anything is evicted.

    Attributes:
        appended: logical positions of the tokens this forward appended (``q`` of them).
        prompt: True for the prefill.
        hidden: block index -> that block's output ``[1, q, hidden]`` (the layers of :meth:`Policy.tap_layers`).
        attention: what :attr:`Policy.attention_needs` asked for, per evicting layer (slot-indexed).
        cache: the cache, the new tokens in its last ``q`` live slots.
    """

    appended: range
    prompt: bool
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    attention: AttentionRecord | None = None
    cache: CacheView | None = None

    def new_slots(self) -> slice:
        """The cache slots holding the appended tokens (always a contiguous run: the free slot, or the end)."""
        start = self.cache.slots_of([self.appended.start])[0]
        return slice(start, start + len(self.appended))


class Policy(ABC):
    """Turns signals from the forward pass into the slots to evict.

    Class attributes:
        name: the registry key (``--policy``).
        evicts: False for the unbounded ``full`` cache.
        has_scores: True when each token gets a frozen score worth plotting.
        protects_prompt: True when prompt tokens and the recent window are never evicted.
        takes_recent: False when the policy has no recent window, so ``--recent`` means nothing to it.
        attention_needs: what the policy reads from attention (None: nothing, it runs on any kernel).
        slack: entries the cache may hold beyond K between evictions (R-KV compresses in batches).
        staged: True when the policy observes in two halves, :meth:`stage` on the device and
            :meth:`settle` with the few host values it needs, so that the engine can read those values
            together with the sampled tokens (one synchronisation per step).
        granular: (instance) True when the policy keeps its own set per evicting layer and KV head: it
            reads ``cache.head_slots`` and :meth:`select` returns :class:`~epikv_cli.keepsets.HeadVictims`.

    Instance attributes:
        recent: R, the recent window in force.
        recent_follows_budget: True when R is the default ``min(128, K // 4)`` rather than a fixed ``--recent``.
    """

    name: ClassVar[str]
    evicts: ClassVar[bool] = True
    has_scores: ClassVar[bool] = False
    protects_prompt: ClassVar[bool] = True
    takes_recent: ClassVar[bool] = True
    attention_needs: ClassVar[AttentionNeeds | None] = None
    slack: ClassVar[int] = 0
    staged: ClassVar[bool] = False
    granular: bool = False
    #: tunable options (``--policies NAME:key=value``): name -> type of the value
    OPTIONS: ClassVar[dict[str, type]] = {}
    recent: int = 0
    recent_follows_budget: bool = False

    @classmethod
    @abstractmethod
    def from_settings(cls, settings: CacheSettings) -> Policy:
        """Build the policy from the CLI/API cache settings."""

    def setup(self, num_layers: int, calibration=None) -> None:
        """Resolve anything that depends on the model (called once, before the first forward).

        ``calibration`` is the model's saved :class:`~epikv_cli.calibrate.Calibration`, if any.
        """

    def tap_layers(self) -> list[int]:
        """Decoder blocks whose outputs :meth:`observe` needs."""
        return []

    @staticmethod
    def default_recent(budget: int) -> int:
        """R when ``--recent`` is not given: ``min(128, K // 4)`` (METHOD.md)."""
        return default_recent(budget)

    @classmethod
    def options_from(cls, settings: CacheSettings) -> dict:
        """``settings.options`` as keyword arguments, each converted to its declared type."""
        values = {}
        for key, text in settings.options:
            if key not in cls.OPTIONS:
                known = ", ".join(cls.OPTIONS) or "none"
                raise UsageError(f"policy {cls.name!r} has no option {key!r} (its options: {known})")
            try:
                values[key] = cls.OPTIONS[key](text)
            except ValueError:
                kind = {int: "a whole number", float: "a number"}.get(cls.OPTIONS[key], "text")
                raise UsageError(f"policy {cls.name!r}: option {key}={text!r} must be {kind}") from None
        return values

    @classmethod
    def recent_from(cls, settings: CacheSettings) -> int:
        """R for these settings: ``--recent``, else this policy's default for the budget."""
        if settings.recent is not None:
            return settings.recent
        return cls.default_recent(settings.budget) if settings.budget is not None else 0

    def observe(self, signals: Signals) -> None:
        """See one forward (scores, accumulators); the cache is not yet brought back within budget.

        A staged policy does it in its two halves at once (one host read of its own)."""
        if self.staged:
            self.settle(signals, host_copies(self.stage(signals)))

    def stage(self, signals: Signals) -> list[torch.Tensor]:
        """Device half of :meth:`observe` (staged policies): return the tensors :meth:`settle` needs on the host."""
        return []

    def settle(self, signals: Signals, values: list[torch.Tensor]) -> None:
        """Host half of :meth:`observe`: ``values`` are CPU float64 copies of what :meth:`stage` returned."""

    @abstractmethod
    def select(self, cache: CacheView, count: int) -> list[int] | HeadVictims:
        """Return ``count`` live slots of ``cache`` to evict (a granular policy: ``count`` per layer and head)."""

    def follow_moves(self, holes: list[int], movers: list[int]) -> None:
        """The cache moved slot ``movers[i]`` into ``holes[i]``: slot-indexed state must follow (default: none kept)."""

    def follow_head_moves(self, victims: torch.Tensor, last: int) -> None:
        """Granular: the cache moved each (layer, KV head)'s entry in slot ``last`` into its slot ``victims``
        ``[layers, heads, 1]`` (state in :class:`~epikv_cli.keepsets.HeadSlots` companions follows by itself)."""

    def recent_for(self, budget: int) -> int:
        """R under a budget of ``budget`` tokens (the default window grows with K)."""
        return self.default_recent(budget) if self.recent_follows_budget else self.recent

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

    def report(self) -> dict:
        """What this policy says of its run, for results and ``--json`` (``policy_report``); JSON types only."""
        return {}

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
