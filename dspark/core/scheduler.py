"""Confidence-scheduled verification: choose how many draft tokens each request verifies.

Every round, each active request r has γ draft slots with calibrated *conditional*
confidences c_{r,j} (slot j's confidence is known before token j is sampled; it depends on
x_{r,<j}).  A policy turns them into verification lengths ℓ_r, 0 ≤ ℓ_r ≤ available[r] ≤ γ.
The target forward for the round then holds B = Σ_r (1 + ℓ_r) tokens (anchor slot included).

DSpark (paper §3.2.2, Algorithm 1; digest §5.1) maximises the expected token throughput

    Θ = τ · SPS(B),   τ = Σ_r (1 + Σ_{j≤ℓ_r} a_{r,j}),   a_{r,j} = Π_{i≤j} c_{r,i}     (digest §5.1)

where SPS(B) is the measured engine steps per second at B batch tokens (`SPSTable`).

Losslessness needs *non-anticipation* (paper §3.2.2 and App. A; digest §5.3): the event
"slot k of request r is verified" must not depend on token x_{r,k}, hence not on
c_{r,k+1..γ}.  `DSpark` gets this from its early-stop break; `DSparkAsync` (paper §5.2,
digest §5.4) gets it from computing the capacity on stale confidences and admitting by rank.

This module is pure numpy and knows nothing about models, tensors on device or servers.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from dspark.core.sps import SPSTable

__all__ = [
    "MODES",
    "DSparkAsync",
    "DSpark",
    "Off",
    "Policy",
    "DSparkSkip",
    "SkipPlanner",
    "Static",
    "Threshold",
    "candidate_order",
    "policy_for",
    "prefix_survival",
]

MODES: tuple[str, ...] = (
    "off",
    "static:<k>",
    "threshold:<x>",
    "dspark",
    "dspark-async",
    "dspark-skip",
)
"""Valid forms of a request's mode (k: int ≥ 0, x: float in [0, 1]); `policy_for` builds its policy."""

DEFAULT_MODE = "dspark-skip"
"""The server's mode for requests that name none (issue 18, docs/decisions.md): Algorithm 1 with
the option of not drafting for a request when drafting does not pay on this machine."""


# ---------------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------------


def prefix_survival(conf: ArrayLike) -> np.ndarray:
    """Prefix survival a_{r,j} = Π_{i≤j} c_{r,i} along the last axis (digest §5.1).

    With c in [0, 1], a is non-increasing in j, also in floating point (x·c ≤ x exactly
    for c ≤ 1 under round-to-nearest).
    """
    return np.cumprod(np.asarray(conf, dtype=np.float64), axis=-1)


def candidate_order(survival: np.ndarray, available: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Candidates (r, j) with a_{r,j} > 0 and j ≤ available[r], in admission order.

    Order: survival descending, ties by ascending j, then ascending r (digest §5.2 step 2).
    The order is deterministic and value-independent on ties, and since a_{r,j} is
    non-increasing in j, (r, j-1) always precedes (r, j): any prefix of this order is a
    per-request prefix of slots.

    Returns:
        (r, j): int64 arrays of request index (0-based) and slot (1-based), best first.
    """
    survival = np.asarray(survival, dtype=np.float64)
    gamma = survival.shape[1]
    slots = np.arange(1, gamma + 1)
    mask = (survival > 0) & (slots[None, :] <= np.asarray(available)[:, None])
    r_idx, j0 = np.nonzero(mask)
    order = np.lexsort((r_idx, j0, -survival[r_idx, j0]))  # last key is the primary key
    return r_idx[order].astype(np.int64), (j0[order] + 1).astype(np.int64)


def _lengths_from_admitted(r_admitted: np.ndarray, n_requests: int) -> np.ndarray:
    """ℓ_r = number of admitted candidates of request r (a prefix of `candidate_order`)."""
    return np.bincount(r_admitted, minlength=n_requests).astype(np.int64)


# ---------------------------------------------------------------------------------------------
# Policies
# ---------------------------------------------------------------------------------------------


class Policy(ABC):
    """Maps per-slot confidences of the active requests to verification lengths ℓ_r.

    `schedule` validates its inputs and returns int64 ℓ with 0 ≤ ℓ_r ≤ available[r] ≤ γ; the
    target batch of the round is B = Σ_r (1 + ℓ_r).
    """

    @property
    @abstractmethod
    def name(self) -> str:
        """The mode this policy implements (dspark-skip, static:3, ...)."""

    def schedule(
        self, conf: np.ndarray, available: np.ndarray, stale_conf: np.ndarray | None = None
    ) -> np.ndarray:
        """Verification lengths for one round.

        Args:
            conf: [R, γ] calibrated conditional confidences c_{r,j} in [0, 1].
            available: [R] number of drafts request r has available, 0..γ.
            stale_conf: [R, γ] confidences of the same requests from two rounds earlier
                (NaN where there is no history); only `DSparkAsync` reads it.

        Returns:
            int64 [R] verification lengths ℓ_r.
        """
        conf, available, stale_conf = _validate(conf, available, stale_conf)
        if conf.shape[0] == 0:
            return np.zeros(0, dtype=np.int64)
        return self._schedule(conf, available, stale_conf).astype(np.int64)

    @abstractmethod
    def _schedule(self, conf: np.ndarray, available: np.ndarray, stale_conf: np.ndarray | None) -> np.ndarray:
        """Policy body on validated inputs with R ≥ 1."""


def _validate(
    conf: np.ndarray, available: np.ndarray, stale_conf: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    conf = np.asarray(conf, dtype=np.float64)
    if conf.ndim != 2:
        raise ValueError(f"conf must be a [R, γ] array of confidences, got shape {conf.shape}.")
    n_requests, gamma = conf.shape
    if not np.all((conf >= 0) & (conf <= 1)):
        raise ValueError(
            "conf must hold calibrated confidences in [0, 1] with no NaN; clip or fix the head output."
        )
    available_arr = np.asarray(available)
    if available_arr.shape != (n_requests,):
        raise ValueError(
            f"available must have shape ({n_requests},) like conf {conf.shape}, got {available_arr.shape}."
        )
    if available_arr.size and not np.all(np.mod(available_arr, 1) == 0):
        raise ValueError("available must hold integer draft counts.")
    available_arr = available_arr.astype(np.int64)
    if available_arr.size and not np.all((available_arr >= 0) & (available_arr <= gamma)):
        raise ValueError(
            f"available must lie in 0..γ={gamma} (drafts available per request), got {available_arr}."
        )
    if stale_conf is not None:
        stale_conf = np.asarray(stale_conf, dtype=np.float64)
        if stale_conf.shape != conf.shape:
            raise ValueError(
                f"stale_conf must have the shape of conf {conf.shape}, got {stale_conf.shape}; "
                "pass NaN rows for requests without history."
            )
        finite = stale_conf[~np.isnan(stale_conf)]
        if not np.all((finite >= 0) & (finite <= 1)):
            raise ValueError("stale_conf must hold confidences in [0, 1], or NaN where there is no history.")
    return conf, available_arr, stale_conf


@dataclass(frozen=True)
class Off(Policy):
    """No speculation: ℓ_r = 0 (plain decoding, B = R)."""

    @property
    def name(self) -> str:
        return "off"

    def _schedule(self, conf: np.ndarray, available: np.ndarray, stale_conf: np.ndarray | None) -> np.ndarray:
        return np.zeros(conf.shape[0], dtype=np.int64)


@dataclass(frozen=True)
class Static(Policy):
    """Static MTP-k (digest §5.5): ℓ_r = min(k, available[r]), whatever the load or confidence."""

    k: int

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int | np.integer) or self.k < 0:
            raise ValueError(f"Static(k) needs an integer k >= 0, got {self.k!r}.")

    @property
    def name(self) -> str:
        return f"static:{self.k}"

    def _schedule(self, conf: np.ndarray, available: np.ndarray, stale_conf: np.ndarray | None) -> np.ndarray:
        return np.minimum(available, int(self.k))


@dataclass(frozen=True)
class Threshold(Policy):
    """Fixed confidence threshold (digest §5.5; EAGLE-2/SpecDec++ style, load-blind).

    ℓ_r = number of leading slots with c_{r,j} ≥ x: truncate at the first slot whose
    conditional confidence is below x, capped by available.  Non-anticipating: slot k is kept
    only on c_{r,1..k}.
    """

    x: float

    def __post_init__(self) -> None:
        if not (isinstance(self.x, int | float | np.floating) and 0.0 <= float(self.x) <= 1.0):
            raise ValueError(f"Threshold(x) needs a confidence x in [0, 1], got {self.x!r}.")

    @property
    def name(self) -> str:
        return f"threshold:{self.x}"

    def _schedule(self, conf: np.ndarray, available: np.ndarray, stale_conf: np.ndarray | None) -> np.ndarray:
        leading = np.cumprod(conf >= self.x, axis=1).sum(axis=1)
        return np.minimum(leading, available)


@dataclass(frozen=True)
class DSpark(Policy):
    """DSpark Algorithm 1: causal greedy with early stopping (paper §3.2.2; digest §5.2–5.3).

    Candidates (r, j) with a_{r,j} > 0 and j ≤ available[r] are scanned in `candidate_order`
    (survival descending, ties by ascending j then r).  Start with ℓ = 0, B = R, τ* = R,
    Θ_best = R · SPS(R).  For each candidate: ℓ_r = j, B += 1, τ* += a_{r,j},
    Θ = τ* · SPS(B); commit if Θ > Θ_best (strict), else BREAK.

    The break is what keeps the procedure lossless: the decision on (r, k) depends only on
    candidates ranked before it (other requests, and (r, j<k)) and on a_{r,k}, never on
    c_{r,k+1..} which depend on x_{r,k} (paper App. A).  The result is the global optimum
    of Θ iff Θ along the sorted path is unimodal; a jagged SPS table can trap it in a local
    optimum — that is what `DSparkAsync` addresses.
    """

    sps: SPSTable

    def __post_init__(self) -> None:
        if not isinstance(self.sps, SPSTable):
            raise ValueError("DSpark needs an SPSTable (measured SPS(B)); profile the engine first.")

    @property
    def name(self) -> str:
        return "dspark"

    def _schedule(self, conf: np.ndarray, available: np.ndarray, stale_conf: np.ndarray | None) -> np.ndarray:
        n_requests = conf.shape[0]
        survival = prefix_survival(conf)
        r_idx, j_idx = candidate_order(survival, available)
        gains = survival[r_idx, j_idx - 1]
        # Θ along the greedy path: point n has admitted the first n candidates.
        tau = n_requests + np.concatenate(([0.0], np.cumsum(gains)))
        batch = n_requests + np.arange(len(gains) + 1)
        theta = tau * self.sps._sps_array(batch)
        # Every commit sets Θ_best to the current Θ, so the scan continues exactly while
        # Θ strictly increases along the path; the first non-increase is the break.
        not_improving = np.flatnonzero(theta[1:] <= theta[:-1])
        n_committed = int(not_improving[0]) if not_improving.size else len(gains)
        return _lengths_from_admitted(r_idx[:n_committed], n_requests)


@dataclass(frozen=True)
class DSparkAsync(Policy):
    """DSpark asynchronous scheduling: stale capacity K, then dynamic top-K (paper §5.2; digest §5.4).

    1. Capacity K from `stale_conf` (two rounds old; NaN entries, or no stale_conf at all,
       are replaced by the conditional confidence `prior` at that slot).  Stale survivals of
       slots j ≤ available[r] with a > 0 are sorted descending and
       Θ(n) = (R + sum of the top-n stale survivals) · SPS(R + n), n = 0..N, is searched
       WITHOUT a break; K = argmax_n Θ(n), the smallest n on ties.  The unconstrained search
       escapes the local optima of a jagged SPS table.
    2. Admission: the top-K candidates in `candidate_order` of the CURRENT survivals
       (a_{r,j} > 0, j ≤ available[r]); ℓ_r = number admitted for r, which is always a prefix
       of r's slots because a is non-increasing in j and ties break by ascending j.

    Why this is lossless (non-anticipation, digest §5.3–5.4): K is a function of the stale
    confidences only, so it cannot depend on the current tokens.  Slot (r, k) is admitted iff
    fewer than K candidates rank above it.  Those candidates are other requests' slots
    (independent of x_{r,k}) and (r, j<k) (functions of x_{r,<k}); the slots that depend on
    x_{r,k}, i.e. (r, j>k), have a_{r,j} ≤ a_{r,k} and lose ties by j, so they never rank
    above (r, k).  Hence 1[ℓ_r ≥ k] does not depend on x_{r,k}.
    """

    sps: SPSTable
    prior: float = 0.7

    def __post_init__(self) -> None:
        if not isinstance(self.sps, SPSTable):
            raise ValueError("DSparkAsync needs an SPSTable (measured SPS(B)); profile the engine first.")
        if not (isinstance(self.prior, int | float | np.floating) and 0.0 <= float(self.prior) <= 1.0):
            raise ValueError(
                f"DSparkAsync prior must be a conditional confidence in [0, 1], got {self.prior!r}."
            )

    @property
    def name(self) -> str:
        return "dspark-async"

    def capacity(self, stale_conf: np.ndarray | None, available: np.ndarray) -> int:
        """Global verify budget K (draft tokens across the batch) from stale confidences.

        Args:
            stale_conf: [R, γ] confidences from two rounds earlier, NaN where unknown, or None.
            available: [R] drafts available per request now; slots beyond it are not candidates.
        """
        available = np.asarray(available, dtype=np.int64)
        n_requests = available.shape[0]
        if n_requests == 0:
            return 0
        if stale_conf is None:
            gamma = int(available.max())
            stale = np.full((n_requests, gamma), float(self.prior))
        else:
            stale = np.asarray(stale_conf, dtype=np.float64)
            stale = np.where(np.isnan(stale), float(self.prior), stale)
        survival = prefix_survival(stale)
        slots = np.arange(1, stale.shape[1] + 1)
        mask = (survival > 0) & (slots[None, :] <= available[:, None])
        gains = np.sort(survival[mask])[::-1]
        tau = n_requests + np.concatenate(([0.0], np.cumsum(gains)))
        batch = n_requests + np.arange(len(gains) + 1)
        theta = tau * self.sps._sps_array(batch)
        return int(np.argmax(theta))  # first occurrence: smallest n on ties

    def _schedule(self, conf: np.ndarray, available: np.ndarray, stale_conf: np.ndarray | None) -> np.ndarray:
        n_requests = conf.shape[0]
        k_capacity = self.capacity(stale_conf, available)
        r_idx, _ = candidate_order(prefix_survival(conf), available)
        return _lengths_from_admitted(r_idx[:k_capacity], n_requests)


@dataclass(frozen=True)
class DSparkSkip(DSpark):
    """Algorithm 1, plus a decision before the draft round: which requests draft at all.

    The paper's drafter cost is paid for every request even when the scheduler then verifies
    0–1 of its drafts; on a CPU a draft round is not free. `plan` decides, from each request's
    LAST round's confidences (NaN when it has none) and the SPS table, whether drafting is
    worth its measured cost this round; requests that do not draft verify ℓ = 0, i.e. decode
    one target token. Lossless: the decision never looks at this round's drafts.

    Expected tokens per second of a plan with drafting set D (R requests in the round):
        no drafting:  R / t(R)
        D non-empty:  (R + Σ_{r∈D} E_r) / (t_draft(|D|) + Σ_{r∈D} t_catchup,r + t(R + Σ_{r∈D} ℓ_r))
    where ℓ_r is what Algorithm 1 would verify on the last survivals, E_r their sum,
    t_draft(n) the measured price of a draft call for n requests (issue 18: one constant
    overpriced single drafts and underpriced refreshes of many), t the target step time
    measured now (the SPS table's shape rescaled live, `core.costs.LiveSteps`), and
    t_catchup,r the measured price of feeding the features r committed while it did not draft
    (a lazy drafter feeds them when it drafts again). Sets
    D are the `forced` requests plus the top-k of the rest by E_r, k = 0..R (the best k wins,
    the smallest on ties). Requests with no history are forced to draft (nothing to go on).
    `SkipPlanner` adds the refreshes that keep those confidences from going stale.
    """

    prior: float = 0.7

    @property
    def name(self) -> str:
        return "dspark-skip"

    def plan(
        self,
        last_conf: np.ndarray,
        available: np.ndarray,
        draft_seconds: float | Callable[[np.ndarray], np.ndarray] | None,
        forced: np.ndarray | None = None,
        catchup_seconds: np.ndarray | None = None,
        step_times: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> np.ndarray:
        """bool [R]: which requests draft this round.

        `draft_seconds`: the draft call's price, a constant or a function of the number of
        drafting requests (`core.costs.DraftCost`); None = not measured yet (everyone drafts).
        `catchup_seconds` [R]: what drafting now would cost each request to catch up (0 by
        default). `step_times`: t(B) for an array of B (default: the SPS table's; the batcher
        passes `core.costs.LiveSteps`, the table rescaled to the steps measured now)."""
        last = np.asarray(last_conf, dtype=np.float64)
        available = np.asarray(available, dtype=np.int64)
        R = last.shape[0]
        forced = np.zeros(R, bool) if forced is None else np.asarray(forced, bool).copy()
        forced |= np.isnan(last).all(axis=1)
        if draft_seconds is None or R == 0:
            return np.ones(R, bool)
        constant = None if callable(draft_seconds) else float(draft_seconds)

        def draft(n: np.ndarray) -> np.ndarray:
            if constant is None:
                assert callable(draft_seconds)
                return np.asarray(draft_seconds(n), dtype=np.float64)
            return np.full(np.shape(n), constant)

        t = step_times or self.sps.step_times
        catchup = np.zeros(R) if catchup_seconds is None else np.asarray(catchup_seconds, dtype=np.float64)
        last = np.where(np.isnan(last), self.prior, last)
        ell = self.schedule(last, available)
        surv = prefix_survival(last)
        gain = np.where(np.arange(surv.shape[1])[None, :] < ell[:, None], surv, 0.0).sum(axis=1)
        rest = np.flatnonzero(~forced)
        rest = rest[np.argsort(-gain[rest], kind="stable")]
        # plan k (k = 0..len(rest)): the forced requests plus the k best of the rest
        n = forced.sum() + np.arange(len(rest) + 1)
        tokens = R + gain[forced].sum() + np.concatenate([[0.0], np.cumsum(gain[rest])])
        verified = ell[forced].sum() + np.concatenate([[0], np.cumsum(ell[rest])])
        extra = catchup[forced].sum() + np.concatenate([[0.0], np.cumsum(catchup[rest])])
        seconds = np.where(
            n > 0,
            np.asarray(draft(np.maximum(n, 1)), dtype=np.float64) + extra + t(R + verified),
            t(np.array([R])),
        )
        k = int(np.argmax(tokens / seconds))  # the first (smallest) k on ties
        mask = forced.copy()
        mask[rest[:k]] = True
        return mask


def _dearer(
    price: float | Callable[[np.ndarray], np.ndarray], factor: float
) -> float | Callable[[np.ndarray], np.ndarray]:
    """A draft price (constant, or function of the number of drafting requests) times factor."""
    if not callable(price):
        return float(price) * factor

    def scaled(n: np.ndarray) -> np.ndarray:
        return factor * np.asarray(price(n), dtype=np.float64)

    return scaled


def _band(requests: int) -> int:
    """Load band of a round of `requests` requests: 1, 2, 3–4, 5–8, ... → 0, 1, 2, 3, ..."""
    return max(int(requests) - 1, 0).bit_length()


class SkipPlanner:
    """dspark-skip across rounds: `DSparkSkip.plan` plus refreshes of stale confidences.

    A request that stops drafting keeps the confidences of its last drafted round; if it never
    drafted again they would decide forever. So a request drafts anyway when it is due for a
    refresh. Each refresh that the plan would not have chosen on its own merits doubles the
    request's `interval` (4, 8, 16, 32, ...), up to `max_interval`: the larger of REFRESH_MAX
    and the interval at which one refresh draft costs at most REFRESH_SHARE (0.5%) of the
    rounds it covers. As soon as the plan picks the request on its own merits, its interval
    drops back to REFRESH.

    Under load requests come and go all the time (issue 18: at 32 clients, one new request
    every other round), so three things are decided for the population, not per request:

    * **a refresh happens only when it could change the decision.** The planner keeps the
      confidences of the last `RECENT` drafted rounds of all its requests; the `best case` is
      their per-position 90th percentile (the stretches where drafting pays: code, arithmetic).
      If drafting for a request with the best-case confidences, at that request's own catch-up
      price, would not pay at this round's load and prices, no confidence a refresh could bring
      back would make it pay, and it is not refreshed (a new request's first probe catches up
      its whole prompt). At one client a refresh is rarely refused (a good stretch doubles a
      round's tokens), at 32 almost always (a good stretch adds a few tokens to 32);
    * refreshes are aligned on a grid: a request with interval I is due only in rounds that are
      multiples of I (and at least I/2 rounds after its last draft); intervals are REFRESH · 2^j,
      so the requests due share one draft call however staggered their arrivals;
    * a new request is judged on the population's confidences (the mean of the last drafted
      round of the requests with a history) instead of drafting blindly; only when the planner
      has never seen a confidence does it draft to learn one. Refreshes include it: on its
      first grid round it probes like any request due.

    * **drafting's measured return throttles refreshes.** The batcher reports what each drafting
      round returned (accepted draft tokens, worth a plain round's time over its requests each)
      and what it cost beyond a plain round (`observe`). While the last VALUE_WINDOW drafting
      rounds at this load returned less than they cost (`losing`), a refresh round happens at most once per
      price / (REFRESH_SHARE · round time) rounds, whoever is due. The best case says what a
      refresh could find, not how often it does: under churn at 4–16 clients every new request
      is probed on 4, 8, 16, ... and most probes find nothing worth drafting, so the stale
      confidences alone kept paying for probes that lost (issue 18, third pass).

    Over a long run in which drafting never pays, refreshes cost under 1% of the round time,
    with or without churn, and also when the confidences keep promising more than drafting
    returns (tests/unit/test_lazy_context.py simulates all three).
    """

    REFRESH = 4
    REFRESH_MAX = 32
    # a refresh draft's cost at most this share of the rounds it covers: half the 1% budget, so
    # that the ramp-up (4, 8, 16, ... before the longest interval) stays inside it too
    REFRESH_SHARE = 0.005
    RECENT = 256  # drafted rounds whose confidences make the best case
    BEST_QUANTILE = 90  # the best case: this percentile of their confidences, per position
    VALUE_WINDOW = 64  # drafting rounds whose measured return and cost say whether drafting pays
    MAX_ODDS = 8.0  # while losing, drafting is priced at most this many times its measured price

    REASONS = ("merit", "refresh", "new")
    """Why a round makes a draft call, first that applies: some request pays on its own merits;
    a request with a history is due for a refresh; a request without one must draft (the planner
    has no confidence at all to judge it on)."""

    def __init__(self, policy: DSparkSkip) -> None:
        self.policy = policy
        self.reason: str | None = None  # why the last `choose` drafts (REASONS), None if it does not
        self.population: np.ndarray | None = None  # mean last-round confidences of the requests seen
        self.probing = True  # whether the last `choose` found that a refresh could pay
        self._recent: deque[np.ndarray] = deque(maxlen=self.RECENT)  # confidences of drafted rounds
        self._best: np.ndarray | None = None  # best_case(), until a round is recorded
        self._seen: dict[int, bytes] = {}  # request → the last confidences recorded for it (raw bytes)
        self._skipped: dict[int, int] = {}  # request → consecutive rounds without drafting
        self._refresh: dict[int, int] = {}  # request → its refresh interval
        self._last_refresh = -(10**9)  # the round of the last refresh
        self._value: dict[int, deque[tuple[float, float]]] = {}  # load band → (benefit, cost) s

    def max_interval(self, draft_seconds: float | None, round_seconds: float) -> int:
        """The longest refresh interval, REFRESH · 2^j: REFRESH_MAX, or longer when a draft call
        is dear enough that refreshing every REFRESH_MAX rounds would cost more than
        REFRESH_SHARE of them."""
        if not draft_seconds or round_seconds <= 0:
            return self.REFRESH_MAX
        need = draft_seconds / (self.REFRESH_SHARE * round_seconds)
        j = max(math.ceil(math.log2(max(need / self.REFRESH, 1.0))), 0)
        return max(self.REFRESH_MAX, self.REFRESH * 2**j)

    def observe(self, accepted: int, requests: int, extra_seconds: float, step_seconds: float) -> None:
        """What a drafting round returned, measured: `accepted` draft tokens over `requests`
        requests, for `extra_seconds` beyond a plain round of those requests, which takes
        `step_seconds` (so a token is worth step_seconds / requests)."""
        if requests > 0 and step_seconds > 0:
            window = self._value.setdefault(_band(requests), deque(maxlen=self.VALUE_WINDOW))
            window.append((accepted * step_seconds / requests, max(extra_seconds, 0.0)))

    def losing(self, requests: int) -> bool:
        """Whether the last VALUE_WINDOW drafting rounds at this load (rounds of as many requests,
        within a power of two) returned less than they cost (False before any is observed).
        Refreshes pay only through the drafts they lead to: when those have been losing at this
        load, the confidences that chose them promised too much. Per load, because whether
        drafting pays depends on it: an hour at 32 clients says nothing about one client."""
        return self.odds(requests) > 1.0

    def odds(self, requests: int) -> float:
        """cost / return of the last VALUE_WINDOW drafting rounds at this load, at least 1 and
        at most MAX_ODDS (1 before any is observed)."""
        window = self._value.get(_band(requests), ())
        benefit, cost = sum(b for b, _ in window), sum(c for _, c in window)
        if cost <= benefit:
            return 1.0
        return min(cost / benefit, self.MAX_ODDS) if benefit > 0 else self.MAX_ODDS

    def best_case(self) -> np.ndarray | None:
        """Per-position BEST_QUANTILE of the recent drafted rounds' confidences (None: none yet)."""
        if self._best is None and self._recent:
            self._best = np.percentile(np.stack(self._recent), self.BEST_QUANTILE, axis=0)
        return self._best

    def choose(
        self,
        round_index: int,
        rids: list[int],
        last_conf: np.ndarray,
        available: np.ndarray,
        draft_seconds: float | Callable[[np.ndarray], np.ndarray] | None,
        catchup_seconds: np.ndarray | None = None,
        step_times: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> np.ndarray:
        """bool [R]: which of these requests draft this round (`last_conf`: their last
        drafted round's confidences, NaN rows for none; `available`: drafts each may verify;
        `draft_seconds`, `catchup_seconds`, `step_times`: the prices, as in `DSparkSkip.plan`).
        `reason` then says why a draft call happens this round (`REASONS`), None if none does."""
        last = np.array(last_conf, dtype=np.float64)
        available = np.asarray(available)
        R = len(rids)
        catch = np.zeros(R) if catchup_seconds is None else np.asarray(catchup_seconds, dtype=np.float64)
        skipped = np.array([self._skipped.get(r, 0) for r in rids])
        interval = np.array([self._refresh.get(r, self.REFRESH) for r in rids])
        has_history = ~np.isnan(last).all(axis=1)
        for r in np.flatnonzero(has_history):  # record the confidences of newly drafted rounds
            row = last[r].tobytes()  # a bytes compare: np.array_equal per request per round cost more
            if self._seen.get(rids[r]) != row:
                self._seen[rids[r]] = row
                self._recent.append(last[r].copy())
                self._best = None
        if has_history.any():
            self.population = last[has_history].mean(axis=0)
        if self.population is not None:  # judge new requests on what the others showed
            last[~has_history] = self.population
        plan = self.policy.plan
        h = np.flatnonzero(has_history)
        # due for a refresh (or, for a request that never drafted, its first probe)
        due = (round_index % interval == 0) & (skipped + 1 >= interval // 2)
        probe = np.zeros(R, bool)
        if due.any() and draft_seconds is not None and self.losing(R):
            # drafting has been losing lately: refresh rounds at most at the rate that keeps their
            # price within REFRESH_SHARE of the rounds in between (exploration, not a habit)
            t = step_times or self.policy.sps.step_times
            n = np.array([int(due.sum())])
            price = draft_seconds(n)[0] if callable(draft_seconds) else draft_seconds
            gap = price / (self.REFRESH_SHARE * float(t(np.array([max(R, 1)]))[0]))
            if round_index - self._last_refresh < gap:
                due[:] = False
                self.probing = False
        if due.any():
            # would drafting pay for a request with the best-case confidences, next to these,
            # at the catch-up price of the request due (a new one catches up its whole prompt)?
            best = self.best_case()
            if draft_seconds is None or best is None:
                probe = due.copy()
            else:
                conf = np.vstack([last[h], best[None, :]])
                avail = np.append(available[h], last.shape[1])

                def pays(c: float) -> bool:
                    extra = np.append(catch[h], c)
                    return bool(plan(conf, avail, draft_seconds, None, extra, step_times)[-1])

                # pays(c) is monotone in c: bisect the due requests' catch-up prices
                d = np.flatnonzero(due)
                d = d[np.argsort(catch[d], kind="stable")]
                lo, hi = 0, len(d)  # d[:lo] pay, d[hi:] do not
                if len(d):  # under load the cheapest usually does not pay: one plan, not log2(R)
                    lo, hi = (1, hi) if pays(float(catch[d[0]])) else (0, 0)
                while lo < hi:
                    mid = (lo + hi) // 2
                    if pays(float(catch[d[mid]])):
                        lo = mid + 1
                    else:
                        hi = mid
                probe[d[:lo]] = True
            self.probing = bool(probe.any())
        forced = probe
        # while drafting has been losing at this load, what the confidences promise is trusted only
        # as far as it was delivered: the plan prices drafting at its measured cost / return
        odds = self.odds(R)
        if odds > 1.0 and draft_seconds is not None:
            draft_seconds = _dearer(draft_seconds, odds)
            catch = catch * odds
        mask = plan(last, available, draft_seconds, forced, catch, step_times)
        # what the plan picks on merit alone (requests with a history, nobody forced): the plan
        # itself when nobody is forced, else (a refresh round) a plan without the refreshes
        merit = mask & has_history
        if forced.any():
            merit = np.zeros(R, bool)
            merit[h] = plan(last[h], available[h], draft_seconds, None, catch[h], step_times)
        cap = self.REFRESH_MAX
        if forced.any():  # the back-off's ceiling matters only when a refresh happens
            t = step_times or self.policy.sps.step_times
            n_due = int(forced.sum())
            refresh_cost = draft_seconds(np.array([n_due]))[0] if callable(draft_seconds) else draft_seconds
            cap = self.max_interval(refresh_cost, float(t(np.array([max(R, 1)]))[0]))
        if (forced & ~merit).any():
            self._last_refresh = round_index
        for r, rid in enumerate(rids):
            if forced[r] and not merit[r]:  # a refresh that did not pay: back off
                self._refresh[rid] = min(2 * int(interval[r]), cap)
            elif mask[r] and merit[r]:  # drafting pays for it again
                self._refresh[rid] = self.REFRESH
            else:
                self._refresh[rid] = int(interval[r])
            self._skipped[rid] = 0 if mask[r] else int(skipped[r]) + 1
        if not mask.any():
            self.reason = None
        elif merit.any():
            self.reason = "merit"
        elif forced.any():
            self.reason = "refresh"
        else:
            self.reason = "new"
        return mask

    def interval(self, rid: int) -> int:
        """Rounds without drafting after which request `rid` drafts again (a refresh)."""
        return self._refresh.get(rid, self.REFRESH)

    def forget(self, rid: int) -> None:
        self._skipped.pop(rid, None)
        self._refresh.pop(rid, None)
        self._seen.pop(rid, None)


# ---------------------------------------------------------------------------------------------
# Modes
# ---------------------------------------------------------------------------------------------


def policy_for(mode: str, sps: SPSTable | None = None) -> Policy:
    """The policy of a request's mode string: one of `MODES`.

    "off", "static:<k>" (int k ≥ 0), "threshold:<x>" (float x in [0, 1]), "dspark",
    "dspark-async" and "dspark-skip" (these three need `sps`, the measured SPS(B) table).
    """
    valid = ", ".join(repr(s) for s in MODES)
    if not isinstance(mode, str):
        raise ValueError(f"mode must be a string, one of {valid}; got {mode!r}.")
    text = mode.strip()
    head, sep, arg = text.partition(":")

    def bad(why: str) -> ValueError:
        return ValueError(f"invalid mode {mode!r}: {why}. Valid forms: {valid}.")

    if head in ("off", "dspark", "dspark-async", "dspark-skip"):
        if sep:
            raise bad(f"{head!r} takes no argument")
        if head == "off":
            return Off()
        if sps is None:
            raise ValueError(
                f"mode {head!r} needs an SPS table (measured engine steps per second vs batch tokens); "
                "pass sps=SPSTable.from_json(...) or profile the engine first."
            )
        return {"dspark": DSpark, "dspark-async": DSparkAsync, "dspark-skip": DSparkSkip}[head](sps)
    if head == "static":
        try:
            k = int(arg)
        except ValueError:
            raise bad("k must be an integer >= 0") from None
        if k < 0:
            raise bad("k must be an integer >= 0")
        return Static(k)
    if head == "threshold":
        try:
            x = float(arg)
        except ValueError:
            raise bad("x must be a float in [0, 1]") from None
        if not 0.0 <= x <= 1.0:
            raise bad("x must be a float in [0, 1]")
        return Threshold(x)
    raise bad("unknown mode")


def check_mode(mode: str) -> None:
    """Raise ValueError if `mode` is not a valid mode (syntax only: a flat SPS table stands in
    for the measured one, which may not exist yet)."""
    policy_for(mode, SPSTable.from_step_times([1, 2], [1.0, 1.0]))
