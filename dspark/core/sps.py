"""SPS(B): the target's measured engine steps per second as a function of batch tokens.

The scheduler reads it (paper §3.2.2; digest §5.1); `dspark sps` (dspark/perf/sps.py) measures
it with perf_analyzer. Pure numpy; a table is immutable and JSON round-trips exactly.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class SPSTable:
    """Measured engine steps per second as a function of batch tokens B (target forward tokens in one step).

    Paper §3.2.2 / digest §5.1: SPS(B) is profiled once at engine start and read as a table.

    Lookup rule for SPS(B) = 1 / t(B), with t the step time in seconds:

    * at a measured B, t(B) is the measured step time;
    * between two measured points, t(B) is interpolated linearly in *step time* (1/SPS);
    * below the smallest measured B, t(B) = t(B_min): a step is never cheaper than the
      smallest one measured;
    * above the largest measured B, t(B) = t(B_max) · B / B_max: step time grows in
      proportion to B (compute-bound assumption; conservative);
    * B < 1 raises ValueError.

    Attributes:
        batch_tokens: measured B values, strictly increasing integers ≥ 1.
        steps_per_second: SPS at each measured B, finite and > 0.
        meta: free-form provenance (context length, machine, versions); ignored by ==.
    """

    batch_tokens: tuple[int, ...]
    steps_per_second: tuple[float, ...]
    meta: dict = field(default_factory=dict, compare=False)
    _b: np.ndarray = field(init=False, repr=False, compare=False)  # B as float64 (set in __post_init__)
    _t: np.ndarray = field(init=False, repr=False, compare=False)  # step times 1 / SPS

    def __post_init__(self) -> None:
        b = tuple(self.batch_tokens)
        s = tuple(float(v) for v in self.steps_per_second)
        if len(b) == 0:
            raise ValueError(
                "SPSTable is empty: measure at least one batch size (batch_tokens, steps_per_second)."
            )
        if len(b) != len(s):
            raise ValueError(
                f"SPSTable length mismatch: {len(b)} batch_tokens but {len(s)} steps_per_second; "
                "give exactly one SPS value per measured batch size."
            )
        for v in b:
            integral = isinstance(v, int | np.integer) or (
                isinstance(v, float | np.floating) and float(v).is_integer()
            )
            if isinstance(v, bool) or not integral:
                raise ValueError(f"SPSTable batch_tokens must be integers (token counts), got {v!r}.")
        b = tuple(int(v) for v in b)
        if b[0] < 1:
            raise ValueError(
                f"SPSTable batch_tokens must be >= 1 (a step verifies at least one token), got {b[0]}."
            )
        for prev, cur in zip(b, b[1:], strict=False):
            if cur == prev:
                raise ValueError(
                    f"SPSTable batch_tokens has duplicate B={cur}; keep one measurement per batch size."
                )
            if cur < prev:
                raise ValueError(
                    f"SPSTable batch_tokens must be strictly increasing, got {prev} before {cur}; "
                    "sort the table by B."
                )
        for bt, sps_b in zip(b, s, strict=True):
            if not (math.isfinite(sps_b) and sps_b > 0):
                raise ValueError(
                    f"SPSTable steps_per_second must be finite and > 0, got {sps_b!r} at B={bt}; "
                    "re-measure that point."
                )
        object.__setattr__(self, "batch_tokens", b)
        object.__setattr__(self, "steps_per_second", s)
        object.__setattr__(self, "meta", dict(self.meta) if self.meta is not None else {})
        object.__setattr__(self, "_b", np.asarray(b, dtype=np.float64))
        object.__setattr__(self, "_t", 1.0 / np.asarray(s, dtype=np.float64))

    def step_time(self, b: int) -> float:
        """Seconds per engine step at B batch tokens, t(B) = 1 / SPS(B) (lookup rule in the class doc)."""
        return float(self._step_time_array(np.asarray([b], dtype=np.float64))[0])

    def __call__(self, b: int) -> float:
        """SPS(B), engine steps per second at B batch tokens (lookup rule in the class doc)."""
        return 1.0 / self.step_time(b)

    def step_times(self, b) -> np.ndarray:
        """Vectorised t(B) for an array of batch sizes (same rule as `step_time`)."""
        return self._step_time_array(np.asarray(b, dtype=np.float64))

    def _step_time_array(self, b: np.ndarray) -> np.ndarray:
        """Vectorised t(B) for an array of batch sizes (same rule as `step_time`)."""
        b = np.asarray(b, dtype=np.float64)
        if b.size and not np.all(b >= 1):
            bad = b[~(b >= 1)][0]
            raise ValueError(f"SPS(B) is defined for B >= 1 batch tokens, got B={bad}.")
        t = np.interp(b, self._b, self._t)  # clamps to t(B_min) below the table
        b_max, t_max = self._b[-1], self._t[-1]
        return np.where(b > b_max, t_max * b / b_max, t)

    def _sps_array(self, b: np.ndarray) -> np.ndarray:
        """Vectorised SPS(B)."""
        return 1.0 / self._step_time_array(b)

    MONOTONE_FIT = "isotonic (step time non-decreasing in B)"  # meta["fit"] of a `monotone` table

    def monotone(self) -> SPSTable:
        """The least-squares fit of the step times that never decreases with B (isotonic
        regression, pool-adjacent-violators), as a new table.

        A measured curve is noisy (a shared VM drifts by ±10% within minutes) and a noisy dip —
        B = 3 measured faster than B = 2 — tells the scheduler that verifying one more token is
        free. A step that carries more tokens is never cheaper, so the scheduler reads the
        monotone fit; `meta["fit"]` says so."""
        blocks: list[list[float]] = []  # [sum, count] of pooled step times
        for t in self._t:
            blocks.append([float(t), 1.0])
            while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
                s, n = blocks.pop()
                blocks[-1][0] += s
                blocks[-1][1] += n
        fitted = [s / n for s, n in blocks for _ in range(int(n))]
        return SPSTable.from_step_times(self.batch_tokens, fitted, {**self.meta, "fit": self.MONOTONE_FIT})

    @classmethod
    def from_step_times(
        cls, batch_tokens: Sequence[int], seconds: Sequence[float], meta: dict | None = None
    ) -> SPSTable:
        """Build a table from measured seconds per step (SPS = 1 / seconds)."""
        secs = [float(v) for v in seconds]
        for bt, v in zip(batch_tokens, secs, strict=False):
            if not (math.isfinite(v) and v > 0):
                raise ValueError(
                    f"step time must be finite and > 0 seconds, got {v!r} at B={bt}; re-measure it."
                )
        return cls(tuple(batch_tokens), tuple(1.0 / v for v in secs), dict(meta or {}))

    @classmethod
    def from_dict(cls, d: dict) -> SPSTable:
        """Inverse of `to_dict`: {"batch_tokens": [...], "steps_per_second": [...], "meta": {...}}."""
        missing = [k for k in ("batch_tokens", "steps_per_second") if k not in d]
        if missing:
            raise ValueError(
                f"SPS table dict lacks {missing}; expected keys 'batch_tokens', 'steps_per_second' "
                "and optionally 'meta'."
            )
        return cls(tuple(d["batch_tokens"]), tuple(d["steps_per_second"]), dict(d.get("meta") or {}))

    def to_dict(self) -> dict:
        """JSON-ready dict; `from_dict(t.to_dict()) == t`."""
        return {
            "batch_tokens": list(self.batch_tokens),
            "steps_per_second": list(self.steps_per_second),
            "meta": dict(self.meta),
        }

    @classmethod
    def from_json(cls, path: str | PathLike) -> SPSTable:
        """Load a table written by `to_json`."""
        with Path(path).open(encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def to_json(self, path: str | PathLike) -> None:
        """Write the table as JSON (floats round-trip exactly)."""
        with Path(path).open("w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")


def measure_sps(
    step: Callable[[int], object],
    sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
    repeats: int = 3,
    meta: dict | None = None,
) -> SPSTable:
    """A quick SPS(B) table: `step(B)` runs one target step of B batch tokens; each size is run
    once to warm up, then timed `repeats` times (the fastest counts); the table is the monotone
    fit. Used where perf_analyzer's sweep (`dspark sps`) has not been run: at server start
    through the target's probe entry, and in-process with a runner."""
    secs = []
    for b in sizes:
        step(b)
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            step(b)
            best = min(best, time.perf_counter() - t)
        secs.append(best)
    return SPSTable.from_step_times(list(sizes), secs, dict(meta or {})).monotone()
