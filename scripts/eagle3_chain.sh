#!/usr/bin/env bash
# Issue-3 catch-up on a fresh machine, resumable: engines, target cache from the committed
# answers, the EAGLE-3-style baseline's training (checkpoints in artifacts/runs/eagle3), then
# every acceptance cell (skipping cells already written) and the report.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
echo "[chain] $(date -u +%FT%TZ) engines"
[ -f build/engines/manifest.json ] || $PY -m dspark.cli engines --drafter dspark --out build/engines
echo "[chain] $(date -u +%FT%TZ) target cache"
$PY -m dspark.cli data --no-generate
echo "[chain] $(date -u +%FT%TZ) train eagle3"
[ -f drafters/eagle3/drafter.json ] || $PY -m dspark.cli train --kind eagle3 --steps "${TRAIN_STEPS:-500}"
echo "[chain] $(date -u +%FT%TZ) eval"
make eval EVAL_SKIP_DONE=1
echo "[chain] $(date -u +%FT%TZ) done"
