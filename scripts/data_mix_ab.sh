#!/usr/bin/env bash
# Issue 12: which data trains the better drafter at an equal budget? Three DSpark runs with the same
# steps, anchors, vocabulary and seed on on-policy answers only, reference answers only, and both;
# each evaluated greedily on the three held-out eval sets (τ with every draft verified, γ = 7).
# Resumable: a finished run or evaluation is skipped. Results: docs/acceptance/mix/*.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
STEPS=${STEPS:-160}
SEQS=${SEQS:-2}
THREADS=${THREADS:-1}
SHARED=${DSPARK_SHARED:-../shared}
OUT=docs/acceptance/mix
mkdir -p "$OUT"
for mix in on-policy reference mix; do
  ship=artifacts/ab/$mix
  if [ ! -f "$ship/drafter.json" ]; then
    $PY -m dspark.cli train --kind dspark --data-mix "$mix" --steps "$STEPS" --seqs-per-step "$SEQS" --anchors 128 \
      --out "artifacts/runs/ab-$mix" --ship "$ship" --sts-prompts 0 --threads "$THREADS" --log-every 10
  fi
  for s in gsm8k-test humaneval mt-bench; do
    [ -f "$OUT/$mix-$s.json" ] && continue
    $PY -m dspark.cli eval --drafter "$ship" --data "$SHARED/data/eval/$s.jsonl" --limit 12 \
      --max-new-tokens 96 --batch 8 --temperature 0 --threads "$THREADS" --json "$OUT/$mix-$s.json" \
      $( [ -f build/engines/target.opt.onnx ] && echo --engines build/engines )
  done
done
