"""One vLLM engine run for the tensor-parallel test (its own process: vLLM starts a worker process per rank).

python tp_run.py MODEL_DIR POLICY BUDGET TP NEW < prompts.json > tokens.json
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    model, policy, budget, tp, new = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    prompts = json.load(sys.stdin)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from epikv_cli.config import CacheSettings
    from epikv_cli.vllm.engine import VllmSettings, engine_arguments

    cache = CacheSettings(
        budget=budget,
        policy=policy.split(":")[0],
        options=tuple(tuple(pair.split("=", 1)) for pair in policy.split(":")[1:]),
    )
    engine = VllmSettings(model, dtype="float32", max_model_len=512, kv_cache_bytes=64 << 20, tensor_parallel=tp)
    arguments = engine_arguments(cache, engine)
    arguments.update(skip_tokenizer_init=True, distributed_executor_backend="mp" if tp > 1 else None)
    llm = LLM(**arguments)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False)
    json.dump([list(output.outputs[0].token_ids) for output in outputs], sys.stdout)


if __name__ == "__main__":
    main()
