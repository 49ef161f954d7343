#!/usr/bin/env bash
# Ship a `scripts/next_stage.sh` candidate that won its held-out comparison (issue 12: one shipped
# update per improvement):
#   1. OUT/dspark and OUT/dflash replace drafters/dspark and drafters/dflash (fp16 safetensors + json);
#   2. their evals (OUT/evals/*.json and .rounds.npz) replace the shipped ones in docs/acceptance/evals,
#      each JSON's `drafter` set to the kind and `evaluated_as` naming the candidate folder;
#   3. `dspark report` refreshes docs/acceptance (acceptance.md, the plots).
# Then by hand: the Makefile's `train` stages, `make engines`, the bench cells, docs/results.md.
#
#   bash scripts/ship_stage.sh artifacts/next5 "session 18"
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: scripts/ship_stage.sh OUT WHEN (e.g. artifacts/next5 "session 18")}
WHEN=${2:?say when it was shipped, e.g. "session 18"}
PY=${PY:-.venv/bin/python}
for k in dspark dflash; do
  for f in drafter.json drafter.safetensors; do
    [ -f "$OUT/$k/$f" ] || { echo "error: $OUT/$k/$f missing: did next_stage.sh finish?" >&2; exit 2; }
  done
  [ -n "$(ls "$OUT/evals/$k"-*.json 2>/dev/null)" ] || { echo "error: no evals of $k in $OUT/evals" >&2; exit 2; }
done
for k in dspark dflash; do
  cp "$OUT/$k/drafter.json" "$OUT/$k/drafter.safetensors" "drafters/$k/"
  for f in "$OUT/evals/$k"-*.json; do
    cp "${f%.json}.rounds.npz" docs/acceptance/evals/  # the per-round arrays go with their JSON
    "$PY" - "$f" "docs/acceptance/evals/$(basename "$f")" "$k" "$OUT/$k (the same files were then copied to drafters/, $WHEN)" <<'PYEOF'
import json, sys
src, dest, kind, note = sys.argv[1:]
d = json.load(open(src))
d.update(drafter=kind, evaluated_as=note)
json.dump(d, open(dest, "w"), indent=2)
PYEOF
  done
done
"$PY" -m dspark.cli report --evals docs/acceptance/evals
echo "shipped $OUT → drafters/; next: the Makefile's train stages, make engines, the bench cells, docs/results.md"
