"""Each request's bounded cache inside vLLM: one ring of C = K + B slots per layer, its slot tables and its policy.

vLLM gives every request one page per layer for its whole life (:mod:`epikv_cli.vllm.backend`'s ring spec): the
page of request block ``b`` in layer ``l`` is ``buffers[l][b]``, ``[kv_heads, 2, C, head_dim]`` (each KV head's C
keys, then its C values: :meth:`RingCache.bind`). This module owns what lives in those pages. It is plain torch
(nothing of vLLM), and it runs the same decode step as the transformers engine: the slot tables and the eviction of
:mod:`epikv_cli.core.cache` (:class:`SlotTable`, :func:`evict_heads`, :func:`move_entries`), and the policy half
of :mod:`epikv_cli.runtime.step`. A policy sees a request through a :class:`RingView`, a
:class:`~epikv_cli.core.view.CacheView` like any other.

One forward of vLLM holds tokens of several requests, each a row: ``(block, computed, first, last)``, its tokens
``first .. last - 1`` of the forward at logical positions ``computed ..``. A row with ``computed == 0`` is a new
request's whole prompt (chunked prefill is off); every other row is one decode token.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from epikv_cli.config import CacheSettings
from epikv_cli.core.attention import AttentionRecord
from epikv_cli.core.cache import SlotTable, evict_heads, move_entries
from epikv_cli.core.hostread import host_copies
from epikv_cli.core.keepsets import HeadSlots
from epikv_cli.core.view import Moves
from epikv_cli.errors import UsageError
from epikv_cli.policies.base import Policy, Signals
from epikv_cli.policies.registry import make_policy
from epikv_cli.runtime.step import choose, follow, observe

#: The policies this engine runs; any other is refused with the engines that support it.
VLLM_POLICIES = ("streaming", "epikv", "epikv2")


def prompt_key(ids: list[int]) -> str:
    """A request's prompt token ids as a short key (its SHA-256)."""
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()


#: The multiplier of a request's token fingerprint (:func:`token_fingerprint`).
FINGERPRINT_BASE = 1_000_003


def token_fingerprint(tokens: list[int]) -> int:
    """``tokens`` folded as the ring folds each request's decode inputs on its device: ``f = f * B + token`` in
    wrapping int64 arithmetic, from 0."""
    value = 0
    for token in tokens:
        value = (value * FINGERPRINT_BASE + token) & 0xFFFF_FFFF_FFFF_FFFF
    return value - (1 << 64) if value >= 1 << 63 else value


def ring_capacity(settings: CacheSettings, slack: int = 0) -> int:
    """C: the slots a request's ring holds, K + max(1, slack) (a step attends over K + 1 entries before its
    policy brings the cache back to K)."""
    if settings.budget is None:
        raise UsageError("--engine vllm needs a --budget (the ring each request holds is K + 1 slots)")
    return settings.budget + max(1, slack)


def query_width(policy: Policy) -> int:
    """How many of a request's newest query vectors ``policy`` reads (per layer; 0: none)."""
    return policy.attention_needs.queries if policy.attention_needs is not None else 0


def query_slots(width: int, heads: int, kv_heads: int) -> int:
    """The page slots that hold ``width`` queries of ``heads`` heads (a slot holds ``2 * kv_heads`` vectors, a key
    and a value per KV head)."""
    return -(-heads * width // (2 * kv_heads))


def page_slots(settings: CacheSettings, heads: int, kv_heads: int) -> int:
    """The slots of a request's page in each layer: the ring's C, and those that hold the newest queries its policy
    reads (:func:`query_slots`), so that vLLM's allocator counts them as the request's memory too."""
    return ring_capacity(settings) + query_slots(query_width(make_policy(settings)), heads, kv_heads)


def check_policy(settings: CacheSettings) -> None:
    """:class:`UsageError` for a policy this engine does not run, naming the engines that run it."""
    if settings.policy != "full" and settings.policy not in VLLM_POLICIES:
        raise UsageError(
            f"policy {settings.policy!r} runs on --engine transformers only; --engine vllm runs "
            f"{', '.join(VLLM_POLICIES)} and full"
        )


def check_prompt(policy: Policy, settings: CacheSettings, length: int) -> None:
    """:class:`UsageError` when a ``length``-token prompt cannot start under ``policy``: below its budget floor, or
    longer than the ring (the whole prompt is one forward into it)."""
    policy.check_budget(length, settings.budget)
    if length > ring_capacity(settings):
        raise UsageError(
            f"the {length}-token prompt does not fit --budget {settings.budget} on --engine vllm, which holds the "
            "whole prompt: raise --budget or shorten the prompt"
        )


@dataclass(frozen=True)
class Row:
    """One request's share of a forward: its ring block, the tokens it had computed before, and its tokens
    ``first .. last - 1`` in the forward's flattened batch."""

    block: int
    computed: int
    first: int
    last: int

    @property
    def count(self) -> int:
        return self.last - self.first


@dataclass
class RingRequest:
    """One request's ring: its slot table (shared keep-sets) or per-head slots (granular ones), and its policy.

    Attributes:
        queries_taken: how many of its query vectors the ring has taken in (:class:`RecentQueries` keeps the newest).
    """

    block: int
    policy: Policy
    table: SlotTable
    heads: HeadSlots | None = None
    queries_taken: int = 0
    evicted_total: int = 0
    peak_stored: int = 0
    trace: list[list[int]] | None = None
    write: torch.Tensor | None = None  # [layers, heads] this step's per-head slots (a granular vacancy), or None
    prompt: str | None = None  # its prompt's key (:func:`prompt_key`), with ``report``


class RecentQueries:
    """Every request's newest ``width`` query vectors (after RoPE) in each layer, for policies that read them: in
    each layer's pages, behind the ring's keys and values, ``[blocks, heads, width, head_dim]`` (request block ``b``'s
    in row ``b``, its ``n``-th query in column ``n % width``). One write per layer and forward takes in every row's
    queries (a copy: in a compiled forward the query buffer is reused); a policy joins them, oldest first, only
    when it reads them (a refresh)."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.buffers: dict[int, torch.Tensor] = {}

    def columns(self, taken: int, count: int) -> torch.Tensor:
        """``[min(count, width)]``: where the last of ``count`` new queries go after ``taken`` (the older ones of a
        long prompt are never read)."""
        kept = min(count, self.width)
        return torch.arange(taken + count - kept, taken + count) % self.width

    def bind(self, layer: int, buffer: torch.Tensor) -> None:
        """Layer ``layer``'s queries live in ``buffer`` ``[blocks, heads, width, head_dim]``."""
        self.buffers[layer] = buffer

    def write(self, layer: int, blocks: torch.Tensor, columns: torch.Tensor, queries: torch.Tensor) -> None:
        """Keep ``queries`` ``[m, heads, head_dim]`` in layer ``layer``, the ``i``-th in row ``blocks[i]``, column
        ``columns[i]``."""
        self.buffers[layer][blocks, :, columns] = queries

    def of(self, block: int, taken: int) -> Mapping[int, torch.Tensor]:
        """Request block ``block``'s queries, ``taken`` in all so far: layer -> ``[heads, w, head_dim]``, oldest
        first (``w = min(taken, width)``)."""
        return _BlockQueries(self, block, taken)


class _BlockQueries(Mapping):
    """One request's view of :class:`RecentQueries` (layer -> its newest queries, oldest first)."""

    def __init__(self, queries: RecentQueries, block: int, taken: int) -> None:
        self.queries = queries
        self.block = block
        self.taken = taken

    def __getitem__(self, layer: int) -> torch.Tensor:
        rows = self.queries.buffers[layer][self.block]
        width = self.queries.width
        if self.taken < width:  # not a lap yet: columns 0 .. taken - 1, in order
            return rows[:, : self.taken]
        start = self.taken % width  # the oldest
        return torch.cat([rows[:, start:], rows[:, :start]], dim=1) if start else rows

    def __iter__(self):
        return iter(self.queries.buffers)

    def __len__(self) -> int:
        return len(self.queries.buffers)


class RingView:
    """One request's ring as its policy sees it (a :class:`~epikv_cli.core.view.CacheView`)."""

    def __init__(self, cache: RingCache, request: RingRequest) -> None:
        self.cache = cache
        self.request = request
        self.budget = cache.settings.budget if request.policy.evicts else None
        self.head_slots = request.heads

    @property
    def prompt_len(self) -> int:
        return self.request.table.prompt_len or 0

    @property
    def seen(self) -> int:
        return self.request.table.seen

    @property
    def stored(self) -> int:
        return self.request.table.stored

    @property
    def evicting_layers(self) -> list[int]:
        return list(range(self.cache.num_layers))

    def live_positions(self) -> torch.Tensor:
        return self.request.table.live_positions()

    def slots_of(self, positions: list[int]) -> list[int]:
        return [self.request.table.slot_of[p] for p in positions]

    def layer_kv(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        b, used = self.request.block, self.request.table.used
        keys, values = self.cache.kv(index)
        return keys[b : b + 1, :, :used], values[b : b + 1, :, :used]


@dataclass
class DecodeGroup:
    """Decode rows that attend in one call: they use ``used`` slots each, in blocks ``first .. first + span - 1``
    (a view of the pages, no gather; a block of the range that is not one of them is computed and dropped).

    Attributes:
        rows: ``(token in the forward, block)`` per row.
        tokens, offsets: ``[n]`` each row's token, and its block's place in the range.
        ordered: the rows are the range's blocks in order, at consecutive tokens (no scatter).
    """

    rows: list[tuple[int, int]]
    first: int
    span: int
    used: int
    tokens: torch.Tensor
    offsets: torch.Tensor
    ordered: bool


@dataclass
class DecodeRows:
    """A forward's decode rows (one token each, over its request's ``used`` live slots) and how they attend.

    Rows that use as many slots (rings that are full, or that started together) and lie in nearby blocks (vLLM hands
    out free blocks from the bottom) attend in one call per such group (:class:`DecodeGroup`); any other row
    attends alone (:attr:`alone`: ``(token, block, used)``). Both give the same numbers: one masked call over rows
    of different lengths would not (its kernel sums in another order, and a greedy near-tie can turn).
    """

    groups: list[DecodeGroup]
    alone: list[tuple[int, int, int]]

    @classmethod
    def plan(cls, rows: list[tuple[int, int, int]], device) -> DecodeRows:
        """The plan for ``rows`` ``(token, block, used)``: a group for each number of slots used by two or more
        rows whose blocks span at most twice as many blocks as there are rows; the other rows alone."""
        by_used: dict[int, list[tuple[int, int]]] = {}
        for token, block, used in rows:
            by_used.setdefault(used, []).append((token, block))
        groups, alone = [], []
        for used, members in by_used.items():
            blocks = [block for _, block in members]
            first, span = min(blocks), max(blocks) - min(blocks) + 1
            if len(members) < 2 or span > 2 * len(members):
                alone += [(token, block, used) for token, block in members]
                continue
            offsets = [block - first for block in blocks]
            tokens = [token for token, _ in members]
            ordered = offsets == list(range(span)) and tokens == list(range(tokens[0], tokens[0] + span))
            index = torch.tensor([tokens, offsets], device=device)
            groups.append(DecodeGroup(members, first, span, used, index[0], index[1], ordered))
        return cls(groups, alone)


class RingCache:
    """Every request's ring in one worker, by block id, with the step that writes, attends and evicts.

    Args:
        settings: the policy and its budget, the same for every request of the engine.
        num_layers: decoder blocks (every one full attention, so every one evicts).
        capacity: C, each ring's slots.
        scaling: the softmax scale of ``q . k``.
        heads: ``(query heads, KV heads)`` of a layer on this rank (where the queries a policy reads are kept:
            :func:`page_slots`).
        calibration: the model's saved calibration (EpiKV's bands), if any.
        trace: keep every request, in the order they were admitted (:attr:`admitted`), with the logical positions
            each of its steps evicted (``trace``; for tests that compare engines step by step).
        report: note each request's prompt and fold its decode inputs into a fingerprint, so that :meth:`request_for`
            finds a finished request by its tokens (the CLI reads each result's evictions and policy report so; a
            server, which never asks, leaves it off).
        reduce: under tensor parallelism, the mean over ranks of a tensor (each rank holds some KV heads): what a
            shared keep-set computed from its rank's heads (``epikv2 keep=global``'s attention) becomes the same
            on every rank. Per-head keep-sets, and policies that read positions or whole hidden states, need none.
    """

    def __init__(
        self,
        settings: CacheSettings,
        num_layers: int,
        capacity: int,
        scaling: float,
        heads: tuple[int, int] = (1, 1),
        calibration=None,
        trace: bool = False,
        report: bool = False,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.settings = settings
        self.num_layers = num_layers
        self.capacity = capacity
        self.scaling = scaling
        self.calibration = calibration
        self.buffers: list[torch.Tensor | None] = [None] * num_layers
        self._kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers  # views of each layer's pages
        self.requests: dict[int, RingRequest] = {}
        self.admitted: list[RingRequest] | None = [] if trace else None
        self.report = report
        #: with ``report``, ``[blocks]`` int64: the fingerprint of the decode inputs of the request in each block
        self._prints: torch.Tensor | None = None
        self.reduce = reduce
        self._scalings = dict.fromkeys(range(num_layers), scaling)  # every layer's softmax scale, as policies read it
        probe = make_policy(settings)  # what every request's policy will ask of the forward
        probe.setup(num_layers, calibration)
        self.tap_layers = probe.tap_layers()
        width = query_width(probe)
        self.queries = RecentQueries(width) if width else None  # the queries policies read, if they read any
        self.heads = heads
        self.page_slots = capacity + query_slots(width, *heads)
        self._page_bytes = [0] * num_layers
        if probe.attention_needs is not None and (probe.attention_needs.received or probe.attention_needs.last_row):
            raise UsageError(f"policy {settings.policy!r} reads attention weights, which --engine vllm does not record")
        self.rows: list[Row] = []
        self.hidden: dict[int, torch.Tensor] = {}  # tap layer -> [tokens, hidden] this forward's block outputs
        self._index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._head_slots: torch.Tensor | None = None  # [layers, tokens, heads] when some row writes per head
        self._decode: DecodeRows | None = None
        self._kept: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # queries kept: tokens, rows, columns

    # -- the pages vLLM allocated ----------------------------------------------------------------------
    def bind(self, layer: int, pages: torch.Tensor) -> None:
        """Layer ``layer``'s pages as vLLM allocated them, ``[blocks, kv_heads, slots, 2 * head_dim]``
        (:attr:`page_slots`). Only this ring reads and writes them, so each page is laid out as each KV head's C keys,
        then its C values (every head's keys are one contiguous ``[C, head_dim]`` matrix for the attention and the
        policies' reads: keys and values interleaved slot by slot made both strided, and a policy's ``q . k``
        products took twice as long), then the queries its policy reads (:class:`RecentQueries`)."""
        blocks, heads, slots, width = pages.shape
        if slots != self.page_slots:
            raise RuntimeError(f"layer {layer}: pages of {slots} slots, the ring needs {self.page_slots}")
        page = pages[0]
        dense = page.permute(sorted(range(3), key=page.stride, reverse=True)).is_contiguous()  # in memory order
        if not dense or pages.stride(0) < page.numel():
            raise RuntimeError(f"layer {layer}: a request's page must be one dense block, got strides {pages.stride()}")
        half, ring, stride, offset = width // 2, self.capacity, pages.stride(0), pages.storage_offset()
        self.buffers[layer] = kv = pages.as_strided(
            (blocks, heads, 2, ring, half), (stride, 2 * ring * half, ring * half, half, 1), offset
        )
        self._kv[layer] = kv[:, :, 0], kv[:, :, 1]
        if self.report and self._prints is None:
            self._prints = torch.zeros(blocks, dtype=torch.int64, device=pages.device)
        if self.queries is not None:
            shape = (blocks, self.heads[0], self.queries.width, half)
            queries = (stride, self.queries.width * half, half, 1)
            self.queries.bind(layer, pages.as_strided(shape, queries, offset + heads * 2 * ring * half))
        self._page_bytes[layer] = page.numel() * pages.element_size()

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s keys and values, ``[blocks, kv_heads, C, head_dim]`` views of its pages (in the model's
        dtype: :func:`~epikv_cli.vllm.models.check_engine_config` refuses another KV-cache dtype)."""
        return self._kv[layer]

    # -- one forward ------------------------------------------------------------------------------------
    def begin(self, rows: list[Row], input_ids: torch.Tensor | None = None) -> None:
        """Before a forward: take new requests in (``computed == 0``) and plan where every row writes.
        ``input_ids`` ``[tokens]``: the forward's tokens (to file each new request under its prompt, with
        ``report``)."""
        self.rows = [row for row in rows if row.block != 0]  # block 0: vLLM's padding rows, which write nothing
        self.hidden = {}
        starts, per_head, kept, inputs = [], False, [], []
        for row in self.rows:
            request = self.requests.get(row.block)
            if row.computed == 0:
                request = self._admit(row)
                if self.report and input_ids is not None:
                    request.prompt = prompt_key(input_ids[row.first : row.last].tolist())
                    self._prints[row.block] = 0
            elif request is not None and row.count == 1:
                inputs.append((row.block, row.first))
            else:
                raise UsageError(
                    "--engine vllm runs each prompt in one forward and then one token per step; "
                    "keep chunked prefill, prefix caching and speculative decoding off"
                )
            first = request.table.seen
            if self.queries is not None:
                kept.append((row, self.queries.columns(request.queries_taken, row.count)))
                request.queries_taken += row.count
            plan = request.table.append(row.count)
            request.write = request.heads.append(plan.start, row.count, first) if request.heads is not None else None
            per_head |= request.write is not None
            starts.append(plan.start)
        self._plan(starts, per_head)
        if self._prints is not None and inputs and input_ids is not None:  # each decode row's input, folded in
            index = torch.tensor(inputs, device=self._prints.device).T  # [2, rows]: blocks, tokens in the forward
            tokens = input_ids.to(self._prints.device)[index[1]].long()
            self._prints[index[0]] = self._prints[index[0]] * FINGERPRINT_BASE + tokens
        self._kept = None
        if kept:  # each row's newest queries: which tokens of the forward, into which request row and column
            tokens = torch.cat([torch.arange(row.last - columns.numel(), row.last) for row, columns in kept])
            blocks = torch.cat([torch.full((columns.numel(),), row.block) for row, columns in kept])
            device = self.buffers[0].device
            self._kept = tokens.to(device), blocks.to(device), torch.cat([c for _, c in kept]).to(device)

    def _admit(self, row: Row) -> RingRequest:
        """A new request (or one vLLM preempted and now recomputes from its start) in block ``row.block``."""
        policy = make_policy(self.settings)
        policy.setup(self.num_layers, self.calibration)
        check_prompt(policy, self.settings, row.count)
        heads = None
        if policy.granular:
            first = self.buffers[0]
            heads = HeadSlots(self.num_layers, first.shape[1], first.device, limit=self.capacity)
        request = RingRequest(row.block, policy, SlotTable(self.capacity, track=not policy.granular), heads)
        if self.admitted is not None:
            request.trace = []
            self.admitted.append(request)
        self.requests[row.block] = request
        return request

    def _plan(self, starts: list[int], per_head: bool) -> None:
        """The ``(block, head, slot)`` index of every token and KV head this forward writes, for every layer."""
        if not self.rows:
            self._index = self._decode = None
            return
        device = self.buffers[0].device
        heads = self.buffers[0].shape[1]
        blocks = torch.cat([torch.full((row.count,), row.block, dtype=torch.long) for row in self.rows])
        slots = torch.cat([torch.arange(start, start + row.count) for row, start in zip(self.rows, starts)])
        tokens = blocks.numel()
        self._index = (
            blocks.to(device)[:, None].expand(tokens, heads),
            torch.arange(heads, device=device)[None, :].expand(tokens, heads),
            slots.to(device)[:, None].expand(tokens, heads),
        )
        self._head_slots = None
        decoding = [(row.first, row.block, self.requests[row.block].table.used) for row in self.rows if row.count == 1]
        self._decode = DecodeRows.plan(decoding, device) if decoding else None
        if per_head:  # a granular row fills each (layer, head)'s own vacant slot
            grid = self._index[2][None].expand(self.num_layers, tokens, heads).clone()
            for row in self.rows:
                write = self.requests[row.block].write
                if write is not None:
                    grid[:, row.first - self.rows[0].first] = write.to(device)
            self._head_slots = grid

    def attend(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor
    ) -> None:
        """Write this forward's ``key``/``value`` ``[tokens, kv_heads, head_dim]`` into the rings, and the attention
        output of ``query`` ``[tokens, heads, head_dim]`` into ``output`` (its shape; tokens of rows vLLM padded get
        zeros). The queries a policy keeps are copies: in a compiled forward ``query``'s buffer is reused."""
        output.zero_()
        if self._index is None:
            return
        keys, values = self.kv(layer)
        base = self.rows[0].first
        end = self.rows[-1].last
        blocks, heads, slots = self._index
        if self._head_slots is not None:
            slots = self._head_slots[layer]
        keys.index_put_((blocks, heads, slots), key[base:end].to(keys.dtype))
        values.index_put_((blocks, heads, slots), value[base:end].to(values.dtype))
        for row in self.rows:  # prompts: causal attention over the prompt, slots in position order
            if row.count == 1:
                continue
            q = query[row.first : row.last].transpose(0, 1)[None]  # [1, heads, q, dim]
            k = keys[row.block : row.block + 1, :, : row.count]
            v = values[row.block : row.block + 1, :, : row.count]
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling, enable_gqa=True)
            output[row.first : row.last] = out[0].transpose(0, 1)
        if self._decode is not None:
            self._attend_decoding(self._decode, query, keys, values, output)
        if self._kept is not None:
            tokens, rows, columns = self._kept
            self.queries.write(layer, rows, columns, query[tokens])

    def _attend_decoding(
        self, decode: DecodeRows, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, output: torch.Tensor
    ) -> None:
        """The decode rows' attention, each over its own live slots (their order does not matter): one call per
        group of rows, one per row left alone (:class:`DecodeRows`)."""
        for token, block, used in decode.alone:
            q = query[token : token + 1, :, None]  # [1, heads, 1, dim]
            k, v = keys[block : block + 1, :, :used], values[block : block + 1, :, :used]
            output[token] = F.scaled_dot_product_attention(q, k, v, scale=self.scaling, enable_gqa=True)[0, :, 0]
        for group in decode.groups:
            first, span, used = group.first, group.span, group.used
            if group.ordered:
                start = group.rows[0][0]
                q = query[start : start + span, :, None]  # [span, heads, 1, dim]
            else:
                q = query.new_zeros(span, query.shape[1], 1, query.shape[2])
                q[group.offsets] = query[group.tokens, :, None]
            k, v = keys[first : first + span, :, :used], values[first : first + span, :, :used]
            out = F.scaled_dot_product_attention(q, k, v, scale=self.scaling, enable_gqa=True)
            if group.ordered:
                output[start : start + span] = out[:, :, 0]
            else:
                output[group.tokens] = out[group.offsets, :, 0]

    def request_for(
        self, prompt_ids: list[int], output_ids: list[int], interrupted: bool = False
    ) -> RingRequest | None:
        """With ``report``, right after the step in which it finished (before another request takes its block): the
        request that read ``prompt_ids`` and then ``output_ids`` but the last (which no forward reads), or None.
        ``interrupted``: a request that Ctrl-C stopped, maybe inside a forward that had begun to read its next token
        (None if another of its prompt has read as many tokens).

        Requests of one prompt are told apart by how many tokens they read and, where that is the same, by the
        fingerprint of their decode inputs (one read from the device, only then). Requests that read the same tokens
        ran the same steps and hold the same evictions and reports, so whichever is found is the answer, even if
        the others go on afterwards.
        """
        key = prompt_key(prompt_ids)
        seen = len(prompt_ids) + len(output_ids) - 1
        found = [
            request
            for request in self.requests.values()
            if request.prompt == key and request.table.seen - seen in ((0, 1) if interrupted else (0,))
        ]
        if len(found) > 1 and interrupted:
            return None
        if len(found) > 1:
            want = token_fingerprint(output_ids[:-1])
            found = [request for request in found if int(self._prints[request.block]) == want]
        return found[0] if found else None

    def holding(self, prompt_ids: list[int]) -> list[RingRequest]:
        """With ``report``, the requests whose blocks hold ``prompt_ids``' requests now (each block's latest)."""
        key = prompt_key(prompt_ids)
        return [request for request in self.requests.values() if request.prompt == key]

    def request_bytes(self) -> int:
        """The KV memory one request holds, in every layer's page (C slots of keys and values, and the queries its
        policy reads): bounded by K."""
        return sum(self._page_bytes)

    def tap(self, layer: int, output: torch.Tensor) -> None:
        """Decoder block ``layer``'s output ``[tokens, hidden]`` this forward (taps the policy asked for)."""
        self.hidden[layer] = output

    def finish(self) -> list[tuple[int, list[int]]]:
        """After the forward: each row's policy sees it, and its ring is brought back within the budget.
        Returns ``(block, evicted positions)`` per row."""
        pending = []
        for row in self.rows:
            request = self.requests[row.block]
            table = request.table
            appended = range(table.committed, table.seen)
            table.committed = table.seen
            if table.prompt_len is None:
                table.prompt_len = len(appended)
            hidden = {layer: states[row.first : row.last][None] for layer, states in self.hidden.items()}
            record = None
            if self.queries is not None:
                record = AttentionRecord(
                    queries=self.queries.of(row.block, request.queries_taken), scaling=self._scalings
                )
            view = RingView(self, request)
            signals = Signals(appended, appended.start == 0, hidden, record, view)
            observed = observe(request.policy, signals)
            policy = request.policy
            if self.reduce is not None and not policy.granular and policy.attention_needs is not None:
                observed.reads = [self.reduce(read) for read in observed.reads]
            pending.append((request, view, observed))
        reads = [tensor for _, _, observed in pending for tensor in observed.reads]
        values = host_copies(reads)
        evicted = []
        done = 0
        for request, view, observed in pending:
            mine = values[done : done + len(observed.reads)]
            done += len(observed.reads)
            request.peak_stored = max(request.peak_stored, view.stored)
            victims = choose(request.policy, observed, mine, view)
            positions = self._evict(request, victims)
            if request.trace is not None:
                request.trace.append(sorted(positions))
            evicted.append((request.block, positions))
        self.hidden = {}
        return evicted

    def _evict(self, request: RingRequest, victims) -> list[int]:
        """Drop ``victims`` from every layer of ``request``'s ring; return the logical positions that left."""
        if not victims:
            return []
        buffers = [self.kv(layer) for layer in range(self.num_layers)]
        if request.heads is not None:
            count = len(victims)
            evict_heads(request.heads, request.table, victims, buffers, request.block)
            request.evicted_total += count
            return victims.gone
        table = request.table
        positions = table.positions[victims].tolist()
        holes, movers = table.plan_eviction(victims)
        if holes:
            move_entries(buffers, [request.block] * len(holes), holes, movers, buffers[0][0].device)
        follow(request.policy, Moves(holes, movers))
        request.evicted_total += len(positions)
        return positions
