"""Known model shapes, built with random weights: speed and memory do not depend on the weights.

``epikv profile --shape qwq-32b --layers 8`` measures a QwQ-32B-shaped model cut to 8 decoder layers
without downloading anything. Configs follow the published ``config.json`` of each model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from epikv_cli.errors import ModelLoadError, UsageError

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

_LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}
_QWEN25_32B = dict(
    model_type="qwen2",
    hidden_size=5120,
    intermediate_size=27648,
    num_hidden_layers=64,
    num_attention_heads=40,
    num_key_value_heads=8,
    vocab_size=152064,
    max_position_embeddings=40960,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    use_sliding_window=False,
    tie_word_embeddings=False,
)

#: name -> config.json fields (``model_type`` picks the architecture).
SHAPES: dict[str, dict] = {
    "llama-3.1-8b": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters=_LLAMA31_ROPE,
        tie_word_embeddings=False,
    ),
    "qwen2.5-32b": _QWEN25_32B,
    "qwq-32b": _QWEN25_32B,
    "qwen3-8b": dict(
        model_type="qwen3",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
    ),
}
SHAPES["deepseek-r1-distill-llama-8b"] = SHAPES["llama-3.1-8b"]


def shape_config(name: str) -> PretrainedConfig:
    """The config of a known shape."""
    if name not in SHAPES:
        raise UsageError(f"unknown --shape {name!r}; choose one of: {', '.join(sorted(SHAPES))}")
    from transformers import AutoConfig  # noqa: PLC0415 (transformers: not for --help, which lists the shapes)

    fields = dict(SHAPES[name])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def cut_layers(config: PretrainedConfig, layers: int | None) -> PretrainedConfig:
    """Keep the first ``layers`` decoder layers (speed and memory scale with depth)."""
    if layers is None:
        return config
    text = config.get_text_config(decoder=True)
    if not 1 <= layers <= text.num_hidden_layers:
        raise UsageError(f"--layers must be from 1 to {text.num_hidden_layers} for this shape, got {layers}")
    text.num_hidden_layers = layers
    if getattr(text, "layer_types", None):
        text.layer_types = text.layer_types[:layers]
    return config


def random_model(config: PretrainedConfig, dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> torch.nn.Module:
    """A causal LM of ``config`` with N(0, 0.02) weight matrices, zero biases and unit norms.

    Built under transformers' ``no_init_weights`` (nothing is sampled twice), then every matrix is
    tiled from one small random pool: each looks random at its own scale, and an 8B-parameter shape
    costs a memory copy instead of minutes of sampling on a CPU.
    """
    import torch  # noqa: PLC0415 (torch: not for --help, which lists the shapes)
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 (transformers: as above)
    from transformers.initialization import no_init_weights  # noqa: PLC0415 (transformers: as above)

    try:
        with no_init_weights(), torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except ValueError as error:
        raise ModelLoadError(
            f"this config is not a causal language model ({str(error).splitlines()[0][:160]})"
        ) from None
    generator = torch.Generator().manual_seed(seed)
    pool = (torch.randn(1 << 20, generator=generator) * 0.02).to(device=device, dtype=dtype)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            flat = weight.view(-1)
            if name.endswith("bias"):
                flat.zero_()
            elif weight.dim() >= 2:
                whole = flat.numel() // pool.numel()
                if whole:
                    flat[: whole * pool.numel()].view(whole, -1).copy_(pool.expand(whole, -1))
                rest = flat.numel() - whole * pool.numel()
                if rest:
                    flat[flat.numel() - rest :].copy_(pool[:rest])
    model.eval()
    return model
