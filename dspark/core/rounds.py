"""The decoding round, step by step: the one public API that the reference loop and the serving
batcher both run (ARCHITECTURE.md, "One decoding round").

A speculative round over the active sequences is four steps, each a function here:

1. `draft`:    the drafter proposes γ tokens per drafting sequence, with q_k and confidence logits;
2. `schedule`: calibrated confidences → verification lengths ℓ_r (the mode's policy);
3. `verify`:   one target step over [x_0, x_1..x_ℓ] per sequence, all in one batch, then chain
               rejection sampling (dspark.core.verify);
4. `commit`:   emit tokens, roll the target's KV back past the accepted prefix, give the drafter
               the committed tokens and their target features.

`speculative_round` runs the four; `target_round` is the target-only round (mode `off`);
`prefill` starts sequences and `release` ends them.

Randomness: each sequence owns a generator; per speculative round it draws, in this order, γ
uniforms for drafting (inside the drafter) and γ+1 for verification; per target-only round one.
So a sequence's tokens never depend on which others share its rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dspark.core.calibration import STS
from dspark.core.interfaces import Drafter, Request, RoundTrace, Target, TargetStep
from dspark.core.metrics import AcceptanceStats, RoundRecord
from dspark.core.sampling import sample, uniforms, warp, warp_rows
from dspark.core.scheduler import Policy
from dspark.core.verify import Verdict, chain_verify, commit_tokens


@dataclass
class SequenceState:
    """One request while it decodes: the small per-sequence state a decoding loop holds (the KV
    cache and drafter context live in the models, in `slot`)."""

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
        """x_0 of the next block: the last committed token."""
        return self.out[-1]

    @property
    def remaining(self) -> int:
        return self.req.max_tokens - len(self.out)

    def emit(self, tokens: list[int], finished: bool) -> None:
        self.out.extend(tokens)
        if finished:
            self.finish = "stop" if self.out and self.out[-1] in self.req.stop_ids else "length"


# -- start and end ----------------------------------------------------------------------------


def prefill(target: Target, seqs: list[SequenceState], drafter: Drafter | None = None) -> None:
    """Prompt forward for every sequence; the first token is sampled from the target; the
    drafter (if any) starts each sequence's context with the prompt's features."""
    step = target.step([s.slot for s in seqs], [list(s.req.prompt_ids) for s in seqs], last_only=True)
    for r, s in enumerate(seqs):
        n = len(s.req.prompt_ids)
        tok = int(sample(warp(step.logits[r, 0], s.req.params), uniforms(s.gen, 1)[0]))
        s.emit([tok], tok in s.req.stop_ids or s.req.max_tokens <= 1)
        if drafter is not None:
            drafter.begin(s.rid, list(s.req.prompt_ids), step.features[r, :n])


def release(target: Target, drafter: Drafter | None, s: SequenceState) -> None:
    """Free the sequence's target slot (and its drafter context, when it drafted)."""
    target.release(s.slot)
    if drafter is not None:
        drafter.end(s.rid)
    s.slot = -1


# -- the target-only round --------------------------------------------------------------------


def target_round(
    target: Target,
    seqs: list[SequenceState],
    drafter: Drafter | None = None,
    feeds: list[bool] | None = None,
) -> None:
    """Target-only decoding: one token per sequence (the `off` baseline, and the round in which
    no speculative sequence drafts). Sequences with feeds[r] hand the anchor's features to the
    drafter (which may keep them until it next drafts for them)."""
    anchors = [s.anchor for s in seqs]
    step = target.step([s.slot for s in seqs], [[a] for a in anchors])
    for r, s in enumerate(seqs):
        tok = int(sample(warp(step.logits[r, 0], s.req.params), uniforms(s.gen, 1)[0]))
        s.emit([tok], tok in s.req.stop_ids or s.remaining <= 1)
        s.stats.add(RoundRecord(verified=0, accepted=0, stopped=False))
        if drafter is not None and feeds is not None and feeds[r] and s.finish is None:
            drafter.advance(s.rid, [anchors[r]], step.features[r, :1])


# -- the speculative round ---------------------------------------------------------------------


@dataclass
class Draft:
    """What the drafting step produced for a round, one row per sequence. Rows with
    `drafting` False did not draft: they verify nothing and their q is never read."""

    tokens: torch.Tensor  # [R, γ] x_1..x_γ
    probs: torch.Tensor  # [R, γ, V] q_k (or [R, γ, Vd] over `vocab`)
    conf_logits: np.ndarray  # [R, γ] raw confidence logits (0 where not drafting)
    drafting: np.ndarray  # [R] bool
    vocab: torch.Tensor | None = None  # compact q: the draft vocabulary (Proposal.vocab)
    index: torch.Tensor | None = None  # [R, γ] position of x_k in `vocab`


@dataclass
class Verification:
    """The target step of a round and its verdict."""

    step: TargetStep
    verdict: Verdict
    start: list[int]  # each sequence's cached length before the step


def draft(drafter: Drafter, seqs: list[SequenceState], drafting: np.ndarray | None = None) -> Draft:
    """Step 1: one `propose` call for the sequences that draft this round (all by default)."""
    gamma, R = drafter.block_size, len(seqs)
    drafting = np.ones(R, bool) if drafting is None else np.asarray(drafting, bool)
    rows = np.flatnonzero(drafting)
    out = Draft(
        torch.zeros(R, gamma, dtype=torch.long), torch.zeros(R, gamma, 1), np.zeros((R, gamma)), drafting
    )
    if not len(rows):
        return out
    sub = [seqs[r] for r in rows]
    prop = drafter.propose(
        [s.rid for s in sub], [s.anchor for s in sub], [s.req.params for s in sub], [s.gen for s in sub]
    )
    out.vocab = prop.vocab
    if len(rows) == R:
        out.tokens, out.probs, out.index = prop.tokens, prop.probs, prop.index
    else:
        out.tokens[rows] = prop.tokens
        out.probs = prop.probs.new_zeros(R, gamma, prop.probs.shape[-1])
        out.probs[rows] = prop.probs
        if prop.index is not None:
            out.index = torch.zeros(R, gamma, dtype=torch.long)
            out.index[rows] = prop.index
    out.conf_logits[rows] = prop.conf_logits.double().numpy()
    return out


def schedule(policy: Policy, calibration: STS | None, seqs: list[SequenceState], d: Draft) -> np.ndarray:
    """Step 2: calibrated confidences → verification lengths ℓ_r (int64 [R]). Each drafting
    sequence keeps its last two rounds of confidences (the async policy reads the older)."""
    gamma = d.tokens.shape[1]
    conf = (
        calibration.apply(d.conf_logits) if calibration is not None else 1.0 / (1.0 + np.exp(-d.conf_logits))
    )
    conf[~d.drafting] = 0.0
    available = np.array(
        [min(gamma, s.remaining - 1) if m else 0 for s, m in zip(seqs, d.drafting)], dtype=np.int64
    )
    stale = np.full((len(seqs), gamma), np.nan)
    for r, s in enumerate(seqs):
        if len(s.conf_history) == 2:
            stale[r] = s.conf_history[0]
    lengths = np.asarray(policy.schedule(conf, available, stale), dtype=np.int64)
    for r in np.flatnonzero(d.drafting):
        seqs[r].conf_history = (seqs[r].conf_history + [conf[r]])[-2:]
    return lengths


def verify(target: Target, seqs: list[SequenceState], d: Draft, lengths: np.ndarray) -> Verification:
    """Step 3: one target step over [x_0, x_1..x_ℓ] per sequence, then chain verification."""
    gamma = d.tokens.shape[1]
    start = [target.length(s.slot) for s in seqs]
    step = target.step(
        [s.slot for s in seqs],
        [[s.anchor] + d.tokens[r, : lengths[r]].tolist() for r, s in enumerate(seqs)],
    )
    u = torch.stack([uniforms(s.gen, gamma + 1) for s in seqs])
    params = [s.req.params for s in seqs]
    # p over the ℓ_r + 1 positions each row verified, rows grouped by ℓ: under load most rows
    # verify ℓ = 0 next to a few that verify up to γ, and warping the step's padded [R, max ℓ + 1, V]
    # would cost (max ℓ + 1) × the round's real work (rows are independent: same verdicts)
    accepted = torch.zeros(len(seqs), dtype=torch.long)
    next_token = torch.zeros(len(seqs), dtype=torch.long)
    for ell in np.unique(lengths).tolist():
        rows = np.flatnonzero(lengths == ell)
        r = slice(None) if len(rows) == len(seqs) else torch.from_numpy(rows)  # one ℓ: views, no copies
        p = warp_rows(step.logits[r, : ell + 1], [params[i] for i in rows])
        index = d.index[r] if d.index is not None else None
        part = chain_verify(d.tokens[r], d.probs[r], p, torch.from_numpy(lengths[rows]), u[r], d.vocab, index)
        accepted[r], next_token[r] = part.accepted, part.next_token
    return Verification(step, Verdict(accepted, next_token), start)


def commit(
    target: Target,
    drafter: Drafter,
    seqs: list[SequenceState],
    d: Draft,
    lengths: np.ndarray,
    v: Verification,
) -> None:
    """Step 4: emit each sequence's tokens, record the round, roll the KV back past the
    accepted prefix, and hand the committed tokens' features to the drafter."""
    for r, s in enumerate(seqs):
        n = int(v.verdict.accepted[r])
        drafts = d.tokens[r, :n].tolist()
        c = commit_tokens(drafts, n, int(v.verdict.next_token[r]), s.req.stop_ids, s.remaining)
        # a round that ends on an accepted stop token counts the drafts up to it, no bonus (§6.2)
        record = RoundRecord(int(lengths[r]), len(c.tokens) if c.stopped else n, c.stopped)
        s.stats.add(record)
        if d.drafting[r]:
            s.trace.append(
                RoundTrace(record.verified, record.accepted, record.stopped, d.conf_logits[r].copy())
            )
        committed_inputs = [s.anchor] + drafts
        s.emit(c.tokens, c.finished)
        target.rollback(s.slot, v.start[r] + n + 1)
        if not c.finished:
            drafter.advance(s.rid, committed_inputs, v.step.features[r, : n + 1])


def speculative_round(
    target: Target,
    drafter: Drafter,
    policy: Policy,
    calibration: STS | None,
    seqs: list[SequenceState],
    drafting: np.ndarray | None = None,
) -> None:
    """draft → schedule → verify → commit for every sequence. Rows with `drafting` False (a
    dspark-skip decision made from earlier rounds' confidences only) verify ℓ = 0, i.e. decode
    one target token, and still hand its features to the drafter."""
    d = draft(drafter, seqs, drafting)
    lengths = schedule(policy, calibration, seqs, d)
    v = verify(target, seqs, d, lengths)
    commit(target, drafter, seqs, d, lengths, v)
