"""Alerts during training: say so the moment a tensor looks wrong, not only in the table at close.

Everything here works on host-side numbers the logger already fetched, so alerts cost no device
work. Each tensor alerts at most once per kind; one message per measured step and kind names every
tensor that newly alerted, so a NaN loss that hits 400 tensors is one line, not 400.

Each tensor is judged against what is normal *in this run* (measured on GPT-2, Mixtral, a ViT, a
ResNet with SGD+momentum and LoRA, see tests/test_calibrated.py):

- a tensor whose gradient is rounding noise at a step (`NOISE_FRACTION`) is not judged low there: Adam
  barely moves an attention key bias, to which softmax is invariant (`verdict.rounding`'s `tiny_update`);
- the update ratio ‖Δw‖/‖w‖ is calibrated (the default, ``ratio_band=None``): at each measured step it
  is compared, in log10, with the median of the run's other tensors of the same role (weight matrices,
  embeddings and other >= 2-D tensors; 1-D tensors: norm gains, biases), with a robust spread (1.4826 x
  the median absolute deviation). A tensor is an outlier when it sits more than
  max(`ratio_decades`, `RATIO_Z` x spread) decades from that median, and it is named when it stays one
  for `ratio_patience` measured steps in a row (its own history: one odd step is not a finding). No
  fixed band fits healthy runs: AdamW at 1e-3 gives ratios near 1e-2 early on, SGD+momentum spreads
  them over a decade, and a warmup moves them all together; a tensor trained at 30x (or 1e-4x) its
  peers' learning rate stands out against its peers in every one of them. The same is asked of the update
  size per entry ‖Δw‖/√n, which carries the lr even after large updates have grown ‖w‖; where it is known,
  a tensor is named only when it is out too (on the ratio's side): ‖Δw‖/‖w‖ = (‖Δw‖/√n) / RMS(w), so a
  ratio out while the update per entry is like its peers' is the weights' own scale, set on purpose by
  stock models (Mamba's A_log, ConvNeXt's layer scale at 1e-6, Wav2Vec2's weight-norm magnitude, an
  embedding at nn.Embedding's N(0, 1): each a warning on a healthy run of the calibration zoo, tests/zoo.py,
  until issue 38). Roles with fewer than `ratio_min_peers` tensors are not judged (there is no "normal" to
  compare with);
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
  Such a norm is a candidate, not yet an alert: a spike is a jump that comes back, so it is judged on
  the next measured norms (`SPIKE_CONFIRM`, `SPIKE_FALLBACK`) and named at its own step when they came
  back; a level change within one measured interval (a masked LM leaving its loss plateau: attention
  gradient norms up ~10x for good) stays up and is no spike. The run's end judges a candidate on what
  came after it; one at the last measured step is named (nothing tells it from a real spike's start).
  A norm at rounding-noise level (`NOISE_FRACTION` of the step's median tensor norm: an attention key
  bias) is no candidate: its noise jumps 100x from step to step.
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
from gradlog.verdict.report import ALERT_COLUMNS, CONSOLE_WIDTH, WARNING_KINDS, Alert, wrapped
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
#: A spike is a jump that comes back. A candidate is named, at its own step, as soon as a later measured norm of
#: its tensor is back below halfway (log10) between its reference and its limit (3.2x the reference at the
#: default factor 10); else it is judged on its next SPIKE_CONFIRM norms: a spike if their median fell at
#: least SPIKE_FALLBACK of the jump (log10) back from it, a lasting level change (no alert) otherwise: a masked
#: LM leaving its loss plateau, whose attention gradient norms rise ~10x and stay there. Measured on GPT-2
#: (every=2): a one-step loss x1000 is back at the next measured step; a one-step lr x100 kicks the weights,
#: and the norms it raised 10-24x fall back slowly: the median of the next 3 by 27% of the jump (log10) on the
#: tensor that fell most (named, at step 20), 10-22% on the three others (not named).
SPIKE_CONFIRM = 3
SPIKE_FALLBACK = 0.25
#: A tensor that jumps alone (no tensor of another layer past its own limit at that measured step) is named only
#: from this many times the factor (30x at the default 10). A layer's weight and bias are one: the Perceiver's
#: decoder query weight and bias jumped 24x together for one step on a healthy run (tests/zoo5.py), the bias's
#: gradient being the sum of the weight's error signals. Healthy tiny-batch runs show lone one-step jumps of
#: 13-15x in one tensor that come back at once (RoBERTa's layer-0 query under Trainer, DistilBERT's layer-0 FFN bias
#: with a hard batch: tests/zoo.py); what breaks a run moves many tensors at once (a garbage batch, a lr kick:
#: 4 tensors past 10x on GPT-2) or one layer far more (a layer's gradient x100).
LONE_SPIKE_FACTOR = 3.0
#: A gradient norm below this fraction of the median norm of the step's tensors is rounding noise, not a
#: gradient (an attention key bias, to which softmax is invariant: ~1e-9 beside ~1e-2; the same fact
#: `verdict.rounding` calls a harmless `tiny_update`). Such a step is judged by neither the spike rule nor
#: the update-ratio rule: Adam barely moves such a tensor, and its noise jumps 100x from step to step.
#: Measured at every=5 on the zoo (tests/zoo.py): SimSiam's biases in front of BatchNorms at 3e-8 .. 8e-8 of
#: the median, attention key biases at 3e-11 .. 2e-8 (Swin, the diffusers UNet), the lowest learning tensors at
#: 1.8e-4 (Mamba's dt_proj) and 3.4e-4 (a ConvNeXt LayerNorm behind its 1e-6 layer scale).
NOISE_FRACTION = 1e-5
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


def _layer(name: str) -> str:
    """The layer a tensor belongs to, for telling a lone jump from a shared one (`LONE_SPIKE_FACTOR`): its
    module's name (`dec.q.weight` and `dec.q.bias` are one layer, whose bias gradient is the sum of the weight
    gradient's error signals: they jump together by construction); a tensor with no module prefix is its own."""
    module, dot, _ = name.rpartition(".")
    return module if dot else name


@dataclass
class _Candidate:
    """A norm past the spike limit at `step`, judged once later norms say whether it came back."""

    step: int
    entry: Entry
    norm: float
    ref: float  # log10 of the reference norm
    what: str
    limit: float  # log10 of the limit, as a factor
    later: list[float] = field(default_factory=list)  # log10 of the tensor's later non-zero norms
    back: int | None = None  # the step of the first later norm back below halfway to the limit

    def see(self, step: int, log_norm: float) -> None:
        self.later.append(log_norm)
        if log_norm <= self.ref + self.limit / 2:
            self.back = step

    def settled(self) -> bool:
        """Whether the later norms decide it: one came back, or SPIKE_CONFIRM of them were seen."""
        return self.back is not None or len(self.later) >= SPIKE_CONFIRM

    def spike(self) -> bool:
        """A jump that came back (or fell back SPIKE_FALLBACK of the way), or one the run ended at."""
        if self.back is not None or not self.later:
            return True
        x = math.log10(self.norm)
        return median(self.later) <= x - SPIKE_FALLBACK * (x - self.ref)


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
    #: a spike candidate waiting for a later norm to come back (a spike) or SPIKE_PATIENCE not to (a level change)
    pending: _Candidate | None = None

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
        self,
        e: Entry,
        kind: str,
        detail: str,
        value: float | None = None,
        ref: float | None = None,
        at: int | None = None,
    ) -> None: ...


class _Noise:
    """Whether a norm is rounding noise at this step (`NOISE_FRACTION` of the median norm of the step's
    tensors with a gradient): the median is made only when asked, which few steps need."""

    def __init__(self, entries: Sequence[Entry]) -> None:
        self.entries = entries
        self.floor: float | None = None

    def __call__(self, g: float | None) -> bool:
        if g is None:
            return False
        if self.floor is None:
            norms = [e.grad_norm for e in self.entries if e.has_grad and e.grad_norm is not None]
            finite = [x for x in norms if math.isfinite(x) and x > 0]
            self.floor = NOISE_FRACTION * median(finite) if finite else 0.0
        return g < self.floor


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
        self._candidates_at: dict[int, set[str]] = {}  # measured step -> layers with a spike candidate there
        self._levels: dict[tuple[str, str], _HeldLevel] = {}  # (role, measure) -> the highest median it held
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
            has_ratio = ratios is not None and row.group is not None and before is not None and host.has_ratio(i)
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
                    vector=len(row.shape) <= 1,  # the whole tensor's (an FSDP1 slice is 1-D)
                    rms_update=_rms(ratios[i], before[i], row.numel)
                    if has_ratio and ratios is not None and before is not None
                    else None,
                )
            )
        return self.step(m.index, entries, skipped=m.skipped)

    def step(self, index: int, entries: Sequence[Entry], skipped: bool = False) -> list[Alert]:
        """Judge one measured step given per-tensor entries (the report replays runs from disk through this)."""
        new: list[Alert] = []
        fire = self._firer(index, new)
        noise = _Noise(entries)

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
                self._spike(index, e, st, g, fire, noise)
            r = e.ratio
            if r is None or math.isnan(r):
                continue
            st.ratios += 1
            if st.ratios == 1:
                st.zero_init = bool(e.zero_start)
            if st.zero_init:
                continue  # no scale of its own yet: ‖Δw‖/‖w‖ falls like 1/t whatever the lr
            judged.append((e, st, r))
        judged = _with_signal(judged, noise)
        if self.ratio_band is not None:
            self._banded(judged, fire, noise)
        else:
            self._calibrated(judged, fire, noise)
        self.fired.extend(new)
        if self.emit:
            self._emit(index, new)
        return new

    def _firer(self, index: int, new: list[Alert]) -> _Fire:
        """The `fire` of one measured step (`index`): each tensor alerts at most once per kind; `at` names
        another step (a spike confirmed later is named at its own step)."""

        def fire(
            e: Entry,
            kind: str,
            detail: str,
            value: float | None = None,
            ref: float | None = None,
            at: int | None = None,
        ) -> None:
            if (e.key, kind) not in self._seen:
                self._seen.add((e.key, kind))
                new.append(Alert(index if at is None else at, kind, e.name, detail, value, ref))

        return fire

    def _spike(self, index: int, e: Entry, st: _State, g: float, fire: _Fire, noise: _Noise) -> None:
        """Judge `g` against the tensor's own history (module docstring), then add it to that history. A norm
        past the limit is a candidate, named when later norms come back (`SPIKE_CONFIRM`), dropped when they stay
        up (a level change); a norm at rounding-noise level is no candidate (its noise jumps 100x)."""
        x = math.log10(g)
        pending = st.pending
        if pending is not None:
            pending.see(index, x)
            if pending.settled():
                st.pending = None
                self._settle(pending, fire)
        elif (e.key, SPIKE) not in self._seen and len(st.logs) >= SPIKE_MIN_HISTORY:
            found = st.spike(x, self.spike_factor)
            if found is not None and not noise(g):
                ref, what, limit = found
                st.pending = _Candidate(index, e, g, math.log10(ref), what, math.log10(limit))
                self._candidates_at.setdefault(index, set()).add(_layer(e.name))
        st.remember(x)

    def _settle(self, c: _Candidate, fire: _Fire) -> None:
        """Name candidate `c` at its own step if it came back; a lasting level change is no spike."""
        found = self._judged(c)
        if found is not None:
            fire(c.entry, SPIKE, found.detail, found.value, found.reference, at=c.step)

    def _judged(self, c: _Candidate) -> Alert | None:
        """The spike alert candidate `c` makes: named when a later norm came back, or when the run ended at it
        (no later norm tells it from a real spike's start); None when its norm stayed up (a level change)."""
        if not c.spike():
            return None
        ref, limit = 10**c.ref, 10**c.limit
        alone = len(self._candidates_at.get(c.step, ())) < 2
        if alone and c.norm / ref < LONE_SPIKE_FACTOR * max(limit, self.spike_factor):
            return None  # one tensor's lone jump within 30x: seen in healthy runs (LONE_SPIKE_FACTOR)
        noisy = f"; its steps vary enough that only > {limit:.3g}x counts" if limit > self.spike_factor else ""
        n = len(c.later)
        if c.back is not None:
            after = f"; back to {10 ** c.later[-1]:.4g} at step {c.back} ({n} measured step{'s' * (n != 1)} later)"
        elif n:
            after = f"; falling back: the median of the next {n} measured norms is {10 ** median(c.later):.4g}"
        else:
            after = "; the run ended before a later measured step"
        detail = f"grad norm {c.norm:.4g} = {c.norm / ref:.3g}x {c.what}, {ref:.4g}{noisy}{after}"
        return Alert(c.step, SPIKE, c.entry.name, detail, c.norm, ref)

    def finish(self) -> list[Alert]:
        """At the end of the run: judge the spike candidates still waiting on the norms they have (a candidate
        at the last measured step is named: nothing tells it from the start of a real spike); log (or print)
        and return the alerts this raised."""
        new: list[Alert] = []
        fire = self._firer(-1, new)
        for st in self._state.values():
            c, st.pending = st.pending, None
            if c is not None:
                self._settle(c, fire)
        new.sort(key=lambda a: a.step)
        self.fired.extend(new)
        if self.emit:
            self._emit(-1, new)
        return new

    def settled(self) -> list[Alert]:
        """The alerts fired so far and those the waiting spike candidates would give if the run ended now (for
        a report made mid-run: a provisional table), without changing any state."""
        extra = [self._judged(st.pending) for st in self._state.values() if st.pending is not None]
        return [*self.fired, *sorted((a for a in extra if a is not None), key=lambda a: a.step)]

    def _banded(self, judged: list[tuple[Entry, _State, float]], fire: _Fire, noise: _Noise) -> None:
        """Each tensor against the fixed band (1-D tensors: ten times wider on each side). A low ratio with a
        rounding-noise gradient (`NOISE_FRACTION`) neither counts nor breaks the low streak."""
        assert self.ratio_band is not None
        lo, hi = self.ratio_band
        for e, st, r in judged:
            b_lo, b_hi = (lo / VECTOR_BAND_SLACK, hi * VECTOR_BAND_SLACK) if e.vector else (lo, hi)
            st.high = st.high + 1 if r > b_hi else 0
            if not (r < b_lo and noise(e.grad_norm)):
                st.low = st.low + 1 if r < b_lo else 0
            what = "1-D tensor band" if e.vector else "band"
            if st.high >= self.ratio_patience and (e.key, RATIO_HIGH) not in self._seen:  # (no message built twice)
                fire(e, RATIO_HIGH, f"update ratio {r:.3g} > {b_hi:g} ({what}) for {st.high} measured steps", r, b_hi)
            if st.low >= self.ratio_patience and (e.key, RATIO_LOW) not in self._seen:
                fire(e, RATIO_LOW, f"update ratio {r:.3g} < {b_lo:g} ({what}) for {st.low} measured steps", r, b_lo)

    def _level(self, role: str, measure: str) -> _HeldLevel:
        """The held level of a role's median update ratio ("r") or update size ("s"), made on first use."""
        key = (role, measure)
        if key not in self._levels:
            self._levels[key] = _HeldLevel(self.ratio_patience)
        return self._levels[key]

    def _calibrated(self, judged: list[tuple[Entry, _State, float]], fire: _Fire, noise: _Noise) -> None:
        """Each tensor against the median of its role's tensors this step, in log10, with a robust spread:
        its update ratio ‖Δw‖/‖w‖, and its update's size per entry ‖Δw‖/√n (which keeps the lr signal once
        large updates have grown ‖w‖, as a 30x lr does within a few steps). Out persistently: the size, and the
        ratio on the same side where the size is known (`_with_the_size`), the ratio alone where it is not.
        A tensor whose gradient is rounding noise (`NOISE_FRACTION`: an attention key bias, which softmax
        ignores) is left out first (`_with_signal`): that step neither counts nor breaks its streaks."""
        roles: dict[str, list[tuple[Entry, _State, float]]] = {}
        for item in judged:
            roles.setdefault(_role(item[0]), []).append(item)
        for role, group in roles.items():
            ratio = _outliers(
                [r for _, _, r in group], self.ratio_decades, self.ratio_min_peers, self._level(role, "r")
            )
            sizes = [e.rms_update for e, _, _ in group]
            size = _outliers(sizes, self.ratio_decades, self.ratio_min_peers, self._level(role, "s"))
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
                mids = {what: o[3] for what, o in (("update ratio", ratio), ("update size ‖Δw‖/√n", size)) if o}
                if size is not None and e.rms_update is not None:
                    found = _with_the_size(found, size[0][k])
                high = [f for f in found if f[1] > 0]
                low = [f for f in found if f[1] < 0]
                st.high = st.high + 1 if high else 0
                if not (low and noise(e.grad_norm)):
                    st.low = st.low + 1 if low else 0
                for kind, hits, streak in ((RATIO_HIGH, high, st.high), (RATIO_LOW, low, st.low)):
                    if not hits or streak < self.ratio_patience or (e.key, kind) in self._seen:
                        continue
                    what, _, value, ref = hits[0]
                    times = (
                        f"{value / ref:.3g}x" if value >= ref else (f"1/{ref / value:.3g} x" if value > 0 else "0 x")
                    )
                    peers = f"the median {ref:.3g} of the run's {role} tensors"
                    if kind == RATIO_HIGH and ref > mids[what]:  # the peers' median fell: the level it held
                        peers = (
                            f"the level {ref:.3g} the median of the run's {role} tensors held (now {mids[what]:.3g})"
                        )
                    detail = f"{what} {value:.3g} = {times} {peers}, for {streak} measured steps"
                    fire(e, kind, detail, value, ref)

    def _emit(self, index: int, new: list[Alert]) -> None:
        """One message per kind and step the alerts name (a spike is confirmed, and so said, a few measured
        steps after its own step `a.step`, which its message names)."""
        if not new:  # the common step: no walk up the logging hierarchy
            return
        configured = _logging_configured()
        for kind, step in dict.fromkeys((a.kind, a.step) for a in sorted(new, key=lambda a: KINDS.index(a.kind))):
            group = [a for a in new if a.kind == kind and a.step == step]
            confirmed = index if step != index and index >= 0 else None
            msg = _message(step, kind, group, banded=self.ratio_band is not None, confirmed=confirmed)
            if configured:
                log.warning("%s", msg)
            elif kind not in self._printed:  # nothing set up: the first of each kind on stderr
                self._printed.add(kind)
                later = f"(later '{kind}' alerts: gl.alerts.fired, and the report at close)"
                print(f"{msg}\n{wrapped(_INDENT + later, CONSOLE_WIDTH, _INDENT)}", file=sys.stderr)


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


def _with_signal(judged: list[tuple[Entry, _State, float]], noise: _Noise) -> list[tuple[Entry, _State, float]]:
    """The tensors whose gradient this step is more than rounding noise (`_Noise`): a gradient zero by
    construction (a bias in front of a BatchNorm, which takes any shift back out; an attention key bias, which
    softmax ignores: ~1e-9 where their peers' are ~1e-2) leaves an update of weight decay and noise. Such a
    tensor says nothing about its lr, and as a peer it drags its role's median down until a healthy tensor
    reads as 1,000x out (SimSiam's predictor bias among three biases in front of BatchNorms, tests/zoo.py)."""
    return [item for item in judged if not noise(item[0].grad_norm)]


#: one measure out for a tensor: what it is, how far out (signed decades beyond the limit), its value, the median
_Hit = tuple[str, float, float, float]


def _with_the_size(
    found: list[tuple[str, float, float, float]], size_out: float
) -> list[tuple[str, float, float, float]]:
    """The hits that count where the update size per entry ‖Δw‖/√n is known: only those on the side its own
    outlier is (none while it is like its peers'). ‖Δw‖/‖w‖ = (‖Δw‖/√n) / RMS(w): a ratio out while the update
    per entry is not is the weights' own scale, which stock models set on purpose (Mamba's A_log = log 1..16,
    ConvNeXt's layer scale at 1e-6, a weight-norm magnitude, an embedding at nn.Embedding's N(0, 1)); the lr
    moves both numbers together."""
    return [f for f in found if size_out != 0 and (f[1] > 0) == (size_out > 0)]


class _HeldLevel:
    """The highest log10 median a role's measure held for `patience` measured steps in a row (a level, not one
    step's kick): the reference above which a tensor is called high once its peers' median has fallen below it."""

    def __init__(self, patience: int) -> None:
        self.recent: deque[float] = deque(maxlen=patience)
        self.peak = -math.inf

    def see(self, mid: float) -> float:
        self.recent.append(mid)
        if len(self.recent) == self.recent.maxlen:
            self.peak = max(self.peak, min(self.recent))
        return self.peak


def _outliers(
    values: Sequence[float | None], decades: float, min_peers: int, level: _HeldLevel | None = None
) -> tuple[list[float], list[float], list[float], float] | None:
    """Per value: how far out it is (decades beyond the limit, signed; 0 within), the value, and its reference,
    judged in log10 against the median and max(`decades`, RATIO_Z x 1.4826 MAD), then the median itself; None
    with too few values. Above the median the reference is the higher of the median and the highest level the
    median held (`level`): when a run converges, Adam's and SGD's updates shrink in most tensors while one still
    carries the loss's last gradient (DeBERTa's last LayerNorm at 6e-4, lr 1e-3, beside peers at 3e-5: 19x
    their median, tests/zoo.py); a tensor is high only above what its peers did in this run, which a tensor at
    30x its peers' lr is from its first steps."""
    logs = [math.log10(v) if v is not None and v > 0 and math.isfinite(v) else None for v in values]
    finite = [x for x in logs if x is not None]
    if len(finite) < min_peers:
        return None
    mid = median(finite)
    top = max(mid, level.see(mid)) if level is not None else mid
    limit = max(decades, RATIO_Z * 1.4826 * median([abs(x - mid) for x in finite]))
    out, refs = [], []
    for x in logs:
        d = 0.0 if x is None else x - mid
        up = 0.0 if x is None else x - top
        out.append(up - limit if up > limit else d + limit if d < -limit else 0.0)
        refs.append(10 ** (top if x is not None and up > limit else mid))
    return out, [v if v is not None else math.nan for v in values], refs, 10**mid


_BANDED = {RATIO_HIGH: "update ratio above the healthy band", RATIO_LOW: "update ratio below the healthy band"}


#: the indent of an alert's lines after its first (`_message`), and of a wrapped line's continuation beyond that
_INDENT = "  "


def _message(step: int, kind: str, alerts: list[Alert], banded: bool = False, confirmed: int | None = None) -> str:
    """What and when on the first line, then each tensor named with its evidence on a line of its own (the
    evidence under the name where both do not fit): every line within CONSOLE_WIDTH (wrapped at spaces; a tensor
    name longer than that stays whole). On one line, two tensors' evidence made a message of 214 characters on
    stderr, five long-named ones 591, that a terminal broke mid-word."""
    n = len(alerts)
    head = (_BANDED if banded else _HEADLINES).get(kind, _HEADLINES[kind])
    when = f"optimizer step {step}" + (f" (confirmed at {confirmed})" if confirmed is not None else "")
    lines = [wrapped(f"gradlog alert at {when}: {head} in {n} tensor{'s' * (n != 1)}", CONSOLE_WIDTH, _INDENT)]
    for a in alerts[:_NAMES_SHOWN]:
        line = f"{_INDENT}{a.name}: {a.detail}"
        if len(line) > CONSOLE_WIDTH:
            line = f"{_INDENT}{a.name}:\n{wrapped(_INDENT * 2 + a.detail, CONSOLE_WIDTH, _INDENT * 2)}"
        lines.append(line)
    if n > _NAMES_SHOWN:
        lines.append(f"{_INDENT}and {n - _NAMES_SHOWN} more")
    return "\n".join(lines)
