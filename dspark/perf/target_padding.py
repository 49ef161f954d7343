"""What a target step costs when its rows verify different numbers of drafts: one padded call
against the length groups OrtTargetRunner makes on the CPU (engines.ort.length_groups).

    python -m dspark.perf.target_padding --engines build/engines --rows 64 --threads 2

R rows with a past of --context tokens each; per case, the best of --repeats steps for the
padded call (group_overhead=None) and the grouped one, each followed by a rollback. The first
line (every row one token) is one call either way: it is the per-row cost; the grouped cases
should cost about that plus the drafts' rows.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="build/engines")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=300, help="cached positions per row")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    from dspark.engines.ort import OrtTargetRunner, session
    from dspark.models.target import TargetConfig

    torch.set_num_threads(1)
    eng = Path(args.engines)
    if not (eng / "target.opt.onnx").exists():
        raise SystemExit(f"no target engine in {eng}: run `make engines` first")
    cfg = TargetConfig.from_dict(json.loads((eng / "target_meta.json").read_text())["config"])
    R, P = args.rows, args.context
    sess = session(eng / "target.opt.onnx", args.threads)
    runners = {"padded": OrtTargetRunner(sess, cfg, R, P + 64, group_overhead=None)}
    runners["grouped"] = OrtTargetRunner(sess, cfg, R, P + 64)
    slots = list(range(R))
    for run in runners.values():
        assert [run.allocate() for _ in range(R)] == slots
        for i in range(0, R, 8):
            rows = slots[i : i + 8]
            run.step(rows, [[(7 * j + i) % 5000 + 100 for j in range(P)] for _ in rows], last_only=True)

    def best(run, tokens) -> float:
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            run.step(slots, tokens)
            times.append(time.perf_counter() - t0)
            for s in slots:
                run.rollback(s, P)
        return min(times)

    cases = [(0, 1), (1, 4), (1, 8), (max(2, R // 8), 8), (max(2, R // 4), 4)]
    print(f"target step, {R} rows × {P} cached positions, {args.threads} threads (best of {args.repeats}):")
    print(f"{'rows with n tokens':>22} {'padded ms':>10} {'grouped ms':>11} {'ratio':>6}")
    for k, n in cases:
        tokens = [[5] * n] * k + [[5]] * (R - k)
        a, b = best(runners["padded"], tokens), best(runners["grouped"], tokens)
        label = f"{k} × {n}, {R - k} × 1" if k else f"{R} × 1"
        print(f"{label:>22} {a * 1e3:10.0f} {b * 1e3:11.0f} {a / b:6.2f}")


if __name__ == "__main__":
    main()
