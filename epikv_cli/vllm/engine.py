"""Build a vLLM engine that runs epikv's policies, and read back what each request's ring did.

:func:`engine_arguments` is the one place that knows which vLLM settings the plugin needs (the ring per request
cannot follow chunked prefill, prefix caching or speculative decoding; compiled, the graph splits at epikv's ops); the
CLI, the tests and the benchmarks build their ``vllm.LLM`` from it. ``policy full`` gives stock vLLM, the reference.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from transformers import AutoConfig

from epikv_cli.config import CacheSettings, Calibration
from epikv_cli.policies.registry import evicts
from epikv_cli.vllm.ring import RingCache, check_policy, page_slots
from epikv_cli.vllm.settings import SPLITTING_OPS, TOKENIZER_MODE, architecture_for, config_for


@dataclass(frozen=True)
class VllmSettings:
    """How vLLM runs the model.

    Attributes:
        model: a local model directory (or a Hub id vLLM can fetch).
        dtype: ``auto``, ``float32``, ``bfloat16``, ``float16``.
        max_model_len: the longest sequence (prompt + new tokens) a request may reach.
        kv_cache_bytes: memory for every request's cache (None: vLLM's share of the device).
        max_num_seqs: most requests decoded together.
        tensor_parallel: tensor-parallel ranks.
        seed: vLLM's seed (sampling).
        trace: keep each request's evictions step by step (:attr:`RingCache.admitted`, tests).
        report: let each result find its request's ring (:meth:`RingCache.request_for`).
        progress: vLLM's progress bar while it loads the weights.
        eager: run the model eagerly (starts in seconds) instead of compiled (vLLM's default: a minute or more
            to compile at the first start, faster steps; on GPUs, piecewise CUDA graphs).
        calibration: the model's saved calibration (EpiKV's bands, as the transformers engine reads them), if any.
    """

    model: str
    dtype: str = "auto"
    max_model_len: int = 4096
    kv_cache_bytes: int | None = None
    max_num_seqs: int = 64
    tensor_parallel: int = 1
    seed: int = 0
    trace: bool = False
    report: bool = False
    progress: bool = True
    eager: bool = True
    calibration: Calibration | None = None


def checkpoint_dtype(config, dtype: str) -> str:
    """``dtype``, with ``auto`` read as the dtype of the checkpoint whose ``config`` this is, as the transformers
    engine reads it (vLLM's ``auto`` runs a float32 checkpoint in bfloat16); ``auto`` when the config names none."""
    if dtype != "auto":
        return dtype
    named = str(getattr(config.get_text_config(decoder=True), "dtype", None) or "").removeprefix("torch.")
    return named if named in ("float32", "bfloat16", "float16") else "auto"


def engine_arguments(cache: CacheSettings, engine: VllmSettings) -> dict:
    """Keyword arguments for ``vllm.LLM`` (and ``vllm serve``'s flags) that run ``cache``'s policy on ``engine``."""
    check_policy(cache)
    config = AutoConfig.from_pretrained(engine.model)
    arguments = {
        "model": engine.model,
        "dtype": checkpoint_dtype(config, engine.dtype),
        "max_model_len": engine.max_model_len,
        "max_num_seqs": engine.max_num_seqs,
        "tensor_parallel_size": engine.tensor_parallel,
        "seed": engine.seed,
        "enforce_eager": engine.eager,
        "enable_prefix_caching": False,
        "use_tqdm_on_load": engine.progress,
    }
    if engine.kv_cache_bytes is not None:
        arguments["kv_cache_memory_bytes"] = engine.kv_cache_bytes
    if not evicts(cache.policy):
        return arguments
    extra = config_for(cache, engine.calibration)
    extra["epikv"].update(trace=engine.trace, report=engine.report)
    arguments.update(
        hf_overrides={"architectures": [architecture_for(config.architectures)]},
        additional_config=extra,
        tokenizer_mode=TOKENIZER_MODE,  # its renderer refuses a prompt longer than the ring (before it is scheduled)
        enable_chunked_prefill=False,
        max_num_batched_tokens=engine.max_model_len,
    )
    if not engine.eager:  # the graph splits at epikv's ops; CUDA graphs capture the pieces between them
        arguments["compilation_config"] = {"splitting_ops": list(SPLITTING_OPS), "cudagraph_mode": "PIECEWISE"}
    return arguments


def build_engine(cache: CacheSettings, engine: VllmSettings):
    """A ``vllm.LLM`` running ``cache``'s policy (stock vLLM for ``full``), its engine in this process: it starts in
    seconds and :func:`ring_of` can read the rings. (``epikv serve`` leaves vLLM's default, an engine-core process
    beside the API server's.)"""
    from vllm import LLM  # noqa: PLC0415 (vllm: seconds to import, only when an engine is built)

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return LLM(**engine_arguments(cache, engine))


def ring_of(llm) -> RingCache:
    """The rings of ``llm``'s first worker (an engine built by :func:`build_engine`, in this process)."""
    return llm.apply_model(lambda model: model.epikv_ring)[0]


def request_bytes(model: str, cache: CacheSettings, max_model_len: int, dtype: str) -> int:
    """The KV memory one request takes on this engine: every layer's page, a ring of C = K + 1 slots and the queries
    its policy reads (:func:`~epikv_cli.vllm.ring.page_slots`; stock vLLM, for ``full``: ``max_model_len`` slots in
    128-token blocks), keys and values."""
    config = AutoConfig.from_pretrained(model)
    text = config.get_text_config(decoder=True)
    heads = text.num_key_value_heads or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    element = 4 if checkpoint_dtype(config, dtype) == "float32" else 2
    if not evicts(cache.policy):
        slots = -(-max_model_len // 128) * 128
    else:
        slots = page_slots(cache, text.num_attention_heads, heads)
    return text.num_hidden_layers * slots * heads * 2 * head_dim * element
