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
O(K * head_dim) pass over those means instead of O(layers * K * head_dim) over the whole cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..settings import CacheSettings
from .base import Policy, Signals, evictable_mask, lowest

if TYPE_CHECKING:
    from ..cache import BudgetCache

LAG_CHUNK = 128
LAG_EPS = 1e-9


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
        normalised[:, 1:] = (blocks[:, 1:] - low) / (high - low + eps)
    normalised = normalised.view(heads, chunks * chunk, dim)[:, :n]
    return normalised.std(dim=-1, unbiased=True).mean(dim=0)


def layer_mean(cache: BudgetCache, start: int = 0, stop: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise mean over evicting layers of the live keys and values of slots ``start:stop``, ``[kv_heads, n, dim]`` each."""
    keys = values = None
    layers = cache.budget_layers
    for layer in layers:
        k, v = layer.live()
        k, v = k[0, :, start:stop].float(), v[0, :, start:stop].float()
        if keys is None:
            keys, values = k.clone(), v.clone()
        else:
            keys += k.to(keys.device)
            values += v.to(values.device)
    return keys / len(layers), values / len(layers)


class LagKV(Policy):
    """Lag-KV: scores recomputed from the cached keys and values at every eviction."""

    name = "lagkv"

    def __init__(self, recent: int, chunk: int = LAG_CHUNK, eps: float = LAG_EPS) -> None:
        self.recent = recent
        self.chunk = chunk
        self.eps = eps
        # [kv_heads, capacity, head_dim] float32 layer means of each live slot's key and value
        self.mean_keys: torch.Tensor | None = None
        self.mean_values: torch.Tensor | None = None
        self.length = 0

    @classmethod
    def from_settings(cls, settings: CacheSettings) -> LagKV:
        return cls(recent=cls.recent_from(settings))

    def observe(self, signals: Signals) -> None:
        """Add the appended tokens' layer-mean keys and values (at their slots) to the buffers."""
        cache, count = signals.cache, len(signals.appended)
        if cache is None or not count:
            return
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

    def token_scores(self, cache: BudgetCache) -> torch.Tensor:
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

    def select(self, cache: BudgetCache, count: int) -> list[int]:
        positions = cache.live_positions()
        candidates = evictable_mask(positions, cache.prompt_len, cache.seen, self.recent)
        return lowest(self.token_scores(cache), positions, candidates, count)

    def follow_moves(self, holes: list[int], movers: list[int]) -> None:
        index_holes = torch.tensor(holes, device=self.mean_keys.device)
        index_movers = torch.tensor(movers, device=self.mean_keys.device)
        self.mean_keys[:, index_holes] = self.mean_keys[:, index_movers]
        self.mean_values[:, index_holes] = self.mean_values[:, index_movers]
