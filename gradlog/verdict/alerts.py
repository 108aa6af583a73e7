"""Alerts during training: say so the moment a tensor looks wrong, not only in the table at close.

Everything here works on host-side numbers the logger already fetched, so alerts cost no device
work. Each tensor alerts at most once per kind; one message per measured step and kind names every
tensor that newly alerted, so a NaN loss that hits 400 tensors is one line, not 400.

Each tensor is judged against what is normal *for it* (measured on GPT-2, a ViT, LoRA and conv nets,
see tests/test_real_models.py):

- a tensor that was all zero when first measured (biases, LayerNorm biases, LoRA ``B``) has no scale
  of its own yet: ‖Δw‖/‖w‖ is 1 at its first step and falls like 1/t while it grows, whatever the
  learning rate. The band says nothing about it; only the NaN, no-gradient and spike checks apply;
- 1-D tensors (biases, norm gains, scalars) have few entries and a scale set by design (a gain near
  1), so their relative update is large early and small late in healthy runs: they are judged
  against a band ten times wider on each side;
- a gradient-norm spike is judged against the median of the tensor's own last `SPIKE_WINDOW`
  measured norms (after `SPIKE_MIN_HISTORY` of them), never against other tensors.

Out-of-band and spike alerts are warnings: listed in the report, never a PROBLEM verdict. A NaN/Inf
gradient is a problem, and its alert comes first.

Where alerts go: through the ``gradlog`` logger when logging is configured (a handler on it or on
the root logger); otherwise the first message of each kind is printed to stderr (rank 0 only, as
the logger only observes there), so a user who set nothing up still sees them. ``alerts=False``
turns them off.
"""

from __future__ import annotations

import bisect
import logging
import math
import sys
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from gradlog.measure.meter import Measurement
from gradlog.verdict.report import WARNING_KINDS, Alert

log = logging.getLogger("gradlog")

#: Alert kinds, in the order a user should look at them.
NONFINITE = "nonfinite_grad"
SPIKE = "grad_norm_spike"
RATIO_HIGH = "update_ratio_high"
RATIO_LOW = "update_ratio_low"
NO_GRAD = "no_grad"
KINDS = (NONFINITE, SPIKE, RATIO_HIGH, RATIO_LOW, NO_GRAD)
assert {SPIKE, RATIO_HIGH, RATIO_LOW} == WARNING_KINDS  # the verdict's warnings (report.py) are these kinds

#: Columns of the `gradlog/alerts` table written at close.
ALERT_COLUMNS = ["step", "kind", "name", "detail"]

DEFAULT_RATIO_BAND = (1e-4, 1e-2)
DEFAULT_RATIO_PATIENCE = 3
DEFAULT_NO_GRAD_PATIENCE = 5
DEFAULT_SPIKE_FACTOR = 10.0
#: A running median needs some history before a spike against it means anything.
SPIKE_MIN_HISTORY = 5
#: The median is over the last this many measured norms: bounded memory, and it follows a slow drift.
SPIKE_WINDOW = 64
#: 1-D tensors are judged against a band this many times wider on each side.
VECTOR_BAND_SLACK = 10.0
_NAMES_SHOWN = 5

__all__ = ["ALERT_COLUMNS", "KINDS", "WARNING_KINDS", "Alert", "Alerts", "Entry", "check_band"]


def check_band(band: Sequence[float]) -> tuple[float, float]:
    """Validate a healthy update-ratio band; used by the logger and the report command alike."""
    try:
        lo, hi = (float(x) for x in band)
    except (TypeError, ValueError):
        raise ValueError(f"ratio_band must be two numbers (low, high), got {band!r}") from None
    if not (0 < lo < hi and math.isfinite(hi)):
        raise ValueError(f"ratio_band must satisfy 0 < low < high < inf, got ({lo!r}, {hi!r}); e.g. (1e-4, 1e-2)")
    return lo, hi


def check_spike(factor: float) -> float:
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 1:
        raise ValueError(
            f"spike_factor must be a number > 1 (a gradient norm this many times its running median), got {factor!r}"
        )
    return float(factor)


def _check_patience(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1 (measured steps in a row), got {value!r}")
    return value


@dataclass
class Entry:
    """One tensor at one measured step, as the judge needs it (live from a Measurement, or replayed from disk)."""

    key: Hashable
    name: str
    has_grad: bool = True
    trainable: bool = True
    nonfinite: float = 0.0
    grad_norm: float | None = None
    ratio: float | None = None  # None: no update measured (not in the optimizer, or no snapshot)
    zero_start: bool | None = None  # the weights were all zero before this step (None: unknown)
    vector: bool = False  # 1-D (or scalar) tensor


@dataclass
class _State:
    high: int = 0
    low: int = 0
    no_grad: int = 0
    ratios: int = 0
    zero_init: bool = False
    window: deque[float] = field(default_factory=deque)
    ordered: list[float] = field(default_factory=list)

    def median(self) -> float:
        xs, n = self.ordered, len(self.ordered)
        return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2

    def remember(self, v: float) -> None:
        self.window.append(v)
        bisect.insort(self.ordered, v)
        if len(self.window) > SPIKE_WINDOW:
            old = self.window.popleft()
            del self.ordered[bisect.bisect_left(self.ordered, old)]


def _logging_configured() -> bool:
    """A handler other than gradlog's own NullHandler on the gradlog logger or above it."""
    lg: logging.Logger | None = log
    while lg is not None:
        if any(not isinstance(h, logging.NullHandler) for h in lg.handlers):
            return True
        if not lg.propagate:
            return False
        lg = lg.parent
    return False


class Alerts:
    """Watches each measured step for things that rarely fix themselves; see the module docstring.

    - a gradient went NaN/Inf (steps the optimizer skipped, as GradScaler does on overflow, are ignored:
      the scaler already handled them);
    - a gradient norm rose above `spike_factor` x the median of the tensor's own recent norms;
    - the update ratio ‖Δw‖/‖w‖ stayed outside the tensor's band for `ratio_patience` measured steps in a
      row (steps without a usable gradient neither count nor break the streak);
    - a trainable tensor had no gradient (`.grad is None`) for `no_grad_patience` measured steps in a row.
    """

    def __init__(
        self,
        ratio_band: Sequence[float] = DEFAULT_RATIO_BAND,
        ratio_patience: int = DEFAULT_RATIO_PATIENCE,
        no_grad_patience: int = DEFAULT_NO_GRAD_PATIENCE,
        spike_factor: float = DEFAULT_SPIKE_FACTOR,
        emit: bool = True,
    ) -> None:
        self.ratio_band = check_band(ratio_band)
        self.ratio_patience = _check_patience("ratio_patience", ratio_patience)
        self.no_grad_patience = _check_patience("no_grad_patience", no_grad_patience)
        self.spike_factor = check_spike(spike_factor)
        self.emit = emit
        self.fired: list[Alert] = []
        self._seen: set[tuple[Hashable, str]] = set()
        self._state: dict[Hashable, _State] = {}
        self._printed: set[str] = set()

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for a in sorted(self.fired, key=lambda a: KINDS.index(a.kind) if a.kind in KINDS else len(KINDS)):
            out[a.kind] = out.get(a.kind, 0) + 1
        return out

    def rows(self) -> list[list[str]]:
        return [a.row() for a in self.fired]

    def observe(self, m: Measurement) -> list[Alert]:
        """Judge one measured step; log (or print) and return the alerts it newly raised."""
        host = m.lists
        nonfinite, norms, ratios, before = host.nonfinite, host.grad_norm, host.ratio, host.before
        entries = []
        for i, row in enumerate(m.rows):
            has_ratio = ratios is not None and row.group is not None and before is not None
            entries.append(
                Entry(
                    key=row.index,
                    name=row.name,
                    has_grad=m.has_grad[i],
                    trainable=row.param.requires_grad,
                    nonfinite=nonfinite[i],
                    grad_norm=norms[i] if m.has_grad[i] else None,
                    ratio=ratios[i] if has_ratio and ratios is not None else None,
                    zero_start=before[i] == 0 if has_ratio and before is not None else None,
                    vector=row.param.dim() <= 1,
                )
            )
        return self.step(m.index, entries, skipped=m.skipped)

    def step(self, index: int, entries: Sequence[Entry], skipped: bool = False) -> list[Alert]:
        """Judge one measured step given per-tensor entries (the report replays runs from disk through this)."""
        new: list[Alert] = []

        def fire(e: Entry, kind: str, detail: str, value: float | None = None, ref: float | None = None) -> None:
            if (e.key, kind) not in self._seen:
                self._seen.add((e.key, kind))
                new.append(Alert(index, kind, e.name, detail, value, ref))

        lo, hi = self.ratio_band
        for e in entries:
            st = self._state.get(e.key)
            if st is None:
                st = self._state[e.key] = _State()
            if not e.has_grad:
                if e.trainable:
                    st.no_grad += 1
                    if st.no_grad >= self.no_grad_patience and (e.key, NO_GRAD) not in self._seen:
                        fire(e, NO_GRAD, f".grad was None on {st.no_grad} measured steps in a row")
                continue
            st.no_grad = 0
            if skipped:
                continue
            if e.nonfinite > 0:
                fire(e, NONFINITE, f"{int(e.nonfinite)} NaN/Inf gradient entries", e.nonfinite)
                continue
            g = e.grad_norm
            if g is not None and math.isfinite(g):
                if len(st.window) >= SPIKE_MIN_HISTORY:
                    med = st.median()
                    if med > 0 and g > self.spike_factor * med:
                        fire(
                            e,
                            SPIKE,
                            f"grad norm {g:.4g} = {g / med:.3g}x the median {med:.4g} of its last "
                            f"{len(st.window)} measured steps",
                            g,
                            med,
                        )
                st.remember(g)
            r = e.ratio
            if r is None or math.isnan(r):
                continue
            st.ratios += 1
            if st.ratios == 1:
                st.zero_init = bool(e.zero_start)
            if st.zero_init:
                continue  # no scale of its own yet: ‖Δw‖/‖w‖ falls like 1/t whatever the lr
            b_lo, b_hi = (lo / VECTOR_BAND_SLACK, hi * VECTOR_BAND_SLACK) if e.vector else (lo, hi)
            st.high = st.high + 1 if r > b_hi else 0
            st.low = st.low + 1 if r < b_lo else 0
            what = "1-D tensor band" if e.vector else "band"
            if st.high >= self.ratio_patience and (e.key, RATIO_HIGH) not in self._seen:  # (no message built twice)
                fire(e, RATIO_HIGH, f"update ratio {r:.3g} > {b_hi:g} ({what}) for {st.high} measured steps", r, b_hi)
            if st.low >= self.ratio_patience and (e.key, RATIO_LOW) not in self._seen:
                fire(e, RATIO_LOW, f"update ratio {r:.3g} < {b_lo:g} ({what}) for {st.low} measured steps", r, b_lo)
        self.fired.extend(new)
        if self.emit:
            self._emit(index, new)
        return new

    def _emit(self, index: int, new: list[Alert]) -> None:
        if not new:  # the common step: no walk up the logging hierarchy
            return
        configured = _logging_configured()
        for kind in KINDS:
            group = [a for a in new if a.kind == kind]
            if not group:
                continue
            msg = _message(index, kind, group)
            if configured:
                log.warning("%s", msg)
            elif kind not in self._printed:  # nothing set up: the first of each kind on stderr
                self._printed.add(kind)
                print(f"{msg} (later '{kind}' alerts: gl.alerts.fired, and the report at close)", file=sys.stderr)


_HEADLINES = {
    NONFINITE: "non-finite gradient",
    SPIKE: "gradient-norm spike",
    RATIO_HIGH: "update ratio above the healthy band",
    RATIO_LOW: "update ratio below the healthy band",
    NO_GRAD: "no gradient",
}


def _message(step: int, kind: str, alerts: list[Alert]) -> str:
    shown = "; ".join(f"{a.name} ({a.detail})" for a in alerts[:_NAMES_SHOWN])
    more = f"; and {len(alerts) - _NAMES_SHOWN} more" if len(alerts) > _NAMES_SHOWN else ""
    n = len(alerts)
    return f"gradlog alert at optimizer step {step}: {_HEADLINES[kind]} in {n} tensor{'s' * (n != 1)}: {shown}{more}"
