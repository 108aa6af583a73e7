"""The one verdict: OK or PROBLEM, decided from a `Report` (and a `Policy`) alone.

Everything that states a run's health calls `judge`: `Report.healthy` and `Report.verdict`, the line
close() prints, the `gradlog/summary` table written to TensorBoard and W&B (and so the W&B run
summary), `gradlog report` (which rebuilds the Report and its policy from those tables), `gradlog diff`
(`DiffResult`), `gradlog.check` and the TensorBoard tab. One function, so they can never disagree
about the same run.

Each finding has a kind and a severity (`gradlog.verdict.policy`: the defaults, tuned by the report's
policy). The run is a PROBLEM when any finding is a `problem`; warnings and notes are counted at the end
of the line ("(2 warnings, 3 notes)"); ignored findings stay in the tables and out of the line. Each kind
of record (`gradlog.verdict.records.FINDINGS`) gives its findings' kinds and says its own part of the line
(`Record.judged_kinds`, `Record.verdict_parts`), so a kind added later is judged with no change here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gradlog.verdict.causes import cause_key
from gradlog.verdict.policy import (
    DEAD_REASONS,
    DEFAULTS,
    EVENT_SLICES,
    IGNORE,
    NOTE,
    PROBLEM,
    SEVERITIES,
    SMALL_SHARE,
    WARNING,
    Policy,
)
from gradlog.verdict.records import FINDINGS, Record


class Report(Protocol):
    """What the judge reads of a `gradlog.verdict.report.Report` (which imports this module, so the judge
    names the fields it reads instead of importing the class: no import circle)."""

    @property
    def policy(self) -> Policy | None: ...

    @property
    def first_nonfinite(self) -> Any: ...

    @property
    def error(self) -> str | None: ...

    @property
    def never_updated(self) -> Sequence[Any]: ...

    @property
    def partly_updated(self) -> Sequence[Any]: ...

    @property
    def stalled(self) -> Sequence[Any]: ...

    @property
    def stopped_slices(self) -> Sequence[Any]: ...

    @property
    def alerts(self) -> Sequence[Any]: ...

    @property
    def skipped_steps(self) -> int: ...

    @property
    def tracked_tensors(self) -> int: ...

    @property
    def optimizer_steps(self) -> int: ...

    @property
    def measured_steps(self) -> int: ...

    def records(self, kind: Any) -> Sequence[Any]: ...


OK = "OK"
#: the verdict's status word for a run with a problem (the severity is spelled "problem")
PROBLEM_STATUS = "PROBLEM"
#: alert kinds that are findings (a NaN alert is the run-level `run.nonfinite`)
ALERT_FINDINGS = frozenset({"update_ratio_high", "update_ratio_low", "grad_norm_spike", "no_grad"})
#: alert kinds a never-updated or stalled record already explains (a spike there is still news)
NAMED_BY_TABLES = frozenset({"update_ratio_high", "update_ratio_low", "no_grad"})


@dataclass(frozen=True)
class Finding:
    """One thing the judge weighs: `kind` (a key of `policy.DEFAULTS`), the tensor `name` (None: the
    run) and the `severity` the policy gave it."""

    kind: str
    name: str | None
    severity: str
    aliases: tuple[str, ...] = ()
    #: from `gradlog.check`'s data-dependent "in this batch" table, not from the run
    in_batch: bool = False
    #: what one mistake explains (`gradlog.verdict.causes`): findings with the same cause count once
    cause: tuple[Any, ...] = ()
    #: the `KIND` of the record it weighs (None: the run's, an alert's, `gradlog diff`'s)
    table: str | None = None


@dataclass(frozen=True)
class Verdict:
    """The judgement of one run: `status` ("OK" or "PROBLEM"), the `parts` of the one-line `text`
    (what was found, most basic first), its `suffix` (step counts, then problems/warnings/notes counted)."""

    healthy: bool
    status: str
    parts: tuple[str, ...]
    suffix: str
    problems: tuple[str, ...]  # the parts that made it a PROBLEM (empty when OK)
    findings: tuple[Finding, ...] = ()
    label: str = "gradlog"

    @property
    def text(self) -> str:
        return f"{self.label} {self.status}: " + "; ".join(self.parts) + self.suffix

    @property
    def tally(self) -> str:
        """ "2 problems, 1 note": the findings counted by severity (ignored ones left out)."""
        return ", ".join(_plural(self.count(s), s) for s in (PROBLEM, WARNING, NOTE) if self.count(s))

    def count(self, severity: str) -> int:
        """The causes with a finding of `severity` (a layer left out of the optimizer counts once, not per tensor)."""
        return len(causes(self.of(severity)))

    def of(self, severity: str) -> list[Finding]:
        return [f for f in self.findings if f.severity == severity]


@dataclass(frozen=True)
class Words:
    """How the verdict line says that tensors learned. A run sees updates and gradients ("updated", "stopped
    learning"); `gradlog diff` sees only saved values, so its tensors "changed" and "stopped changing"."""

    #: follows "all {n} " and "{k} of {n} ": the tensors judged and what they all did
    tracked_did: str = "tracked tensors were updated"
    #: the same of a single tensor, after "the 1 "
    tracked_did_one: str = "tracked tensor was updated"
    #: follows "{k} of {n} tensors " and "{k} tensors partly "
    never: str = "never updated"
    #: follows "{k} tensors " and "{k} tensors with slices that "
    stopped: str = "stopped learning"

    def everything(self, n: int) -> str:
        """The part that says every one of `n` tensors did it ("the 1 ... was", not "all 1 ... were")."""
        return f"the 1 {self.tracked_did_one}" if n == 1 else f"all {n} {self.tracked_did}"


#: a run's words (`GradLogger.close()`, `gradlog report`, `gradlog.check`)
RUN_WORDS = Words()
#: `gradlog diff`'s words: what changed between saved checkpoints
CHECKPOINT_WORDS = Words(
    tracked_did="compared tensors changed",
    tracked_did_one="compared tensor changed",
    never="never changed",
    stopped="stopped changing",
)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def plural(n: int, word: str) -> str:
    """ "1 optimizer step", "2 optimizer steps": the one place a count meets its noun (issue 41 found
    "1 optimizer steps", "1 of 1 tensors", "in all 2 checkpoints")."""
    return _plural(n, word)


def all_of(n: int, noun: str) -> str:
    """ "the 1 checkpoint", "both checkpoints", "all 3 checkpoints" (`noun` singular)."""
    return f"the 1 {noun}" if n == 1 else f"both {noun}s" if n == 2 else f"all {n} {noun}s"


def nothing_measured(report: Report) -> bool:
    """A run that measured no step (closed before any optimizer step reached a measurement): its tensors'
    reason is `unknown` for want of any evidence, not because of a bug."""
    return report.measured_steps == 0 and report.error is None


def by_reason(reasons: Iterable[object]) -> str:
    """ "zero_grad 2, no_grad 1": how many of each, in order of first appearance."""
    counts: dict[str, int] = {}
    for r in reasons:
        key = str(r)
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{k} {v}" for k, v in counts.items())


def causes(found: Iterable[Finding]) -> dict[tuple[Any, ...], list[Finding]]:
    """`found` by cause, in order of first appearance."""
    out: dict[tuple[Any, ...], list[Finding]] = {}
    for f in found:
        out.setdefault(f.cause, []).append(f)
    return out


def per_tensor(found: Sequence[Finding]) -> str:
    """The reasons of findings counted once per cause, and said so where the causes are not one per tensor
    (a tensor with two causes: the padding row and ids no batch held, "2 causes: not_in_batch 1,
    padding_idx 1"; a layer's units dead in three tensors: "1 cause: dead_units 1"), so the counts add up."""
    tensors = len({f.name for f in found})
    groups = causes(found)
    counts = by_reason(reasons_of(group[0] for group in groups.values()))
    return counts if len(groups) == tensors else f"{_plural(len(groups), 'cause')}: {counts}"


def never_kind(reason: object, suspect: bool) -> str:
    return "never.frozen_suspect" if str(reason) == "frozen" and suspect else f"never.{reason}"


def slice_kinds(report: Report) -> tuple[list[str], list[str]]:
    """The kinds of the partly-updated and the stopped-slice records, in their order: `partly.REASON` and
    `stopped.REASON`, or `*.few_dead` for dead units, filters and experts (`policy.DEAD_REASONS`) that are a
    small share of their tensor's slices along their dim (`policy.SMALL_SHARE`, never-active and stopped ones
    counted together) and, for stopped ones, not an event (`policy.EVENT_SLICES` at one step). A whole tensor
    never counts here: that is the never-updated table's."""
    lost: dict[tuple[str, Any], int] = {}
    records = [*report.partly_updated, *report.stopped_slices]
    for r in records:
        if str(r.reason) in DEAD_REASONS:
            key = (r.name, r.dim)
            lost[key] = lost.get(key, 0) + len(r.indices)

    def kind(table: str, r: Any) -> str:
        if str(r.reason) not in DEAD_REASONS or not r.total:
            return str(r.policy_kind())
        small = lost[(r.name, r.dim)] <= SMALL_SHARE * r.total
        event = table == "stopped" and len(r.indices) >= EVENT_SLICES
        return f"{table}.few_dead" if small and not event else str(r.policy_kind())

    return [kind("partly", p) for p in report.partly_updated], [kind("stopped", s) for s in report.stopped_slices]


def findings(report: Report, extra: Sequence[tuple[str, str | None]] = ()) -> list[Finding]:
    """Every finding in `report` (plus `extra` (kind, name) pairs, e.g. `gradlog diff`'s), with its severity."""
    policy = report.policy if report.policy is not None else Policy()
    out: list[Finding] = []

    def add(
        kind: str,
        name: str | None,
        aliases: tuple[str, ...] = (),
        in_batch: bool = False,
        cause: tuple[Any, ...] = (),
        table: str | None = None,
    ) -> None:
        names = None if name is None else (name, *aliases)
        cause = cause or (kind, name, len(out))  # a finding of its own
        out.append(Finding(kind, name, policy.severity(kind, names), aliases, in_batch, cause, table))

    if report.first_nonfinite is not None:
        add("run.nonfinite", report.first_nonfinite.name)
    if report.error is not None:
        add("run.diagnosis_error", None)
    for table in FINDINGS:  # each record with its judged kind (`Record.judged_kinds`; None: no severity of its own)
        for r, k in zip(report.records(table), table.judged_kinds(report)):
            if k is not None and r.weighed(report):
                tensor, *aliases = _names(r)
                add(k, tensor, tuple(aliases), cause=cause_key(table.KIND, r), table=table.KIND)
    for p in getattr(report, "in_batch", ()):  # gradlog.check: judged by the same policy as a run's slices
        add(p.policy_kind(), p.name, in_batch=True, table=p.KIND)
    if report.skipped_steps:
        add("run.skipped_steps", None)
    named = {r.name for r in report.never_updated} | {s.name for s in report.stalled}
    for a in report.alerts:  # a tensor a table already names (with its reason): no update-ratio/no-grad alert again
        if a.kind in ALERT_FINDINGS and not (a.kind in NAMED_BY_TABLES and a.name in named):
            add(f"alert.{a.kind}", a.name)
    for kind, name in extra:
        add(kind, name)
    return out


def _names(record: Record) -> tuple[str, ...]:
    """A record's tensor name, then its aliases (what a policy's pattern is matched against)."""
    names = record.policy_names()
    return (names,) if isinstance(names, str) else tuple(names)


def _worst(found: Iterable[Finding]) -> str:
    sev = [f.severity for f in found if f.severity != IGNORE]
    return min(sev, key=SEVERITIES.index) if sev else IGNORE


@dataclass
class _Line:
    """The verdict line being built: its parts in order, and which of them are problems."""

    found: list[Finding]
    words: Words = RUN_WORDS
    parts: list[str] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)

    def add(self, text: str, severity: str) -> None:
        if severity == IGNORE:
            return
        self.parts.append(text)
        if severity == PROBLEM:
            self.problems.append(text)

    def of(self, prefix: str) -> list[Finding]:
        """The findings of kinds starting with `prefix` that the policy does not ignore."""
        return [f for f in self.found if f.kind.startswith(prefix) and f.severity != IGNORE]


def reasons_of(found: Iterable[Finding]) -> list[str]:
    """The reason of each finding: its kind after the table (`partly.not_in_batch` -> `not_in_batch`)."""
    return [f.kind.split(".", 1)[1] for f in found]


def _run_first(line: _Line, report: Report) -> None:
    """The first non-finite gradient (the one thing to look at before anything else), or that the diagnosis
    failed (which tensors never updated is then unknown)."""
    nonfinite = line.of("run.nonfinite")
    if nonfinite and report.first_nonfinite is not None:
        f = report.first_nonfinite
        line.add(f"first non-finite gradient at step {f.step} in {f.name}", _worst(nonfinite))
    if report.error is not None:
        text = f"the diagnosis failed ({report.error}); which tensors {line.words.never} is unknown"
        line.add(text, _worst(line.of("run.diag")))


def _records(line: _Line, report: Report) -> None:
    """What each kind of record says (`Record.verdict_parts`, or the count of its findings and `Record.SAID`),
    in the order of `FINDINGS`: never updated, partly updated, stalled, stopped slices, rounded away, ..."""
    for kind in FINDINGS:
        found = [f for f in line.found if f.table == kind.KIND]
        parts = kind.verdict_parts(found, report, line.words)
        for text, of in _phrase(kind, found) if parts is None else parts:
            if of:
                line.add(text, _worst(of))
            else:
                line.parts.append(text)  # said whatever the findings are ("all 12 tracked tensors were updated")


def _phrase(kind: type[Record], found: Sequence[Finding]) -> list[tuple[str, Sequence[Finding]]]:
    """The part of a kind that says no more: "2 tensors <SAID>" (its `NOUN`), or "<TITLE>: 2 records"."""
    kept = [f for f in found if f.severity != IGNORE]
    if not kept:
        return []
    count = _plural(len(kept), kind.NOUN)
    return [(f"{count} {kind.SAID}" if kind.SAID else f"{kind.TITLE}: {count}", kept)]


def _run_wide(line: _Line, report: Report) -> None:
    """Skipped optimizer steps, and the alerts (one part per severity)."""
    skipped = line.of("run.skipped")
    if skipped:
        line.add(f"{_plural(report.skipped_steps, 'optimizer step')} skipped", _worst(skipped))
    alerts = line.of("alert.")
    for severity in SEVERITIES[:3]:  # the alerts of one severity in one part: "2 warnings (update_ratio_high 2)"
        group = [f for f in alerts if f.severity == severity]
        if group:
            word = {PROBLEM: "alert", WARNING: "warning", NOTE: "note"}[severity]
            line.add(f"{_plural(len(group), word)} ({by_reason(reasons_of(group))})", severity)


def _appeared(line: _Line) -> None:
    """`gradlog diff`: NaN/Inf that appeared in saved values, first, as a run's first non-finite gradient is."""
    group = line.of("diff.nonfinite")
    if group:
        line.add(f"NaN/Inf values appeared in {_plural(len(group), 'tensor')} (first: {group[0].name})", _worst(group))


def _diffs(line: _Line) -> None:
    """`gradlog diff`'s other findings, one part per kind."""
    others = [f for f in line.of("diff.") if f.kind != "diff.nonfinite"]
    for kind in dict.fromkeys(f.kind for f in others):
        group = [f for f in others if f.kind == kind]
        k = _plural(len(group), "tensor")
        text = {
            "diff.missing": f"{k} missing from some checkpoints",
            "diff.shape_or_dtype_changed": f"{k} changed shape or dtype",
        }.get(kind, f"{kind} {len(group)}")
        line.add(text, _worst(group))


def judge(
    report: Report, extra: Sequence[tuple[str, str | None]] = (), label: str = "gradlog", words: Words = RUN_WORDS
) -> Verdict:
    """OK or PROBLEM for `report` under its policy, with the one line that says why (in `words`)."""
    line = _Line(findings(report, extra), words)
    _appeared(line)
    _run_first(line, report)
    _records(line, report)
    _run_wide(line, report)
    _diffs(line)
    problems = line.problems
    status = PROBLEM_STATUS if problems else OK
    v = Verdict(not problems, status, tuple(line.parts), "", tuple(problems), tuple(line.found), label)
    tail = f"; {v.tally}" if v.tally else ""
    rotation = getattr(report, "update_rotation", 1)
    each = f", each tensor's update ratio every {rotation} measured" if rotation > 1 else ""
    steps = plural(report.optimizer_steps, "optimizer step")
    suffix = f" ({steps}, {report.measured_steps} measured{each}{tail})"
    return dataclasses.replace(v, suffix=suffix)


def finding_lines(verdict: Verdict, severities: Sequence[str] = (WARNING, NOTE)) -> list[str]:
    """One line per (severity, kind), naming the first few tensors: the warnings and notes under the tables."""
    out = []
    for sev in severities:
        group = verdict.of(sev)
        for kind in dict.fromkeys(f.kind for f in group):
            names = list(dict.fromkeys(f.name for f in group if f.kind == kind and f.name is not None))
            shown = ", ".join(names[:4]) + (f", and {len(names) - 4} more" if len(names) > 4 else "")
            what = f" in {_plural(len(names), 'tensor')}: {shown}" if names else ""
            out.append(f"{sev}: {kind}{what} ({DEFAULTS[kind][1]})" if not names else f"{sev}: {kind}{what}")
    return out
