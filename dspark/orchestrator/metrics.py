"""The orchestrator's Prometheus metrics, kept in-process and mirrored to Triton's metrics port.

Every metric lives here as a plain Python value (so unit tests and `snapshot()` read it without
a server); when a `backend` is given (model.py passes one built on pb_utils.MetricFamily), the
updates are forwarded to the matching Triton metrics at each `flush()` (after every round), which
tritonserver publishes on its metrics port next to its own `nv_*` metrics.

Families (all prefixed `dspark_`):
  requests_total{outcome}            finished | error | cancelled | rejected | busy
  generated_tokens_total             tokens streamed to clients
  sequence_rounds_total{kind}        speculative | target_only (one per sequence per round)
  acceptance_length                  histogram: accepted drafts per speculative sequence-round
  verify_length                      histogram: drafts verified (ℓ) per speculative sequence-round
  position_verified_total{position}  drafts verified at block position k (1-based)
  position_accepted_total{position}  of those, accepted
  round_verified_tokens                   histogram: Σℓ over the batch of one round (one per round)
  active_sequences / queued_requests / free_slots      gauges, after every round
  drafter_available                  gauge: 1 while drafting, 0 during a fallback to target-only
  fallback_events_total{reason}      drafter failures that switched requests to target-only
  skipped_drafts_total               dspark-skip: request-rounds that decided not to draft
  draft_rounds_total{reason}         dspark-skip: rounds with a draft call, by why (merit | refresh | new)
  skip_price_seconds{what}           dspark-skip's measured prices, after every plan: draft_1 / draft_R
                                     (a drafting round for 1 / all R requests), step_1 / step_R (a
                                     target step now), catchup_position; why it drafts or not
  rounds_total / round_seconds_total          busy batcher rounds and their wall time
  bls_calls_total{model_called} / bls_seconds_total{model_called}   BLS calls and time inside them
  bls_bytes_total{model_called, direction}                          tensor bytes sent (in) / received (out)
  calibration_predicted_survival{position} / calibration_realized_survival{position}
                                     running means over verified positions: the calibrated
                                     prefix survival the scheduler used vs what happened
  sps_table{source}                  1 for the SPS table in use: file | quick_probe | none
"""

from __future__ import annotations

import threading
from collections import defaultdict

import numpy as np

ROUND_BUCKETS = [0, 1, 2, 3, 4, 5, 6, 7]
VERIFIED_BUCKETS = [0, 1, 2, 4, 8, 16, 32, 64, 128, 256]


class _Histogram:
    def __init__(self, buckets: list[float]) -> None:
        self.buckets = list(buckets)
        self.counts = [0] * (len(buckets) + 1)  # last = +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        i = next((i for i, b in enumerate(self.buckets) if v <= b), len(self.buckets))
        self.counts[i] += 1
        self.sum += v
        self.count += 1


class ServingMetrics:
    """Thread-safe counters, gauges and histograms; `backend` mirrors them to Triton.

    Updates reach the backend at `flush()`, not one by one: each backend update is a round trip
    between the python stub and tritonserver (pb_utils metrics), and a speculative round updates
    up to ~30 per sequence (positions, calibration). Between flushes, increments to one counter add
    up and a gauge keeps its last value; histogram observations are sent one by one (the backend
    has no bulk observe). The orchestrator flushes after every round, before every final
    response, and every 0.5 s when idle."""

    def __init__(self, gamma: int = 7, backend=None, labels: dict | None = None) -> None:
        self.gamma = gamma
        self.backend = backend
        self.labels = dict(labels or {})
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()  # one flush at a time: the backend sees updates in order
        self._pending_inc: dict[tuple, float] = defaultdict(float)
        self._pending_set: dict[tuple, float] = {}
        self._pending_obs: list[tuple[str, float]] = []
        self.counters: dict[tuple, float] = defaultdict(float)
        self.gauges: dict[tuple, float] = {}
        self.hists: dict[str, _Histogram] = {
            "acceptance_length": _Histogram(ROUND_BUCKETS[: gamma + 1]),
            "verify_length": _Histogram(ROUND_BUCKETS[: gamma + 1]),
            "round_verified_tokens": _Histogram(VERIFIED_BUCKETS),
        }
        self._pred = np.zeros(gamma)
        self._real = np.zeros(gamma)
        self._n = np.zeros(gamma)
        self.set_gauge("drafter_available", 1.0)

    # -- primitives ---------------------------------------------------------------------------

    def inc(self, name: str, value: float = 1.0, **labels) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self.counters[key] += value
            if self.backend is not None and value:
                self._pending_inc[key] += value

    def set_gauge(self, name: str, value: float, **labels) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self.gauges[key] = float(value)
            if self.backend is not None:
                self._pending_set[key] = float(value)

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            self.hists[name].observe(value)
            if self.backend is not None:
                self._pending_obs.append((name, float(value)))

    def flush(self) -> int:
        """Send what changed since the last flush to the backend: counters, then histogram
        observations, then gauges (so that a reader who sees the gauges of a round also sees its
        counters). Returns the number of backend updates (0 without a backend)."""
        if self.backend is None:
            return 0
        with self._flush_lock:
            with self._lock:
                incs, self._pending_inc = self._pending_inc, defaultdict(float)
                obs, self._pending_obs = self._pending_obs, []
                sets, self._pending_set = self._pending_set, {}
            for (name, labels), value in incs.items():
                self.backend.inc(name, {**self.labels, **dict(labels)}, value)
            for name, value in obs:
                self.backend.observe(name, self.labels, self.hists[name].buckets, value)
            for (name, labels), value in sets.items():
                self.backend.set(name, {**self.labels, **dict(labels)}, value)
        return len(incs) + len(obs) + len(sets)

    def counter(self, name: str, **labels) -> float:
        return self.counters.get((name, tuple(sorted(labels.items()))), 0.0)

    def gauge(self, name: str, **labels) -> float | None:
        return self.gauges.get((name, tuple(sorted(labels.items()))))

    # -- what the batcher reports --------------------------------------------------------------

    def speculative_round(self, verified: int, accepted: int, survival: np.ndarray | None) -> None:
        """One sequence's speculative round: ℓ verified, `accepted` accepted; `survival` is the
        calibrated prefix survival the scheduler saw for positions 1..γ (None without a head)."""
        self.inc("sequence_rounds_total", kind="speculative")
        self.observe("verify_length", verified)
        self.observe("acceptance_length", accepted)
        for k in range(1, verified + 1):
            self.inc("position_verified_total", position=str(k))
            if k <= accepted:
                self.inc("position_accepted_total", position=str(k))
        if survival is None or verified == 0:
            return
        with self._lock:
            k = np.arange(verified)
            self._pred[k] += survival[:verified]
            self._real[k] += (k < accepted).astype(float)
            self._n[k] += 1
            pred, real = self._pred[k] / self._n[k], self._real[k] / self._n[k]
        for i in range(verified):
            self.set_gauge("calibration_predicted_survival", pred[i], position=str(i + 1))
            self.set_gauge("calibration_realized_survival", real[i], position=str(i + 1))

    def target_rounds(self, n: int) -> None:
        self.inc("sequence_rounds_total", n, kind="target_only")

    def round_verified(self, verified: int) -> None:
        self.observe("round_verified_tokens", verified)

    def occupancy(self, active: int, queued: int, free_slots: int) -> None:
        self.set_gauge("active_sequences", active)
        self.set_gauge("queued_requests", queued)
        self.set_gauge("free_slots", free_slots)

    def calibration(self) -> dict:
        """Predicted vs realized prefix survival per position (positions verified at least once)."""
        with self._lock:
            seen = self._n > 0
            return {
                "positions": (np.nonzero(seen)[0] + 1).tolist(),
                "predicted": (self._pred[seen] / self._n[seen]).tolist(),
                "realized": (self._real[seen] / self._n[seen]).tolist(),
                "rounds": self._n[seen].astype(int).tolist(),
            }

    def snapshot(self) -> dict:
        """Everything as plain data (tests, logs)."""

        def fmt(key):
            name, labels = key
            return name + ("{" + ",".join(f"{k}={v}" for k, v in labels) + "}" if labels else "")

        with self._lock:
            return {
                "counters": {fmt(k): v for k, v in self.counters.items()},
                "gauges": {fmt(k): v for k, v in self.gauges.items()},
                "histograms": {
                    n: {"buckets": h.buckets, "counts": h.counts, "sum": h.sum, "count": h.count}
                    for n, h in self.hists.items()
                },
            }


DESCRIPTIONS = {
    "requests_total": "Requests by outcome (finished, error, cancelled, rejected, busy)",
    "generated_tokens_total": "Tokens streamed to clients",
    "sequence_rounds_total": "Decoding rounds per sequence, speculative or target-only",
    "acceptance_length": "Accepted drafts per speculative sequence-round",
    "verify_length": "Drafts verified (verification length) per speculative sequence-round",
    "position_verified_total": "Drafts verified at each block position",
    "position_accepted_total": "Drafts accepted at each block position",
    "round_verified_tokens": "Drafts verified over the whole batch in one round",
    "active_sequences": "Sequences holding a slot",
    "queued_requests": "Requests waiting for a slot",
    "free_slots": "Target sequence slots free",
    "drafter_available": "1 while the drafter serves, 0 while requests fall back to target-only",
    "fallback_events_total": "Drafter failures that switched requests to target-only decoding",
    "calibration_predicted_survival": "Mean calibrated prefix survival the scheduler used, per position",
    "calibration_realized_survival": "Mean realized prefix survival, per position",
    "sps_table": "The SPS table in use (label source)",
    "skipped_drafts_total": "Request-rounds where dspark-skip decided drafting would not pay",
    "skip_price_seconds": "dspark-skip's measured prices: draft_1, draft_R, step_1, step_R, catchup_position",
    "draft_rounds_total": "dspark-skip rounds with a draft call, by reason: merit, refresh, new",
    "rounds_total": "Batcher rounds that ran at least one request",
    "bls_calls_total": "BLS calls from the orchestrator, per called model",
    "bls_seconds_total": "Seconds inside BLS calls (transport + the model's execution), per called model",
    "bls_bytes_total": "Tensor bytes crossing BLS calls, per called model and direction (in = sent to it)",
    "round_seconds_total": "Wall time of those rounds (model calls + everything else)",
}


class TritonMetricsBackend:
    """Forwards ServingMetrics updates to pb_utils metric families (created lazily)."""

    def __init__(self, pb_utils) -> None:
        self.pb = pb_utils
        self.families: dict[str, object] = {}
        self.metrics: dict[tuple, object] = {}
        self._lock = threading.Lock()

    def _metric(self, name: str, kind: str, labels: dict, buckets=None):
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            if key not in self.metrics:
                if name not in self.families:
                    fam_kind = getattr(self.pb.MetricFamily, kind)
                    self.families[name] = self.pb.MetricFamily(
                        name=f"dspark_{name}", description=DESCRIPTIONS.get(name, name), kind=fam_kind
                    )
                fam = self.families[name]
                if buckets is not None:
                    self.metrics[key] = fam.Metric(labels=labels, buckets=[float(b) for b in buckets])
                else:
                    self.metrics[key] = fam.Metric(labels=labels)
            return self.metrics[key]

    def inc(self, name: str, labels: dict, value: float) -> None:
        self._metric(name, "COUNTER", labels).increment(value)

    def set(self, name: str, labels: dict, value: float) -> None:
        self._metric(name, "GAUGE", labels).set(value)

    def observe(self, name: str, labels: dict, buckets, value: float) -> None:
        self._metric(name, "HISTOGRAM", labels, buckets).observe(value)

    def close(self) -> None:
        """Drop every metric and family; the model's finalize() calls it while the stub can still
        message tritonserver. Left to the interpreter's exit, their destructors message a parent
        that is gone and the stub segfaults (python backend 2.51, Metric::Clear)."""
        with self._lock:
            self.metrics.clear()
            self.families.clear()


def parse_prometheus(text: str, prefix: str = "dspark_") -> dict[str, float]:
    """`name{labels}` → value for the lines of a /metrics page that start with `prefix`."""
    out = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
