"""Confidence-head reliability metrics and Sequential Temperature Scaling (STS).

The confidence head outputs one logit z_k per draft slot; c_k = σ(z_k) is the probability
that draft k survives verification *given* drafts 1..k−1 survived (paper eq. 7, reference
notes §1.6). The scheduler needs absolute prefix-survival probabilities

    a_k = Π_{i≤k} c_i                                             (reference notes §1.6)

so the heads must be calibrated, not merely well ranked. STS (paper §3.2.1, reference notes
§3) fits one temperature per slot, left to right, each minimising the ECE of the cumulative
product against the observed accepted-prefix label y_k = 1[drafts 1..k all accepted].

Measurement follows the reference evaluator (reference notes §3): cumulative predictions in
float64, clipped to [1e-8, 1 − 1e-8]; 20 equal-width bins on [0, 1]; per-position metrics
over the slots that were actually verified; dataset summaries weighted by sample count.
One deliberate difference: AUROC here is exact (Mann–Whitney with ties counted ½), where the
reference approximates it from 1000-bin histograms.

Everything here is numpy-only and free of model code, so it runs anywhere an eval JSON is
produced or read.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from dspark.core.scheduler import prefix_survival

PRED_CLIP = 1e-8  # cumulative predictions are clipped to [PRED_CLIP, 1 − PRED_CLIP] (notes §3)
DEFAULT_N_BINS = 20  # the reference evaluator's bin count (notes §3)
_GRID_CHUNK_ELEMENTS = 1 << 21  # grid × rows evaluated per batched ECE call during fitting
_STS_FORMAT = "dspark.sts"
_STS_VERSION = 1


# ---------------------------------------------------------------------------------------------
# Scalar reliability metrics
# ---------------------------------------------------------------------------------------------


def _paired_1d(pred: ArrayLike, label: ArrayLike, pred_name: str) -> tuple[np.ndarray, np.ndarray]:
    """Flatten a (prediction, label) pair to float64 vectors, checking they match and are finite."""
    p = np.asarray(pred, dtype=np.float64).reshape(-1)
    y = np.asarray(label, dtype=np.float64).reshape(-1)
    if p.shape != y.shape:
        raise ValueError(
            f"{pred_name} has {p.size} elements but label has {y.size}; pass one label per "
            f"{pred_name} (select the verified slots with the same mask for both)."
        )
    if not (np.all(np.isfinite(p)) and np.all(np.isfinite(y))):
        raise ValueError(
            f"{pred_name} and label must be finite; drop unverified slots (e.g. with the `valid` "
            "mask from prefix_labels) instead of filling them with nan."
        )
    return p, y


def _check_probabilities(p: np.ndarray, name: str) -> None:
    if p.size and (p.min() < 0.0 or p.max() > 1.0):
        raise ValueError(
            f"{name} must lie in [0, 1] (got min {p.min():.6g}, max {p.max():.6g}); apply the "
            "sigmoid to confidence logits before computing this metric."
        )


def ece_rows(preds: np.ndarray, label: np.ndarray, n_bins: int) -> np.ndarray:
    """ECE of each row of preds [G, M] against one label vector [M]; returns [G].

    Σ_b (n_b/M)·|mean_b(p) − mean_b(y)| equals Σ_b |Σ_b p − Σ_b y| / M, which needs only
    per-bin sums, so all G candidates are binned with one bincount.
    """
    g, m = preds.shape
    bins = np.minimum((preds * n_bins).astype(np.int64), n_bins - 1)  # p == 1.0 → last bin
    flat = (bins + (np.arange(g, dtype=np.int64) * n_bins)[:, None]).reshape(-1)
    sum_pred = np.bincount(flat, weights=preds.reshape(-1), minlength=g * n_bins)
    sum_label = np.bincount(
        flat, weights=np.broadcast_to(label, preds.shape).reshape(-1), minlength=g * n_bins
    )
    return np.abs(sum_pred - sum_label).reshape(g, n_bins).sum(axis=1) / m


def ece(pred: ArrayLike, label: ArrayLike, n_bins: int = DEFAULT_N_BINS) -> float:
    """Expected calibration error with `n_bins` equal-width bins on [0, 1] (notes §3).

    ECE = Σ_b (n_b / N) · |mean(pred_b) − mean(label_b)|. Bins are left-closed; pred == 1.0
    falls in the last bin. Returns nan for empty input.
    """
    if not isinstance(n_bins, (int, np.integer)) or n_bins < 1:
        raise ValueError(f"n_bins must be a positive integer, got {n_bins!r}.")
    p, y = _paired_1d(pred, label, "pred")
    _check_probabilities(p, "pred")
    if p.size == 0:
        return math.nan
    return float(ece_rows(p[None, :], y, int(n_bins))[0])


def auroc(score: ArrayLike, label: ArrayLike) -> float:
    """Exact area under the ROC curve: P(score⁺ > score⁻) + ½·P(score⁺ = score⁻).

    Computed from average ranks (Mann–Whitney U). Labels must be 0/1. Returns nan when only one
    class is present (the AUROC is undefined).
    """
    s, y = _paired_1d(score, label, "score")
    if not np.all((y == 0.0) | (y == 1.0)):
        raise ValueError("label must contain only 0 and 1 for AUROC; threshold soft labels first.")
    n_pos = int(np.count_nonzero(y))
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return math.nan
    _, inverse, counts = np.unique(s, return_inverse=True, return_counts=True)
    upper = np.cumsum(counts)  # 1-based rank of the last member of each tie group
    average_rank = upper - (counts - 1) / 2.0
    rank_sum_pos = float(average_rank[inverse.reshape(-1)][y == 1.0].sum())
    u_stat = rank_sum_pos - n_pos * (n_pos + 1) / 2.0
    return u_stat / (n_pos * n_neg)


def brier(pred: ArrayLike, label: ArrayLike) -> float:
    """Brier score: mean of (pred − label)². Returns nan for empty input."""
    p, y = _paired_1d(pred, label, "pred")
    if p.size == 0:
        return math.nan
    return float(np.mean((p - y) ** 2))


# ---------------------------------------------------------------------------------------------
# Rounds → labels
# ---------------------------------------------------------------------------------------------


def _check_rounds(accepted: ArrayLike, verified: ArrayLike, gamma: int) -> tuple[np.ndarray, np.ndarray]:
    """Validate per-round (accepted, verified) counts against block size gamma; return int64 vectors."""
    if not isinstance(gamma, (int, np.integer)) or gamma < 1:
        raise ValueError(f"gamma (draft positions per block) must be a positive integer, got {gamma!r}.")
    arrays = []
    for name, values in (("accepted", accepted), ("verified", verified)):
        raw = np.asarray(values)
        if raw.ndim != 1:
            raise ValueError(f"{name} must be a 1-D array with one entry per round, got shape {raw.shape}.")
        if raw.size and not np.all(np.isfinite(raw.astype(np.float64))):
            raise ValueError(f"{name} must be finite integer counts.")
        as_int = raw.astype(np.int64)
        if raw.size and not np.array_equal(as_int, raw):
            raise ValueError(f"{name} must hold integer counts, got non-integer values.")
        arrays.append(as_int)
    acc, prop = arrays
    if acc.shape != prop.shape:
        raise ValueError(
            f"accepted has {acc.size} rounds but verified has {prop.size}; pass one entry per round in both."
        )
    if prop.size and (prop.min() < 0 or prop.max() > gamma):
        raise ValueError(
            f"verified must lie in [0, gamma={gamma}] (got min {prop.min()}, max {prop.max()}); "
            "check that gamma matches the logits' last dimension."
        )
    if acc.size and (acc.min() < 0 or np.any(acc > prop)):
        raise ValueError(
            "accepted must lie in [0, verified] for every round; a round cannot accept "
            "more drafts than it verified."
        )
    return acc, prop


def prefix_labels(accepted: ArrayLike, verified: ArrayLike, gamma: int) -> tuple[np.ndarray, np.ndarray]:
    """Accepted-prefix labels for the cumulative prediction a_k (notes §3).

    For round n that verified `verified[n]` drafts and accepted the first `accepted[n]`:
    labels[n, k−1] = 1[accepted[n] ≥ k] and valid[n, k−1] = (k ≤ verified[n]), k = 1..gamma.
    For a round that stopped on an accepted EOS, pass verified = the EOS position to match the
    reference's "effective proposal length".

    Returns (labels [N, gamma] float64, valid [N, gamma] bool).
    """
    acc, prop = _check_rounds(accepted, verified, gamma)
    k = np.arange(1, gamma + 1)
    labels = (acc[:, None] >= k[None, :]).astype(np.float64)
    valid = prop[:, None] >= k[None, :]
    return labels, valid


def conditional_labels(accepted: ArrayLike, verified: ArrayLike, gamma: int) -> tuple[np.ndarray, np.ndarray]:
    """Labels for the conditional confidence c_k (the head's own target, paper eq. 7).

    Slot k was *reached* in round n when drafts 1..k−1 were accepted and k was verified:
    reached[n, k−1] = (accepted[n] ≥ k−1) & (verified[n] ≥ k); there the label is
    1[accepted[n] ≥ k]. Returns (labels [N, gamma] float64, reached [N, gamma] bool).
    """
    acc, prop = _check_rounds(accepted, verified, gamma)
    k = np.arange(1, gamma + 1)
    labels = (acc[:, None] >= k[None, :]).astype(np.float64)
    reached = (acc[:, None] >= k[None, :] - 1) & (prop[:, None] >= k[None, :])
    return labels, reached


# ---------------------------------------------------------------------------------------------
# Sigmoid / survival helpers
# ---------------------------------------------------------------------------------------------


def sigmoid(x: ArrayLike) -> np.ndarray:
    """Numerically stable logistic function in float64."""
    x = np.asarray(x, dtype=np.float64)
    out = np.empty_like(x)
    pos = x >= 0
    out[pos] = 1.0 / (1.0 + np.exp(-x[pos]))
    e = np.exp(x[~pos])
    out[~pos] = e / (1.0 + e)
    return out


def clipped_survival(conditional: ArrayLike) -> np.ndarray:
    """Prefix survival a_k (dspark.core.scheduler.prefix_survival) clipped to [1e-8, 1 − 1e-8],
    so that log-losses and the reliability bins stay finite (notes §3)."""
    return np.clip(prefix_survival(conditional), PRED_CLIP, 1.0 - PRED_CLIP)


def default_grid() -> np.ndarray:
    """STS temperature grid: 199 geometric points on [0.2, 10] plus exactly 1.0 (200 points).

    The paper gives no grid (notes §3); this spans 50× either side of "too sharp" and "too
    flat" with ~2% steps, and contains the identity so an already-calibrated slot can stay put.
    """
    return np.unique(np.concatenate([np.geomspace(0.2, 10.0, 199), [1.0]]))


def _check_logits(logits: ArrayLike, gamma: int | None = None) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64)
    if z.ndim != 2:
        raise ValueError(
            f"logits must have shape [rounds, gamma] (one confidence logit per round and draft slot), "
            f"got shape {z.shape}."
        )
    if gamma is not None and z.shape[1] != gamma:
        raise ValueError(f"logits have {z.shape[1]} slots but the calibration has gamma={gamma}.")
    return z


def _masked_logits(z: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Zero the unverified slots (their content is arbitrary, e.g. padding) after checking the rest."""
    if not np.all(np.isfinite(z[valid])):
        raise ValueError("logits contain nan/inf at verified slots; the confidence head output is broken.")
    return np.where(valid, z, 0.0)


# ---------------------------------------------------------------------------------------------
# Sequential Temperature Scaling
# ---------------------------------------------------------------------------------------------


@dataclass
class STS:
    """Sequential Temperature Scaling (paper §3.2.1, notes §3): c̃_k = σ(z_k / T_k), one T per slot.

    temperatures: T_1..T_γ, all > 0; T > 1 softens an over-confident head.
    meta: free-form provenance (data set, rounds, bins, ...), saved with the temperatures.
    """

    temperatures: tuple[float, ...]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        temps = tuple(float(t) for t in self.temperatures)
        if not temps:
            raise ValueError("STS needs one temperature per draft slot; got none.")
        bad = [t for t in temps if not (math.isfinite(t) and t > 0.0)]
        if bad:
            raise ValueError(f"STS temperatures must be finite and > 0, got {bad}.")
        self.temperatures = temps
        if not isinstance(self.meta, dict):
            raise TypeError(f"STS.meta must be a dict, got {type(self.meta).__name__}.")

    @property
    def gamma(self) -> int:
        """Number of draft slots calibrated."""
        return len(self.temperatures)

    @classmethod
    def identity(cls, gamma: int) -> STS:
        """No-op calibration (all T = 1) for a block of `gamma` slots."""
        if not isinstance(gamma, (int, np.integer)) or gamma < 1:
            raise ValueError(f"gamma must be a positive integer, got {gamma!r}.")
        return cls(temperatures=(1.0,) * int(gamma))

    @classmethod
    def fit(
        cls,
        logits: ArrayLike,
        accepted: ArrayLike,
        verified: ArrayLike,
        grid: Sequence[float] | np.ndarray | None = None,
        n_bins: int = DEFAULT_N_BINS,
    ) -> STS:
        """Fit T_1..T_γ left to right on held-out verification rounds (paper §3.2.1).

        logits [N, γ]: raw confidence logits z; accepted [N], verified [N]: per-round counts.
        For k = 1..γ, with T_1..T_{k−1} fixed, pick the grid T_k minimising the ECE of
        â_k = clip(Π_{i≤k} σ(z_i/T_i)) against y_k = 1[accepted ≥ k] over rows with
        verified ≥ k. Ties go to the T closest to 1 in log scale; a slot with no verified
        rows keeps T = 1.
        """
        z = _check_logits(logits)
        gamma = z.shape[1]
        labels, valid = prefix_labels(accepted, verified, gamma)
        if labels.shape[0] != z.shape[0]:
            raise ValueError(
                f"logits have {z.shape[0]} rounds but accepted/verified have {labels.shape[0]}; "
                "pass one row of logits per round."
            )
        if not isinstance(n_bins, (int, np.integer)) or n_bins < 1:
            raise ValueError(f"n_bins must be a positive integer, got {n_bins!r}.")
        temps_grid = default_grid() if grid is None else np.asarray(grid, dtype=np.float64).reshape(-1)
        if temps_grid.size == 0 or not np.all(np.isfinite(temps_grid)) or np.any(temps_grid <= 0):
            raise ValueError("grid must be a non-empty list of finite temperatures > 0.")
        z = _masked_logits(z, valid)

        temps: list[float] = []
        prefix = np.ones(z.shape[0])  # Π_{i<k} c̃_i, unclipped
        chunk = max(1, _GRID_CHUNK_ELEMENTS // max(1, z.shape[0]))
        for k in range(gamma):
            rows = valid[:, k]
            if not rows.any():
                t_k = 1.0
            else:
                zk, prev, yk = z[rows, k], prefix[rows], labels[rows, k]
                scores = np.empty(temps_grid.size)
                for start in range(0, temps_grid.size, chunk):
                    t = temps_grid[start : start + chunk, None]
                    cand = np.clip(prev[None, :] * sigmoid(zk[None, :] / t), PRED_CLIP, 1.0 - PRED_CLIP)
                    scores[start : start + chunk] = ece_rows(cand, yk, int(n_bins))
                best = np.flatnonzero(scores <= scores.min() + 1e-12)
                t_k = float(temps_grid[best[np.argmin(np.abs(np.log(temps_grid[best])))]])
            temps.append(t_k)
            prefix = prefix * sigmoid(z[:, k] / t_k)
        meta = {
            "method": "sts",
            "n_rounds": int(z.shape[0]),
            "n_bins": int(n_bins),
            "grid": [float(temps_grid.min()), float(temps_grid.max()), int(temps_grid.size)],
            "n_per_position": [int(n) for n in valid.sum(axis=0)],
        }
        return cls(temperatures=tuple(temps), meta=meta)

    def apply(self, logits: ArrayLike) -> np.ndarray:
        """Calibrated conditional confidences σ(z_k / T_k) for logits shaped [..., γ] (float64)."""
        z = np.asarray(logits, dtype=np.float64)
        if z.ndim == 0 or z.shape[-1] != self.gamma:
            raise ValueError(
                f"apply needs exactly gamma={self.gamma} trailing slots (shape [..., {self.gamma}]), got "
                f"shape {z.shape}; pad unused slots with any finite value and ignore their outputs."
            )
        return sigmoid(z / np.asarray(self.temperatures))

    def survival(self, logits: ArrayLike) -> np.ndarray:
        """Calibrated prefix survival â_k = clip(Π_{i≤k} σ(z_i/T_i)) for logits shaped [..., γ]."""
        return clipped_survival(self.apply(logits))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form; `from_dict` inverts it."""
        return {
            "format": _STS_FORMAT,
            "version": _STS_VERSION,
            "gamma": self.gamma,
            "temperatures": list(self.temperatures),
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> STS:
        """Rebuild from `to_dict` output, checking the format tag and gamma."""
        if not isinstance(data, dict) or "temperatures" not in data:
            raise ValueError("not an STS calibration: expected a dict with a 'temperatures' list.")
        if data.get("format", _STS_FORMAT) != _STS_FORMAT:
            raise ValueError(
                f"not an STS calibration: format is {data.get('format')!r}, expected {_STS_FORMAT!r}."
            )
        if int(data.get("version", _STS_VERSION)) > _STS_VERSION:
            raise ValueError(
                f"STS calibration version {data['version']} is newer than this code supports "
                f"({_STS_VERSION}); upgrade dspark."
            )
        temps = data["temperatures"]
        if not isinstance(temps, (list, tuple)):
            raise ValueError("STS 'temperatures' must be a list of numbers.")
        if "gamma" in data and int(data["gamma"]) != len(temps):
            raise ValueError(
                f"STS calibration says gamma={data['gamma']} but lists {len(temps)} temperatures; "
                "the file is corrupt, refit it."
            )
        return cls(temperatures=tuple(temps), meta=dict(data.get("meta") or {}))

    def to_json(self, path: str | os.PathLike[str]) -> None:
        """Write the calibration as JSON."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2, allow_nan=False)
            f.write("\n")

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> STS:
        """Read a calibration written by `to_json`."""
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{os.fspath(path)} is not valid JSON ({e}); refit or restore the file."
                ) from e
        return cls.from_dict(data)


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------

_AVERAGED = ("ece_raw", "ece_sts", "auroc_raw", "auroc_sts", "brier_raw", "brier_sts", "auroc_conditional")


def _json_number(x: float) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def calibration_report(
    logits: ArrayLike,
    accepted: ArrayLike,
    verified: ArrayLike,
    sts: STS | None = None,
    n_bins: int = DEFAULT_N_BINS,
) -> dict[str, Any]:
    """Per-position reliability of the confidence head, raw and after STS (notes §3, paper Fig. 6).

    Per position k (over rounds with verified ≥ k): n, ECE / AUROC / Brier of the cumulative
    prediction â_k against y_k = 1[accepted ≥ k] for the raw head ("_raw") and the calibrated
    one ("_sts"), mean predictions, mean label, and "auroc_conditional" — the AUROC of c_k
    against the conditional label over reached rows (identical raw and calibrated, since
    temperature scaling is monotone). Top level: the sample-weighted average over positions
    of each metric (positions where it is undefined are left out; "auroc_conditional" is
    weighted by reached rows), plus totals. Undefined
    values and every "_sts" value when `sts` is None are None, so the dict is strict JSON.
    """
    z = _check_logits(logits)
    gamma = z.shape[1]
    labels, valid = prefix_labels(accepted, verified, gamma)
    cond_labels, reached = conditional_labels(accepted, verified, gamma)
    if labels.shape[0] != z.shape[0]:
        raise ValueError(
            f"logits have {z.shape[0]} rounds but accepted/verified have {labels.shape[0]}; "
            "pass one row of logits per round."
        )
    if sts is not None and sts.gamma != gamma:
        raise ValueError(
            f"the STS calibration has gamma={sts.gamma} but the logits have {gamma} slots; "
            "use the calibration fitted for this drafter's block size."
        )
    z = _masked_logits(z, valid)
    cond_raw = sigmoid(z)
    surv_raw = clipped_survival(cond_raw)
    surv_sts = sts.survival(z) if sts is not None else None

    positions: list[dict[str, Any]] = []
    for k in range(gamma):
        rows = valid[:, k]
        y = labels[rows, k]
        entry: dict[str, Any] = {
            "k": k + 1,
            "n": int(rows.sum()),
            "mean_label": float(y.mean()) if y.size else math.nan,
        }
        for tag, surv in (("raw", surv_raw), ("sts", surv_sts)):
            if surv is None:
                for name in ("ece", "auroc", "brier", "mean_pred"):
                    entry[f"{name}_{tag}"] = math.nan
                continue
            p = surv[rows, k]
            entry[f"ece_{tag}"] = ece(p, y, n_bins)
            entry[f"auroc_{tag}"] = auroc(p, y)
            entry[f"brier_{tag}"] = brier(p, y)
            entry[f"mean_pred_{tag}"] = float(p.mean()) if p.size else math.nan
        hit = reached[:, k]
        entry["n_reached"] = int(hit.sum())
        entry["auroc_conditional"] = auroc(cond_raw[hit, k], cond_labels[hit, k])
        positions.append(entry)

    report: dict[str, Any] = {
        "gamma": gamma,
        "n_bins": int(n_bins),
        "n_rounds": int(z.shape[0]),
        "n": int(valid.sum()),
        "temperatures": list(sts.temperatures) if sts is not None else None,
    }
    for key in _AVERAGED:
        weight_key = "n_reached" if key == "auroc_conditional" else "n"
        weights = np.array([e[weight_key] for e in positions], dtype=np.float64)
        values = np.array([e[key] for e in positions], dtype=np.float64)
        ok = np.isfinite(values) & (weights > 0)
        report[key] = float(np.sum(weights[ok] * values[ok]) / np.sum(weights[ok])) if ok.any() else math.nan
    report["positions"] = positions
    return _to_json_friendly(report)


def _to_json_friendly(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _to_json_friendly(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_json_friendly(v) for v in obj]
    if isinstance(obj, float):
        return _json_number(obj)
    return obj
