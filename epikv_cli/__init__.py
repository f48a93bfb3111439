"""epikv: long-reasoning generation under a fixed KV-cache budget (EpiKV eviction).

The package imports nothing heavy at first: ``attach``, ``BudgetCache`` and ``EpiKVSession`` load
torch and transformers when first used, so that the ``epikv`` command can start (and be interrupted)
before those imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["attach", "policy_of", "BudgetCache", "EpiKVSession", "__version__"]

_LAZY = {
    "attach": "runtime.attach",
    "policy_of": "runtime.session",
    "EpiKVSession": "runtime.session",
    "BudgetCache": "core.cache",
}

if TYPE_CHECKING:
    from epikv_cli.core.cache import BudgetCache
    from epikv_cli.runtime.attach import attach
    from epikv_cli.runtime.session import EpiKVSession, policy_of


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
