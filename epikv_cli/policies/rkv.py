"""R-KV (Cai et al., arXiv 2505.24133): importance minus redundancy, compressed every 128 steps.

The cache may grow to K + 128 entries; then it is brought back to K at once:
  importance(t) = attention of the last 8 queries to t (softmax over the past tokens, mean over
                  the 8, grouped query heads pooled by max), max-pooled over positions (kernel 7);
  redundancy(t) = mean over tokens i of cos(key_i, key_t), where each token's own key and its most
                  recent look-alike (cosine > 0.5, the copy that is kept) do not count; softmax over t;
  score(t)      = 0.1 * importance(t) - 0.9 * redundancy(t)    (lambda = 0.1, METHOD.md)
Kept: the top K - 8 past tokens and the last 8. Scores are averaged over KV heads and evicting
layers, giving one global keep-set (the original is per layer and per KV head). Only the last 8
query vectors of each layer are kept, so no eager attention is ever needed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from epikv_cli.policies.base import AttentionNeeds, BudgetFloor, Policy, PolicyOptions, Signals

if TYPE_CHECKING:
    from epikv_cli.core.view import CacheView

WINDOW = 8
BUFFER = 128
KERNEL = 7
MIX_LAMBDA = 0.1
SIMILAR = 0.5


def importance(
    queries: torch.Tensor, keys: torch.Tensor, window: int = WINDOW, kernel: int = KERNEL, scaling: float | None = None
) -> torch.Tensor:
    """``[kv_heads, n - window]``: max-pooled attention of the window's queries to the past tokens.

    Args:
        queries: ``[heads, w, dim]``, the last w <= window queries; keys: ``[kv_heads, n, dim]`` in logical order.
        scaling: the layer's softmax scale (default ``dim ** -0.5``).
    """
    heads, w, dim = queries.shape
    kv_heads = keys.shape[0]
    logits = torch.matmul(
        queries.float().view(kv_heads, heads // kv_heads, w, dim), keys.float().unsqueeze(1).transpose(-1, -2)
    )
    logits = logits.amax(dim=1) * (
        scaling if scaling is not None else dim**-0.5
    )  # [kv_heads, w, n], grouped heads pooled by max
    attention = torch.softmax(logits[:, :, : keys.shape[1] - window], dim=-1).mean(dim=1)
    return F.max_pool1d(attention.unsqueeze(0), kernel_size=kernel, padding=kernel // 2, stride=1)[0]


def redundancy(keys: torch.Tensor, threshold: float = SIMILAR) -> torch.Tensor:
    """``[kv_heads, n]``: softmax over tokens of their mean cosine similarity to the others.

    For each token i, its own key and its most recent look-alike (the largest j with cosine above
    ``threshold``, the copy that stays) are left out of the mean.
    """
    unit = keys.float() / (keys.float().norm(dim=-1, keepdim=True) + 1e-8)
    similarity = torch.matmul(unit, unit.transpose(-1, -2))  # [kv_heads, n, n]
    similarity.diagonal(dim1=-2, dim2=-1).zero_()
    n = keys.shape[1]
    alike = similarity > threshold
    last_alike = torch.where(alike, torch.arange(n, device=keys.device), -1).amax(dim=-1)  # [kv_heads, n]
    has = last_alike >= 0
    rows = torch.nonzero(has, as_tuple=True)
    similarity[rows[0], rows[1], last_alike[has]] = 0
    return torch.softmax(similarity.mean(dim=-2), dim=-1)


class RKV(Policy):
    """R-KV with a global keep-set; keeps only the last 8 query vectors per layer."""

    name = "rkv"
    protects_prompt = False
    takes_recent = False
    attention_needs = AttentionNeeds(queries=WINDOW)
    slack = BUFFER

    def __init__(self, options: PolicyOptions | None = None, **values: object) -> None:
        super().__init__(options, **values)
        self.window = WINDOW
        self.buffer = BUFFER
        self.mix = MIX_LAMBDA
        self.queries = None  # the attention record's query store, set by stage
        self.scaling: dict[int, float] = {}  # layer -> its kernel's softmax scale

    def stage(self, signals: Signals) -> list[torch.Tensor]:
        self.queries = signals.attention.queries
        self.scaling = signals.attention.scaling
        return []

    def budget_floor(self, prompt_len: int) -> BudgetFloor:
        return BudgetFloor(self.window + 1, f"its last {self.window} tokens")

    def token_scores(self, cache: CacheView) -> tuple[torch.Tensor, torch.Tensor]:
        """``(order, score)``: live slots in logical order and the ``[n - window]`` scores of all but the last
        window.
        """
        order = torch.argsort(cache.live_positions())
        total = None
        for j, index in enumerate(cache.evicting_layers):
            live = cache.layer_kv(j)[0][0]
            keys = live[:, order.to(live.device)]  # [kv_heads, n, dim], logical order
            queries = self.queries[index].to(keys.device)
            past = self.mix * importance(queries, keys, self.window, scaling=self.scaling.get(index))
            joint = (past - (1 - self.mix) * redundancy(keys)[:, : -self.window]).mean(dim=0).cpu()
            total = joint if total is None else total + joint
        return order, total / len(cache.evicting_layers)

    def select(self, cache: CacheView, count: int) -> list[int]:
        """Nothing until K + 128 entries are stored; then back to K at once."""
        if count < self.buffer:
            return []
        order, score = self.token_scores(cache)
        drop = torch.argsort(score, stable=True)[:count]
        return order[drop].tolist()
