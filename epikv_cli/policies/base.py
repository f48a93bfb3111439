"""What every eviction policy provides: its options, its eight hooks, and the keep rules most of them share.

A policy module imports only this module, :mod:`epikv_cli.core.view` and torch (and the helpers beside it in
``policies/``): what it needs from the lower layers (the attention it may ask for, the error it raises, the
limits on numbers) is re-exported here.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from epikv_cli.config import MAX_TOKENS
from epikv_cli.core.attention import AttentionNeeds, AttentionRecord
from epikv_cli.core.hostread import host_copies
from epikv_cli.core.scratch import Scratch
from epikv_cli.errors import UsageError

if TYPE_CHECKING:
    from epikv_cli.config import CacheSettings
    from epikv_cli.core.view import CacheView, Moves, Victims

__all__ = [
    "MAX_TOKENS",
    "AttentionNeeds",
    "AttentionRecord",
    "BudgetFloor",
    "Policy",
    "PolicyOptions",
    "Scratch",
    "Signals",
    "UsageError",
    "evictable_mask",
    "lowest",
    "method_recent",
    "recent_window",
    "setting",
]

#: The recent window's cap in METHOD.md: R = min(128, K // 4).
RECENT_CAP = 128


def method_recent(budget: int) -> int:
    """The recent window R = min(128, K // 4) of METHOD.md."""
    return min(RECENT_CAP, budget // 4)


def recent_window(budget: int, recent: float | None, default: Callable[[int], int] = method_recent) -> int:
    """R under a budget of K = ``budget`` tokens: the one place the recent-window rule lives.

    ``recent``: a number of tokens (``--recent``), or, below 1, a share of K (epikv2's ``recent=0.75``); None:
    ``default(K)``, METHOD.md's ``min(128, K // 4)`` unless the policy names its own.
    """
    if recent is None:
        return default(budget)
    return int(round(recent * budget)) if 0 < recent < 1 else int(recent)


def setting(name: str, default: object = None, option: bool = False):
    """An options field filled from the cache settings' ``name`` (``budget``, ``recent``, ``seed``, ``bands``) when
    they set it. ``option``: it may also be given as ``KEY=VALUE`` (epikv2's ``recent``)."""
    return field(default=default, metadata={"setting": name, "option": option})


@dataclass(frozen=True)
class PolicyOptions:
    """A policy's options: a frozen dataclass each policy extends with its own fields and checks (in its
    ``__post_init__``, raising :class:`UsageError`).

    Fields made with :func:`setting` come from the cache settings (``--budget``, ``--recent``, ``--seed``); every
    other field is an option, given as ``--policies NAME:KEY=VALUE`` or ``--policy-option KEY=VALUE`` and converted
    to the field's type.
    """

    budget: int | None = setting("budget")
    recent: int | None = setting("recent")
    seed: int = setting("seed", 0)

    @classmethod
    def option_names(cls) -> list[str]:
        """The ``KEY=VALUE`` options, in declaration order."""
        return [f.name for f in dataclasses.fields(cls) if "setting" not in f.metadata or f.metadata["option"]]

    @classmethod
    def from_settings(cls, policy: str, settings: CacheSettings) -> PolicyOptions:
        """The options ``settings`` give policy ``policy``; :class:`UsageError` for an unknown key or a value of the
        wrong kind (the dataclass's own checks follow)."""
        types_of = typing.get_type_hints(cls)
        values: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            if "setting" in f.metadata and getattr(settings, f.metadata["setting"]) is not None:
                values[f.name] = getattr(settings, f.metadata["setting"])
        names = cls.option_names()
        for key, text in settings.options:
            if key not in names:
                raise UsageError(f"policy {policy!r} has no option {key!r} (its options: {', '.join(names) or 'none'})")
            values[key] = _converted(policy, key, text, types_of[key])
        return cls(**values)


def _converted(policy: str, key: str, text: str, kind: object) -> object:
    """``text`` as a value of ``kind`` (``int``, ``float``, ``str``, or one of them ``| None``)."""
    if isinstance(kind, types.UnionType):
        kind = next(k for k in typing.get_args(kind) if k is not type(None))
    try:
        return kind(text)
    except ValueError:
        what = {int: "a whole number", float: "a number"}.get(kind, "text")
        raise UsageError(f"policy {policy!r}: option {key}={text!r} must be {what}") from None


@dataclass(frozen=True)
class BudgetFloor:
    """The smallest budget a policy can run under, and what fills it (for the message when a budget is below it).

    Attributes:
        tokens: the smallest K.
        keeps: what the policy always keeps, as words ("4 sink tokens and a 3-token recent window").
        advice: what else the user may change, appended to "use --budget N or more" (", or a smaller --recent").
    """

    tokens: int
    keeps: str
    advice: str = ""


@dataclass
class Signals:
    """What one forward shows a policy, before anything is evicted.

    Attributes:
        appended: logical positions of the tokens this forward appended (``q`` of them).
        prompt: True for the prefill.
        hidden: block index -> that block's output ``[1, q, hidden]`` (the layers of :meth:`Policy.tap_layers`).
        attention: what :attr:`Policy.attention_needs` asked for, per evicting layer (slot-indexed).
        cache: the cache, the new tokens in its last ``q`` live slots.
    """

    appended: range
    prompt: bool
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    attention: AttentionRecord | None = None
    cache: CacheView | None = None

    def new_slots(self) -> slice:
        """The cache slots holding the appended tokens (always a contiguous run: the free slot, or the end)."""
        start = self.cache.slots_of([self.appended.start])[0]
        return slice(start, start + len(self.appended))


class Policy(ABC):
    """Turns signals from the forward pass into the slots to evict. It knows its cache only as a
    :class:`~epikv_cli.core.view.CacheView`, whichever engine holds it.

    Hooks (the runtime calls them in this order; :mod:`epikv_cli.runtime.step`): :meth:`setup` once,
    :meth:`tap_layers` once; per forward :meth:`stage` (on the device), :meth:`settle` (with the host copies of what
    stage returned, read together with the sampled tokens), :meth:`select` when over the budget, :meth:`follow`
    when the cache moved entries; :meth:`budget_floor` before a prompt; :meth:`report` at the end.

    Class attributes:
        name: the registry key (``--policy``).
        Options: its options dataclass (a :class:`PolicyOptions`).
        evicts: False for the unbounded ``full`` cache.
        protects_prompt: True when prompt tokens and the recent window are never evicted.
        takes_recent: True when the policy keeps a recent window, so that ``--recent`` sets it.
        attention_needs: what the policy reads from attention (None: nothing, it runs on any kernel).
        slack: entries the cache may hold beyond K between evictions (R-KV compresses in batches).
        spikes: True when :attr:`scores` are epiphany scores, whose spikes the panel draws.

    Instance attributes:
        options: its options.
        recent: R, the recent window in force (0 without one).
        granular: True when the policy keeps its own set per evicting layer and KV head: it reads
            ``cache.head_slots`` and :meth:`select` returns :class:`~epikv_cli.core.view.HeadVictims`.
        scores: the frozen per-token scores (``.get(position)``), or None when the policy keeps none.
    """

    name: ClassVar[str]
    Options: ClassVar[type[PolicyOptions]] = PolicyOptions
    evicts: ClassVar[bool] = True
    protects_prompt: ClassVar[bool] = True
    takes_recent: ClassVar[bool] = True
    attention_needs: ClassVar[AttentionNeeds | None] = None
    slack: ClassVar[int] = 0
    spikes: ClassVar[bool] = False
    #: the recent window when ``--recent`` is not given (K -> R)
    default_recent: ClassVar[Callable[[int], int]] = staticmethod(method_recent)
    granular: bool = False
    scores = None

    def __init__(self, options: PolicyOptions | None = None, **values: object) -> None:
        """Under ``options``, or ``Options(**values)`` (e.g. ``H2O(budget=64)``; checked the same way)."""
        self.options = dataclasses.replace(options, **values) if options is not None else self.Options(**values)
        self.recent = self.recent_for(self.options.budget or 0) if self.takes_recent else 0

    @classmethod
    def from_settings(cls, settings: CacheSettings) -> Policy:
        """The policy under ``settings`` (its options checked by its own :attr:`Options`)."""
        return cls(cls.Options.from_settings(cls.name, settings))

    def recent_for(self, budget: int) -> int:
        """R under a budget of ``budget`` tokens (the default window grows with K); see :func:`recent_window`."""
        return recent_window(budget, self.options.recent, type(self).default_recent)

    def min_budget(self, prompt_len: int) -> int:
        """The smallest K a ``prompt_len``-token prompt can run under."""
        return self.budget_floor(prompt_len).tokens

    def check_budget(self, prompt_len: int, budget: int | None) -> None:
        """Raise :class:`UsageError` when ``budget`` is below :meth:`budget_floor`."""
        if budget is None or not self.evicts:
            return
        floor = self.budget_floor(prompt_len)
        if budget < floor.tokens:
            raise UsageError(
                f"--budget {budget} is too small for {self.name}, which keeps {floor.keeps}; "
                f"use --budget {floor.tokens} or more{floor.advice}"
            )

    def observe(self, signals: Signals) -> None:
        """:meth:`stage` and :meth:`settle` at once, with a host read of its own (tools and tests; the runtime
        reads the staged tensors together with the sampled tokens instead)."""
        self.settle(signals, host_copies(self.stage(signals)))

    def score_of(self, position: int) -> float | None:
        """The frozen score of the token at ``position``, if this policy keeps one."""
        return self.scores.get(position) if self.scores is not None else None

    # -- the hooks ---------------------------------------------------------------------------------
    def setup(self, num_layers: int, calibration=None) -> None:
        """Resolve anything that depends on the model (called once, before the first forward).

        ``calibration`` is the model's saved :class:`~epikv_cli.models.calibration.Calibration`, if any.
        """

    def tap_layers(self) -> list[int]:
        """Decoder blocks whose outputs :meth:`stage` reads in ``signals.hidden``."""
        return []

    def stage(self, signals: Signals) -> list[torch.Tensor]:
        """See one forward, on the device (the cache is not yet within budget); return the few tensors
        :meth:`settle` needs on the host (the runtime reads them with the sampled tokens: one read a step)."""
        return []

    def settle(self, signals: Signals, values: list[torch.Tensor]) -> None:
        """The host half: ``values`` are CPU float64 copies of what :meth:`stage` returned."""

    @abstractmethod
    def select(self, cache: CacheView, count: int) -> Victims:
        """Return ``count`` live slots of ``cache`` to evict (a granular policy: ``count`` per layer and head)."""

    def follow(self, moves: Moves) -> None:
        """The cache moved entries (:class:`~epikv_cli.core.view.Moves`): slot-indexed state must follow."""

    def budget_floor(self, prompt_len: int) -> BudgetFloor:
        """Smallest K with K > prompt + R(K): room for the prompt, the recent window and one new token.

        K - R(K) never decreases as K grows, so iterating K <- prompt + R(K) + 1 from below climbs to
        the smallest fixed point without overshooting it.
        """
        budget = prompt_len + 1
        while budget < (needed := prompt_len + self.recent_for(budget) + 1):
            budget = needed
        window = f"a recent window ({self.recent_for(budget)} tokens at K = {budget})"
        return BudgetFloor(
            budget,
            f"the {prompt_len}-token prompt, {window} and one new token",
            ", a shorter prompt, or a smaller --recent",
        )

    def report(self) -> dict:
        """What this policy says of its run, for results and ``--json`` (``policy_report``); JSON types only."""
        return {}


def evictable_mask(positions: torch.Tensor, prompt_len: int, seen: int, recent: int) -> torch.Tensor:
    """``[n]`` bool: generated tokens outside the recent window (the last ``recent`` generated tokens).

    Args:
        positions: ``[n]`` logical positions of the live slots.
        prompt_len: prompt tokens, always kept.
        seen: logical length (prompt + generated so far).
        recent: R.
    """
    return (positions >= prompt_len) & (positions < seen - recent)


def lowest(scores: torch.Tensor, positions: torch.Tensor, candidates: torch.Tensor, count: int) -> list[int]:
    """Slots of the ``count`` lowest ``scores`` among ``candidates``; ties go to the older token.

    Args:
        scores: ``[n]`` per-slot scores.
        positions: ``[n]`` logical positions (the tie-break).
        candidates: ``[n]`` bool mask of evictable slots.
        count: how many to return; at most ``candidates.sum()``.
    """
    slots = torch.nonzero(candidates, as_tuple=True)[0]
    if count > slots.numel():
        raise RuntimeError(f"asked to evict {count} tokens but only {slots.numel()} are evictable")
    by_position = slots[torch.argsort(positions[slots], stable=True)]
    by_score = by_position[torch.argsort(scores[by_position], stable=True)]
    return by_score[:count].tolist()
