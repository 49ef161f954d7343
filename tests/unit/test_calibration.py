"""Reliability metrics and Sequential Temperature Scaling (reference notes §1.6, §3; paper §3.2.1)."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from dspark.core.calibration import (
    STS,
    auroc,
    brier,
    calibration_report,
    clipped_survival,
    conditional_labels,
    default_grid,
    ece,
    prefix_labels,
    sigmoid,
)

GAMMA = 7


def simulate_overconfident_rounds(
    n: int, seed: int, scale: float = 2.5, min_verified: int = 4
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Rounds whose true conditional acceptance at slot k is σ(z_k) but whose head reports scale·z_k.

    Drafts are verified left to right with independent Bernoulli(σ(z_k)) draws, stopping at the
    first rejection; proposal lengths vary in [min_verified, γ]. Returns (reported logits,
    accepted, verified, latent z).
    """
    rng = np.random.default_rng(seed)
    z = rng.normal(1.5, 1.5, size=(n, GAMMA))
    ok = rng.random((n, GAMMA)) < sigmoid(z)
    first_reject = np.where(ok.all(axis=1), GAMMA, np.argmin(ok, axis=1))
    verified = rng.integers(min_verified, GAMMA + 1, size=n)
    accepted = np.minimum(first_reject, verified)
    return scale * z, accepted, verified, z


@pytest.fixture(scope="module")
def overconfident_split() -> dict[str, object]:
    logits, accepted, verified, _ = simulate_overconfident_rounds(12000, seed=1234)
    half = logits.shape[0] // 2
    fit = (logits[:half], accepted[:half], verified[:half])
    held_out = (logits[half:], accepted[half:], verified[half:])
    return {"sts": STS.fit(*fit), "held_out": held_out}


# ---------------------------------------------------------------------------------------------
# ECE
# ---------------------------------------------------------------------------------------------


def test_ece_of_calibrated_predictor_is_near_zero() -> None:
    rng = np.random.default_rng(0)
    pred = rng.random(200_000)
    label = (rng.random(pred.size) < pred).astype(float)
    assert ece(pred, label) < 0.01


def test_ece_of_constant_overconfident_predictor_is_the_gap() -> None:
    label = np.array([1.0] * 70 + [0.0] * 30)
    assert ece(np.full(100, 0.9), label) == pytest.approx(0.2, abs=1e-12)


def test_ece_matches_hand_computed_bins() -> None:
    # 20 bins: 0.11, 0.13 → bin 2; 0.81, 0.84 → bin 16; 1.0 → last bin.
    pred = [0.11, 0.13, 0.81, 0.84, 1.0]
    label = [0, 1, 1, 0, 1]
    expected = (2 / 5) * abs(0.12 - 0.5) + (2 / 5) * abs(0.825 - 0.5) + (1 / 5) * 0.0
    assert ece(pred, label) == pytest.approx(expected, abs=1e-12)


def test_ece_puts_prediction_one_in_the_last_bin_and_zero_in_the_first() -> None:
    # 0.97 and 1.0 share the last bin (mean 0.985 vs label 1); 0.0 and 0.04 share the first.
    pred = [0.97, 1.0, 0.0, 0.04]
    label = [1, 1, 0, 0]
    assert ece(pred, label) == pytest.approx((2 / 4) * 0.015 + (2 / 4) * 0.02, abs=1e-12)


def test_ece_with_one_bin_is_the_mean_gap() -> None:
    assert ece([0.2, 0.4, 0.9], [1, 0, 0], n_bins=1) == pytest.approx(abs(0.5 - 1 / 3), abs=1e-12)


def test_ece_of_empty_input_is_nan() -> None:
    assert math.isnan(ece([], []))


def test_ece_rejects_predictions_outside_unit_interval_and_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="sigmoid"):
        ece([1.5], [1])
    with pytest.raises(ValueError, match="one label per"):
        ece([0.5, 0.5], [1])
    with pytest.raises(ValueError, match="n_bins"):
        ece([0.5], [1], n_bins=0)


# ---------------------------------------------------------------------------------------------
# AUROC / Brier
# ---------------------------------------------------------------------------------------------


def test_auroc_is_one_for_perfect_separation_and_zero_when_reversed() -> None:
    score = [0.1, 0.2, 0.3, 0.8, 0.9]
    label = [0, 0, 0, 1, 1]
    assert auroc(score, label) == 1.0
    assert auroc(score, [1 - y for y in label]) == 0.0


def test_auroc_counts_ties_as_half() -> None:
    assert auroc([0.5] * 6, [0, 1, 0, 1, 1, 0]) == 0.5
    # one positive tied with one of two negatives, above the other: (1 + 0.5) / 2
    assert auroc([0.3, 0.7, 0.7], [0, 0, 1]) == 0.75


def test_auroc_matches_brute_force_pairwise_count() -> None:
    rng = np.random.default_rng(7)
    score = np.round(rng.random(300), 1)  # coarse values → many ties
    label = (rng.random(300) < 0.4).astype(int)
    pos, neg = score[label == 1], score[label == 0]
    wins = sum(1.0 if p > q else 0.5 if p == q else 0.0 for p, q in itertools.product(pos, neg))
    assert auroc(score, label) == pytest.approx(wins / (pos.size * neg.size), abs=1e-12)


def test_auroc_is_nan_with_a_single_class_and_rejects_soft_labels() -> None:
    assert math.isnan(auroc([0.1, 0.9], [1, 1]))
    with pytest.raises(ValueError, match="only 0 and 1"):
        auroc([0.1, 0.9], [0.5, 1])


def test_brier_is_mean_squared_error() -> None:
    assert brier([0.9, 0.2, 0.5], [1, 0, 0]) == pytest.approx((0.01 + 0.04 + 0.25) / 3)
    assert math.isnan(brier([], []))


# ---------------------------------------------------------------------------------------------
# Labels
# ---------------------------------------------------------------------------------------------


def test_prefix_labels_mark_accepted_prefix_and_verified_slots() -> None:
    labels, valid = prefix_labels(accepted=[0, 2, 3, 0], verified=[3, 3, 3, 0], gamma=4)
    np.testing.assert_array_equal(labels, [[0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(
        valid,
        [[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 0], [0, 0, 0, 0]],
    )
    assert labels.dtype == np.float64 and valid.dtype == bool


def test_conditional_labels_cover_only_reached_slots() -> None:
    labels, reached = conditional_labels(accepted=[0, 2, 3], verified=[3, 3, 3], gamma=4)
    np.testing.assert_array_equal(reached, [[1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0]])
    np.testing.assert_array_equal(labels[reached], [0, 1, 1, 0, 1, 1, 1])


def test_prefix_labels_reject_inconsistent_counts() -> None:
    with pytest.raises(ValueError, match=r"\[0, verified\]"):
        prefix_labels(accepted=[3], verified=[2], gamma=7)
    with pytest.raises(ValueError, match="gamma=7"):
        prefix_labels(accepted=[0], verified=[8], gamma=7)
    with pytest.raises(ValueError, match="one entry per round"):
        prefix_labels(accepted=[0, 1], verified=[2], gamma=7)
    with pytest.raises(ValueError, match="integer"):
        prefix_labels(accepted=[0.5], verified=[2], gamma=7)


def test_clipped_survival_is_clipped_running_product() -> None:
    out = clipped_survival([[0.5, 0.5, 1e-9], [1.0, 1.0, 1.0]])
    np.testing.assert_allclose(out, [[0.5, 0.25, 1e-8], [1 - 1e-8] * 3], rtol=0, atol=1e-15)


# ---------------------------------------------------------------------------------------------
# STS
# ---------------------------------------------------------------------------------------------


def test_default_grid_is_geometric_from_0p2_to_10_and_contains_identity() -> None:
    grid = default_grid()
    assert 190 <= grid.size <= 210
    assert grid.min() == pytest.approx(0.2) and grid.max() == pytest.approx(10.0)
    assert 1.0 in grid
    assert np.all(np.diff(grid) > 0)


def test_identity_sts_returns_plain_sigmoid() -> None:
    logits = np.linspace(-5, 5, 21).reshape(3, 7)
    np.testing.assert_allclose(STS.identity(7).apply(logits), 1 / (1 + np.exp(-logits)), rtol=1e-12)


def test_sts_lowers_heldout_ece_at_every_position_on_overconfident_head(overconfident_split) -> None:
    sts, held_out = overconfident_split["sts"], overconfident_split["held_out"]
    report = calibration_report(*held_out, sts=sts)
    for pos in report["positions"]:
        assert pos["n"] > 0
        assert pos["ece_sts"] < pos["ece_raw"], pos
    assert report["ece_sts"] < 0.5 * report["ece_raw"]
    assert report["ece_raw"] > 0.05  # the simulated head really is over-confident


def test_sts_temperatures_exceed_one_for_an_overconfident_head(overconfident_split) -> None:
    temps = np.array(overconfident_split["sts"].temperatures)
    assert temps.shape == (GAMMA,)
    assert np.all(temps > 1.0)
    # slot 1 has the most rows and no earlier temperatures to compensate: T_1 ≈ the true 2.5
    assert 2.0 < temps[0] < 3.0


def test_sts_leaves_conditional_auroc_unchanged(overconfident_split) -> None:
    sts = overconfident_split["sts"]
    logits, accepted, verified = overconfident_split["held_out"]
    labels, reached = conditional_labels(accepted, verified, GAMMA)
    raw, calibrated = sigmoid(logits), sts.apply(logits)
    for k in range(GAMMA):
        rows = reached[:, k]
        assert auroc(calibrated[rows, k], labels[rows, k]) == pytest.approx(
            auroc(raw[rows, k], labels[rows, k]), abs=1e-12
        )


def test_sts_keeps_unit_temperature_at_positions_never_verified() -> None:
    logits, accepted, verified, _ = simulate_overconfident_rounds(2000, seed=5, min_verified=1)
    verified = np.minimum(verified, 5)
    accepted = np.minimum(accepted, verified)
    sts = STS.fit(logits, accepted, verified)
    assert sts.temperatures[5:] == (1.0, 1.0)
    assert all(t > 1.0 for t in sts.temperatures[:5])
    assert sts.meta["n_per_position"][5:] == [0, 0]


def test_sts_fit_ignores_garbage_logits_in_unverified_slots() -> None:
    logits, accepted, verified, _ = simulate_overconfident_rounds(2000, seed=6)
    dirty = logits.copy()
    dirty[np.arange(GAMMA)[None, :] >= verified[:, None]] = np.nan
    assert STS.fit(dirty, accepted, verified).temperatures == STS.fit(logits, accepted, verified).temperatures


def test_sts_fit_uses_a_custom_grid() -> None:
    logits, accepted, verified, _ = simulate_overconfident_rounds(2000, seed=8)
    sts = STS.fit(logits, accepted, verified, grid=[1.0, 2.5])
    assert set(sts.temperatures) <= {1.0, 2.5}
    with pytest.raises(ValueError, match="grid"):
        STS.fit(logits, accepted, verified, grid=[0.0, 1.0])


def test_sts_survival_is_cumulative_product_of_apply() -> None:
    sts = STS(temperatures=(2.0, 1.0, 0.5))
    logits = np.array([[1.0, -1.0, 0.5], [3.0, 2.0, -2.0]])
    expected = np.cumprod(sigmoid(logits / np.array([2.0, 1.0, 0.5])), axis=-1)
    np.testing.assert_allclose(sts.survival(logits), np.clip(expected, 1e-8, 1 - 1e-8), rtol=1e-12)
    assert sts.apply(np.zeros((2, 5, 3))).shape == (2, 5, 3)


def test_sts_json_round_trip_preserves_temperatures_and_meta(tmp_path) -> None:
    sts = STS(temperatures=(2.5, 1.0, 0.75), meta={"dataset": "alpaca", "rounds": 123})
    path = tmp_path / "sts.json"
    sts.to_json(path)
    loaded = STS.from_json(path)
    assert loaded == sts
    assert STS.from_dict(json.loads(path.read_text())) == sts
    assert STS.from_dict(sts.to_dict()) == sts


def test_sts_rejects_bad_shapes_and_values(tmp_path) -> None:
    sts = STS.identity(7)
    with pytest.raises(ValueError, match="gamma=7"):
        sts.apply(np.zeros((2, 6)))
    with pytest.raises(ValueError, match=r"\[rounds, gamma\]"):
        STS.fit(np.zeros(7), [0], [7])
    with pytest.raises(ValueError, match="one row of logits per round"):
        STS.fit(np.zeros((3, 7)), [0, 1], [7, 7])
    with pytest.raises(ValueError, match="gamma=7"):
        STS.fit(np.zeros((1, 7)), [0], [9])
    with pytest.raises(ValueError, match="> 0"):
        STS(temperatures=(1.0, -2.0))
    with pytest.raises(ValueError, match="gamma must be"):
        STS.identity(0)
    with pytest.raises(ValueError, match="refit"):
        STS.from_dict({"gamma": 3, "temperatures": [1.0, 1.0]})
    with pytest.raises(ValueError, match="format"):
        STS.from_dict({"format": "something.else", "temperatures": [1.0]})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        STS.from_json(bad)


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def test_report_top_level_is_sample_weighted_average_of_positions() -> None:
    logits, accepted, verified, _ = simulate_overconfident_rounds(3000, seed=9)
    sts = STS.fit(logits, accepted, verified)
    report = calibration_report(logits, accepted, verified, sts)
    positions = report["positions"]
    assert [p["k"] for p in positions] == list(range(1, GAMMA + 1))
    _, valid = prefix_labels(accepted, verified, GAMMA)
    assert [p["n"] for p in positions] == valid.sum(axis=0).tolist()
    assert report["n"] == int(valid.sum())
    n = np.array([p["n"] for p in positions])
    for key in ("ece_raw", "ece_sts", "brier_raw", "brier_sts", "auroc_raw", "auroc_sts"):
        values = np.array([p[key] for p in positions])
        assert report[key] == pytest.approx(float((n * values).sum() / n.sum()), rel=1e-12)
    assert report["temperatures"] == list(sts.temperatures)


def test_report_per_position_values_match_the_metric_functions() -> None:
    logits, accepted, verified, _ = simulate_overconfident_rounds(1000, seed=10)
    report = calibration_report(logits, accepted, verified, STS.identity(GAMMA))
    labels, valid = prefix_labels(accepted, verified, GAMMA)
    surv = clipped_survival(sigmoid(logits))
    pos3 = report["positions"][2]
    rows = valid[:, 2]
    assert pos3["ece_raw"] == pytest.approx(ece(surv[rows, 2], labels[rows, 2]))
    assert pos3["auroc_raw"] == pytest.approx(auroc(surv[rows, 2], labels[rows, 2]))
    assert pos3["mean_label"] == pytest.approx(labels[rows, 2].mean())
    assert pos3["ece_sts"] == pytest.approx(pos3["ece_raw"])  # identity calibration changes nothing


def test_report_without_sts_is_strict_json_with_nulls() -> None:
    logits, accepted, verified, _ = simulate_overconfident_rounds(500, seed=11)
    verified = np.minimum(verified, 6)  # slot 7 never verified → undefined metrics there
    accepted = np.minimum(accepted, verified)
    report = calibration_report(logits, accepted, verified, sts=None)
    text = json.dumps(report, allow_nan=False)
    assert report["ece_sts"] is None and report["temperatures"] is None
    assert report["ece_raw"] is not None
    last = report["positions"][-1]
    assert last["n"] == 0 and last["ece_raw"] is None and last["auroc_raw"] is None
    assert json.loads(text) == report


def test_report_rejects_calibration_of_another_block_size() -> None:
    with pytest.raises(ValueError, match="block size"):
        calibration_report(np.zeros((2, 7)), [0, 1], [7, 7], STS.identity(5))
