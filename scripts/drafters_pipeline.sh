#!/usr/bin/env bash
# The issue-3/4 long job in one resumable chain (each step resumes or skips when done):
# engines for the shipped DSpark drafter, the two baselines' training, then the acceptance evals.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
$PY -m dspark.cli engines --drafter dspark --out build/engines
for k in dflash eagle3; do
  [ -f drafters/$k/drafter.json ] || $PY -m dspark.cli train --kind $k --steps "${TRAIN_STEPS:-500}"
done
make eval
