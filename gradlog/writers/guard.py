"""Writer trouble must never kill, block or hang a training run.

Every writer that does not ask to be called inline (`Writer.inline`: fast, or with a thread of its own) runs
behind a bounded queue on a background thread (a `Lane`, writers/lanes.py, the one such mechanism): the
training thread only enqueues. A writer whose call has run longer than `timeout` seconds, or whose queue
is full, has fallen behind: one warning, and its records are dropped and counted (`dropped`) until it
catches up. `close()` waits at most `timeout` seconds per writer. Errors are warned about once per writer
and call, on the training thread; `strict=True` calls every writer inline and raises the first error
instead (tests, CI).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gradlog.measure.histogram import Histogram, Histograms
from gradlog.measure.once import WarnOnce, warn
from gradlog.writers.base import Writer
from gradlog.writers.lanes import Lane

log = logging.getLogger("gradlog")

#: Seconds a writer call may run before the writer counts as behind, and close() waits per writer.
DEFAULT_TIMEOUT_S = 10.0
#: Seconds close() waits for a writer that kept up (finishing a W&B run takes a few seconds).
CLOSE_GRACE_S = 30.0
#: Calls (one step's scalars, one histogram, one table, a flush) that may wait for a writer's thread.
DEFAULT_MAX_QUEUE = 4096

#: `sync()`: a single call running longer than this means the writer is slow, and nobody waits for it.
SYNC_PATIENCE_S = 0.5


def _records(n: int, verb: str) -> str:
    """ "1 record was lost" / "3 records were lost": a count, its noun and its verb agreeing."""
    return f"{n} record was {verb}" if n == 1 else f"{n} records were {verb}"


def _warn(msg: str) -> None:
    warn(msg, stacklevel=5)


class _Lane(Lane):
    """One writer behind its own lane: an item is one call (`(what, call)`), done alone and in order."""

    def __init__(self, writer: Writer, max_queue: int, timeout: float) -> None:
        super().__init__(f"gradlog-writer-{type(writer).__name__}", max_queue, timeout)
        self.writer = writer
        self.errors: list[tuple[str, Exception]] = []  # appended by the thread, warned by the caller
        self.warned = False  # about falling behind (once per run)

    def consume(self, items: list[Any], durable: bool) -> None:
        for _what, call in items:
            call(self.writer)

    def failed(self, items: list[Any], exc: Exception) -> None:
        self.errors.append((items[0][0], exc))

    def weight(self, item: Any) -> int:
        """A record call is a record lost when dropped; a flush or close is not."""
        return 1 if item[0].startswith("log_") else 0

    def label(self, item: Any) -> str:
        return str(item[0])

    def fell_behind(self, why: str) -> None:
        if not self.warned:
            self.warned = True
            _warn(
                f"gradlog: {type(self.writer).__name__} is falling behind ({why}); training does not wait for it, "
                "its records are dropped and counted until it catches up"
            )

    def close_by(self, deadline: float) -> None:
        """Close the lane (a writer's own close() is waited for until `deadline`); warn about what is lost."""
        lost = self.close(deadline, patient_with="close")
        if lost is not None:
            _warn(
                f"gradlog: {type(self.writer).__name__} did not finish in time at close(); "
                f"{_records(lost, 'lost')} (still queued or in progress; dropped={self.dropped})"
            )


def _tell(note: Callable[[int], object], n: int) -> Callable[[Writer], object]:
    """A queued call that hands `n` to `note` on the writer's thread."""
    return lambda _w: note(n)


class GuardedWriters(Writer):
    """Fans out to several writers; a failing one is warned about once and the others go on.

    Writers with `inline = True` (TensorBoard: a lane of its own, batching its file writes; memory) are
    called inline; every other writer behind its own queue and thread (see the module docstring).
    With `strict=True` every writer is called inline and the first error is raised (tests, CI).
    """

    inline = True

    def __init__(
        self,
        writers: Sequence[Writer],
        strict: bool = False,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_queue: int = DEFAULT_MAX_QUEUE,
    ) -> None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"the writer timeout must be a number of seconds > 0, got {timeout!r}")
        self.writers = list(writers)
        self.strict = strict
        self.timeout = float(timeout)
        self._warned = WarnOnce()
        self._lanes: dict[int, _Lane] = {}
        if not strict:
            for w in self.writers:
                if not w.inline:
                    self._lanes[id(w)] = _Lane(w, max_queue, self.timeout)

    @property
    def dropped(self) -> int:
        """Records lost so far: by writers that fell behind, and by writers that count their own (TensorBoard)."""
        own = sum(self._own_dropped(w) for w in self.writers if id(w) not in self._lanes)
        return own + sum(lane.dropped for lane in self._lanes.values())

    def _own_dropped(self, w: Writer) -> int:
        """A writer's own count of lost records; one that fails to say (a property of one's own writer raising) is
        warned about once and counts 0: asking it made close() raise after the report had been printed."""
        try:
            return int(w.dropped)
        except Exception as exc:
            self._failed(w, "dropped", exc)
            return 0

    def _failed(self, w: Writer, what: str, exc: Exception) -> None:
        if self.strict:
            raise exc
        self._warned(
            (id(w), what),
            f"gradlog: {type(w).__name__}.{what} failed ({type(exc).__name__}: {exc}); "
            "training continues, further errors of this kind are not shown",
            stacklevel=4,
        )

    def _report_lane_errors(self) -> None:
        for lane in self._lanes.values():
            while lane.errors:
                what, exc = lane.errors.pop(0)
                self._failed(lane.writer, what, exc)

    def _each(self, what: str, call: Callable[[Writer], object], wait: float = 0.0) -> None:
        self._report_lane_errors()
        for w in self.writers:
            lane = self._lanes.get(id(w))
            if lane is not None:
                lane.submit((what, call), wait)
                continue
            try:
                call(w)
            except Exception as exc:
                self._failed(w, what, exc)
            except SystemExit as exc:  # a backend's sys.exit ended the training script (Ctrl-C still does)
                self._failed(w, what, RuntimeError(f"it raised SystemExit({exc})"))

    def log_scalars(self, scalars: Mapping[str, float], step: int) -> None:
        self._each("log_scalars", lambda w: w.log_scalars(scalars, step))

    def log_histogram(self, tag: str, hist: Histogram, step: int) -> None:
        self._each("log_histogram", lambda w: w.log_histogram(tag, hist, step))

    def log_histograms(self, tags: Sequence[str], hists: Histograms, step: int) -> None:
        """One queued call per writer for the whole block (not one closure per histogram)."""
        self._each("log_histograms", lambda w: w.log_histograms(tags, hists, step))

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
        self._each("log_table", lambda w: w.log_table(name, columns, rows))

    def log_image(self, tag: str, png: bytes, step: int) -> None:
        self._each("log_image", lambda w: w.log_image(tag, png, step))

    def flush(self) -> None:
        """Flush every writer; wait for the `ordered` writers' threads to have sent the step, so that their
        backend never sees gradlog's calls interleaved with the training thread's. Bounded by `timeout`,
        the time after which one call counts as fallen behind (not waited for until it has caught up), not
        by `sync()`'s patience: a W&B thread paused 0.58 s in one call (a full garbage collection of the
        process, on a loaded machine) was left running beside the user's next `run.log`, and a row was lost."""
        self._each("flush", lambda w: w.flush())
        ordered = [lane for lane in self._lanes.values() if lane.writer.ordered]
        if ordered:
            deadline = time.monotonic() + self.timeout
            for lane in ordered:
                lane.sync(deadline, self.timeout)
            self._report_lane_errors()

    def sync(self, patience: float = SYNC_PATIENCE_S) -> None:
        """Return once the writers on background threads have done every call made so far, so that what
        was logged is in their backends' hands (a W&B run's service process) before a kill -9 could lose
        it. Bounded: at most `timeout` seconds in all, and no wait at all for a writer that fell behind or
        whose current call has run longer than `patience`. The logger calls it after a provisional table
        (at most once per `provisional_every`)."""
        deadline = time.monotonic() + self.timeout
        for lane in self._lanes.values():
            lane.sync(deadline, patience)
        self._report_lane_errors()

    def close(self) -> None:
        """Close every writer; one that does not finish within `timeout` seconds is left behind, counted.

        A writer on a background thread that had records dropped is told first (`Writer.record_dropped`:
        the W&B writer keeps the count in its run summary, `gradlog/dropped_records`)."""
        start = time.monotonic()

        def left() -> float:  # a full queue (a writer catching up) may take these calls within `timeout` s in all
            return max(0.0, start + self.timeout - time.monotonic())

        for lane in self._lanes.values():
            if lane.dropped:
                lane.submit(("record_dropped", _tell(lane.writer.record_dropped, lane.dropped)), left())
        self._each("close", lambda w: w.close(), left())
        for lane in self._lanes.values():
            # a writer that kept up gets time to finish its run (W&B's finish() waits for wandb-core);
            # one that fell behind, or whose record call runs longer than `timeout`, does not
            wait = self.timeout if lane.behind else max(self.timeout, CLOSE_GRACE_S)
            lane.close_by(start + wait)
        self._report_lane_errors()
        if self.dropped:
            msg = f"gradlog: {_records(self.dropped, 'dropped')} during this run (slow, stalled or failing writers)"
            log.warning(msg)

    def after_fork(self) -> None:
        """In a forked child: forget the parent's writers without touching their files or threads."""
        for w in self.writers:
            w.after_fork()
        self.writers = []
        self._lanes = {}
