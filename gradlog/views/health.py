"""The health report `gradlog report` prints: what gradlog found at close, plus what the series show.

From the tables gradlog wrote at close: the never-updated tensors and the first non-finite gradient.
From the per-step series: tensors whose update ratio sat outside a healthy band for most of the run,
and tensors whose gradient norm spiked far above its own running median.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from gradlog.readers.run import RunData
from gradlog.verdict.alerts import DEFAULT_RATIO_BAND
from gradlog.verdict.report import COLUMNS, format_table

DEFAULT_SPIKE_FACTOR = 10.0
#: A running median needs some history before a spike against it means anything.
SPIKE_MIN_HISTORY = 5


@dataclass(frozen=True)
class NeverUpdatedRow:
    name: str
    shape: str
    numel: str
    reason: str
    detail: str


@dataclass(frozen=True)
class FirstNonFinite:
    step: int
    tensor: str


@dataclass(frozen=True)
class OutOfBand:
    """A tensor whose update ratio was outside the band on `outside` of its `measured` steps."""

    name: str
    outside: int
    measured: int
    median_ratio: float
    side: str  # "high", "low" or "both"


@dataclass(frozen=True)
class Spike:
    """A tensor's worst gradient-norm spike: `value` at `step` against the running `median` before it."""

    name: str
    step: int
    value: float
    median: float
    count: int  # how many measured steps spiked


@dataclass
class Health:
    path: str
    backend: str
    band: tuple[float, float]
    spike_factor: float
    measured_steps: int
    tensors: int
    never_updated: list[NeverUpdatedRow] = field(default_factory=list)
    never_updated_known: bool = False  # False when the run never wrote its table (it did not close)
    summary: dict[str, str] = field(default_factory=dict)
    first_nonfinite: FirstNonFinite | None = None
    out_of_band: list[OutOfBand] = field(default_factory=list)
    spikes: list[Spike] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    #: The run never closed: the tables are the last provisional ones, as of this step.
    provisional_step: int | None = None

    @property
    def problems(self) -> bool:
        """Anything a user should look at: a non-frozen never-updated tensor, NaN/Inf, out of band, spikes."""
        intentional = all(r.reason == "frozen" for r in self.never_updated)
        recorded = self.summary.get("healthy", "True") == "True"
        return (
            not (intentional and recorded) or self.first_nonfinite is not None or bool(self.out_of_band or self.spikes)
        )

    @property
    def healthy(self) -> bool:
        """No problems, and the run closed (so its never-updated table is known) and was read in full."""
        return not self.problems and self.never_updated_known and not self.skipped and self.provisional_step is None

    @property
    def verdict(self) -> str:
        parts = []
        if self.provisional_step is not None:
            parts.append(f"as of step {self.provisional_step}, run did not close")
        if not self.never_updated_known:
            parts.append("no never-updated table (the run did not close: crashed or still running)")
        elif self.never_updated:
            by: dict[str, int] = {}
            for r in self.never_updated:
                by[r.reason] = by.get(r.reason, 0) + 1
            counts = ", ".join(f"{k} {v}" for k, v in by.items())
            parts.append(f"{len(self.never_updated)} of {self.tensors} tensors never updated ({counts})")
        else:
            parts.append(f"all {self.tensors} tensors were updated")
        if self.first_nonfinite is not None:
            f = self.first_nonfinite
            parts.append(f"first non-finite gradient at step {f.step} in {f.tensor}")
        lo, hi = self.band
        if self.out_of_band:
            n = len(self.out_of_band)
            parts.append(f"{n} tensor{'s' * (n != 1)} with update ratio outside {lo:g}..{hi:g} most of the run")
        if self.spikes:
            n = len(self.spikes)
            parts.append(f"{n} tensor{'s' * (n != 1)} with gradient-norm spikes > {self.spike_factor:g}x median")
        if self.skipped:
            parts.append(f"{len(self.skipped)} unreadable part{'s' * (len(self.skipped) != 1)} skipped")
        head = "PROBLEM" if self.problems else "OK" if self.healthy else "INCOMPLETE"
        return f"gradlog {head}: " + "; ".join(parts) + f" ({self.measured_steps} measured steps)"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["healthy"] = self.healthy
        out["problems"] = self.problems
        out["verdict"] = self.verdict
        out["band"] = list(self.band)
        return out

    def text(self) -> str:
        lines = [
            f"gradlog report: {self.path} ({self.backend}, {self.tensors} tensors, {self.measured_steps} measured)"
        ]
        lines.append("")
        if not self.never_updated_known:
            lines.append("Never updated: unknown (no gradlog/never_updated table: the run did not call close())")
        elif self.never_updated:
            when = "" if self.provisional_step is None else f", as of step {self.provisional_step}, run did not close"
            lines.append(f"Never updated ({len(self.never_updated)}{when}):")
            rows = [[r.name, r.shape, r.numel, r.reason, r.detail] for r in self.never_updated]
            lines.append(_indent(format_table(COLUMNS, rows)))
        elif self.provisional_step is not None:
            lines.append(f"Never updated: none as of step {self.provisional_step} (run did not close)")
        else:
            lines.append("Never updated: none")
        lines.append("")
        if self.first_nonfinite is not None:
            f = self.first_nonfinite
            lines.append(f"First non-finite gradient: step {f.step}, {f.tensor}")
        else:
            lines.append("First non-finite gradient: none")
        lo, hi = self.band
        lines.append("")
        if self.out_of_band:
            lines.append(f"Update ratio outside {lo:g}..{hi:g} for most of the run ({len(self.out_of_band)}):")
            rows = [[o.name, o.side, f"{o.outside}/{o.measured}", f"{o.median_ratio:.3g}"] for o in self.out_of_band]
            lines.append(_indent(format_table(["name", "side", "steps outside", "median ratio"], rows)))
        else:
            lines.append(f"Update ratio outside {lo:g}..{hi:g} for most of the run: none")
        lines.append("")
        if self.spikes:
            lines.append(f"Gradient-norm spikes (> {self.spike_factor:g}x running median) ({len(self.spikes)}):")
            rows = [[s.name, str(s.step), f"{s.value:.4g}", f"{s.median:.4g}", str(s.count)] for s in self.spikes]
            lines.append(_indent(format_table(["name", "worst step", "grad norm", "median before", "spikes"], rows)))
        else:
            lines.append(f"Gradient-norm spikes (> {self.spike_factor:g}x running median): none")
        if self.skipped:
            lines.append("")
            lines.append("Skipped (unreadable):")
            lines += [f"  {s}" for s in self.skipped]
        lines.append("")
        lines.append(self.verdict)
        return "\n".join(lines)


def _indent(block: str) -> str:
    return "\n".join("  " + ln for ln in block.splitlines())


def _names(run: RunData, prefix: str) -> list[str]:
    return [t[len(prefix) :] for t in run.scalars if t.startswith(prefix)]


def out_of_band(
    run: RunData,
    band: Sequence[float],
    exclude: Collection[str] = (),
) -> list[OutOfBand]:
    """Tensors whose finite update ratio was outside `band` on more than half of their measured steps."""
    lo, hi = float(band[0]), float(band[1])
    found = []
    for name in _names(run, "update_ratio/"):
        if name in exclude:
            continue
        values = [v for _, v in run.scalars[f"update_ratio/{name}"] if math.isfinite(v)]
        if not values:
            continue
        high = sum(v > hi for v in values)
        low = sum(v < lo for v in values)
        if 2 * (high + low) > len(values):
            side = "high" if high and not low else "low" if low and not high else "both"
            found.append(OutOfBand(name, high + low, len(values), _median(values), side))
    return found


def spikes(run: RunData, factor: float, min_history: int = SPIKE_MIN_HISTORY) -> list[Spike]:
    """Tensors whose gradient norm exceeded `factor` times the median of its own earlier finite values."""
    found = []
    for name in _names(run, "grad_norm/"):
        history: list[float] = []
        worst: tuple[float, int, float, float] | None = None  # (ratio, step, value, median)
        count = 0
        for step, v in run.scalars[f"grad_norm/{name}"]:
            if not math.isfinite(v):
                continue  # NaN/Inf are the non-finite finding, not a spike
            if len(history) >= min_history:
                med = _median_sorted(history)
                if med > 0 and v > factor * med:
                    count += 1
                    if worst is None or v / med > worst[0]:
                        worst = (v / med, step, v, med)
            bisect.insort(history, v)
        if worst is not None:
            found.append(Spike(name, worst[1], worst[2], worst[3], count))
    return found


def _median_sorted(xs: list[float]) -> float:
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def _median(values: list[float]) -> float:
    return _median_sorted(sorted(values))


def _first_nonfinite(run: RunData, summary: dict[str, str]) -> FirstNonFinite | None:
    """From the summary gradlog wrote at close; for a run that never closed, from the per-tensor series."""
    if "first_nonfinite_step" in summary and "first_nonfinite_tensor" in summary:
        try:
            return FirstNonFinite(int(summary["first_nonfinite_step"]), summary["first_nonfinite_tensor"])
        except ValueError:
            pass
    best: tuple[int, str] | None = None
    for name in _names(run, "grad_nonfinite/"):
        for step, v in run.scalars[f"grad_nonfinite/{name}"]:
            if v != 0:  # a count of NaN/Inf entries (itself never NaN)
                if best is None or step < best[0]:
                    best = (step, name)
                break
    return None if best is None else FirstNonFinite(*best)


def analyze(
    run: RunData, band: Sequence[float] = DEFAULT_RATIO_BAND, spike_factor: float = DEFAULT_SPIKE_FACTOR
) -> Health:
    """The health report of one run read back from disk (or from a MemoryWriter)."""
    summary: dict[str, str] = {}
    if "gradlog/summary" in run.tables:
        cols, rows = run.tables["gradlog/summary"]
        summary = {r[0]: r[1] for r in rows if len(r) >= 2}
    never: list[NeverUpdatedRow] = []
    known = "gradlog/never_updated" in run.tables
    if known:
        cols, rows = run.tables["gradlog/never_updated"]
        index = {c: i for i, c in enumerate(cols)}
        for r in rows:
            cell = {c: (r[index[c]] if c in index and index[c] < len(r) else "") for c in COLUMNS}
            never.append(NeverUpdatedRow(**cell))
    names = {t.split("/", 1)[1] for t in run.scalars if t.startswith(("weight_norm/", "grad_norm/", "update_ratio/"))}
    steps = {s for t, pts in run.scalars.items() if t.startswith(("grad_norm/", "weight_norm/")) for s, _ in pts}
    measured = int(summary["measured_steps"]) if summary.get("measured_steps", "").isdigit() else len(steps)
    never_names = {r.name.split(" (= ", 1)[0] for r in never}
    return Health(
        path=run.path,
        backend=run.backend,
        band=(float(band[0]), float(band[1])),
        spike_factor=float(spike_factor),
        measured_steps=measured,
        tensors=len(names | never_names),
        never_updated=never,
        never_updated_known=known,
        summary=summary,
        first_nonfinite=_first_nonfinite(run, summary),
        out_of_band=out_of_band(run, band, exclude=never_names),
        spikes=spikes(run, spike_factor),
        skipped=list(run.skipped),
        provisional_step=run.provisional_step,
    )
