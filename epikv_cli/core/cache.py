"""The budget cache: preallocated KV slots, logical positions, keep-set application.

It knows nothing about scores. A policy names the slots to drop. In the steady state one entry leaves
per step, and its slot is simply left free: the next token is written into it, so nothing moves.
When several leave at once (a prefill over the budget, R-KV's batch compression) the holes are
filled with the newest entries (O(evicted) slot moves per layer, never a copy of the whole cache).
A slot -> logical position map gives whoever needs it the order back.

Layout of every evicting layer: ``keys``/``values`` of shape ``[1, kv_heads, capacity, head_dim]``;
slots ``0 .. used-1`` are in use, in no particular order; at most one of them is free between
forwards (see :class:`SlotTable`). Sliding-window layers (Mistral, Gemma 3's
local layers) are bounded already and stay transformers' own ``DynamicSlidingWindowLayer``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DynamicSlidingWindowLayer,
    get_layer_types_and_kwargs,
)

from epikv_cli.core.keepsets import HeadSlots, HeadVictims, capped, grown_capacity, mutable_zeros
from epikv_cli.errors import UsageError

#: Slots allocated beyond the first forward's tokens (then doubling, up to the layer's limit).
HEADROOM = 256


FULL, SLIDING = "full", "sliding"


def layer_groups(config: PretrainedConfig) -> tuple[list[str], list[dict]]:
    """Per decoder layer, :data:`FULL` (bounded by the budget, evicting) or :data:`SLIDING` (a sliding or chunked
    window, bounded already), and its transformers layer arguments; :class:`UsageError` for any other kind.
    Both caches (one sequence, a batch of rows) classify their layers here."""
    text_config = config.get_text_config(decoder=True)
    layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
    groups = []
    for index, kind in enumerate(layer_types):
        if kind == "full_attention":
            groups.append(FULL)
        elif kind in ("sliding_attention", "chunked_attention"):
            groups.append(SLIDING)
        else:
            raise UsageError(
                f"layer {index} is a {kind!r} layer; the EpiKV cache supports full and sliding attention only"
            )
    return groups, layer_kwargs


def sliding_window(layer_kwargs: list[dict]) -> int | None:
    """The sliding layers' window in tokens (from :func:`layer_groups`' layer arguments), None where none slides."""
    return next((kwargs["sliding_window"] for kwargs in layer_kwargs if kwargs.get("sliding_window")), None)


def entry_bytes(keys: torch.Tensor, values: torch.Tensor) -> int:
    """Bytes one entry (one token, every KV head) takes in ``[batch, kv_heads, slots, dim]`` key and value buffers."""
    return keys.shape[1] * (keys.shape[-1] * keys.element_size() + values.shape[-1] * values.element_size())


def fill_plan(stored: int, drop: set[int]) -> tuple[list[int], list[int]]:
    """Where entries move when the slots ``drop`` leave ``stored`` live slots: ``movers[i]`` -> ``holes[i]``.

    The newest live slots not being dropped fill the holes left below the new length, so only
    ``len(drop)`` entries move, and whoever keeps per-slot state beside the cache can follow.
    """
    new_stored = stored - len(drop)
    holes = sorted(s for s in drop if s < new_stored)
    movers = [s for s in range(new_stored, stored) if s not in drop]
    return holes, movers


class SlotTable:
    """Slot -> logical position map shared by all evicting layers (one global keep-set).

    Attributes:
        positions: ``[capacity]`` int64 on the CPU; ``positions[s]`` is the logical index of the token
            in slot ``s``, valid for ``s < used`` except the free slot.
        stored: live entries.
        free: the slot left by the single entry the last step evicted, which the next token will fill
            (``None`` when every used slot is live, always the case while a forward's policy runs).
        seen: logical length, i.e. tokens ever appended.
        committed: ``seen`` at the end of the last forward (tokens after it are still being scored).
        prompt_len: tokens appended by the first forward, the prompt (``None`` before it).
        slot_of: logical position -> slot of every live token (the inverse map, kept in O(1) per change),
            so a policy that knows which positions leave finds their slots without scanning K.
        track: whether the two maps follow each step; False for a granular keep-set's table, which only
            counts (its per-head map is :class:`~epikv_cli.keepsets.HeadSlots`).
    """

    def __init__(self, capacity: int, track: bool = True) -> None:
        self.track = track
        # the map grows during the forward (in inference mode) and is updated after it
        self.positions = mutable_zeros((capacity,), torch.long, torch.device("cpu"))
        self.stored = 0
        self.free: int | None = None
        self.seen = 0
        self.committed = 0
        self.prompt_len: int | None = None
        self.slot_of: dict[int, int] = {}

    @property
    def used(self) -> int:
        """Slots in use: the live ones plus the free one."""
        return self.stored + (self.free is not None)

    def append(self, count: int) -> WritePlan:
        """Record ``count`` new tokens; return where every evicting layer writes them.

        One token fills the free slot if there is one. Several tokens need contiguous slots at the end,
        so a free slot is first closed by moving the last used entry into it.
        """
        if self.free is not None and count == 1:
            slot, self.free = self.free, None
            if self.track:
                self.positions[slot] = self.seen
                self.slot_of[self.seen] = slot
            self.stored += 1
            self.seen += 1
            return WritePlan(slot)
        closed = self._close_free()
        needed = self.stored + count
        if needed > self.positions.numel():
            grown = mutable_zeros((grown_capacity(needed, self.positions.numel()),), torch.long, torch.device("cpu"))
            grown[: self.stored] = self.positions[: self.stored]
            self.positions = grown
        self.positions[self.stored : needed] = torch.arange(self.seen, self.seen + count)
        self.slot_of.update(zip(range(self.seen, self.seen + count), range(self.stored, needed)))
        start, self.stored = self.stored, needed
        self.seen += count
        return WritePlan(start, closed)

    def _close_free(self) -> tuple[int, int] | None:
        """Move the last used entry into the free slot; return ``(hole, mover)`` (None when nothing moves)."""
        hole, self.free = self.free, None
        if hole is None or hole == self.stored:  # no free slot, or it was the last one
            return None
        mover = self.stored
        self.positions[hole] = self.positions[mover]
        self.slot_of[int(self.positions[hole])] = hole
        return hole, mover

    def live_positions(self) -> torch.Tensor:
        """``[stored]`` logical positions, in slot order when no slot is free (a view), else without the free slot."""
        if self.free is None:
            return self.positions[: self.stored]
        return torch.cat([self.positions[: self.free], self.positions[self.free + 1 : self.used]])

    def plan_eviction(self, slots: list[int]) -> tuple[list[int], list[int]]:
        """Update the map for dropping ``slots``; return ``(holes, movers)``: move slot ``movers[i]`` to ``holes[i]``.

        A single slot leaving a table with no free slot becomes the free slot: nothing moves. Otherwise
        the newest used slots not being dropped fill the holes left below the new length (a free slot
        counts as a hole), so only ``len(slots)`` entries move.
        """
        if self.track:
            for slot in slots:
                del self.slot_of[int(self.positions[slot])]
        if len(slots) == 1 and self.free is None:
            self.free = slots[0]
            self.stored -= 1
            return [], []
        drop = set(slots) | ({self.free} if self.free is not None else set())
        holes, movers = fill_plan(self.used, drop)
        if holes:
            self.positions[holes] = self.positions[movers]
            for hole in holes:
                self.slot_of[int(self.positions[hole])] = hole
        self.stored -= len(slots)
        self.free = None
        return holes, movers


@dataclass(frozen=True)
class WritePlan:
    """Where a forward's new entries go in every evicting layer: from slot ``start`` on, after moving
    slot ``close[1]`` into slot ``close[0]`` when a free slot had to be closed first."""

    start: int
    close: tuple[int, int] | None = None


class BudgetLayer(CacheLayerMixin):
    """One evicting layer: slots allocated as they fill, up to a limit.

    The first forward allocates room for its tokens plus :data:`HEADROOM` (never more than ``limit``);
    after that the buffers double when full, never beyond ``limit`` unless a single forward needs
    more. A budgeted layer's limit is K + 1, so it settles at exactly K + 1 slots; an unbounded one
    grows with the sequence (amortised O(1) copies per token) instead of allocating
    prompt + max-new-tokens up front.

    Reports the logical length (tokens seen) as its sequence length, like transformers' sliding-window
    layers, so default position ids and causal masks stay in logical coordinates after eviction.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, limit: int | None = None) -> None:
        super().__init__()
        self.limit = limit
        self.capacity = 0
        self.length = 0  # live slots in this layer (equals the table's stored between forwards)
        self.seen = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.shape[0] != 1:
            raise UsageError(
                f"this EpiKV cache holds one sequence (one global keep-set); got batch size {key_states.shape[0]}; "
                "attach with batch_size=N for a batch, or run prompts one at a time"
            )
        self.device = key_states.device
        heads, k_dim, v_dim = key_states.shape[1], key_states.shape[-1], value_states.shape[-1]
        self.capacity = capped(key_states.shape[-2] + HEADROOM, self.limit)
        self.keys = key_states.new_zeros((1, heads, self.capacity, k_dim))
        self.values = value_states.new_zeros((1, heads, self.capacity, v_dim))
        self.is_initialized = True

    def _grow(self, needed: int) -> None:
        capacity = grown_capacity(needed, self.capacity, self.limit)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros((*old.shape[:2], capacity, old.shape[-1]))
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)
        self.capacity = capacity

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        *args,
        plan: WritePlan | None = None,
        head_index: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[1, kv_heads, q, head_dim]`` new states where ``plan`` says (default: after the used
        slots), or one token into each KV head's own slot (a granular keep-set's vacancies): ``head_index``
        is the ``([1, kv_heads, 1, key_dim], [1, kv_heads, 1, value_dim])`` slot of each head, repeated along
        the last dimension (a ``scatter_`` index, usually expanded); return the ``[1, kv_heads, used, head_dim]``
        views, every used slot live."""
        if head_index is not None:
            key_index, value_index = head_index
            if key_index.device != self.keys.device:  # layers placed on several devices
                key_index, value_index = key_index.to(self.keys.device), value_index.to(self.keys.device)
            self.keys.scatter_(2, key_index, key_states)
            self.values.scatter_(2, value_index, value_states)
            self.length = max(self.length, plan.start + 1)
            self.seen += 1
            return self.keys[:, :, : self.length], self.values[:, :, : self.length]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        count = key_states.shape[-2]
        if plan is not None and plan.close is not None:
            self.move_one(*plan.close, self.length - 1)
        start = self.length if plan is None else plan.start
        end = start + count
        if end > self.capacity:
            self._grow(end)
        self.keys[:, :, start:end] = key_states
        self.values[:, :, start:end] = value_states
        self.length = max(self.length, end)
        self.seen += count
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def move_one(self, hole: int, mover: int, new_length: int) -> None:
        """Copy slot ``mover`` into ``hole`` and shrink to ``new_length`` (no host-to-device index copy)."""
        self.keys[:, :, hole] = self.keys[:, :, mover]
        self.values[:, :, hole] = self.values[:, :, mover]
        self.length = new_length

    def live(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The used ``[1, kv_heads, used, head_dim]`` keys and values (slot order; all live while a forward's
        policy runs).
        """
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def get_mask_sizes(self, query_length: int, free: bool = False) -> tuple[int, int]:
        # Slot j holds, for masking purposes, logical index kv_offset + j: every stored token lies
        # before the query and new tokens come last (or, one at a time, into the free slot, where a
        # single query sees every key anyway), so causality holds. A free slot is filled (or closed)
        # by the forward, so it adds no key.
        kv_length = self.length + query_length - int(free)
        return kv_length, self.seen - (kv_length - query_length)

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0
        self.seen = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("the EpiKV cache cannot be cropped (assisted decoding is not supported)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("the EpiKV cache holds one sequence; beam search is not supported")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise NotImplementedError("the EpiKV cache holds one sequence; use num_return_sequences=1")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("the EpiKV cache holds one sequence")


class BudgetCache(Cache):
    """A transformers ``Cache`` whose full-attention layers hold at most ``budget`` entries between steps.

    Args:
        config: the model config (its text config decides which layers are sliding).
        budget: K; ``None`` for an unbounded cache.
        max_tokens: the most tokens the sequence will hold (prompt + max new tokens), if known.
        compressed_positions: report ``stored`` instead of ``seen`` as the next position.
        slack: entries a policy may keep beyond K between evictions (R-KV: 128).
        granular: the policy keeps its own set per evicting layer and KV head (:attr:`head_slots`, on the
            device); the slot table then only counts (stored, seen, free), its positions mean nothing.

    Each evicting layer allocates slots as it fills, up to ``budget + max(1, slack)`` (the step that
    appends a token attends over K + 1 entries before the keep-set brings it back to K, as in the
    paper) and never beyond ``max_tokens``. :attr:`peak_stored` is that in-step peak.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        budget: int | None,
        max_tokens: int | None = None,
        compressed_positions: bool = False,
        slack: int = 0,
        granular: bool = False,
    ) -> None:
        groups, layer_kwargs = layer_groups(config)
        limits = [n for n in (budget + max(1, slack) if budget is not None else None, max_tokens) if n is not None]
        limit = min(limits) if limits else None
        self.budget = budget
        self.compressed_positions = compressed_positions
        self.granular = granular
        self.head_slots: HeadSlots | None = (
            None  # granular policies: per (layer, KV head) positions, made at the first write
        )
        self.table = SlotTable(HEADROOM, track=not granular)
        layers = [
            BudgetLayer(limit) if group == FULL else DynamicSlidingWindowLayer(**kwargs)
            for group, kwargs in zip(groups, layer_kwargs)
        ]
        super().__init__(layers=layers)
        self.budget_layer_indices = [i for i, layer in enumerate(layers) if isinstance(layer, BudgetLayer)]
        if budget is not None and not self.budget_layer_indices:
            window = getattr(config.get_text_config(decoder=True), "sliding_window", None)
            raise UsageError(
                f"every layer of this model uses sliding-window attention (window {window}), so its cache is "
                "bounded already and --budget cannot apply; use --policy full"
            )
        self._first_budget_layer = self.budget_layer_indices[0] if self.budget_layer_indices else None
        #: set (to the reason) when the session that evicts from this cache has ended: the cache takes no more
        #: tokens, instead of growing past its budget with nothing to evict
        self.ended: str | None = None
        self.evicted_total = 0
        self.peak_stored = 0
        #: granular: the vacancies a forward closed before writing several tokens, ``(victims [layers, heads, 1],
        #: last slot)`` each, for whoever keeps slot-indexed state beside the cache (the runtime tells the policy)
        self.closed_vacancies: list[tuple[torch.Tensor, int]] = []
        self._plan: WritePlan | None = None  # where the current forward writes, decided at its first evicting layer
        #: granular, one token: per evicting layer, where each KV head writes it (see :meth:`BudgetLayer.update`)
        self._head_index: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._budget_order = {index: j for j, index in enumerate(self.budget_layer_indices)}

    def reset(self) -> None:
        """Empty the cache for a new sequence: entries, slot table and counters (the session that owns it starts
        its policy afresh before the next forward)."""
        super().reset()
        self.table = SlotTable(HEADROOM, track=not self.granular)
        self.head_slots = None
        self._head_index = None
        self.evicted_total = 0
        self.peak_stored = 0
        self.closed_vacancies = []

    # -- transformers hooks -------------------------------------------------------------------
    @torch.compiler.disable  # bookkeeping in Python (slot table, plans): outside any compiled graph
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.ended is not None and layer_idx == 0:
            raise UsageError(self.ended)
        if layer_idx == self._first_budget_layer:  # the slot table decides once where every evicting layer writes
            count = key_states.shape[-2]
            if self.granular and count != 1 and (closed := self.close_vacant_heads()) is not None:
                self.closed_vacancies.append(closed)
            self._plan = self.table.append(count)
            if self.granular:
                if self.head_slots is None:
                    self.head_slots = HeadSlots(
                        len(self.budget_layer_indices),
                        key_states.shape[1],
                        key_states.device,
                        limit=self.layers[layer_idx].limit,
                    )
                writes = self.head_slots.append(self._plan.start, count, self.table.seen - count)
                self._head_index = None if writes is None else self._scatter_index(writes, key_states, value_states)
        if isinstance(self.layers[layer_idx], BudgetLayer):
            kwargs["plan"] = self._plan
            if self._head_index is not None:
                kwargs["head_index"] = self._head_index[self._budget_order[layer_idx]]
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @staticmethod
    def _scatter_index(
        slots: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each evicting layer's ``scatter_`` indices along the slot dimension, for keys and values, from the
        ``[layers, kv_heads]`` slots (expanded views of one tensor, made once for every layer)."""
        layers, heads = slots.shape
        index = slots.reshape(layers, 1, heads, 1, 1)
        keys = index.expand(layers, 1, heads, 1, key_states.shape[-1]).unbind(0)
        if value_states.shape[-1] == key_states.shape[-1]:
            return list(zip(keys, keys))
        return list(zip(keys, index.expand(layers, 1, heads, 1, value_states.shape[-1]).unbind(0)))

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        if isinstance(layer, BudgetLayer):
            return layer.get_mask_sizes(query_length, free=self.table.free is not None)
        return super().get_mask_sizes(query_length, layer_idx)

    # -- bookkeeping ----------------------------------------------------------------------------
    @property
    def budget_layers(self) -> list[BudgetLayer]:
        return [self.layers[i] for i in self.budget_layer_indices]

    @property
    def stored(self) -> int:
        """Live entries in every evicting layer (a model without one, under policy ``full``: what its first
        layer holds, a sliding window's worth at most)."""
        if self._first_budget_layer is None:
            layer = self.layers[0]
            return layer.keys.shape[-2] if getattr(layer, "is_initialized", False) and layer.keys is not None else 0
        return self.table.stored

    @property
    def seen(self) -> int:
        """Logical length: tokens appended so far."""
        if self._first_budget_layer is None:
            return self.get_seq_length()
        return self.table.seen

    def live_positions(self) -> torch.Tensor:
        """``[stored]`` logical positions of the live slots (CPU, int64), in slot order while a forward's
        policy runs (between forwards the free slot, if any, is left out)."""
        if self._first_budget_layer is None:  # nothing evicts: the newest ``stored`` positions, in order
            return torch.arange(self.seen - self.stored, self.seen)
        return self.table.live_positions()

    def slots_of(self, positions: list[int]) -> list[int]:
        """The slots of live logical ``positions`` (O(1) each)."""
        return [self.table.slot_of[p] for p in positions]

    def position_ids(self, count: int, device: torch.device | str) -> torch.Tensor:
        """``[1, count]`` RoPE positions for the next ``count`` tokens: logical, or compressed."""
        start = self.stored if (self.compressed_positions and self._first_budget_layer is not None) else self.seen
        return torch.arange(start, start + count, device=device).unsqueeze(0)

    def evict(self, slots: list[int] | HeadVictims) -> Evicted:
        """Drop ``slots`` from every evicting layer; return their logical positions and the moves made.

        One slot leaving is left free for the next token (nothing moves); several are filled by the newest
        entries (``holes``/``movers``: whoever keeps slot-indexed state beside the cache follows them). A granular
        policy's :class:`~epikv_cli.core.keepsets.HeadVictims` are applied per (layer, KV head) instead; the
        positions returned are then those no (layer, head) holds any more.
        """
        if isinstance(slots, HeadVictims):
            return Evicted(self._evict_heads(slots))
        if not slots:
            return Evicted([])
        positions = self.table.positions[slots].tolist()
        holes, movers = self.table.plan_eviction(slots)
        if holes:
            with torch.inference_mode():  # the buffers were written under the forward's inference mode
                self._move(holes, movers)
        for layer in self.budget_layers:
            layer.length = self.table.used
        self.evicted_total += len(positions)
        return Evicted(positions, holes, movers)

    def _evict_heads(self, victims: HeadVictims) -> list[int]:
        """Each (layer, KV head) drops its own victims; its last entries close the holes (device indices only)."""
        count = len(victims)
        if not count:
            return []
        with torch.inference_mode():  # (a forward's append always fills or closes the vacancies: none is open here)
            evict_heads(self.head_slots, self.table, victims, self._initialized_kv(), 0)
        for layer in self.budget_layers:
            layer.length = self.table.used
        self.evicted_total += count
        return victims.gone

    def close_vacant_heads(self) -> tuple[torch.Tensor, int] | None:
        """Fill the slots a granular keep-set left vacant with each head's last used entry (before anything but a
        single token is appended, or before the entries are read in slot order elsewhere); return the moves,
        ``(victims [layers, heads, 1], last slot)``, for slot-indexed state kept beside the cache (None: none)."""
        if self.head_slots is None or self.head_slots.vacant is None:
            return None
        vacant = self.head_slots.vacant
        with torch.inference_mode():
            apply_head_moves(self.head_slots.close_vacant(self.table.stored), self._initialized_kv(), 0)
        return vacant[..., None], self.table.stored

    def _initialized_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.keys, layer.values) for layer in self.budget_layers if layer.is_initialized]

    def _move(self, holes: list[int], movers: list[int]) -> None:
        """Copy slot ``movers[i]`` into ``holes[i]`` in every evicting layer."""
        by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for keys, values in self._initialized_kv():
            by_device.setdefault(keys.device, []).append((keys, values))
        for device, buffers in by_device.items():
            move_entries(buffers, [0] * len(holes), holes, movers, device)

    def commit(self) -> range:
        """Close a forward: return the logical positions it appended."""
        appended = range(self.table.committed, self.seen)
        self.table.committed = self.seen
        if self.table.prompt_len is None and len(appended):
            self.table.prompt_len = len(appended)
        return appended

    @property
    def prompt_len(self) -> int:
        return self.table.prompt_len or 0

    def kv_bytes(self) -> int:
        """Bytes held by all key/value buffers now (evicting layers' allocated slots plus sliding windows)."""
        return sum(
            entry_bytes(layer.keys, layer.values) * layer.keys.shape[2]
            for layer in self.layers
            if getattr(layer, "is_initialized", False) and layer.keys is not None
        )

    # -- what a policy reads (epikv_cli.core.view.CacheView) ----------------------------------------
    @property
    def evicting_layers(self) -> list[int]:
        """The decoder blocks whose cache is bounded, in order."""
        return self.budget_layer_indices

    def layer_kv(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[1, kv_heads, used, head_dim]`` of the ``index``-th evicting layer (views)."""
        return self.layers[self.budget_layer_indices[index]].live()


@dataclass
class Evicted:
    """What one eviction did: the logical ``positions`` that left, and the slot moves that closed their holes
    (``movers[i]`` into ``holes[i]``; none when one entry left a free slot, or per-head keep-sets)."""

    positions: list[int]
    holes: list[int] = field(default_factory=list)
    movers: list[int] = field(default_factory=list)


def move_entries(
    buffers: list[tuple[torch.Tensor, torch.Tensor]],
    rows: list[int],
    holes: list[int],
    movers: list[int],
    device: torch.device,
) -> None:
    """Copy slot ``movers[i]`` into slot ``holes[i]`` of batch row ``rows[i]`` in every ``(keys, values)`` pair of
    ``[batch, kv_heads, slots, dim]`` buffers on ``device`` (one indexed copy per buffer)."""
    r = torch.tensor(rows, dtype=torch.long, device=device)
    h = torch.tensor(holes, dtype=torch.long, device=device)
    m = torch.tensor(movers, dtype=torch.long, device=device)
    for keys, values in buffers:
        keys[r, :, h] = keys[r, :, m]
        values[r, :, h] = values[r, :, m]


def evict_heads(
    heads: HeadSlots, table: SlotTable, victims: HeadVictims, buffers: list[tuple[torch.Tensor, torch.Tensor]], row: int
) -> None:
    """A keep-set per (layer, KV head) drops its own victims from batch row ``row`` of ``buffers`` (each evicting
    layer's keys and values). One victim per (layer, head), the steady state, leaves its slot vacant for the next
    token (nothing moves); several (a prompt over the budget) are closed by gathering each head's kept entries to
    the front. ``table`` keeps the shared counts (one victim leaves the last slot free)."""
    stored, count = table.stored, len(victims)
    if count == 1:
        heads.vacate(victims.slots[..., 0])
    else:
        apply_head_moves(heads.plan(victims.slots, stored), buffers, row)
    table.plan_eviction(list(range(stored - count, stored)))


def apply_head_moves(moves, buffers: list[tuple[torch.Tensor, torch.Tensor]], row: int) -> None:
    """Apply a granular keep-set's :class:`~epikv_cli.core.keepsets.HeadMoves` to batch row ``row`` of each evicting
    layer's ``(keys, values)`` buffers (``buffers[j]`` is the ``j``-th evicting layer's)."""
    for index, (keys, values) in enumerate(buffers):
        moves.apply(keys[row], index)
        moves.apply(values[row], index)
