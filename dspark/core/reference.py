"""The reference draft → verify loop: the oracle every faster path is compared with.

One call decodes a batch of requests to completion, one round at a time
(ARCHITECTURE.md, "One decoding round"):

1. draft:    the drafter proposes γ tokens per active request, with q_k and confidence logits;
2. schedule: calibrated confidences → verification lengths ℓ_r (scheduler policy);
3. verify:   one target step over [x_0, x_1..x_ℓ] per request, all requests in one batch;
4. accept:   chain rejection sampling (dspark.core.verify);
5. commit:   emit tokens, roll the target's KV back past the accepted prefix, give the
             drafter the committed tokens and their target features.

Each request owns a random generator; per round it draws, in this order, γ uniforms for
drafting (inside the drafter) and γ+1 for verification. With the mode `off` the drafter is
never called and each round is a plain target step (the target-only baseline).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from dspark.core.calibration import STS
from dspark.core.interfaces import Drafter, Request, Result, RoundTrace, Target
from dspark.core.metrics import AcceptanceStats, RoundRecord
from dspark.core.sampling import make_generator, sample, uniforms, warp, warp_rows
from dspark.core.scheduler import Off, Policy
from dspark.core.verify import chain_verify, commit_tokens


@dataclass
class _Live:
    rid: int
    req: Request
    slot: int
    gen: torch.Generator
    out: list[int] = field(default_factory=list)
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    conf_history: list[np.ndarray] = field(default_factory=list)  # last two rounds, oldest first
    trace: list[RoundTrace] = field(default_factory=list)
    finish: str | None = None

    @property
    def anchor(self) -> int:
        return self.out[-1]

    def emit(self, tokens: list[int], finished: bool) -> None:
        self.out.extend(tokens)
        if finished:
            self.finish = "stop" if self.out and self.out[-1] in self.req.stop_ids else "length"


def generate(
    target: Target,
    requests: Sequence[Request],
    drafter: Drafter | None = None,
    policy: Policy | None = None,
    calibration: STS | None = None,
) -> list[Result]:
    """Decode every request to completion; returns one Result per request, in order."""
    policy = policy or Off()
    speculate = drafter is not None and not isinstance(policy, Off)
    t0 = time.perf_counter()
    live: list[_Live] = []
    try:
        for rid, req in enumerate(requests):
            live.append(_Live(rid, req, target.allocate(), make_generator(req.params.seed)))
        _prefill(target, live, drafter if speculate else None)
        active = [s for s in live if s.finish is None]
        while active:
            if speculate:
                _speculative_round(target, drafter, policy, calibration, active)
            else:
                _target_round(target, active)
            for s in active:
                if s.finish is not None:
                    _release(target, drafter if speculate else None, s)
            active = [s for s in active if s.finish is None]
    finally:
        for s in live:
            if s.slot >= 0:
                _release(target, drafter if speculate else None, s)
    seconds = time.perf_counter() - t0
    return [Result(s.out, s.finish or "length", s.stats, seconds, s.trace) for s in live]


def _release(target: Target, drafter: Drafter | None, s: _Live) -> None:
    target.release(s.slot)
    if drafter is not None:
        drafter.end(s.rid)
    s.slot = -1


def _prefill(target: Target, live: list[_Live], drafter: Drafter | None) -> None:
    """Prompt forward for every request; the first token is sampled from the target."""
    step = target.step([s.slot for s in live], [list(s.req.prompt_ids) for s in live], last_only=True)
    for r, s in enumerate(live):
        n = len(s.req.prompt_ids)
        p = warp(step.logits[r, 0], s.req.params)
        tok = int(sample(p, uniforms(s.gen, 1)[0]))
        s.emit([tok], tok in s.req.stop_ids or s.req.max_tokens <= 1)
        if drafter is not None:
            drafter.begin(s.rid, list(s.req.prompt_ids), step.features[r, :n])


def _target_round(target: Target, active: list[_Live]) -> None:
    """Target-only decoding: one token per request per round (the `off` baseline)."""
    step = target.step([s.slot for s in active], [[s.anchor] for s in active])
    for r, s in enumerate(active):
        p = warp(step.logits[r, 0], s.req.params)
        tok = int(sample(p, uniforms(s.gen, 1)[0]))
        remaining = s.req.max_tokens - len(s.out)
        s.emit([tok], tok in s.req.stop_ids or remaining <= 1)
        s.stats.add(RoundRecord(proposed=0, accepted=0, stopped=False))


def _speculative_round(
    target: Target,
    drafter: Drafter,
    policy: Policy,
    calibration: STS | None,
    active: list[_Live],
    draft_mask: np.ndarray | None = None,
) -> None:
    """One draft → schedule → verify round. Rows with draft_mask False do not draft this round
    (a `dspark-skip` decision made from stale confidences): they verify ℓ = 0, i.e. decode one
    target token, and still hand its features to the drafter."""
    gamma = drafter.block_size
    R = len(active)
    mask = np.ones(R, bool) if draft_mask is None else np.asarray(draft_mask, bool)
    rows = np.flatnonzero(mask)
    raw = np.zeros((R, gamma))
    drafts = torch.zeros(R, gamma, dtype=torch.long)
    probs = torch.zeros(R, gamma, 1)
    vocab, index = None, None
    if len(rows):
        sub = [active[r] for r in rows]
        prop = drafter.propose(
            [s.rid for s in sub], [s.anchor for s in sub], [s.req.params for s in sub], [s.gen for s in sub]
        )
        vocab = prop.vocab
        if len(rows) == R:
            drafts, probs, index = prop.tokens, prop.probs, prop.index
        else:  # rows that do not draft verify nothing: their q is never read
            drafts[rows] = prop.tokens
            probs = prop.probs.new_zeros(R, gamma, prop.probs.shape[-1])
            probs[rows] = prop.probs
            if vocab is not None:
                index = torch.zeros(R, gamma, dtype=torch.long)
                index[rows] = prop.index
        raw[rows] = prop.conf_logits.double().numpy()
    conf = calibration.apply(raw) if calibration is not None else 1.0 / (1.0 + np.exp(-raw))
    conf[~mask] = 0.0
    max_len = np.array(
        [min(gamma, s.req.max_tokens - len(s.out) - 1) if m else 0 for s, m in zip(active, mask)],
        dtype=np.int64,
    )
    stale = np.full((R, gamma), np.nan)
    for r, s in enumerate(active):
        if len(s.conf_history) == 2:
            stale[r] = s.conf_history[0]
    lengths = np.asarray(policy.schedule(conf, max_len, stale), dtype=np.int64)
    for r in rows:
        active[r].conf_history = (active[r].conf_history + [conf[r]])[-2:]

    start = [target.length(s.slot) for s in active]
    step = target.step(
        [s.slot for s in active],
        [[s.anchor] + drafts[r, : lengths[r]].tolist() for r, s in enumerate(active)],
    )
    # p over the max ℓ + 1 positions this step verified (no padding to γ + 1: at high load most
    # rows verify ℓ = 0 and [R, γ+1, V] would be mostly copies)
    p = warp_rows(step.logits[:, : gamma + 1], [s.req.params for s in active])
    u = torch.stack([uniforms(s.gen, gamma + 1) for s in active])
    verdict = chain_verify(drafts, probs, p, torch.from_numpy(lengths), u, vocab, index)

    for r, s in enumerate(active):
        n = int(verdict.accepted[r])
        c = commit_tokens(
            drafts[r, :n].tolist(),
            n,
            int(verdict.next_token[r]),
            s.req.stop_ids,
            s.req.max_tokens - len(s.out),
        )
        committed_inputs = [s.anchor] + drafts[r, :n].tolist()
        # a round that ends on an accepted stop token counts the drafts up to it, no bonus (§6.2)
        record = RoundRecord(int(lengths[r]), len(c.tokens) if c.stopped else n, c.stopped)
        s.stats.add(record)
        if mask[r]:
            s.trace.append(RoundTrace(record.proposed, record.accepted, record.stopped, raw[r].copy()))
        s.emit(c.tokens, c.finished)
        target.rollback(s.slot, start[r] + n + 1)
        if not c.finished:
            drafter.advance(s.rid, committed_inputs, step.features[r, : n + 1])
