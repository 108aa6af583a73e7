"""The health report `gradlog report` prints: what gradlog found at close, plus what the series show.

From the tables gradlog wrote at close: the never-updated tensors and the first non-finite gradient.
From the per-step series: tensors whose update ratio sat outside a healthy band for most of the run,
and tensors whose gradient norm spiked far above its own running median, last norm and noise.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Collection, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from gradlog.readers.run import load
from gradlog.runformat import names, tags
from gradlog.runformat.cells import bare_name, table_cells
from gradlog.runformat.files import shown
from gradlog.runformat.rundata import RunData
from gradlog.runformat.wandb_offline import WandbFileError, find_run_files, read_finished_run
from gradlog.verdict.alerts import (
    DEFAULT_SPIKE_FACTOR,
    RATIO_HIGH,
    RATIO_LOW,
    SPIKE,
    WARNING_KINDS,
    Alerts,
    Entry,
)
from gradlog.verdict.judge import Verdict, finding_lines, judge, plural
from gradlog.verdict.policy import Policy
from gradlog.verdict.report import (
    COLUMNS,
    CONSOLE_WIDTH,
    FINDINGS,
    TITLES,
    Alert,
    IdleExperts,
    NeverUpdated,
    PartlyUpdated,
    PrecisionLoss,
    Report,
    Section,
    Stalled,
    StoppedSlice,
    format_table,
    grouped_rows,
)
from gradlog.verdict.tables import closed_report, read_alerts, series_first_nonfinite, series_names, series_steps

__all__ = ["DEFAULT_SPIKE_FACTOR", "Finding", "Health", "analyze", "replay"]


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
class Finding:
    """A warning about one tensor (an alert kind from `gradlog.verdict.alerts`), at the step it was first seen."""

    name: str
    kind: str
    step: int
    detail: str


@dataclass
class Health:
    path: str
    backend: str
    band: tuple[float, float] | None  # None: update ratios calibrated against the run's own tensors
    spike_factor: float
    measured_steps: int
    tensors: int
    #: the never-updated table's cells as the run wrote them (a damaged or unknown cell reads as written)
    never_updated: list[NeverUpdatedRow] = field(default_factory=list)
    never_updated_known: bool = False  # False when the run never wrote its table (it did not close)
    #: the other close-time records, read back from their tables (`to_dict()`: as `Report.to_dict()` writes them)
    partly_updated: list[PartlyUpdated] = field(default_factory=list)
    stalled: list[Stalled] = field(default_factory=list)
    #: the slice-level records in time: stopped slices, experts, updates rounded away
    stopped_slices: list[StoppedSlice] = field(default_factory=list)
    experts: list[IdleExperts] = field(default_factory=list)
    precision: list[PrecisionLoss] = field(default_factory=list)
    #: the close-time tables as the console prints them, from the rebuilt Report (`Report.sections`)
    sections: list[Section] = field(default_factory=list)
    #: the never-updated table as printed: one row per cause (a layer's tensors left out of the optimizer in
    #: one row, `gradlog.verdict.causes`), every row of the written table otherwise (no Report rebuilt)
    never_rows: list[list[str]] = field(default_factory=list)
    #: one finding per cause, as `Report.findings()` lists them (the tensors each touches, its full detail)
    findings: list[dict[str, Any]] = field(default_factory=list)
    #: the judge's verdict on the Report rebuilt from the tables (and the warnings below): what close()
    #: said (None: the run did not close)
    closed: Verdict | None = None
    summary: dict[str, str] = field(default_factory=dict)
    first_nonfinite: FirstNonFinite | None = None
    out_of_band: list[Finding] = field(default_factory=list)
    spikes: list[Finding] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    #: where the warnings come from: "close" (the alerts table the run wrote) or "series" (re-judged here)
    warnings_from: str = "series"
    notes: list[str] = field(default_factory=list)
    #: The run never closed: the tables are the last provisional ones, as of this step.
    provisional_step: int | None = None
    #: the `Report` rebuilt from the tables (None: the run never wrote them): the records above are its own
    report: Report | None = field(default=None, repr=False)

    @property
    def problems(self) -> bool:
        """What close() judged a problem (`gradlog.verdict.judge`, the same function on the same tables),
        or NaN/Inf in a run that never closed. Out-of-band update ratios and spikes are warnings."""
        if self.closed is not None:
            return not self.closed.healthy
        return self.first_nonfinite is not None

    @property
    def healthy(self) -> bool:
        """No problems, and the run closed (so its never-updated table is known) and was read in full."""
        return not self.problems and self.never_updated_known and not self.skipped and self.provisional_step is None

    def _warning_part(self) -> list[str]:
        warned: dict[str, int] = {}
        for w in [*self.spikes, *self.out_of_band]:
            warned[w.kind] = warned.get(w.kind, 0) + 1
        if not warned:
            return []
        k = sum(warned.values())
        return [f"{k} warning{'s' * (k != 1)} ({', '.join(f'{kind} {v}' for kind, v in warned.items())})"]

    @property
    def verdict(self) -> str:
        """For a run that closed: close()'s own line (the judge's); else what the series show."""
        head = "PROBLEM" if self.problems else "OK" if self.healthy else "INCOMPLETE"
        n = len(self.skipped)
        skipped = [f"{n} unreadable part{'s' * (n != 1)} skipped"] if n else []
        if self.closed is not None:
            as_of = [] if self.provisional_step is None else [f"as of step {self.provisional_step}, run did not close"]
            return f"gradlog {head}: " + "; ".join([*as_of, *self.closed.parts, *skipped]) + self.closed.suffix
        parts = []
        if self.first_nonfinite is not None:  # first: the one thing to look at before anything else
            f = self.first_nonfinite
            parts.append(f"first non-finite gradient at step {f.step} in {f.tensor}")
        parts.append("no never-updated table (the run did not close: crashed or still running)")
        steps = f" ({self.measured_steps} measured steps)"
        return f"gradlog {head}: " + "; ".join(parts + self._warning_part() + skipped) + steps

    def to_dict(self) -> dict[str, Any]:
        out = asdict(dataclasses.replace(self, report=None))
        del out["sections"], out["never_rows"], out["report"]  # the console's form of the tables above
        judged = self.report.to_dict() if self.report is not None else {}
        for kind in FINDINGS:  # each record with its severity under the run's policy, as close() judged it
            if kind is not NeverUpdated:
                out[kind.KIND] = judged.get(kind.KIND, [])
        out["summary"] = {k: _typed(v) for k, v in self.summary.items()}
        out["never_updated"] = [{**asdict(r), "numel": _typed(r.numel)} for r in self.never_updated]
        out["healthy"] = self.healthy
        out["problems"] = self.problems
        out["verdict"] = self.verdict
        out["band"] = None if self.band is None else list(self.band)
        return out

    def text(self) -> str:
        """The console report: the close-time tables, the warnings, notes and skipped parts, the verdict."""
        self = escaped(dataclasses.replace(self, report=None))  # every name, cell and message came from a file
        tensors = plural(self.tensors, "tensor")
        lines = [f"gradlog report: {self.path} ({self.backend}, {tensors}, {self.measured_steps} measured)"]
        lines.append("")
        lines += self._never_lines()
        if self.never_updated_known:
            lines += self._close_time_lines()
        lines.append("")
        lines += self._warning_lines()
        for title, items in (("Notes:", self.notes), ("Skipped (unreadable):", self.skipped)):
            if items:
                lines += ["", title, *(f"  {s}" for s in items)]
        if self.closed is not None and self.closed.findings:  # notes are listed, never hidden
            lines.append("")
            lines += finding_lines(self.closed)
        lines.append("")
        lines.append(self.verdict)
        return "\n".join(lines)

    def _never_lines(self) -> list[str]:
        title = TITLES["never_updated"]
        if not self.never_updated_known:
            return [f"{title}: unknown (no gradlog/never_updated table: the run did not call close())"]
        if self.never_updated:
            when = "" if self.provisional_step is None else f", as of step {self.provisional_step}, run did not close"
            rows = self.never_rows or [[r.name, r.shape, r.numel, r.reason, r.detail] for r in self.never_updated]
            table = _indent(format_table(COLUMNS, rows, WIDTH))
            return [f"{title} ({len(self.never_updated)}{when}):", table]
        if self.provisional_step is not None:
            return [f"{title}: none as of step {self.provisional_step} (run did not close)"]
        return [f"{title}: none"]

    def _close_time_lines(self) -> list[str]:
        """Partly updated and stopped learning (said "none" when empty), then the other non-empty tables as
        close() printed them; rows and columns (and the other tables' headings) are the Report's own."""
        by_key = {s.key: s for s in self.sections}
        lines = []
        for key in _ALWAYS_SHOWN:
            section = by_key.get(key)
            lines.append("")
            if section is not None:
                table = _indent(format_table(section.columns, section.rows, WIDTH))
                lines += [f"{_counted(section.heading)}:", table]
            else:
                lines.append(f"{TITLES[key]}: none")
        for section in self.sections:
            if section.key not in _OWN_SECTIONS:
                lines += ["", f"{section.heading}:", _indent(format_table(section.columns, section.rows, WIDTH))]
        return lines

    def _warning_lines(self) -> list[str]:
        lines = []
        if self.first_nonfinite is not None:
            f = self.first_nonfinite
            lines.append(f"First non-finite gradient: step {f.step}, {f.tensor}")
        else:
            lines.append("First non-finite gradient: none")
        where = "calibrated against the run's tensors" if self.band is None else "band {:g}..{:g}".format(*self.band)
        source = "as judged during training" if self.warnings_from == "close" else "re-judged from the series"
        for title, found in (
            (f"Gradient-norm spikes (> {self.spike_factor:g}x the tensor's running median and last norm)", self.spikes),
            (f"Update ratio outliers ({where})", self.out_of_band),
        ):
            lines.append("")
            if found:
                lines.append(f"Warning: {title}, {source} ({len(found)}):")
                rows = [[w.name, w.kind, str(w.step), w.detail] for w in found]
                lines.append(_indent(format_table(["name", "kind", "first step", "detail"], rows, WIDTH)))
            else:
                lines.append(f"{title}: none")
        return lines


def _counted(heading: str) -> str:
    """A table's heading with its count and without what the table holds, which the title says here:
    "Partly updated (1 finding in 3 records: slices that never changed)" -> "Partly updated (1 finding in 3
    records)"."""
    head, sep, _ = heading.partition(": ")
    return f"{head})" if sep and "(" in head and ")" not in head else heading


_T = TypeVar("_T")
#: a table's width inside the report's two-space indent: the lines stay within the console's width
WIDTH = CONSOLE_WIDTH - 2


def escaped(obj: _T) -> _T:
    """A copy of `obj` (a dataclass, dict, list, tuple or str, nested) with every string `shown`: safe to print."""
    value: Any = obj
    if type(value) is str:  # not str-valued enums (gradlog.Reason): their text is gradlog's own
        return shown(value)  # type: ignore[return-value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: escaped(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **changes)  # type: ignore[return-value]
    if isinstance(value, dict):
        return {escaped(k): escaped(v) for k, v in value.items()}  # type: ignore[return-value]
    if isinstance(value, (list, tuple)):
        return type(value)(escaped(v) for v in value)  # type: ignore[return-value]
    return obj


def _indent(block: str) -> str:
    return "\n".join("  " + ln for ln in block.splitlines())


def _names(run: RunData, prefix: str) -> list[str]:
    return [t[len(prefix) :] for t in run.scalars if t.startswith(prefix)]


def _typed(v: str) -> object:
    """Table cells are text on disk; JSON gets real booleans and numbers back."""
    if v in ("True", "False"):
        return v == "True"
    try:
        return int(v)
    except ValueError:
        pass
    try:
        f = float(v)
    except ValueError:
        return v
    return f if math.isfinite(f) else v


def replay(
    run: RunData, band: Sequence[float] | None, spike_factor: float, exclude: Collection[str] = ()
) -> list[Alert]:
    """Judge the run's series with the same per-tensor rules as the alerts during training
    (`gradlog.verdict.alerts.Alerts`). From disk a zero-initialised tensor is known by its first update
    ratio of 1 (‖Δw‖/‖w_after‖ with w_before = 0); whether a tensor is 1-D is not on disk, so every
    tensor gets the base band here, and calibrated ratios (`band` None) compare every tensor with all the others."""
    judge = Alerts(band, spike_factor=spike_factor, emit=False)
    # one cursor per (metric, tensor) series, walked step by step: a step's entries are made when it is
    # judged, not every step's at once (500,000 entries, ~120 MB, for 100 tensors over 5,000 steps)
    tracks: list[tuple[str, str, Iterator[tuple[int, float]]]] = []
    steps: set[int] = set()
    for metric in ("grad_norm", "update_ratio", "grad_nonfinite"):
        prefix = tags.prefix(metric)
        for name in _names(run, prefix):
            if name in exclude:
                continue
            points = run.scalars[prefix + name]
            steps.update(step for step, _ in points)
            tracks.append((metric, name, iter(points)))
    heads: list[tuple[int, float] | None] = [next(it, None) for _, _, it in tracks]
    first_ratio: set[str] = set()
    for step in sorted(steps):
        found: dict[str, Entry] = {}
        for k, (metric, name, it) in enumerate(tracks):
            head = heads[k]
            if head is None or head[0] != step:  # each series is in step order: its head is its next step
                continue
            while head is not None and head[0] == step:  # a step written twice: the last value, as a dict kept
                v = head[1]
                head = next(it, None)
            heads[k] = head
            e = found.get(name)
            if e is None:
                e = found[name] = Entry(key=name, name=name)
            if metric == "grad_norm":
                e.grad_norm = v
            elif metric == "update_ratio":
                e.ratio = v
            else:
                e.nonfinite = v
        entries = list(found.values())
        for e in entries:
            if e.ratio is not None and e.name not in first_ratio and math.isfinite(e.ratio):
                first_ratio.add(e.name)
                e.zero_start = abs(e.ratio - 1.0) < 1e-3
        judge.step(step, entries)
    judge.finish()
    return judge.fired


def _from_table(run: RunData) -> list[Alert] | None:
    return read_alerts(run.tables[names.ALERTS]) if names.ALERTS in run.tables else None


def _first_nonfinite(run: RunData, summary: dict[str, str], closed: bool) -> FirstNonFinite | None:
    """From the summary gradlog wrote at close; for a run that never closed, from the per-tensor series
    (a closed run's summary is the answer: the series also count the NaN of steps a GradScaler skipped)."""
    if "first_nonfinite_step" in summary and "first_nonfinite_tensor" in summary:
        try:
            return FirstNonFinite(int(summary["first_nonfinite_step"]), summary["first_nonfinite_tensor"])
        except ValueError:
            pass
    if closed:
        return None
    first = series_first_nonfinite(run)
    return None if first is None else FirstNonFinite(first.step, first.name)


def analyze(
    run: RunData, band: Sequence[float] | None = None, spike_factor: float | None = None, policy: Policy | None = None
) -> Health:
    """The health report of one run read back from disk (or from a MemoryWriter).

    Judged under the policy the run recorded (its `gradlog/policy` table) with `policy`'s rules after it
    (the command line's: they win), by the same judge as close().

    Warnings: for a run that closed with alerts on, the alerts table it wrote (so the report says what
    close() said); with `band` or `spike_factor` given, or without that table, the series re-judged
    with the same per-tensor rules (`replay`).
    """
    rejudge = band is not None or spike_factor is not None
    spike_factor = DEFAULT_SPIKE_FACTOR if spike_factor is None else spike_factor
    summary = run.summary()
    known = names.NEVER_UPDATED in run.tables
    never = [NeverUpdatedRow(**c) for c in table_cells(run.tables[names.NEVER_UPDATED], COLUMNS)] if known else []
    tensors = series_names(run)
    measured = _count(summary.get("measured_steps", ""), default=len(series_steps(run)))
    never_names = {bare_name(r.name) for r in never}
    recorded = None if rejudge or names.SUMMARY not in run.tables else _from_table(run)
    if recorded is None and not rejudge and names.SUMMARY in run.tables and summary.get("warnings") == "0":
        recorded = []  # closed with no warning (or with alerts off): nothing to re-judge against
    report = closed_report(run)
    closed = report is not None and run.provisional_step is None and bool(summary)  # else the series answer
    alerts = recorded if recorded is not None else replay(run, band, spike_factor, exclude=never_names)
    if report is not None:
        report.policy = (report.policy or Policy()).then(policy)
        report.alerts = alerts  # the judge then counts exactly the warnings listed here
        alerts = report.warning_alerts()
    warns = [Finding(a.name, a.kind, a.step, a.detail) for a in alerts if a.kind in WARNING_KINDS]
    return Health(
        path=run.path,
        backend=run.backend,
        band=None if band is None else (float(band[0]), float(band[1])),
        spike_factor=float(spike_factor),
        measured_steps=measured,
        tensors=len(tensors | never_names),
        never_updated=never,
        never_updated_known=known,
        partly_updated=[] if report is None else report.partly_updated,
        stalled=[] if report is None else report.stalled,
        stopped_slices=[] if report is None else report.stopped_slices,
        experts=[] if report is None else report.experts,
        precision=[] if report is None else report.precision,
        findings=[] if report is None else report.findings(),
        sections=[] if report is None else report.sections(console=True),
        never_rows=[] if report is None else grouped_rows("never_updated", report.never_updated, NeverUpdated.row),
        closed=judge(report) if report is not None else None,
        summary=summary,
        first_nonfinite=_first_nonfinite(run, summary, closed=closed),
        out_of_band=[w for w in warns if w.kind in (RATIO_HIGH, RATIO_LOW)],
        spikes=[w for w in warns if w.kind == SPIKE],
        skipped=list(run.skipped),
        warnings_from="series" if recorded is None else "close",
        notes=list(run.notes),
        provisional_step=run.provisional_step,
        report=report,
    )


#: the tables `Health.text` says "none" for when they are empty (a closed run has them all), by `Report` field
_ALWAYS_SHOWN = ("partly_updated", "stalled")
#: the tables `Health.text` heads itself: never updated (every row of the written table, where close()'s console
#: folds intentionally frozen tensors) and `_ALWAYS_SHOWN`; every other non-empty table is printed as close()
#: printed it, since the verdict counts it
_OWN_SECTIONS = frozenset({"never_updated", *_ALWAYS_SHOWN})


def _count(text: str, default: int) -> int:
    """A count from a table cell; anything else (text, a 5,000-digit number, "²") gives `default`."""
    if not (text.isascii() and text.isdigit() and len(text) < 19):
        return default
    return int(text)


def read_run(source: Any, wait: float = 60.0) -> Health:
    """`gradlog.read_run`: a run's health read back, as `gradlog report` prints it (`.text()`, `.healthy`,
    `.never_updated`, `.to_dict()`). `source`: a TensorBoard or W&B run folder or file, or a `MemoryWriter`.
    A W&B run just finished is waited for (at most `wait` seconds a run file) until wandb has written its
    end; a run that never finished (a crash) is read as far as it goes."""
    if hasattr(source, "scalars") and hasattr(source, "tables") and not isinstance(source, (str, os.PathLike)):
        return analyze(RunData.from_memory(source))
    path = os.fspath(source)
    if os.path.isdir(path):
        for run_file in find_run_files(path):
            try:
                read_finished_run(run_file, timeout=wait)
            except WandbFileError:
                pass
    return analyze(load(path))
