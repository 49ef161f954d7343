"""Is a candidate drafter's held-out τ really higher? A paired bootstrap over the eval prompts.

The ship rule of issue 12 compares τ per eval set of a candidate against the shipped drafter,
measured on the same prompts (`dspark eval`, 24 per set in `make eval`). With a few dozen prompts
per set the macro τ moves by a few percent between neighbouring checkpoints, so a +2% candidate
may be noise. This resamples prompts with replacement — the same draw for both drafters, since
both decoded the same prompts (the `request` array of each .rounds.npz) — recomputes τ per cell
(Σ(accepted + 1) / rounds over the drawn prompts' rounds), and reports the ratio candidate /
shipped of the macro per temperature and of the mean over all cells: the ratio measured and its
5–95% interval, and how often the candidate wins under resampling.

    python -m dspark.perf.eval_compare --a docs/acceptance/evals --b artifacts/next5/evals \\
        [--drafters dspark,dflash] [--boot 4000]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark.prompts import EVAL_SETS

SETS = tuple(EVAL_SETS)


@dataclass
class Cell:
    """One eval cell's rounds, summed per prompt: Σ(accepted + 1) and the number of rounds."""

    committed: np.ndarray  # [P]
    rounds: np.ndarray  # [P]

    @property
    def tau(self) -> float:
        return float(self.committed.sum() / self.rounds.sum())


def load_cell(path: Path) -> Cell:
    """A .rounds.npz file as per-prompt sums (its `request` array says whose round each is)."""
    z = np.load(path)
    if "request" not in z.files:
        raise ValueError(f"{path} has no `request` array (written since session 16): rerun `dspark eval`")
    req = z["request"].astype(int)
    n = int(req.max()) + 1 if len(req) else 0
    committed = np.bincount(req, weights=z["accepted"] + 1.0, minlength=n)
    rounds = np.bincount(req, minlength=n).astype(float)
    return Cell(committed, rounds)


def paired_cells(a_dir: Path, b_dir: Path, drafter: str) -> dict[tuple[str, int], tuple[Cell, Cell]]:
    """Cells (set, T) present in both folders. Both must have decoded the same prompts: `dspark
    eval --limit N` takes a seeded subset of N in file order, so evals with different limits hold
    different prompts at the same request index (and other T = 1 seeds): refused, not cut."""
    out = {}
    for s in SETS:
        for t in (0, 1):
            name = f"{drafter}-{s}-T{t}.rounds.npz"
            if not ((a_dir / name).exists() and (b_dir / name).exists()):
                continue
            a, b = load_cell(a_dir / name), load_cell(b_dir / name)
            if len(a.rounds) != len(b.rounds):
                raise ValueError(
                    f"{name}: {len(a.rounds)} prompts in {a_dir}, {len(b.rounds)} in {b_dir}: not the same "
                    "prompts; evaluate both with the same `dspark eval --limit`"
                )
            out[(s, t)] = (a, b)
    return out


def bootstrap_ratios(
    cells: dict[tuple[str, int], tuple[Cell, Cell]], boot: int, seed: int = 0
) -> dict[str, np.ndarray]:
    """Ratio b / a of the mean τ over each group of cells (per T, and all), per bootstrap draw;
    draw 0 is the data itself (no resampling)."""
    rng = np.random.default_rng(seed)
    groups: dict[str, list[tuple[str, int]]] = {}
    for key in sorted(cells, key=lambda k: (k[1], k[0])):
        groups.setdefault(f"T={key[1]}", []).append(key)
    groups["all"] = sorted(cells)
    taus = {key: np.empty((boot + 1, 2)) for key in cells}
    for key, (a, b) in cells.items():
        p = len(a.rounds)
        idx = np.vstack([np.arange(p), rng.integers(0, p, size=(boot, p))])
        for j, c in enumerate((a, b)):
            taus[key][:, j] = c.committed[idx].sum(1) / c.rounds[idx].sum(1)
    ratios = {}
    for g, keys in groups.items():
        mean = np.mean([taus[k] for k in keys], axis=0)  # [boot + 1, 2]
        ratios[g] = mean[:, 1] / mean[:, 0]
    return ratios


def report(a_dir: Path, b_dir: Path, drafters: list[str], boot: int, seed: int) -> str:
    lines = [
        f"a = {a_dir}, b = {b_dir}; paired bootstrap over prompts, {boot} draws",
        "",
        "| drafter | cell | prompts | τ a | τ b | b / a |",
        "|---|---|---|---|---|---|",
    ]
    summary = ["", "| drafter | cells | mean τ b / a | 5–95% | P(b > a) |", "|---|---|---|---|---|"]
    for d in drafters:
        cells = paired_cells(a_dir, b_dir, d)
        if not cells:
            lines.append(f"| {d} | no cell in both folders | | | | |")
            continue
        for (s, t), (a, b) in sorted(cells.items()):
            lines.append(
                f"| {d} | {s} T={t} | {len(a.rounds)} | {a.tau:.3f} | {b.tau:.3f} | {b.tau / a.tau:.3f} |"
            )
        for g, r in bootstrap_ratios(cells, boot, seed).items():
            lo, hi = np.percentile(r[1:], [5, 95])
            summary.append(f"| {d} | {g} | {r[0]:.3f} | {lo:.3f}–{hi:.3f} | {(r[1:] > 1).mean():.2f} |")
    return "\n".join(lines + summary)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", default="docs/acceptance/evals", help="the shipped drafters' evals")
    ap.add_argument("--b", required=True, help="the candidates' evals")
    ap.add_argument("--drafters", default="dspark,dflash")
    ap.add_argument("--boot", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    try:
        print(report(Path(args.a), Path(args.b), args.drafters.split(","), args.boot, args.seed))
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None


if __name__ == "__main__":
    main()
