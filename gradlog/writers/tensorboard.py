"""`TensorBoardWriter`: event files for `tensorboard --logdir runs`, written by a background thread.

The training thread only enqueues plain Python values, on a `Lane` (the queue and thread every
off-thread writer has). The lane's thread adds them to TensorBoard's own
protobuf messages, a step's values in few Event records, frames them (C CRC32C) and writes them with
one system call. `flush()` (the logger calls it after every published step) waits until that is done,
so a `kill -9` right after `log()` loses nothing already logged.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import socket
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

from gradlog.measure.histogram import Histogram, Histograms
from gradlog.measure.once import warn
from gradlog.runformat.names import GRAD_NORM_TOTAL, SUMMARY
from gradlog.writers.base import Writer
from gradlog.writers.lanes import Lane
from gradlog.writers.quiet import QuietNonfinite, tensor_names

log = logging.getLogger("gradlog")

#: Queue items: ("s", step, wall, [(tag, value)]), ("h", step, wall, (tag, Histogram)), ("t", step, wall, (tag, md)),
#: ("i", step, wall, (tag, png)), ("o", step, wall, [tensor names in model order]),
#: ("H", step, wall, (tags, Histograms)): up to _BLOCK_ROWS histograms of one step, built on the writer thread,
#: ("p", step, wall, (tag, tensor names, [(tag, value)])): a measured step's values, packed on the writer thread.
_Item = tuple[str, int, float, Any]
#: Histograms per "H" item, and values encoded before they are written: what the writer thread holds at once.
_BLOCK_ROWS = 256
_claimed: set[str] = set()  # default run folders handed out in this process
_writers = itertools.count(1)  # TensorBoardWriters made by this process


def default_log_dir(root: str = "runs") -> str:
    """`runs/<YYYYmmdd-HHMMSS>-<host>`, with a `-2`, `-3`... suffix if taken: one run folder per logger."""
    host = socket.gethostname().replace(os.sep, "_") or "localhost"
    base = os.path.join(root, f"{time.strftime('%Y%m%d-%H%M%S')}-{host}")
    path, n = base, 1
    while path in _claimed or os.path.exists(path):
        n += 1
        path = f"{base}-{n}"
    _claimed.add(path)
    return path


@dataclass
class _Sink:
    """The writer thread's side: the open event file, and the problems it has met (reported by the caller's thread)."""

    log_dir: str
    fsync: bool
    retry_secs: float
    format: Any  # the tb_format module, imported by the constructor
    run: str = ""  # in every event file's name: this writer's files, told apart from another run's
    file: Any = None  # tfrecord.EventFile
    retry_at: float = 0.0
    dropped: int = 0
    files: list[str] = field(default_factory=list)
    problems: list[tuple[str, str]] = field(default_factory=list)
    reported: set[str] = field(default_factory=set)
    kinds: set[str] = field(default_factory=set)  # of the problems kept: one each, as only the first is reported

    def problem(self, kind: str, message: str) -> None:
        """Keep the first problem of each kind (a stalled disk drops, and would add one, per record)."""
        if kind not in self.kinds:
            self.kinds.add(kind)
            self.problems.append((kind, message))

    def write(self, records: list[bytes], sync: bool) -> None:
        from gradlog.writers.tfrecord import EventFile, frames

        if self.file is not None and self.file.vanished():
            self.problem(
                "vanished",
                f"gradlog: the TensorBoard event file {self.file.path} was deleted while training; "
                f"writing continues in a new event file under {self.log_dir}",
            )
            self._drop_file()
        if time.monotonic() < self.retry_at:  # an outage: drop until the next retry
            self.dropped += len(records)
            return
        if self.file is None:
            try:
                self.file = EventFile(self.log_dir, self.run)
                self.files.append(self.file.path)
                records = self.format.header_events(time.time()) + records
            except OSError as exc:
                self._fail(exc, records)
                return
        try:
            self.file.write(frames(records))
            if sync and self.fsync:
                self.file.sync()
        except OSError as exc:
            self._fail(exc, records)

    def _fail(self, exc: OSError, records: list[bytes]) -> None:
        """Never append after a torn record: cut the file back to its last whole record and retry in it
        later (one event file per outage, a full disk say); a file that cannot be cut back, or that hit a
        file size limit (EFBIG: only a new file can go on), is left for a new one."""
        self.dropped += len(records)
        try:
            if self.file is None:
                raise OSError("no file")
            self.file.rewind()
            if exc.errno == errno.EFBIG:  # whole records only in this one, and the rest in a new one
                self._drop_file()
        except OSError:
            self._drop_file()
        self.retry_at = time.monotonic() + self.retry_secs
        self.problem(
            "io",
            f"gradlog: TensorBoard cannot write to {self.log_dir!r} ({type(exc).__name__}: {exc}); training "
            f"continues, records are dropped and writing is tried again every {self.retry_secs:g} s",
        )

    def _drop_file(self) -> None:
        f, self.file = self.file, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass

    def close(self) -> None:
        self._drop_file()

    def new_problems(self) -> list[str]:
        """One message per kind of problem, the first time it is seen."""
        out = []
        for kind, message in list(self.problems):
            if kind not in self.reported:
                self.reported.add(kind)
                out.append(message)
        return out


def _encode(fmt: Any, items: list[_Item]) -> list[bytes]:
    """Serialized Events: consecutive items of the same step share Events (up to MAX_VALUES_PER_EVENT values
    each).

    A text table is an Event of its own: a damaged record then loses one table, never the final
    summary (the verdict) together with the never-updated table written beside it."""
    out = fmt.Events()
    for kind, step, wall, payload in items:
        if kind == "s":
            out.scalars(step, wall, payload)
        elif kind == "H":
            out.histograms(step, wall, *payload)
        elif kind == "h":
            out.histogram(step, wall, *payload)
        elif kind == "i":
            out.value(step, wall, fmt.image_value(*payload))
        elif kind == "o":
            out.value(step, wall, fmt.order_value(payload))
        elif kind == "p":
            tag, names, pairs = payload
            out.value(step, wall, fmt.packed_value(tag, names, dict(pairs)))
        else:
            out.end()
            out.value(step, wall, fmt.text_value(*payload))
            out.end()
    out.end()
    records: list[bytes] = out.records
    return records


def _records(item: Any) -> int:
    """Records one queue item carries (a histogram block: one per histogram)."""
    return len(item[3][0]) if isinstance(item, tuple) and item[0] == "H" else 1


def _pieces(items: list[_Item]) -> list[list[_Item]]:
    """Consecutive runs of items of at most ~MAX_VALUES_PER_EVENT records: each is encoded and written
    before the next is built, so the thread never holds a whole step of serialized histograms at once."""
    out: list[list[_Item]] = [[]]
    size = 0
    for item in items:
        n = _records(item)
        if out[-1] and size + n > _BLOCK_ROWS * 4:
            out.append([])
            size = 0
        out[-1].append(item)
        size += n
    return out


def _write(sink: _Sink, items: list[_Item], durable: bool) -> None:
    """Encode and write queued items, a piece at a time; `durable`: fsync the last (with `fsync=True`)."""
    pending = sum(map(_records, items))
    try:
        pieces = _pieces(items) if items else [[]]
        for i, piece in enumerate(pieces):
            sink.write(_encode(sink.format, piece) if piece else [], sync=durable and i == len(pieces) - 1)
            pending -= sum(map(_records, piece))
    except Exception as exc:  # a bug or a bad value: counted and warned about, and the next batch goes on
        sink.dropped += pending
        sink.problem("error", f"gradlog: TensorBoard writing failed ({type(exc).__name__}: {exc}); training continues")


class _Lane(Lane):
    """The writer's queue and thread: takes whatever is queued (up to a flush) and writes it in one go.
    It holds the sink, never the writer, so an unreferenced writer is collected and closed."""

    max_batch = 4096

    def __init__(self, sink: _Sink, max_queue: int, timeout: float) -> None:
        super().__init__("gradlog-tensorboard", max_queue, timeout, put_wait=timeout)
        self.sink = sink

    def consume(self, items: list[Any], durable: bool) -> None:
        _write(self.sink, items, durable)

    def weight(self, item: Any) -> int:
        return _records(item)

    def label(self, item: Any) -> str:
        return "write"

    def fell_behind(self, why: str) -> None:
        self.sink.problem(
            "slow",
            f"gradlog: TensorBoard writing is more than {self.timeout:g} s behind (a slow or hung disk?); "
            "training continues without waiting for it, records that do not fit the queue (or come while a write is "
            "stuck) are dropped",
        )

    def stopped(self) -> None:
        self.sink.close()


def _emit(messages: list[str]) -> None:
    for message in messages:
        warn(message, stacklevel=3)


def _shutdown(lane: _Lane, timeout: float, emit: bool = True) -> None:
    """Drain and stop the writer thread, close the file. Runs once: from close(), on collection, or at exit."""
    lost = lane.close(time.monotonic() + timeout, patient_with="write")  # a slow write gets all of `timeout`
    if lost is not None:  # a stalled disk: what is still queued will never be written
        lane.sink.problem(
            "close",
            f"gradlog: TensorBoard writing did not finish within {timeout:g} s at close() (a stalled disk?); "
            f"{lost} queued {'record is' if lost == 1 else 'records are'} lost "
            f"(dropped={lane.dropped + lane.sink.dropped})",
        )
    if emit:
        _emit(lane.sink.new_problems())


class TensorBoardWriter(Writer):
    """Writes scalars, raw histograms, the custom-scalars layout and tables as TensorBoard event files.

    `log_dir` is one run folder (default `runs/<timestamp>-<host>`); every writer creates a new event
    file in it, so a restarted run never appends to an old, possibly torn, file. Nothing is created
    until the first value is logged.

    Options: `max_queue` items may wait for the writer thread; `flush_timeout` seconds bound how long
    `flush()` waits (after one timeout it stops waiting until the thread catches up); `fsync=True`
    also survives power loss, not only a killed process; after an I/O error a new event file is
    tried every `retry_secs`. Problems are warned about once each and never raise, unless
    `strict=True` (for CI): then `flush()` and `close()` raise RuntimeError with the same message.
    """

    inline = True  # a lane of its own (batched writes, flush() waits) and bounded waits: the logger calls it inline

    def __init__(
        self,
        log_dir: Union[str, os.PathLike[str], None] = None,
        *,
        max_queue: int = 10_000,
        flush_timeout: float = 60.0,
        fsync: bool = False,
        retry_secs: float = 30.0,
        strict: bool = False,
    ) -> None:
        try:
            from gradlog.writers import tb_format, tfrecord  # noqa: F401 - both need the extra
        except ImportError as exc:
            raise ImportError(
                f"TensorBoardWriter needs the tensorboard and crc32c packages ({exc}); "
                "install them with pip install 'gradlog[tensorboard]', or pass writer='memory'"
            ) from exc
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue!r}")
        if not flush_timeout > 0:
            raise ValueError(f"flush_timeout must be > 0 seconds, got {flush_timeout!r}")
        self.log_dir = os.fspath(log_dir) if log_dir is not None else default_log_dir()
        self.flush_timeout = float(flush_timeout)
        self.strict = strict
        #: In the name of every event file this writer creates (a second run into the same folder differs).
        self.run = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{next(_writers)}"
        self._sink = _Sink(self.log_dir, fsync, float(retry_secs), tb_format, run=self.run)
        self._lane = _Lane(self._sink, max_queue, self.flush_timeout)
        self._last_step = 0
        self._scalar_tags: set[str] = set()
        self._quiet = QuietNonfinite()
        self._order: dict[str, None] = {}
        self._verdict: str | None = None
        self._packed = 0
        self._last_len = -1
        self.closed = False
        self._finalizer = weakref.finalize(self, _shutdown, self._lane, self.flush_timeout)

    def continue_run(self, run: str) -> None:
        """Write under an earlier run's id (a resumed run: readers take both for one run). Before the
        first record only: the id is in the event file's name."""
        if self._sink.file is not None:
            raise RuntimeError("continue_run() after the first record: the event file is named already")
        self.run = self._sink.run = run

    @property
    def run_id(self) -> str:
        """The mark in this writer's event file names (`run`): a resumed run's segments share it."""
        return self.run

    @property
    def resume_dir(self) -> str:
        """The run folder: an earlier run of the same model in it is continued (`continue_run`)."""
        return self.log_dir

    def where(self) -> str:
        root = os.path.dirname(os.path.normpath(self.log_dir)) or "."
        return (
            f"gradlog: TensorBoard event files in {self.log_dir} "
            f"(view: tensorboard --logdir {root}; check: gradlog report {self.log_dir})"
        )

    @property
    def files(self) -> list[str]:
        """Event files written so far (more than one after the log dir vanished or a write failed)."""
        return list(self._sink.files)

    @property
    def dropped(self) -> int:
        """Records lost to I/O errors or a stalled disk (0 in a healthy run)."""
        return self._lane.dropped + self._sink.dropped

    # --- the training thread's side: enqueue only ---------------------------------------------
    def _put(self, item: _Item) -> None:
        if self.closed:
            raise RuntimeError("TensorBoardWriter is closed; create a new writer (a new run) to log again")
        self._lane.submit(item)

    def log_scalars(self, scalars: Mapping[str, float], step: int) -> None:
        """Per-tensor `weights/grad_nonfinite/` tags only once non-zero (see writers/quiet.py); new tensor names
        also rewrite the model-order record the gradlog tab sorts its rows by."""
        self._last_step = max(self._last_step, step)
        new = []
        if len(scalars) != self._last_len:  # new tensors bring new tags: skip the scan on ordinary steps
            self._last_len = len(scalars)
            new = [n for n in tensor_names(scalars) if n not in self._order]
        if new:
            self._order.update(dict.fromkeys(new))
            self._put(("o", int(step), time.time(), list(self._order)))
        pairs = [(tag, float(v)) for tag, v in scalars.items()]
        if self._order and GRAD_NORM_TOTAL in scalars:  # a measured step (not the close() counts)
            tag = f"{self._sink.format.PACK_TAG}{self._packed // self._sink.format.PACK_BLOCK:06d}"
            self._packed += 1
            self._put(("p", int(step), time.time(), (tag, tuple(self._order), pairs)))  # packed on the writer thread
        quiet = self._quiet(scalars)
        self._scalar_tags.update(quiet)
        self._put(("s", int(step), time.time(), [p for p in pairs if p[0] in quiet]))  # the same tuples, not copies

    def log_image(self, tag: str, png: bytes, step: int) -> None:
        """A PNG in TensorBoard's Images tab (the overview heatmap)."""
        self._sink.format.png_size(png)  # refuse non-PNG bytes here, in the caller, not on the writer thread
        self._last_step = max(self._last_step, step)
        self._put(("i", int(step), time.time(), (tag, bytes(png))))

    def log_histogram(self, tag: str, hist: Histogram, step: int) -> None:
        self._last_step = max(self._last_step, step)
        self._put(("h", int(step), time.time(), (tag, hist)))

    def log_histograms(self, tags: Sequence[str], hists: Histograms, step: int) -> None:
        """The block as it came (views of its rows, _BLOCK_ROWS at a time): the protobufs are built on the
        writer thread, and the queue holds a few bytes per bucket instead of Python `Histogram` objects."""
        self._last_step = max(self._last_step, step)
        wall = time.time()
        for at in range(0, len(hists), _BLOCK_ROWS):
            self._put(("H", int(step), wall, (list(tags[at : at + _BLOCK_ROWS]), hists.rows(at, at + _BLOCK_ROWS))))

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
        """A markdown table in TensorBoard's Text tab at the latest step logged (after `gradlog/summary`,
        headed by its verdict line).

        Tagged `name`, or `name/table` when a scalar already uses that tag (the logger writes a scalar
        `gradlog/never_updated` too): TensorBoard keeps one kind of data per tag and drops the other.
        """
        tag = f"{name}/table" if name in self._scalar_tags else name
        summary = name == SUMMARY  # key/value: the verdict stays one line, as scripts grep it
        markdown = self._sink.format.markdown_table(columns, rows, wrap=not summary)
        if summary:  # the logger writes it first: the other tables repeat its verdict on top
            self._verdict = next((str(r[1]) for r in rows if len(r) >= 2 and r[0] == "verdict"), None)
        elif self._verdict:  # TensorBoard sorts the Text tab by tag: every card starts with the verdict
            markdown = f"**{self._sink.format.escape_markdown(self._verdict)}**\n\n{markdown}"
        self._put(("t", self._last_step, time.time(), (tag, markdown)))

    def flush(self) -> None:
        """Return once everything logged so far is written to the OS (or `flush_timeout` passed)."""
        if not self.closed:
            lane = self._lane
            done = lane.sync(time.monotonic() + self.flush_timeout, patience=self.flush_timeout)
            if not done and not lane.behind:  # it gave up waiting: not waited for again until caught up
                lane.fall_behind(f"flush() waited {self.flush_timeout:g} s")
        self._report()

    def _report(self) -> None:
        problems = self._sink.new_problems()
        if problems and self.strict:
            raise RuntimeError(problems[0])
        _emit(problems)

    def close(self) -> None:
        """Write what is queued, close the file. Idempotent; also runs at interpreter exit."""
        if self.closed:
            return
        self.closed = True
        if self.strict:  # report here, raising, instead of warning from the finalizer
            self._finalizer.detach()
            _shutdown(self._lane, self.flush_timeout, emit=False)
            self._report()
        else:
            self._finalizer()

    def after_fork(self) -> None:
        """In a forked child: the writer thread did not come along; never wait for it or write from here."""
        self.closed = True
        self._finalizer.detach()

    def __repr__(self) -> str:
        return f"TensorBoardWriter(log_dir={self.log_dir!r})"
