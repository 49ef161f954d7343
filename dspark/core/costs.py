"""What a round costs on this machine now: live measurements that dspark-skip's plan prices with.

dspark-skip (core/scheduler.py) decides each round whether a draft call pays for the tokens it is
expected to add. That compares two measured quantities that must be on the same clock:

* the target step time t(B) at B batch tokens. The SPS table gives its *shape* (how t grows
  with B), but it was measured once, maybe on another day: a VM's speed drifts (this project's
  CI machine varies ~2.5× between days). `LiveSteps` keeps the table's shape and rescales it to
  the level of the target steps measured in this process (a moving average of measured / table).
* the draft call's seconds for n drafting requests. One constant misprices both ends: a refresh
  round that drafts for 32 requests costs several times a round that drafts for one.
  `DraftCost` keeps the median of recent calls per band of n (1, 2, 3–4, 5–8, ...) and
  interpolates; a band's first call (an engine's warm-up) is dropped.

Both are pure Python/numpy (no clocks: callers pass measured seconds) so that tests can drive
them with exact numbers.
"""

from __future__ import annotations

from collections import deque

import numpy as np
from numpy.typing import ArrayLike

from dspark.core.sps import SPSTable

__all__ = ["DraftCost", "LiveSteps"]


class LiveSteps:
    """t(B) = scale · table(B): the SPS table's shape at the level measured now.

    `observe(b, seconds)` records one measured target step of b batch tokens; `scale` is an
    exponential moving average (weight `alpha`) of seconds / table(b), 1 until the first step.
    Steps shorter than `min_seconds` or non-finite are ignored (a clock glitch must not make the
    whole table free)."""

    def __init__(self, table: SPSTable, alpha: float = 0.05, min_seconds: float = 1e-5) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.table = table
        self.alpha = alpha
        self.min_seconds = min_seconds
        self.scale = 1.0
        self.observed = 0

    def observe(self, b: int, seconds: float) -> None:
        if b < 1 or not np.isfinite(seconds) or seconds < self.min_seconds:
            return
        ratio = seconds / self.table.step_time(b)
        self.scale = ratio if self.observed == 0 else (1 - self.alpha) * self.scale + self.alpha * ratio
        self.observed += 1

    def step_time(self, b: int) -> float:
        return self.scale * self.table.step_time(b)

    def step_times(self, b: ArrayLike) -> np.ndarray:
        return self.scale * self.table.step_times(b)


class DraftCost:
    """Seconds of a call as a function of n, the number of requests in it (a draft call, or the
    non-model part of a round).

    Calls are grouped in bands of n with edges at powers of two (1, 2, 3–4, 5–8, 9–16, ...), the
    batch buckets the engines are built for. Each band keeps its last `window` calls and reads
    their median (n and seconds): one slow call (a VM hiccup) moves nothing. The FIRST call of a
    band is not kept: it carries one-time costs (an engine bucket's first inference, allocator
    growth) that can be many times a normal call, and a price that high would stop the very
    calls that would correct it (a request that never drafts is never measured again). The
    cost at any n is the piecewise-linear interpolation through the bands (in their median n),
    extended past the last band with the slope of the last two (never below 0 per extra request),
    or in proportion to n from a single band above it and flat below it. `seen` is False until a
    call has been kept."""

    def __init__(self, window: int = 9) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._bands: dict[int, deque[tuple[float, float]]] = {}  # band → recent (n, seconds)
        self._warm: set[int] = set()  # bands whose first call has been seen (and dropped)
        self._cached: tuple[np.ndarray, np.ndarray] | None = None  # the band points, until a call

    @staticmethod
    def band(n: int) -> int:
        return max(int(n) - 1, 0).bit_length()  # 1→0, 2→1, 3–4→2, 5–8→3, ...

    def observe(self, n: int, seconds: float) -> None:
        if n < 1 or not np.isfinite(seconds) or seconds < 0:
            return
        k = self.band(n)
        if k not in self._warm:
            self._warm.add(k)
            return
        self._bands.setdefault(k, deque(maxlen=self.window)).append((float(n), float(seconds)))
        self._cached = None

    @property
    def seen(self) -> bool:
        return bool(self._bands)

    def _points(self) -> tuple[np.ndarray, np.ndarray]:
        if self._cached is None:
            pts = sorted(
                (float(np.median([c[0] for c in q])), float(np.median([c[1] for c in q])))
                for q in self._bands.values()
            )
            self._cached = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
        return self._cached

    @property
    def mean(self) -> float | None:
        """The mean over bands of their median call (for logs), None before any."""
        if not self._bands:
            return None
        return float(self._points()[1].mean())

    def __call__(self, n: ArrayLike) -> np.ndarray:
        """Seconds of a call for each n (an array; raises if no call was kept yet)."""
        if not self._bands:
            raise ValueError(
                "DraftCost has no measurement yet: observe a call first (the first one per band is a warm-up)"
            )
        xs, ys = self._points()
        n = np.asarray(n, dtype=np.float64)
        out = np.interp(n, xs, ys)  # flat outside [xs[0], xs[-1]]
        if len(xs) >= 2:
            slope = max((ys[-1] - ys[-2]) / max(xs[-1] - xs[-2], 1e-9), 0.0)
            out = np.where(n > xs[-1], ys[-1] + slope * (n - xs[-1]), out)
        else:
            out = np.where(n > xs[0], ys[0] * n / xs[0], out)
        return out
