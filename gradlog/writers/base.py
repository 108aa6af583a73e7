"""The one interface every backend implements."""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence

from gradlog.measure.histogram import Histogram


class Writer(abc.ABC):
    """Where gradlog's numbers go. Subclass it to send them anywhere.

    `step` is the x-axis value the user passed to `log(step)`. Tables arrive once, at close.
    """

    @abc.abstractmethod
    def log_scalars(self, scalars: Mapping[str, float], step: int) -> None:
        """All scalar tags of one measured step, in one call so backends can batch them."""

    @abc.abstractmethod
    def log_histogram(self, tag: str, hist: Histogram, step: int) -> None:
        """One precomputed histogram."""

    @abc.abstractmethod
    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
        """A small table of strings (the never-updated report, the run summary)."""

    def log_image(self, tag: str, png: bytes, step: int) -> None:  # noqa: B027 - optional: images are extra
        """One PNG image (the overview heatmap). Writers that cannot show images ignore it."""

    def flush(self) -> None:  # noqa: B027 - optional for backends that write through
        """Make everything logged so far durable."""

    def close(self) -> None:
        """Release files and runs; called once by `GradLogger.close()`."""
        self.flush()
