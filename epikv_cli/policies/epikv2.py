"""EpiKV-2: heavy hitters measured from a few recent queries, on any attention kernel.

The published EpiKV score freezes a hidden-state statistic at entry, and measured on real models it
keeps the cache further from the full one than keeping the most recent tokens. What does keep a
model close is what H2O measures: the attention each cached token receives. EpiKV-2 measures it
without the kernel's weights: each evicting layer keeps its last ``period`` query vectors (after
RoPE), and every ``period`` steps their attention to the cached keys is computed beside the kernel
(one small matmul per layer) and added to each token's running score, older contributions decayed.
Kept: the first ``sinks`` tokens, the most recent ``recent`` share of K, then the highest scores;
the prompt is scored like everything else. State: one float per token and ``period`` queries per
layer; the per-step work is one query copy per layer and O(log K) heap operations, and every
``period`` steps one ``[queries x K]`` product per layer and a heap rebuilt from the new scores
(amortised O(K / period) per step, the order of one attention row).

Options (``--policies epikv2:period=32:decay=0.9``): ``sinks``, ``recent`` (a share of K below 1,
else tokens), ``period``, ``decay`` (per refresh, 1 keeps every contribution), ``prompt``
(``score`` or ``keep``), and ``signal`` for ablations: ``attention`` (the default), ``epiphany``
(the published EpiKV score under these keep rules) or ``none`` (recency alone).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

import torch

from ..attention import AttentionNeeds
from ..errors import UsageError
from ..settings import CacheSettings
from .base import Policy, Signals
from .epikv import EpiKV
from .keep_scored import CandidateHeap, ScoreBook

if TYPE_CHECKING:
    from ..cache import BudgetCache


def received_attention(queries: torch.Tensor, keys: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """``[n]``: attention each key receives from the queries, summed over queries, mean over query heads.

    Args:
        queries: ``[heads, w, dim]`` (after RoPE); keys: ``[kv_heads, n, dim]`` in slot order.
        query_positions: ``[w]`` and key_positions: ``[n]`` logical positions (a query sees keys at or before it).
    """
    heads, w, dim = queries.shape
    kv_heads, n = keys.shape[0], keys.shape[1]
    logits = torch.matmul(queries.float().view(kv_heads, heads // kv_heads, w, dim), keys.float().unsqueeze(1).transpose(-1, -2))
    logits = logits.view(heads, w, n) / math.sqrt(dim)
    visible = key_positions.to(keys.device)[None, :] <= query_positions.to(keys.device)[:, None]  # [w, n]
    weights = torch.softmax(logits.masked_fill(~visible, -math.inf), dim=-1)
    return weights.sum(dim=1).mean(dim=0)


class EpiKV2(Policy):
    """Sinks, a recent share of the budget, then the most attention received from recent queries."""

    name = "epikv2"
    protects_prompt = False
    uses_recent = False
    OPTIONS: ClassVar[dict[str, type]] = {"sinks": int, "recent": float, "period": int, "decay": float, "prompt": str, "signal": str}

    def __init__(
        self, budget: int, sinks: int = 4, recent: float = 0.75, period: int = 16, decay: float = 1.0, prompt: str = "score",
        signal: str = "attention",
    ) -> None:
        if (sinks < 0 or period < 1 or not 0 < decay <= 1 or recent < 0 or prompt not in ("score", "keep")
                or signal not in ("attention", "epiphany", "none")):
            raise UsageError(
                "epikv2 options: sinks >= 0, period >= 1, 0 < decay <= 1, recent >= 0 (a share of K below 1, else tokens), "
                "prompt score|keep, signal attention|epiphany|none"
            )
        self.sinks = sinks
        self.recent_share = recent
        self.recent = self.recent_for(budget)
        self.period = period
        self.decay = decay
        self.keep_prompt = prompt == "keep"
        self.signal = signal
        self.attention_needs = AttentionNeeds(queries=period) if signal == "attention" else None
        self.epiphany = EpiKV(recent=0) if signal == "epiphany" else None
        self.received = ScoreBook()
        self._decode_steps = 0
        self.candidates = CandidateHeap(unscored=0.0)
        self._stale = True  # scores changed since the heap was built

    def setup(self, num_layers: int, calibration=None) -> None:
        if self.epiphany is not None:
            self.epiphany.setup(num_layers, calibration)

    def tap_layers(self) -> list[int]:
        return self.epiphany.tap_layers() if self.epiphany is not None else []

    @classmethod
    def from_settings(cls, settings: CacheSettings) -> EpiKV2:
        return cls(settings.budget or 0, **cls.options_from(settings))

    def observe(self, signals: Signals) -> None:
        """At the prefill and every ``period`` steps: add the stored queries' attention to each token's score."""
        if self.signal != "attention":
            if self.epiphany is not None:
                self.epiphany.observe(signals)
            return
        if not signals.prompt:
            self._decode_steps += 1
            if self._decode_steps % self.period:
                return
        cache, record = signals.cache, signals.attention
        positions = cache.live_positions()
        seen = cache.seen
        total = None
        for index, layer in zip(cache.budget_layer_indices, cache.budget_layers):
            queries = record.queries[index]
            query_positions = torch.arange(seen - queries.shape[1], seen)
            part = received_attention(queries, layer.live()[0][0], query_positions, positions).cpu()
            total = part if total is None else total + part
        self.credit(positions, total / len(cache.budget_layers))

    def credit(self, positions: torch.Tensor, received: torch.Tensor) -> None:
        """Decay the scores of ``positions`` ``[n]``, then add ``received`` ``[n]`` to them (a refresh)."""
        if self.decay < 1:
            current = self.received.gather(positions)
            self.received.add(positions, torch.nan_to_num(current, nan=0.0) * (self.decay - 1))
        self.received.add(positions, received)
        self._stale = True

    def recent_for(self, budget: int) -> int:
        """The recent window under a budget of ``budget`` tokens (a share of K below 1, else tokens)."""
        return int(round(self.recent_share * budget)) if self.recent_share < 1 else int(self.recent_share)

    def min_budget(self, prompt_len: int) -> int:
        """Smallest K that holds the sinks, the recent share of K (and the prompt with prompt=keep) and one more.

        K - recent(K) never decreases as K grows, so iterating from below reaches the smallest fixed point.
        """
        floor = self.sinks + (prompt_len if self.keep_prompt else 0) + 1
        budget = floor
        while budget < (needed := floor + self.recent_for(budget)):
            budget = needed
        return budget

    def budget_advice(self, prompt_len: int, budget: int, needed: int) -> str:
        what = f"{self.sinks} sink tokens and a {self.recent_for(needed)}-token recent window"
        if self.keep_prompt:
            what += f" and the {prompt_len}-token prompt"
        return f"--budget {budget} is too small for epikv2, which keeps {what}; use --budget {needed} or more"

    def select(self, cache: BudgetCache, count: int) -> list[int]:
        """The ``count`` lowest scores among the evictable tokens (unscored counts as 0; ties: the older).

        Between refreshes scores are frozen and one token leaves the recent window per step, so the
        candidates wait in a heap; a refresh rebuilds it from the live tokens' new scores.
        """
        book = self.epiphany.book if self.epiphany is not None else self.received
        floor = max(self.sinks, cache.prompt_len if self.keep_prompt else 0)
        end = cache.seen - self.recent
        if self._stale:
            self.candidates.rebuild(book, cache.live_positions(), floor, end)
            self._stale = False
        else:
            self.candidates.admit(book, floor, end)
        return cache.slots_of(self.candidates.pop(count))
