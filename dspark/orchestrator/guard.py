"""The drafter behind a guard: its failures never fail a request (lossless fallback).

Any failure of the drafter (a model unloaded, a crashed call) switches the requests it served to
target-only rounds, which is lossless: greedy output stays token for token the same, sampled
output keeps the target's distribution. A failure is visible in the metrics
(fallback_events_total, drafter_available) and the log; new requests try the drafter again
`retry_s` seconds later.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import numpy as np

from dspark.core.interfaces import Drafter, Proposal
from dspark.orchestrator.metrics import ServingMetrics

log = logging.getLogger("dspark.orchestrator")


class DrafterFailure(RuntimeError):
    """The drafter could not propose; the round's requests continue target-only."""


class DrafterGuard(Drafter):
    """Wraps the drafter: `propose` raises DrafterFailure before any state has changed;
    `begin`/`advance` failures mark the request as lost to the drafter (`lost`; the batcher
    moves it to target-only after the round); `end` never raises. Holds the fallback state:
    while the drafter is down, new requests are admitted target-only."""

    def __init__(self, inner: Drafter, metrics: ServingMetrics, retry_s: float = 10.0) -> None:
        self.inner = inner
        self.metrics = metrics
        self.retry_s = retry_s
        self.block_size = inner.block_size
        self.vocab_size = getattr(inner, "vocab_size", 0)
        self.lost: dict[int, str] = {}
        self.last_catchup_s = 0.0  # seconds the last propose call spent catching up lazy contexts
        self.catchup_seconds: float | None = None  # median price per position fed by a catch-up
        self._catchup_prices: deque[float] | None = None  # recent per-position prices (None: warm-up)
        self.down_until = 0.0  # monotonic time before which new requests do not draft

    @property
    def free_slots(self) -> int:
        return getattr(self.inner, "free_slots", 1 << 30)

    @property
    def has_head(self) -> bool:
        return getattr(self.inner, "has_head", True)

    def begin(self, rid, token_ids, features) -> None:
        try:
            self.inner.begin(rid, token_ids, features)
        except Exception as exc:  # noqa: BLE001
            self.lost[rid] = f"begin: {exc}"

    def advance(self, rid, token_ids, features) -> None:
        if rid in self.lost:
            return
        try:
            self.inner.advance(rid, token_ids, features)
        except Exception as exc:  # noqa: BLE001
            self.lost[rid] = f"advance: {exc}"

    def end(self, rid) -> None:
        self.lost.pop(rid, None)
        try:
            self.inner.end(rid)
        except Exception as exc:  # noqa: BLE001
            log.warning("drafter release of request %d failed (%s); continuing", rid, exc)

    def propose(self, rids, anchors, params, gens) -> Proposal:
        before = self.inner.catchup_totals()
        t0 = time.perf_counter()
        try:
            prop = self.inner.propose(rids, anchors, params, gens)
        except Exception as exc:  # noqa: BLE001
            raise DrafterFailure(str(exc)) from exc
        seconds = time.perf_counter() - t0
        after = self.inner.catchup_totals()  # the catch-up's own price is measured apart
        fed, fed_s = after[0] - before[0], after[1] - before[1]
        if fed > 0:  # the catch-up's own price, per position (dspark-skip's cost model reads it)
            if self._catchup_prices is None:  # the context engine's first call is its warm-up
                self._catchup_prices = deque(maxlen=9)
            else:
                self._catchup_prices.append(fed_s / fed)
                self.catchup_seconds = float(np.median(self._catchup_prices))
        self.last_catchup_s = min(max(fed_s, 0.0), seconds)
        return prop

    def catchup_positions(self, rid: int) -> int:
        try:
            return self.inner.catchup_positions(rid)
        except Exception:  # noqa: BLE001 - a lost request: its next draft never comes
            return 0

    def catchup_totals(self) -> tuple[int, float]:
        return self.inner.catchup_totals()

    # -- availability ---------------------------------------------------------------------------

    def up(self) -> bool:
        """May a new request draft? (After a failure, only once `retry_s` has passed.)"""
        up = time.monotonic() >= self.down_until
        if up and self.metrics.gauge("drafter_available") == 0.0:
            log.warning("retrying the drafter for new requests")
            self.metrics.set_gauge("drafter_available", 1.0)
        return up

    def failed(self, reason: str, requests: int) -> None:
        """A failure took `requests` requests off the drafter: log once per outage, count each,
        and keep new requests target-only for `retry_s`."""
        if time.monotonic() >= self.down_until:
            log.warning(
                "%s; %d request(s) continue target-only (lossless), new requests retry the drafter in %.0f s",
                reason,
                requests,
                self.retry_s,
            )
        self.down_until = time.monotonic() + self.retry_s
        self.metrics.set_gauge("drafter_available", 0.0)
        self.metrics.inc("fallback_events_total", requests, reason=reason.split(":")[0].replace(" ", "_"))
