"""Many sequences decoded side by side, each with its own slots, positions, budget and keep-set.

A :class:`RowsCache` holds B rows. Every layer keeps ``[B, kv_heads, capacity, head_dim]`` buffers in
which each row's live entries are compact (slots ``0 .. stored_b - 1``, shorter rows padded); an
attention mask hides the padding. Between steps a row may hold one free slot among them, left by the
single entry it evicted (per KV head, for a granular keep-set), which its next token fills: in the
steady state no entry moves. Rows join already prefilled (a single-sequence session hands over
its cache, policy state and queries) and leave when their sequence ends, so the batch can be kept
full from a queue; or a whole left-padded batch is prefilled at once (``model.generate`` with a
batch), after which each row's entries are moved to the front of its slots and the padding dropped.
Sliding-window layers (Gemma 3's local layers) are rows too: the oldest entry leaves once a row holds
``window - 1``.

Each step every row takes one token; the policies see each row through a :class:`RowView`, which
looks to them exactly like a single-sequence :class:`~epikv_cli.cache.BudgetCache`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin

from epikv_cli.core.cache import (
    FULL,
    SLIDING,
    BudgetCache,
    BudgetLayer,
    SlotTable,
    entry_bytes,
    evict_heads,
    layer_groups,
    move_entries,
    sliding_window,
)
from epikv_cli.core.keepsets import HeadSlots, HeadVictims, grown_capacity
from epikv_cli.errors import UsageError

#: Slots allocated beyond a batched prefill's length (then doubling as rows grow).
PREFILL_HEADROOM = 64


@dataclass
class Row:
    """One sequence of the batch: its slot tables per layer group and its counters (its policy is the runtime's).

    Attributes:
        budget: K (None: unbounded); compressed: RoPE positions are the stored count (the paper-time harness).
        limit: the most slots its full layers use, K + max(1, slack) or the sequence's length if less (None: unbounded).
    """

    budget: int | None
    compressed: bool
    tables: dict[str, SlotTable]
    queries_needed: int = 0
    evicted_total: int = 0
    peak_stored: int = 0
    last_evicted: list[int] = field(default_factory=list)
    heads: HeadSlots | None = None  # a granular policy's per (layer, KV head) positions
    limit: int | None = None

    @property
    def full(self) -> SlotTable:
        return self.tables[FULL]


class RowsLayer(CacheLayerMixin):
    """One decoder layer for every row: writes each row's new entry at its own next slot."""

    is_compileable = False
    is_sliding = False

    def __init__(self, group: str, owner: RowsCache) -> None:
        super().__init__()
        self.group = group
        self.owner = owner
        self.is_sliding = group == SLIDING
        self.keys = self.values = None
        self.head_order: int | None = None  # a full layer's index among the full layers (its row of HeadSlots)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:  # pragma: no cover
        raise RuntimeError("rows join a RowsCache through RowsCache.adopt")

    @torch.compiler.disable  # the rows' slots are Python bookkeeping: outside any compiled graph
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write ``[B, kv_heads, 1, head_dim]`` at each row's next slot; return ``[B, kv_heads, L, head_dim]``.

        During a batched prefill (:meth:`RowsCache.begin_prefill`) the whole padded ``[B, kv_heads, n,
        head_dim]`` prompt is written to slots ``0 .. n - 1`` instead, as a plain cache would.
        """
        if self.owner.ended is not None:
            raise UsageError(self.owner.ended)
        if self.owner.prefilling:
            count = key_states.shape[-2]
            shape = (*key_states.shape[:2], count + PREFILL_HEADROOM, key_states.shape[-1])
            self.keys, self.values = key_states.new_zeros(shape), value_states.new_zeros(shape)
            self.keys[:, :, :count], self.values[:, :, :count] = key_states, value_states
            self.is_initialized = True
            self.owner.prefill_length = count
            return self.keys[:, :, :count], self.values[:, :, :count]
        if key_states.shape[-2] != 1:
            raise UsageError("batched decoding feeds one token per row and step; prompts join through adopt()")
        length = self.owner.step_lengths[self.group]
        flat = self.owner.write_rows(self)
        dim = key_states.shape[-1]
        # one indexed write per buffer: row b's KV head h goes to row (b * kv_heads + h) * capacity + slot
        self.keys.view(-1, dim).index_put_((flat,), key_states[:, :, 0].reshape(-1, dim))
        self.values.view(-1, self.values.shape[-1]).index_put_(
            (flat,), value_states[:, :, 0].reshape(-1, value_states.shape[-1])
        )
        return self.keys[:, :, :length], self.values[:, :, :length]

    def get_seq_length(self) -> int:
        return max((row.full.seen for row in self.owner.rows), default=0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:  # masks are always given explicitly
        return self.owner.step_lengths.get(self.group, query_length), 0

    def get_max_length(self) -> int:
        return -1


class RowsCache(Cache):
    """The batch's cache. Build it empty, then :meth:`adopt` prefilled sequences."""

    def __init__(self, config: PretrainedConfig) -> None:
        groups, layer_kwargs = layer_groups(config)
        self.groups = groups
        self.window = sliding_window(layer_kwargs)
        super().__init__(layers=[RowsLayer(group, self) for group in groups])
        self.full_layer_indices = [i for i, group in enumerate(groups) if group == FULL]
        for order, index in enumerate(self.full_layer_indices):
            self.layers[index].head_order = order
        self.rows: list[Row] = []
        #: per group, ``[B * kv_heads]``: where each row's KV heads write this step's token, as rows of the
        #: group's ``[B * kv_heads * capacity, head_dim]`` flattened buffers (every layer of a group has the
        #: same capacity), and that capacity
        self.step_rows: dict[str, torch.Tensor] = {}
        self.step_capacity: dict[str, int] = {}
        #: ``[full layers, B * kv_heads]``: the same for each full layer, when some granular row's KV heads each
        #: write into their own vacant slot (None: every full layer writes at ``step_rows[FULL]``)
        self.step_head_rows: torch.Tensor | None = None
        self.step_lengths: dict[str, int] = {}
        self.prefilling = False
        self.prefill_length = 0  # the padded prompt length of the batched prefill
        #: set (to the reason) when the session that evicts from this cache has ended: it takes no more tokens
        self.ended: str | None = None

    # -- rows joining and leaving ---------------------------------------------------------------
    @property
    def batch(self) -> int:
        return len(self.rows)

    def _grown(self, group: str, needed: int, capacity: int) -> int:
        """The capacity a group's buffers grow to for ``needed`` slots: double, but never past the most slots a row
        can use (a full layer: K + 1, which at K = 8192 would otherwise double to 16384; a sliding layer: its window,
        the window - 1 entries it keeps and the new one), unless ``needed`` is more."""
        limits = [row.limit for row in self.rows]
        limit = None
        if group == FULL and limits and None not in limits:
            limit = max(limits)
        elif group == SLIDING and self.window:
            limit = self.window
        return grown_capacity(needed, capacity, limit)

    def _ensure(self, layer: RowsLayer, template: torch.Tensor, length: int) -> None:
        """Room for one more row holding ``length`` entries (capacity doubles when short: :meth:`_grown`)."""
        heads, dim = template.shape[1], template.shape[-1]
        if layer.keys is None:
            shape = (0, heads, max(length, 16), dim)
            layer.keys, layer.values = template.new_zeros(shape), template.new_zeros(shape)
        capacity = layer.keys.shape[2]
        if length > capacity:
            grown = self._grown(layer.group, length, capacity)
            layer.keys = torch.nn.functional.pad(layer.keys, (0, 0, 0, grown - capacity))
            layer.values = torch.nn.functional.pad(layer.values, (0, 0, 0, grown - capacity))
        pad = torch.zeros((1, heads, layer.keys.shape[2], dim), dtype=layer.keys.dtype, device=layer.keys.device)
        layer.keys = torch.cat([layer.keys, pad])
        layer.values = torch.cat([layer.values, pad.clone()])
        layer.is_initialized = True

    def adopt(self, source: BudgetCache, compressed: bool = False, queries_needed: int = 0) -> int:
        """Add a row from a prefilled single-sequence cache (its entries, positions and counters); return its index.
        Its vacant slots (a granular keep-set's) must be closed first (:meth:`BudgetCache.close_vacant_heads`)."""
        if source.head_slots is not None and source.head_slots.vacant is not None:
            raise RuntimeError("close the source's vacant slots before a row adopts it: rows move entries at once")
        tables: dict[str, SlotTable] = {}
        for index, (group, layer) in enumerate(zip(self.groups, self.layers)):
            origin = source.layers[index]
            if isinstance(origin, BudgetLayer):
                keys, values = origin.live()
            else:  # transformers' sliding-window layer: the last window - 1 entries
                keys, values = origin.keys, origin.values
            self._ensure(layer, keys, keys.shape[2] + 1)
            layer.keys[-1, :, : keys.shape[2]] = keys[0]
            layer.values[-1, :, : values.shape[2]] = values[0]
            if group not in tables:
                tables[group] = _table_for(source, group, keys.shape[2])
        budget = source.budget
        row = Row(
            budget,
            compressed,
            tables,
            queries_needed,
            source.evicted_total,
            source.peak_stored,
            heads=source.head_slots,
            limit=next((layer.limit for layer in source.layers if isinstance(layer, BudgetLayer)), None),
        )
        self.rows.append(row)
        return len(self.rows) - 1

    def begin_prefill(self) -> None:
        """The next forward is a whole left-padded batch of prompts, written as it comes (an empty cache only)."""
        if self.rows:
            raise UsageError(
                "a batch of prompts can only be prefilled into an empty cache; start a new one for the next batch"
            )
        self.prefilling = True
        self.step_lengths.clear()

    def finish_prefill(
        self, pads: list[int], rows: list[tuple[int | None, bool, bool, int]], queries_needed: list[int]
    ) -> None:
        """Turn the prefilled batch into rows: row ``b``'s real tokens (after its ``pads[b]`` padding) move to
        the front of its slots (a sliding layer keeps the last ``window - 1``), each with its own table.
        ``rows[b]``: its budget (None: unbounded), whether its positions are compressed, whether its keep-set
        is per (layer, KV head), and its policy's slack (entries it may hold beyond K between evictions)."""
        self.prefilling = False
        length = self.prefill_length
        keep = {FULL: [length - pad for pad in pads]}
        if SLIDING in self.groups:
            keep[SLIDING] = [min(length - pad, self.window - 1) for pad in pads]
        for layer in self.layers:
            for row, count in enumerate(keep[layer.group]):
                if count < length:  # shift the row's last `count` entries to slots 0 .. count - 1
                    layer.keys[row, :, :count] = layer.keys[row, :, length - count : length].clone()
                    layer.values[row, :, :count] = layer.values[row, :, length - count : length].clone()
        full = self.layers[self.full_layer_indices[0]].keys if self.full_layer_indices else None
        for row, (budget, compressed, granular, slack) in enumerate(rows):
            prompt = length - pads[row]
            tables = {group: tail_table(prompt, counts[row], prompt) for group, counts in keep.items()}
            limit = None if budget is None else budget + max(1, slack)
            heads = None
            if granular:
                heads = HeadSlots(len(self.full_layer_indices), full.shape[1], full.device, limit=limit)
                heads.append(0, prompt, 0)
            self.rows.append(Row(budget, compressed, tables, queries_needed[row], heads=heads, limit=limit))

    def row(self, index: int) -> RowView:
        """Row ``index`` seen as a single-sequence cache (``stored``, ``seen``, ``evicted_total``, ...)."""
        if not 0 <= index < len(self.rows):
            raise UsageError(
                f"this batch cache holds {len(self.rows)} rows, so it has no row {index}"
                + ("" if self.rows else ": generate with it first")
            )
        return RowView(self, index)

    def reset(self) -> None:
        """Empty the cache for a new batch: every row, its slots, and the step's write plan."""
        self.rows = []
        for layer in self.layers:
            layer.keys = layer.values = None
        self.step_rows, self.step_capacity, self.step_lengths = {}, {}, {}
        self.step_head_rows = None
        self.prefilling = False
        self.prefill_length = 0

    def keep_rows(self, keep: list[int]) -> None:
        """Drop every row not in ``keep`` (finished sequences), in that order."""
        index = torch.tensor(keep, dtype=torch.long)
        for layer in self.layers:
            if layer.keys is not None:
                where = index.to(layer.keys.device)
                layer.keys, layer.values = layer.keys[where], layer.values[where]
        self.rows = [self.rows[i] for i in keep]

    # -- one decoding step ------------------------------------------------------------------------
    def begin_step(self, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Reserve each row's next slot (its free slot, else the one after its used slots); return
        ``position_ids [B, 1]`` and a ``[B, 1, 1, L]`` additive mask per group."""
        masks = {}
        for group in set(self.groups):
            tables = [row.tables[group] for row in self.rows]
            slots = torch.tensor([table.used if table.free is None else table.free for table in tables])
            used_after = torch.tensor([table.stored + 1 for table in tables])  # every used slot live after the write
            length = int(used_after.max())
            for layer in self.layers:
                if layer.group == group and length > layer.keys.shape[2]:
                    grown = self._grown(group, length, layer.keys.shape[2])
                    extra = grown - layer.keys.shape[2]
                    layer.keys = torch.nn.functional.pad(layer.keys, (0, 0, 0, extra))
                    layer.values = torch.nn.functional.pad(layer.values, (0, 0, 0, extra))
            self.step_lengths[group] = length
            self._plan_writes(group, to_device(slots, device))
            visible = torch.arange(length)[None, :] < used_after[:, None]
            mask = torch.zeros((len(self.rows), 1, 1, length), dtype=dtype)
            masks[group] = to_device(mask.masked_fill(~visible[:, None, None, :], torch.finfo(dtype).min), device)
        positions = [row.full.stored if row.compressed else row.full.seen for row in self.rows]
        return to_device(torch.tensor(positions).unsqueeze(1), device), masks

    def _plan_writes(self, group: str, slots: torch.Tensor) -> None:
        """Where each row writes this step's token in every layer of ``group``: row ``b``'s slot ``slots[b]``
        ``[B]`` for every KV head, except that a granular row's heads with vacant slots (left by last step's
        victims) write there, each its own."""
        template = next(layer.keys for layer in self.layers if layer.group == group)
        batch, heads, capacity = template.shape[:3]
        first_rows = torch.arange(batch * heads, device=template.device).view(batch, heads) * capacity
        grid = slots.to(template.device)[:, None].expand(batch, heads)
        self.step_rows[group] = (grid + first_rows).view(-1)
        self.step_capacity[group] = capacity
        if group != FULL:
            return
        self.step_head_rows = None
        vacant = [
            (index, row.heads.vacant)
            for index, row in enumerate(self.rows)
            if row.heads is not None and row.heads.vacant is not None
        ]
        if vacant:
            per_head = grid[None].expand(len(self.full_layer_indices), batch, heads).clone()
            for index, vacancies in vacant:
                per_head[:, index] = vacancies
            self.step_head_rows = (per_head + first_rows).view(len(self.full_layer_indices), batch * heads)

    def write_rows(self, layer: RowsLayer) -> torch.Tensor:
        """``[B * kv_heads]``: the flattened-buffer rows ``layer`` writes this step's tokens to."""
        if layer.keys.shape[2] != self.step_capacity[layer.group]:
            raise RuntimeError(f"the {layer.group} layers of a RowsCache must share one capacity")
        if layer.head_order is not None and self.step_head_rows is not None:
            return self.step_head_rows[layer.head_order].to(layer.keys.device)
        return self.step_rows[layer.group].to(layer.keys.device)

    def end_step(self) -> None:
        """Record the entries the step appended (one per row and group, where :meth:`begin_step` put them)."""
        for row in self.rows:
            if row.heads is not None:
                table = row.full
                row.heads.append(table.used if table.free is None else table.free, 1, table.seen)
            for table in row.tables.values():
                table.append(1)
            row.full.committed = row.full.seen

    def evict(
        self, plans: dict[str, list[tuple[int, list[int] | HeadVictims]]]
    ) -> dict[int, tuple[list[int], list[int]]]:
        """Drop, per group, ``(row, slots)`` pairs: a single slot is left free for the row's next token, several are
        filled by the row's newest entries. Return, per row whose full layers moved entries, ``(holes, movers)``
        (``movers[i]`` went into ``holes[i]``), for whoever keeps slot-indexed state beside the cache."""
        moved: dict[int, tuple[list[int], list[int]]] = {}
        with torch.inference_mode():  # the buffers were written under the forward's inference mode
            for group, pairs in plans.items():
                rows, holes, movers = [], [], []
                for row_index, slots in pairs:
                    if isinstance(slots, HeadVictims):
                        self._evict_heads(row_index, slots)
                        continue
                    hole, mover = self.rows[row_index].tables[group].plan_eviction(slots)
                    if hole and group == FULL:
                        moved[row_index] = (hole, mover)
                    rows += [row_index] * len(hole)
                    holes += hole
                    movers += mover
                if holes:
                    self._move(group, rows, holes, movers)
        return moved

    def _evict_heads(self, index: int, victims: HeadVictims) -> None:
        """A granular row drops its own victims in every (layer, KV head). One victim per (layer, head), the steady
        state, leaves its slot vacant for the row's next token (nothing moves, as in a single sequence's cache);
        several (a prompt over the budget) are closed by gathering each head's kept entries to the front."""
        row = self.rows[index]
        buffers = [(self.layers[i].keys, self.layers[i].values) for i in self.full_layer_indices]
        evict_heads(row.heads, row.full, victims, buffers, index)

    def _move(self, group: str, rows: list[int], holes: list[int], movers: list[int]) -> None:
        """Copy slot ``movers[i]`` into ``holes[i]`` of row ``rows[i]`` in every layer of ``group``."""
        for layer in self.layers:
            if layer.group == group:
                move_entries([(layer.keys, layer.values)], rows, holes, movers, layer.keys.device)

    def nbytes(self) -> int:
        """Bytes the key and value buffers hold: every row's slots, padding and room to grow included."""
        return sum(
            entry_bytes(layer.keys, layer.values) * layer.keys.shape[0] * layer.keys.shape[2]
            for layer in self.layers
            if layer.keys is not None
        )

    def kv_bytes(self, row: int) -> int:
        """Bytes one row's entries occupy (its share of the padded buffers is not counted)."""
        return sum(
            entry_bytes(layer.keys, layer.values) * self.rows[row].tables[group].stored
            for group, layer in zip(self.groups, self.layers)
        )


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (built on the host) on ``device``; to a GPU from pinned memory, asynchronously, so that
    the step's small host-to-device copies never wait for the work queued before them."""
    device = torch.device(device)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def _table_for(source: BudgetCache, group: str, count: int) -> SlotTable:
    """The slot table of a joining row: a copy of the budget table (``count`` used slots, the free one
    included), or the last ``count`` positions (sliding)."""
    if group == FULL and source.budget_layer_indices:
        table = SlotTable(max(count, 1))
        origin = source.table
        table.positions[:count] = origin.positions[:count]
        table.stored, table.free = origin.stored, origin.free
        table.seen, table.committed, table.prompt_len = origin.seen, origin.committed, origin.prompt_len
        table.slot_of = dict(origin.slot_of)
        return table
    return tail_table(source.seen, count, source.prompt_len)


def tail_table(seen: int, count: int, prompt_len: int) -> SlotTable:
    """A slot table holding the last ``count`` of ``seen`` tokens in slots ``0 .. count - 1``, in order."""
    table = SlotTable(max(count, 1))
    table.positions[:count] = torch.arange(seen - count, seen)
    table.stored, table.seen, table.committed, table.prompt_len = count, seen, seen, prompt_len
    table.slot_of = {seen - count + i: i for i in range(count)}
    return table


class RowView:
    """One row of a :class:`RowsCache` as a policy sees it (a :class:`~epikv_cli.core.view.CacheView`, as a
    :class:`BudgetCache` is), with the row's counters."""

    def __init__(self, cache: RowsCache, index: int) -> None:
        self.cache = cache
        self.index = index
        self.row = cache.rows[index]

    def live_positions(self) -> torch.Tensor:
        return self.row.full.live_positions()

    def slots_of(self, positions: list[int]) -> list[int]:
        return [self.row.full.slot_of[p] for p in positions]

    @property
    def stored(self) -> int:
        return self.row.full.stored

    @property
    def seen(self) -> int:
        return self.row.full.seen

    @property
    def prompt_len(self) -> int:
        return self.row.full.prompt_len or 0

    @property
    def budget(self) -> int | None:
        return self.row.budget

    @property
    def evicted_total(self) -> int:
        return self.row.evicted_total

    @property
    def peak_stored(self) -> int:
        return self.row.peak_stored

    @property
    def evicting_layers(self) -> list[int]:
        return self.cache.full_layer_indices

    @property
    def head_slots(self) -> HeadSlots | None:
        return self.row.heads

    def layer_kv(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[1, kv_heads, used, head_dim]`` of the ``index``-th evicting layer, this row's (views)."""
        layer, i, n = self.cache.layers[self.cache.full_layer_indices[index]], self.index, self.row.full.used
        return layer.keys[i : i + 1, :, :n], layer.values[i : i + 1, :, :n]
