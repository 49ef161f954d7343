#!/usr/bin/env bash
# The issue-3/4 long job in one resumable chain (each step resumes or skips what is done):
# engines for the shipped DSpark drafter, the target cache from the committed answers, the
# drafters not trained yet (checkpoints in artifacts/runs/<kind>), then every acceptance cell not
# written yet (docs/acceptance/evals) and the report.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
stamp() { echo "[pipeline] $(date -u +%FT%TZ) $*"; }
stamp engines
[ -f build/engines/manifest.json ] || $PY -m dspark.cli engines --drafter dspark --out build/engines
stamp "target cache"
$PY -m dspark.cli data --no-generate
for k in dspark dflash eagle3; do
  stamp "train $k"
  [ -f drafters/$k/drafter.json ] || $PY -m dspark.cli train --kind $k --steps "${TRAIN_STEPS:-500}"
done
stamp eval
make eval EVAL_SKIP_DONE=1
stamp done
