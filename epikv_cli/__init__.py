"""epikv: long-reasoning generation under a fixed KV-cache budget (EpiKV eviction)."""

from .cache import BudgetCache
from .session import EpiKVSession, attach

__version__ = "0.1.0"

__all__ = ["attach", "BudgetCache", "EpiKVSession", "__version__"]
