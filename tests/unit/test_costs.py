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


def _warm(cost: DraftCost, *bands: int) -> DraftCost:
    for n in bands:  # the first call of each band is a warm-up and is dropped
        cost.observe(n, 100.0)
    return cost


def test_draft_cost_drops_each_bands_first_call_and_reads_medians():
    cost = DraftCost()
    cost.observe(1, 5.0)  # an engine's first inference: 500× a normal call
    assert not cost.seen and cost.mean is None
    with pytest.raises(ValueError, match="observe a call first"):
        cost(np.array([1]))
    for s in (0.010, 0.011, 0.5, 0.009):  # one hiccup among normal calls
        cost.observe(1, s)
    assert cost(np.array([1]))[0] == pytest.approx(0.0105)  # median of the four kept
    for _ in range(9):  # the window holds the last 9 calls: a slower machine takes over
        cost.observe(1, 0.020)
    assert cost(np.array([1]))[0] == pytest.approx(0.020)
    with pytest.raises(ValueError):
        DraftCost(window=0)


def test_draft_cost_interpolates_between_bands_and_extends_past_them():
    cost = _warm(DraftCost(window=1), 1, 16, 32, 4)
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
    # a flat extension never makes more requests cheaper than fewer
    cost2 = _warm(DraftCost(window=1), 2, 8)
    cost2.observe(2, 0.05)
    cost2.observe(8, 0.03)  # noise: a larger call measured cheaper
    assert cost2(np.array([16]))[0] == pytest.approx(0.03)
