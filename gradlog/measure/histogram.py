"""`Histogram`: precomputed fixed-width buckets, the value writers receive."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

MAX_BINS = 512
#: rows `Histograms.values` reads out of its blocks at once: a few tens of kB of Python numbers at 64 bins
_CHUNK_ROWS = 64


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
        """Build from a `bucketing.histogram_partials` row (counts, min, max, sum, sum of squares, non-finite)."""
        bins = len(row) - 5
        counts = tuple(map(float, row[:bins]))  # C-level loops: thousands of these per logged step
        if counts and min(counts) < 0:
            counts = tuple(max(c, 0.0) for c in counts)
        return cls._of(counts, row[bins:])

    @classmethod
    def _of(cls, counts: tuple[float, ...], moments: Sequence[float]) -> Histogram:
        """From counts already floats and >= 0, and the 5 moments (min, max, sum, sum of squares, non-finite)."""
        lo, hi, s, s2, nf = map(float, moments)
        count = round(sum(counts))
        if count == 0:
            lo = hi = s = s2 = 0.0
        return cls(counts, lo, hi, s, s2, count, round(nf))


class Histograms(Mapping[int, Histogram]):
    """One kind's histograms of one measured step, kept as host blocks (bucket counts [n, bins] and moments
    [n, 5]: min, max, sum, sum of squares, NaN/Inf count) until a writer asks for them: `Histogram` objects
    (a tuple of Python floats each, ~2 KB at 64 bins) are built one at a time and dropped after use. A
    model of 5,000 tensors has 15,000 histograms per step; built all at once and held in the writer
    queues, they were most of a measured step's extra memory.

    A read-only mapping from a tensor's row in the measurement to its `Histogram`, in row order.
    """

    __slots__ = ("_index", "counts", "moments", "positions")

    def __init__(self, partials: torch.Tensor, positions: Sequence[int]) -> None:
        """From a `bucketing.histogram_partials` block [len(positions), bins + 5] (views of it are kept)."""
        if partials.dim() != 2 or partials.shape[0] != len(positions) or partials.shape[1] < 5:
            raise ValueError(f"partials must be [len(positions), bins + 5], got {tuple(partials.shape)}")
        block = partials.detach().to("cpu", torch.float64)
        self.counts = block[:, :-5]
        self.moments = block[:, -5:]
        self.positions = list(positions)
        self._index: dict[int, int] | None = None

    @classmethod
    def of(cls, counts: torch.Tensor, moments: torch.Tensor, positions: Sequence[int]) -> Histograms:
        """From `bucketing.host_histograms`' counts (integers or floats) and float64 moments, kept as they are."""
        n = len(positions)
        if counts.dim() != 2 or counts.shape[0] != n or tuple(moments.shape) != (n, 5):
            raise ValueError(
                f"counts must be [{n}, bins] and moments [{n}, 5], got {tuple(counts.shape)} and {tuple(moments.shape)}"
            )
        out = cls.__new__(cls)
        out.counts, out.moments = counts.detach().cpu(), moments.detach().to("cpu", torch.float64)
        out.positions = list(positions)
        out._index = None
        return out

    @property
    def bins(self) -> int:
        return int(self.counts.shape[1])

    def __len__(self) -> int:
        return len(self.positions)

    def __iter__(self) -> Iterator[int]:
        return iter(self.positions)

    def _row(self, i: int) -> Histogram:
        return Histogram.from_partials(self.counts[i].tolist() + self.moments[i].tolist(), 0)

    def __getitem__(self, pos: int) -> Histogram:
        if self._index is None:
            self._index = {p: i for i, p in enumerate(self.positions)}
        return self._row(self._index[pos])

    def values(self) -> Iterator[Histogram]:  # type: ignore[override]
        """Each histogram in row order, built as it is reached. The blocks are read out _CHUNK_ROWS rows at a time:
        one `tolist` per chunk instead of a tensor index and a `tolist` per row and block, and the counts come out
        as floats, checked for negatives once per chunk (a TensorBoard or memory writer builds every row of
        every step: ~8.5 -> ~3 us a row)."""
        for start in range(0, len(self.positions), _CHUNK_ROWS):
            block = self.counts[start : start + _CHUNK_ROWS]
            moments = self.moments[start : start + _CHUNK_ROWS].tolist()
            if bool((block < 0).any()):  # never from gradlog's own blocks: from_partials clamps, row by row
                yield from (Histogram.from_partials(c + m, 0) for c, m in zip(block.tolist(), moments))
                continue
            # counts read out as Python floats in one call (integers below 2**53: the same floats `float` makes)
            for c, m in zip(block.double().tolist(), moments):
                yield Histogram._of(tuple(c), m)

    def items(self) -> Iterator[tuple[int, Histogram]]:  # type: ignore[override]
        return zip(self.positions, self.values())

    def rows(self, start: int, stop: int) -> Histograms:
        """Rows `start:stop` (views of the same blocks): writers hand a big step on in pieces."""
        return Histograms.of(self.counts[start:stop], self.moments[start:stop], self.positions[start:stop])

    def only(self, keep: Sequence[bool]) -> Histograms:
        """The histograms of the rows whose position `p` has `keep[p]` true."""
        at = [i for i, p in enumerate(self.positions) if keep[p]]
        return Histograms.of(self.counts[at], self.moments[at], [self.positions[i] for i in at])
