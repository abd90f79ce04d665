#!/usr/bin/env bash
# @taso_jax.optimize on the transformer registry (examples/transformer_models.py) on a lent GPU
# machine, in bfloat16 unless DTYPE says otherwise.
#
# Runs on the device machine, in the repository root, with the wheels it lacks in .whl/
# (platformdirs; flax and equinox are in its image) carried. BERT and GPT-2 need
# transformers < 5 and its dependencies among those wheels; without them their rows say
# "skipped: transformers not installed". One benchmarks/transformer_suite.py process per
# model, so a run cut off at the command's limit keeps every model it finished: each prints
# its own table into $OUT/log.txt and appends its rows to $OUT/transformers.jsonl.
#
#   bash benchmarks/device_transformers.sh causal_attention llama_block
#   SEQ=1024,4096 ROUNDS=50 bash benchmarks/device_transformers.sh causal_attention
#
# Any arguments name the models (default: all); SEQ (default 128,1024,2048), DTYPE (default
# bfloat16) and ROUNDS (default 30) go to the runner.
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
export PYTHONPATH=/tmp/site:.
export TASO_JAX_COST_CACHE="$OUT/costs.sqlite"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import jax; print(jax.__version__, jax.devices())" | tee -a "$OUT/device.txt"
python3 -c "import transformers; print('transformers', transformers.__version__)" \
    2>/dev/null | tee -a "$OUT/device.txt" || echo "transformers not installed" \
    | tee -a "$OUT/device.txt"
models=("$@")
if [ ${#models[@]} -eq 0 ]; then
    models=(causal_attention causal_attention_dpa llama_block llama_decode lora_mlp
            nnx_attention eqx_attention hf_bert hf_gpt2)
fi
for m in "${models[@]}"; do
    python3 benchmarks/transformer_suite.py "$m" --seq "${SEQ:-128,1024,2048}" \
        --dtype "${DTYPE:-bfloat16}" --rounds "${ROUNDS:-30}" --json "$OUT/rows_$m.json" 2>&1 \
        | grep -v "cuda_timer\|Delay kernel" | tee -a "$OUT/log.txt" \
        || { echo "$m: no rows (exit status above)" | tee -a "$OUT/log.txt"; continue; }
    python3 -c "import json,sys; [print(json.dumps(r)) for r in json.load(open(sys.argv[1]))['rows']]" \
        "$OUT/rows_$m.json" >> "$OUT/transformers.jsonl" && rm -f "$OUT/rows_$m.json"
done
