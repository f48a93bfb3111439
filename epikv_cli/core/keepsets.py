"""Keep-sets per evicting layer and KV head, decided and applied on the model's device.

The budget cache's slot table gives every evicting layer one shared keep-set. A granular policy keeps
a different set of tokens in every layer and KV head (as SnapKV, PyramidKV and kvpress's presses do),
which measured closer to the full cache than one global set. :class:`HeadSlots` holds, for one
sequence, which logical position each slot of every (layer, KV head) holds. Every (layer, head) uses
the same slots ``0 .. used - 1`` as the shared slot table, so the attention kernels and masks are exactly
those of the shared table; only which token a slot holds differs from head to head.

In a single sequence's steady state (one victim per (layer, head) per step) nothing moves: each head's
victim slot is left vacant and the next token's key and value are written into it, head by head
(:attr:`HeadSlots.vacant`, :meth:`HeadSlots.append`). Otherwise entries are kept compact: when one entry
per (layer, head) leaves a row of a batch (or a vacancy must be closed before several tokens come), each
head's last entry moves into its victim's slot (one indexed copy per tensor and layer, device indices
only: no host round-trip); several at once (a prompt over the budget) are gathered to the front.

Every (layer, head) evicts the same number of entries, so counts stay shared. A token has fully left
the cache when no (layer, head) holds it any more: :attr:`HeadSlots.holders` counts, per logical
position, the pairs still holding it, so that events can name the tokens gone everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_GROWTH = 2
#: Slots and positions allocated beyond the first need (then doubling).
HEADROOM = 256
_LAST = torch.iinfo(torch.long).max


def capped(slots: int, limit: int | None) -> int:
    """``slots``, at most ``limit`` (None: no bound)."""
    return slots if limit is None else min(slots, limit)


def grown_capacity(needed: int, capacity: int, limit: int | None = None) -> int:
    """What a buffer of ``capacity`` slots grows to for ``needed``: doubled, never past ``limit`` (the most slots its
    cache uses; None: no bound) unless ``needed`` is more."""
    return max(needed, capped(_GROWTH * capacity, limit))


def order_keys(scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int64 keys that sort like ``(score, position)``: one ``argmin`` or ``topk`` finds the lowest score
    and, among equal scores, the older token. ``scores`` are float32 (any sign), ``positions`` < 2**32."""
    bits = scores.float().view(torch.int32)
    monotone = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # float order as int32: a negative float's magnitude bits flip
    return monotone.to(torch.int64).bitwise_left_shift_(32).bitwise_or_(positions)  # positions fill the low 32 bits


@dataclass
class HeadVictims:
    """What a granular policy evicts in one step: ``slots`` ``[layers, heads, count]`` per (layer, KV head),
    and ``gone``, the logical positions no (layer, head) holds any more afterwards (host list)."""

    slots: torch.Tensor
    gone: list[int]

    def __len__(self) -> int:
        return self.slots.shape[-1]


@dataclass
class HeadMoves:
    """How every (layer, head) closes the slots its victims leave.

    Either one victim each: ``victims`` ``[layers, heads]`` and the slot ``last`` whose entry moves into
    it (a victim in the last slot stays where it is: the slot is dropped); or several: ``order``
    ``[layers, heads, kept]``, the slots to keep in slot order, gathered to the front.
    """

    victims: torch.Tensor | None = None
    last: int = 0
    order: torch.Tensor | None = None
    _head_index: dict = field(default_factory=dict, repr=False)

    def _heads(self, heads: int, device: torch.device) -> torch.Tensor:
        """``arange(heads)`` on ``device``, made once per device for all the layers and buffers."""
        if device not in self._head_index:
            self._head_index[device] = torch.arange(heads, device=device)
        return self._head_index[device]

    def apply_stacked(self, tensor: torch.Tensor) -> None:
        """Apply every layer's moves to ``tensor`` ``[layers, heads, slots]`` at once (in place)."""
        if self.order is not None:
            tensor[..., : self.order.shape[-1]] = torch.gather(tensor, -1, self.order)
            return
        layers, heads = self.victims.shape
        rows = torch.arange(layers, device=tensor.device)[:, None]
        tensor[rows, self._heads(heads, tensor.device)[None, :], self.victims] = tensor[:, :, self.last].clone()

    def apply(self, tensor: torch.Tensor, layer: int) -> None:
        """Apply layer ``layer``'s moves to ``tensor`` ``[heads, slots, ...]`` (a view, moved in place)."""
        if self.order is not None:
            order = self.order[layer].to(tensor.device)
            index = order.view(*order.shape, *([1] * (tensor.dim() - 2))).expand(*order.shape, *tensor.shape[2:])
            tensor[:, : order.shape[1]] = torch.gather(tensor, 1, index)
            return
        # (a copy of the last entries: a head whose victim is its last slot writes onto what it reads)
        tensor[self._heads(tensor.shape[0], tensor.device), self.victims[layer].to(tensor.device)] = tensor[
            :, self.last
        ].clone()


class HeadSlots:
    """Which logical position each slot of every evicting layer and KV head holds, on one device.

    Args:
        layers: evicting layers; heads: KV heads per layer; device: where the map lives.
        limit: the most slots the cache holds (its K + 1 ring, say): the map grows to it and no further, unless one
            append needs more (None: it doubles as it fills). Doubling past it would hold up to twice the slots
            for every (layer, head) on the device: 48 MiB more per sequence for a 64-layer, 8-KV-head model at
            K = 8192 (int64 positions, one float32 companion).

    Attributes:
        positions: ``[layers, heads, capacity]`` int64, valid for slots below the cache's stored count.
        holders: ``[tokens]`` int32: how many (layer, head) pairs hold each logical position.
        companions: a policy's slot-indexed ``[layers, heads, capacity]`` state, moved with the entries.
    """

    def __init__(self, layers: int, heads: int, device: torch.device | str, limit: int | None = None) -> None:
        self.layers, self.heads, self.device, self.limit = layers, heads, torch.device(device), limit
        self.positions = mutable_zeros((layers, heads, capped(HEADROOM, limit)), torch.long, self.device)
        self.holders = mutable_zeros((HEADROOM,), torch.int32, self.device)
        self.companions: list[torch.Tensor] = []
        #: ``[layers, heads]`` the slot each (layer, head) left vacant at the last single eviction, which its
        #: next token fills (None: compact, slots ``0 .. stored - 1`` all live)
        self.vacant: torch.Tensor | None = None
        self._minus_ones: torch.Tensor | None = None  # what a release adds to its victims' holder counts

    @property
    def capacity(self) -> int:
        return self.positions.shape[-1]

    def _grow(self, slots: int, tokens: int) -> None:
        if slots > self.capacity:
            size = grown_capacity(slots, self.capacity, self.limit)
            self.positions = _padded(self.positions, size)
            self.companions = [_padded(tensor, size) for tensor in self.companions]
        if tokens > self.holders.numel():
            self.holders = _padded(self.holders, grown_capacity(tokens, self.holders.numel()))

    def companion(self, dtype: torch.dtype = torch.float32) -> int:
        """Register a zero ``[layers, heads, capacity]`` tensor that follows every move; return its index
        (read it back as ``companions[index]``: growing replaces the tensor)."""
        self.companions.append(mutable_zeros((self.layers, self.heads, self.capacity), dtype, self.device))
        return len(self.companions) - 1

    def append(self, start: int, count: int, first: int) -> torch.Tensor | None:
        """Slots ``start .. start + count - 1`` of every (layer, head) now hold positions ``first ..``; or, for
        one token while slots are vacant, each (layer, head)'s vacant slot does: then return those slots
        ``[layers, heads]`` (where the layers write it), else None. Vacancies must be closed before ``count > 1``."""
        self._grow(start + count, first + count)
        self.holders[first : first + count] = self.layers * self.heads
        if self.vacant is not None:
            if count != 1:
                raise RuntimeError("close the vacant slots (HeadSlots.close_vacant) before appending several tokens")
            slots, self.vacant = self.vacant, None
            self.positions.scatter_(-1, slots[..., None], first)
            for tensor in self.companions:
                tensor.scatter_(-1, slots[..., None], 0)
            return slots
        self.positions[:, :, start : start + count] = torch.arange(first, first + count, device=self.device)
        for tensor in self.companions:
            tensor[:, :, start : start + count] = 0
        return None

    def vacate(self, victims: torch.Tensor) -> None:
        """One victim per (layer, head), ``[layers, heads]``, leaves its slot vacant for the next token (no move)."""
        if self.vacant is not None:
            raise RuntimeError("a second vacancy per (layer, head) before a token filled the first")
        self.vacant = victims

    def close_vacant(self, stored: int) -> HeadMoves | None:
        """Close the vacant slots (``stored`` live entries besides them) by moving each head's last used entry,
        slot ``stored``, into its vacant slot; return the moves for the key and value buffers (None: none vacant)."""
        if self.vacant is None:
            return None
        victims, self.vacant = self.vacant, None
        return self.plan(victims[..., None], stored + 1)

    def held(self, stored: int) -> torch.Tensor:
        """``[layers, heads, stored]`` positions each (layer, head) holds, vacancies left out (a copy when some are
        vacant: the order is then that of the slots after closing them)."""
        if self.vacant is None:
            return self.live(stored)
        used = self.positions[:, :, : stored + 1].clone()
        used.scatter_(-1, self.vacant[..., None], used[:, :, stored:])
        return used[:, :, :stored]

    def live(self, stored: int) -> torch.Tensor:
        """``[layers, heads, stored]`` positions of the live slots (a view)."""
        return self.positions[:, :, :stored]

    def lowest(self, scores: torch.Tensor, candidates: torch.Tensor, stored: int, count: int) -> torch.Tensor:
        """``[layers, heads, count]`` slots with the lowest ``scores`` among ``candidates`` (ties: the older
        token), per (layer, head). Every (layer, head) must have ``count`` candidates.

        Args:
            scores: ``[layers, heads, stored]``; candidates: ``[layers, heads, stored]`` bool.
        """
        keys = order_keys(scores, self.live(stored)).masked_fill_(~candidates, _LAST)
        if count == 1:
            return keys.argmin(dim=-1, keepdim=True)
        return torch.topk(keys, count, dim=-1, largest=False, sorted=True).indices

    def release(
        self, victims: torch.Tensor, stored: int, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Count the ``victims`` ``[layers, heads, count]`` out of :attr:`holders`; return their positions
        ``[n]`` and whether each is now held nowhere ``[n]`` (both on the device, for one host read).
        ``positions``: the victims' ``[layers, heads, count]`` positions, when known already."""
        gone = (torch.gather(self.live(stored), -1, victims) if positions is None else positions).reshape(-1)
        if self._minus_ones is None or self._minus_ones.shape != gone.shape:
            self._minus_ones = torch.full_like(gone, -1, dtype=torch.int32)
        self.holders.index_add_(0, gone, self._minus_ones)
        return gone, self.holders[gone] == 0

    def plan(self, victims: torch.Tensor, stored: int) -> HeadMoves:
        """Move this map and the companions for dropping ``victims`` ``[layers, heads, count]`` of ``stored``
        live slots; return the same moves for the key and value buffers."""
        count = victims.shape[-1]
        if count == 1:
            moves = HeadMoves(victims=victims[..., 0], last=stored - 1)
        else:
            keep = torch.ones((self.layers, self.heads, stored), dtype=torch.bool, device=self.device)
            keep.scatter_(-1, victims, False)
            order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)[..., : stored - count]
            moves = HeadMoves(order=order)
        for tensor in [self.positions, *self.companions]:
            moves.apply_stacked(tensor)
        return moves

    def kept_age(self, stored: int, seen: int, prompt_len: int) -> float | None:
        """Mean age (``seen`` minus position) of the generated tokens held, over every (layer, head)."""
        positions = self.held(stored)
        generated = positions[positions >= prompt_len]
        return float((seen - generated).float().mean()) if generated.numel() else None


def mutable_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor that may be updated in place inside and outside inference mode (the cache is written
    during the model's forward, the policy updates it after)."""
    with torch.inference_mode(False):
        return torch.zeros(shape, dtype=dtype, device=device)


def _padded(tensor: torch.Tensor, size: int) -> torch.Tensor:
    """``tensor`` with its last dimension zero-padded to ``size``."""
    grown = mutable_zeros((*tensor.shape[:-1], size), tensor.dtype, tensor.device)
    grown[..., : tensor.shape[-1]] = tensor
    return grown
