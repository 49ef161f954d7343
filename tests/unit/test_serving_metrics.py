"""ServingMetrics' mirror to Triton (dspark.orchestrator.metrics): updates wait for flush() and
reach the backend summed per counter, last value per gauge, one per histogram observation, in
the order counters → histograms → gauges; the orchestrator's senders flush before a request's
last response. The in-process values never wait."""

from dspark.orchestrator.metrics import ServingMetrics, TritonMetricsBackend
from dspark.orchestrator.streaming import _MetricsFirst


class _Backend:
    def __init__(self):
        self.calls = []

    def inc(self, name, labels, value):
        self.calls.append(("inc", name, labels, value))

    def set(self, name, labels, value):
        self.calls.append(("set", name, labels, value))

    def observe(self, name, labels, buckets, value):
        self.calls.append(("observe", name, labels, value))


def test_updates_reach_the_backend_at_flush_summed_and_ordered():
    b = _Backend()
    m = ServingMetrics(7, b, {"model": "dspark"})
    m.flush()
    b.calls.clear()  # drafter_available, set at construction
    for v in (0.5, 0.8, 0.3):
        m.set_gauge("active_sequences", v)
    for _ in range(10):
        m.speculative_round(3, 2, None)
        m.inc("generated_tokens_total", 3)
    assert b.calls == []  # nothing before the flush ...
    assert (
        m.counter("generated_tokens_total") == 30 and m.gauge("active_sequences") == 0.3
    )  # ... here at once
    n = m.flush()
    assert n == len(b.calls)
    kinds = [c[0] for c in b.calls]
    assert kinds == sorted(kinds, key=["inc", "observe", "set"].index)  # counters, histograms, gauges
    incs = {(c[1], tuple(sorted(c[2].items()))): c[3] for c in b.calls if c[0] == "inc"}
    assert incs[("generated_tokens_total", (("model", "dspark"),))] == 30
    assert incs[("position_verified_total", (("model", "dspark"), ("position", "3")))] == 10
    assert incs[("position_accepted_total", (("model", "dspark"), ("position", "2")))] == 10
    assert ("position_accepted_total", (("model", "dspark"), ("position", "3"))) not in incs
    assert [c[3] for c in b.calls if c[0] == "observe" and c[1] == "verify_length"] == [3.0] * 10
    assert [c for c in b.calls if c[0] == "set"] == [("set", "active_sequences", {"model": "dspark"}, 0.3)]
    # 10 rounds of updates for 3 verified positions: far fewer round trips than updates
    assert n < 10 * 9
    b.calls.clear()
    assert m.flush() == 0 and b.calls == []  # nothing new


def test_without_a_backend_flush_does_nothing():
    m = ServingMetrics(7)
    m.inc("rounds_total")
    assert m.flush() == 0 and m.counter("rounds_total") == 1


class _Sender:
    def __init__(self, log):
        self.log = log

    def send(self, outputs, final):
        self.log.append(("send", final))

    def error(self, message):
        self.log.append(("error", message))

    def is_cancelled(self):
        return False


def test_the_last_response_of_a_request_goes_out_after_a_flush():
    log = []
    b = _Backend()
    m = ServingMetrics(7, b)
    m.flush()
    b.calls.clear()
    s = _MetricsFirst(_Sender(log), m)
    m.inc("requests_total", outcome="finished")
    s.send({}, final=False)
    assert b.calls == [] and log == [("send", False)]
    s.send({}, final=True)
    assert b.calls == [("inc", "requests_total", {"outcome": "finished"}, 1.0)] and log[-1] == ("send", True)
    m.inc("requests_total", outcome="rejected")
    s.error("bad")
    assert b.calls[-1][3] == 1.0 and b.calls[-1][2] == {"outcome": "rejected"} and log[-1] == ("error", "bad")
    assert not s.is_cancelled()


class _Pb:
    """What TritonMetricsBackend uses of pb_utils; counts the metric objects alive."""

    alive = 0

    class MetricFamily:
        COUNTER, GAUGE, HISTOGRAM = "c", "g", "h"

        def __init__(self, name, description, kind):
            pass

        def Metric(self, labels, buckets=None):  # noqa: N802 - pb_utils' name
            return _Pb._Metric()

    class _Metric:
        def __init__(self):
            _Pb.alive += 1

        def __del__(self):
            _Pb.alive -= 1

        def increment(self, v):
            pass


def test_close_drops_every_metric_object():
    be = TritonMetricsBackend(_Pb)
    be.inc("rounds_total", {"model": "dspark"}, 1.0)
    be.inc("requests_total", {"model": "dspark", "outcome": "finished"}, 1.0)
    assert _Pb.alive == 2
    be.close()  # the model's finalize(): while the stub can still reach tritonserver
    assert _Pb.alive == 0 and not be.families
