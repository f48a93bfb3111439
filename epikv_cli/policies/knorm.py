"""Key norm (Devoto et al., arXiv 2406.11430; kvpress's KnormPress): keys with a small L2 norm draw
the most attention, so the tokens whose keys are largest leave first.

Score of a token = minus the L2 norm of its key, averaged over KV heads and evicting layers, computed
once when the token is appended (cached keys never change). Attention-free; same protection as
EpiKV-Flat (prompt and recent window kept).
"""

from __future__ import annotations

import torch

from epikv_cli.policies.base import Signals
from epikv_cli.policies.keep_scored import ScoredPolicy


class KeyNorm(ScoredPolicy):
    """Evict the largest mean key norm."""

    name = "knorm"

    def stage(self, signals: Signals) -> list[torch.Tensor]:
        """Minus the appended keys' L2 norms, mean over KV heads and evicting layers: ``[q]`` on the device."""
        cache, slots = signals.cache, signals.new_slots()
        layers = range(len(cache.evicting_layers))
        norms = [cache.layer_kv(j)[0][0, :, slots].float().norm(dim=-1).mean(dim=0) for j in layers]
        return [-torch.stack([n.to(norms[0].device) for n in norms]).mean(dim=0)]

    def settle(self, signals: Signals, values: list[torch.Tensor]) -> None:
        for position, score in zip(signals.appended, values[0].tolist()):
            self.record_score(position, score)
