"""In-flight batching: requests join and leave between rounds; every round batches all of them.

The batcher runs the round API of dspark.core.rounds (prefill, target-only round, speculative
round), so the serving path decodes with exactly the reference loop's rules; what it adds is the
life cycle of a request in a server:

  submit → queued → admitted (slots allocated, prompt prefilled) → rounds → finished | cancelled |
  failed, and in every end state its target and drafter slots are released.

Three collaborators, one responsibility each:
  Admission      the queue, the "busy" limit, and the prefill budget per round
  DrafterGuard   (guard.py) drafter failures → lossless target-only fallback
  Delivery       committed tokens to each request's sink, cancellation, release

Each request carries its mode (off, static:k, threshold:x, dspark, dspark-async, dspark-skip);
requests of one mode are scheduled together, and a mode-`off` request never runs the drafter.
Because every request draws its random numbers from its own generator in a fixed order, a
request's tokens do not depend on which others share its rounds (for static modes exactly; for
dspark the verification lengths depend on the batch, the output distribution does not).

Sinks receive `tokens(list[int])` as tokens commit, then exactly one of `done(result)` (a
ServedResult) or `error(message)`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from dspark.core import rounds
from dspark.core.calibration import STS, clipped_survival, sigmoid
from dspark.core.costs import DraftCost, LiveSteps
from dspark.core.interfaces import Drafter, Request, Result, Target
from dspark.core.rounds import SequenceState
from dspark.core.sampling import make_generator
from dspark.core.scheduler import DSparkSkip, Policy, SkipPlanner, policy_for
from dspark.core.sps import SPSTable
from dspark.orchestrator.guard import DrafterFailure, DrafterGuard
from dspark.orchestrator.metrics import ServingMetrics

log = logging.getLogger("dspark.orchestrator")


class Busy(RuntimeError):
    """The queue is full: the client should retry later."""


@dataclass
class ServedResult(Result):
    fallback: str | None = None  # why a speculative request continued target-only


class Sink(Protocol):
    def tokens(self, tokens: list[int]) -> None: ...
    def done(self, result: ServedResult) -> None: ...
    def error(self, message: str) -> None: ...


@dataclass
class Entry:
    """A request in the batcher: its decoding state, mode, sink and serving status."""

    seq: SequenceState
    mode: str
    sink: Sink
    sent: int = 0  # tokens already delivered
    t_submit: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    drafting: bool = False  # holds drafter state and runs speculative rounds
    fallback: str | None = None  # why a speculative request continues target-only
    traced: int = 0  # rounds of seq.trace already reported to the metrics


class Admission:
    """The queue in front of the slots. `submit` refuses with Busy past `max_queue` waiting
    requests; `admit` takes what fits this round, at most `prefill_budget` prompt tokens (at
    least one request): 32 prompts arriving together would otherwise be one ~10k-token target
    call that every active stream waits behind."""

    def __init__(self, max_queue: int, prefill_budget: int) -> None:
        self.max_queue = max_queue
        self.prefill_budget = prefill_budget
        self.queue: deque[Entry] = deque()

    def check_room(self, active: int, free: int) -> None:
        if len(self.queue) >= self.max_queue + max(free, 0):  # free slots admit at the next round
            raise Busy(
                f"server busy: {active} sequences decoding and {len(self.queue)} queued "
                f"(max_queue {self.max_queue}); retry later"
            )

    def take(self, free: int) -> list[Entry]:
        """The entries to admit now (popped from the queue), within `free` slots and the budget."""
        out: list[Entry] = []
        tokens = 0
        while self.queue and len(out) < free:
            n = len(self.queue[0].seq.req.prompt_ids)
            if self.prefill_budget and tokens and tokens + n > self.prefill_budget:
                break  # the rest waits for the next round's budget
            tokens += n
            out.append(self.queue.popleft())
        return out


class Delivery:
    """Committed tokens to sinks; the end of every request (finished, failed, cancelled) with
    its slots released."""

    def __init__(self, target: Target, guard: DrafterGuard | None, metrics: ServingMetrics) -> None:
        self.target = target
        self.guard = guard
        self.metrics = metrics

    def release(self, e: Entry) -> None:
        if e.seq.slot >= 0:
            try:
                rounds.release(self.target, self.guard if e.drafting else None, e.seq)
            except Exception as exc:  # noqa: BLE001
                log.warning("releasing request %d failed: %s", e.seq.rid, exc)
                e.seq.slot = -1
            e.drafting = False

    def deliver(self, e: Entry) -> bool:
        """Send e's new tokens; on finish, release and send the result. True when it finished."""
        s = e.seq
        if len(s.out) > e.sent:
            self.metrics.inc("generated_tokens_total", len(s.out) - e.sent)
            e.sink.tokens(s.out[e.sent :])
            e.sent = len(s.out)
        if s.finish is None:
            return False
        self.release(e)
        self.metrics.inc("requests_total", outcome="finished")
        seconds = time.perf_counter() - e.t_submit
        e.sink.done(ServedResult(s.out, s.finish, s.stats, seconds, s.trace, e.fallback))
        return True

    def fail(self, e: Entry, message: str) -> None:
        self.release(e)
        e.seq.finish = "error"
        self.metrics.inc("requests_total", outcome="error")
        e.sink.error(message)

    def cancel(self, e: Entry) -> None:
        self.release(e)
        self.metrics.inc("requests_total", outcome="cancelled")
        e.sink.error("cancelled")


class _TimedTarget:
    """The target, with each decode / verify step's seconds and batch tokens reported to the
    batcher's `LiveSteps` (prefill steps, `last_only`, are not SPS steps and are not reported);
    `seconds` counts the time of every step (prefill included)."""

    def __init__(self, inner: Target, batcher: Batcher) -> None:
        self.inner = inner
        self.batcher = batcher
        self.seconds = 0.0

    def step(self, slots, tokens, last_only: bool = False):
        t0 = time.perf_counter()
        out = self.inner.step(slots, tokens, last_only=last_only)
        dt = time.perf_counter() - t0
        self.seconds += dt
        live = self.batcher.live
        if not last_only and live is not None:
            live.observe(sum(len(t) for t in tokens), dt)
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


class Batcher:
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
        self.metrics = metrics or ServingMetrics(drafter.block_size if drafter is not None else 7)
        self.drafter = DrafterGuard(drafter, self.metrics, drafter_retry_s) if drafter is not None else None
        self.sps = sps
        self.live = LiveSteps(sps) if sps is not None else None  # t(B) at today's level
        self.target = _TimedTarget(target, self)
        # dspark-skip's prices, measured in this process (issue 18): what a round that drafts
        # for n requests costs beyond the target step and the catch-up (draft model calls, their
        # transport and the speculative bookkeeping), and, to subtract from it, the non-model
        # seconds of a target-only round of R requests
        self.draft_cost = DraftCost()
        self.plain_overhead = DraftCost()
        self.calibration = calibration
        self.max_active = max_active
        self.admission = Admission(max_queue, prefill_budget)
        self.delivery = Delivery(target, self.drafter, self.metrics)
        self.active: list[Entry] = []
        self._policies: dict[str, Policy] = {}
        self._planners: dict[str, SkipPlanner] = {}
        self._next = 0
        self.rounds = 0  # rounds run (one per `step`)
        self._drafted = 0  # requests that drafted in the last `_speculative` of dspark-skip

    @property
    def queue(self) -> deque[Entry]:
        return self.admission.queue

    # -- requests -----------------------------------------------------------------------------

    def set_sps(self, sps: SPSTable) -> None:
        """Use a (newly measured) SPS table from now on; policies are rebuilt on next use."""
        self.sps = sps
        self.live = LiveSteps(sps)
        self._policies.clear()
        self._planners.clear()

    def policy(self, mode: str) -> Policy:
        """The policy of a mode (raises ValueError naming the valid forms, or saying that the
        mode needs a drafter this server does not have): the one place a mode is validated."""
        if mode not in self._policies:
            if mode != "off" and self.drafter is None:
                raise ValueError(f"mode {mode!r} needs a drafter and this server has none: use mode 'off'")
            self._policies[mode] = policy_for(mode, self.sps)
        return self._policies[mode]

    def submit(self, req: Request, mode: str, sink: Sink) -> int:
        self.policy(mode)  # validate before queueing
        try:
            self.admission.check_room(len(self.active), self._free())
        except Busy:
            self.metrics.inc("requests_total", outcome="busy")
            raise
        rid = self._next
        self._next += 1
        seq = SequenceState(rid, req, -1, make_generator(req.params.seed))
        self.admission.queue.append(Entry(seq, mode, sink))
        return rid

    def cancel(self, rid: int) -> bool:
        """Stop a request (client gone); its slots are released at the next round boundary."""
        for e in list(self.queue) + self.active:
            if e.seq.rid == rid:
                e.cancelled = True
                return True
        return False

    @property
    def idle(self) -> bool:
        return not self.queue and not self.active

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if self.idle:
                return
            self.step()
        raise RuntimeError(f"batcher still busy after {max_steps} steps")

    # -- one round ----------------------------------------------------------------------------

    def step(self) -> None:
        """Admit what fits, run one round for every active request, deliver, release."""
        self.rounds += 1
        self._drop_cancelled()
        self._admit()
        groups: dict[str, list[Entry]] = {}
        for e in self.active:
            if e.seq.finish is None:
                groups.setdefault(e.mode if e.drafting else "off", []).append(e)
        plain = groups.pop("off", [])
        feeding: list[Entry] = []  # speculative requests that draft nobody this round
        verified = 0
        for mode, entries in groups.items():
            t0, model0 = time.perf_counter(), self.target.seconds
            try:
                fallen, idle = self._speculative(mode, entries)
            except Exception as exc:  # a failed round fails its requests, not the server
                self._fail(entries, f"decoding round failed: {exc}")
                continue
            plain += fallen
            feeding += idle
            accepted = sum(t.accepted for e in entries for t in e.seq.trace[e.traced :])
            verified += self._report_rounds(entries)
            if self._drafted:  # dspark-skip drafted: measure what that cost beyond a plain round
                wall = time.perf_counter() - t0
                extra = wall - (self.target.seconds - model0) - self.drafter.last_catchup_s
                overhead = 0.0
                if self.plain_overhead.seen:
                    overhead = float(self.plain_overhead(np.array([len(entries)]))[0])
                self.draft_cost.observe(self._drafted, max(extra - overhead, 0.0))
                self._returned(mode, len(entries), accepted, wall, overhead)
        if plain or feeding:
            # one target call for everything that does not draft this round; the drafter gets
            # the features of its requests' tokens, lazily (no drafter call)
            seqs = [e.seq for e in plain + feeding]
            feeds = [False] * len(plain) + [True] * len(feeding)
            t0, model0 = time.perf_counter(), self.target.seconds
            try:
                rounds.target_round(self.target, seqs, self.drafter if feeding else None, feeds)
                self.metrics.target_rounds(len(seqs))
            except Exception as exc:
                self._fail(plain + feeding, f"decoding round failed: {exc}")
            else:
                if feeding:
                    self._check_lost(feeding)
                    wall = time.perf_counter() - t0
                    self.plain_overhead.observe(len(seqs), wall - (self.target.seconds - model0))
        if groups:
            self.metrics.round_verified(verified)
        keep = []
        for e in self.active:
            if self.delivery.deliver(e):
                self._forget(e)
            else:
                keep.append(e)
        self.active = keep
        self.metrics.occupancy(len(self.active), len(self.queue), self._free_slots())

    def _speculative(self, mode: str, entries: list[Entry]) -> tuple[list[Entry], list[Entry]]:
        """One speculative round for the requests of one mode. Returns (requests that fell back
        to target-only because the drafter failed before anything changed, requests that draft
        nobody this round): both join this round's target-only call, the second feeding the
        drafter their features lazily."""
        assert self.drafter is not None
        policy = self.policy(mode)
        seqs = [e.seq for e in entries]
        self._drafted = 0
        drafting = self._plan(mode, policy, seqs) if isinstance(policy, DSparkSkip) else None
        if drafting is not None and not drafting.any():
            return [], entries  # a round that drafts for nobody costs what off costs
        try:
            rounds.speculative_round(self.target, self.drafter, policy, self.calibration, seqs, drafting)
        except DrafterFailure as exc:  # nothing changed yet: these requests go on target-only
            self._fall_back(entries, f"drafter failed: {exc}")
            return entries, []
        self._check_lost(entries)
        self._drafted = int(drafting.sum()) if drafting is not None else 0
        return [], []

    def _returned(self, mode: str, R: int, accepted: int, wall: float, overhead: float) -> None:
        """dspark-skip: what a drafting round of R requests returned (accepted draft tokens)
        against what it cost beyond a plain round of R (the live target step plus the measured
        non-model seconds of one), for the planner's measured return on drafting."""
        if self.live is None or not self.live.observed:
            return
        plain = float(self.live.step_times(np.array([R]))[0]) + overhead
        self.planner(mode).observe(accepted, R, wall - plain, plain)

    def _check_lost(self, entries: list[Entry]) -> None:
        """Requests whose drafter state failed this round continue target-only."""
        assert self.drafter is not None
        lost = [e for e in entries if e.seq.rid in self.drafter.lost and e.seq.finish is None]
        if lost:
            self._fall_back(lost, f"drafter failed: {self.drafter.lost[lost[0].seq.rid]}")

    def planner(self, mode: str) -> SkipPlanner:
        """The dspark-skip planner of a mode (who drafts; refresh intervals per request)."""
        policy = self.policy(mode)
        if not isinstance(policy, DSparkSkip):
            raise ValueError(f"mode {mode!r} does not plan who drafts (only dspark-skip does)")
        return self._planners.setdefault(mode, SkipPlanner(policy))

    def _plan(self, mode: str, policy: DSparkSkip, seqs: list[SequenceState]) -> np.ndarray:
        """dspark-skip: which requests draft this round, from their last drafted round only."""
        assert self.drafter is not None
        planner = self.planner(mode)
        gamma = self.drafter.block_size
        last = np.full((len(seqs), gamma), np.nan)
        for r, s in enumerate(seqs):
            if s.conf_history:
                last[r] = s.conf_history[-1]
        available = np.maximum([min(gamma, s.remaining - 1) for s in seqs], 0)
        per = self.drafter.catchup_seconds or 0.0
        catchup = np.array([per * self.drafter.catchup_positions(s.rid) for s in seqs])
        cost = self.draft_cost if self.draft_cost.seen else None
        live = self.live.step_times if self.live is not None and self.live.observed else None
        mask = planner.choose(self.rounds, [s.rid for s in seqs], last, available, cost, catchup, live)
        if (~mask).any():
            self.metrics.inc("skipped_drafts_total", float((~mask).sum()))
        if planner.reason is not None:
            self.metrics.inc("draft_rounds_total", reason=planner.reason)
        self._report_prices(len(seqs), cost, live or policy.sps.step_times, per)
        return mask

    def _report_prices(self, R: int, cost, step_times, catchup_position: float) -> None:
        """The prices dspark-skip just planned with, as gauges (an operator's "why does it not
        draft?"): a drafting round for 1 and for all R requests, a target step of 1 and R."""
        if cost is not None:
            d = cost(np.array([1, max(R, 1)]))
            self.metrics.set_gauge("skip_price_seconds", float(d[0]), what="draft_1")
            self.metrics.set_gauge("skip_price_seconds", float(d[1]), what="draft_R")
        t = step_times(np.array([1, max(R, 1)]))
        self.metrics.set_gauge("skip_price_seconds", float(t[0]), what="step_1")
        self.metrics.set_gauge("skip_price_seconds", float(t[1]), what="step_R")
        self.metrics.set_gauge("skip_price_seconds", catchup_position, what="catchup_position")

    def _report_rounds(self, entries: list[Entry]) -> int:
        """Per-round acceptance and calibration metrics; returns the round's Σℓ."""
        assert self.drafter is not None
        verified = 0
        for e in entries:
            for t in e.seq.trace[e.traced :]:
                surv = None
                if self.drafter.has_head:
                    c = self.calibration.apply(t.conf_logits) if self.calibration else sigmoid(t.conf_logits)
                    surv = clipped_survival(c)
                self.metrics.speculative_round(t.verified, t.accepted, surv)
                verified += t.verified
            e.traced = len(e.seq.trace)
        return verified

    def _fall_back(self, entries: list[Entry], reason: str) -> None:
        """Drop these requests' drafter state; they continue with target-only rounds."""
        assert self.drafter is not None
        self.drafter.failed(reason, len(entries))
        for e in entries:
            e.drafting = False
            e.fallback = reason
            self.drafter.end(e.seq.rid)

    # -- admission, failure, cancellation -----------------------------------------------------

    def _free_slots(self) -> int:
        return getattr(self.target, "free_slots", self.max_active - len(self.active))

    def _free(self) -> int:
        n = getattr(self.target, "free_slots", self.max_active)
        if self.drafter is not None:
            n = min(n, self.drafter.free_slots)
        return min(n, self.max_active - len(self.active))

    def _admit(self) -> None:
        new: dict[bool, list[Entry]] = {True: [], False: []}
        for i, e in enumerate(taken := self.admission.take(max(self._free(), 0))):
            try:
                e.seq.slot = self.target.allocate()
            except Exception as exc:
                self.queue.extendleft(reversed(taken[i:]))  # no slot after all: retry next round
                if not self.active:
                    self._fail([e], f"cannot allocate a target slot: {exc}")
                break
            self.active.append(e)
            e.drafting = e.mode != "off" and self.drafter is not None and self.drafter.up()
            if e.mode != "off" and not e.drafting:
                e.fallback = "drafter unavailable at admission"
                self.metrics.inc("fallback_events_total", reason="drafter_unavailable")
            new[e.drafting].append(e)
        for spec, entries in new.items():
            if not entries:
                continue
            try:
                rounds.prefill(self.target, [e.seq for e in entries], self.drafter if spec else None)
            except Exception as exc:
                self._fail(entries, f"prefill failed: {exc}")
                continue
            if spec and self.drafter is not None:
                lost = [e for e in entries if e.seq.rid in self.drafter.lost]
                if lost:
                    self._fall_back(lost, f"drafter failed: {self.drafter.lost[lost[0].seq.rid]}")

    def _fail(self, entries: list[Entry], message: str) -> None:
        for e in entries:
            if e in self.queue:
                self.queue.remove(e)
            if e in self.active:
                self.active.remove(e)
            self._forget(e)
            self.delivery.fail(e, message)

    def _forget(self, e: Entry) -> None:
        for planner in self._planners.values():
            planner.forget(e.seq.rid)

    def _drop_cancelled(self) -> None:
        for e in [e for e in self.queue if e.cancelled]:
            self.queue.remove(e)
            self.delivery.cancel(e)
        for e in [e for e in self.active if e.cancelled]:
            self.active.remove(e)
            self._forget(e)
            self.delivery.cancel(e)
