"""The codecs between a `Report` and the tables a run writes: each table written from the report, and
the report rebuilt from them (`closed_report`), so what close() returned and what `gradlog report`,
the gradlog tab and a resumed run read back are one thing.

A table read from disk is untrusted: a row that cannot be read is skipped and named in `run.skipped`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from gradlog.runformat import names, tags
from gradlog.runformat.cells import DIM_NAMES, parse_shape, split_name_cell, table_cells
from gradlog.runformat.rundata import RunData, Table
from gradlog.verdict.policy import Policy, Rule
from gradlog.verdict.report import (
    Alert,
    IdleExperts,
    NeverUpdated,
    NonFinite,
    PartlyUpdated,
    PrecisionLoss,
    Reason,
    Report,
    Stalled,
    StoppedSlice,
    parse_ranges,
)

# --- writing -----------------------------------------------------------------------------------------
#: Tables written once there is something to say (most runs: never), then always: an emptied provisional
#: table must replace the rows written before it.
SPARSE_TABLES = (names.STOPPED_SLICES, names.EXPERTS, names.PRECISION)


def report_tables(report: Report) -> dict[str, Table]:
    """Every findings table of `report`, in the order they are written: the three tables, the sparse
    ones (`SPARSE_TABLES`), the alerts when any fired, the policy when it has rules (`gradlog report`
    then judges the run as close() did). The summary is `summary_rows`."""
    out: dict[str, Table] = {
        names.NEVER_UPDATED: (names.TABLE_COLUMNS, report.table_rows()),
        names.PARTLY_UPDATED: (names.PARTLY_COLUMNS, report.partly_rows()),
        names.STALLED: (names.STALLED_COLUMNS, report.stalled_rows()),
        names.STOPPED_SLICES: (names.STOPPED_COLUMNS, [r.row() for r in report.stopped_slices]),
        names.EXPERTS: (names.EXPERT_COLUMNS, [r.row() for r in report.experts]),
        names.PRECISION: (names.PRECISION_COLUMNS, [r.row() for r in report.precision]),
    }
    if report.alerts:
        out[names.ALERTS] = (names.ALERT_COLUMNS, [a.row() for a in report.alerts])
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
R = TypeVar("R")


def _rows(run: RunData, name: str, columns: list[str], key: str, make: Callable[[dict[str, str]], R]) -> list[R]:
    """`make(cells)` of every row of the table `name` (none without it); a row `make` cannot read (KeyError,
    ValueError) is skipped and named, by its `key` cell, in `run.skipped`."""
    out: list[R] = []
    for c in table_cells(run.tables.get(name, _EMPTY), columns):
        try:
            out.append(make(c))
        except (KeyError, ValueError) as exc:
            run.skipped.append(f"table {name}: row {c[key]!r} cannot be read ({exc})")
    return out


def _reason(text: str) -> Reason:
    try:
        return Reason(text)
    except ValueError:
        return Reason.UNKNOWN  # a reason this version does not know: still listed, judged a problem


def _int(text: str, default: int = 0) -> int:
    try:
        return int(text)
    except ValueError:
        return default


_DIMS = {v: k for k, v in DIM_NAMES.items()}


def _never(c: dict[str, str]) -> NeverUpdated:
    name, aliases = split_name_cell(c["name"])
    shape = parse_shape(c["shape"])
    if shape is None:  # a damaged dimension reads as 0, the row is kept
        shape = tuple(_int(d) for d in c["shape"].split("x"))
    return NeverUpdated(
        name=name,
        shape=shape,
        numel=_int(c["numel"]),
        reason=_reason(c["reason"]),
        detail=c["detail"],
        aliases=aliases,
        suspect=c["suspect"] == "True",
    )


def _partly(c: dict[str, str]) -> PartlyUpdated:
    indices = parse_ranges(c["indices"], limit=min(int(c["total"]), 10_000_000))  # total is from the file too
    dim = _DIMS[c["dim"]]
    return PartlyUpdated(c["name"], dim, int(c["never"]), int(c["total"]), indices, _reason(c["reason"]), c["detail"])


def _stalled(c: dict[str, str]) -> Stalled:
    since, last = int(c["since_step"]), int(c["last_update_step"])
    return Stalled(c["name"], since, last, _reason(c["reason"]), c["detail"])


def _stopped(c: dict[str, str]) -> StoppedSlice:
    total = int(c["total"])
    indices = parse_ranges(c["indices"], limit=min(total, 10_000_000))
    dim, stopped = _DIMS[c["dim"]], int(c["stopped"])
    since, last = int(c["since_step"]), int(c["last_grad_step"])
    return StoppedSlice(c["name"], dim, stopped, total, indices, since, last, _reason(c["reason"]), c["detail"])


def _experts(c: dict[str, str]) -> IdleExperts:
    total = int(c["total"])
    idx = parse_ranges(c["experts"], limit=min(total, 1_000_000))
    return IdleExperts(c["layer"], c["state"], idx, total, int(c["since_step"]), _reason(c["reason"]), c["detail"])


def _precision(c: dict[str, str]) -> PrecisionLoss:
    mean, top, steps = float(c["mean_frac"]), float(c["max_frac"]), int(c["steps"])
    return PrecisionLoss(c["name"], c["dtype"], mean, top, steps, c["detail"])


def read_alerts(table: Table) -> list[Alert]:
    """The `gradlog/alerts` table's alerts (step, kind, name, detail); a damaged row is left out."""
    cols, rows = table
    index = {c: i for i, c in enumerate(cols)}
    out = []
    for r in rows:
        try:
            out.append(Alert(int(r[index["step"]]), r[index["kind"]], r[index["name"]], r[index["detail"]]))
        except (KeyError, IndexError, ValueError):
            continue  # a damaged row: the others still count
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
        step=_int(summary["first_nonfinite_step"], -1),
        name=summary["first_nonfinite_tensor"],
        count=_int(summary.get("first_nonfinite_count", "0")),
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
    never = [_never(c) for c in table_cells(run.tables[names.NEVER_UPDATED], names.TABLE_COLUMNS)]
    partly = _rows(run, names.PARTLY_UPDATED, names.PARTLY_COLUMNS, "name", _partly)
    stalled = _rows(run, names.STALLED, names.STALLED_COLUMNS, "name", _stalled)
    stopped = _rows(run, names.STOPPED_SLICES, names.STOPPED_COLUMNS, "name", _stopped)
    experts = _rows(run, names.EXPERTS, names.EXPERT_COLUMNS, "layer", _experts)
    precision = _rows(run, names.PRECISION, names.PRECISION_COLUMNS, "name", _precision)
    tracked = _int(run.summary().get("tracked_tensors", ""), -1)
    summary, first = _judged_on(run)
    return Report(
        never_updated=never,
        partly_updated=partly,
        stalled=stalled,
        policy=recorded_policy(run),
        stopped_slices=stopped,
        experts=experts,
        precision=precision,
        first_nonfinite=first,
        optimizer_steps=_int(summary.get("optimizer_steps", "0")),
        measured_steps=_int(summary.get("measured_steps", "0")),
        skipped_steps=_int(summary.get("skipped_steps", "0")),
        tracked_tensors=tracked if tracked >= 0 else len(series_names(run) | {r.name for r in never}),
        error=summary.get("error") or None,
        hint=summary.get("hint") or None,
    )
