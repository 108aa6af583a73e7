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
    and is called on the training thread.

    Everything else gradlog asks a writer is declared here with a default, so a writer implements only
    what its backend has: drops it counts itself (`dropped`), being told of drops (`record_dropped`), a
    fork (`after_fork`), where its files went (`where`), and a resumed run (`run_id`, `resume_dir`,
    `continue_run`).
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

    # --- what the guard, the lifecycle and publishing ask; each has a default --------------------
    @property
    def dropped(self) -> int:
        """Records this writer lost on its own (an `inline` writer with a queue of its own: TensorBoard's
        lane). The records the guard drops for a writer that fell behind are counted by the guard. 0 here."""
        return 0

    def record_dropped(self, n: int) -> None:  # noqa: B027 - optional: a backend that can keep the count
        """At close, on the writer's thread: `n` of its records were dropped while it fell behind. A writer
        whose run can keep the count says so there (W&B: `gradlog/dropped_records` in the run summary)."""

    def after_fork(self) -> None:  # noqa: B027 - optional: only a writer with files, threads or a run
        """In a forked child, which writes nothing: forget the parent's files, threads and runs without
        touching them (never wait for a thread that did not come along)."""

    def where(self) -> str | None:
        """One line saying where this run's files went and the command that reads them back, printed at
        close before the report; None (here) for a writer that leaves no files."""
        return None

    # --- a resumed run (`Output(resume=...)`) ----------------------------------------------------
    @property
    def run_id(self) -> str | None:
        """The id of the run this writer writes, where its backend has one (TensorBoard: the mark in its
        event files' names; W&B: the run's id): every segment of a resumed run writes under the same id,
        and a backend that continues a run by its id (W&B: `wandb.init(id=...)`) is checked against it.
        None (here) for a writer without runs."""
        return None

    @property
    def resume_dir(self) -> str | None:
        """The folder whose event files (the run format's TensorBoard framing) hold the earlier run this
        writer continues with `continue_run` (TensorBoard: its `log_dir`). None (here) for a writer that
        cannot, or that continues a run by its id instead (W&B)."""
        return None

    def continue_run(self, run: str) -> None:
        """Write on as the earlier run `run` found in `resume_dir`, before the first record. Called only
        on a writer with a `resume_dir`."""
        raise NotImplementedError(f"{type(self).__name__} has no resume_dir, so it cannot continue a run")
