"""One vLLM engine run for the tensor-parallel and compiled tests (its own process: vLLM starts a worker process per
rank, and a compiled model stays compiled in its process).

python tp_run.py MODEL_DIR POLICIES BUDGET TP NEW PROMPTS_JSON [compile | pages=N] > result.json

``pages=N``: KV memory for N request pages (vLLM's null block among them), so that the other requests wait for one.
The last line of stdout: per policy its greedy ``tokens`` per prompt; on one rank, each request's evicted positions
step by step (``trace``) and its count of evicted entries (``evicted``); ``mode``, vLLM's compilation mode; and
``blocks``, the request pages vLLM made.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM logs to stdout; the result is the last line there


def main() -> None:
    model, policies, budget, tp, new = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    prompts = json.loads(sys.argv[6])
    compiled = sys.argv[7:] == ["compile"]
    pages = int(sys.argv[7].removeprefix("pages=")) if sys.argv[7:8] and sys.argv[7].startswith("pages=") else None
    if tp == 1:  # the engine runs in this process, on torch's threads (one per core unless told): one, beside TP 2's
        import torch

        torch.set_num_threads(1)
    if tp > 1:  # vLLM's CPU workers bind their threads to one NUMA node each unless told which cores: one core each
        cores = sorted(os.sched_getaffinity(0))
        os.environ.setdefault(
            "VLLM_CPU_OMP_THREADS_BIND", "|".join(str(cores[rank % len(cores)]) for rank in range(tp))
        )
    result = {policy: run(model, policy, budget, tp, new, prompts, compiled, pages) for policy in policies.split(",")}
    print(json.dumps(result), flush=True)


def run(
    model: str, policy: str, budget: int, tp: int, new: int, prompts: list[list[int]], compiled: bool, pages: int | None
) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from epikv_cli.config import CacheSettings
    from epikv_cli.policies.registry import parse_policy_spec
    from epikv_cli.vllm.engine import VllmSettings, engine_arguments, request_bytes, ring_of

    name, options = parse_policy_spec(policy)
    cache = CacheSettings(budget=budget, policy=name, options=options)
    engine = VllmSettings(
        model,
        dtype="float32",
        max_model_len=512,
        kv_cache_bytes=64 << 20 if pages is None else int(request_bytes(model, cache, 512, "float32") * (pages + 0.5)),
        tensor_parallel=tp,
        trace=tp == 1,
        eager=not compiled,
    )
    arguments = engine_arguments(cache, engine)
    arguments.update(skip_tokenizer_init=True, distributed_executor_backend="mp" if tp > 1 else None)
    llm = LLM(**arguments)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False)
    result = {
        "tokens": [list(output.outputs[0].token_ids) for output in outputs],
        "trace": [request.trace for request in ring_of(llm).admitted] if tp == 1 else None,
        "evicted": [request.evicted_total for request in ring_of(llm).admitted] if tp == 1 else None,
        "mode": llm.llm_engine.vllm_config.compilation_config.mode.name,
        "blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
    }
    llm.llm_engine.engine_core.shutdown()
    return result


if __name__ == "__main__":
    main()
