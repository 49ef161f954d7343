"""STS fitted on more held-out rollouts (issue 12, item 6), scored on the committed eval rounds.

    .venv/bin/python -m dspark.perf.sts_refit rollouts --start 0 --count 120 --temperature 1 \
        --out results/sts/rollouts-T1.npz
    .venv/bin/python -m dspark.perf.sts_refit rollouts --start 120 --count 120 --temperature 0 \
        --out results/sts/rollouts-T0.npz
    .venv/bin/python -m dspark.perf.sts_refit score results/sts/rollouts-T*.npz --json results/sts/refit.json
    .venv/bin/python -m dspark.perf.sts_refit apply results/sts/rollouts-T*.npz --drafter drafters/dspark

`dspark train` fits DSpark's STS on speculative rollouts of `--sts-prompts` (240) held-out
training prompts, split into slices by temperature (`dspark.training.evaluate.sts_slices`: T = 1,
then greedy). `rollouts` records one such slice (the drafter, static:γ, `--tokens` new tokens,
PyTorch target, the same rounds `dspark train` records), so two processes can share the work;
`score` fits STS on every recorded round together (and per temperature, when the files hold more
than one) and reports the ECE of prefix survival per eval set and temperature from the eval rounds
in docs/acceptance/evals (what `dspark eval` wrote): raw, with the shipped STS, and with the refit.
The eval sets are only scored, never fitted on. `apply` writes the fit on every given file into a
drafter's drafter.json (what the orchestrator and `dspark eval` read).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def rollouts(args: argparse.Namespace) -> int:
    import torch

    from dspark.models.loading import load_target
    from dspark.training.data import read_answers
    from dspark.training.evaluate import sts_rollouts, traces_to_arrays
    from dspark.training.pipeline import load_drafter, split_cache

    torch.set_num_threads(args.threads)
    loaded = load_target()
    model, _ = load_drafter(args.drafter, loaded)
    _, held, _ = split_cache(read_answers(Path(args.answers)), None)
    print(f"[sts] held-out prompts {args.start}–{args.start + args.count} at T={args.temperature}")
    traces = sts_rollouts(loaded, model, held, args.start, args.count, args.temperature, args.tokens)
    if not traces:
        print(f"error: no held-out prompts from {args.start} in {args.answers} ({len(held)} held out)")
        return 2
    logits, accepted, verified = traces_to_arrays(traces, model.cfg.block_size)
    np.savez(args.out, logits=logits, accepted=accepted, verified=verified, temperature=args.temperature)
    print(f"[sts] {len(logits)} rounds → {args.out}")
    return 0


def _fit(files) -> tuple:
    """The STS fitted on every round of the given rollout files, and how many rounds that was."""
    from dspark.core.calibration import STS

    logits, accepted, verified = (
        np.concatenate([a[k] for a in files]) for k in ("logits", "accepted", "verified")
    )
    return STS.fit(logits, accepted, verified), len(logits)


def score(args: argparse.Namespace) -> int:
    from dspark.core.calibration import STS, calibration_report
    from dspark.prompts import EVAL_SETS
    from dspark.training.pipeline import load_drafter_meta

    z = [np.load(f) for f in args.traces]
    temps = sorted({float(a["temperature"]) for a in z})
    fits = {"shipped": STS.from_dict(load_drafter_meta(args.drafter)["sts"])}
    groups = [("all", z)] + (
        [(f"T{t:g}", [a for a in z if float(a["temperature"]) == t]) for t in temps] if len(temps) > 1 else []
    )
    rounds = {}
    for label, zs in groups:
        fits[f"refit-{label}"], rounds[f"refit-{label}"] = _fit(zs)
    name = Path(args.drafter).name
    for k, sts in fits.items():
        print(f"{k} ({rounds.get(k, 'shipped')} rounds): T_k = {[round(t, 3) for t in sts.temperatures]}")
    print("| set | T | ECE raw | " + " | ".join(f"ECE {k}" for k in fits) + " |")
    print("|---|---|---|" + "---|" * len(fits))
    rows = []
    for s in EVAL_SETS:
        for t in (0, 1):
            f = Path(args.evals) / f"{name}-{s}-T{t}.rounds.npz"
            if not f.exists():
                continue
            r = np.load(f)
            row: dict = {"set": s, "T": t}
            for k, sts in fits.items():
                rep = calibration_report(r["logits"], r["accepted"], r["verified"], sts)
                row.setdefault("raw", rep["ece_raw"])
                row[k] = rep["ece_sts"]
            rows.append(row)
            print(f"| {s} | {t} | " + " | ".join(f"{row[k]:.3f}" for k in ["raw", *fits]) + " |")
    for k in ["raw", *fits]:
        vals = [r[k] for r in rows]
        print(f"{k}: mean {np.mean(vals):.4f}, ≤ 2% on {sum(v <= 0.02 for v in vals)} of {len(vals)} cells")
    cross = []  # in distribution: each rollout file scored by the STS fitted on the others
    for i, held in enumerate(z if len(z) > 1 else []):
        fit, _ = _fit([a for j, a in enumerate(z) if j != i])
        rep = calibration_report(held["logits"], held["accepted"], held["verified"], fit)
        cross.append({"file": str(args.traces[i]), "raw": rep["ece_raw"], "sts": rep["ece_sts"]})
        print(
            f"held-out rollouts {args.traces[i]}: ECE raw {rep['ece_raw']:.4f}, STS fitted on the others "
            f"{rep['ece_sts']:.4f}"
        )
    if args.json:
        out = {
            "traces": [str(f) for f in args.traces],
            "rounds": rounds,
            "temperatures": {k: list(v.temperatures) for k, v in fits.items()},
            "cells": rows,
            "cross_fit": cross,
        }
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


def apply(args: argparse.Namespace) -> int:
    """Write the STS fitted on every given trace file into a drafter's drafter.json."""
    from dspark.training.pipeline import drafter_path

    z = [np.load(f) for f in args.traces]
    sts, n = _fit(z)
    sts.meta["fitted_on"] = (
        f"static:γ rollouts of held-out training prompts at T = "
        f"{sorted({float(a['temperature']) for a in z})} (python -m dspark.perf.sts_refit)"
    )
    path = drafter_path(args.drafter) / "drafter.json"
    meta = json.loads(path.read_text())
    meta["sts"] = sts.to_dict()
    path.write_text(json.dumps(meta, indent=2))
    print(f"STS of {n} rounds → {path}: T_k = {[round(t, 3) for t in sts.temperatures]}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("rollouts")
    r.add_argument("--drafter", default="drafters/dspark")
    r.add_argument("--answers", default="artifacts/data/answers.jsonl")
    r.add_argument("--start", type=int, default=0)
    r.add_argument("--count", type=int, default=120)
    r.add_argument("--tokens", type=int, default=128)
    r.add_argument("--temperature", type=float, default=1.0)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--out", required=True)
    c = sub.add_parser("score")
    c.add_argument("traces", nargs="+")
    c.add_argument("--drafter", default="drafters/dspark")
    c.add_argument("--evals", default="docs/acceptance/evals")
    c.add_argument("--json", default=None)
    w = sub.add_parser("apply")
    w.add_argument("traces", nargs="+")
    w.add_argument("--drafter", required=True, help="the drafter folder whose drafter.json gets the STS")
    args = ap.parse_args(argv)
    return {"rollouts": rollouts, "score": score, "apply": apply}[args.cmd](args)


if __name__ == "__main__":
    raise SystemExit(main())
