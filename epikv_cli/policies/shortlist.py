"""Each (layer, KV head)'s victims until the next refresh, decided at the refresh (epikv2 ``keep=head``).

Between refreshes scores are frozen and one token leaves the recent window per step, so a refresh can decide the
next ``period`` steps' victims at once; a step then reads its own, with no search of K and no kernel.
"""

from __future__ import annotations

import torch

from epikv_cli.core.view import HeadSlots, order_keys

_LAST = torch.iinfo(torch.long).max


class Shortlist:
    """Each (layer, head)'s victims until the next refresh, decided when the list is built, so that a step
    between refreshes only reads its own (no search of K, no kernel). Scores are frozen between refreshes
    and one token leaves the recent window per step, so the victim of each step is among the ``period + 1``
    lowest current candidates and the ``period`` tokens that leave the recent window meanwhile; the build
    plays the steps' picks in turn over those few (one token is a candidate once it is older than its
    layer's recent window, the lowest order key leaves, ties: the older), as a search of all K would at
    each step. Slots follow the moves that close the victims' slots.

    Attributes:
        slots, positions: ``[layers, heads, steps]`` each step's victim: its slot and logical position.
        first: the logical length at the build, the first step's.
    """

    def __init__(self, slots: torch.Tensor, positions: torch.Tensor, first: int) -> None:
        self.slots, self.positions, self.first = slots, positions, first

    @classmethod
    def build(
        cls,
        slots: HeadSlots,
        scores: torch.Tensor,
        candidates: torch.Tensor,
        window_start: torch.Tensor,
        floor: int,
        stored: int,
        period: int,
        seen: int,
    ) -> Shortlist:
        """From ``scores`` and ``candidates`` ``[layers, heads, stored]``, with the recent window of each
        layer starting at ``window_start`` ``[layers, 1, 1]`` at logical length ``seen`` (its oldest tokens are
        the next candidates): the victims of this step and the ``period`` after it."""
        positions = slots.live(stored)
        # this step's victim and up to `period` picks come from the lowest current candidates
        low = torch.topk(
            order_keys(scores, positions).masked_fill_(~candidates, _LAST),
            min(period + 1, stored),
            dim=-1,
            largest=False,
        )
        upcoming = (positions >= window_start) & (positions < window_start + period) & (positions >= floor)
        soon = torch.topk(positions.masked_fill(~upcoming, _LAST), min(period, stored), dim=-1, largest=False)
        soon_keys = order_keys(torch.gather(scores, -1, soon.indices), soon.values).masked_fill_(
            soon.values == _LAST, _LAST
        )
        listed = torch.cat([low.indices, soon.indices], dim=-1)
        listed_positions = torch.gather(positions, -1, listed)
        keys = torch.cat([low.values, soon_keys], dim=-1)
        wait = listed_positions - window_start  # a listed token is a candidate from the step after this many
        picks = []
        for step in range(period + 1):
            chosen = keys.masked_fill(wait >= step, _LAST).argmin(dim=-1, keepdim=True)
            keys.scatter_(-1, chosen, _LAST)
            picks.append(chosen)
        order = torch.cat(picks, dim=-1)
        return cls(torch.gather(listed, -1, order), torch.gather(listed_positions, -1, order), seen)

    def pick(self, seen: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[layers, heads, 1]`` slots and positions of each (layer, head)'s victim at logical length ``seen``
        (views).
        """
        step = seen - self.first
        if not 0 <= step < self.slots.shape[-1]:
            raise RuntimeError(f"a short list built at length {self.first} holds no victim for length {seen}")
        return self.slots[..., step : step + 1], self.positions[..., step : step + 1]

    def follow(self, victims: torch.Tensor, last: int) -> None:
        """The entry in slot ``last`` moved into each (layer, head)'s victim slot ``[layers, heads, 1]``."""
        self.slots = torch.where(self.slots == last, victims, self.slots)


def gone_positions(positions: torch.Tensor, gone: torch.Tensor) -> list[int]:
    """Host copies of :meth:`HeadSlots.release`'s results -> the sorted positions held nowhere any more."""
    return sorted({int(p) for p, g in zip(positions.tolist(), gone.tolist()) if g})
