"""The policy registry: ``POLICIES`` maps the ``--policy`` name to its class; :func:`make_policy` builds one.

Settings know no policy names: :func:`check_settings` is where a :class:`~epikv_cli.config.CacheSettings` is
checked against its policy (name, budget, recent window, bands, options), before any model loads.
"""

from __future__ import annotations

import dataclasses
import importlib

from epikv_cli.config import CacheSettings
from epikv_cli.errors import UsageError
from epikv_cli.policies.base import Policy
from epikv_cli.policies.catalog import REGISTERED


def _policy_class(name: str, target: str) -> type[Policy]:
    module, _, attribute = target.partition(":")
    cls = getattr(importlib.import_module(module), attribute)
    if cls.name != name:
        raise RuntimeError(f"the catalog registers {target} as {name!r}, but its name is {cls.name!r}")
    return cls


#: ``--policy`` name -> class, for every policy of :data:`~epikv_cli.policies.catalog.REGISTERED`.
POLICIES: dict[str, type[Policy]] = {name: _policy_class(name, target) for name, target in REGISTERED.items()}


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


def evicts(name: str) -> bool:
    """Whether the policy named ``name`` (a registered name) bounds the cache: ``full`` does not."""
    return POLICIES[name].evicts


def recent_window_policies() -> list[str]:
    """Names of the policies that take ``--recent``, sorted."""
    return sorted(name for name, cls in POLICIES.items() if cls.takes_recent)


def takes_setting(name: str, setting: str) -> bool:
    """Whether policy ``name``'s options take the cache setting ``setting`` (``bands``: ``--bands``)."""
    return any(f.metadata.get("setting") == setting for f in dataclasses.fields(POLICIES[name].Options))


def check_settings(settings: CacheSettings) -> CacheSettings:
    """``settings``, or :class:`UsageError` for what they ask of their policy that it cannot do: an unknown
    name, no budget for a policy that evicts, a recent window or bands it does not take, options it refuses."""
    if settings.policy not in POLICIES:
        raise UsageError(f"unknown policy {settings.policy!r}; choose one of: {', '.join(sorted(POLICIES))}")
    cls = POLICIES[settings.policy]
    if settings.budget is None and cls.evicts:
        raise UsageError(f"policy {settings.policy!r} needs a --budget")
    if settings.recent is not None and not cls.takes_recent:
        raise UsageError(
            f"--recent does not apply to policy {settings.policy!r} (it keeps no separate recent window); "
            f"drop --recent or choose one of: {', '.join(recent_window_policies())}"
        )
    if settings.bands is not None and not takes_setting(settings.policy, "bands"):
        takers = " or ".join(repr(name) for name in sorted(POLICIES) if takes_setting(name, "bands"))
        raise UsageError(f"--bands only applies to policy {takers}, not {settings.policy!r}")
    cls.Options.from_settings(cls.name, settings)  # unknown, malformed or out-of-range options fail here
    return settings


def make_policy(settings: CacheSettings) -> Policy:
    """The policy named by ``settings.policy``, configured from ``settings``."""
    check_settings(settings)
    return POLICIES[settings.policy].from_settings(settings)
