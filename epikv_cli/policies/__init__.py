"""Eviction policies: one file each, one registry.

``POLICIES`` maps the ``--policy`` name to its class; :func:`make_policy` builds one from settings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Policy
from .baselines import FullCache, RandomEviction, Streaming
from .epikv import EpiKV
from .epikv2 import EpiKV2
from .h2o import H2O
from .knorm import KeyNorm
from .lagkv import LagKV
from .rkv import RKV
from .tova import TOVA

if TYPE_CHECKING:
    from ..settings import CacheSettings

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (EpiKV, EpiKV2, LagKV, Streaming, RandomEviction, FullCache, H2O, TOVA, RKV, KeyNorm)
}


def parse_policy_spec(text: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """``"epikv2:period=32:decay=0.9"`` -> ``("epikv2", (("period", "32"), ("decay", "0.9")))``."""
    from ..errors import UsageError

    name, *pairs = text.strip().split(":")
    if name not in POLICIES:
        raise UsageError(f"unknown policy {name!r}; choose from: {', '.join(sorted(POLICIES))}")
    options = []
    for pair in pairs:
        key, equals, value = pair.partition("=")
        if not equals or not key or not value:
            raise UsageError(f"policy option {pair!r} in {text.strip()!r} is not KEY=VALUE")
        options.append((key, value))
    return name, tuple(options)


def make_policy(settings: CacheSettings) -> Policy:
    """The policy named by ``settings.policy``, configured from ``settings``."""
    policy = POLICIES[settings.policy].from_settings(settings)
    policy.recent_follows_budget = policy.uses_recent and settings.recent is None
    return policy


__all__ = [
    "POLICIES", "Policy", "make_policy", "parse_policy_spec", "EpiKV", "EpiKV2", "LagKV", "Streaming", "RandomEviction", "FullCache", "H2O", "TOVA",
    "RKV", "KeyNorm",
]
