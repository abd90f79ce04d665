#!/usr/bin/env bash
# TASO's benchmark suite on a lent GPU machine, one piece per call (10 minutes a command).
#
# Runs on the device machine, in the repository root, with the wheels it lacks in .whl/
# (z3-solver, platformdirs) and the kernel cost cache of earlier pieces in .gpu_cache/
# (both carried: they are ignored by git). Earlier pieces' result rows travel in
# benchmarks/results/ with the working tree; this piece adds its own. Everything it writes
# goes to $OUT: the results files, the log and the updated cost cache, to be copied back
# (results into benchmarks/results/, costs.sqlite into .gpu_cache/) before the next piece.
# A piece stops itself after PIECE_SECONDS (570 s); its measured kernels still come back,
# so running the same piece again goes faster.
#
#   bash benchmarks/device_suite.sh resnet50 nasnet_a --no-scaling
#   bash benchmarks/device_suite.sh resnext50 nasrnn bert_large inception_v3 --no-scaling
#   bash benchmarks/device_suite.sh --scaling-only
#
# Any arguments go to benchmarks/taso_suite.py.
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
mkdir -p "$OUT/results"
cp benchmarks/results/gpu_* "$OUT/results/" 2>/dev/null || true
# the cost cache lives in $OUT while the piece runs, so that a piece cut off at the time
# limit still returns every kernel it measured
cp .gpu_cache/costs.sqlite "$OUT/costs.sqlite" 2>/dev/null || true
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import jax; print(jax.__version__, jax.devices())" | tee -a "$OUT/device.txt"
status=0
timeout "${PIECE_SECONDS:-570}" python3 benchmarks/taso_suite.py --out "$OUT/results" \
    --cost-cache "$OUT/costs.sqlite" "$@" 2>&1 | tee "$OUT/log.txt" || status=$?
exit "$status"
