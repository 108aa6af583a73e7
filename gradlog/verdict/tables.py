"""The codecs between a `Report` and the tables a run writes: each table written from the report, and
the report rebuilt from them (`closed_report`), so what close() returned and what `gradlog report`,
the gradlog tab and a resumed run read back are one thing. Each findings table is its records' own
(`gradlog.verdict.records`: columns, rows and reading back derived from the record's fields).

A table read from disk is untrusted: a row that cannot be read is skipped and named in `run.skipped`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from gradlog.runformat import names, tags
from gradlog.runformat.cells import table_cells
from gradlog.runformat.rundata import RunData, Table
from gradlog.verdict.policy import Policy, Rule
from gradlog.verdict.records import Record, lenient_int
from gradlog.verdict.report import FINDINGS, Alert, NeverUpdated, NonFinite, Report


# --- writing -----------------------------------------------------------------------------------------
def table_name(kind: type[Record]) -> str:
    """The name a kind of finding's table is written under: `gradlog/<KIND>` (`names.finding_table`)."""
    return names.finding_table(kind.KIND)


def sparse_tables() -> tuple[str, ...]:
    """Tables written once there is something to say (most runs: never), then always: an emptied provisional
    table must replace the rows written before it (`Record.SPARSE`)."""
    return tuple(table_name(kind) for kind in FINDINGS if kind.SPARSE)


def written(kind: type[Record], records: Sequence[Record]) -> Table:
    """The table of `records` as a run writes it: every cell in full."""
    return kind.columns(written=True), [r.row(written=True) for r in records]


def report_tables(report: Report) -> dict[str, Table]:
    """Every findings table of `report`, in the order they are written: the three tables, the sparse
    ones (`sparse_tables`), the alerts when any fired, the policy when it has rules (`gradlog report`
    then judges the run as close() did). The summary is `summary_rows`."""
    out = {table_name(kind): written(kind, report.records(kind)) for kind in FINDINGS}
    if report.alerts:
        out[names.ALERTS] = written(Alert, report.alerts)
    if report.policy is not None and report.policy.rules:
        out[names.POLICY] = (names.POLICY_COLUMNS, report.policy.rows())
    return out


def final_counts(report: Report) -> dict[str, float]:
    """The scalars written once at close: how many findings of each table, and of each reason."""
    final = {
        names.NEVER_UPDATED: float(len(report.never_updated)),
        names.PARTLY_UPDATED: float(len(report.partly_updated)),
        names.STALLED: float(len(report.stalled)),
    }
    for table, counts in (
        (names.NEVER_UPDATED, report.counts()),
        (names.PARTLY_UPDATED, report.partly_counts()),
        (names.STALLED, report.stalled_counts()),
    ):
        for reason, n in counts.items():
            final[f"{table}/{reason}"] = float(n)
    return final


def summary_rows(report: Report, provisional_step: int | None, rank_local: bool) -> list[list[str]]:
    """The `gradlog/summary` table: the verdict first, then what it was judged on (keys: `names.SUMMARY_KEYS`)."""
    summary = [
        [names.VERDICT, report.verdict],
        ["status", report.status],
        ["healthy", str(report.healthy)],
        ["optimizer_steps", str(report.optimizer_steps)],
        ["measured_steps", str(report.measured_steps)],
        ["skipped_steps", str(report.skipped_steps)],
        ["tracked_tensors", str(report.tracked_tensors)],
        ["warnings", str(sum(report.warnings().values()))],
        ["notes", str(report.severities().get("note", 0))],
    ]
    if report.hint:
        summary.append(["hint", report.hint])
    if report.first_nonfinite is not None:
        summary += [
            ["first_nonfinite_step", str(report.first_nonfinite.step)],
            ["first_nonfinite_tensor", report.first_nonfinite.name],
            ["first_nonfinite_count", str(report.first_nonfinite.count)],
        ]
    if report.error is not None:
        summary.append(["error", report.error])
    if provisional_step is not None:
        summary += [["final", "False"], ["as_of_step", str(provisional_step)]]
        if rank_local:
            summary.append(["scope", "rank-local"])
    return summary


# --- reading -----------------------------------------------------------------------------------------
#: Tags whose tensors count as tracked when the summary lacks the count.
_NAMED_BY = (tags.prefix("weight_norm"), tags.prefix("grad_norm"), tags.prefix("update_ratio"))
_EMPTY: Table = ([], [])
R = TypeVar("R", bound=Record)


def read(run: RunData, kind: type[R]) -> list[R]:
    """The records of `kind`'s table (none without it); a row that cannot be read (a KeyError or ValueError
    from its cells) is skipped and named, by its `KEY` cell, in `run.skipped`."""
    name = table_name(kind)
    out: list[R] = []
    unnamed = bad = 0
    for c in table_cells(run.tables.get(name, _EMPTY), kind.columns(written=True)):
        if not c[kind.KEY]:  # a row about no tensor (damage): it was read as a tensor named ""
            unnamed += 1
            continue
        try:
            out.append(kind.from_cells(c))
        except (KeyError, ValueError) as exc:
            bad += 1
            if bad <= _NAMED_ROWS:
                run.skipped.append(f"table {name}: row {c[kind.KEY]!r} cannot be read ({exc})")
    if bad > _NAMED_ROWS:
        run.skipped.append(f"table {name}: {bad - _NAMED_ROWS} more rows cannot be read")
    if unnamed:
        run.skipped.append(f"table {name}: {unnamed} row{'s' * (unnamed != 1)} without a {kind.KEY!r} cell skipped")
    return out


#: Unreadable rows named one by one in `run.skipped`; the rest are counted (a damaged table can hold millions).
_NAMED_ROWS = 20


def read_alerts(table: Table) -> list[Alert]:
    """The `gradlog/alerts` table's alerts (step, kind, name, detail); a damaged row (a cell missing or
    unreadable) is left out."""
    cols, rows = table
    index = {c: i for i, c in enumerate(cols)}
    wanted = Alert.columns(written=True)
    if not set(wanted) <= set(index):
        return []
    out = []
    for r, c in zip(rows, table_cells(table, wanted)):
        if any(index[w] >= len(r) for w in wanted):
            continue  # a damaged row: the others still count
        try:
            out.append(Alert.from_cells(c))
        except (KeyError, ValueError):
            continue
    return out


def series_first_nonfinite(run: RunData) -> NonFinite | None:
    """The first non-finite gradient as the per-tensor series show it (a count of NaN/Inf entries,
    written from the first non-zero one on); for runs whose summary table was not written or is lost."""
    best: tuple[int, str, int] | None = None
    for tag, points in run.scalars.items():
        if not tag.startswith(tags.prefix("grad_nonfinite")):
            continue
        for step, v in points:
            if v != 0:
                if best is None or (step, tag) < (best[0], best[1]):
                    best = (step, tag, int(v) if v == v and abs(v) < 2**62 else 0)
                break
    return None if best is None else NonFinite(step=best[0], name=best[1].split("/", 2)[2], count=best[2])


def series_names(run: RunData) -> set[str]:
    """The tensors the per-tensor series name (weight norm, grad norm or update ratio)."""
    return {t.split("/", 2)[2] for t in run.scalars if t.startswith(_NAMED_BY)}


def series_steps(run: RunData) -> set[int]:
    """The measured steps as the series show them: the steps that have norms."""
    return {s for t, pts in run.scalars.items() if t.startswith(_NAMED_BY[:2]) for s, _ in pts}


def _summary_from_series(run: RunData) -> dict[str, str]:
    """Step counts from the per-tensor series: the measured steps are the steps that have norms; the
    optimizer steps are at least the last measured one + 1."""
    steps = series_steps(run)
    return {"measured_steps": str(len(steps)), "optimizer_steps": str(max(steps) + 1 if steps else 0)}


def recorded_policy(run: RunData) -> Policy | None:
    """The policy the run was judged with at close (its `gradlog/policy` table), None without one. A rule
    this gradlog does not know is named in `run.skipped` and the rest still apply."""
    if names.POLICY not in run.tables:
        return None
    cols, rows = run.tables[names.POLICY]
    kept: list[Rule] = []
    for r in rows:
        try:
            kept.extend(Policy.from_rows(cols, [r]).rules)
        except ValueError as exc:
            run.skipped.append(f"table {names.POLICY}: rule {r!r} cannot be read ({exc})")
    return Policy(kept)


def _first_nonfinite(summary: dict[str, str]) -> NonFinite | None:
    """Where a gradient first went NaN/Inf, as the summary says (None when it does not)."""
    if "first_nonfinite_step" not in summary or "first_nonfinite_tensor" not in summary:
        return None
    return NonFinite(
        step=lenient_int(summary["first_nonfinite_step"], -1),
        name=summary["first_nonfinite_tensor"],
        count=lenient_int(summary.get("first_nonfinite_count", "0")),
    )


def _judged_on(run: RunData) -> tuple[dict[str, str], NonFinite | None]:
    """(the summary, the first non-finite gradient); a run whose summary is lost gets both from its series."""
    summary = run.summary()
    if summary:
        return summary, _first_nonfinite(summary)
    # the summary is written last at close, so it is the first thing a cut-off or damaged file loses
    run.notes.append(
        "the summary table written at close is missing (the file was cut off or damaged): step counts "
        "and the first non-finite gradient come from the logged series"
    )
    return _summary_from_series(run), series_first_nonfinite(run)


def closed_report(run: RunData) -> Report | None:
    """The `Report` that close() returned, rebuilt from the tables it wrote (None when the run never
    closed). `gradlog report` judges it with the same function close() used, so both say the same.
    A row that cannot be read is skipped and named in `run.skipped`."""
    if names.NEVER_UPDATED not in run.tables:
        return None
    found: dict[type[Record], list[Record]] = {kind: list(read(run, kind)) for kind in FINDINGS}
    never = [r for r in found[NeverUpdated] if isinstance(r, NeverUpdated)]
    tracked = lenient_int(run.summary().get("tracked_tensors", ""), -1)
    summary, first = _judged_on(run)
    return Report(
        policy=recorded_policy(run),
        first_nonfinite=first,
        optimizer_steps=lenient_int(summary.get("optimizer_steps", "0")),
        measured_steps=lenient_int(summary.get("measured_steps", "0")),
        skipped_steps=lenient_int(summary.get("skipped_steps", "0")),
        tracked_tensors=tracked if tracked >= 0 else len(series_names(run) | {r.name for r in never}),
        error=summary.get("error") or None,
        hint=summary.get("hint") or None,
    ).with_records(found)
