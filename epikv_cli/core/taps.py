"""Forward hooks that read what policies need from the forward pass, and nothing else."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn


def decoder_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's decoder blocks, in order (``model.model.layers``, ``model.gpt_neox.layers``, ...)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    blocks = getattr(decoder, "layers", None)
    if isinstance(blocks, nn.ModuleList):
        return blocks
    depth = model.config.get_text_config(decoder=True).num_hidden_layers
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == depth:
            return module
    raise ValueError(f"cannot find the decoder blocks of {type(model).__name__}")


class HiddenStateTaps:
    """Keeps, for the current forward, the output ``[batch, q, hidden]`` of chosen decoder blocks.

    Block l's output is what transformers calls ``hidden_states[l + 1]`` (for the last block,
    transformers reports the state after the final norm instead; the tap keeps the block's own output).
    The tensors are references, not copies; :meth:`clear` drops them after each forward. Only
    forwards while :attr:`active` is set are recorded (the owning session sets it for its own forwards).
    """

    def __init__(self, model: nn.Module, layers: list[int]) -> None:
        blocks = decoder_blocks(model)
        self.outputs: dict[int, torch.Tensor] = {}
        self.active = True
        self._handles = [blocks[layer].register_forward_hook(partial(self._keep, layer)) for layer in layers]

    def _keep(self, layer: int, module: nn.Module, args: tuple, output) -> None:
        if self.active:
            self.outputs[layer] = output[0] if isinstance(output, tuple) else output

    def clear(self) -> None:
        self.outputs.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.clear()
