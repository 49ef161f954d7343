"""Tables and plots for docs/results.md, from the JSON files `dspark eval` and `dspark train` write.

    dspark report --evals artifacts/eval --drafters drafters --out docs

writes docs/acceptance.md (the τ table per dataset × drafter × temperature with macro
averages, the ECE table) and PNGs: per-position conditional acceptance, training curves
(analytic τ vs supervised slots), and reliability diagrams before/after STS.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from dspark.core.calibration import STS, clipped_survival, prefix_labels, sigmoid


def load_evals(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


def tau_table(evals: list[dict]) -> str:
    """Markdown: rows = drafter × temperature, columns = datasets + macro average."""
    by = defaultdict(dict)
    datasets = sorted({Path(e["data"]).stem for e in evals})
    for e in evals:
        by[(e["drafter"], e["temperature"])][Path(e["data"]).stem] = e["tau"]
    lines = [
        "| drafter | T | " + " | ".join(datasets) + " | macro avg |",
        "|---|---|" + "---|" * (len(datasets) + 1),
    ]
    for (drafter, temp), row in sorted(by.items()):
        vals = [row.get(d) for d in datasets]
        known = [v for v in vals if v is not None]
        macro = f"{np.mean(known):.2f}" if len(known) == len(datasets) else "–"
        cells = [f"{v:.2f}" if v is not None else "–" for v in vals]
        lines.append(f"| {drafter} | {temp:g} | " + " | ".join(cells) + f" | {macro} |")
    return "\n".join(lines)


def ece_table(evals: list[dict]) -> str:
    lines = ["| drafter | dataset | T | ECE raw | ECE after STS |", "|---|---|---|---|---|"]
    for e in evals:
        if e.get("ece_raw") is not None:
            sts = f"{e['ece_sts']:.3f}" if e.get("ece_sts") is not None else "–"
            lines.append(
                f"| {e['drafter']} | {Path(e['data']).stem} | {e['temperature']:g} | "
                f"{e['ece_raw']:.3f} | {sts} |"
            )
    return "\n".join(lines)


def plot_conditional(evals: list[dict], png: Path) -> None:
    """Per-position conditional acceptance, one panel per dataset, one line per drafter/T."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = sorted({Path(e["data"]).stem for e in evals})
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.2 * len(datasets), 3.4), squeeze=False)
    for ax, d in zip(axes[0], datasets):
        for e in evals:
            if Path(e["data"]).stem != d:
                continue
            cond = [np.nan if c is None else c for c in e["conditional"]]
            ax.plot(range(1, len(cond) + 1), cond, marker="o", label=f"{e['drafter']} T={e['temperature']:g}")
        ax.set_title(d)
        ax.set_xlabel("draft position k")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("conditional acceptance")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def plot_training(drafter_dirs: list[Path], png: Path) -> None:
    """Analytic τ (teacher forced, 1 + Σ_k Π α) against supervised slots, per drafter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for d in drafter_dirs:
        meta = json.loads((d / "drafter.json").read_text())
        hist = meta.get("history", [])
        if not hist:
            continue
        slots = np.cumsum([h["slots"] for h in hist])
        ax.plot(slots, [h["tau_prob"] for h in hist], label=d.name)
    ax.set_xlabel("supervised draft slots seen")
    ax.set_ylabel("analytic τ (teacher forced)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def reliability_bins(pred: np.ndarray, label: np.ndarray, n_bins: int = 20):
    """Mean prediction, observed rate and count per equal-width bin (empty bins dropped)."""
    idx = np.minimum((pred * n_bins).astype(int), n_bins - 1)
    out = []
    for b in range(n_bins):
        m = idx == b
        if m.any():
            out.append((pred[m].mean(), label[m].mean(), int(m.sum())))
    return np.array(out)


def plot_reliability(
    logits: np.ndarray,
    accepted: np.ndarray,
    verified: np.ndarray,
    sts: STS,
    png: Path,
    positions=(1, 3, 5, 7),
) -> None:
    """Reliability of prefix survival â_k before and after STS, for a few positions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gamma = logits.shape[1]
    labels, valid = prefix_labels(accepted, verified, gamma)
    raw = clipped_survival(sigmoid(logits))
    cal = clipped_survival(sts.apply(logits))
    positions = [k for k in positions if k <= gamma]
    fig, axes = plt.subplots(1, len(positions), figsize=(3.3 * len(positions), 3.3), squeeze=False)
    for ax, k in zip(axes[0], positions):
        m = valid[:, k - 1]
        for pred, name in ((raw, "raw"), (cal, "STS")):
            bins = reliability_bins(pred[m, k - 1], labels[m, k - 1])
            if len(bins):
                ax.plot(bins[:, 0], bins[:, 1], marker="o", label=name)
        ax.plot([0, 1], [0, 1], color="gray", lw=0.8, ls="--")
        ax.set_title(f"position {k}")
        ax.set_xlabel("predicted prefix survival")
    axes[0][0].set_ylabel("observed")
    axes[0][-1].legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
