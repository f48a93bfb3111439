"""Settings dataclasses, validated on construction.

Every check raises :class:`~epikv_cli.errors.UsageError` with a message fit for one line on stderr.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .errors import UsageError

POSITION_MODES = ("logical", "compressed")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTN_CHOICES = ("auto", "sdpa", "eager", "flash_attention_2")

#: Paper defaults (METHOD.md): z-score window, its epsilon, recent-window cap.
ZSCORE_WINDOW = 64
ZSCORE_EPS = 1e-6
RECENT_CAP = 128

_BAND = re.compile(r"^\s*(\d+)\s*:\s*([+-]?\d+(?:\.\d+)?)\s*$")


def parse_bands(text: str) -> tuple[tuple[int, float], ...]:
    """Parse ``"10:+1,21:-1"`` into ``((10, 1.0), (21, -1.0))``.

    Each band is ``LAYER:SIGN``: a 0-based decoder-block index and the weight of its z-score
    (normally +1 or -1).
    """
    if not text or not text.strip():
        raise UsageError("--bands is empty; give LAYER:SIGN pairs such as --bands 10:+1,21:-1")
    bands = []
    for part in text.split(","):
        match = _BAND.match(part)
        if match is None:
            raise UsageError(
                f"--bands: cannot read {part.strip()!r}; each band is LAYER:SIGN, e.g. --bands 10:+1,21:-1"
            )
        sign = float(match.group(2))
        if sign == 0:
            raise UsageError(f"--bands: band {part.strip()!r} has weight 0; use +1 or -1")
        bands.append((int(match.group(1)), sign))
    layers = [layer for layer, _ in bands]
    if len(set(layers)) != len(layers):
        raise UsageError(f"--bands: layer listed twice in {text!r}; give each layer once")
    return tuple(bands)


def default_recent(budget: int) -> int:
    """The recent window R = min(128, K // 4) of METHOD.md."""
    return min(RECENT_CAP, budget // 4)


@dataclass(frozen=True)
class CacheSettings:
    """How the KV cache is bounded and which policy evicts.

    Attributes:
        budget: K, the most entries an evicting layer holds after each step (prompt included);
            ``None`` means unbounded (policy ``full``).
        policy: a name from :data:`epikv_cli.policies.POLICIES`.
        recent: R, generated tokens always kept; ``None`` means ``min(128, K // 4)``.
        bands: ``(layer, sign)`` pairs for ``epikv``; ``None`` means the depth-fraction default.
        positions: ``logical`` (true absolute index) or ``compressed`` (next position = stored length,
            the paper-time harness).
        seed: seed for policies that draw at random.
    """

    budget: int | None = 4096
    policy: str = "epikv"
    recent: int | None = None
    bands: tuple[tuple[int, float], ...] | None = None
    positions: str = "logical"
    seed: int = 0

    def __post_init__(self) -> None:
        from .policies import POLICIES  # late import: policies import settings

        if self.policy not in POLICIES:
            raise UsageError(
                f"unknown policy {self.policy!r}; choose one of: {', '.join(sorted(POLICIES))}"
            )
        if self.budget is not None and self.budget < 1:
            raise UsageError(f"--budget must be a positive number of tokens, got {self.budget}")
        if self.budget is None and POLICIES[self.policy].evicts:
            raise UsageError(f"policy {self.policy!r} needs a --budget")
        if self.recent is not None and self.recent < 0:
            raise UsageError(f"--recent must be 0 or more, got {self.recent}")
        if self.positions not in POSITION_MODES:
            raise UsageError(
                f"--positions must be one of {', '.join(POSITION_MODES)}, got {self.positions!r}"
            )
        if self.bands is not None and self.policy != "epikv":
            raise UsageError(f"--bands only applies to policy 'epikv', not {self.policy!r}")

    @property
    def recent_window(self) -> int:
        """R for this budget (0 without a budget)."""
        if self.recent is not None:
            return self.recent
        return default_recent(self.budget) if self.budget is not None else 0


@dataclass(frozen=True)
class SamplingSettings:
    """Decoding settings; ``temperature == 0`` is greedy."""

    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise UsageError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise UsageError(f"--temperature must be 0 (greedy) or more, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UsageError(f"--top-k must be 0 (off) or more, got {self.top_k}")
        if self.temperature == 0 and (self.top_k or self.top_p < 1.0):
            raise UsageError("--top-k and --top-p only apply when sampling; add --temperature (e.g. 0.7)")
        if any(s == "" for s in self.stop):
            raise UsageError("--stop got an empty string; give the text that should end generation")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class ModelSettings:
    """Which model to load and how to place it.

    Attributes:
        model: a local directory, a ``.gguf`` file, a Hub id, or ``None`` for the demo model.
        device_map: passed to Accelerate (``auto``, ``cpu``, ``cuda``, ``cuda:1``, ...).
        dtype: ``auto`` keeps the checkpoint's dtype.
        attn: ``auto`` picks flash_attention_2 when installed on CUDA, else sdpa.
    """

    model: str | None = None
    device_map: str = "auto"
    dtype: str = "auto"
    attn: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.attn not in ATTN_CHOICES:
            raise UsageError(f"--attn must be one of {', '.join(ATTN_CHOICES)}, got {self.attn!r}")
        if self.model is not None and not self.model.strip():
            raise UsageError("--model is empty; give a directory, a .gguf file or a Hub id")


@dataclass(frozen=True)
class PromptSettings:
    """How a prompt becomes token ids."""

    system: str | None = None
    chat_template: bool = True
