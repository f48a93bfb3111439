"""vLLM engine speed on a big model shape with random weights (vLLM's ``load_format="dummy"``): stock vLLM against
epikv's plugin, both compiled with CUDA graphs (the plugin's piecewise), decode tokens/s of batches of 1 / 8 / 32
requests, and vLLM's own KV figures.

    python benchmarks/vllm_gpu.py --shape qwq-32b --budget 8192 --batches 1,8,32 --json out.json   # a GPU
    python benchmarks/vllm_gpu.py --shape qwen3-8b --layers 2 --budget 96 --batches 1,2 --prompt 48 --new 64 --smoke

The shape's config.json is written to a temporary directory with no tokenizer (prompts are token ids); run from the
vLLM venv (``.venv-vllm`` here, ``pip install 'epikv[vllm]'`` on a GPU machine).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwq-32b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--budget", type=int, default=8192)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens")
    parser.add_argument("--new", type=int, default=8192 + 512, help="new tokens (past K, so that the rings evict)")
    parser.add_argument("--policies", default="full,streaming,epikv2")
    parser.add_argument("--smoke", action="store_true", help="CPU sizes: fp32, no CUDA graphs, small KV memory")
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args()

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from epikv_cli.config import CacheSettings
    from epikv_cli.models.shapes import cut_layers, shape_config
    from epikv_cli.vllm.engine import VllmSettings, engine_arguments, ring_of

    folder = tempfile.mkdtemp(prefix="epikv-shape-")
    config = cut_layers(shape_config(args.shape), args.layers)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]  # what vLLM builds
    config.save_pretrained(folder)
    length = args.prompt + args.new
    results = []
    for policy in args.policies.split(","):
        cache = CacheSettings(budget=args.budget if policy != "full" else None, policy=policy)
        batches = [int(b) for b in args.batches.split(",")]
        engine = VllmSettings(
            folder,
            dtype="float32" if args.smoke else "bfloat16",
            max_model_len=length,
            max_num_seqs=max(batches),
            kv_cache_bytes=(1 << 30) if args.smoke else None,
            report=policy != "full",
            eager=args.smoke,  # CUDA graphs on: stock vLLM's own, and the plugin's pieces between its ops
        )
        arguments = engine_arguments(cache, engine)
        arguments.update(load_format="dummy", skip_tokenizer_init=True)
        started = time.perf_counter()
        llm = LLM(**arguments)
        built = time.perf_counter() - started
        cache_config = llm.llm_engine.vllm_config.cache_config
        prompt = [(17 * i) % 1000 + 10 for i in range(args.prompt)]
        for batch in batches:
            params = SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True)
            start = time.perf_counter()
            outputs = llm.generate([TokensPrompt(prompt_token_ids=prompt)] * batch, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            row = {
                "policy": policy,
                "batch": batch,
                "tokens_per_s": round(tokens / seconds, 2),
                "seconds": round(seconds, 2),
                "engine_build_s": round(built, 1),
                "num_kv_blocks": cache_config.num_gpu_blocks,
                "kv_bytes_per_request": ring_of(llm).request_bytes() if policy != "full" else None,
            }
            if policy != "full":
                ring = ring_of(llm)
                row["evicted_per_request"] = [r.evicted_total for r in ring.holding(prompt)]
            print(json.dumps(row), flush=True)
            results.append(row)
        llm.llm_engine.engine_core.shutdown()
        del llm
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"shape": args.shape, "layers": args.layers, "budget": args.budget, "results": results}, out)


if __name__ == "__main__":
    sys.exit(main())
