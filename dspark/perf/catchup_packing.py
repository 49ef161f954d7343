"""What a drafter catch-up costs when its rows wait with different numbers of positions: the
padded context call (every row to the longest, what `OrtDrafterRunner._flush` did before session
16) against the packed one it makes now (the rows' positions one after another in one row).

    python -m dspark.perf.catchup_packing --engines build/engines --rows 64 --threads 2

Cases: a refresh (every row waiting ~32 positions, a few more or less), first drafts of prompts
of different lengths (uniform in 30..--longest), and one long prompt among short refreshes. Per
case the best of --repeats context calls for each layout, and the positions each one computes.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="build/engines")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--longest", type=int, default=600, help="the longest first-draft prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    from dspark.engines.ort import session

    eng = Path(args.engines)
    if not (eng / "drafter_meta.json").exists():
        raise SystemExit(f"no drafter engines in {eng}: run `make engines` first")
    meta = json.loads((eng / "drafter_meta.json").read_text())
    sess = session(eng / meta["files"]["drafter_context"], args.threads)
    F = meta["config"]["feature_size"]
    rng = np.random.default_rng(0)
    R = args.rows
    cases = {
        "refresh (28-36 each)": rng.integers(28, 37, R),
        f"first drafts (30-{args.longest})": rng.integers(30, args.longest + 1, R),
        f"refresh + one prompt of {args.longest}": np.r_[rng.integers(28, 37, R - 1), args.longest],
    }

    def best(feed) -> float:
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            sess.run(None, feed)
            times.append(time.perf_counter() - t0)
        return min(times)

    print(f"{R} rows, {args.threads} threads, best of {args.repeats}")
    print("| case | positions needed | padded: positions computed | padded s | packed s | padded / packed |")
    print("|---|---|---|---|---|---|")
    for name, n in cases.items():
        n = n.astype(np.int64)
        T = int(n.max())
        padded = {
            "features": rng.standard_normal((R, T, F)).astype(np.float32),
            "positions": np.tile(np.arange(T, dtype=np.int64), (R, 1)),
        }
        total = int(n.sum())
        packed = {
            "features": rng.standard_normal((1, total, F)).astype(np.float32),
            "positions": np.concatenate([np.arange(k, dtype=np.int64) for k in n])[None],
        }
        a, b = best(padded), best(packed)
        print(f"| {name} | {total:,} | {R * T:,} | {a:.3f} | {b:.3f} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
