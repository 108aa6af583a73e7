"""`Histogram`: precomputed fixed-width buckets, the value writers receive."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

MAX_BINS = 512


@dataclass(frozen=True)
class Histogram:
    """Buckets of the finite values of one tensor at one step.

    `counts[i]` counts values in `[edges[i], edges[i+1])` (the last bucket is closed).
    `count` is the number of finite values; NaN/Inf are only counted, in `nonfinite`.
    """

    counts: tuple[float, ...]
    min: float
    max: float
    sum: float
    sum_squares: float
    count: int
    nonfinite: int

    @property
    def bins(self) -> int:
        return len(self.counts)

    @property
    def edges(self) -> tuple[float, ...]:
        """bins + 1 increasing edges. A constant tensor gets a tiny bucket that starts at its value."""
        lo, hi = self.min, self.max
        if not hi > lo:
            hi = lo + max(abs(lo), 1.0) * 1e-6
        step = (hi - lo) / self.bins
        return tuple([lo + i * step for i in range(self.bins)] + [hi])

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else math.nan

    @classmethod
    def from_partials(cls, row: Sequence[float], numel: int) -> Histogram:
        """Build from a `stats.histogram_partials` row (counts, min, max, sum, sum of squares, non-finite)."""
        bins = len(row) - 5
        counts = tuple(map(float, row[:bins]))  # C-level loops: thousands of these per logged step
        if counts and min(counts) < 0:
            counts = tuple(max(c, 0.0) for c in counts)
        lo, hi, s, s2, nf = (float(v) for v in row[bins:])
        count = round(sum(counts))
        if count == 0:
            lo = hi = s = s2 = 0.0
        return cls(counts, lo, hi, s, s2, count, round(nf))
