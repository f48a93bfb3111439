"""Lag-KV, the causal "lag-normalized KV" variant of the EpiKV paper (after LagKV, arXiv 2504.04704).

At every eviction, over the whole current cache:
  1. average the key vectors of all evicting layers element-wise -> ``[kv_heads, n, head_dim]`` in
     logical order (same for values);
  2. cut the n tokens into chunks of 128, prompt included; chunk 0 stays raw, chunk c >= 1 is min-max
     normalised per head and channel with the min and max of chunk c - 1:
     ``x_hat = (x - min) / (max - min + 1e-9)``;
  3. token score = unbiased std over head_dim of x_hat, mean over heads; keys + values.
The lowest-scoring evictable tokens leave (same protection as EpiKV-Flat). No softmax.

Cached keys never change, so the layer means of step 1 are accumulated once per token, when it is
appended, into slot-indexed buffers that follow the cache's slot moves (``follow_moves``): an eviction costs one
O(K * head_dim) pass over those means instead of O(layers * K * head_dim) over the whole cache. It stays
O(K) by definition: the chunks are cut over the tokens the cache holds now, so each eviction moves the first
token of every later chunk into the chunk before it, and every later token's reference range changes.

``lagkv:chunks=positions`` cuts the chunks over logical positions instead (position // 128), the way the
tokens arrived: a token's chunk and the chunk before it never change, so its score is computed once, at
append, against the range of the previous 128 positions as they were appended (evicted ones included), and
frozen. Per token that is one layer mean and one O(heads * head_dim) normalisation, and eviction pops a heap
(:class:`~.keep_scored.ScoredPolicy`): the step no longer grows with K. Until the first eviction both ways
give the same scores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from epikv_cli.policies.base import Policy, PolicyOptions, Signals, UsageError, evictable_mask, lowest
from epikv_cli.policies.keep_scored import ScoredPolicy

if TYPE_CHECKING:
    from epikv_cli.config import CacheSettings
    from epikv_cli.core.view import CacheView, Moves

LAG_CHUNK = 128
LAG_EPS = 1e-9


def _scaled(x: torch.Tensor, low: torch.Tensor, high: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` min-max scaled by the range ``[low, high]`` of the chunk before (broadcast per head and channel)."""
    return (x - low) / (high - low + eps)


def _spread(x: torch.Tensor) -> torch.Tensor:
    """``[..., heads, n, dim]`` -> ``[..., n]``: unbiased std over ``dim``, mean over heads."""
    return x.std(dim=-1, unbiased=True).mean(dim=-2)


def lag_scores(x: torch.Tensor, chunk: int = LAG_CHUNK, eps: float = LAG_EPS) -> torch.Tensor:
    """Lag-normalised token scores.

    Args:
        x: ``[heads, n, dim]`` vectors in logical order.
    Returns:
        ``[n]`` float32: per token, the unbiased std over ``dim`` of the normalised vector, mean over heads.
    """
    heads, n, dim = x.shape
    x = x.float()
    chunks = -(-n // chunk)
    padded = torch.nn.functional.pad(x, (0, 0, 0, chunks * chunk - n))
    blocks = padded.view(heads, chunks, chunk, dim)
    normalised = blocks.clone()
    if chunks > 1:
        # min/max of each full previous chunk (a chunk followed by another is always full)
        reference = blocks[:, :-1]
        low = reference.amin(dim=2, keepdim=True)
        high = reference.amax(dim=2, keepdim=True)
        normalised[:, 1:] = _scaled(blocks[:, 1:], low, high, eps)
    return _spread(normalised.view(heads, chunks * chunk, dim)[:, :n])


def layer_mean(cache: CacheView, start: int = 0, stop: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise mean over evicting layers of the live keys and values of slots ``start:stop``, ``[kv_heads, n,
    dim]`` each.
    """
    keys = values = None
    layers = len(cache.evicting_layers)
    for j in range(layers):
        k, v = cache.layer_kv(j)
        k, v = k[0, :, start:stop].float(), v[0, :, start:stop].float()
        if keys is None:
            keys, values = k.clone(), v.clone()
        else:
            keys += k.to(keys.device)
            values += v.to(values.device)
    return keys / layers, values / layers


@dataclass(frozen=True)
class LagKVOptions(PolicyOptions):
    """Lag-KV's option: ``chunks``, what its chunks are made of: ``cache`` (the live slots in logical order, the
    published rule, rescored at every eviction) or ``positions`` (logical positions, each score frozen at append)."""

    chunks: str = "cache"

    def __post_init__(self) -> None:
        if self.chunks not in ("cache", "positions"):
            raise UsageError(f"lagkv option chunks={self.chunks!r}: choose cache (the published rule) or positions")


class LagKV(Policy):
    """Lag-KV: scores recomputed from the cached keys and values at every eviction.

    ``--policies lagkv:chunks=positions`` builds :class:`FrozenLagKV` instead (chunks of logical positions,
    each score frozen at append); ``chunks=cache`` (the default) is the published rule.
    """

    name = "lagkv"
    Options = LagKVOptions

    def __init__(self, options: LagKVOptions | None = None, **values: object) -> None:
        super().__init__(options, **values)
        self.chunk = LAG_CHUNK
        self.eps = LAG_EPS
        # [kv_heads, capacity, head_dim] float32 layer means of each live slot's key and value
        self.mean_keys: torch.Tensor | None = None
        self.mean_values: torch.Tensor | None = None
        self.length = 0

    @classmethod
    def from_settings(cls, settings: CacheSettings) -> LagKV | FrozenLagKV:
        """``chunks=positions`` builds :class:`FrozenLagKV`."""
        options = LagKVOptions.from_settings(cls.name, settings)
        return (FrozenLagKV if options.chunks == "positions" else cls)(options)

    def stage(self, signals: Signals) -> list[torch.Tensor]:
        """Add the appended tokens' layer-mean keys and values (at their slots) to the buffers."""
        cache, count = signals.cache, len(signals.appended)
        if cache is None or not count:
            return []
        slots = signals.new_slots()
        keys, values = layer_mean(cache, slots.start, slots.stop)
        if self.mean_keys is None or slots.stop > self.mean_keys.shape[1]:
            size = max(slots.stop, 2 * (self.mean_keys.shape[1] if self.mean_keys is not None else 0))
            grown = [torch.zeros(keys.shape[0], size, keys.shape[2], device=keys.device) for _ in range(2)]
            if self.mean_keys is not None:
                grown[0][:, : self.length] = self.mean_keys[:, : self.length]
                grown[1][:, : self.length] = self.mean_values[:, : self.length]
            self.mean_keys, self.mean_values = grown
        self.mean_keys[:, slots] = keys
        self.mean_values[:, slots] = values
        self.length = max(self.length, slots.stop)
        return []

    def token_scores(self, cache: CacheView) -> torch.Tensor:
        """``[stored]`` Lag-KV scores of the live slots, in slot order."""
        positions = cache.live_positions()
        order = torch.argsort(positions)
        keys, values = self.mean_keys[:, : cache.stored], self.mean_values[:, : cache.stored]
        order_dev = order.to(keys.device)
        logical = lag_scores(keys[:, order_dev], self.chunk, self.eps) + lag_scores(
            values[:, order_dev], self.chunk, self.eps
        )
        scores = torch.empty_like(logical)
        scores[order_dev] = logical
        return scores.cpu()

    def select(self, cache: CacheView, count: int) -> list[int]:
        positions = cache.live_positions()
        candidates = evictable_mask(positions, cache.prompt_len, cache.seen, self.recent)
        return lowest(self.token_scores(cache), positions, candidates, count)

    def follow(self, moves: Moves) -> None:
        if not moves.holes:
            return
        index_holes = torch.tensor(moves.holes, device=self.mean_keys.device)
        index_movers = torch.tensor(moves.movers, device=self.mean_keys.device)
        self.mean_keys[:, index_holes] = self.mean_keys[:, index_movers]
        self.mean_values[:, index_holes] = self.mean_values[:, index_movers]


class LagChunks:
    """Lag-normalised scores of a stream of vectors cut into chunks of logical positions, one block at a time.

    Holds the min and max of the last complete chunk (the reference of the tokens now arriving) and the
    running min and max of the chunk being filled, each ``[heads, dim]`` on the vectors' device: O(heads * dim)
    memory and work per token, whatever the length. Fed the whole sequence in blocks, it returns what
    :func:`lag_scores` returns for the whole sequence at once.
    """

    def __init__(self, chunk: int = LAG_CHUNK, eps: float = LAG_EPS) -> None:
        self.chunk = chunk
        self.eps = eps
        self.length = 0  # positions seen so far
        self.reference: tuple[torch.Tensor, torch.Tensor] | None = None  # (min, max) of the last full chunk
        self.running: tuple[torch.Tensor, torch.Tensor] | None = None  # (min, max) of the chunk being filled

    def push(self, x: torch.Tensor) -> torch.Tensor:
        """Scores of the next ``q`` positions.

        Args:
            x: ``[heads, q, dim]`` their vectors, in position order.
        Returns:
            ``[q]`` float32 on ``x``'s device: unbiased std over ``dim`` of each normalised vector, mean over heads.
        """
        x = x.float()
        scores, start = [], 0
        while start < x.shape[1]:
            room = self.chunk - self.length % self.chunk  # positions left in the current chunk
            block = x[:, start : start + room]
            # chunk 0 stays raw
            scores.append(_spread(block if self.reference is None else _scaled(block, *self.reference, self.eps)))
            low, high = block.amin(dim=1, keepdim=True), block.amax(dim=1, keepdim=True)
            if self.running is not None:
                low, high = torch.minimum(low, self.running[0]), torch.maximum(high, self.running[1])
            self.running = (low, high)
            self.length += block.shape[1]
            start += block.shape[1]
            if self.length % self.chunk == 0:  # the chunk is complete: the next one normalises with it
                self.reference, self.running = self.running, None
        return torch.cat(scores) if scores else x.new_zeros(0)


class FrozenLagKV(ScoredPolicy):
    """Lag-KV over chunks of logical positions (``lagkv:chunks=positions``): each token scored once, at append.

    Its score is that of :func:`lag_scores` over every token appended so far (evicted ones included), keys
    plus values, from the layer means of its key and value; the lowest-scoring evictable tokens leave.
    """

    name = "lagkv"
    Options = LagKVOptions

    def __init__(self, options: LagKVOptions | None = None, **values: object) -> None:
        super().__init__(options, **values)
        self.keys = LagChunks(LAG_CHUNK, LAG_EPS)
        self.values = LagChunks(LAG_CHUNK, LAG_EPS)

    def stage(self, signals: Signals) -> list[torch.Tensor]:
        """``[q]`` scores of the appended tokens on the model's device, from their layer-mean keys and values."""
        cache = signals.cache
        if cache is None or not len(signals.appended):
            return []
        if signals.appended.start != self.keys.length:
            raise RuntimeError(
                f"lagkv:chunks=positions saw position {signals.appended.start} after {self.keys.length} positions"
            )
        slots = signals.new_slots()
        keys, values = layer_mean(cache, slots.start, slots.stop)
        return [self.keys.push(keys) + self.values.push(values)]

    def settle(self, signals: Signals, values: list[torch.Tensor]) -> None:
        """Freeze the appended tokens' scores (``values[0]``: ``[q]`` on the host)."""
        if not values:
            return
        for position, score in zip(signals.appended, values[0].tolist()):
            self.record_score(position, score)
