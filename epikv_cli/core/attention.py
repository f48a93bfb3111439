"""Attention taps: what attention-based policies need, read beside any attention kernel.

Attention weights are never materialised by SDPA or FlashAttention kernels. Instead of switching the
whole model to eager attention, a session that needs them registers, through transformers'
``AttentionInterface``, a function ``epikv_taps+<kernel>`` that calls the model's own kernel for the
output and computes, on the side and only for the evicting layers, the softmax rows of the queries
of this forward (chunked over queries at prefill, so memory stays O(chunk x length)). With eager
attention the kernel returns the weights itself and they are used as they are. The model's kernel
setting is restored when the session ends; nothing global is patched (new names are registered).
"""

from __future__ import annotations

import collections
import math
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    AttentionMaskInterface,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from epikv_cli.core.keepsets import mutable_zeros
from epikv_cli.core.taps import decoder_blocks

TAP_PREFIX = "epikv_taps+"
_TAP_ATTRIBUTE = "_epikv_attention_tap"  # on a tapped attention module: the AttentionTaps it reports to
#: Query rows whose weights are computed at once at prefill: memory is O(QUERY_CHUNK x length) per layer.
QUERY_CHUNK = 256


@dataclass(frozen=True)
class AttentionNeeds:
    """What a policy reads from attention.

    Attributes:
        received: per key, the attention it receives from this forward's queries (summed over them).
        last_row: per key, the attention of this forward's last query.
        queries: keep each layer's last ``queries`` query vectors (after RoPE) across forwards.
    """

    received: bool = False
    last_row: bool = False
    queries: int = 0

    @property
    def weights(self) -> bool:
        return self.received or self.last_row


class QueryRing:
    """One layer's last ``width`` query vectors for every batch row, in a ring: a decode step fills one
    slot (no copy of the others); rows read them oldest first.

    A decode step's query, outside a compiled graph, is only referenced (``[batch, heads, 1, head_dim]``,
    a fresh tensor of the forward) and copied into the ring when it is next read: a policy reads the ring
    once per refresh, so the step skips a copy kernel per layer, and its bookkeeping (:attr:`head`,
    :attr:`valid`) is brought up to date then too. Inside a compiled graph the query is copied at once (a
    graph's outputs may be overwritten by its next replay, e.g. with CUDA graphs).
    """

    def __init__(self, width: int) -> None:
        self.width = width
        self._buffer: torch.Tensor | None = None  # [batch, heads, width, head_dim]
        #: the newest decode queries not copied in yet, oldest first (at most a lap's worth)
        self._pending: collections.deque[torch.Tensor] = collections.deque(maxlen=width)
        self._unsettled = 0  # decode queries written since the bookkeeping was last brought up to date
        self._head = 0  # the next slot written, the same for every row (all rows take one query per step)
        self._valid: list[int] = []  # per row: how many slots hold real queries

    def _settle(self) -> None:
        """Copy the pending queries into their slots and advance :attr:`head` and :attr:`valid` past them."""
        if not self._unsettled:
            return
        count, self._unsettled = self._unsettled, 0
        self._head = (self._head + count) % self.width
        self._valid = [min(v + count, self.width) for v in self._valid]
        if not self._pending:
            return
        with torch.no_grad(), torch.inference_mode(False):  # a normal tensor, as keep_rows makes
            joined = torch.cat(list(self._pending), dim=2)
            if len(self._pending) == self.width:  # a whole lap: the pending queries are the ring, oldest first
                self._buffer, self._head = joined, 0
            else:
                done = 0
                for first, last in self._spans(len(self._pending)):
                    self._buffer[:, :, first:last] = joined[:, :, done : done + last - first]
                    done += last - first
        self._pending.clear()

    @property
    def head(self) -> int:
        """The next slot written."""
        self._settle()
        return self._head

    @property
    def valid(self) -> list[int]:
        """Per row: how many slots hold real queries."""
        self._settle()
        return self._valid

    @valid.setter
    def valid(self, counts: list[int]) -> None:
        self._settle()
        self._valid = counts

    @property
    def buffer(self) -> torch.Tensor | None:
        """``[batch, heads, width, head_dim]``: the ring's slots, every written query copied in."""
        self._settle()
        return self._buffer

    def _spans(self, count: int) -> list[tuple[int, int]]:
        """The slot ranges ``[first, last)`` of the ``count`` slots before :attr:`head`, oldest first (two when
        they wrap around the ring's end)."""
        start = (self._head - count) % self.width
        if start + count <= self.width:
            return [(start, start + count)]
        return [(start, self.width), (0, start + count - self.width)]

    def write(self, query: torch.Tensor) -> None:
        """Store ``query`` ``[batch, heads, q, head_dim]`` (q = 1 in decode steps, the prompt at a prefill)."""
        buffer = self._buffer
        # the decode step's path, taken once per layer and step: as few Python lines as it can be
        if (
            query.shape[2] == 1
            and buffer is not None
            and query.shape[0] == buffer.shape[0]
            and not torch.compiler.is_compiling()
        ):
            self._pending.append(query)
            self._unsettled += 1
            return
        self._settle()  # (may replace the buffer)
        buffer, query = self._buffer, query.detach()
        batch, heads, count, dim = query.shape
        if buffer is None or buffer.shape[0] != batch:
            self._buffer = buffer = mutable_zeros((batch, heads, self.width, dim), query.dtype, query.device)
            self._head, self._valid = 0, [0] * batch
        if count >= self.width:
            buffer.copy_(query[:, :, -self.width :])
            self._head, self._valid = 0, [self.width] * batch
            return
        for index in range(count):
            buffer.select(2, self._head).copy_(query.select(2, index))
            self._head = (self._head + 1) % self.width
        self._valid = [min(v + count, self.width) for v in self._valid]

    def ordered(self, row: int) -> torch.Tensor:
        """``[heads, valid, head_dim]``: row ``row``'s real queries, oldest first (a view when they do not
        wrap around the ring's end, else one copy of two slices; no index tensor, so no host-to-device copy)."""
        slots = self.buffer[row]
        spans = [slots[:, first:last] for first, last in self._spans(self.valid[row])]
        return spans[0] if len(spans) == 1 else torch.cat(spans, dim=1)

    def keep_rows(self, keep: torch.Tensor) -> None:
        with torch.inference_mode(False):  # a normal tensor, written in place in and out of inference mode
            self._buffer = self.buffer[keep.to(self._buffer.device)]
        self.valid = [self.valid[i] for i in keep.tolist()]

    def add_row(self, queries: torch.Tensor | None, heads: int, dim: int, dtype, device) -> None:
        """A row joins with its own last queries ``[heads, w, head_dim]`` (oldest first; None: none)."""
        row = mutable_zeros((1, heads, self.width, dim), dtype, device)
        count = 0 if queries is None else min(queries.shape[1], self.width)
        for i in range(count):
            row[0, :, (self.head - count + i) % self.width] = queries[:, queries.shape[1] - count + i]
        with torch.inference_mode(False):  # as keep_rows
            self._buffer = row if self._buffer is None else torch.cat([self.buffer, row])
        self.valid.append(count)


class RowQueries(Mapping):
    """Layer -> one batch row's queries ``[heads, w, head_dim]``, oldest first, gathered from the rings
    when read (a policy reads them only at its refreshes; read them before the next forward writes)."""

    def __init__(self, rings: dict[int, QueryRing], row: int, last: int | None = None) -> None:
        self.rings, self.row, self.last = rings, row, last  # last: only the newest `last` queries

    def __getitem__(self, layer: int) -> torch.Tensor:
        queries = self.rings[layer].ordered(self.row)
        return queries[:, -self.last :] if self.last else queries

    def __iter__(self) -> Iterator[int]:
        return iter(self.rings)

    def __len__(self) -> int:
        return len(self.rings)


@dataclass
class AttentionRecord:
    """Per evicting layer, what the latest forward's attention showed, for every sequence of the batch.
    Key index ``j`` is cache slot ``j`` (slots beyond a row's stored length are padding).

    Attributes:
        received: layer -> ``[batch, kv_len]`` float32, attention received, summed over this forward's
            queries, mean over query heads.
        last_row: layer -> ``[batch, kv_len]`` float32, the last query's attention, mean over query heads.
        queries: layer -> :class:`QueryRing` of the last N query vectors (kept across forwards). A
            one-row view (:meth:`row`) holds ``[heads, w, head_dim]`` tensors instead, oldest first.
        scaling: layer -> the softmax scale its kernel applies to ``q . k`` (Gemma's
            ``query_pre_attn_scalar``, for instance, is not always ``head_dim``), for whoever recomputes
            attention from the stored queries.
    """

    received: dict[int, torch.Tensor] = field(default_factory=dict)
    last_row: dict[int, torch.Tensor] = field(default_factory=dict)
    queries: dict = field(default_factory=dict)
    scaling: dict[int, float] = field(default_factory=dict)

    @staticmethod
    def layer_mean(per_layer: dict[int, torch.Tensor]) -> torch.Tensor:
        """``[kv_len]`` float32 on the first layer's device: the mean over layers of slot-indexed vectors."""
        vectors = list(per_layer.values())
        return torch.stack([vector.float().to(vectors[0].device) for vector in vectors]).mean(dim=0)

    def row(self, index: int, stored: int, offset: int = 0) -> AttentionRecord:
        """One sequence's record, cut to its ``stored`` slots from ``offset`` on (a left-padded prefill's
        row starts after its padding): ``[kv_len]`` vectors and ``[heads, w, dim]`` queries."""
        end = offset + stored
        return AttentionRecord(
            {layer: v[index, offset:end] for layer, v in self.received.items()},
            {layer: v[index, offset:end] for layer, v in self.last_row.items()},
            RowQueries(self.queries, index),
            self.scaling,
        )

    def select_rows(self, keep: torch.Tensor) -> None:
        """Keep only the batch rows ``keep`` (queries persist across forwards, so they follow the batch)."""
        for ring in self.queries.values():
            ring.keep_rows(keep)

    def clear_forward(self) -> None:
        """Drop what belongs to one forward only (queries persist)."""
        self.received.clear()
        self.last_row.clear()


def attention_rows(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    rows: slice,
    softcap: float | None = None,
) -> torch.Tensor:
    """Softmax attention of some query rows, in float32.

    Args:
        query: ``[batch, heads, q, dim]``; key: ``[batch, kv_heads, n, dim]`` (grouped-query attention allowed).
        attention_mask: ``[batch, 1, q, n]`` boolean (True attends) or additive float, or None (causal
            when q > 1: query i sees keys up to ``n - q + i``).
        rows: which of the q query rows.
    Returns:
        ``[batch, heads, r, n]`` attention weights of those rows.
    """
    batch, heads, q_len, dim = query.shape
    kv_heads, n = key.shape[1], key.shape[2]
    q = query[:, :, rows].float()
    r = q.shape[2]
    grouped = q.view(batch, kv_heads, heads // kv_heads, r, dim)
    scores = torch.matmul(grouped, key.float().unsqueeze(2).transpose(-1, -2)).view(batch, heads, r, n) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        mask = attention_mask[:, :, rows, :n]
        scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask.float()
    elif q_len > 1:
        first = rows.start or 0
        visible = (
            torch.arange(n, device=key.device)[None, :]
            <= (n - q_len + first + torch.arange(r, device=key.device))[:, None]
        )
        scores = scores.masked_fill(~visible, -math.inf)
    return torch.softmax(scores, dim=-1)


class AttentionTaps:
    """While active, the model's evicting layers report their attention into :attr:`record`.

    Args:
        model: a loaded causal LM.
        layers: the decoder blocks to read (the evicting, full-attention layers).
        needs: what to compute.
    """

    def __init__(self, model: nn.Module, layers: list[int], needs: AttentionNeeds) -> None:
        self.model = model
        self.needs = needs
        self.record = AttentionRecord()
        blocks = decoder_blocks(model)
        self.modules = [_attention_module(blocks[layer]) for layer in layers]
        # Sessions sharing a model share the tapped kernel: the first switches, the last restores.
        users = getattr(model, "_epikv_tap_users", 0)
        if users == 0:
            model._epikv_tap_base = model.config._attn_implementation
            _register(model._epikv_tap_base)
            model.set_attn_implementation(TAP_PREFIX + model._epikv_tap_base)
        model._epikv_tap_users = users + 1
        self.base = model._epikv_tap_base
        #: batch rows whose policies read weights (None: all); the others get zeros, computed for nobody
        self.weight_rows: torch.Tensor | None = None
        #: ``[batch, q]`` bool, False for the padding queries of a left-padded prefill (None: all real);
        #: their attention is nobody's and is left out of what keys receive
        self.query_valid: torch.Tensor | None = None
        self.set_active(True)

    def set_active(self, active: bool) -> None:
        """Receive the evicting layers' attention (only this session's forwards should)."""
        # twice a forward on every evicting layer: through the instance dict, not nn.Module's __setattr__
        # and __delattr__ (which look through parameters, buffers and submodules first)
        for module in self.modules:
            if active:
                module.__dict__[_TAP_ATTRIBUTE] = self
            elif module.__dict__.get(_TAP_ATTRIBUTE) is self:
                del module.__dict__[_TAP_ATTRIBUTE]

    @property
    def returns_weights(self) -> bool:
        """Eager attention with weights needed: the EpiKV authors' set-up, where the forward is asked
        for every layer's attention weights (``output_attentions=True``), O(layers x heads x n^2) at prefill."""
        return self.base == "eager" and self.needs.weights

    @torch.compiler.disable
    def observe(self, module: nn.Module, query, key, attention_mask, kwargs: dict, weights) -> None:
        """Called by the tapped kernel after it computed ``module``'s output (never compiled: its ring index
        and records change every step, and would make a compiled forward recompile every step)."""
        layer = module.layer_idx
        needs = self.needs
        if needs.queries:  # every decode step of every evicting layer: kept short
            ring = self.record.queries.get(layer)
            if ring is None or layer not in self.record.scaling:
                ring = self._ring(layer, query.shape[-1], kwargs)
            ring.write(query)
        if not needs.weights:
            return
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        q_len = query.shape[2]
        softcap = kwargs.get("softcap")
        batch = query.shape[0]
        subset = self.weight_rows
        valid = self.query_valid.to(query.device) if self.query_valid is not None else None
        if subset is not None:
            subset = subset.to(query.device)
            valid = valid[subset] if valid is not None else None
            query, key = query[subset], key[subset]
            attention_mask = attention_mask[subset] if attention_mask is not None else None
            weights = weights[subset] if weights is not None else None

        def rows(part: slice) -> torch.Tensor:  # [batch, heads, r, n]
            if weights is not None:
                return weights[:, :, part].float()
            return attention_rows(query, key, attention_mask, scaling, part, softcap)

        def place(values: torch.Tensor) -> torch.Tensor:  # [rows, n] -> [batch, n]
            if subset is None:
                return values
            full = values.new_zeros((batch, values.shape[-1]))
            full[subset] = values
            return full

        if needs.last_row:
            self.record.last_row[layer] = place(rows(slice(q_len - 1, q_len))[:, :, 0].mean(dim=1))
        if needs.received:
            total = None
            for start in range(0, q_len, QUERY_CHUNK):
                span = slice(start, min(start + QUERY_CHUNK, q_len))
                chunk = rows(span)
                if valid is not None:  # a padding query's row (fully masked) adds nothing
                    chunk = torch.where(valid[:, None, span, None], chunk, 0.0)
                part = chunk.sum(dim=2).mean(dim=1)
                total = part if total is None else total + part
            self.record.received[layer] = place(total)

    def _ring(self, layer: int, head_dim: int, kwargs: dict) -> QueryRing:
        """``layer``'s query ring (made if new), its kernel's softmax scale recorded beside it."""
        self.record.scaling[layer] = kwargs.get("scaling") or head_dim**-0.5
        return self.record.queries.setdefault(layer, QueryRing(self.needs.queries))

    def remove(self) -> None:
        """Stop recording; the last session to leave gives the model its own kernel back."""
        self.set_active(False)
        self.model._epikv_tap_users -= 1
        if self.model._epikv_tap_users == 0:
            if self.model.config._attn_implementation == TAP_PREFIX + self.base:
                self.model.set_attn_implementation(self.base)
            del self.model._epikv_tap_users, self.model._epikv_tap_base
        self.record = AttentionRecord()


def _attention_module(block: nn.Module) -> nn.Module:
    """The attention submodule of a decoder block (the one carrying ``layer_idx``)."""
    for module in block.modules():
        if module is not block and hasattr(module, "layer_idx") and "Attention" in type(module).__name__:
            return module
    raise ValueError(f"cannot find the attention module of {type(block).__name__}")


def _delegate(base: str, module: nn.Module):
    """The kernel the model would have used: a registered one, or its own eager function."""
    if base == "eager":
        own = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if own is None:
            raise ValueError(f"{type(module).__name__} has no eager attention function to tap")
        return own
    return ALL_ATTENTION_FUNCTIONS[base]


def _tapped(base: str):
    def attention(module, query, key, value, attention_mask, **kwargs):
        output, weights = _delegate(base, module)(module, query, key, value, attention_mask, **kwargs)
        tap = getattr(module, _TAP_ATTRIBUTE, None)
        if tap is not None:
            tap.observe(module, query, key, attention_mask, kwargs, weights)
        return output, weights

    return attention


def _register(base: str) -> None:
    """Register ``epikv_taps+<base>`` (kernel and mask) once."""
    name = TAP_PREFIX + base
    if name in ALL_ATTENTION_FUNCTIONS:
        return
    AttentionInterface.register(name, _tapped(base))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
