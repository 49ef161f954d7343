"""Acceptance metrics of speculative decoding, named and defined as in the reference (notes §6.2).

Glossary (one round = one target verification of ℓ = `verified` drafts; k is 1-based):

τ (acceptance length)
    committed tokens / rounds, where a round commits its accepted drafts plus the
    target-generated bonus/correction token (paper footnote 3). A round that stopped on an
    accepted EOS/stop token commits its accepted drafts only. Range [1, γ+1] without stops.
survival(k)  (the reference code's ``accept_rate@{k-1}``; notes §6.2, §11)
    #rounds(accepted ≥ k) / #rounds(verified ≥ k): UNCONDITIONAL prefix survival. With every
    round proposing γ and no stops, τ = 1 + Σ_k survival(k).
conditional(k)  (paper Fig. 2)
    #rounds(accepted ≥ k) / #rounds(verified ≥ k and accepted ≥ k−1): acceptance of draft k
    among rounds that reached it. With every round proposing γ it equals
    survival(k) / survival(k−1); survival(k) = Π_{j≤k} conditional(j).
verify_rate  (reference ``verify_rate``; probably the paper's Fig. 5 "acceptance rate")
    committed tokens / Σ(verified + 1): fraction of verified tokens, bonus slot included,
    that were committed.
draft_acceptance_rate
    accepted drafts / verified drafts (bonus excluded); depends on γ, so compare it only at
    equal γ.

Other tools (peers.md §0 item 3, §3.2):
  * vLLM "mean acceptance length" (1 + accepted/num_drafts) and SGLang "accept len" are τ
    (they have no stopped-round rule, so they differ slightly on stopped rounds).
  * vLLM "per-position acceptance rate" (accepted_per_pos[k] / num_drafts) is survival(k)
    when every draft has length γ; it divides by all drafts, survival(k) by rounds that
    verified slot k, so the two differ under variable-length verification.
  * vLLM / TRT-LLM "draft acceptance rate" is draft_acceptance_rate.
  * EAGLE's α_k (``alpha.py``), vLLM Adaptive-K docs and the DSpark confidence head's target
    are conditional(k).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import ArrayLike


@dataclass(frozen=True)
class RoundRecord:
    """Outcome of one verification round.

    verified: drafts verified this round, ℓ ≥ 0 (ℓ = 0: the target just decodes one token).
    accepted: drafts accepted, 0..verified (the accepted prefix length).
    stopped: the accepted prefix ends on an EOS/stop token, so the round commits `accepted`
        tokens and no bonus; requires accepted ≥ 1. A bonus/correction token that is itself
        EOS is not a stop in this sense: that round commits accepted + 1 as usual.
    """

    verified: int
    accepted: int
    stopped: bool = False

    def __post_init__(self) -> None:
        _check_round(self.verified, self.accepted, self.stopped)

    @property
    def committed(self) -> int:
        """Tokens this round commits: accepted drafts + the bonus token unless stopped."""
        return self.accepted + (0 if self.stopped else 1)


def _check_round(verified: int, accepted: int, stopped: bool) -> None:
    for name, value in (("verified", verified), ("accepted", accepted)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}.")
    if verified < 0:
        raise ValueError(f"verified must be ≥ 0, got {verified}.")
    if not 0 <= accepted <= verified:
        raise ValueError(
            f"accepted must lie in [0, verified={verified}], got {accepted}; a round cannot accept more "
            "drafts than it verified."
        )
    if stopped and accepted < 1:
        raise ValueError(
            "stopped=True needs accepted ≥ 1 (the stop token is an accepted draft); if the bonus/correction "
            "token was the stop token, record stopped=False, since that round still commits accepted + 1."
        )


def _int_vector(values: ArrayLike, name: str) -> np.ndarray:
    raw = np.asarray(values)
    if raw.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array with one entry per round, got shape {raw.shape}.")
    if raw.size == 0:
        return np.zeros(0, dtype=np.int64)
    if raw.dtype == bool or not np.all(np.isfinite(raw.astype(np.float64))):
        raise ValueError(f"{name} must hold finite integer counts.")
    as_int = raw.astype(np.int64)
    if not np.array_equal(as_int, raw):
        raise ValueError(f"{name} must hold integer counts, got non-integer values.")
    return as_int


def _count_at_least(values: np.ndarray, size: int) -> np.ndarray:
    """Element k−1 = #(values ≥ k) for k = 1..size."""
    if size == 0:
        return np.zeros(0, dtype=np.int64)
    counts = np.bincount(values, minlength=size + 1)
    at_least = np.cumsum(counts[::-1])[::-1]
    return at_least[1 : size + 1].astype(np.int64)


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else math.nan


def _empty_counts() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


@dataclass(eq=False)
class AcceptanceStats:
    """Mergeable accumulator of verification rounds (notes §6.2).

    Per-position counters are arrays whose element k−1 counts slot k, sized to the longest
    proposal seen (they grow as needed):
      verified_at[k−1] = #rounds(verified ≥ k)
      accepted_at[k−1] = #rounds(accepted ≥ k)
      reached_at[k−1]  = #rounds(verified ≥ k and accepted ≥ k−1)
    Metrics with a zero denominator are nan.
    """

    rounds: int = 0
    committed_tokens: int = 0
    verified_tokens: int = 0
    accepted_tokens: int = 0
    stopped_rounds: int = 0
    verified_at: np.ndarray = field(default_factory=_empty_counts)
    accepted_at: np.ndarray = field(default_factory=_empty_counts)
    reached_at: np.ndarray = field(default_factory=_empty_counts)

    # -- accumulation --------------------------------------------------------------------------

    def _grow(self, size: int) -> None:
        extra = size - self.verified_at.size
        if extra > 0:
            pad = np.zeros(extra, dtype=np.int64)
            self.verified_at = np.concatenate([self.verified_at, pad])
            self.accepted_at = np.concatenate([self.accepted_at, pad])
            self.reached_at = np.concatenate([self.reached_at, pad])

    def add(self, record: RoundRecord) -> None:
        """Add one round."""
        p, a = int(record.verified), int(record.accepted)
        self._grow(p)
        self.rounds += 1
        self.committed_tokens += record.committed
        self.verified_tokens += p
        self.accepted_tokens += a
        self.stopped_rounds += int(record.stopped)
        self.verified_at[:p] += 1
        self.accepted_at[:a] += 1
        self.reached_at[: min(p, a + 1)] += 1  # slot k reached ⇔ k ≤ verified and k ≤ accepted + 1

    def add_many(self, verified: ArrayLike, accepted: ArrayLike, stopped: ArrayLike | None = None) -> None:
        """Add a batch of rounds given as parallel 1-D arrays (stopped defaults to all False)."""
        prop = _int_vector(verified, "verified")
        acc = _int_vector(accepted, "accepted")
        stop = np.zeros(prop.shape, dtype=bool) if stopped is None else np.asarray(stopped)
        if stop.dtype != bool:
            if stop.size and not np.all(np.isin(stop, (0, 1))):
                raise ValueError("stopped must be booleans (or 0/1), one per round.")
            stop = stop.astype(bool)
        if not (prop.shape == acc.shape == stop.shape):
            raise ValueError(
                f"verified, accepted and stopped must have one entry per round each; got lengths "
                f"{prop.size}, {acc.size}, {stop.size}."
            )
        if prop.size == 0:
            return
        if prop.min() < 0:
            raise ValueError(f"verified must be ≥ 0, got {prop.min()}.")
        if acc.min() < 0 or np.any(acc > prop):
            raise ValueError(
                "accepted must lie in [0, verified] for every round; a round cannot accept "
                "more drafts than it verified."
            )
        if np.any(stop & (acc < 1)):
            raise ValueError(
                "stopped=True needs accepted ≥ 1 (the stop token is an accepted draft); a round "
                "whose bonus/correction token is the stop token is not 'stopped'."
            )
        size = int(prop.max())
        self._grow(size)
        self.rounds += int(prop.size)
        self.committed_tokens += int(acc.sum() + np.count_nonzero(~stop))
        self.verified_tokens += int(prop.sum())
        self.accepted_tokens += int(acc.sum())
        self.stopped_rounds += int(np.count_nonzero(stop))
        self.verified_at[:size] += _count_at_least(prop, size)
        self.accepted_at[:size] += _count_at_least(acc, size)
        self.reached_at[:size] += _count_at_least(np.minimum(prop, acc + 1), size)

    def merge(self, other: AcceptanceStats) -> AcceptanceStats:
        """Add all of `other`'s rounds into this accumulator (in place); returns self."""
        if not isinstance(other, AcceptanceStats):
            raise TypeError(f"can only merge another AcceptanceStats, got {type(other).__name__}.")
        self._grow(other.gamma)
        g = other.gamma
        self.rounds += other.rounds
        self.committed_tokens += other.committed_tokens
        self.verified_tokens += other.verified_tokens
        self.accepted_tokens += other.accepted_tokens
        self.stopped_rounds += other.stopped_rounds
        self.verified_at[:g] += other.verified_at
        self.accepted_at[:g] += other.accepted_at
        self.reached_at[:g] += other.reached_at
        return self

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, AcceptanceStats):
            return NotImplemented
        scalars = ("rounds", "committed_tokens", "verified_tokens", "accepted_tokens", "stopped_rounds")
        return all(getattr(self, s) == getattr(other, s) for s in scalars) and all(
            np.array_equal(getattr(self, a), getattr(other, a))
            for a in ("verified_at", "accepted_at", "reached_at")
        )

    # -- metrics -------------------------------------------------------------------------------

    @property
    def gamma(self) -> int:
        """Longest proposal seen (the size of the per-position counters)."""
        return int(self.verified_at.size)

    @property
    def tau(self) -> float:
        """Mean acceptance length: committed tokens per round, bonus included (paper footnote 3)."""
        return _ratio(self.committed_tokens, self.rounds)

    @property
    def verify_rate(self) -> float:
        """Committed tokens / Σ(verified + 1): share of verified tokens, bonus slot included, committed."""
        return _ratio(self.committed_tokens, self.verified_tokens + self.rounds)

    @property
    def mean_verify_len(self) -> float:
        """Mean verification length ℓ (drafts verified per round)."""
        return _ratio(self.verified_tokens, self.rounds)

    @property
    def draft_acceptance_rate(self) -> float:
        """Accepted drafts / verified drafts (bonus excluded; vLLM's "draft acceptance rate")."""
        return _ratio(self.accepted_tokens, self.verified_tokens)

    def _slot(self, k: int) -> int:
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"position k is 1-based (k = 1..gamma), got {k!r}.")
        return int(k) - 1

    def survival(self, k: int) -> float:
        """Unconditional prefix survival at slot k: #(accepted ≥ k) / #(verified ≥ k)."""
        i = self._slot(k)
        if i >= self.gamma:
            return math.nan
        return _ratio(int(self.accepted_at[i]), int(self.verified_at[i]))

    def conditional(self, k: int) -> float:
        """Conditional acceptance at slot k: #(accepted ≥ k) / #(verified ≥ k, accepted ≥ k−1)."""
        i = self._slot(k)
        if i >= self.gamma:
            return math.nan
        return _ratio(int(self.accepted_at[i]), int(self.reached_at[i]))

    def to_dict(self, gamma: int | None = None) -> dict[str, Any]:
        """All metrics; per-position lists cover k = 1..gamma (default: longest proposal seen).

        Undefined ratios are float('nan'); use `to_json_dict` for strict JSON (nan → None).
        """
        g = self.gamma if gamma is None else gamma
        if isinstance(g, bool) or not isinstance(g, (int, np.integer)) or g < 0:
            raise ValueError(f"gamma must be a non-negative integer, got {gamma!r}.")
        g = int(g)

        def counts(arr: np.ndarray) -> list[int]:
            out = [int(x) for x in arr[:g]]
            return out + [0] * (g - len(out))

        return {
            "rounds": self.rounds,
            "committed_tokens": self.committed_tokens,
            "verified_tokens": self.verified_tokens,
            "accepted_tokens": self.accepted_tokens,
            "stopped_rounds": self.stopped_rounds,
            "tau": self.tau,
            "survival": [self.survival(k) for k in range(1, g + 1)],
            "conditional": [self.conditional(k) for k in range(1, g + 1)],
            "verify_rate": self.verify_rate,
            "mean_verify_len": self.mean_verify_len,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "accepted_per_position": counts(self.accepted_at),
            "verified_per_position": counts(self.verified_at),
            "reached_per_position": counts(self.reached_at),
        }

    def to_json_dict(self, gamma: int | None = None) -> dict[str, Any]:
        """`to_dict` with every nan replaced by None, ready for json.dumps(allow_nan=False)."""

        def clean(v: Any) -> Any:
            if isinstance(v, list):
                return [clean(x) for x in v]
            if isinstance(v, float) and not math.isfinite(v):
                return None
            return v

        return {k: clean(v) for k, v in self.to_dict(gamma).items()}
