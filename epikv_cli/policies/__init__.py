"""Eviction policies: one file each, one registry.

``POLICIES`` maps the ``--policy`` name to its class; :func:`make_policy` builds one from settings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Policy
from .baselines import FullCache, RandomEviction, Streaming
from .epikv import EpiKV
from .h2o import H2O
from .knorm import KeyNorm
from .lagkv import LagKV
from .rkv import RKV
from .tova import TOVA

if TYPE_CHECKING:
    from ..settings import CacheSettings

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (EpiKV, LagKV, Streaming, RandomEviction, FullCache, H2O, TOVA, RKV, KeyNorm)
}


def make_policy(settings: CacheSettings) -> Policy:
    """The policy named by ``settings.policy``, configured from ``settings``."""
    policy = POLICIES[settings.policy].from_settings(settings)
    policy.recent_follows_budget = policy.uses_recent and settings.recent is None
    return policy


__all__ = [
    "POLICIES", "Policy", "make_policy", "EpiKV", "LagKV", "Streaming", "RandomEviction", "FullCache", "H2O", "TOVA",
    "RKV", "KeyNorm",
]
