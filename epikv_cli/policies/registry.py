"""The policy registry: ``POLICIES`` maps the ``--policy`` name to its class; :func:`make_policy` builds one.

Settings know no policy names: :func:`check_settings` is where a :class:`~epikv_cli.config.CacheSettings` is
checked against its policy (name, budget, recent window, bands, options), before any model loads.
"""

from __future__ import annotations

from epikv_cli.config import CacheSettings
from epikv_cli.errors import UsageError
from epikv_cli.policies.base import Policy
from epikv_cli.policies.baselines import FullCache, RandomEviction, Streaming
from epikv_cli.policies.epikv import EpiKV
from epikv_cli.policies.epikv2 import EpiKV2
from epikv_cli.policies.h2o import H2O
from epikv_cli.policies.knorm import KeyNorm
from epikv_cli.policies.lagkv import LagKV
from epikv_cli.policies.rkv import RKV
from epikv_cli.policies.tova import TOVA

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (EpiKV, EpiKV2, LagKV, Streaming, RandomEviction, FullCache, H2O, TOVA, RKV, KeyNorm)
}


def parse_policy_spec(text: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """``"epikv2:period=32:decay=0.9"`` -> ``("epikv2", (("period", "32"), ("decay", "0.9")))``."""
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


def recent_window_policies() -> list[str]:
    """Names of the policies that take ``--recent``, sorted."""
    return sorted(name for name, cls in POLICIES.items() if cls.takes_recent())


def check_settings(settings: CacheSettings) -> CacheSettings:
    """``settings``, or :class:`UsageError` for what they ask of their policy that it cannot do: an unknown
    name, no budget for a policy that evicts, a recent window or bands it does not take, options it refuses."""
    if settings.policy not in POLICIES:
        raise UsageError(f"unknown policy {settings.policy!r}; choose one of: {', '.join(sorted(POLICIES))}")
    cls = POLICIES[settings.policy]
    if settings.budget is None and cls.evicts:
        raise UsageError(f"policy {settings.policy!r} needs a --budget")
    if settings.recent is not None and not cls.takes_recent():
        raise UsageError(
            f"--recent does not apply to policy {settings.policy!r} (it keeps no separate recent window); "
            f"drop --recent or choose one of: {', '.join(recent_window_policies())}"
        )
    if settings.bands is not None and settings.policy != "epikv":
        raise UsageError(f"--bands only applies to policy 'epikv', not {settings.policy!r}")
    if settings.options or settings.recent is not None:
        cls.from_settings(settings)  # unknown, malformed or out-of-range options fail here, before any model loads
    return settings


def make_policy(settings: CacheSettings) -> Policy:
    """The policy named by ``settings.policy``, configured from ``settings``."""
    check_settings(settings)
    policy = POLICIES[settings.policy].from_settings(settings)
    policy.recent_follows_budget = policy.uses_recent and settings.recent is None
    return policy
