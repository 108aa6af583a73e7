"""`WandbWriter`: gradlog's metrics into a Weights & Biases run, one `run.log` call per measured step.

Why it looks the way it does (measured with wandb 0.31, see README "Weights & Biases"):

- `step=` is never passed to `run.log`: W&B's step counter is shared with the user's own `wandb.log`
  calls, and a step lower than the current one is silently dropped. gradlog logs `gradlog/step` as a
  value and declares it, with `define_metric`, as the x-axis of its own keys.
- Rows are logged with `commit=False`, so they merge into the row the user is building instead of
  advancing W&B's step behind the user's back. If gradlog's previous row is still open when the next
  measured step arrives, it is committed first with an empty `run.log({})`.
- Histograms arrive one call per tensor, so a step is buffered and sent on `flush()` (the logger
  flushes after each published step), when a new step starts, or at `close()`.
- W&B accepts about 10 MB per `run.log` call; a step larger than `max_payload_bytes` is split over
  several rows, each carrying `gradlog/step`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gradlog.measure.distributed import is_rank_zero
from gradlog.measure.histogram import Histogram, Histograms
from gradlog.measure.once import WarnOnce
from gradlog.runformat.cells import summary_value
from gradlog.runformat.names import (
    COUNTED_TABLES,
    DROPPED_KEY,
    ORDER_KEY,
    STEP_KEY,
    SUMMARY,
    WANDB_TABLE_KEYS,
    summary_key,
)
from gradlog.runformat.tags import RUN, TENSORS
from gradlog.writers.base import Writer
from gradlog.writers.quiet import QuietNonfinite, tensor_names

log = logging.getLogger("gradlog")

INSTALL_HINT = "pip install 'gradlog[wandb]'"
#: Seconds between wandb-core's writes of a run gradlog starts to its `.wandb` file (wandb's default, 15 s,
#: is what a kill -9 would lose); its `x_transaction_log_flush_interval` setting.
DEFAULT_FILE_FLUSH_S = 0.1
#: Less free space than this where the run is written counts as a full disk (warned about once).
MIN_FREE_BYTES = 1 << 20
#: key prefixes gradlog writes (every per-tensor key under `weights/`, run-level under `gradlog/`:
#: `gradlog.runformat.tags`); each gets `define_metric(prefix + "/*", step_metric="gradlog/step")`.
PREFIXES = (TENSORS.rstrip("/"), RUN.rstrip("/"))
#: W&B rejects a `run.log` call above ~10 MB (wandb#3701); stay well under it.
DEFAULT_MAX_PAYLOAD_BYTES = 4_000_000


class WandbSetupError(RuntimeError):
    """W&B could not start a run (no credentials, no server): raised once, at construction."""


def import_wandb() -> Any:
    """Import wandb, refusing an empty namespace package (a stray `./wandb` folder, e.g. offline runs)."""
    try:
        import wandb
    except ImportError as exc:
        raise ImportError(f"gradlog's W&B writer needs the wandb package: {INSTALL_HINT}") from exc
    if not callable(getattr(wandb, "init", None)):
        where = list(getattr(wandb, "__path__", []))
        raise ImportError(
            f"`import wandb` found a folder without the wandb package ({where}), probably a stray ./wandb "
            f"directory of run files shadowing a missing install: {INSTALL_HINT}, or run from another directory"
        )
    return wandb


#: A histogram in the form `wandb.Histogram(np_histogram=...)` takes: (counts, edges) as tuples of plain ints
#: and floats. Tuples, not lists: Python's garbage collector stops tracking a tuple of numbers the first time it
#: sees one, while every list stays tracked. A step's 300-1,200 histograms held in lists until `flush()` were
#: promoted into the oldest generation and brought on a full collection of the whole process (torch, wandb:
#: ~330,000 objects, ~300 ms) every 20 or so steps, on the W&B thread: ~15 ms a step.
Payload = tuple[tuple[int, ...], tuple[float, ...]]
#: A histogram `block_payloads` already prepared: (bins, payload or None). A plain tuple as well (see `Payload`).
Prepared = tuple[int, "Payload | None"]


def block_payloads(hists: Histograms) -> list[Payload | None]:
    """`histogram_payload` of every histogram of a block, computed for the whole block at once and read out
    with one `tolist()` per array: the same counts and edges as row by row, without building 1,200
    `Histogram` objects and their edges in Python for each step of a 400-tensor model.

    numpy does the arithmetic: torch's float64 `round` and boolean indexing took ~5 ms each on a [100, 64]
    block (torch 2.13 CPU), most of the W&B thread's time per step."""
    n, bins = len(hists), hists.bins
    if n == 0 or bins <= 0:
        return [None] * n
    counts = np.clip(hists.counts.numpy().astype(np.float64), 0.0, None)  # what Histogram.from_partials reads
    m = hists.moments.numpy()
    edges = _edges(m[:, 0], m[:, 1], bins)
    with np.errstate(invalid="ignore", over="ignore"):
        total = counts.sum(1)
        ok = np.isfinite(total) & (np.rint(total) > 0) & np.isfinite(edges).all(1)
    at = np.flatnonzero(ok).tolist()
    out: list[Payload | None] = [None] * n
    if at:
        short = short_edges(edges[ok]).tolist()
        for i, c, e in zip(at, np.rint(counts[ok]).astype(np.int64).tolist(), short):
            out[i] = (tuple(c), tuple(e))
    return out


def _edges(lo: Any, hi: Any, bins: int) -> Any:
    """[n, bins + 1] float64 edges of rows with these min and max: `Histogram.edges`' arithmetic, per value."""
    with np.errstate(invalid="ignore", over="ignore"):
        hi = np.where(hi > lo, hi, lo + np.maximum(np.abs(lo), 1.0) * 1e-6)  # a constant tensor's tiny bucket
        step = (hi - lo) / bins
        edges = np.empty((len(lo), bins + 1), dtype=np.float64)
        edges[:, :bins] = lo[:, None] + np.arange(bins, dtype=np.float64)[None, :] * step[:, None]
    edges[:, bins] = hi
    return edges


#: Edges are sent rounded to decimals at this fraction of their bucket's width (see `short_edges`).
EDGE_RESOLUTION = 1e-4


def short_edges(edges: Any) -> Any:
    """Rows of finite, increasing bucket edges, each rounded to the decimal place at `EDGE_RESOLUTION` of the
    row's bucket width (the first edge down, the last up, so every value stays inside): an edge moves by at
    most 1/10,000 of a bucket, far below a pixel of W&B's chart, and its JSON is ~10 characters instead of
    ~22 (`repr` of a full float64). wandb-core parses every number of every history row; the edges are half
    of a histogram's numbers and most of its bytes.

    The rounded value is `m / 10**k` (or `m * 10**-k`), the float64 nearest that decimal, whose shortest
    `repr` is the decimal itself. A row whose rounding would not keep its edges finite and strictly
    increasing within the resolution (widths beyond 10**±22, magnitudes beyond 2**53 resolutions) is kept
    as it is."""
    if edges.size == 0:
        return edges
    bins = edges.shape[1] - 1
    width = (edges[:, -1] - edges[:, 0]) / bins
    out = edges.copy()
    with np.errstate(all="ignore"):
        k = np.ceil(-np.log10(width * EDGE_RESOLUTION))  # decimals: 10**-k <= width * resolution
        for sign, rows in ((1, (k >= 0) & (k <= 22)), (-1, (k < 0) & (k >= -22))):
            if not rows.any():
                continue
            e = edges[rows]
            p = 10.0 ** (sign * k[rows])[:, None]  # exact powers of ten: 10**0 .. 10**22
            if sign == 1:
                q = np.rint(e * p) / p
                q[:, 0], q[:, -1] = np.floor(e[:, 0] * p[:, 0]) / p[:, 0], np.ceil(e[:, -1] * p[:, 0]) / p[:, 0]
            else:
                q = np.rint(e / p) * p
                q[:, 0], q[:, -1] = np.floor(e[:, 0] / p[:, 0]) * p[:, 0], np.ceil(e[:, -1] / p[:, 0]) * p[:, 0]
            good = (
                np.isfinite(q).all(1)
                & (np.diff(q, axis=1) > 0).all(1)
                & (np.abs(q - e).max(1) <= width[rows] * EDGE_RESOLUTION)
            )
            idx = np.flatnonzero(rows)[good]
            out[idx] = q[good]
    return out


def histogram_bytes(tag: str, hist: Histogram | Prepared) -> int:
    """Upper bound of one histogram's size in a W&B history row: 3 items (`_type`, `values`, `bins`),
    each repeating the key, counts up to 12 characters, edges up to 25 (`repr` of a float64 plus comma)."""
    bins = hist.bins if isinstance(hist, Histogram) else hist[0]
    return 3 * (len(tag.encode()) + 16) + 40 + 12 * bins + 25 * (bins + 1)


def scalar_bytes(key: str) -> int:
    """Upper bound of one scalar item: the key, a float's JSON and protobuf framing."""
    return len(key.encode()) + 40


def histogram_payload(hist: Histogram) -> Payload | None:
    """(counts, edges) for `wandb.Histogram(np_histogram=...)`, or None when there is nothing W&B can draw:
    no finite value (all NaN/Inf, or an empty tensor) or a non-finite bucket edge. NaN/Inf entries are
    already outside the buckets (counted in `hist.nonfinite`), so W&B never sees one.

    Tuples of plain numbers, built with C-level calls: `wandb.Histogram` keeps them as they are (numpy arrays
    it converts with `.tolist()`), wandb's JSON encoder writes them as arrays, and a step of 400 tensors has
    1,200 of these (why tuples: see `Payload`).
    """
    if hist.count <= 0 or hist.bins == 0:
        return None
    counts = hist.counts
    if not math.isfinite(sum(counts)):  # any NaN/Inf count makes the sum non-finite
        return None
    edges = list(hist.edges)
    if not all(map(math.isfinite, edges)):
        return None
    edges = short_edges(np.array([edges], dtype=np.float64))[0].tolist()
    return tuple(map(round, counts)), tuple(edges)  # whole numbers: W&B's integer bins


def scalar_value(value: object) -> float | None:
    """A float W&B stores as it is: finite, NaN ("NaN") and ±Inf ("Infinity") all round-trip through the
    offline file. Anything float() refuses is dropped (one bad value would lose the whole `run.log` call)."""
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


@dataclass
class StepPayload:
    """Everything gradlog sent for one x-axis value, waiting for `flush()`."""

    step: int
    scalars: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram | Prepared] = field(default_factory=dict)
    tables: dict[str, tuple[list[str], list[list[str]]]] = field(default_factory=dict)
    images: dict[str, bytes] = field(default_factory=dict)
    image_steps: dict[str, int] = field(default_factory=dict)

    def empty(self) -> bool:
        return not (self.scalars or self.histograms or self.tables or self.images)


def split_payload(payload: StepPayload, max_bytes: int) -> list[StepPayload]:
    """Cut one step into parts of at most `max_bytes` (estimated); scalars first, then histograms, tables last.

    A single item larger than `max_bytes` still gets a part of its own (it cannot be cut further)."""
    parts = [StepPayload(payload.step)]
    used = scalar_bytes(STEP_KEY)

    def room(size: int) -> StepPayload:
        nonlocal used
        if used + size > max_bytes and not parts[-1].empty():
            parts.append(StepPayload(payload.step))
            used = scalar_bytes(STEP_KEY)
        used += size
        return parts[-1]

    for key, value in payload.scalars.items():
        room(scalar_bytes(key)).scalars[key] = value
    for tag, hist in payload.histograms.items():
        room(histogram_bytes(tag, hist)).histograms[tag] = hist
    for name, table in payload.tables.items():
        size = len(json.dumps(table[1]).encode()) + 200
        room(size).tables[name] = table
    for tag, png in payload.images.items():  # a file reference in the row, the bytes go to media/
        part = room(len(tag.encode()) + 300)
        part.images[tag] = png
        part.image_steps[tag] = payload.image_steps.get(tag, payload.step)
    return parts


class WandbWriter(Writer):
    """Logs gradlog's scalars, histograms and never-updated report into a W&B run.

    `run`: an existing run to log into. Otherwise the active run (`wandb.run`) is used; gradlog never
    finishes a run it did not start. With no active run, `wandb.init(project=project, dir=log_dir,
    **init_kwargs)` starts one, finished again by `close()`. Pass `mode="offline"` or `mode="disabled"`
    through `init_kwargs` (or set `WANDB_MODE`).

    `ordered`: a W&B run's rows and step are shared with the program's own `run.log` calls (on the
    training thread, into its own run or into the one gradlog started), and wandb's client is not safe
    for two threads logging at once: rows were lost or merged (issue 41). So `log()` returns only once
    this writer's thread has sent the step (bounded like every writer: one call running longer than the
    output's `timeout` is not waited for).
    """

    ordered = True

    def __init__(
        self,
        run: Any = None,
        project: str | None = None,
        log_dir: str | None = None,
        *,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        **init_kwargs: Any,
    ) -> None:
        self.wandb = import_wandb()
        if isinstance(max_payload_bytes, bool) or not isinstance(max_payload_bytes, int) or max_payload_bytes < 1024:
            raise ValueError(f"max_payload_bytes must be an integer >= 1024, got {max_payload_bytes!r}")
        self.max_payload_bytes = max_payload_bytes
        self.owns_run = False
        if run is None:
            run = self.wandb.run
            if run is not None and (project is not None or log_dir is not None or init_kwargs):
                log.warning("gradlog: logging into the active W&B run; project/log_dir/init arguments are ignored")
        if run is None:
            if not is_rank_zero():  # only rank 0 logs; a writer built by hand on every rank must not start N runs
                init_kwargs = {**init_kwargs, "mode": "disabled"}
            run = self._init(project, log_dir, init_kwargs)
            self.owns_run = True
        self.run = run
        self._buffer: StepPayload | None = None
        self._open_row: int | None = None  # W&B step of gradlog's uncommitted row, if still open
        self._owns_step = False  # nobody else commits rows: gradlog commits its own at once (durable)
        self._next_row: int | None = None  # W&B's step after gradlog's last own commit
        self._summary: dict[str, Any] = {}
        self._warned = WarnOnce()
        self._disk_checked = -math.inf
        self._closed = False
        self._last_step = 0
        self._step_known = True
        self._quiet = QuietNonfinite()
        self._order: dict[str, None] = {}
        self._last_len = -1
        self._image_dir: str | None = None
        self._images = 0
        self.run.define_metric(STEP_KEY)
        for prefix in PREFIXES:
            self.run.define_metric(f"{prefix}/*", step_metric=STEP_KEY)

    def _init(self, project: str | None, log_dir: str | None, init_kwargs: dict[str, Any]) -> Any:
        kwargs = dict(init_kwargs)
        if project is not None:
            kwargs["project"] = project
        if log_dir is not None:
            kwargs.setdefault("dir", log_dir)
            os.makedirs(log_dir, exist_ok=True)  # wandb.init refuses a dir that does not exist
        if "settings" not in kwargs:
            settings = run_settings(self.wandb)
            if settings is not None:
                kwargs["settings"] = settings
        try:
            return self.wandb.init(**kwargs)
        except self.wandb.errors.Error as exc:
            raise WandbSetupError(
                f"W&B could not start a run ({type(exc).__name__}: {exc}). Without a W&B account or network, set "
                "WANDB_MODE=offline (sync later with `wandb sync`) or pass writer_options={'mode': 'offline'}; "
                "to log online, run `wandb login` or set WANDB_API_KEY"
            ) from exc

    # --- Writer interface -------------------------------------------------------------------
    def _payload(self, step: int) -> StepPayload:
        """The buffer for `step`; a different step first sends the buffered one."""
        if self._buffer is not None and self._buffer.step != step:
            self.flush()
        if self._buffer is None:
            self._buffer = StepPayload(int(step))
        return self._buffer

    def log_scalars(self, scalars: Mapping[str, float], step: int) -> None:
        """Per-tensor `weights/grad_nonfinite/` keys only once non-zero (see writers/quiet.py); new tensor names
        extend the model order kept in run.config."""
        payload = self._payload(step)
        new = []
        if len(scalars) != self._last_len:  # new tensors bring new keys: skip the scan on ordinary steps
            self._last_len = len(scalars)
            new = [n for n in tensor_names(scalars) if n not in self._order]
        if new:
            self._order.update(dict.fromkeys(new))
            self.run.config.update({ORDER_KEY: list(self._order)}, allow_val_change=True)
        for key, value in self._quiet(scalars).items():
            v = scalar_value(value)
            if v is None:
                self._warn_once("value", f"gradlog: W&B cannot log {key}={value!r} (not a number); it is left out")
                continue
            payload.scalars[key] = v
            if key.startswith(COUNTED_TABLES):  # close-time counts: in the run summary too
                self._summary[key] = round(v) if v.is_integer() else v

    def log_histogram(self, tag: str, hist: Histogram, step: int) -> None:
        self._payload(step).histograms[tag] = hist

    def log_histograms(self, tags: Sequence[str], hists: Histograms, step: int) -> None:
        """A step's block in W&B's form at once (`block_payloads`); the buffer holds tuples of numbers."""
        into = self._payload(step).histograms
        bins = hists.bins
        for tag, data in zip(tags, block_payloads(hists)):
            into[tag] = (bins, data)

    def log_image(self, tag: str, png: bytes, step: int) -> None:
        """A PNG as a `wandb.Image` (the overview heatmap). It is drawn in the background and arrives while a
        later step is being logged: it joins that step's row rather than reopen an older one (a row per
        `run.log`, in order). The caption names the step it shows."""
        payload = self._buffer if self._buffer is not None else self._payload(step)
        payload.images[tag] = bytes(png)
        payload.image_steps[tag] = int(step)

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
        if name == SUMMARY:
            for row in rows:
                if len(row) >= 2:
                    self._summary[summary_key(str(row[0]))] = summary_value(str(row[1]))
            return
        step = self._buffer.step if self._buffer is not None else self._last_step
        self._payload(step).tables[WANDB_TABLE_KEYS.get(name, name)] = (list(columns), [list(r) for r in rows])

    def record_dropped(self, n: int) -> None:
        """`n` records never reached this writer (it fell behind; see `writers.guard`): kept in the run summary as
        `gradlog/dropped_records`, so the run itself says that some of its steps are incomplete."""
        self._summary[DROPPED_KEY] = int(n)

    @property
    def run_id(self) -> str:
        """The W&B run's id ("" for a run object without one): a resumed run continues it by this id."""
        return str(getattr(self.run, "id", "") or "")

    def where(self) -> str | None:
        """The run's folder, where wandb keeps one (a run object without `dir` leaves nothing to say)."""
        folder = getattr(self.run, "dir", None)
        if not isinstance(folder, str):
            return None
        run_dir = os.path.dirname(os.path.normpath(folder))
        return f"gradlog: W&B run files in {run_dir} (after exit: gradlog report {_whole_run(run_dir)})"

    def flush(self) -> None:
        """Send the buffered step. The buffer is emptied first: a failing call loses that step, not the next."""
        payload, self._buffer = self._buffer, None
        if payload is None or payload.empty():
            return
        self._last_step = payload.step
        parts = split_payload(payload, self.max_payload_bytes)
        if len(parts) > 1:
            self._warn_once(
                "split",
                f"gradlog: step {payload.step} is larger than max_payload_bytes={self.max_payload_bytes} and was "
                f"split over {len(parts)} W&B rows; log fewer histograms (histogram_every=, bins=, "
                "histogram_kinds=) to keep one row per step",
            )
        for part in parts:
            self._send(self._row(part))
        self._check_disk()

    def _check_disk(self) -> None:
        """wandb-core writes the run file in another process and says nothing when the disk is full: look at
        the free space of the run's folder (at most once a second) and warn when it is gone, not at close."""
        now = time.monotonic()
        if now - self._disk_checked < 1.0 or "disk" in self._warned.seen:
            return
        self._disk_checked = now
        folder = getattr(self.run, "dir", None)
        if not isinstance(folder, str) or not folder:
            return
        try:
            st = os.statvfs(folder)
        except (OSError, AttributeError):  # gone, or no statvfs on this platform
            return
        free = st.f_bavail * st.f_frsize
        if free < MIN_FREE_BYTES:
            self._warn_once(
                "disk",
                f"gradlog: the disk holding the W&B run {folder!r} is full ({free} bytes free); W&B cannot write "
                "this run's file, so what it logs from now on is lost. Free space; training continues",
            )
        self._check_file_size(os.path.dirname(folder))

    def _check_file_size(self, run_folder: str) -> None:
        """A file size limit (`ulimit -f`, inherited by wandb-core) cuts the run file off as silently as a full
        disk, with space to spare: warn when the file nears it (seen: a 300 KB limit, the file stopped at
        300,000 bytes, 40 steps logged and no word)."""
        try:
            import resource

            limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        except (ImportError, OSError, ValueError):  # no resource module on Windows
            return
        if limit == resource.RLIM_INFINITY or limit <= 0:
            return
        path = os.path.join(run_folder, f"run-{self.run_id}.wandb")
        try:
            size = os.path.getsize(path)
        except OSError:
            return
        if size >= limit - min(MIN_FREE_BYTES, limit // 2):
            self._warn_once(
                "disk",
                f"gradlog: the W&B run file {path!r} is at the file size limit of this process ({limit} bytes, "
                "`ulimit -f`); W&B cannot write past it, so what it logs from then on is lost. Raise the limit "
                "(ulimit -f unlimited); training continues",
            )

    def close(self) -> None:
        """Send what is buffered, write the summary, and finish the run if gradlog started it."""
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
            if self._summary and not getattr(self.run, "_is_finished", False):
                self.run.summary.update(self._summary)
        finally:
            if self.owns_run:
                self.run.finish()
            if self._image_dir is not None:
                import shutil

                shutil.rmtree(self._image_dir, ignore_errors=True)

    # --- internals ----------------------------------------------------------------------------
    def _row(self, part: StepPayload) -> dict[str, Any]:
        row: dict[str, Any] = {STEP_KEY: part.step}
        row.update(part.scalars)
        for tag, hist in part.histograms.items():
            data = histogram_payload(hist) if isinstance(hist, Histogram) else hist[1]
            if data is not None:
                row[tag] = self.wandb.Histogram(np_histogram=data)
        for name, (columns, rows) in part.tables.items():
            row[name] = self.wandb.Table(columns=columns, data=rows)
        for tag, png in part.images.items():
            image = self._image(tag, png, part.image_steps.get(tag, part.step))
            if image is not None:
                row[tag] = image
        return row

    def _image(self, tag: str, png: bytes, step: int) -> Any:
        """`wandb.Image` from a file (wandb copies it into the run's media/); wandb needs Pillow for that."""
        import importlib.util
        import tempfile

        if importlib.util.find_spec("PIL") is None:
            self._warn_once(
                "pillow", "gradlog: W&B images need Pillow (pip install pillow); the overview image is left out"
            )
            return None
        if self._image_dir is None:
            self._image_dir = tempfile.mkdtemp(prefix="gradlog-wandb-images-")
        self._images += 1
        path = os.path.join(self._image_dir, f"{tag.replace('/', '_')}-{step}-{self._images}.png")
        with open(path, "wb") as f:
            f.write(png)
        caption = f"gradlog overview at step {step}: update ratio per tensor (rows, model order) x step (columns)"
        return self.wandb.Image(path, caption=caption)

    def _send(self, row: dict[str, Any]) -> None:
        """Merge into the row being built (`commit=False`); commit gradlog's own previous row first if
        nobody else did, so two gradlog steps never land in one W&B row."""
        if getattr(self.run, "_is_finished", False):  # asking a finished run its step hangs for 30 s
            raise RuntimeError(
                f"the W&B run {getattr(self.run, 'id', '')} was finished before gradlog.close(), so gradlog's "
                f"data for step {row.get(STEP_KEY)} is not logged; finish the run after closing the GradLogger"
            )
        current = self._current_step()
        if current is None:  # a run that cannot tell its step: plain committed rows
            self.run.log(row)
            return
        if current == self._open_row:  # nobody committed gradlog's previous row: nobody else logs rows
            self.run.log({}, commit=True)
            current += 1
            self._owns_step = True
        elif self._owns_step and current != self._next_row:  # the program logs rows of its own (again): join them
            self._owns_step = False
        self.run.log(row, commit=False)  # does not move the step
        if self._owns_step:  # commit now, so that a crash loses at most the step in flight
            self.run.log({}, commit=True)
            self._open_row, self._next_row = None, current + 1
        else:
            self._open_row = current

    def _current_step(self) -> int | None:
        """W&B's step of the row being built. wandb's `Run` keeps it on the client side (`_local_step`,
        advanced by every committing `log` of this process); `run.step` asks wandb's service instead, a
        round trip that waits until the service has processed every row queued before it (tens of ms
        after a large row on a busy machine), so it is the fallback. None for runs that cannot say
        (mode="shared" raises), remembered so it is asked only once."""
        local = getattr(self.run, "_local_step", None)
        if isinstance(local, int) and not isinstance(local, bool):
            return local
        if self._step_known:
            try:
                step = self.run.step
            except Exception:
                step = None
            if isinstance(step, int):
                return step
            self._step_known = False
        return None

    def _warn_once(self, key: str, msg: str) -> None:
        self._warned(key, msg, stacklevel=3)


def run_settings(wandb: Any, **extra: Any) -> Any:
    """`wandb.Settings` of a run gradlog starts (`extra` added), or None where this wandb has neither setting:

    - `x_transaction_log_flush_interval=0.1`: a crash loses what wandb-core has not written to the run file
      yet (wandb's default interval is 15 s);
    - `x_server_side_derived_summary=True`: wandb-core otherwise rewrites the run's summary after every
      row, every logged histogram in it (one summary record per row as large as the row: a third of its
      CPU time for a 100-tensor model's 300 histograms, on the cores training uses). The W&B server derives
      the summary from the history instead when the run is synced or online; values set with
      `run.summary` (gradlog's verdict and counts) are written as before. A run that is not synced keeps
      only those in its local summary."""
    for settings in (
        {"x_transaction_log_flush_interval": DEFAULT_FILE_FLUSH_S, "x_server_side_derived_summary": True},
        {"x_transaction_log_flush_interval": DEFAULT_FILE_FLUSH_S},
        {},
    ):
        if not settings and not extra:
            return None
        try:
            return wandb.Settings(**settings, **extra)
        except Exception:  # an older wandb without the setting: the next set, down to its own defaults
            continue
    return None


__all__ = ["DEFAULT_MAX_PAYLOAD_BYTES", "WandbSetupError", "WandbWriter", "import_wandb", "run_settings"]


def _whole_run(run_dir: str) -> str:
    """The folder `gradlog report` reads the whole W&B run from: its parent when a resumed run left other
    segments beside it (`offline-run-<time>-<id>`, one per segment, the same id), else the run folder."""
    parent, name = os.path.split(run_dir)
    run_id = name.rsplit("-", 1)[-1]
    try:
        others = [n for n in os.listdir(parent) if n != name and n.endswith("-" + run_id)]
    except OSError:
        return run_dir
    return parent if others else run_dir
