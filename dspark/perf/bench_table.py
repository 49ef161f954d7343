"""A `dspark bench` JSON as the markdown table docs/results.md shows: per concurrency, each
mode's aggregate and per-user tok/s as a multiple of `off`, per repeat pair (median, range),
with the counters that explain them.

    python -m dspark.perf.bench_table results/bench-issue18.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def _pairs(runs: list[dict], mode: str, c: int, key: str) -> list[float]:
    """mode / off of `key` for each repeat in which both ran at concurrency c."""
    by = {(r["mode"], r["repeat"]): r for r in runs if r["concurrency"] == c}
    out = []
    for (m, rep), r in sorted(by.items(), key=lambda kv: kv[0][1]):
        off = by.get(("off", rep))
        if m == mode and off and off[key]:
            out.append(r[key] / off[key])
    return out


def _ratio(values: list[float]) -> str:
    if not values:
        return "–"
    med = statistics.median(values)
    return f"{med:.2f} ({min(values):.2f}–{max(values):.2f})" if len(values) > 1 else f"{med:.2f}"


def table(data: dict) -> str:
    runs, cells = data["repeat_runs"], {(r["mode"], r["concurrency"]): r for r in data["runs"]}
    modes = [m for m in dict.fromkeys(r["mode"] for r in data["runs"]) if m != "off"]
    conc = sorted({r["concurrency"] for r in data["runs"]})
    head = ["c", "off agg tok/s"] + [f"{m} agg × off" for m in modes] + ["off per-user tok/s"]
    head += [f"{m} per-user × off" for m in modes]
    head += [
        "τ " + " / ".join(modes),
        "step ms off / " + " / ".join(modes),
        "BLS calls/step off / " + " / ".join(modes),
    ]
    skip = "dspark-skip" in modes
    if skip:
        head.append("skip draft rounds/step merit / refresh / new")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in conc:
        off = cells.get(("off", c))
        if off is None:
            continue
        row = [str(c), f"{off['aggregate_tps']:.1f}"]
        row += [_ratio(_pairs(runs, m, c, "aggregate_tps")) for m in modes]
        row.append(f"{off['per_user_tps']:.2f}")
        row += [_ratio(_pairs(runs, m, c, "per_user_tps")) for m in modes]
        got = [cells.get((m, c)) for m in modes]
        row.append(" / ".join(f"{g['tau']:.2f}" if g else "–" for g in got))
        row.append(" / ".join(f"{g['step_ms']:.0f}" if g else "–" for g in [off, *got]))
        row.append(" / ".join(f"{g['bls_calls_per_step']:.2f}" if g else "–" for g in [off, *got]))
        if skip:
            s = cells.get(("dspark-skip", c)) or {}
            d = s.get("draft_rounds_per_step") or {}
            row.append(" / ".join(f"{d.get(k, 0.0):.3f}" for k in ("merit", "refresh", "new")))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench_json")
    args = ap.parse_args(argv)
    data = json.loads(Path(args.bench_json).read_text())
    spread = data.get("settings", {}).get("length_spread") or 0
    lengths = f", max tokens ×[{1 - spread:g}, {1 + spread:g}] per request" if spread else ""
    print(f"{args.bench_json}: {data.get('date')}, {data.get('machine')}{lengths}")
    print(table(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
