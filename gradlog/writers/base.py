"""The one interface every backend implements."""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence

from gradlog.measure.histogram import Histogram, Histograms


class Writer(abc.ABC):
    """Where gradlog's numbers go. Subclass it to send them anywhere.

    `step` is the x-axis value the user passed to `log(step)`. Tables arrive at close (the final ones)
    and, marked `gradlog/provisional/...`, on histogram steps (the answer so far, for a run that dies).

    gradlog calls a writer from a background thread behind a bounded queue, so a slow one never stalls
    training; a writer that is fast or already hands its work to a thread of its own sets `inline = True`
    and is called on the training thread. (`threaded = True`, this flag's old name, is still read.)
    """

    inline: bool = False
    #: The backend is shared with the training thread's own calls (a W&B run, whose rows and step the
    #: user's `run.log` also moves): a step's calls must be done before `log()` returns, so that the two
    #: threads never log into it at once. The writer still runs on its thread, bounded as any other.
    ordered: bool = False

    @abc.abstractmethod
    def log_scalars(self, scalars: Mapping[str, float], step: int) -> None:
        """All scalar tags of one measured step, in one call so backends can batch them. At close (and with
        the provisional tables) a call of its own carries only the tables' counts (`gradlog/never_updated`,
        ...): a writer must not expect every tag in every call."""

    @abc.abstractmethod
    def log_histogram(self, tag: str, hist: Histogram, step: int) -> None:
        """One precomputed histogram."""

    def log_histograms(self, tags: Sequence[str], hists: Histograms, step: int) -> None:
        """One kind's histograms of one step, `tags[i]` naming the i-th; gradlog calls this, not
        `log_histogram`, so the step's histograms travel as one block. The default hands them to
        `log_histogram` one at a time, each built just before its call; override it to keep the block.
        """
        for tag, hist in zip(tags, hists.values()):
            self.log_histogram(tag, hist, step)

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
