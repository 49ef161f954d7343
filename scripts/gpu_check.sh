#!/usr/bin/env bash
# `make gpu-check`: the GPU half of the project in one run on one NVIDIA GPU (~8 minutes):
# TensorRT plans, parity against PyTorch on the GPU (a failure → exit 1), the gpu-profile
# tritonserver, an SPS sweep and a short bench → results/gpu/ (phase-*.json, parity, sps, bench, summary)
#
# Offline (a GPU machine that cannot download anything), prepare beside the checkout first, on a
# machine that can (scripts/prepare_gpu_offline.sh does both):
#   ../gpu-wheels/   every wheel of requirements.txt + requirements-gpu.txt (+ the few setup.sh adds)
#   ../gpu-cache/smollm2-135m-instruct/   the fp32 SmolLM2 checkpoint + tokenizer (DSPARK_CACHE)
# Settings (environment): PY (a Python that already has the GPU stack), GPU_WHEELS, DSPARK_CACHE,
# GPU_CHECK_TIMEOUT (seconds for the Python part, default 540), and any `dspark gpu-check` flag
# as arguments (e.g. --runtime ort, --precision fp32,fp16, --tritonserver /opt/tritonserver/bin/tritonserver).
set -euo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
say() { echo "gpu-check: [$(( $(date +%s) - T0 )) s] $*"; }

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: no NVIDIA GPU here (nvidia-smi missing or failing): this check needs one GPU and its driver" >&2
  exit 2
fi
say "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)"

export GPU_WHEELS=${GPU_WHEELS:-../gpu-wheels}
if [ -z "${DSPARK_CACHE:-}" ] && [ -d ../gpu-cache ]; then export DSPARK_CACHE=$(cd ../gpu-cache && pwd); fi
PY=${PY:-.venv/bin/python}
if ! "$PY" -c 'import sys, torch, tensorrt; sys.exit(not torch.cuda.is_available())' >/dev/null 2>&1; then
  say "installing the GPU stack (make setup GPU=1$( [ -d "$GPU_WHEELS" ] && echo ", offline from $GPU_WHEELS"))"
  GPU=1 bash scripts/setup.sh
  PY=.venv/bin/python
fi
"$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' || {
  echo "gpu-check: torch $("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)') sees no GPU (driver too old for its CUDA?)" >&2
  exit 2
}
mkdir -p results/gpu
say "running dspark gpu-check (log: results/gpu/gpu-check.log)"
set +e
timeout "${GPU_CHECK_TIMEOUT:-540}" "$PY" -m dspark.cli gpu-check "$@" 2>&1 | tee results/gpu/gpu-check.log
code=${PIPESTATUS[0]}
set -e
[ "$code" = 124 ] && echo "gpu-check: the Python part ran past ${GPU_CHECK_TIMEOUT:-540} s; what it measured is in results/gpu" >&2
say "done (exit $code); summary: results/gpu/summary.md"
exit "$code"
