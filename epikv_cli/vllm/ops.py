"""The two custom ops through which vLLM's model reaches the rings, so that a compiled forward keeps them.

vLLM compiles a model's forward (on CPU: one Inductor graph; on GPUs: pieces between *splitting ops*, replayed as
CUDA graphs). Python in that forward runs once, while tracing, and never again; only ops in the graph run at each
step. So each layer hands its queries, keys and values to the ring through ``epikv::ring_attention`` (it writes
the attention output into a buffer the graph allocated), and each tapped decoder block hands its output through
``epikv::ring_tap`` (it returns nothing, so it is marked side-effecting: no dead-code pass drops it). Both look
their layer up by name in vLLM's forward context, as vLLM's own attention op does, and both are splitting ops
(:data:`epikv_cli.vllm.settings.SPLITTING_OPS`), so that a piecewise CUDA graph runs them eagerly.

What the ring keeps from a step outlives the op: the tapped block outputs are copied (a compiled graph reuses
its buffers), and :meth:`~epikv_cli.vllm.ring.RingCache.attend` copies the queries it keeps.
"""

from __future__ import annotations

import torch
from torch.fx.node import has_side_effect
from torch.library import Library
from vllm.forward_context import get_forward_context
from vllm.utils.torch_utils import direct_register_custom_op

LIBRARY = Library("epikv", "FRAGMENT")


def _layer(name: str):
    """The :class:`~epikv_cli.vllm.models.EpiKVAttention` registered under ``name``."""
    return get_forward_context().no_compile_layers[name]


def ring_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor, layer_name: str
) -> None:
    """Write this step's ``key``/``value`` ``[tokens, kv_heads, dim]`` into layer ``layer_name``'s rings and its
    attention output for ``query`` ``[tokens, heads, dim]`` into ``output`` (same shape as ``query``)."""
    layer = _layer(layer_name)
    layer.ring.attend(layer.index, query, key, value, output)


def ring_tap(hidden: torch.Tensor, layer_name: str) -> None:
    """Give the ring the output ``[tokens, hidden]`` of the decoder block whose attention is ``layer_name``."""
    layer = _layer(layer_name)
    layer.ring.tap(layer.index, hidden.clone())


def _nothing(*args) -> None:
    return None


direct_register_custom_op("ring_attention", ring_attention, ["output"], _nothing, LIBRARY)
direct_register_custom_op("ring_tap", ring_tap, [], _nothing, LIBRARY)
has_side_effect(torch.ops.epikv.ring_tap.default)
