"""Copy lookahead: where the newest tokens repeat an earlier passage, what followed that passage is
likely to be read next.

A model that writes an n-gram it wrote (or read) before tends to go on as it did then: induction heads
attend to the token after the earlier occurrence, and prompt-lookup decoding drafts from it. Attention
already received cannot see this coming: in a long repeat (a list, a restated problem, an equation
quoted again), the earlier passage is attended only once the copy reaches it, often after it has left
the cache. :class:`NgramIndex` finds, on the host and in O(1) per token, where each new generated
token's last ``n`` tokens occurred before; a policy then credits the ``horizon`` positions after each
such occurrence (:func:`lookahead_hits`, on the device) as if they had been attended.
"""

from __future__ import annotations

from collections import deque

import torch


class NgramIndex:
    """Every n-gram of the sequence so far -> the position of its last token at its latest occurrence.

    State: one entry per distinct n-gram seen (token ids on the host, O(1) per token).
    """

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"n-gram length must be at least 1, got {n}")
        self.n = n
        self._latest: dict[tuple[int, ...], int] = {}
        self._tail: deque[int] = deque(maxlen=n)

    def feed(self, tokens: list[int], first: int, match: bool = True) -> list[int | None]:
        """Index ``tokens`` at positions ``first, first + 1, ...``. When ``match``, return for each token the
        position where the n-gram it closes last ended before (None: not seen before, or fewer than ``n``
        tokens so far); else ``[]``."""
        earlier: list[int | None] = []
        for offset, token in enumerate(tokens):
            self._tail.append(token)
            gram = tuple(self._tail) if len(self._tail) == self.n else None
            if match:
                earlier.append(self._latest.get(gram) if gram is not None else None)
            if gram is not None:
                self._latest[gram] = first + offset
        return earlier


def lookahead_hits(positions: torch.Tensor, starts: torch.Tensor, horizon: int) -> torch.Tensor:
    """``[...]`` float: for each held position ``p``, how many ranges ``(start, start + horizon]`` contain it.

    Args:
        positions: ``[...]`` logical positions (any shape, e.g. ``[layers, heads, slots]``).
        starts: ``[m]`` the ranges' starts (an earlier occurrence's last position), same device.
    Cost: O(positions x log m) via two binary searches (``#(start < p) - #(start + horizon < p)``).
    """
    ordered = torch.sort(starts).values
    positions = positions.contiguous()
    after_start = torch.searchsorted(ordered, positions, side="left")
    after_end = torch.searchsorted(ordered + horizon, positions, side="left")
    return (after_start - after_end).float()
