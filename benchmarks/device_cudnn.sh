#!/usr/bin/env bash
# cuDNN attention on a lent GPU machine: causal attention's lowerings side by side
# (benchmarks/cudnn_attention.py), @taso_jax.optimize on transformer workloads
# (benchmarks/device_transformers.sh) in bfloat16 and float32, and kernels collected for
# the GPU's calibration (benchmarks/calibrate.py collect).
#
# Runs on the device machine, in the repository root, with the wheels it lacks in .whl/
# (platformdirs) carried. Writes into $OUT: cudnn_attention.{json,txt}, the files of
# device_transformers.sh (log.txt, transformers.jsonl, costs.sqlite), gpu_kernels.jsonl
# with its .rewrites.jsonl. Each part runs under its own time limit in seconds (0 skips it).
#
#   MODELS="causal_attention llama_block" SEQ=1024,2048 bash benchmarks/device_cudnn.sh
#   MICRO_SECONDS=0 BF16_SECONDS=0 FP32_SECONDS=0 CALIBRATE_SECONDS=200 \
#       CALIBRATE_MODELS="taso:nasrnn:small jax:causal_attention:1024" bash benchmarks/device_cudnn.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
export PYTHONPATH=/tmp/site:.
if [ "${MICRO_SECONDS:-150}" != 0 ]; then
    timeout "${MICRO_SECONDS:-150}" python3 benchmarks/cudnn_attention.py \
        --seq "${MICRO_SEQ:-1024,2048,4096}" --dtype bfloat16,float32 --rounds 20 \
        --json "$OUT/cudnn_attention.json" 2>&1 | grep -v "cuda_timer\|Delay kernel" \
        | tee "$OUT/cudnn_attention.txt"
fi
if [ "${BF16_SECONDS:-300}" != 0 ]; then
    read -r -a models <<< "${MODELS:-causal_attention llama_block}"
    DTYPE=bfloat16 timeout "${BF16_SECONDS:-300}" bash benchmarks/device_transformers.sh \
        "${models[@]}"
fi
if [ "${FP32_SECONDS:-90}" != 0 ]; then
    read -r -a fp32 <<< "${FP32_MODELS:-causal_attention}"
    DTYPE=float32 SEQ="${FP32_SEQ:-2048}" timeout "${FP32_SECONDS:-90}" \
        bash benchmarks/device_transformers.sh "${fp32[@]}"
fi
if [ "${CALIBRATE_SECONDS:-0}" != 0 ]; then
    read -r -a calib <<< "${CALIBRATE_MODELS:-}"
    timeout "${CALIBRATE_SECONDS}" python3 benchmarks/calibrate.py collect \
        --out "$OUT/gpu_kernels.jsonl" --cost-cache "${CALIBRATION_CACHE:-/tmp/gpu_calibration.sqlite}" \
        --per-model "${PER_MODEL:-25}" --rewrites "${REWRITES:-6}" \
        --time-per-model "${TIME_PER_MODEL:-3}" --only "${calib[@]}" 2>&1 \
        | grep -v "cuda_timer\|Delay kernel" | tail -40 | tee "$OUT/calibrate_log.txt"
fi
exit 0
