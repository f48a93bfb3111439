"""What a policy may read of the cache that holds its sequence, and the forms its answer takes.

Two engines hold caches: a single sequence's :class:`~epikv_cli.core.cache.BudgetCache` and one row of a batch's
:class:`~epikv_cli.core.rows.RowsCache` (:class:`~epikv_cli.core.rows.RowView`); both are a :class:`CacheView`.
A policy reads nothing else of them, and the cache holds no policy: after each forward the runtime shows the
policy the view, takes its answer and tells the cache to evict.

Answers (:meth:`~epikv_cli.policies.base.Policy.select`):
- one shared set: ``list[int]``, the slots that leave every evicting layer and KV head;
- per (layer, KV head): :class:`~epikv_cli.core.keepsets.HeadVictims`, ``[layers, kv_heads, count]`` slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from epikv_cli.core.keepsets import HeadSlots, HeadVictims, order_keys

#: What :meth:`~epikv_cli.policies.base.Policy.select` returns: shared slots, or victims per (layer, KV head).
Victims = list[int] | HeadVictims


@dataclass
class Moves:
    """Entries the cache moved to close the slots its victims left, for a policy's slot-indexed state to follow.

    Attributes:
        holes, movers: one shared set: the entry in slot ``movers[i]`` now lies in slot ``holes[i]``.
        head_victims: per (layer, KV head): ``[layers, kv_heads, 1]`` the slot each one's entry in slot
            ``head_last`` moved into (None: no such move).
        head_last: that last slot.
    """

    holes: list[int] = field(default_factory=list)
    movers: list[int] = field(default_factory=list)
    head_victims: torch.Tensor | None = None
    head_last: int = -1


class CacheView(Protocol):
    """One sequence's cache as a policy sees it.

    Attributes:
        budget: K, the most entries an evicting layer keeps between steps (None: unbounded).
        prompt_len: tokens of the prompt (the first forward).
        seen: logical length, tokens ever appended.
        stored: live entries per evicting layer and KV head (while a forward's policy runs: in slots
            ``0 .. stored - 1``).
        evicting_layers: the decoder blocks whose cache is bounded (full attention), in order.
        head_slots: per (layer, KV head) occupancy (the logical position each slot holds, and companions that
            follow moves) when the policy keeps a set per (layer, KV head); None for a shared set.
    """

    budget: int | None
    head_slots: HeadSlots | None

    @property
    def prompt_len(self) -> int: ...

    @property
    def seen(self) -> int: ...

    @property
    def stored(self) -> int: ...

    @property
    def evicting_layers(self) -> list[int]: ...

    def live_positions(self) -> torch.Tensor:
        """``[stored]`` int64 on the CPU: the logical position of each live slot, in slot order."""

    def slots_of(self, positions: list[int]) -> list[int]:
        """The slots of live logical ``positions`` (shared keep-sets)."""

    def layer_kv(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[1, kv_heads, stored, head_dim]`` (views) of the ``index``-th evicting layer, in slot
        order."""


#: Re-exported for policies, which import only the policy base, this module and torch: a granular policy's occupancy
#: (:class:`HeadSlots`), its answer (:class:`HeadVictims`) and the (score, position) sort key (:func:`order_keys`).
__all__ = ["CacheView", "HeadSlots", "HeadVictims", "Moves", "Victims", "order_keys"]
