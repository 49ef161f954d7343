"""In-flight batching: requests join and leave between rounds; every round batches all of them.

The engine reuses the reference loop's round functions (dspark.reference: prefill, a target-only
round, a speculative round), so the serving path decodes with exactly the oracle's rules; what it
adds is the life cycle of a request in a server:

  submit → queued → admitted (slots allocated, prompt prefilled) → rounds → finished | cancelled |
  failed, and in every end state its target and drafter slots are released.

Each request carries its speculation mode (off, static:k, threshold:x, dspark, dspark-async);
requests of one mode are scheduled together, and a mode-`off` request never runs the drafter.
Because every request draws its random numbers from its own generator in a fixed order, a
request's tokens do not depend on which others share its rounds (for static modes exactly; for
dspark the verification lengths depend on the batch, the output distribution does not).

Sinks receive `tokens(list[int])` as tokens commit, then exactly one of `done(result)` or
`error(message)`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from dspark.calibration import STS
from dspark.drafter import Drafter
from dspark.reference import (
    Request,
    Result,
    Target,
    _Live,
    _prefill,
    _release,
    _speculative_round,
    _target_round,
)
from dspark.sampling import make_generator
from dspark.scheduler import SPSTable, parse_policy


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


class Engine:
    """Continuous batching of decoding requests over one target and (optionally) one drafter."""

    def __init__(
        self,
        target: Target,
        drafter: Drafter | None = None,
        sps: SPSTable | None = None,
        calibration: STS | None = None,
        max_active: int = 16,
    ) -> None:
        self.target = target
        self.drafter = drafter
        self.sps = sps
        self.calibration = calibration
        self.max_active = max_active
        self.queue: deque[_Entry] = deque()
        self.active: list[_Entry] = []
        self._policies: dict[str, object] = {}
        self._next = 0

    # -- requests -----------------------------------------------------------------------------

    def policy(self, mode: str):
        """The policy object of a mode spec (raises ValueError naming the valid forms)."""
        if mode not in self._policies:
            if mode != "off" and self.drafter is None:
                raise ValueError(f"mode {mode!r} needs a drafter and none is loaded: use mode 'off'")
            self._policies[mode] = parse_policy(mode, self.sps)
        return self._policies[mode]

    def submit(self, req: Request, mode: str, sink: Sink) -> int:
        self.policy(mode)  # validate before queueing
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
        self._drop_cancelled()
        self._admit()
        groups: dict[str, list[_Entry]] = {}
        for e in self.active:
            if e.live.finish is None:
                groups.setdefault(e.mode, []).append(e)
        for mode, entries in groups.items():
            lives = [e.live for e in entries]
            try:
                if mode == "off":
                    _target_round(self.target, lives)
                else:
                    _speculative_round(self.target, self.drafter, self.policy(mode), self.calibration, lives)
            except Exception as exc:  # a failed round fails its requests, not the server
                self._fail(entries, f"decoding round failed: {exc}")
        self._deliver()

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if self.idle:
                return
            self.step()
        raise RuntimeError(f"engine still busy after {max_steps} steps")

    def _free(self) -> int:
        n = getattr(self.target, "free_slots", self.max_active)
        if self.drafter is not None and hasattr(self.drafter, "free_slots"):
            n = min(n, self.drafter.free_slots)
        return min(n, self.max_active - len(self.active))

    def _admit(self) -> None:
        new: dict[bool, list[_Entry]] = {True: [], False: []}
        while self.queue and self._free() > 0:
            e = self.queue.popleft()
            try:
                e.live.slot = self.target.allocate()
            except Exception as exc:
                self.queue.appendleft(e)  # no slot after all: retry next round
                if not self.active:
                    self._fail([e], f"cannot allocate a target slot: {exc}")
                break
            self.active.append(e)
            new[e.mode != "off"].append(e)
        for spec, entries in new.items():
            if not entries:
                continue
            try:
                _prefill(self.target, [e.live for e in entries], self.drafter if spec else None)
            except Exception as exc:
                self._fail(entries, f"prefill failed: {exc}")

    def _deliver(self) -> None:
        keep = []
        for e in self.active:
            s = e.live
            if len(s.out) > e.sent:
                e.sink.tokens(s.out[e.sent :])
                e.sent = len(s.out)
            if s.finish is not None:
                self._release(e)
                e.sink.done(Result(s.out, s.finish, s.stats, time.perf_counter() - e.t_submit, s.trace))
            else:
                keep.append(e)
        self.active = keep

    def _release(self, e: _Entry) -> None:
        if e.live.slot >= 0:
            spec = e.mode != "off" and self.drafter is not None
            try:
                _release(self.target, self.drafter if spec else None, e.live)
            except Exception:
                e.live.slot = -1

    def _fail(self, entries: list[_Entry], message: str) -> None:
        for e in entries:
            self._release(e)
            if e in self.active:
                self.active.remove(e)
            e.live.finish = "error"
            e.sink.error(message)

    def _drop_cancelled(self) -> None:
        for e in [e for e in self.queue if e.cancelled]:
            self.queue.remove(e)
            e.sink.error("cancelled")
        for e in [e for e in self.active if e.cancelled]:
            self._release(e)
            self.active.remove(e)
            e.sink.error("cancelled")
