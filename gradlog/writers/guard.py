"""Writer trouble must never kill, block or hang a training run.

Every writer that does not ask to be called inline (`Writer.inline`: fast, or with a thread of its own) runs behind a
bounded queue on a background thread: the training thread only enqueues. A writer whose call has run
longer than `timeout` seconds, or whose queue is full, has fallen behind: one warning, and its records
are dropped and counted (`dropped`) until it catches up. `close()` waits at most `timeout` seconds per
writer. Errors are warned about once per writer and call, on the training thread; `strict=True` calls
every writer inline and raises the first error instead (tests, CI).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gradlog.measure.histogram import Histogram, Histograms
from gradlog.measure.once import WarnOnce, warn
from gradlog.writers.base import Writer

log = logging.getLogger("gradlog")

#: Seconds a writer call may run before the writer counts as behind, and close() waits per writer.
DEFAULT_TIMEOUT_S = 10.0
#: Seconds close() waits for a writer that kept up (finishing a W&B run takes a few seconds).
CLOSE_GRACE_S = 30.0
#: Calls (one step's scalars, one histogram, one table, a flush) that may wait for a writer's thread.
DEFAULT_MAX_QUEUE = 4096

#: `sync()`: a single call running longer than this means the writer is slow, and nobody waits for it.
SYNC_PATIENCE_S = 0.5

_Call = tuple[str, Callable[[Writer], object]]
_STOP: _Call = ("stop", lambda w: None)


def _warn(msg: str) -> None:
    warn(msg, stacklevel=5)


class _Lane:
    """One writer, its queue and its thread. The thread starts at the first call."""

    def __init__(self, writer: Writer, max_queue: int, timeout: float) -> None:
        self.writer = writer
        self.timeout = timeout
        self.queue: queue.Queue[_Call] = queue.Queue(maxsize=max_queue)
        self.thread: threading.Thread | None = None
        self.inline = False  # no thread could be started (interpreter shutdown): call in the caller
        self.busy_since: float | None = None  # monotonic start of the call in progress
        self.busy_what = ""  # which call that is
        self.errors: list[tuple[str, Exception]] = []  # appended by the thread, warned by the caller
        self.dropped = 0
        self.behind = False  # dropping records now: set on a drop, cleared once it has caught up
        self.warned = False  # about falling behind (once per run)

    def _run(self) -> None:
        while True:
            what, call = self.queue.get()
            if what == "stop":
                return
            self.busy_what = what
            self.busy_since = time.monotonic()
            try:
                call(self.writer)
            except Exception as exc:
                self.errors.append((what, exc))
            finally:
                self.busy_since = None

    def _start(self) -> None:
        name = f"gradlog-writer-{type(self.writer).__name__}"
        t = threading.Thread(target=self._run, name=name, daemon=True)
        try:
            t.start()
            self.thread = t
        except RuntimeError:  # "can't create new thread at interpreter shutdown"
            self.inline = True

    def submit(self, what: str, call: Callable[[Writer], object], wait: float = 0.0) -> None:
        """Queue `call` for the writer's thread; `wait` > 0 (close() only) waits that long for room in a full
        queue instead of dropping the call at once."""
        if self.thread is None and not self.inline:
            self._start()
        if self.inline:
            try:
                call(self.writer)
            except Exception as exc:
                self.errors.append((what, exc))
            return
        since = self.busy_since
        if since is not None and time.monotonic() - since > self.timeout:
            self._drop(f"one call has run for more than {self.timeout:g} s")
            return
        if self.behind and since is None and self.queue.empty():
            self.behind = False  # caught up: syncs wait for it again
        try:
            if wait > 0:
                self.queue.put((what, call), timeout=wait)
            else:
                self.queue.put_nowait((what, call))
        except queue.Full:
            self._drop(f"{self.queue.maxsize} calls are waiting for it")

    def _drop(self, why: str) -> None:
        self.dropped += 1
        self.behind = True
        if not self.warned:
            self.warned = True
            _warn(
                f"gradlog: {type(self.writer).__name__} is falling behind ({why}); training does not wait for it, "
                "its records are dropped and counted until it catches up"
            )

    def sync(self, deadline: float, patience: float) -> None:
        """Wait until the thread has done every call queued so far; give up at `deadline`, or as soon as
        one call has run longer than `patience` (a slow writer is not waited for: it would block training)."""
        t = self.thread
        if t is None or not t.is_alive() or self.behind:
            return
        done = threading.Event()
        try:
            self.queue.put_nowait(("sync", lambda w: done.set()))
        except queue.Full:
            return
        while not done.wait(0.01):
            since = self.busy_since
            now = time.monotonic()
            if now >= deadline or (since is not None and now - since > patience) or not t.is_alive():
                return

    def close(self, deadline: float) -> None:
        """Let the thread finish what is queued, up to `deadline` (monotonic); count what it could not."""
        t = self.thread
        if t is None or not t.is_alive():
            return
        try:
            self.queue.put(_STOP, timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            pass
        while t.is_alive() and time.monotonic() < deadline:
            since = self.busy_since
            if since is not None and self.busy_what != "close" and time.monotonic() - since > self.timeout:
                break  # stuck in a record call: waiting longer would only delay the end of the run
            t.join(0.05)
        if t.is_alive():
            with self.queue.mutex:  # what the thread will never get to: records, not flush/close/stop markers
                left = sum(1 for what, _ in self.queue.queue if what.startswith("log_"))
            lost = left + (1 if self.busy_since is not None else 0)  # the call in progress is lost too
            self.dropped += lost
            _warn(
                f"gradlog: {type(self.writer).__name__} did not finish in time at close(); "
                f"{lost} record(s) still queued or in progress are lost (dropped={self.dropped})"
            )


def _tell(note: Callable[[int], object], n: int) -> Callable[[Writer], object]:
    """A queued call that hands `n` to `note` on the writer's thread."""
    return lambda _w: note(n)


class GuardedWriters(Writer):
    """Fans out to several writers; a failing one is warned about once and the others go on.

    Writers with `inline = True` (TensorBoard: its own writer thread with bounded waits; memory) are
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
                if not (getattr(w, "inline", False) or getattr(w, "threaded", False)):  # threaded: the old name
                    self._lanes[id(w)] = _Lane(w, max_queue, self.timeout)

    @property
    def dropped(self) -> int:
        """Records lost so far: by writers that fell behind, and by writers that count their own (TensorBoard)."""
        own = sum(int(getattr(w, "dropped", 0) or 0) for w in self.writers if id(w) not in self._lanes)
        return own + sum(lane.dropped for lane in self._lanes.values())

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
                lane.submit(what, call, wait)
                continue
            try:
                call(w)
            except Exception as exc:
                self._failed(w, what, exc)

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
        self._each("flush", lambda w: w.flush())

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

        A writer on a background thread that had records dropped, and can keep the count in its run
        (`record_dropped(n)`, the W&B writer: `gradlog/dropped_records` in the run summary), is told first."""
        start = time.monotonic()

        def left() -> float:  # a full queue (a writer catching up) may take these calls within `timeout` s in all
            return max(0.0, start + self.timeout - time.monotonic())

        for lane in self._lanes.values():
            note: Any = getattr(lane.writer, "record_dropped", None)
            if lane.dropped and callable(note):
                lane.submit("record_dropped", _tell(note, lane.dropped), left())
        self._each("close", lambda w: w.close(), left())
        for lane in self._lanes.values():
            # a writer that kept up gets time to finish its run (W&B's finish() waits for wandb-core);
            # one that fell behind, or whose record call runs longer than `timeout`, does not
            wait = self.timeout if lane.behind else max(self.timeout, CLOSE_GRACE_S)
            lane.close(start + wait)
        self._report_lane_errors()
        if self.dropped:
            msg = f"gradlog: {self.dropped} record(s) were dropped during this run (slow, stalled or failing writers)"
            log.warning(msg)

    def after_fork(self) -> None:
        """In a forked child: forget the parent's writers without touching their files or threads."""
        for w in self.writers:
            hook: Any = getattr(w, "after_fork", None)
            if callable(hook):
                hook()
        self.writers = []
        self._lanes = {}
