"""Settings dataclasses, validated on construction.

Every check raises :class:`~epikv_cli.errors.UsageError` with a message fit for one line on stderr.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass, field

from epikv_cli.errors import UsageError

#: The policy used when none is named: by the CLI, CacheSettings, attach(), profile, fidelity and eval.
DEFAULT_POLICY = "epikv2"
POSITION_MODES = ("logical", "compressed")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTN_CHOICES = ("auto", "sdpa", "eager", "flash_attention_2")
#: Accelerate's placement strategies; a device (``cpu``, ``cuda``, ``cuda:N``, ``mps``, a GPU index) works too.
PLACEMENTS = ("auto", "balanced", "balanced_low_0", "sequential")
#: What shell completion offers for ``--device-map``.
DEVICE_MAP_NAMES = PLACEMENTS + ("cpu", "cuda", "mps")
_DEVICE = re.compile(r"^(cpu|cuda|mps|xpu|npu)(:(\d+))?$|^(\d+)$")
#: Temperatures below this decode greedily, as in vLLM: dividing logits by a smaller one overflows
#: float32 (1e-40 gives inf, then NaN probabilities), and the distribution is one-hot anyway.
GREEDY_BELOW = 1e-5
#: torch generators take seeds from 0 to 2**64 - 1.
MAX_SEED = 2**64 - 1
#: The largest K accepted: positions and slot counts are int64 tensors (a K beyond any sequence
#: simply never evicts; policy ``full`` says so directly).
MAX_BUDGET = 2**62
#: The largest token count a recent window or a policy option may name: no model holds 2**31 tokens.
MAX_TOKENS = 2**31 - 1


_BAND = re.compile(r"^\s*(\d+)\s*:\s*([+-]?\d+(?:\.\d+)?)\s*$")


def parse_bands(text: str) -> tuple[tuple[int, float], ...]:
    """Parse ``"10:+1,21:-1"`` into ``((10, 1.0), (21, -1.0))``.

    Each band is ``LAYER:SIGN``: a 0-based decoder-block index and the sign of its z-score in the
    score, +1 (a large change keeps the token) or -1 (a large change lets it go).
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
        if sign not in (1.0, -1.0):
            raise UsageError(f"--bands: band {part.strip()!r} has sign {match.group(2)}; each SIGN is +1 or -1")
        bands.append((int(match.group(1)), sign))
    layers = [layer for layer, _ in bands]
    if len(set(layers)) != len(layers):
        raise UsageError(f"--bands: layer listed twice in {text!r}; give each layer once")
    return tuple(bands)


def list_items(text: str, option: str) -> list[str]:
    """The comma-separated items of ``text``, stripped (``[]`` when it holds none); an empty item between
    commas (``a,,b``, ``a,``) is refused, as a typo that would otherwise drop something silently."""
    items = [part.strip() for part in text.split(",")]
    if not any(items):
        return []
    if not all(items):
        raise UsageError(f"{option} {text!r} has an empty item; separate the items with single commas")
    return items


def whole_number(option: str, value) -> int:
    """``value`` as an int (anything ``operator.index`` takes, bools excepted), or :class:`UsageError`."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise UsageError(f"{option} must be a whole number, got {value!r}") from None


def checked_bands(bands) -> tuple[tuple[int, float], ...]:
    """``bands`` as ``((layer, sign), ...)`` with whole layers from 0 and signs +1 or -1, or :class:`UsageError`."""
    refused = UsageError(
        f"--bands must be (layer, sign) pairs with sign +1 or -1, e.g. ((10, 1), (21, -1)); got {bands!r}"
    )
    if isinstance(bands, (str, bytes)) or not isinstance(bands, (tuple, list)):
        raise refused
    checked = []
    for band in bands:
        if (
            isinstance(band, (str, bytes))
            or not isinstance(band, (tuple, list))
            or len(band) != 2
            or band[1] not in (1, -1)
        ):
            raise refused
        try:
            layer = whole_number("--bands", band[0])
        except UsageError:
            raise refused from None
        if layer < 0:
            raise refused
        checked.append((layer, float(band[1])))
    return tuple(checked)


def require_finite(option: str, value: float) -> float:
    """``value``, or :class:`UsageError` naming ``option`` when it is NaN or infinite."""
    if not math.isfinite(value):
        raise UsageError(f"{option} must be a finite number, got {value}")
    return value


def require_seed(seed: int | None) -> int | None:
    """``seed``, or :class:`UsageError` when torch cannot take it."""
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise UsageError(f"--seed must be a whole number from 0 to {MAX_SEED}, got {seed}")
    return seed


@dataclass
class Calibration:
    """Band layers measured for one model by ``epikv calibrate`` (stored by :mod:`epikv_cli.models.calibration`),
    and where they are stored."""

    model: str
    bands: list[tuple[int, float]]
    spearman: list[float]  # per layer
    windows: int
    prompts: int
    new_tokens: int
    path: str = ""

    @classmethod
    def from_record(cls, record: dict) -> Calibration:
        """A calibration from its JSON record (a saved file, or the one the vLLM engine's settings carry); raises
        ``KeyError``, ``TypeError`` or ``ValueError`` when ``record`` is not one (its bands are checked as
        ``--bands`` is, and there must be one at least)."""
        bands = checked_bands(record["bands"])
        if not bands:
            raise ValueError("a calibration without bands")
        return cls(**{**record, "bands": list(bands)})

    def describe(self) -> str:
        return f"calibrated ({self.path})"


@dataclass(frozen=True)
class CacheSettings:
    """How the KV cache is bounded and which policy evicts.

    Attributes:
        budget: K, the most entries an evicting layer holds after each step (prompt included);
            ``None`` means unbounded (policy ``full``).
        policy: a name from :data:`epikv_cli.policies.registry.POLICIES` (checked by
            :func:`epikv_cli.policies.registry.check_settings`, not here: settings know no policy).
        recent: R, the most recent tokens always kept; ``None`` means the policy's own default
            (``min(128, K // 4)`` for epikv, 75% of K for epikv2).
        bands: ``(layer, sign)`` pairs for ``epikv``; ``None`` means the depth-fraction default.
        positions: ``logical`` (true absolute index) or ``compressed`` (next position = stored length,
            the paper-time harness).
        seed: seed for policies that draw at random.
        options: ``(key, value)`` pairs for the policy's tunable options (``epikv2:period=32``).
    """

    budget: int | None = 4096
    policy: str = DEFAULT_POLICY
    recent: int | None = None
    bands: tuple[tuple[int, float], ...] | None = None
    positions: str = "logical"
    seed: int = 0
    options: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for name, option in (("budget", "--budget"), ("recent", "--recent"), ("seed", "--seed")):
            value = getattr(self, name)
            if value is not None:  # numpy and torch integers are whole numbers too; bools and floats are not
                object.__setattr__(self, name, whole_number(option, value))
        if self.bands is not None:
            object.__setattr__(self, "bands", checked_bands(self.bands))
        if self.budget is not None and self.budget < 1:
            raise UsageError(f"--budget must be a positive number of tokens, got {self.budget}")
        if self.budget is not None and self.budget > MAX_BUDGET:
            raise UsageError(
                f"--budget must be at most {MAX_BUDGET} tokens, got {self.budget}; for no eviction use --policy full"
            )
        if self.recent is not None and self.recent < 0:
            raise UsageError(f"--recent must be 0 or more, got {self.recent}")
        if self.recent is not None and self.recent > MAX_TOKENS:
            raise UsageError(f"--recent must be at most {MAX_TOKENS} tokens, got {self.recent}")
        keys = [key for key, _ in self.options]
        for key in keys:
            if keys.count(key) > 1:
                raise UsageError(f"policy option {key!r} is given {keys.count(key)} times; give it once")
        if self.recent is not None and "recent" in keys:
            raise UsageError(
                f"--recent and the option recent= both set the recent window of {self.policy!r}; give one of them"
            )
        require_seed(self.seed)
        if self.positions not in POSITION_MODES:
            raise UsageError(f"--positions must be one of {', '.join(POSITION_MODES)}, got {self.positions!r}")


@dataclass(frozen=True)
class SamplingSettings:
    """Decoding settings; a temperature below :data:`GREEDY_BELOW` (0 included) is greedy."""

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
        require_finite("--temperature", self.temperature)
        require_finite("--top-p", self.top_p)
        require_seed(self.seed)
        if self.temperature < 0:
            raise UsageError(f"--temperature must be 0 (greedy) or more, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UsageError(f"--top-k must be 0 (off) or more, got {self.top_k}")
        if self.greedy and (self.top_k or self.top_p < 1.0):
            raise UsageError("--top-k and --top-p only apply when sampling; add --temperature (e.g. 0.7)")
        if any(s == "" for s in self.stop):
            raise UsageError("--stop got an empty string; give the text that should end generation")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


#: The engines a model runs on: epikv's transformers loop, or vLLM with epikv's plugin.
ENGINES = ("transformers", "vllm")


@dataclass(frozen=True)
class ModelSettings:
    """Which model to load and how to place it.

    Attributes:
        model: a local directory, a ``.gguf`` file, a Hub id, a ``config.json`` (random weights), or
            ``None`` for the demo model.
        device_map: passed to Accelerate (``auto``, ``cpu``, ``cuda``, ``cuda:1``, ...).
        dtype: ``auto`` keeps the checkpoint's dtype (random weights: bfloat16 on CUDA, else float32).
        attn: ``auto`` picks flash_attention_2 when installed on CUDA, else sdpa.
        shape: a known shape (:data:`epikv_cli.models.shapes.SHAPES`, checked when loading) built with random
            weights, instead of ``model``.
        layers: keep only this many decoder layers of a shape or config.json.
        compile: ``torch.compile`` the model's forward (the eviction bookkeeping stays outside it).
        engine: ``transformers`` (epikv's own loop) or ``vllm`` (the plugin in vLLM, docs/vllm.md).
    """

    model: str | None = None
    device_map: str = "auto"
    dtype: str = "auto"
    attn: str = "auto"
    shape: str | None = None
    layers: int | None = None
    compile: bool = False
    engine: str = "transformers"

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise UsageError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.dtype not in DTYPES:
            raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.attn not in ATTN_CHOICES:
            raise UsageError(f"--attn must be one of {', '.join(ATTN_CHOICES)}, got {self.attn!r}")
        if self.model is not None and not self.model.strip():
            raise UsageError("--model is empty; give a directory, a .gguf file or a Hub id")
        if self.shape is not None and self.model is not None:
            raise UsageError("give either --model or --shape, not both")
        if self.layers is not None and self.shape is None and not (self.model or "").endswith(".json"):
            raise UsageError("--layers goes with --shape NAME or --model CONFIG.json (random weights)")
        if self.layers is not None and self.layers < 1:
            raise UsageError(f"--layers must be at least 1, got {self.layers}")
        check_device_map(self.device_map)


def check_device_map(spec: str) -> None:
    """Raise :class:`UsageError` unless ``spec`` names a placement this machine has."""
    if spec in PLACEMENTS:
        return
    match = _DEVICE.match(spec)
    if match is None:
        raise UsageError(
            f"--device-map {spec!r} is not a placement; use one of {', '.join(DEVICE_MAP_NAMES)}, cuda:N or a GPU index"
        )
    import torch  # noqa: PLC0415 (torch: settings load without it, only a --device-map check needs it)

    kind = match.group(1) or "cuda"
    index = match.group(3) or match.group(4)
    if kind == "cpu":
        if index is not None:
            raise UsageError(f"--device-map {spec!r}: the CPU has no index; use --device-map cpu")
        return
    backend = getattr(torch, kind, None)
    available = backend is not None and backend.is_available()
    if not available:
        raise UsageError(
            f"--device-map {spec}: this machine has no {kind.upper()} device (torch sees none); use --device-map "
            "cpu or auto"
        )
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    if index is not None and int(index) >= count:
        raise UsageError(
            f"--device-map {spec}: there is no {kind} device {index}; this machine has {count} (0-{count - 1})"
        )


@dataclass(frozen=True)
class PromptSettings:
    """How a prompt becomes token ids."""

    system: str | None = None
    chat_template: bool = True
