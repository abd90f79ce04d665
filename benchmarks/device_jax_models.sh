#!/usr/bin/env bash
# @taso_jax.optimize on the JAX model registry (examples/jax_models.py) on a lent GPU machine.
#
# Runs on the device machine, in the repository root, with the wheels it lacks in .whl/
# (platformdirs; flax and equinox are in its image) carried. One benchmarks/jax_models.py
# process per model, so a run cut off at the command's limit keeps every model it finished:
# each prints its own table into $OUT/log.txt and writes $OUT/jax_models.jsonl.
#
#   bash benchmarks/device_jax_models.sh nasrnn nasrnn_1d flax_resnet50
#
# Any arguments name the models (default: all but tiny_attention, as benchmarks/jax_models.py);
# DTYPE=bfloat16 runs them with bfloat16 weights and inputs.
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
export PYTHONPATH=/tmp/site:.
export TASO_JAX_COST_CACHE="$OUT/costs.sqlite"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import jax; print(jax.__version__, jax.devices())" | tee -a "$OUT/device.txt"
models=("$@")
if [ ${#models[@]} -eq 0 ]; then
    models=(nasrnn nasrnn_1d flax_resnet50 flax_bert_block eqx_convnet flax_vit_block
            flax_causal_lm flax_lstm eqx_attention eqx_mlp flax_cnn_bn stax_resnet)
fi
for m in "${models[@]}"; do
    over=0
    [ "$m" = "${models[-1]}" ] && over=2000
    python3 benchmarks/jax_models.py "$m" --repeats "${REPEATS:-30}" --overhead-rounds "$over" \
        --dtype "${DTYPE:-float32}" \
        --json "$OUT/row_$m.json" 2>&1 | grep -v "cuda_timer\|Delay kernel" | tee -a "$OUT/log.txt" \
        || { echo "$m: no row (exit status above)" | tee -a "$OUT/log.txt"; continue; }
    python3 -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1]))))" \
        "$OUT/row_$m.json" >> "$OUT/jax_models.jsonl" && rm -f "$OUT/row_$m.json"
done
