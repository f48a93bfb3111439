"""Eviction policies: one file each, one registry.

``POLICIES`` maps the ``--policy`` name to its class; :func:`make_policy` builds one from settings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Policy
from .baselines import FullCache, RandomEviction, Streaming
from .epikv import EpiKV
from .lagkv import LagKV

if TYPE_CHECKING:
    from ..settings import CacheSettings

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (EpiKV, LagKV, Streaming, RandomEviction, FullCache)
}


def make_policy(settings: CacheSettings) -> Policy:
    """The policy named by ``settings.policy``, configured from ``settings``."""
    policy = POLICIES[settings.policy].from_settings(settings)
    policy.recent_follows_budget = policy.uses_recent and settings.recent is None
    return policy


__all__ = ["POLICIES", "Policy", "make_policy", "EpiKV", "LagKV", "Streaming", "RandomEviction", "FullCache"]
