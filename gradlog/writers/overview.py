"""The overview image: the update-ratio heatmap (one row per tensor in model order, one column per
published step, or per span of steps in a long run) with the findings marked, drawn on a background
thread and handed to every writer's `log_image` as PNG bytes.

Why a thread: at 1,000 tensors x 1,000 steps drawing takes a noticeable fraction of a second, which
must not land on a training step. Why the training thread still hands the image over: writers are
called from one thread only (W&B's buffer is not thread-safe), so a finished image waits until the
next `log()` (or `close()`) picks it up. Why columns merge (`MAX_COLUMNS`): a run publishes for as
long as it trains, and one column per step grew ~9 bytes per tensor per step without end (5,000
tensors logged every step: ~4.5 GB after 100,000 steps, and an image 100,000 pixels wide).
"""

from __future__ import annotations

import array
import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence

import numpy as np

from gradlog.measure.meter import Measurement
from gradlog.runformat.names import OVERVIEW
from gradlog.writers.overview_labels import label
from gradlog.writers.png import PILLOW_HINT, has_pillow, heatmap_rgb, log_range

log = logging.getLogger("gradlog")

TAG = OVERVIEW
#: At most one image per this many seconds of wall time during training (the final one always comes).
MIN_INTERVAL_S = 20.0
#: At most this many columns are kept: when full, neighbouring columns merge in pairs and each column
#: from then on spans twice as many published steps (the image stays at most ~this many pixels wide).
MAX_COLUMNS = 256
_NONE = -1.0  # no ratio at that step (not measured, or not in the optimizer)
_OK, _NO_GRAD, _ZERO_GRAD = 0, 1, 2
_NUMPY_FROM = 32  # rows from which `_merge` uses numpy (~20 us a call; the loop is ~0.4 us a row)


def check_every(every: int | None) -> int | None:
    """`overview_every`: None (on histogram steps), an integer >= 1, or 0 (no overview images)."""
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 0):
        raise ValueError(
            f"overview_every must be None (on histogram steps), an integer >= 1 (every that many published "
            f"steps) or 0 (no overview images), got {every!r}"
        )
    return every


class Overview:
    """Collects each published step's update ratios and draws the heatmap when due.

    `every`: an image every that many published steps; None: on histogram steps (every published step
    when histograms are off); 0: no images at all. Either way at most one per `min_interval` seconds
    during training, and one more, with the final findings, at close.

    A column is one published step until `max_columns` are held; then columns span 2, 4, ... steps each
    (see `_merge` for what a span shows: a cell is dark only if the tensor did not move at any of its steps).
    """

    def __init__(
        self, every: int | None = None, min_interval: float = MIN_INTERVAL_S, max_columns: int = MAX_COLUMNS
    ) -> None:
        self.every = check_every(every)
        if self.every != 0 and not has_pillow():  # a core install (writer="memory") may lack it: no images
            logging.getLogger("gradlog").info("gradlog: no overview images: they need Pillow (%s)", PILLOW_HINT)
            self.every = 0
        self.min_interval = min_interval
        self.names: list[str] = []  # model order: the order tensors were first published
        self._row: dict[str, int] = {}
        self.max_columns = max(2, max_columns + max_columns % 2)
        self.steps: list[int] = []  # per column, the last published step it holds
        self._ratios: list[array.array[float]] = []  # one per column, indexed by row
        self._grad: list[bytes] = []  # one per column: _OK / _NO_GRAD / _ZERO_GRAD per row
        self._span = 1  # published steps per column
        self._fill = 0  # published steps in the last column
        self._published = 0
        self._last_start = -math.inf
        self._thread: threading.Thread | None = None
        self._done: list[tuple[int, bytes]] = []
        self._lock = threading.Lock()

    def observe(self, m: Measurement, step: int) -> None:
        """Record one published step (host-side numbers only)."""
        host = m.lists
        ratios, nonzero, numel = host.ratio, host.nonzero, host.numel
        for row in m.rows:
            if row.name not in self._row:
                self._row[row.name] = len(self.names)
                self.names.append(row.name)
        values = array.array("d", [_NONE]) * len(self.names)
        grad = bytearray(len(self.names))
        for i, row in enumerate(m.rows):
            r = self._row[row.name]
            if ratios is not None and row.group is None:  # in no param group: never moves ("no update", as in the tab)
                values[r] = 0.0
            elif ratios is not None and host.has_ratio(i):
                values[r] = ratios[i]
            if not m.has_grad[i]:
                grad[r] = _NO_GRAD
            elif numel[i] > 0 and nonzero[i] == 0:
                grad[r] = _ZERO_GRAD
        self._published += 1
        if self._ratios and self._fill < self._span:  # the last column still has room: merge into it
            self._ratios[-1], self._grad[-1] = _merge(self._ratios[-1], self._grad[-1], values, bytes(grad))
            self.steps[-1] = int(step)
            self._fill += 1
            return
        if len(self._ratios) >= self.max_columns:
            self._halve()
        self.steps.append(int(step))
        self._ratios.append(values)
        self._grad.append(bytes(grad))
        self._fill = 1

    def _halve(self) -> None:
        """Merge neighbouring columns in pairs: half as many columns, each spanning twice the steps."""
        ratios, grads, steps = self._ratios, self._grad, self.steps
        pairs = range(0, len(ratios) - 1, 2)  # an even count: `max_columns` is rounded up to even
        merged = [_merge(ratios[j], grads[j], ratios[j + 1], grads[j + 1]) for j in pairs]
        self._ratios = [r for r, _ in merged]
        self._grad = [g for _, g in merged]
        self.steps = [steps[j + 1] for j in pairs]
        self._span *= 2
        self._fill = self._span

    def due(self, histogram_step: bool) -> bool:
        if self.every == 0 or not self.steps:
            return False
        if self.every is None:
            wanted = histogram_step
        else:
            wanted = (self._published - 1) % self.every == 0
        return wanted and time.monotonic() - self._last_start >= self.min_interval

    def live_marks(self) -> dict[str, str]:
        """Findings visible in the latest step: no update, or a NaN/Inf ratio."""
        if not self._ratios:
            return {}
        out = {}
        last, grad = self._ratios[-1], self._grad[-1]
        for r, name in enumerate(self.names):
            v = last[r] if r < len(last) else _NONE
            if math.isnan(v) or math.isinf(v):
                out[name] = "nonfinite"
            elif v == 0.0 and (r >= len(grad) or grad[r] == _OK):
                out[name] = "no_update"
        return out

    def draw(self, marks: Mapping[str, str]) -> bytes:
        """The heatmap as PNG bytes, from the steps recorded so far."""
        return _draw(self.names[:], list(self._ratios), list(self._grad), dict(marks), self.steps[:])

    def start(self, marks: Mapping[str, str]) -> None:
        """Draw on a background thread for the latest step; skipped while the previous drawing runs."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._last_start = time.monotonic()
        step = self.steps[-1]
        names, ratios, grads, mk, steps = (
            self.names[:],
            list(self._ratios),
            list(self._grad),
            dict(marks),
            self.steps[:],
        )

        def work() -> None:
            try:
                png = _draw(names, ratios, grads, mk, steps)
            except Exception as exc:  # an image is a nicety: never an error in the training loop
                log.warning("gradlog: drawing the overview image failed (%s: %s)", type(exc).__name__, exc)
                return
            with self._lock:
                self._done.append((step, png))

        t = threading.Thread(target=work, name="gradlog-overview", daemon=True)
        try:
            t.start()
        except RuntimeError:  # interpreter shutting down: no image this time
            return
        self._thread = t

    def take(self) -> list[tuple[int, bytes]]:
        """Images finished since the last call, as (step, png)."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def wait(self, timeout: float = 30.0) -> None:
        t = self._thread
        if t is not None:
            t.join(timeout)


def _merge(ra: array.array[float], ga: bytes, rb: array.array[float], gb: bytes) -> tuple[array.array[float], bytes]:
    """Two columns as one spanning both (rows missing from the shorter one count as unmeasured).

    Update ratio: NaN/Inf if either is (a blow-up stays visible), else the larger measured one, so a cell
    reads "no update" only when the tensor moved at none of its steps; a stop shows from the first column
    wholly after it. Gradient state: kept where both agree, else "ok" if either had a gradient; a mix of
    "none" and "zero" reads "zero". A row one column lacks (published later) takes the other's."""
    n = max(len(ra), len(rb))
    if n >= _NUMPY_FROM:
        a = np.full(n, _NONE)
        b = np.full(n, _NONE)
        a[: len(ra)] = np.frombuffer(ra, dtype=np.float64)
        b[: len(rb)] = np.frombuffer(rb, dtype=np.float64)
        with np.errstate(invalid="ignore"):
            v = np.where(a == _NONE, b, np.where(b == _NONE, a, np.fmax(a, b)))
            bad = ~(np.isfinite(a) & np.isfinite(b))
            v[bad] = np.where(
                np.isnan(a[bad]) | np.isnan(b[bad]), np.nan, np.where(np.isfinite(a[bad]), b[bad], a[bad])
            )
        x = np.empty(n, dtype=np.uint8)
        y = np.empty(n, dtype=np.uint8)
        x[: len(ga)] = np.frombuffer(ga, dtype=np.uint8)
        y[: len(gb)] = np.frombuffer(gb, dtype=np.uint8)
        x[len(ga) :] = y[len(ga) :]  # a row one column lacks (not published yet) takes the other's state
        y[len(gb) :] = x[len(gb) :]
        g = np.where(x == y, x, np.where((x == _OK) | (y == _OK), _OK, _ZERO_GRAD)).astype(np.uint8)
        return array.array("d", v.tobytes()), g.tobytes()
    values = array.array("d", [_NONE]) * n
    grad = bytearray(n)
    for i in range(n):
        u = ra[i] if i < len(ra) else _NONE
        w = rb[i] if i < len(rb) else _NONE
        if math.isnan(u) or math.isnan(w):
            values[i] = math.nan
        elif math.isinf(u) or math.isinf(w):
            values[i] = u if math.isinf(u) else w
        else:
            values[i] = w if u == _NONE else u if w == _NONE else max(u, w)
        p = ga[i] if i < len(ga) else gb[i]  # a row one column lacks takes the other's state
        q = gb[i] if i < len(gb) else p
        grad[i] = p if p == q else _OK if _OK in (p, q) else _ZERO_GRAD
    return values, bytes(grad)


def _draw(
    names: list[str],
    ratios: list[array.array[float]],
    grads: list[bytes],
    marks: dict[str, str],
    steps: Sequence[int] = (),
) -> bytes:
    """Transpose the per-step arrays into rows (tensors) x columns (steps), draw them, and label the image
    (`steps`: each column's last step). The recorded steps become [tensors, steps] arrays directly (no Python
    float per cell: a 5,000-tensor x 42-step overview's lists were ~7 MB at a measured step's peak)."""
    n = len(names)
    row_marks = {r: marks[name] for r, name in enumerate(names) if name in marks}
    k = min(len(ratios), len(grads))
    values = np.full((n, k), _NONE, dtype=np.float64)
    flags = np.full((n, k), _OK, dtype=np.uint8)
    for j in range(k):
        sv = np.frombuffer(ratios[j], dtype=np.float64)[:n]  # a step may predate later rows: padded
        values[: sv.size, j] = sv
        sg = np.frombuffer(grads[j], dtype=np.uint8)[:n]
        flags[: sg.size, j] = sg
    states = np.where(flags == _NO_GRAD, 1, np.where(flags == _ZERO_GRAD, 2, 0)).astype(np.uint8)
    measured = values != _NONE
    cells = heatmap_rgb(values, measured, states, row_marks)
    return label(cells, names, steps, *log_range(values, measured))


__all__ = ["MAX_COLUMNS", "MIN_INTERVAL_S", "TAG", "Overview"]
