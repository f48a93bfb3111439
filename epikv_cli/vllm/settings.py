"""The cache settings as they travel to vLLM's workers: ``additional_config={"epikv": {...}}``, plain JSON.

``VllmConfig.additional_config`` is part of vLLM's config hash and reaches every process (engine core, workers),
so every worker builds the same policies from it.
"""

from __future__ import annotations

from dataclasses import asdict

from epikv_cli.config import CacheSettings, Calibration
from epikv_cli.errors import UsageError

#: The key of ``additional_config`` that holds epikv's settings.
CONFIG_KEY = "epikv"
#: The tokenizer mode (and renderer mode) of epikv's engines: :mod:`epikv_cli.vllm.renderer`.
TOKENIZER_MODE = "epikv"
#: The ops of :mod:`epikv_cli.vllm.ops`: a compiled forward is split at them (piecewise CUDA graphs run them eagerly).
SPLITTING_OPS = ("epikv::ring_attention", "epikv::ring_tap")


def config_for(settings: CacheSettings, calibration: Calibration | None = None) -> dict:
    """``additional_config`` for an engine whose requests run under ``settings``, on a model whose saved
    ``calibration`` (EpiKV's bands) travels with them: every worker, on every node, reads the bands the command
    read, whatever its own cache directory holds."""
    return {
        CONFIG_KEY: {
            "policy": settings.policy,
            "budget": settings.budget,
            "recent": settings.recent,
            "bands": [list(band) for band in settings.bands] if settings.bands is not None else None,
            "seed": settings.seed,
            "options": [list(pair) for pair in settings.options],
            "calibration": asdict(calibration) if calibration is not None else None,
        }
    }


def settings_from_config(additional_config: dict | None) -> CacheSettings:
    """The settings ``additional_config`` carries (:func:`config_for`); :class:`UsageError` when it has none."""
    values = (additional_config or {}).get(CONFIG_KEY)
    if values is None:
        raise UsageError(
            'epikv\'s vLLM models need their settings: pass additional_config={"epikv": {"policy": ..., '
            '"budget": ...}} (vllm serve: --additional-config)'
        )
    bands = values.get("bands")
    return CacheSettings(
        budget=values.get("budget"),
        policy=values.get("policy", CacheSettings.policy),
        recent=values.get("recent"),
        bands=tuple((int(layer), float(sign)) for layer, sign in bands) if bands else None,
        seed=values.get("seed", 0),
        options=tuple((str(key), str(value)) for key, value in values.get("options", ())),
    )


def calibration_from_config(additional_config: dict | None) -> Calibration | None:
    """The model's calibration ``additional_config`` carries (:func:`config_for`), if any."""
    record = ((additional_config or {}).get(CONFIG_KEY) or {}).get("calibration")
    return Calibration.from_record(record) if record is not None else None


#: vLLM architecture name of each epikv model class -> the stock architecture it bounds (``hf_overrides`` picks it).
ARCHITECTURES = {
    "EpiKVLlamaForCausalLM": "LlamaForCausalLM",
    "EpiKVQwen2ForCausalLM": "Qwen2ForCausalLM",
    "EpiKVQwen3ForCausalLM": "Qwen3ForCausalLM",
}


def architecture_for(stock: list[str] | None) -> str:
    """The epikv architecture that bounds a model of architectures ``stock`` (its config's); :class:`UsageError`
    when there is none."""
    for name, base in ARCHITECTURES.items():
        if base in (stock or []):
            return name
    supported = ", ".join(sorted(ARCHITECTURES.values()))
    raise UsageError(f"--engine vllm runs {supported} models; this one is {', '.join(stock or ['unknown'])}")
