"""What vLLM allocates and schedules for epikv: one ring page per request and layer, and the per-step row list.

- :class:`EpiKVRingSpec` is a :class:`~vllm.v1.kv_cache_interface.CircularBufferSpec` whose block is the ring
  (C = K + 1 slots): vLLM's ``CircularBufferManager`` (found through the spec registry's MRO lookup) gives each
  request one block for its whole life and never another, so admission and concurrency are planned for K, not
  for ``max_model_len``, while the scheduler's token count, and so RoPE's positions, keep counting.
- :class:`EpiKVBackend` and its builder turn vLLM's per-step metadata into the rows of
  :mod:`epikv_cli.vllm.ring` (block id, tokens computed before, the row's tokens), once per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.utils.math_utils import cdiv
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import CircularBufferSpec

from epikv_cli.vllm.ring import Row


@dataclass(frozen=True, kw_only=True)
class EpiKVRingSpec(CircularBufferSpec):
    """One page of ``block_size`` = C slots per request and layer, for the request's whole life."""

    def max_num_blocks_per_req(self, vllm_config, max_len: int) -> int:
        # The worker's generic slot mapping indexes the block table by position // block_size with no bound; a
        # row as wide as the positions can reach keeps it inside the table (the extra entries stay the null block).
        del vllm_config
        return cdiv(max_len, self.block_size)


@dataclass
class EpiKVMetadata:
    """One step's rows (``block 0``: padding) and its token count."""

    rows: list[Row]
    num_actual_tokens: int


class EpiKVMetadataBuilder(AttentionMetadataBuilder):
    """Reads each request's ring block, computed-token count and query span: one host copy of the block ids."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> EpiKVMetadata:
        meta = common_attn_metadata
        count = meta.num_reqs
        starts = meta.query_start_loc_cpu[: count + 1].tolist()
        lengths = meta.seq_lens_cpu_upper_bound
        lengths = (lengths if lengths is not None else meta.seq_lens.cpu())[:count].tolist()
        blocks = meta.block_table_tensor[:count, 0].cpu().tolist()
        rows = [
            Row(block, length - (last - first), first, last)
            for block, length, first, last in zip(blocks, lengths, starts[:-1], starts[1:])
            if last > first
        ]
        return EpiKVMetadata(rows, meta.num_actual_tokens)


class EpiKVBackend(AttentionBackend):
    """The ring's backend: any head size and block size; the attention itself runs in the layer."""

    accept_output_buffer = False

    @staticmethod
    def get_name() -> str:
        return "EPIKV_RING"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("EpiKVAttention computes its own attention")

    @staticmethod
    def get_builder_cls() -> type[EpiKVMetadataBuilder]:
        return EpiKVMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return True
