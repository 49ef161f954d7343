"""dspark.perf.stage_curve: the positions summed down a drafter's stages, the log-linear fit and the
positions it projects for a goal, and the projection over a series of stage points."""

import math

import numpy as np
import pytest

from dspark.perf.stage_curve import SETS, StagePoint, chain_totals, fit_log, positions_for, projections


def test_chain_totals_sums_every_stage():
    summary = {
        "steps": 300,
        "supervised_slots": 30,
        "continued_from": {
            "steps": 200,
            "supervised_slots": 20,
            "continued_from": {"steps": 100, "supervised_slots": 10},
        },
    }
    assert chain_totals(summary) == (600, 60)
    assert chain_totals({"steps": 5, "supervised_slots": 7}) == (5, 7)


def test_fit_log_recovers_a_log_linear_curve_and_its_goal():
    x = np.array([1e6, 2e6, 4e6, 8e6])
    a, b = 0.3, 0.1
    fa, fb = fit_log(x, a + b * np.log(x))
    assert fa == pytest.approx(a) and fb == pytest.approx(b)
    need = positions_for(fa, fb, 2.0)
    assert a + b * math.log(need) == pytest.approx(2.0)
    assert positions_for(1.0, 0.0, 2.0) == math.inf and positions_for(1.0, -0.1, 2.0) == math.inf


def _point(kind, positions, prompts, tau0, tau1=1.5):
    tau = {(s, 0): tau0 for s in SETS} | {(s, 1): tau1 for s in SETS}
    return StagePoint(kind, "c0ffee0", "2026-12-07", positions // 1000, positions, prompts, tau)


def test_projection_uses_the_newest_protocol_and_the_last_points():
    pts = [_point("dspark", 1_000_000, 12, 9.0)]  # an old protocol's point far off the line: left out
    pts += [_point("dspark", int(p), 24, 1.0 + 0.2 * math.log2(p / 1e6)) for p in (2e6, 4e6, 8e6)]
    pts += [_point("dflash", 8_000_000, 24, 5.0)]  # another kind: left out
    proj = projections(pts, "dspark", fit_last=3)
    assert (
        proj["points"] == 3 and proj["prompts"] == 24 and proj["positions_fitted"] == [2_000_000, 8_000_000]
    )
    cell = proj["cells"]["gsm8k-test-T0"]
    assert cell["gain_per_doubling"] == pytest.approx(0.2)
    assert cell["positions_for_goal"] == pytest.approx(1e6 * 2 ** ((2.5 - 1.0) / 0.2), rel=1e-6)
    assert proj["cells"]["gsm8k-test-T1"]["positions_for_goal"] == math.inf  # flat at T = 1
    assert projections(pts[:2], "dspark", fit_last=3)["cells"] == {}  # one point of the newest protocol
