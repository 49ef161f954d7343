"""Would an online per-request logit offset bring ECE after STS under 2%? Replayed offline.

The shipped STS temperatures are fitted once, on held-out rollouts of the training mix; on the
eval sets the calibrated head is underconfident on gsm8k and overconfident on humaneval /
mt-bench (a domain offset one global calibration cannot remove). A server knows, after each
verification, which drafts of a request were accepted, so it could learn a per-request offset b
on the conditional logits (c_k = σ(z_k / T_k + b)) from that request's own past rounds: the
MAP estimate under a Gaussian prior of strength `prior`, refitted before every round, using
only earlier rounds (causal, so the replay is what a server would have seen). `stream` mode
keeps one offset for all the traffic of a set (the last 2,000 reached positions).

`--crossfit` asks the other question, whether a richer global form would transfer across
domains: per-position STS and per-position Platt scaling (slope and bias, c_k = σ(a_k z_k + b_k)),
each fitted left to right on the rounds of two eval sets (both temperatures) by the grid search
STS uses, and scored on the third set.

This replays the rounds of `dspark eval` (docs/acceptance/evals/KIND-SET-TT.rounds.npz, one row
per round, requests in order) and prints ECE after STS, as `calibration_report` computes it,
with and without the offset. Rounds belong to requests by the file's `request` array (written
since session 16); older files are split by the eval's token budget, which only holds where no
request stopped early (checked against the JSON's `prompts`; otherwise the cell is left out).

    python -m dspark.perf.calibration_online [--evals docs/acceptance/evals] [--drafter dspark]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from dspark.core.calibration import PRED_CLIP, STS, calibration_report, ece_rows, prefix_labels, sigmoid
from dspark.prompts import EVAL_SETS
from dspark.training.pipeline import load_drafter_meta

SETS = tuple(EVAL_SETS)


def split_requests(accepted: np.ndarray, budget: int) -> list[tuple[int, int]]:
    """[start, end) of each request's rounds: a request ends once it has committed `budget`."""
    bounds, start, committed = [], 0, 0
    for i, a in enumerate(accepted):
        committed += int(a) + 1
        if committed >= budget:
            bounds.append((start, i + 1))
            start, committed = i + 1, 0
    if start < len(accepted):
        bounds.append((start, len(accepted)))
    return bounds


def map_offset(z: np.ndarray, y: np.ndarray, prior: float) -> float:
    """argmin_b Σ BCE(σ(z + b), y) + prior·b²/2, by Newton's method (convex)."""
    b = 0.0
    for _ in range(25):
        p = sigmoid(z + b)
        step = ((p - y).sum() + prior * b) / ((p * (1 - p)).sum() + prior)
        b -= step
        if abs(step) < 1e-6:
            break
    return b


def replay(logits, accepted, verified, sts: STS, bounds, prior: float, mode: str) -> np.ndarray:
    """Calibrated logits z_k / T_k + b, b refitted before each round from earlier rounds only."""
    z = np.asarray(logits, dtype=np.float64) / np.asarray(sts.temperatures)
    out = np.empty_like(z)
    hist_z: list[np.ndarray] = []
    hist_y: list[np.ndarray] = []
    for start, end in bounds:
        if mode == "request":
            hist_z, hist_y = [], []
        for i in range(start, end):
            b = map_offset(np.concatenate(hist_z), np.concatenate(hist_y), prior) if hist_z else 0.0
            out[i] = z[i] + b
            reached = min(int(accepted[i]) + 1, int(verified[i]))
            hist_z.append(z[i, :reached])
            hist_y.append((np.arange(reached) < accepted[i]).astype(np.float64))
            if mode == "stream":
                while sum(len(h) for h in hist_z) > 2000:
                    hist_z.pop(0), hist_y.pop(0)
    return out


def fit_sequential(z, accepted, verified, slopes, biases, n_bins: int = 20) -> list[tuple[float, float]]:
    """Per position k, left to right, the (a_k, b_k) from the grid that minimises the ECE of the
    cumulative product Π_{i≤k} σ(a_i z_i + b_i) against the accepted-prefix labels; with biases
    (0,) and slopes 1/T this is STS's fit."""
    z = np.asarray(z, dtype=np.float64)
    labels, valid = prefix_labels(accepted, verified, z.shape[1])
    grid = [(float(a), float(b)) for a in slopes for b in biases]
    cum, params = np.ones(len(z)), []
    for k in range(z.shape[1]):
        m = valid[:, k]
        preds = np.array([cum[m] * sigmoid(a * z[m, k] + b) for a, b in grid])
        best = grid[int(np.argmin(ece_rows(np.clip(preds, PRED_CLIP, 1 - PRED_CLIP), labels[m, k], n_bins)))]
        params.append(best)
        cum = cum * sigmoid(best[0] * z[:, k] + best[1])
    return params


def crossfit(evals: Path, drafter: str) -> None:
    """Leave one eval set out: fit STS and per-position Platt on the other two, score the third."""
    data = {}
    for s in SETS:
        for t in (0, 1):
            r = np.load(evals / f"{drafter}-{s}-T{t}.rounds.npz")
            data[s, t] = (r["logits"].astype(np.float64), r["accepted"], r["verified"])
    shipped = STS.from_dict(load_drafter_meta(drafter)["sts"])
    identity = STS.identity(shipped.gamma)
    print(
        "| held-out set | T | STS shipped | STS, fitted on the other sets "
        "| Platt (slope, bias), fitted on the other sets |"
    )
    print("|---|---|---|---|---|")
    for hold in SETS:
        fit = [data[s, t] for s in SETS if s != hold for t in (0, 1)]
        z, acc, ver = (np.concatenate([f[i] for f in fit]) for i in range(3))
        sts = STS.fit(z, acc, ver, grid=np.linspace(0.2, 10.0, 200))
        platt = fit_sequential(z, acc, ver, np.geomspace(0.05, 3.0, 40), np.linspace(-3.0, 3.0, 41))
        for t in (0, 1):
            zh, ah, vh = data[hold, t]
            cal = np.stack([a * zh[:, k] + b for k, (a, b) in enumerate(platt)], axis=1)
            eces = [
                calibration_report(zh, ah, vh, shipped)["ece_sts"],
                calibration_report(zh, ah, vh, sts)["ece_sts"],
                calibration_report(cal, ah, vh, identity)["ece_sts"],
            ]
            print(f"| {hold} | {t} | " + " | ".join(f"{e:.3f}" for e in eces) + " |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--evals", default="docs/acceptance/evals")
    ap.add_argument("--drafter", default="dspark", help="shipped drafter whose STS and evals are replayed")
    ap.add_argument("--priors", default="1,5,20")
    ap.add_argument(
        "--crossfit", action="store_true", help="STS vs Platt fitted on two sets, scored on the third"
    )
    args = ap.parse_args(argv)
    if args.crossfit:
        crossfit(Path(args.evals), args.drafter)
        return
    sts = STS.from_dict(load_drafter_meta(args.drafter)["sts"])
    identity = STS.identity(sts.gamma)
    cells = [(s, t) for t in (0, 1) for s in SETS]
    rows: dict[str, list[float]] = {"STS (shipped)": []}
    variants = [(p, m) for p in map(float, args.priors.split(",")) for m in ("request", "stream")]
    for p, m in variants:
        rows[f"STS + {m} offset, prior {p:g}"] = []
    for s, t in cells:
        stem = Path(args.evals) / f"{args.drafter}-{s}-T{t}"
        meta = json.loads(stem.with_suffix(".json").read_text())
        r = np.load(stem.with_suffix(".rounds.npz"))
        logits, acc, ver = r["logits"], r["accepted"], r["verified"]
        if "request" in r.files:
            edges = np.flatnonzero(np.diff(r["request"])) + 1
            bounds = list(zip([0, *edges.tolist()], [*edges.tolist(), len(acc)]))
        else:
            bounds = split_requests(acc, int(meta["new_tokens"]) // int(meta["prompts"]) - 1)
        known = len(bounds) == int(meta["prompts"])
        rows["STS (shipped)"].append(calibration_report(logits, acc, ver, sts)["ece_sts"])
        for p, m in variants:
            if m == "request" and not known:  # request boundaries unknown: leave the cell out
                rows[f"STS + {m} offset, prior {p:g}"].append(float("nan"))
                continue
            z = replay(logits, acc, ver, sts, bounds, p, m)
            rows[f"STS + {m} offset, prior {p:g}"].append(
                calibration_report(z, acc, ver, identity)["ece_sts"]
            )
    print("| ECE after calibration | " + " | ".join(f"{s} T={t}" for s, t in cells) + " | ≤ 0.02 |")
    print("|---|" + "---|" * (len(cells) + 1))
    for name, v in rows.items():
        ok = sum(x <= 0.02 for x in v)
        cells_txt = " | ".join("–" if np.isnan(x) else f"{x:.3f}" for x in v)
        print(f"| {name} | {cells_txt} | {ok} of {sum(not np.isnan(x) for x in v)} |")


if __name__ == "__main__":
    main()
