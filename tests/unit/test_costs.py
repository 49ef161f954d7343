"""Live round costs (core/costs.py): the SPS table rescaled to the steps measured now, and the
draft call's price as a function of how many requests draft in it."""

from __future__ import annotations

import numpy as np
import pytest

from dspark.core.costs import DraftCost, LiveSteps
from dspark.core.sps import SPSTable

TABLE = SPSTable.from_step_times([1, 8, 32], [0.010, 0.020, 0.050])


def test_live_steps_keep_the_tables_shape_at_the_measured_level():
    live = LiveSteps(TABLE, alpha=0.5)
    assert live.step_time(8) == pytest.approx(0.020)  # nothing measured: the table itself
    live.observe(8, 0.050)  # today's machine is 2.5× slower than the table's day
    assert live.scale == pytest.approx(2.5)
    assert live.step_times(np.array([1, 32])) == pytest.approx([0.025, 0.125])
    live.observe(1, 0.010)  # moving average of measured / table: 0.5·2.5 + 0.5·1
    assert live.scale == pytest.approx(1.75)
    for bad in (float("nan"), float("inf"), 0.0, -1.0):  # clock glitches are ignored
        live.observe(8, bad)
    live.observe(0, 1.0)
    assert live.scale == pytest.approx(1.75) and live.observed == 2
    with pytest.raises(ValueError):
        LiveSteps(TABLE, alpha=0.0)


def test_draft_cost_interpolates_between_bands_and_extends_past_them():
    cost = DraftCost(alpha=1.0)  # alpha 1: each band holds its last call exactly
    assert not cost.seen and cost.mean is None
    with pytest.raises(ValueError, match="observe a draft call"):
        cost(np.array([1]))
    cost.observe(1, 0.010)
    # one band: flat below it, in proportion to n above it (never cheaper per request)
    assert cost(np.array([1, 4])) == pytest.approx([0.010, 0.040])
    cost.observe(16, 0.050)
    cost.observe(32, 0.090)
    assert [DraftCost.band(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 32)] == [0, 1, 2, 2, 3, 3, 4, 4, 5]
    # piecewise linear in between, the last slope beyond, flat below the smallest
    expect = [0.010, 0.030, 0.050, 0.070, 0.090, 0.170]
    assert cost(np.array([1, 8.5, 16, 24, 32, 64])) == pytest.approx(expect)
    cost.observe(0, 1.0)  # no requests, negative or non-finite seconds: ignored
    cost.observe(4, -1.0)
    cost.observe(4, float("nan"))
    assert cost(np.array([32])) == pytest.approx([0.090])


def test_draft_cost_moving_average_per_band_follows_a_slower_machine():
    cost = DraftCost(alpha=0.2)
    for _ in range(50):
        cost.observe(1, 0.010)
        cost.observe(32, 0.100)
    for _ in range(60):  # the machine slows down 2× for single drafts
        cost.observe(1, 0.020)
    one, many = cost(np.array([1, 32]))
    assert one == pytest.approx(0.020, rel=1e-3) and many == pytest.approx(0.100)
    # a flat extension never makes more requests cheaper than fewer
    cost2 = DraftCost(alpha=1.0)
    cost2.observe(2, 0.05)
    cost2.observe(8, 0.03)  # noise: a larger call measured cheaper
    assert cost2(np.array([16]))[0] == pytest.approx(0.03)
