"""vLLM's entry point (``vllm.general_plugins``): register epikv's model classes, by name, and the tokenizer mode
whose renderer refuses a prompt the ring cannot take (:mod:`epikv_cli.vllm.renderer`), in every process.

vLLM runs this in each of its processes, possibly several times; registering the same lazy names again is
harmless, and nothing here imports the models themselves (vLLM inspects a lazily registered class in a
subprocess when it first needs it).
"""

from __future__ import annotations

from vllm import ModelRegistry

from epikv_cli.vllm.settings import ARCHITECTURES


def register() -> None:
    """Register each class of :mod:`epikv_cli.vllm.models` under its name, lazily, and epikv's tokenizer mode."""
    from epikv_cli.vllm import renderer  # noqa: PLC0415 (vLLM's renderers: once vLLM loads its plugins)

    for name in ARCHITECTURES:
        if name not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(name, f"epikv_cli.vllm.models:{name}")
    renderer.register()
