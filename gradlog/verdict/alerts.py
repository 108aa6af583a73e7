"""Alerts during training: say so the moment a tensor looks wrong, not only in the table at close.

Everything here works on host-side numbers the logger already fetched, so alerts cost no device
work. Each tensor alerts at most once per kind; one message per measured step and kind names every
tensor that newly alerted, so a NaN loss that hits 400 tensors is one line, not 400.

Each tensor is judged against what is normal *in this run* (measured on GPT-2, Mixtral, a ViT, a
ResNet with SGD+momentum and LoRA, see tests/test_calibrated.py):

- the update ratio ‖Δw‖/‖w‖ is calibrated (the default, ``ratio_band=None``): at each measured step it
  is compared, in log10, with the median of the run's other tensors of the same role (weight matrices,
  embeddings and other >= 2-D tensors; 1-D tensors: norm gains, biases), with a robust spread (1.4826 x
  the median absolute deviation). A tensor is an outlier when it sits more than
  max(`ratio_decades`, `RATIO_Z` x spread) decades from that median, and it is named when it stays one
  for `ratio_patience` measured steps in a row (its own history: one odd step is not a finding). No
  fixed band fits healthy runs: AdamW at 1e-3 gives ratios near 1e-2 early on, SGD+momentum spreads
  them over a decade, and a warmup moves them all together; a tensor trained at 30x (or 1e-4x) its
  peers' learning rate stands out against its peers in every one of them. Roles with fewer than
  `ratio_min_peers` tensors are not judged (there is no "normal" to compare with);
- a fixed band is still there: ``ratio_band=(lo, hi)`` judges each tensor against it (1-D tensors
  against a band ten times wider on each side), as before;
- a tensor that was all zero when first measured (biases, LayerNorm biases, LoRA ``B``) has no scale
  of its own yet: ‖Δw‖/‖w‖ is 1 at its first step and falls like 1/t while it grows, whatever the
  learning rate. Its ratio says nothing about its learning rate; only the NaN, no-gradient and spike
  checks apply;
- a gradient-norm spike is judged against the tensor's own history, never against other tensors
  (gradient norms of different layers differ by orders of magnitude in healthy runs). In log10, the norm
  must stand above both the median of its last `SPIKE_WINDOW` non-zero measured norms and its previous
  one (after `SPIKE_MIN_HISTORY` of them) by more than max(log10 `spike_factor`, `SPIKE_Z` x its robust
  step-to-step spread: 1.4826 x the median |change| of log10 norm between consecutive measured steps in
  that window). The previous norm: a level change is not a spike. LoRA's q/k ``B`` on a tiny Llama
  rose 20x between two steps measured 50 apart while attention started to matter, and stayed there;
  the median of a short history still held the old level, so the next measured steps read as 10-55x
  "spikes" on a run whose loss was falling. The spread: LoRA's ``A`` early on varies ~10x from step to
  step while it grows, so 10x its median is its noise, not news. A loss spike (a garbage batch, a lr
  jump, a layer's gradient scaled 100x) jumps far past both, at its step (measured, tests/test_calibrated.py).
  A level change that happens within one measured interval after the history is long enough still
  reads as a spike at that step: no one step tells it from the start of a real one.
  A zero norm says the tensor was not reached that step, not what its scale is: LoRA's ``A`` has a zero
  gradient until its zero-initialised ``B`` moves, and under a warmup from lr 0 its norm then grows like
  t², 12x the median of a history padded with those zeros at step 5 of a healthy run; an expert no token
  chose has zero norms that would drag its median below its normal steps.

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
from typing import Protocol

from gradlog.measure.meter import Measurement
from gradlog.runformat.names import ALERT_COLUMNS
from gradlog.verdict.report import WARNING_KINDS, Alert
from gradlog.verdict.silence import MAX_CHANCE, chance

log = logging.getLogger("gradlog")

#: Alert kinds, in the order a user should look at them.
NONFINITE = "nonfinite_grad"
SPIKE = "grad_norm_spike"
RATIO_HIGH = "update_ratio_high"
RATIO_LOW = "update_ratio_low"
NO_GRAD = "no_grad"
KINDS = (NONFINITE, SPIKE, RATIO_HIGH, RATIO_LOW, NO_GRAD)
assert {SPIKE, RATIO_HIGH, RATIO_LOW} == WARNING_KINDS  # the verdict's warnings (report.py) are these kinds


#: the fixed band, for ``ratio_band=DEFAULT_RATIO_BAND`` (the default is calibrated: ``ratio_band=None``)
DEFAULT_RATIO_BAND = (1e-4, 1e-2)
#: calibrated: an outlier is at least this many decades (10x per decade) from its role's median ...
DEFAULT_RATIO_DECADES = 1.0
#: ... and at least this many robust spreads (1.4826 x MAD of the role's log10 ratios) from it
RATIO_Z = 5.0
#: calibrated: a role with fewer tensors than this is not judged
DEFAULT_RATIO_MIN_PEERS = 4
DEFAULT_RATIO_PATIENCE = 3
DEFAULT_NO_GRAD_PATIENCE = 5
DEFAULT_SPIKE_FACTOR = 10.0
#: A running median needs some history before a spike against it means anything.
SPIKE_MIN_HISTORY = 5
#: The median is over the last this many measured norms: bounded memory, and it follows a slow drift.
SPIKE_WINDOW = 64
#: A spike stands this many robust spreads of the tensor's step-to-step log10 changes above its reference.
#: Measured: on the healthy runs the largest jump over 10x stood 4.4 spreads out (LoRA A, every step);
#: a garbage batch, a lr jump or a layer's gradient x100 put at least one named tensor 7-140 spreads out
#: (a one-step lr x100 on GPT-2 LoRA, whose one tensor over 10x stood at 4.5, is missed)
SPIKE_Z = 5.0
#: 1-D tensors are judged against a band this many times wider on each side.
VECTOR_BAND_SLACK = 10.0
_NAMES_SHOWN = 5

__all__ = ["ALERT_COLUMNS", "KINDS", "WARNING_KINDS", "Alert", "Alerts", "Entry", "check_band", "median"]


def median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


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
            "spike_factor must be a number > 1 (a gradient norm at least this many times its running median), "
            f"got {factor!r}"
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
    #: ‖Δw‖/√numel, the update's size per entry (None: unknown, e.g. replayed from disk). Under Adam it is
    #: about lr whatever the tensor's scale, so it keeps the lr signal once large updates have grown ‖w‖
    rms_update: float | None = None


class _RunningMedian:
    """The median of the last `size` values pushed: a deque for their order, a sorted list for the median."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.order: deque[float] = deque()
        self.sorted: list[float] = []

    def __len__(self) -> int:
        return len(self.order)

    def median(self) -> float:
        xs, n = self.sorted, len(self.sorted)
        return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2

    def push(self, v: float) -> None:
        self.order.append(v)
        bisect.insort(self.sorted, v)
        if len(self.order) > self.size:
            old = self.order.popleft()
            del self.sorted[bisect.bisect_left(self.sorted, old)]


def _no_grad_evidence(st: _State) -> str | None:
    """What a no-gradient streak adds to its alert's words, or None when it is no evidence: a tensor that had a
    gradient at c of the m measured steps before the streak of n is named only when one used at random at a
    steady rate would be this quiet with chance C(m, c) / C(m + n, c) below `silence.MAX_CHANCE` (a branch taken
    on 10% of steps is quiet 5 steps in a row most of the time). One that never had a gradient: the patience."""
    if not st.with_grad:
        return ""
    p = chance(st.judged, st.no_grad, st.with_grad)
    if p >= MAX_CHANCE:
        return None
    return f", after a gradient at {st.with_grad} of the {st.judged} before (chance {p:.1g} at a steady rate)"


@dataclass
class _State:
    high: int = 0
    low: int = 0
    no_grad: int = 0
    #: measured steps judged before the current no-gradient streak, and those of them with a gradient: what a
    #: streak is weighed against (`_no_grad_evidence`)
    judged: int = 0
    with_grad: int = 0
    ratios: int = 0
    zero_init: bool = False
    #: log10 of the last SPIKE_WINDOW non-zero grad norms
    logs: _RunningMedian = field(default_factory=lambda: _RunningMedian(SPIKE_WINDOW))

    def remember(self, log_norm: float) -> None:
        self.logs.push(log_norm)

    def spread(self) -> float:
        """The median |change| of log10 norm between consecutive measured steps in the window: made only for
        a step already past the factor (rare), not kept up on every step (a 5,000-tensor model paid ~7 ms a
        measured step for a second running median)."""
        xs = self.logs.order
        return median([abs(b - a) for a, b in zip(xs, list(xs)[1:])]) if len(xs) > 1 else 0.0

    def spike(self, log_norm: float, factor: float) -> tuple[float, str, float] | None:
        """(reference norm, what it is, the limit as a factor) when `log_norm` is a spike, else None."""
        floor, previous = math.log10(factor), self.logs.order[-1]
        if log_norm - previous <= floor:  # the common step: no spike whatever the median and spread (both >=)
            return None
        median = self.logs.median()
        ref = max(median, previous)
        limit = max(floor, SPIKE_Z * 1.4826 * self.spread())
        if log_norm - ref <= limit:
            return None
        what = f"the median of its last {len(self.logs)} measured norms" if median >= previous else "its previous one"
        return 10**ref, what, 10**limit


class _Fire(Protocol):
    def __call__(
        self, e: Entry, kind: str, detail: str, value: float | None = None, ref: float | None = None
    ) -> None: ...


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
    - a gradient norm jumped above `spike_factor` x both the median of the tensor's own recent norms and
      its previous one, and beyond its own step-to-step noise;
    - the update ratio ‖Δw‖/‖w‖ stayed an outlier among the run's tensors of its role (calibrated, the
      default: ``ratio_band=None``, `ratio_decades`, `ratio_min_peers`) or outside a fixed
      ``ratio_band=(lo, hi)``, for `ratio_patience` measured steps in a row (steps without a usable
      gradient neither count nor break the streak);
    - a trainable tensor had no gradient (`.grad is None`) for `no_grad_patience` measured steps in a row.
    """

    def __init__(
        self,
        ratio_band: Sequence[float] | None = None,
        ratio_patience: int = DEFAULT_RATIO_PATIENCE,
        no_grad_patience: int = DEFAULT_NO_GRAD_PATIENCE,
        spike_factor: float = DEFAULT_SPIKE_FACTOR,
        emit: bool = True,
        *,
        ratio_decades: float = DEFAULT_RATIO_DECADES,
        ratio_min_peers: int = DEFAULT_RATIO_MIN_PEERS,
    ) -> None:
        self.ratio_band = None if ratio_band is None else check_band(ratio_band)
        if isinstance(ratio_decades, bool) or not isinstance(ratio_decades, (int, float)) or not ratio_decades > 0:
            raise ValueError(
                f"ratio_decades must be a number > 0 (decades from the role's median ratio), got {ratio_decades!r}"
            )
        self.ratio_decades = float(ratio_decades)
        if isinstance(ratio_min_peers, bool) or not isinstance(ratio_min_peers, int) or ratio_min_peers < 3:
            raise ValueError(f"ratio_min_peers must be an integer >= 3 (tensors of one role), got {ratio_min_peers!r}")
        self.ratio_min_peers = ratio_min_peers
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
                    rms_update=_rms(ratios[i], before[i], row.param.numel())
                    if has_ratio and ratios is not None and before is not None
                    else None,
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

        judged: list[tuple[Entry, _State, float]] = []  # (entry, state, ratio) of the tensors with a scale
        for e in entries:
            st = self._state.get(e.key)
            if st is None:
                st = self._state[e.key] = _State()
            if not e.has_grad:
                if e.trainable:
                    st.no_grad += 1
                    if st.no_grad >= self.no_grad_patience and (e.key, NO_GRAD) not in self._seen:
                        said = _no_grad_evidence(st)
                        if said is not None:
                            fire(e, NO_GRAD, f".grad was None on {st.no_grad} measured steps in a row{said}")
                continue
            st.judged += st.no_grad + 1
            st.with_grad += 1
            st.no_grad = 0
            if skipped:
                continue
            if e.nonfinite > 0:
                fire(e, NONFINITE, f"{int(e.nonfinite)} NaN/Inf gradient entries", e.nonfinite)
                continue
            g = e.grad_norm
            if g is not None and math.isfinite(g) and g > 0:  # a zero norm is no scale (module docstring)
                self._spike(e, st, g, fire)
            r = e.ratio
            if r is None or math.isnan(r):
                continue
            st.ratios += 1
            if st.ratios == 1:
                st.zero_init = bool(e.zero_start)
            if st.zero_init:
                continue  # no scale of its own yet: ‖Δw‖/‖w‖ falls like 1/t whatever the lr
            judged.append((e, st, r))
        if self.ratio_band is not None:
            self._banded(judged, fire)
        else:
            self._calibrated(judged, fire)
        self.fired.extend(new)
        if self.emit:
            self._emit(index, new)
        return new

    def _spike(self, e: Entry, st: _State, g: float, fire: _Fire) -> None:
        """Judge `g` against the tensor's own history (module docstring), then add it to that history."""
        x = math.log10(g)
        found = st.spike(x, self.spike_factor) if len(st.logs) >= SPIKE_MIN_HISTORY else None
        if found is not None:
            ref, what, limit = found
            noisy = f"; its steps vary enough that only > {limit:.3g}x counts" if limit > self.spike_factor else ""
            fire(e, SPIKE, f"grad norm {g:.4g} = {g / ref:.3g}x {what}, {ref:.4g}{noisy}", g, ref)
        st.remember(x)

    def _banded(self, judged: list[tuple[Entry, _State, float]], fire: _Fire) -> None:
        """Each tensor against the fixed band (1-D tensors: ten times wider on each side)."""
        assert self.ratio_band is not None
        lo, hi = self.ratio_band
        for e, st, r in judged:
            b_lo, b_hi = (lo / VECTOR_BAND_SLACK, hi * VECTOR_BAND_SLACK) if e.vector else (lo, hi)
            st.high = st.high + 1 if r > b_hi else 0
            st.low = st.low + 1 if r < b_lo else 0
            what = "1-D tensor band" if e.vector else "band"
            if st.high >= self.ratio_patience and (e.key, RATIO_HIGH) not in self._seen:  # (no message built twice)
                fire(e, RATIO_HIGH, f"update ratio {r:.3g} > {b_hi:g} ({what}) for {st.high} measured steps", r, b_hi)
            if st.low >= self.ratio_patience and (e.key, RATIO_LOW) not in self._seen:
                fire(e, RATIO_LOW, f"update ratio {r:.3g} < {b_lo:g} ({what}) for {st.low} measured steps", r, b_lo)

    def _calibrated(self, judged: list[tuple[Entry, _State, float]], fire: _Fire) -> None:
        """Each tensor against the median of its role's tensors this step, in log10, with a robust spread:
        its update ratio ‖Δw‖/‖w‖, and its update's size per entry ‖Δw‖/√n (which keeps the lr signal once
        large updates have grown ‖w‖, as a 30x lr does within a few steps). Either one out, persistently."""
        roles: dict[str, list[tuple[Entry, _State, float]]] = {}
        for item in judged:
            roles.setdefault(_role(item[0]), []).append(item)
        for role, group in roles.items():
            ratio = _outliers([r for _, _, r in group], self.ratio_decades, self.ratio_min_peers)
            size = _outliers([e.rms_update for e, _, _ in group], self.ratio_decades, self.ratio_min_peers)
            if ratio is None and size is None:
                for _, st, _ in group:  # no peers to compare with: no streak either
                    st.high = st.low = 0
                continue
            for k, (e, st, _) in enumerate(group):
                found = [
                    (what, o[0][k], o[1][k], o[2][k])
                    for what, o in (("update ratio", ratio), ("update size ‖Δw‖/√n", size))
                    if o
                ]
                high = [f for f in found if f[1] > 0]
                low = [f for f in found if f[1] < 0]
                st.high = st.high + 1 if high else 0
                st.low = st.low + 1 if low else 0
                for kind, hits, streak in ((RATIO_HIGH, high, st.high), (RATIO_LOW, low, st.low)):
                    if not hits or streak < self.ratio_patience or (e.key, kind) in self._seen:
                        continue
                    what, _, value, ref = hits[0]
                    times = (
                        f"{value / ref:.3g}x" if value >= ref else (f"1/{ref / value:.3g} x" if value > 0 else "0 x")
                    )
                    peers = f"the median {ref:.3g} of the run's {role} tensors"
                    detail = f"{what} {value:.3g} = {times} {peers}, for {streak} measured steps"
                    if size is not None and size[0][k] == 0 and e.rms_update is not None:
                        detail += _scale_clause(e, size[2][k], group)
                    fire(e, kind, detail, value, ref)

    def _emit(self, index: int, new: list[Alert]) -> None:
        if not new:  # the common step: no walk up the logging hierarchy
            return
        configured = _logging_configured()
        for kind in KINDS:
            group = [a for a in new if a.kind == kind]
            if not group:
                continue
            msg = _message(index, kind, group, banded=self.ratio_band is not None)
            if configured:
                log.warning("%s", msg)
            elif kind not in self._printed:  # nothing set up: the first of each kind on stderr
                self._printed.add(kind)
                print(f"{msg} (later '{kind}' alerts: gl.alerts.fired, and the report at close)", file=sys.stderr)


_HEADLINES = {
    NONFINITE: "non-finite gradient",
    SPIKE: "gradient-norm spike",
    RATIO_HIGH: "update ratio far above its peers'",
    RATIO_LOW: "update ratio far below its peers'",
    NO_GRAD: "no gradient",
}


def _role(e: Entry) -> str:
    """Tensors compared with each other: >= 2-D (weights, embeddings), 1-D biases (a scale of ~1/sqrt(fan_in)
    and the gradient of a sum: their ratio runs far above a norm gain's in healthy nets), other 1-D (norm gains)."""
    if not e.vector:
        return ">= 2-D"
    return "1-D bias" if e.name.rsplit(".", 1)[-1].endswith("bias") else "1-D (non-bias)"


def _rms(ratio: float, before_sumsq: float, numel: int) -> float | None:
    """‖Δw‖/√n from ‖Δw‖/‖w_before‖ and ‖w_before‖²."""
    if not (numel > 0 and before_sumsq > 0 and math.isfinite(ratio) and math.isfinite(before_sumsq)):
        return None
    return ratio * math.sqrt(before_sumsq / numel)


def _scale_clause(e: Entry, size_ref: float, group: Sequence[tuple[Entry, _State, float]]) -> str:
    """Why a ratio is out while the update per entry is not: ‖Δw‖/‖w‖ = (‖Δw‖/√n) / RMS(w), so it is the
    weights' own scale that sets the tensor apart (an initialisation), not its learning rate."""
    scales = [x.rms_update / r for x, _, r in group if x.rms_update is not None and r > 0]
    mine = e.rms_update / e.ratio if e.rms_update is not None and e.ratio else None
    if mine is None or not math.isfinite(mine) or mine <= 0 or not scales:
        return ""
    ref = 10 ** median([math.log10(v) for v in scales if v > 0 and math.isfinite(v)] or [math.log10(mine)])
    times = f"{mine / ref:.3g}x" if mine >= ref else f"1/{ref / mine:.3g} x"
    return (
        f"; its update per entry ‖Δw‖/√n {e.rms_update:.3g} is like its peers' ({size_ref:.3g}): its values' RMS "
        f"{mine:.3g} is {times} theirs ({ref:.3g}), so the weights' scale sets it apart, not the lr "
        "(an initialisation: nn.Embedding's default is N(0, 1))"
    )


def _outliers(
    values: Sequence[float | None], decades: float, min_peers: int
) -> tuple[list[float], list[float], list[float]] | None:
    """Per value: how far out it is (decades beyond the limit, signed; 0 within), the value, and the median,
    judged in log10 against the median and max(`decades`, RATIO_Z x 1.4826 MAD); None with too few values."""
    logs = [math.log10(v) if v is not None and v > 0 and math.isfinite(v) else None for v in values]
    finite = [x for x in logs if x is not None]
    if len(finite) < min_peers:
        return None
    mid = median(finite)
    limit = max(decades, RATIO_Z * 1.4826 * median([abs(x - mid) for x in finite]))
    out = []
    for x in logs:
        d = 0.0 if x is None else x - mid
        out.append(d - limit if d > limit else d + limit if d < -limit else 0.0)
    return out, [v if v is not None else math.nan for v in values], [10**mid] * len(values)


_BANDED = {RATIO_HIGH: "update ratio above the healthy band", RATIO_LOW: "update ratio below the healthy band"}


def _message(step: int, kind: str, alerts: list[Alert], banded: bool = False) -> str:
    shown = "; ".join(f"{a.name} ({a.detail})" for a in alerts[:_NAMES_SHOWN])
    more = f"; and {len(alerts) - _NAMES_SHOWN} more" if len(alerts) > _NAMES_SHOWN else ""
    n = len(alerts)
    head = (_BANDED if banded else _HEADLINES).get(kind, _HEADLINES[kind])
    return f"gradlog alert at optimizer step {step}: {head} in {n} tensor{'s' * (n != 1)}: {shown}{more}"
