"""The reference draft → verify loop: the oracle every faster path is compared with.

`generate` decodes a batch of requests to completion, one round at a time, with the round API
of dspark.core.rounds (draft → schedule → verify → commit); the serving batcher runs the same
functions. With the policy `off` the drafter is never called and each round is a plain target
step (the target-only baseline).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from dspark.core import rounds
from dspark.core.calibration import STS
from dspark.core.interfaces import Drafter, Request, Result, Target
from dspark.core.rounds import SequenceState
from dspark.core.sampling import make_generator
from dspark.core.scheduler import Off, Policy


def generate(
    target: Target,
    requests: Sequence[Request],
    drafter: Drafter | None = None,
    policy: Policy | None = None,
    calibration: STS | None = None,
) -> list[Result]:
    """Decode every request to completion; returns one Result per request, in order."""
    spec_drafter = drafter if drafter is not None and not isinstance(policy or Off(), Off) else None
    t0 = time.perf_counter()
    seqs: list[SequenceState] = []
    try:
        for rid, req in enumerate(requests):
            seqs.append(SequenceState(rid, req, target.allocate(), make_generator(req.params.seed)))
        rounds.prefill(target, seqs, spec_drafter)
        active = [s for s in seqs if s.finish is None]
        while active:
            if spec_drafter is not None:
                rounds.speculative_round(target, spec_drafter, policy or Off(), calibration, active)
            else:
                rounds.target_round(target, active)
            for s in active:
                if s.finish is not None:
                    rounds.release(target, spec_drafter, s)
            active = [s for s in active if s.finish is None]
    finally:
        for s in seqs:
            if s.slot >= 0:
                rounds.release(target, spec_drafter, s)
    seconds = time.perf_counter() - t0
    return [Result(s.out, s.finish or "length", s.stats, seconds, s.trace) for s in seqs]
