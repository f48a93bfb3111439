"""Choose EpiKV's band layers for a model, by measuring instead of assuming (``epikv calibrate``).

On greedy full-cache reference traces, every 32-token window (stride 16) of the generated tokens is
labelled by how much hiding it from every later query raises the KL divergence of the tokens that
follow (one masked full-sequence forward per window). Each layer's token-to-token hidden-state change
d(t), smoothed by a causal rolling mean over 64 tokens and averaged over the window, is then
rank-correlated (Spearman) with those labels. The most positive layer becomes the +1 band, the most
negative the -1 band. The result is saved per model and picked up by ``generate``, ``eval``,
``fidelity`` and ``profile``; ``--bands`` still overrides it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from epikv_cli.config import CacheSettings
from epikv_cli.core.cache import FULL, layer_groups, sliding_window
from epikv_cli.core.taps import HiddenStateTaps, decoder_blocks
from epikv_cli.data.problems import Problem, protocol_ids
from epikv_cli.errors import UsageError
from epikv_cli.models.calibration import Calibration, model_key, save_calibration
from epikv_cli.runtime.stream import CacheStream, input_device

WINDOW = 32
STRIDE = 16
ROLLING = 64


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation (ties share their average rank)."""

    def ranks(values: list[float]) -> torch.Tensor:
        v = torch.tensor(values, dtype=torch.float64)
        order = torch.argsort(v)
        r = torch.empty_like(v)
        r[order] = torch.arange(len(values), dtype=torch.float64)
        _, inverse, counts = torch.unique(v, return_inverse=True, return_counts=True)
        sums = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, r)
        return (sums / counts)[inverse]

    rx, ry = ranks(x), ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denominator = math.sqrt(float((rx * rx).sum() * (ry * ry).sum()))
    return float((rx * ry).sum()) / denominator if denominator else 0.0


def rolling_mean(values: torch.Tensor, width: int = ROLLING) -> torch.Tensor:
    """Causal rolling mean over the last ``width`` values (fewer at the start). ``values``: ``[..., T]``."""
    cumulative = torch.cumsum(torch.nn.functional.pad(values, (1, 0)), dim=-1)
    t = torch.arange(1, values.shape[-1] + 1)
    start = (t - width).clamp(min=0)
    return (cumulative[..., t] - cumulative[..., start]) / (t - start)


def trace(model, ids: torch.Tensor, new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy full-cache reference tokens and ``[layers, new_tokens]`` hidden-state changes d(t) of every layer."""

    layers = len(decoder_blocks(model))
    taps = HiddenStateTaps(model, list(range(layers)))
    changes = torch.zeros(layers, new_tokens)
    tokens: list[int] = []
    try:
        with CacheStream(
            model, CacheSettings(budget=None, policy="full"), max_tokens=ids.shape[1] + new_tokens
        ) as stream:
            logits = stream.feed(ids)
            previous = [taps.outputs[layer][0, -1].float() for layer in range(layers)]
            taps.clear()
            for step in range(new_tokens):
                token = int(logits.argmax())
                tokens.append(token)
                logits = stream.feed(torch.tensor([[token]]))
                for layer in range(layers):
                    state = taps.outputs[layer][0, -1].float()
                    changes[layer, step] = (state - previous[layer]).norm().cpu()
                    previous[layer] = state
                taps.clear()
    finally:
        taps.remove()
    return tokens, changes


def window_labels(model, sequence: list[int], prompt_len: int, new_tokens: int) -> list[tuple[int, float]]:
    """``(start, label)`` per window of the generated tokens: the mean KL(full || window hidden) over the
    tokens after the window, from one masked full-sequence forward per window.

    The window is hidden from the full-attention layers only, as eviction hides it: sliding-window layers (Gemma 3's
    local ones) are not evicted from, and keep their own window (the masks given replace the model's)."""
    device = input_device(model)
    dtype = next(model.parameters()).dtype
    groups, layer_kwargs = layer_groups(model.config)
    ids = torch.tensor([sequence], device=device)
    total = len(sequence)

    def additive(visible: torch.Tensor) -> torch.Tensor:
        return torch.zeros(1, 1, total, total, dtype=dtype, device=device).masked_fill(~visible, torch.finfo(dtype).min)

    causal = torch.tril(torch.ones(total, total, dtype=torch.bool, device=device))
    sliding = None
    if (window := sliding_window(layer_kwargs)) is not None:
        position = torch.arange(total, device=device)
        sliding = additive(causal & (position[:, None] - position[None, :] < window))
    with torch.inference_mode():
        reference = torch.log_softmax(model(ids, use_cache=False).logits[0].float(), dim=-1)
        labels = []
        for start in range(0, new_tokens - WINDOW - 1, STRIDE):
            first, last = prompt_len + start, prompt_len + start + WINDOW  # generated tokens [start, start + 32)
            visible = causal.clone()
            visible[last:, first:last] = False  # evicted once the window is complete: later queries miss it
            mask = additive(visible)
            if sliding is not None:  # a model whose every layer slides: nothing is hidden (calibrate refuses it)
                mask = {"full_attention": mask, "sliding_attention": sliding} if FULL in groups else sliding
            hidden = torch.log_softmax(
                model(ids, attention_mask=mask, use_cache=False).logits[0, last:].float(), dim=-1
            )
            after = reference[last:]
            labels.append((start, float((after.exp() * (after - hidden)).sum(-1).mean())))
    return labels


@dataclass
class WindowSamples:
    """The windows measured so far: each one's per-layer mean smoothed change (``features``) and its importance
    (``labels``), and how many prompts they come from (a calibration interrupted part way keeps them)."""

    features: list[list[float]] = field(default_factory=list)
    labels: list[float] = field(default_factory=list)
    prompts: int = 0

    def correlations(self) -> list[float]:
        """Per layer: Spearman's ρ of its feature with the labels."""
        return [spearman(list(values), self.labels) for values in zip(*self.features)]


def calibrate(
    model,
    prompts_ids: list[torch.Tensor],
    new_tokens: int,
    advance=lambda text: None,
    samples: WindowSamples | None = None,
) -> tuple[list[float], int]:
    """Per-layer Spearman correlation of the smoothed hidden-state change with window importance, and the number of
    windows. ``samples`` (new ones when None) gathers the windows prompt by prompt, for a caller that is interrupted."""
    if new_tokens < WINDOW + STRIDE:
        raise UsageError(
            f"--new-tokens must be at least {WINDOW + STRIDE} for {WINDOW}-token windows, got {new_tokens}"
        )
    if FULL not in layer_groups(model.config)[0]:
        raise UsageError(
            "every layer of this model uses sliding-window attention, so no budget evicts from it: there are no "
            "EpiKV bands to calibrate"
        )
    samples = samples if samples is not None else WindowSamples()
    for index, ids in enumerate(prompts_ids):
        advance(f"prompt {index + 1}/{len(prompts_ids)}: reference trace")
        tokens, changes = trace(model, ids, new_tokens)
        smooth = rolling_mean(changes)  # [layers, new_tokens]
        advance(f"prompt {index + 1}/{len(prompts_ids)}: window labels")
        # d(t) belongs to generated token t (its state against the one before); windows index the same tokens
        labelled = window_labels(model, ids[0].tolist() + tokens[:-1], ids.shape[1], new_tokens)
        samples.labels.extend(label for _, label in labelled)
        samples.features.extend(smooth[:, start : start + WINDOW].mean(dim=1).tolist() for start, _ in labelled)
        samples.prompts += 1
    return samples.correlations(), len(samples.labels)


#: Fewer windows than this and a layer's ρ is mostly chance (its standard error is about 1 / sqrt(windows - 1)):
#: calibrate says so.
MIN_WINDOWS = 30


def choose_bands(rho: list[float]) -> tuple[list[tuple[int, float]], str | None]:
    """The most positive layer as the +1 band and the most negative as the -1 band, and a note when
    the pattern differs from the paper's (positive below, negative in the upper middle)."""
    positive = max(range(len(rho)), key=lambda layer: rho[layer])
    negative = min(range(len(rho)), key=lambda layer: rho[layer])
    bands = []
    if rho[positive] > 0:
        bands.append((positive, 1.0))
    if rho[negative] < 0:
        bands.append((negative, -1.0))
    if not bands:
        raise UsageError(
            "no layer's hidden-state change correlates with window importance; use more prompts or --new-tokens"
        )
    note = None
    if len(bands) < 2:
        note = "only one band: no layer correlates " + ("negatively" if rho[positive] > 0 else "positively")
    elif positive > negative:
        note = (
            f"the pattern differs from the paper's: the positive band (layer {positive}) "
            f"lies above the negative one (layer {negative})"
        )
    return bands, note


@dataclass
class BandsMeasured:
    """What :func:`calibrate_bands` found: the calibration (``path`` set once saved), every layer's ρ unrounded,
    and :func:`choose_bands`'s note."""

    calibration: Calibration
    rho: list[float]
    note: str | None


def calibrate_bands(
    loaded, problems: list[Problem], new_tokens: int, advance=lambda text: None, samples: WindowSamples | None = None
) -> BandsMeasured:
    """Measure the loaded model's bands on ``problems`` (:func:`save_bands` keeps them). ``advance(text)`` says which
    step is under way; ``samples`` gathers the windows as they come (see :func:`bands_so_far`)."""
    prompts_ids = [protocol_ids(loaded.tokenizer, problem) for problem in problems]
    rho, windows = calibrate(loaded.model, prompts_ids, new_tokens, advance, samples)
    return bands_from(loaded, rho, windows, len(problems), new_tokens)


def save_bands(measured: BandsMeasured) -> None:
    """Save ``measured``'s calibration for its model (``path`` set); :class:`~epikv_cli.errors.WriteError` when the
    cache cannot hold it."""
    measured.calibration.path = str(save_calibration(measured.calibration, measured.calibration.model))


def bands_so_far(loaded, samples: WindowSamples, new_tokens: int) -> BandsMeasured | None:
    """What the windows of the prompts finished so far say (not saved: a calibration cut short is not the model's),
    or None when no prompt finished or no layer correlates yet."""
    if not samples.labels:
        return None
    try:
        return bands_from(loaded, samples.correlations(), len(samples.labels), samples.prompts, new_tokens)
    except UsageError:
        return None


def bands_from(loaded, rho: list[float], windows: int, prompts: int, new_tokens: int) -> BandsMeasured:
    """The bands ``rho`` picks, with their notes (few windows, an unusual pattern), as a calibration of the loaded
    model (``path`` empty until saved)."""
    bands, note = choose_bands(rho)
    if windows < MIN_WINDOWS:
        few = (
            f"the correlations rest on only {windows} windows, where |ρ| of 0.8 arises by chance: these bands are "
            f"noise; calibrate on more prompts or a larger --new-tokens (at least {MIN_WINDOWS} windows)"
        )
        note = f"{few}; {note}" if note else few
    calibration = Calibration(model_key(loaded.source), bands, [round(r, 4) for r in rho], windows, prompts, new_tokens)
    return BandsMeasured(calibration, rho, note)
