"""`MemoryWriter`: keeps everything in Python dicts, for tests and notebooks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gradlog.measure.histogram import Histogram
from gradlog.writers.base import Writer


class MemoryWriter(Writer):
    """`scalars[tag] = [(step, value), ...]`, `histograms[tag] = [(step, Histogram), ...]`,
    `tables[name] = (columns, rows)`, `images[tag] = [(step, png_bytes), ...]`."""

    inline = True  # dicts in memory: called inline, so what log() published is there when it returns

    def __init__(self) -> None:
        self.scalars: dict[str, list[tuple[int, float]]] = {}
        self.histograms: dict[str, list[tuple[int, Histogram]]] = {}
        self.tables: dict[str, tuple[list[str], list[list[str]]]] = {}
        self.images: dict[str, list[tuple[int, bytes]]] = {}
        self.closed = False

    def log_scalars(self, scalars: Mapping[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self.scalars.setdefault(tag, []).append((step, float(value)))

    def log_histogram(self, tag: str, hist: Histogram, step: int) -> None:
        self.histograms.setdefault(tag, []).append((step, hist))

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
        self.tables[name] = (list(columns), [list(r) for r in rows])

    def log_image(self, tag: str, png: bytes, step: int) -> None:
        self.images.setdefault(tag, []).append((step, bytes(png)))

    def close(self) -> None:
        self.closed = True

    def last(self, tag: str) -> float:
        """The latest value of a scalar tag."""
        return self.scalars[tag][-1][1]
