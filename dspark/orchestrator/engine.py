"""In-flight batching: requests join and leave between rounds; every round batches all of them.

The engine reuses the reference loop's round functions (dspark.core.reference: prefill, a target-only
round, a speculative round), so the serving path decodes with exactly the oracle's rules; what it
adds is the life cycle of a request in a server:

  submit → queued → admitted (slots allocated, prompt prefilled) → rounds → finished | cancelled |
  failed, and in every end state its target and drafter slots are released.

Each request carries its speculation mode (off, static:k, threshold:x, dspark, dspark-async);
requests of one mode are scheduled together, and a mode-`off` request never runs the drafter.
Because every request draws its random numbers from its own generator in a fixed order, a
request's tokens do not depend on which others share its rounds (for static modes exactly; for
dspark the verification lengths depend on the batch, the output distribution does not).

Graceful degradation: the drafter is wrapped so that any failure of it (a model unloaded, a
crashed call) switches the requests it served to target-only rounds, which is lossless: greedy
output stays token for token the same, sampled output keeps the target's distribution. A failure
is visible in `metrics` (fallback_events_total, drafter_available) and the log; new requests try
the drafter again `drafter_retry_s` seconds later.

Sinks receive `tokens(list[int])` as tokens commit, then exactly one of `done(result)` or
`error(message)`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from dspark.core.calibration import STS, cumulative_survival, sigmoid
from dspark.core.interfaces import Drafter, Proposal, Request, Result, Target
from dspark.core.reference import _Live, _prefill, _release, _speculative_round, _target_round
from dspark.core.sampling import make_generator
from dspark.core.scheduler import parse_policy
from dspark.core.sps import SPSTable
from dspark.orchestrator.metrics import ServingMetrics

log = logging.getLogger("dspark.orchestrator")


SKIP_REFRESH = 4  # dspark-skip: rounds without drafting before requests draft again, together
SKIP_REFRESH_MAX = 32  # a refresh that keeps showing drafting does not pay backs off up to this


class Busy(RuntimeError):
    """The queue is full: the client should retry later."""


class DrafterFailure(RuntimeError):
    """The drafter could not propose; the round's requests continue target-only."""


class _GuardedDrafter(Drafter):
    """Wraps the drafter so its failures never fail a request: `propose` raises DrafterFailure
    before any state has changed; `begin`/`advance` failures mark the request as lost to the
    drafter (the engine moves it to target-only after the round); `end` never raises."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.block_size = inner.block_size
        self.lost: dict[int, str] = {}
        self.seconds: float | None = None  # moving average of one propose call (dspark-skip reads it)

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
        t0 = time.perf_counter()
        try:
            prop = self.inner.propose(rids, anchors, params, gens)
        except Exception as exc:  # noqa: BLE001
            raise DrafterFailure(str(exc)) from exc
        seconds = time.perf_counter() - t0
        self.seconds = seconds if self.seconds is None else 0.8 * self.seconds + 0.2 * seconds
        return prop


class Sink(Protocol):
    def tokens(self, tokens: list[int]) -> None: ...
    def done(self, result: Result) -> None: ...
    def error(self, message: str) -> None: ...


@dataclass
class _Entry:
    live: _Live
    mode: str
    sink: Sink
    sent: int = 0
    t_submit: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    drafting: bool = False  # holds drafter state and runs speculative rounds
    fallback: str | None = None  # why a speculative request continues target-only
    traced: int = 0  # rounds of live.trace already reported to the metrics
    skipped: int = 0  # consecutive rounds this request did not draft (dspark-skip)
    refresh: int = SKIP_REFRESH  # dspark-skip: rounds without drafting before a refresh (_plan_drafting)


class Engine:
    """Continuous batching of decoding requests over one target and (optionally) one drafter."""

    def __init__(
        self,
        target: Target,
        drafter: Drafter | None = None,
        sps: SPSTable | None = None,
        calibration: STS | None = None,
        max_active: int = 16,
        max_queue: int = 64,
        metrics: ServingMetrics | None = None,
        drafter_retry_s: float = 10.0,
        prefill_budget: int = 2048,
    ) -> None:
        self.target = target
        self.drafter = _GuardedDrafter(drafter) if drafter is not None else None
        self.sps = sps
        self.calibration = calibration
        self.max_active = max_active
        self.max_queue = max_queue
        self.metrics = metrics or ServingMetrics(drafter.block_size if drafter is not None else 7)
        self.drafter_retry_s = drafter_retry_s
        # prompt tokens prefilled per step (at least one request): 32 prompts arriving together
        # would otherwise be one ~10k-token target call that every active stream waits behind
        self.prefill_budget = prefill_budget
        self.drafter_down_until = 0.0  # monotonic time before which new requests do not draft
        self.queue: deque[_Entry] = deque()
        self.active: list[_Entry] = []
        self._policies: dict[str, object] = {}
        self._next = 0
        self._steps = 0

    # -- requests -----------------------------------------------------------------------------

    def set_sps(self, sps: SPSTable) -> None:
        """Use a (newly measured) SPS table from now on; policies are rebuilt on next use."""
        self.sps = sps
        self._policies.clear()

    def policy(self, mode: str):
        """The policy object of a mode spec (raises ValueError naming the valid forms)."""
        if mode not in self._policies:
            if mode != "off" and self.drafter is None:
                raise ValueError(f"mode {mode!r} needs a drafter and none is loaded: use mode 'off'")
            self._policies[mode] = parse_policy(mode, self.sps)
        return self._policies[mode]

    def submit(self, req: Request, mode: str, sink: Sink) -> int:
        self.policy(mode)  # validate before queueing
        if len(self.queue) >= self.max_queue + max(self._free(), 0):  # free slots admit at the next step
            self.metrics.inc("requests_total", outcome="busy")
            raise Busy(
                f"server busy: {len(self.active)} sequences decoding and {len(self.queue)} queued "
                f"(max_queue {self.max_queue}); retry later"
            )
        rid = self._next
        self._next += 1
        live = _Live(rid, req, -1, make_generator(req.params.seed))
        self.queue.append(_Entry(live, mode, sink))
        return rid

    def cancel(self, rid: int) -> bool:
        """Stop a request (client gone); its slots are released at the next step boundary."""
        for e in list(self.queue) + self.active:
            if e.live.rid == rid:
                e.cancelled = True
                return True
        return False

    @property
    def idle(self) -> bool:
        return not self.queue and not self.active

    # -- the loop -----------------------------------------------------------------------------

    def step(self) -> None:
        """Admit what fits, run one round for every active request, deliver, release."""
        self._steps += 1
        self._drop_cancelled()
        self._admit()
        groups: dict[str, list[_Entry]] = {}
        for e in self.active:
            if e.live.finish is None:
                groups.setdefault(e.mode if e.drafting else "off", []).append(e)
        plain = groups.pop("off", [])
        budget = 0
        for mode, entries in groups.items():
            lives = [e.live for e in entries]
            try:
                policy = self.policy(mode)
                mask = (
                    self._plan_drafting(policy, entries) if getattr(policy, "skip_drafting", False) else None
                )
                _speculative_round(self.target, self.drafter, policy, self.calibration, lives, mask)
            except DrafterFailure as exc:  # nothing changed yet: these requests go on target-only
                self._fall_back(entries, f"drafter failed: {exc}")
                plain += entries
                continue
            except Exception as exc:  # a failed round fails its requests, not the server
                self._fail(entries, f"decoding round failed: {exc}")
                continue
            budget += self._report_rounds(entries)
            lost = [e for e in entries if e.live.rid in self.drafter.lost and e.live.finish is None]
            if lost:
                self._fall_back(lost, f"drafter failed: {self.drafter.lost[lost[0].live.rid]}")
        if plain:
            try:
                _target_round(self.target, [e.live for e in plain])
                self.metrics.target_rounds(len(plain))
            except Exception as exc:
                self._fail(plain, f"decoding round failed: {exc}")
        if groups:
            self.metrics.round_budget(budget)
        self._deliver()
        self.metrics.occupancy(len(self.active), len(self.queue), self._free_slots())

    SKIP_REFRESH = SKIP_REFRESH
    SKIP_REFRESH_MAX = SKIP_REFRESH_MAX

    def _plan_drafting(self, policy, entries: list[_Entry]) -> np.ndarray:
        """dspark-skip: which requests draft this round, from stale confidences only.

        A request drafts when the plan says its expected gain pays for the draft call, or when
        it is due for a refresh (its confidences are `refresh` rounds old). Each refresh doubles
        the request's interval (4, 8, 16, 32 rounds): when drafting never pays on this machine,
        the refresh draft calls stop costing a fixed share of every round. As soon as the plan
        picks the request on its own merits, the interval drops back to 4."""
        gamma = self.drafter.block_size
        stale = np.full((len(entries), gamma), np.nan)
        for r, e in enumerate(entries):
            if e.live.conf_history:
                stale[r] = e.live.conf_history[-1]
        max_len = np.array([min(gamma, e.live.req.max_tokens - len(e.live.out) - 1) for e in entries])
        max_len = np.maximum(max_len, 0)
        # refreshes are synchronised (every SKIP_REFRESH-th step for everyone due, and every
        # interval is a multiple of it), so that the draft call they cost is paid once for all
        # of them, not once per staggered request
        refresh_step = self._steps % self.SKIP_REFRESH == 0
        forced = np.array([refresh_step and e.skipped + 1 >= e.refresh for e in entries])
        seconds = self.drafter.seconds
        merit = policy.plan(stale, max_len, seconds) if forced.any() else None
        mask = policy.plan(stale, max_len, seconds, forced)
        for r, (e, m) in enumerate(zip(entries, mask)):
            if merit is not None and forced[r] and not merit[r]:
                e.refresh = min(2 * e.refresh, self.SKIP_REFRESH_MAX)
            elif m and e.live.conf_history:
                e.refresh = self.SKIP_REFRESH
            e.skipped = 0 if m else e.skipped + 1
        if (~mask).any():
            self.metrics.inc("skipped_drafts_total", float((~mask).sum()))
        return mask

    def _report_rounds(self, entries: list[_Entry]) -> int:
        """Per-round acceptance and calibration metrics; returns the round's Σℓ."""
        budget = 0
        for e in entries:
            for t in e.live.trace[e.traced :]:
                surv = None
                if self.drafter.has_head:
                    c = self.calibration.apply(t.conf_logits) if self.calibration else sigmoid(t.conf_logits)
                    surv = cumulative_survival(c)
                self.metrics.speculative_round(t.proposed, t.accepted, surv)
                budget += t.proposed
            e.traced = len(e.live.trace)
        return budget

    def _fall_back(self, entries: list[_Entry], reason: str) -> None:
        """Drop these requests' drafter state; they continue with target-only rounds."""
        if time.monotonic() >= self.drafter_down_until:
            log.warning(
                "%s; %d request(s) continue target-only (lossless), new requests retry the drafter in %.0f s",
                reason,
                len(entries),
                self.drafter_retry_s,
            )
        self.drafter_down_until = time.monotonic() + self.drafter_retry_s
        self.metrics.set_gauge("drafter_available", 0.0)
        for e in entries:
            self.metrics.inc("fallback_events_total", reason=reason.split(":")[0].replace(" ", "_"))
            e.drafting = False
            e.fallback = reason
            self.drafter.end(e.live.rid)

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if self.idle:
                return
            self.step()
        raise RuntimeError(f"engine still busy after {max_steps} steps")

    def _free_slots(self) -> int:
        return getattr(self.target, "free_slots", self.max_active - len(self.active))

    def _free(self) -> int:
        n = getattr(self.target, "free_slots", self.max_active)
        if self.drafter is not None:
            n = min(n, self.drafter.free_slots)
        return min(n, self.max_active - len(self.active))

    def _drafter_up(self) -> bool:
        if self.drafter is None:
            return False
        up = time.monotonic() >= self.drafter_down_until
        if up and self.metrics.gauge("drafter_available") == 0.0:
            log.warning("retrying the drafter for new requests")
            self.metrics.set_gauge("drafter_available", 1.0)
        return up

    def _admit(self) -> None:
        new: dict[bool, list[_Entry]] = {True: [], False: []}
        tokens = 0
        while self.queue and self._free() > 0:
            n = len(self.queue[0].live.req.prompt_ids)
            if self.prefill_budget and tokens and tokens + n > self.prefill_budget:
                break  # the rest waits for the next step's budget
            tokens += n
            e = self.queue.popleft()
            try:
                e.live.slot = self.target.allocate()
            except Exception as exc:
                self.queue.appendleft(e)  # no slot after all: retry next round
                if not self.active:
                    self._fail([e], f"cannot allocate a target slot: {exc}")
                break
            self.active.append(e)
            e.drafting = e.mode != "off" and self._drafter_up()
            if e.mode != "off" and not e.drafting:
                e.fallback = "drafter unavailable at admission"
                self.metrics.inc("fallback_events_total", reason="drafter_unavailable")
            new[e.drafting].append(e)
        for spec, entries in new.items():
            if not entries:
                continue
            try:
                _prefill(self.target, [e.live for e in entries], self.drafter if spec else None)
            except Exception as exc:
                self._fail(entries, f"prefill failed: {exc}")
                continue
            lost = [e for e in entries if spec and e.live.rid in self.drafter.lost]
            if lost:
                self._fall_back(lost, f"drafter failed: {self.drafter.lost[lost[0].live.rid]}")

    def _deliver(self) -> None:
        keep = []
        for e in self.active:
            s = e.live
            if len(s.out) > e.sent:
                self.metrics.inc("generated_tokens_total", len(s.out) - e.sent)
                e.sink.tokens(s.out[e.sent :])
                e.sent = len(s.out)
            if s.finish is not None:
                self._release(e)
                self.metrics.inc("requests_total", outcome="finished")
                seconds = time.perf_counter() - e.t_submit
                e.sink.done(Result(s.out, s.finish, s.stats, seconds, s.trace, e.fallback))
            else:
                keep.append(e)
        self.active = keep

    def _release(self, e: _Entry) -> None:
        if e.live.slot >= 0:
            try:
                _release(self.target, self.drafter if e.drafting else None, e.live)
            except Exception as exc:  # noqa: BLE001
                log.warning("releasing request %d failed: %s", e.live.rid, exc)
                e.live.slot = -1
            e.drafting = False

    def _fail(self, entries: list[_Entry], message: str) -> None:
        for e in entries:
            self._release(e)
            if e in self.active:
                self.active.remove(e)
            e.live.finish = "error"
            self.metrics.inc("requests_total", outcome="error")
            e.sink.error(message)

    def _drop_cancelled(self) -> None:
        for e in [e for e in self.queue if e.cancelled]:
            self.queue.remove(e)
            self.metrics.inc("requests_total", outcome="cancelled")
            e.sink.error("cancelled")
        for e in [e for e in self.active if e.cancelled]:
            self._release(e)
            self.active.remove(e)
            self.metrics.inc("requests_total", outcome="cancelled")
            e.sink.error("cancelled")
