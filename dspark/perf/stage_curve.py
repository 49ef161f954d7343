"""Held-out τ of every shipped drafter stage, read back from git history (issue 12, item 4).

Each shipped stage replaced drafters/K/drafter.json and docs/acceptance/evals/K-*.json in one commit,
so the history holds the whole curve: this walks the commits that touched the evals, pairs each
drafter's evals with its drafter.json at that commit (total steps and supervised draft positions,
summed down the `continued_from` chain), and draws held-out τ (macro over the eval sets, greedy
and T = 1) against supervised positions for DSpark, DFlash and the EAGLE-3-style baseline (one
point: trained once, on the first stage's budget). The eval protocol changed at stage 8 (12 → 24
prompts per set): the two series are drawn apart, and the fit uses the 24-prompt points only.

The fit, τ = a + b · ln(positions) per eval set over the last `--fit-last` points, says how many
supervised positions the goal τ would take if the curve kept its recent slope — a projection of
this recipe (same data mix, same model size), not a promise: a log-linear curve never flattens,
the real one will.

    python -m dspark.perf.stage_curve [--png docs/acceptance/heldout_by_stage.png]
        [--json results/heldout_by_stage.json] [--fit-last 4]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dspark.prompts import EVAL_SETS

SETS = tuple(EVAL_SETS)
KINDS = ("dspark", "dflash", "eagle3")
GOALS = {0: 2.5, 1: 2.0}  # issue 12: DSpark τ on every eval set, greedy / T = 1
EVALS = "docs/acceptance/evals"


@dataclass
class StagePoint:
    kind: str
    commit: str
    date: str
    steps: int
    positions: int  # supervised draft positions, all stages
    prompts: int  # per eval set
    tau: dict[tuple[str, int], float] = field(default_factory=dict)  # (set, T) → τ

    def macro(self, t: int) -> float:
        vals = [self.tau[(s, t)] for s in SETS if (s, t) in self.tau]
        return float(np.mean(vals)) if len(vals) == len(SETS) else math.nan


def chain_totals(summary: dict) -> tuple[int, int]:
    """(steps, supervised positions) of a drafter and every stage it was continued from."""
    steps = positions = 0
    node: dict | None = summary
    while node:
        steps += int(node.get("steps", 0))
        positions += int(node.get("supervised_slots", 0))
        node = node.get("continued_from")
    return steps, positions


def fit_log(positions: np.ndarray, tau: np.ndarray) -> tuple[float, float]:
    """Least squares τ = a + b · ln(positions)."""
    b, a = np.polyfit(np.log(np.asarray(positions, float)), np.asarray(tau, float), 1)
    return float(a), float(b)


def positions_for(a: float, b: float, goal: float) -> float:
    """Supervised positions where the fitted line reaches `goal` (inf when it does not rise)."""
    return math.exp((goal - a) / b) if b > 0 else math.inf


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)


def _show_json(repo: Path, commit: str, path: str) -> dict | None:
    r = _git(repo, "show", f"{commit}:{path}")
    return json.loads(r.stdout) if r.returncode == 0 else None


def stage_points(repo: Path) -> list[StagePoint]:
    """One point per drafter, total steps and eval protocol; a later commit's evals of the same
    drafter replace an earlier one's (a re-run of the same cells)."""
    log = _git(repo, "log", "--reverse", "--format=%H %ad", "--date=short", "--", EVALS)
    log.check_returncode()
    commits = log.stdout.split("\n")
    points: dict[tuple[str, int, int], StagePoint] = {}
    budget_of_first: tuple[int, int] | None = None
    for line in filter(None, commits):
        commit, date = line.split()
        for kind in KINDS:
            evals = {
                (s, t): _show_json(repo, commit, f"{EVALS}/{kind}-{s}-T{t}.json")
                for s in SETS
                for t in (0, 1)
            }
            evals = {k: v for k, v in evals.items() if v}
            if not evals:
                continue
            meta = _show_json(repo, commit, f"drafters/{kind}/drafter.json")
            if meta is not None:
                steps, positions = chain_totals(meta["summary"])
                budget_of_first = budget_of_first or (steps, positions)
            elif budget_of_first is not None:  # the EAGLE-3-style baseline: the first stage's budget
                steps, positions = budget_of_first
            else:
                continue
            prompts = max(int(v["prompts"]) for v in evals.values())
            tau = {k: float(v["tau"]) for k, v in evals.items()}
            seen = points.get((kind, steps, prompts))
            if seen is None or seen.tau != tau:  # unchanged files keep the commit that made them
                points[(kind, steps, prompts)] = StagePoint(
                    kind, commit[:7], date, steps, positions, prompts, tau
                )
    return sorted(points.values(), key=lambda p: (KINDS.index(p.kind), p.prompts, p.positions))


def projections(points: list[StagePoint], kind: str, fit_last: int) -> dict:
    """Per eval set and temperature: the fitted line over the kind's last `fit_last` points of the
    newest protocol, and the positions at which it reaches the goal."""
    newest = max((p.prompts for p in points if p.kind == kind), default=0)
    series = [p for p in points if p.kind == kind and p.prompts == newest][-fit_last:]
    out: dict = {"points": len(series), "prompts": newest, "cells": {}}
    if len(series) < 2:
        return out
    x = np.array([p.positions for p in series], float)
    out["positions_fitted"] = [int(x.min()), int(x.max())]
    for t, goal in GOALS.items():
        for s in SETS:
            y = np.array([p.tau[(s, t)] for p in series])
            a, b = fit_log(x, y)
            out["cells"][f"{s}-T{t}"] = {
                "a": a,
                "b_per_e": b,
                "gain_per_doubling": b * math.log(2),
                "goal": goal,
                "tau_now": float(y[-1]),
                "positions_for_goal": positions_for(a, b, goal),
            }
    return out


def markdown(points: list[StagePoint], proj: dict, last: StagePoint) -> str:
    """The points as a table, then the projection; `last` (the newest DSpark point) converts
    positions into multiples of today's and into steps at its positions per step."""
    now, per_step = last.positions, last.positions / last.steps
    lines = [
        "| drafter | commit | steps | supervised positions | prompts/set | greedy macro | T = 1 macro |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in points:
        lines.append(
            f"| {p.kind} | {p.commit} ({p.date}) | {p.steps:,} | {p.positions / 1e3:,.0f} k | "
            f"{p.prompts} | {p.macro(0):.3f} | {p.macro(1):.3f} |"
        )
    lines += [
        "",
        f"DSpark, log-linear fit over its last {proj['points']} points ({proj['prompts']} prompts per set):",
        "",
        "| cell | τ now | gain per doubling of positions | positions for the goal | × now | steps at "
        f"{per_step:,.0f} positions/step |",
        "|---|---|---|---|---|---|",
    ]
    for cell, c in proj["cells"].items():
        need = c["positions_for_goal"]
        head = f"| {cell} (goal {c['goal']}) | {c['tau_now']:.2f} | {c['gain_per_doubling']:+.3f} | "
        if not math.isfinite(need):
            lines.append(head + "never (not rising) | – | – |")
        elif need > 1000 * now:
            lines.append(head + "beyond reach (> 1,000 × now) | – | – |")
        else:
            lines.append(head + f"{need / 1e6:,.0f} M | {need / now:,.1f} | {need / per_step:,.0f} |")
    return "\n".join(lines)


def plot(points: list[StagePoint], proj: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"dspark": "tab:blue", "dflash": "tab:orange", "eagle3": "tab:green"}
    names = {"dspark": "DSpark", "dflash": "DFlash", "eagle3": "EAGLE-3-style (not continued)"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharex=True)
    for ax, t in zip(axes, (0, 1)):
        for kind in KINDS:
            for prompts in sorted({p.prompts for p in points if p.kind == kind}):
                ser = [p for p in points if p.kind == kind and p.prompts == prompts]
                ax.plot(
                    [p.positions / 1e6 for p in ser],
                    [p.macro(t) for p in ser],
                    marker="o",
                    color=colors[kind],
                    mfc=colors[kind] if prompts == proj["prompts"] else "white",  # the newest protocol
                    ls="-" if prompts == proj["prompts"] else ":",
                    label=f"{names[kind]}, {prompts} prompts/set",
                )
        ax.set_xscale("log")
        ax.set_xlabel("supervised draft positions (M, log)")
        ax.set_ylabel("held-out τ, macro over 3 eval sets")
        ax.set_title("greedy" if t == 0 else "T = 1")
        ax.grid(alpha=0.3)
        cells = [proj["cells"].get(f"{s}-T{t}") for s in SETS]
        if all(cells):
            lo, hi = proj["positions_fitted"]
            x = np.geomspace(lo, 4 * hi, 50)  # from the fitted points to 4 × the newest
            fitted = np.mean([c["a"] + c["b_per_e"] * np.log(x) for c in cells], axis=0)
            ax.plot(x / 1e6, fitted, "--", color=colors["dspark"], alpha=0.5, label="DSpark, log-linear fit")
        ax.axhline(GOALS[t], color="grey", lw=0.8, ls="--")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle("Held-out τ of every shipped stage (γ = 7, every draft verified; from git history)")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, default=Path("."))
    ap.add_argument("--png", type=Path, default=Path("docs/acceptance/heldout_by_stage.png"))
    ap.add_argument("--json", type=Path, default=Path("results/heldout_by_stage.json"))
    ap.add_argument("--fit-last", type=int, default=4, help="points of DSpark's newest protocol in the fit")
    args = ap.parse_args(argv)
    points = stage_points(args.repo)
    if not any(p.kind == "dspark" for p in points):
        raise SystemExit(
            "no DSpark evals in this repository's history (a shallow clone? `git fetch --unshallow`)"
        )
    proj = projections(points, "dspark", args.fit_last)
    last = max((p for p in points if p.kind == "dspark"), key=lambda p: p.positions)
    print(markdown(points, proj, last))
    plot(points, proj, args.png)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "points": [
                    {**p.__dict__, "tau": {f"{s}-T{t}": v for (s, t), v in p.tau.items()}} for p in points
                ],
                "dspark_projection": proj,
            },
            indent=2,
        )
    )
    print(f"→ {args.png}, {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
