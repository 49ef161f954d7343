"""Pure parts of the benchmark tooling."""

import numpy as np
import pytest

from dspark.perf.bench import combine, goals, request_lengths


def _run(mode, c, agg, k, **extra):
    return {"mode": mode, "concurrency": c, "requests": 3, "errors": 0, "error_sample": [], "tokens": 100,
            "wall_s": 2.0, "per_user_tps": agg / c, "aggregate_tps": agg, "tau": None, "overhead": 0.1,
            "peak_rss_mb": 100.0 + k, "repeat": k, **extra}  # fmt: skip


def test_combine_takes_medians_sums_counts_and_keeps_the_largest_peak_memory():
    single = [
        _run("off", 1, 40.0, 0), _run("dspark", 1, 30.0, 0), _run("dspark", 1, 50.0, 1),
        _run("off", 1, 20.0, 1), _run("off", 1, 41.0, 2), _run("dspark", 1, 10.0, 2, errors=1),
    ]  # fmt: skip
    rows = combine(single)
    assert [(r["mode"], r["concurrency"]) for r in rows] == [("off", 1), ("dspark", 1)]
    off, ds = rows
    assert (
        off["aggregate_tps"] == 40.0 and ds["aggregate_tps"] == 30.0
    )  # medians, an outlier does not move them
    assert off["per_user_tps"] == 40.0 and off["tau"] is None  # None stays None
    assert off["requests"] == 9 and ds["errors"] == 1 and off["wall_s"] == 6.0
    assert off["peak_rss_mb"] == 102.0 and off["repeats"] == 3 and "repeat" not in off
    assert goals(rows)["c1_dspark_aggregate_vs_best_fixed"] == pytest.approx(30.0 / 40.0)


def test_summarize_splits_model_time_by_model_per_step():
    from dspark.perf.bench import summarize

    before = {"model_seconds": 1.0, "model_seconds_by": {"target": 1.0}, "steps": 10, "step_seconds": 2.0}
    after = {
        "model_seconds": 4.0,
        "model_seconds_by": {"target": 3.5, "drafter_backbone": 0.5},
        "steps": 20,
        "step_seconds": 6.0,
    }
    s = summarize("dspark-skip", 1, [], [], 1.0, before, after, None)
    assert s["model_ms_per_step"] == 300.0  # 3 s over 10 steps
    assert s["model_ms_per_step_by_model"] == {"target": 250.0, "drafter_backbone": 50.0}


def test_combine_takes_the_median_of_each_model_s_time():
    rows = [
        {"mode": "off", "concurrency": 1, "model_ms_per_step_by_model": {"target": t}, "repeat": i}
        for i, t in enumerate((30.0, 10.0, 20.0))
    ]
    assert combine(rows)[0]["model_ms_per_step_by_model"] == {"target": 20.0}


def test_online_offset_recovers_a_known_shift_and_replays_causally():
    from dspark.core.calibration import STS, sigmoid
    from dspark.perf.calibration_online import map_offset, replay, split_requests

    rng = np.random.default_rng(0)
    z = rng.normal(size=20_000)
    y = (rng.random(z.size) < sigmoid(z + 0.7)).astype(float)  # the head is 0.7 logits underconfident
    assert abs(map_offset(z, y, prior=1e-9) - 0.7) < 0.05
    assert abs(map_offset(z, y, prior=1e9)) < 1e-3  # a strong prior keeps b at 0

    # three requests of 3 + 2 + 4 rounds, 7 drafts each; the replay's first round of a request
    # carries no offset in request mode (nothing seen yet), later rounds are shifted.
    acc = np.array([7, 7, 7, 0, 7, 7, 7, 7, 7])
    ver = np.full(9, 7)
    bounds = split_requests(acc, budget=17)
    assert bounds == [(0, 3), (3, 6), (6, 9)]
    logits = np.zeros((9, 7))
    out = replay(logits, acc, ver, STS.identity(7), [(0, 3), (3, 5), (5, 9)], prior=1.0, mode="request")
    assert np.all(out[[0, 3, 5]] == 0.0)
    assert np.all(out[1] > 0) and np.all(out[4] < 0) and np.all(out[8] > out[6])


def test_sequential_fit_recovers_a_known_slope_and_bias_and_reduces_to_sts():
    from dspark.core.calibration import STS, sigmoid
    from dspark.perf.calibration_online import fit_sequential

    rng = np.random.default_rng(1)
    z = rng.normal(size=(30_000, 2))
    c = sigmoid(np.array([2.0, 0.5]) * z + np.array([-1.0, 1.0]))  # the true conditional law
    u = rng.random(z.shape)
    accepted = np.where(u[:, 0] >= c[:, 0], 0, np.where(u[:, 1] >= c[:, 1], 1, 2))
    verified = np.full(len(z), 2)
    (a1, b1), (a2, b2) = fit_sequential(
        z, accepted, verified, np.linspace(0.25, 3, 12), np.linspace(-2, 2, 9)
    )
    assert abs(a1 - 2.0) <= 0.25 and abs(b1 + 1.0) <= 0.5  # one grid step
    assert abs(a2 - 0.5) <= 0.25 and abs(b2 - 1.0) <= 0.5
    # with no bias and slopes 1/T it is STS's own fit
    temps = np.linspace(0.2, 10.0, 50)
    fit = fit_sequential(z, accepted, verified, 1 / temps, (0.0,))
    sts = STS.fit(z, accepted, verified, grid=temps)
    assert np.allclose([1 / a for a, _ in fit], sts.temperatures)


def test_request_lengths_are_one_draw_for_every_cell_and_stay_in_their_range():
    assert request_lengths(64, 0.0, 5) == [64] * 5
    a = request_lengths(64, 0.5, 400)
    assert a == request_lengths(64, 0.5, 400)  # every mode and cell asks for the same lengths
    assert min(a) >= 32 and max(a) <= 96 and len(set(a)) > 30
    assert abs(np.mean(a) - 64) < 3
    with pytest.raises(ValueError, match="length spread"):
        request_lengths(64, 1.0, 3)
