"""EpiKV-Flat (Kolawole & Smith, arXiv 2606.26472): evict the tokens with the lowest epiphany score.

For each generated token t and band (layer l, sign w):
    d_l(t) = || h_l(t) - h_l(t-1) ||_2          (output of decoder block l, token-to-token change)
    z_l(t) = (d_l(t) - mean) / (std + 1e-6)      (last 64 values of d_l, population std; 0 below two)
    s(t)   = sum_bands w * z_l(t)                (frozen once computed)
No attention weights, keys or logits are read, so SDPA and FlashAttention kernels run unchanged.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch

from epikv_cli.policies.base import PolicyOptions, Signals, UsageError, setting
from epikv_cli.policies.keep_scored import ScoredPolicy

#: Paper defaults (METHOD.md): z-score window and its epsilon.
ZSCORE_WINDOW = 64
ZSCORE_EPS = 1e-6
#: Paper bands on a 32-layer model: (10, +1) and (21, -1); other depths use the same fractions.
DEFAULT_BAND_FRACTIONS = ((10 / 31, 1.0), (21 / 31, -1.0))


def default_bands(num_layers: int) -> tuple[tuple[int, float], ...]:
    """The layers nearest depth fractions 10/31 and 21/31 of ``num_layers - 1``, signs +1 and -1."""
    return tuple((math.floor(fraction * (num_layers - 1) + 0.5), sign) for fraction, sign in DEFAULT_BAND_FRACTIONS)


class RollingZScore:
    """Causal z-score of a stream against its last ``window`` values (current one included).

    ``push(d)`` returns ``(d - mean) / (std + eps)`` with the population std (divide by n), or 0 while
    fewer than two values exist.
    """

    def __init__(self, window: int = ZSCORE_WINDOW, eps: float = ZSCORE_EPS) -> None:
        self.values: deque[float] = deque(maxlen=window)
        self.eps = eps

    def push(self, value: float) -> float:
        """The z-score of ``value``; a non-finite value (fp16 overflow) scores 0 and stays out of the window."""
        if not math.isfinite(value):
            return 0.0
        self.values.append(value)
        n = len(self.values)
        if n < 2:
            return 0.0
        mean = sum(self.values) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in self.values) / n)
        return (value - mean) / (std + self.eps)


@dataclass
class Band:
    """One (layer, sign) pair with its state: the previous hidden vector and the z-score ring."""

    layer: int
    sign: float
    zscore: RollingZScore
    previous: torch.Tensor | None = None  # [hidden] float32, the last token's block output


@dataclass
class StepScore:
    """What EpiKV computed for one generated token."""

    position: int
    score: float
    changes: tuple[float, ...]  # d per band
    zscores: tuple[float, ...]  # z per band


@dataclass(frozen=True)
class EpiKVOptions(PolicyOptions):
    """EpiKV's options.

    Attributes:
        bands: where the bands come from (``--policies epikv:bands=...``): ``default`` (the paper's depth fractions),
            ``calibrated`` (the model's saved calibration, required) or ``auto``: ``--bands``, else calibrated, else
            default.
        given_bands: ``--bands``, ``(layer, sign)`` pairs (None: none given).
    """

    bands: str = "auto"
    given_bands: tuple[tuple[int, float], ...] | None = setting("bands")

    def __post_init__(self) -> None:
        if self.bands not in ("auto", "default", "calibrated"):
            raise UsageError(f"epikv option bands={self.bands!r}: choose auto, default or calibrated")


class EpiKV(ScoredPolicy):
    """EpiKV-Flat. No bands given: the model's calibration, else :func:`default_bands` for its depth."""

    name = "epikv"
    Options = EpiKVOptions
    spikes = True

    def __init__(self, options: EpiKVOptions | None = None, **values: object) -> None:
        super().__init__(options, **values)
        self.band_source = self.options.bands
        self.requested_bands = self.options.given_bands
        self.bands: list[Band] = []
        self.bands_source: str | None = None  # where the bands came from, said in --json and the panel
        self.last: list[StepScore] = []

    def setup(self, num_layers: int, calibration=None) -> None:
        """Bands: ``--bands`` if given, else the model's calibrated bands, else the depth-fraction default
        (``bands=default`` or ``bands=calibrated`` picks one of the last two whatever else is there)."""
        # a calibration measured on another model (one layer per Spearman figure) is not this model's
        measured = calibration is not None and len(calibration.spearman) == num_layers
        usable = measured and all(0 <= layer < num_layers for layer, _ in calibration.bands)
        if self.band_source == "calibrated" and calibration is not None and not measured:
            raise UsageError(
                f"epikv:bands=calibrated, but the saved calibration ({calibration.path or calibration.model}) was "
                f"measured on a model of {len(calibration.spearman)} layers and this one has {num_layers}; run "
                "`epikv calibrate` again"
            )
        if self.band_source == "calibrated" and not usable:
            raise UsageError(
                "epikv:bands=calibrated, but this model has no saved calibration; run `epikv calibrate` first"
            )
        if self.band_source == "auto" and self.requested_bands:
            pairs, self.bands_source = self.requested_bands, "--bands"
        elif self.band_source == "calibrated" or (self.band_source == "auto" and usable):
            pairs, self.bands_source = tuple(calibration.bands), calibration.describe()
        else:
            pairs, self.bands_source = default_bands(num_layers), "default (depth fractions 10/31, 21/31)"
        for layer, _ in pairs:
            if not 0 <= layer < num_layers:
                raise UsageError(
                    f"band layer {layer} is out of range: the model has {num_layers} decoder layers "
                    f"(0-{num_layers - 1})"
                )
        self.bands = [Band(layer, sign, RollingZScore(ZSCORE_WINDOW, ZSCORE_EPS)) for layer, sign in pairs]

    def report(self) -> dict:
        """The bands, ``[[layer, sign], ...]``, where they came from, and the non-finite score count."""
        return {
            "bands": [[band.layer, band.sign] for band in self.bands] or None,
            "bands_source": self.bands_source,
            **super().report(),
        }

    def tap_layers(self) -> list[int]:
        return sorted({band.layer for band in self.bands})

    def stage(self, signals: Signals) -> list[torch.Tensor]:
        """The appended tokens' hidden-state change per band, ``[bands, q]`` on the model's device (none at the
        prefill).
        """
        hidden = signals.hidden
        self.last = []
        if signals.prompt:
            for band in self.bands:
                band.previous = hidden[band.layer][0, -1].detach().float().clone()
            return []
        changes = []
        for band in self.bands:
            states = hidden[band.layer][0].detach().float()  # [q, hidden]
            if band.previous is None:  # no prefill seen: the first token has nothing to differ from
                band.previous = states[0]
            chain = torch.cat([band.previous.to(states.device).unsqueeze(0), states])
            changes.append((chain[1:] - chain[:-1]).norm(dim=-1))  # [q]
            band.previous = states[-1].clone()
        return [torch.stack([change.to(changes[0].device) for change in changes])]

    def settle(self, signals: Signals, values: list[torch.Tensor]) -> None:
        """z-score each band's change against its rolling window and freeze the score."""
        if signals.prompt:
            return
        per_band = values[0].tolist()
        for j, position in enumerate(signals.appended):
            ds = tuple(per_band[b][j] for b in range(len(self.bands)))
            zs = tuple(band.zscore.push(d) for band, d in zip(self.bands, ds))
            score = sum(band.sign * z for band, z in zip(self.bands, zs))
            if not all(math.isfinite(d) for d in ds):
                self.nonfinite += 1
            self.record_score(position, score)
            self.last.append(StepScore(position, score, ds, zs))
