"""The short soak (issue 16): 32 streaming clients for one minute against a real tritonserver on
loopback, mixing modes, sampling, stop strings, cancellations and bad requests (the long one is
`make soak`). Only the expected errors; no slot held at the end; greedy answers unchanged; RSS
steady; no client hangs."""

import json

import pytest

from dspark.perf.soak import BAD, run_soak
from tests.integration.test_tiny_server import tiny  # noqa: F401 - fixture

pytestmark = pytest.mark.integration


def test_short_soak(tiny, tmp_path):  # noqa: F811
    _, eng = tiny
    out = tmp_path / "soak.json"
    res = run_soak(
        minutes=1.0, clients=32, out=out, work=tmp_path, engines=eng, bin_seconds=15, sample_seconds=3,
        log=lambda s: None,
    )  # fmt: skip
    assert json.loads(out.read_text())["requests"] == res["requests"] and out.with_suffix(".png").exists()
    v = res["verdict"]
    # tritonserver 2.51's python backend can abort under this load (a segfault in
    # libtriton_python.so, triton-inference-server/server #8882; ~1 one-minute run in 20 here):
    # supervised as under `dspark serve`, it is restarted, and the streams it cut are reported,
    # not hidden. More than one in a minute, or a dead stub, is a failure.
    restarts = res["restarts"]
    assert len(restarts) <= 1 and all("exit_code" in r for r in restarts), restarts
    assert res["lost_in_restart"] == res["outcomes"].get("lost_in_restart", 0)
    assert res["unexpected_errors"] == {}, (res["unexpected_errors"], res["error_examples"])
    assert v["slots_held_at_end_0"], res["slots_held_at_end"]
    assert v["greedy_output_equal"] and v["no_hung_client"]
    assert res["rss"]["growth"] is not None and res["rss"]["growth"] <= 0.05, res["rss"]["growth"]
    # every kind of traffic happened, and every malformed kind got its own error
    o = res["outcomes"]
    assert o.get("stream_finished", 0) > 50 and o.get("stop_finished", 0) > 5 and o.get("cancelled", 0) > 5
    assert {f"bad:{i}" for i in range(len(BAD))} <= set(res["errors_by_kind"])
    # on a shared 2-core VM a 15 s bin can be noisy: a loose bound here, the 25% goal in make soak
    # (a restarted server warms up again: its bins are not comparable)
    assert res["itl_p50_drift"] is not None and (res["itl_p50_drift"] < 2.0 or restarts)
