#!/usr/bin/env bash
# Issue 12's next training stage in one background command, resumable at every step:
#   1. the target cache for every answer in artifacts/data/answers.jsonl (two cooperating
#      builders on one folder, one thread each: one from the start, one from the end);
#   2. DSpark and DFlash (KINDS) continued from the shipped drafters, side by side, one thread each
#      (STEPS at lr 3e-4; each run resumes from its own checkpoints), then DSpark's STS on 240
#      held-out rollouts (T = 1 and greedy, one core each: `dspark train`'s fit in half the time);
#   3. the held-out eval of the candidates (the `make eval` protocol: 24 prompts per set, γ = 7,
#      greedy and T = 1, verified on the ORT target engine);
#   4. τ per cell, candidate against the shipped drafter's docs/acceptance/evals, and the paired
#      bootstrap of the ratio (`python -m dspark.perf.eval_compare`).
# It ships nothing: copy OUT/K/ to drafters/K/ only when it wins (one shipped update per
# improvement), then `make engines` and the bench cells (issue 12, item 8).
#
#   nohup bash scripts/next_stage.sh > artifacts/next-stage.log 2>&1 &
# Settings: STEPS (800), OUT (artifacts/next), PY (.venv/bin/python), SHARED (../shared),
# GROW (empty: keep the shipped draft vocabulary; N: grow it to N tokens, `dspark train --grow-vocab`),
# LIMIT (24: prompts per eval set, `make eval`'s protocol since session 18; any other value also
# evaluates the shipped drafters on the same prompts, into OUT/evals-shipped, and the table compares
# against those), KINDS ("dspark dflash"), LAYERS (empty: keep the draft layers; N: deepen to N,
# `dspark train --layers N --init-from`, issue 12 item 5: deeper or shallower), CACHE (build: finish
# the target cache first; skip: train on the answers cached so far, e.g. a fresh machine's partial
# cache, where rebuilding all of it costs ~1.7 h of both cores).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
STEPS=${STEPS:-800}
OUT=${OUT:-artifacts/next}
SHARED=${SHARED:-../shared}
GROW=${GROW:-}
LIMIT=${LIMIT:-24}
KINDS=${KINDS:-dspark dflash}
LAYERS=${LAYERS:-}
CACHE=${CACHE:-build}
case "$CACHE" in build|skip) ;; *) echo "CACHE must be build or skip, not '$CACHE'" >&2; exit 2 ;; esac
export OMP_NUM_THREADS=1
mkdir -p "$OUT/evals"
say() { echo "[next-stage $(date -u +%H:%M:%S)] $*"; }

# the ORT target engine (make engines) runs the cache rebuild and the evals when it is there
engines=$([ -f build/engines/target.opt.onnx ] && echo "--engines build/engines" || true)
if [ "$CACHE" = skip ]; then
  say "answers: $(wc -l < artifacts/data/answers.jsonl); training on the $(find artifacts/cache -name '*.npz' ! -name '*.tmp.npz' | wc -l) cached"
else
  say "answers: $(wc -l < artifacts/data/answers.jsonl); building the target cache (2 builders)"
  # shellcheck disable=SC2086
  "$PY" -m dspark.cli data --no-generate --threads 1 $engines > "$OUT/cache-a.log" 2>&1 &
  # shellcheck disable=SC2086
  "$PY" -m dspark.cli data --no-generate --threads 1 --reverse $engines > "$OUT/cache-b.log" 2>&1 &
  wait
fi

say "training $KINDS ($STEPS steps each, side by side${LAYERS:+, $LAYERS draft layers})"
for k in $KINDS; do
  "$PY" -m dspark.cli train --kind "$k" --init-from "drafters/$k" --steps "$STEPS" --lr 3e-4 \
    --threads 1 --out "$OUT/runs/$k" --ship "$OUT/$k" ${GROW:+--grow-vocab "$GROW"} ${LAYERS:+--layers "$LAYERS"} \
    --sts-prompts 0 > "$OUT/train-$k.log" 2>&1 &
done
wait

if [[ " $KINDS " == *" dspark "* ]]; then
  # the STS `dspark train` would fit at the end (240 held-out prompts, T = 1 then greedy), its two
  # slices on the two cores: the same rounds in half the time
  say "STS of the DSpark candidate on held-out rollouts (dspark.perf.sts_refit)"
  slices=$("$PY" -c 'from dspark.training.evaluate import STS_PROMPTS, sts_slices as s
for start, n, t in s(STS_PROMPTS): print(start, n, f"{t:g}")')
  while read -r start n t; do
    "$PY" -m dspark.perf.sts_refit rollouts --drafter "$OUT/dspark" --start "$start" --count "$n" \
      --temperature "$t" --out "$OUT/sts-T$t.npz" > "$OUT/sts-T$t.log" 2>&1 &
  done <<< "$slices"
  wait
  "$PY" -m dspark.perf.sts_refit apply "$OUT"/sts-T*.npz --drafter "$OUT/dspark"
fi

say "held-out eval of the candidates ($LIMIT prompts per set)"
evaluate() {  # drafter folder, output folder
  for s in gsm8k-test humaneval mt-bench; do for t in 0 1; do
    out="$2/$(basename "$1")-$s-T$t.json"
    [ -f "$out" ] && continue
    # shellcheck disable=SC2086
    "$PY" -m dspark.cli eval --drafter "$1" --data "$SHARED/data/eval/$s.jsonl" --limit "$LIMIT" \
      --max-new-tokens 96 --batch 8 --temperature "$t" --threads 1 --json "$out" $engines
  done; done
}
base=docs/acceptance/evals
if [ "$LIMIT" != 24 ]; then base="$OUT/evals-shipped"; mkdir -p "$base"; fi
for k in $KINDS; do
  (evaluate "$OUT/$k" "$OUT/evals"
   [ "$base" = docs/acceptance/evals ] || evaluate "drafters/$k" "$base") > "$OUT/eval-$k.log" 2>&1 &
done
wait

say "τ per cell, shipped → candidate, and the paired bootstrap (dspark.perf.eval_compare)"
"$PY" -m dspark.perf.eval_compare --a "$base" --b "$OUT/evals" --drafters "${KINDS// /,}"
say "done"
