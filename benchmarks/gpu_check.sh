#!/usr/bin/env bash
# The GPU numbers the issues ask for (docs/benchmarks.md, "GPU numbers are pending"): random weights in
# bfloat16 on one H200-class GPU, one call of at most 9 minutes (the sum of the parts' own limits).
#
#   bash benchmarks/gpu_check.sh                 # on the GPU machine; results in $OUT (default /tmp/gpu_check)
#   GPU_CHECK_SMOKE=1 bash benchmarks/gpu_check.sh   # here, on the CPU: the same commands, tiny sizes
#
# A machine whose torch image carries an older transformers needs this project's versions as wheels in
# .whl/ (about 25 MB; installed into /tmp/site first when the folder exists), fetched where PyPI is
# reachable (the H200 image has Python 3.12, and huggingface_hub, tokenizers, accelerate, safetensors recent enough):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl transformers==5.24.0 \
#       typer==0.29.2 rich==15.0.0 pydantic==2.14.4 pydantic_core==2.50.5 typing-inspection==0.4.5 \
#       annotated-types==0.8.0 annotated-doc==0.0.7 markdown-it-py==4.3.0 mdurl==0.1.2 shellingham==1.5.4 regex
# then, through the device tool: carry [".whl"], command "bash benchmarks/gpu_check.sh", timeout 600.
#
# Each part has its own time limit, so one that hangs or runs out of memory does not take the others down.
# Parts: (1) issue 7: Llama-3.1-8B shape, K = 2048 (the last 256 of 384 steps evict): full, streaming, epikv, epikv2, the
# authors' eager H2O; (2) issue 10: Qwen2.5-32B shape cut to 8 layers, K = 8192, batch 1 and 8: full,
# streaming, epikv, epikv2; (3) issue 10: --compile (CUDA graphs) against eager PyTorch, Llama shape, 8 layers;
# (4) issue 38: the vLLM engine (benchmarks/vllm_gpu.py), QwQ-32B shape, K = 8192, batch 1 / 8 / 32.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="$PWD:/tmp/site"
fi
LOG="$OUT/log.txt"

if [ "${GPU_CHECK_SMOKE:-0}" = 1 ]; then  # the commands as on the GPU, at sizes a CPU runs in a few minutes
    LLAMA=(--shape llama-3.1-8b --layers 1 --dtype float32); LLAMA8=("${LLAMA[@]}"); QWEN=(--shape qwen2.5-32b --layers 1 --dtype float32)
    P7=(--budget 192 --prompt-tokens 128 --new-tokens 96 --repeats 1); P10=(--budget 112 --prompt-tokens 76 --new-tokens 40 --repeats 1)
    PC=(--budget 64 --prompt-tokens 40 --new-tokens 32 --repeats 1); LIMIT=900
else
    # epikv protects its prompt and min(128, K/4) recent tokens: each prompt leaves room for them, and each run
    # ends past K, so that the last steps evict
    LLAMA=(--shape llama-3.1-8b --dtype bfloat16); LLAMA8=("${LLAMA[@]}" --layers 8); QWEN=(--shape qwen2.5-32b --layers 8 --dtype bfloat16)
    P7=(--budget 2048 --prompt-tokens 1792 --new-tokens 384 --repeats 1); P10=(--budget 8192 --prompt-tokens 8000 --new-tokens 384 --repeats 1)
    PC=(--budget 512 --prompt-tokens 256 --new-tokens 512 --repeats 2); LIMIT=0
fi

{
    date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
    "$PY" -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "transformers", transformers.__version__)'
} >"$LOG" 2>&1

part() {  # part NAME SECONDS ARGS...: one `epikv profile --json` into $OUT/NAME.json, its stderr into the log
    local name=$1 seconds=$2; shift 2
    [ "$LIMIT" != 0 ] && seconds=$LIMIT
    echo "== $name: epikv profile $*" >>"$LOG"
    local start=$SECONDS
    timeout "$seconds" "$PY" -m epikv_cli profile "$@" --json -q >"$OUT/$name.json" 2>>"$LOG"
    echo "== $name: exit $? after $((SECONDS - start)) s" >>"$LOG"
}

part issue7_llama8b 180 "${LLAMA[@]}" --policies full,streaming,epikv,epikv2,h2o@eager "${P7[@]}"
part issue10_qwen32b_l8_b1 80 "${QWEN[@]}" --policies full,streaming,epikv,epikv2 "${P10[@]}" --batch-size 1
part issue10_qwen32b_l8_b8 100 "${QWEN[@]}" --policies full,streaming,epikv,epikv2 "${P10[@]}" --batch-size 8
part compile_off_llama8b_l8 50 "${LLAMA8[@]}" --policies streaming,epikv "${PC[@]}"
part compile_on_llama8b_l8 130 "${LLAMA8[@]}" --policies streaming,epikv "${PC[@]}" --compile

# (4) issue 38: the vLLM engine on the QwQ-32B shape (random weights, load_format="dummy"), K = 8192, batch 1 / 8 / 32:
# stock vLLM with CUDA graphs against the plugin (piecewise CUDA graphs between its ops). Needs vLLM 0.32 in the
# image (`pip install 'epikv[vllm]'`; its wheel is too big to carry); without it the part says so and is skipped.
if [ "${GPU_CHECK_SMOKE:-0}" = 1 ]; then
    VLLM_ARGS=(--shape qwen3-8b --layers 2 --budget 96 --batches 1,2 --prompt 48 --new 64 --smoke); VLLM_LIMIT=$LIMIT
else
    VLLM_ARGS=(--shape qwq-32b --budget 8192 --batches 1,8,32 --prompt 1024 --new 8704); VLLM_LIMIT=240
fi
if "$PY" -c "import vllm" >/dev/null 2>&1; then
    echo "== issue38_vllm: benchmarks/vllm_gpu.py ${VLLM_ARGS[*]}" >>"$LOG"
    timeout "$VLLM_LIMIT" "$PY" benchmarks/vllm_gpu.py "${VLLM_ARGS[@]}" --json "$OUT/issue38_vllm.json" >>"$LOG" 2>&1
    echo "== issue38_vllm: exit $?" >>"$LOG"
else
    echo "== issue38_vllm: skipped, vLLM is not installed in this image" >>"$LOG"
fi
cat "$LOG"
