"""vLLM model classes that hold a bounded cache: the stock Llama, Qwen2 and Qwen3 with epikv's attention layer.

Each class is the stock one, built as usual, after which every decoder block's ``Attention`` is replaced by an
:class:`EpiKVAttention` under the same name: it declares the ring page (:class:`~epikv_cli.vllm.backend.EpiKVRingSpec`)
and hands its queries, keys and values to the worker's :class:`~epikv_cli.vllm.ring.RingCache`. RoPE is applied
before, at the positions vLLM counts (logical positions), so nothing in vLLM is patched. ``forward`` plans the
step's writes before the stock forward and lets each request's policy evict after it, before sampling (the
logits are already computed from the hidden states).

The settings come from ``additional_config={"epikv": {...}}`` (:func:`settings_from_config`).
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

import epikv_cli.vllm.ops  # noqa: F401 (registers torch.ops.epikv, which the layers call)
from epikv_cli.config import CacheSettings
from epikv_cli.errors import UsageError
from epikv_cli.vllm.backend import EpiKVBackend, EpiKVRingSpec
from epikv_cli.vllm.ring import RingCache, ring_capacity
from epikv_cli.vllm.settings import CONFIG_KEY, calibration_from_config, settings_from_config


class EpiKVAttention(nn.Module, AttentionLayerBase):
    """One decoder block's attention over its requests' rings (replaces vLLM's ``Attention`` of that block)."""

    def __init__(self, stock: nn.Module, index: int, ring: RingCache) -> None:
        super().__init__()
        self.layer_name = stock.layer_name
        self.num_heads = stock.num_heads
        self.num_kv_heads = stock.num_kv_heads
        self.head_size = stock.head_size
        self.dtype = stock.kv_cache_torch_dtype
        self.index = index
        self._ring = [ring]  # a list, so that the ring is no submodule
        self.kv_cache = torch.tensor([])
        context = get_current_vllm_config().compilation_config.static_forward_context
        context[self.layer_name] = self  # the stock layer's entry: vLLM now allocates and binds through this one

    @property
    def ring(self) -> RingCache:
        return self._ring[0]

    def get_attn_backend(self):
        return EpiKVBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> EpiKVRingSpec:
        return EpiKVRingSpec(
            block_size=self.ring.page_slots,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=self.dtype,
        )

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        self.ring.bind(self.index, kv_cache)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs) -> torch.Tensor:
        tokens = query.shape[0]
        output = torch.empty(tokens, self.num_heads, self.head_size, dtype=query.dtype, device=query.device)
        torch.ops.epikv.ring_attention(
            query.view(tokens, self.num_heads, self.head_size),
            key.view(tokens, self.num_kv_heads, self.head_size),
            value.view(tokens, self.num_kv_heads, self.head_size),
            output,
            self.layer_name,
        )
        return output.view(tokens, self.num_heads * self.head_size)


class EpiKVMixin:
    """Installs the rings on a stock causal LM after it is built, and runs the policy half of each step."""

    def _install_epikv(self, vllm_config: VllmConfig) -> None:
        settings: CacheSettings = settings_from_config(vllm_config.additional_config)
        check_engine_config(vllm_config)
        blocks = self.model.layers
        stock = [block.self_attn.attn for block in blocks]
        if any(getattr(layer, "sliding_window", None) for layer in stock):
            raise UsageError("--engine vllm supports models whose every layer is full attention")
        flags = (vllm_config.additional_config or {}).get(CONFIG_KEY, {})
        ring = RingCache(
            settings,
            len(blocks),
            ring_capacity(settings),
            stock[0].impl.scale,
            heads=(stock[0].num_heads, stock[0].num_kv_heads),
            calibration=calibration_from_config(vllm_config.additional_config),
            trace=bool(flags.get("trace")),
            report=bool(flags.get("report")),
            reduce=_rank_mean() if get_tensor_model_parallel_world_size() > 1 else None,
        )
        self.epikv_ring = ring
        self._epikv_first = stock[0].layer_name
        for index, (block, layer) in enumerate(zip(blocks, stock)):
            block.self_attn.attn = EpiKVAttention(layer, index, ring)
        for index in ring.tap_layers:
            blocks[index].register_forward_hook(_tap(stock[index].layer_name))

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        metadata = get_forward_context().attn_metadata
        step = metadata.get(self._epikv_first) if isinstance(metadata, dict) else None
        if step is not None:
            self.epikv_ring.begin(step.rows, input_ids)
        output = super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        if step is not None:
            self.epikv_ring.finish()
        return output


def _rank_mean():
    """The mean over tensor-parallel ranks (a shared keep-set's scores from each rank's own KV heads)."""
    world = get_tensor_model_parallel_world_size()

    def mean(tensor: torch.Tensor) -> torch.Tensor:
        return tensor_model_parallel_all_reduce(tensor.float().contiguous()) / world

    return mean


def _tap(layer_name: str):
    """A forward hook that gives the ring the output of the decoder block whose attention is ``layer_name`` (vLLM's
    blocks return it as two parts, ``hidden + residual``), through the op a compiled forward keeps."""

    def hook(module: nn.Module, args, output) -> None:
        hidden, residual = output
        torch.ops.epikv.ring_tap(hidden if residual is None else hidden + residual, layer_name)

    return hook


def check_engine_config(vllm_config: VllmConfig) -> None:
    """Refuse the engine features a ring per request cannot follow (one line each, naming the setting)."""
    cache = vllm_config.cache_config
    scheduler = vllm_config.scheduler_config
    parallel = vllm_config.parallel_config
    problems = []
    if cache.enable_prefix_caching:
        problems.append("prefix caching (enable_prefix_caching=False)")
    if scheduler.enable_chunked_prefill:
        problems.append("chunked prefill (enable_chunked_prefill=False)")
    if vllm_config.speculative_config is not None:
        problems.append("speculative decoding")
    if parallel.pipeline_parallel_size > 1:
        problems.append("pipeline parallelism")
    if cache.cache_dtype not in ("auto", None):
        problems.append(f"kv_cache_dtype={cache.cache_dtype} (use auto)")
    if problems:
        raise UsageError("epikv's vLLM models need these off: " + "; ".join(problems))


class EpiKVLlamaForCausalLM(EpiKVMixin, LlamaForCausalLM):
    """Llama (SmolLM2, Llama 3) with a bounded cache per request."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._install_epikv(vllm_config)


class EpiKVQwen2ForCausalLM(EpiKVMixin, Qwen2ForCausalLM):
    """Qwen2 (QwQ-32B, Qwen2.5) with a bounded cache per request."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._install_epikv(vllm_config)


class EpiKVQwen3ForCausalLM(EpiKVMixin, Qwen3ForCausalLM):
    """Qwen3 with a bounded cache per request."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._install_epikv(vllm_config)
