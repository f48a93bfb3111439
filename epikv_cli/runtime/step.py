"""The decode step's policy half, the same for one sequence and for every row of a batch.

After a forward has appended tokens to a cache:

1. :func:`observe`: the policy sees what the forward showed (:class:`~epikv_cli.policies.base.Signals`) on the
   device (:meth:`~epikv_cli.policies.base.Policy.stage`) and returns the few tensors it needs on the host;
2. the runtime reads those tensors together with the sampled tokens (one device-to-host copy per step);
3. :func:`choose`: the policy gets its host values (:meth:`~epikv_cli.policies.base.Policy.settle`), and, when the
   cache is over its budget, names the victims;
4. the cache evicts them (:meth:`BudgetCache.evict <epikv_cli.core.cache.BudgetCache.evict>` or
   :meth:`RowsCache.evict <epikv_cli.core.rows.RowsCache.evict>`) and :func:`follow` lets the policy's slot-indexed
   state follow any entries the cache moved.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from epikv_cli.core.view import CacheView, Moves, Victims
from epikv_cli.policies.base import Policy, Signals


@dataclass
class Observed:
    """A forward the policy has seen: its signals and the device tensors it needs on the host (``reads``)."""

    signals: Signals
    reads: list[torch.Tensor] = field(default_factory=list)


def observe(policy: Policy, signals: Signals) -> Observed:
    """Step 1: the policy sees the forward on the device."""
    return Observed(signals, policy.stage(signals))


def over_budget(view: CacheView) -> int:
    """How many entries must leave ``view`` to be back within its budget (0 when within it, or unbounded)."""
    return 0 if view.budget is None else max(0, view.stored - view.budget)


def choose(policy: Policy, observed: Observed, values: list[torch.Tensor], view: CacheView) -> Victims:
    """Step 3: the policy gets ``values`` (CPU copies of ``observed.reads``), then names what leaves ``view``."""
    policy.settle(observed.signals, values)
    over = over_budget(view)
    return policy.select(view, over) if over else []


def follow(policy: Policy, moves: Moves) -> None:
    """Step 4: the cache moved entries (shared: slot ``movers[i]`` into ``holes[i]``; per head: each one's last
    entry into its victim's slot); the policy's slot-indexed state follows."""
    if moves.holes or moves.head_victims is not None:
        policy.follow(moves)
