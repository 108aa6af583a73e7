"""`Lane`: the one writer-queue mechanism, a bounded queue and one background thread in front of a writer.

Every writer gradlog calls off the training thread runs behind one: `GuardedWriters` gives each writer
that is not inline a lane of its own, and `TensorBoardWriter` keeps one for its file writing. The
training thread only enqueues; the lane's thread hands what is queued to `consume()`. A lane whose
current call has run longer than `timeout`, or whose queue stays full, has fallen behind: its records
are dropped and counted (`dropped`, weighed by `weight()`) until it has caught up, and `sync()` does
not wait for it. `close()` waits until a deadline, and counts what the thread never got to.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any


class _Marker:
    """A queued `sync()` or `close()`: the thread sets `done` once everything queued before it is done."""

    def __init__(self, stop: bool = False) -> None:
        self.stop = stop
        self.done = threading.Event()


class Lane:
    """One queue, one thread (started at the first item), and the counts of what it could not keep.

    Subclasses say what an item is: `consume()` does a batch of them, `weight()` counts the records in
    one, `label()` names it, `fell_behind()` is told (on the caller's thread) the first time and every
    time records start being dropped, and `stopped()` runs on the thread at `close()`."""

    #: Items handed to one `consume()` call: a writer that batches its output (TensorBoard) raises it.
    max_batch = 1

    def __init__(self, name: str, max_queue: int, timeout: float, put_wait: float = 0.0) -> None:
        self.name = name
        self.timeout = timeout  # a call running longer than this means the lane has fallen behind
        self.put_wait = put_wait  # seconds a caller waits for room in a full queue before dropping
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=max_queue)
        self.thread: threading.Thread | None = None
        self.inline = False  # no thread could be started (interpreter shutdown): consume in the caller
        self.busy_since: float | None = None  # monotonic start of the consume() call in progress
        self.busy_what = ""  # `label()` of the first item of that call
        self.busy_weight = 0  # records in that call
        self.dropped = 0
        self.behind = False  # dropping records now: set on a drop, cleared once it has caught up
        self.unsynced = False  # an item was submitted since the last sync()
        self._start_lock = threading.Lock()

    # --- what an item is: the subclass's side ---------------------------------------------------
    def consume(self, items: list[Any], durable: bool) -> None:
        """Do `items` in order, on the lane's thread; `durable`: a `sync()` or `close()` waits for them."""
        raise NotImplementedError

    def weight(self, item: Any) -> int:
        """Records `item` carries: what is counted in `dropped` when it is lost."""
        return 1

    def label(self, item: Any) -> str:
        return ""

    def failed(self, items: list[Any], exc: Exception) -> None:
        """`consume()` raised: keep the thread alive; the subclass reports it on the caller's thread."""

    def fell_behind(self, why: str) -> None:
        """Records are being dropped (`why`); called on the caller's thread."""

    def stopped(self) -> None:
        """The lane is closed: release what the consumer holds (on the thread, or the caller without one)."""

    # --- the thread ---------------------------------------------------------------------------
    def _take(self) -> list[Any]:
        """Block for one item, then take what else is queued, up to `max_batch` or a marker."""
        batch = [self.queue.get()]
        while len(batch) < self.max_batch and not isinstance(batch[-1], _Marker):
            try:
                batch.append(self.queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def _consume(self, items: list[Any], durable: bool) -> None:
        self.busy_what = self.label(items[0]) if items else ""
        self.busy_weight = sum(map(self.weight, items))
        self.busy_since = time.monotonic()
        try:
            self.consume(items, durable)
        except Exception as exc:  # a bug or a bad value must not kill the thread and hang sync()
            self.failed(items, exc)
        except BaseException as exc:  # SystemExit (a backend's sys.exit) ended the thread in silence: all later
            self.failed(items, RuntimeError(f"it raised {type(exc).__name__}({exc})"))  # records lost, unsaid
        finally:
            self.busy_since = None

    def _run(self) -> None:
        while True:
            batch = self._take()
            marker = batch.pop() if isinstance(batch[-1], _Marker) else None
            if batch or (marker is not None and not marker.stop):
                self._consume(batch, durable=marker is not None)
            if marker is not None:
                if marker.stop:
                    self.stopped()
                marker.done.set()
                if marker.stop:
                    return

    def _start(self) -> None:
        with self._start_lock:
            if self.thread is not None or self.inline:
                return
            t = threading.Thread(target=self._run, name=self.name, daemon=True)
            try:
                t.start()
                self.thread = t
            except RuntimeError:  # "can't create new thread at interpreter shutdown"
                self.inline = True

    # --- the caller's side ----------------------------------------------------------------------
    def submit(self, item: Any, wait: float | None = None) -> None:
        """Queue `item`; wait at most `wait` seconds (default `put_wait`, none while behind) for room in a
        full queue, else drop it. close() passes the time it has left."""
        if self.thread is None:
            self._start()
        if self.inline:
            self._consume([item], durable=False)
            return
        self.unsynced = True
        since = self.busy_since
        if since is not None and time.monotonic() - since > self.timeout:
            self._drop(item, f"one call has run for more than {self.timeout:g} s")
            return
        if self.behind:
            self.caught_up()
        if wait is None:
            wait = 0.0 if self.behind else self.put_wait
        if not self._put(item, wait):
            self._drop(item, f"{self.queue.maxsize} calls are waiting for it")

    def _put(self, item: Any, wait: float) -> bool:
        try:
            if wait > 0:
                self.queue.put(item, timeout=wait)
            else:
                self.queue.put_nowait(item)
        except queue.Full:
            return False
        return True

    def caught_up(self) -> bool:
        """Clear `behind` once the thread is idle with nothing queued; True unless still behind."""
        if self.behind and self.busy_since is None and self.queue.empty():
            self.behind = False
        return not self.behind

    def _drop(self, item: Any, why: str) -> None:
        self.dropped += self.weight(item)
        self.fall_behind(why)

    def fall_behind(self, why: str) -> None:
        """Stop waiting for the lane (and drop what does not fit its queue) until it has caught up."""
        self.behind = True
        self.fell_behind(why)

    def sync(self, deadline: float, patience: float) -> bool:
        """Wait until the thread has done every item submitted so far; give up at `deadline` (monotonic), or
        as soon as one call has run longer than `patience` (a slow writer would block training). True once
        done (or nothing to wait for); False when it gave up, or the lane is behind (not waited for until it
        has caught up)."""
        t = self.thread
        if t is None or not t.is_alive() or not self.unsynced:
            return True
        if not self.caught_up():
            return False
        marker = _Marker()
        if not self._put(marker, self.put_wait):
            return False
        self.unsynced = False
        while not marker.done.wait(0.01):
            since = self.busy_since
            now = time.monotonic()
            if now >= deadline or (since is not None and now - since > patience) or not t.is_alive():
                return False
        return True

    def close(self, deadline: float, patient_with: str | None = None) -> int | None:
        """Let the thread finish what is queued, up to `deadline` (monotonic). None once it has; else the
        records it will never get to (queued or in progress), added to `dropped`. A call that has run longer
        than `timeout` is not waited for, unless its label is `patient_with` (a writer's own close())."""
        t = self.thread
        if t is None or not t.is_alive():
            self.stopped()
            return None
        self._put(_Marker(stop=True), max(0.0, deadline - time.monotonic()))
        while t.is_alive() and time.monotonic() < deadline:
            since = self.busy_since
            if since is not None and self.busy_what != patient_with and time.monotonic() - since > self.timeout:
                break  # stuck in a record call: waiting longer would only delay the end of the run
            t.join(0.05)
        if not t.is_alive():
            return None
        with self.queue.mutex:  # what the thread will never get to (markers weigh nothing)
            left = sum(self.weight(item) for item in self.queue.queue if not isinstance(item, _Marker))
        lost = left + (self.busy_weight if self.busy_since is not None else 0)
        self.dropped += lost
        return lost
