"""Report tables and plots render from eval JSON of the shape `dspark eval` writes."""

import numpy as np

from dspark.core.calibration import STS
from dspark.training.report import ece_table, plot_conditional, plot_reliability, tau_table


def _eval(drafter, data, temp, tau):
    return {
        "drafter": drafter,
        "data": f"x/{data}.jsonl",
        "temperature": temp,
        "tau": tau,
        "conditional": [0.8, 0.7, None, 0.6],
        "ece_raw": 0.05,
        "ece_sts": 0.01,
    }


def test_tau_table_has_a_macro_average_only_when_every_dataset_is_present():
    evals = [_eval("dspark", "a", 0.0, 3.0), _eval("dspark", "b", 0.0, 4.0), _eval("dflash", "a", 0.0, 2.0)]
    table = tau_table(evals)
    assert "| dspark | 0 | 3.00 | 4.00 | 3.50 |" in table
    assert "| dflash | 0 | 2.00 | – | – |" in table
    assert "| dspark | a | 0 | 0.050 | 0.010 |" in ece_table(evals)


def test_plots_are_written(tmp_path):
    plot_conditional([_eval("dspark", "a", 0.0, 3.0)], tmp_path / "c.png")
    g = np.random.default_rng(0)
    logits = g.normal(1.0, 1.0, (300, 7))
    verified = np.full(300, 7)
    accepted = g.integers(0, 8, 300)
    plot_reliability(logits, accepted, verified, STS.identity(7), tmp_path / "r.png")
    assert (tmp_path / "c.png").stat().st_size > 1000 and (tmp_path / "r.png").stat().st_size > 1000
