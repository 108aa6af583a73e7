"""What the gradlog TensorBoard tab shows, built from plain `{tag: [(step, value)]}` series and tables.

Nothing here imports TensorBoard, so it is tested without a server and reused by other front ends.
The heatmap travels as one binary payload: a little-endian u32 header length, the JSON header (names
in model order, steps, metric), zero padding to a multiple of 4, then rows x columns float32 values.
At 1,000 tensors x 1,000 steps that is 4 MB, parsed by the browser with one `Float32Array` view.
"""

from __future__ import annotations

import array
import json
import math
import struct
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from gradlog.runformat import names as fmt
from gradlog.runformat import tags as names_mod
from gradlog.runformat.cells import bare_name
from gradlog.runformat.names import PACK_MISSING, PACKED

#: Metrics the heatmap can show (tags `weights/<metric>/<tensor>`) -> how the browser colours it.
METRICS: dict[str, str] = {
    "update_ratio": "log",
    "grad_norm": "log",
    "grad_zero_frac": "linear",
    "grad_nonfinite": "count",
}
#: Special cells (all real values are >= 0, NaN or +Inf).
#: no value at that step (not in the optimizer, not measured, not written): the packed rows' own sentinel
NOT_MEASURED = PACK_MISSING
NO_GRAD = -2.0  # the tensor had no gradient at that step
ZERO_GRAD = -3.0  # the gradient was exactly zero (all entries)
PROVISIONAL = "gradlog (training, provisional):"
FINAL_LATER = "The final verdict comes at close()."
#: Mark kinds, strongest last (a tensor in several tables keeps the strongest).
MARK_ORDER = ("no_update", "nonfinite", "partly_updated", "stopped_slices", "stalled", "never_updated")

Series = Mapping[str, Sequence[tuple[int, float]]]
Table = tuple[list[str], list[list[str]]]


def metric_prefix(metric: str) -> str:
    """The prefix of `metric`'s per-tensor tags: `weights/update_ratio/` (`gradlog.runformat.tags`)."""
    return names_mod.prefix(metric)


def has_tensor_series(tags: Sequence[str]) -> bool:
    """Whether a run's tags hold any per-tensor series the heatmap can show."""
    heads = tuple(names_mod.prefix(m) for m in METRICS)
    return any(t.startswith(heads) for t in tags)


def tensor_names(tags: Sequence[str], order: Sequence[str]) -> list[str]:
    """Tensor names in model order: `order` first (as written by the writer), then any others as listed."""
    group = names_mod.TENSORS
    heads = tuple(names_mod.prefix(m) for m in (*METRICS, "weight_norm"))
    seen: dict[str, None] = dict.fromkeys(order)
    present: set[str] = set()
    for tag in tags:
        if tag.startswith(heads):
            name = tag[len(group) :].partition("/")[2]
            seen.setdefault(name, None)
            present.add(name)
    return [n for n in seen if n in present]


def needs_gradient(metric: str, values: Sequence[tuple[int, float]] | None, n_steps: int) -> bool:
    """Whether a tensor's cells can only be told apart with its gradient norm: it misses steps (no gradient
    there?), has a 0 update ratio (no update, or no/zero gradient?), or the metric is the sparse NaN/Inf
    count. Most tensors need not: reading every gradient norm would double the points read."""
    if metric == "grad_nonfinite" or not values or len(values) < n_steps:
        return True
    return metric == "update_ratio" and any(v == 0 for _, v in values)


def heatmap(
    names: Sequence[str], metric: str, values: Series, grad_norm: Series, grad_read: set[str] | None = None
) -> tuple[list[int], array.array[float]]:
    """(steps, row-major float32 cells) for `metric`; `values` and `grad_norm` are keyed by tensor name.

    A cell with no value is NO_GRAD when the tensor had no gradient there (no grad_norm at that step
    while other tensors had one), else NOT_MEASURED. A 0 where the gradient was all zero is ZERO_GRAD,
    where there was no gradient NO_GRAD; grad_norm 0 and zero fraction 1 are ZERO_GRAD. Non-finite
    counts are written only once non-zero (gradlog/writers/quiet.py): a missing count with a gradient is 0.
    `grad_read`: the tensors whose gradient norms were read (default: all); the others are taken to have
    had a gradient wherever they have a value (see `needs_gradient`).
    """
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; choose from {', '.join(METRICS)}")
    grad_steps = sorted({s for n in names for s, _ in grad_norm.get(n, ())})
    steps = sorted({s for n in names for s, _ in values.get(n, ())} | set(grad_steps))
    col = {s: i for i, s in enumerate(steps)}
    grad_set = set(grad_steps)
    ncol = len(steps)
    cells = array.array("f", [NOT_MEASURED]) * (len(names) * ncol)
    for r, name in enumerate(names):
        base = r * ncol
        g = dict(grad_norm.get(name, ()))
        # a tensor with no value at all never had a gradient: "no gradient" wherever others had one
        first = min([*g, *(s for s, _ in values.get(name, ()))], default=grad_steps[0] if grad_steps else None)
        known = grad_read is None or name in grad_read
        if first is not None and known:  # no gradient: a step the others had one, from this tensor's first value on
            for s in grad_set:
                if s >= first and s not in g:
                    cells[base + col[s]] = NO_GRAD
        if metric == "grad_nonfinite":
            for s in g:
                cells[base + col[s]] = 0.0
        for s, v in values.get(name, ()):
            cells[base + col[s]] = _cell(metric, v, g.get(s) if known else 1.0)
        if metric == "update_ratio" and not values.get(name):  # a gradient, never an update: not in the optimizer
            for s, gv in g.items():
                cells[base + col[s]] = _cell(metric, 0.0, gv)
    return steps, cells


def _cell(metric: str, v: float, grad: float | None) -> float:
    if math.isnan(v) or math.isinf(v):
        return v
    if metric == "update_ratio" and v == 0:
        return NO_GRAD if grad is None else ZERO_GRAD if grad == 0 else 0.0
    if (metric == "grad_norm" and v == 0) or (metric == "grad_zero_frac" and v == 1):
        return ZERO_GRAD
    return v


def encode(header: dict[str, Any], cells: Any) -> bytes:
    """The binary payload described in the module docstring (`cells`: an array('f') or a little-endian
    float32 numpy array)."""
    head = json.dumps(header, allow_nan=False, separators=(",", ":")).encode("utf-8")
    head += b" " * (-(len(head) + 4) % 4)
    if isinstance(cells, array.array) and sys.byteorder != "little":
        cells = _swapped(cells)
    body: bytes = cells.tobytes()
    return struct.pack("<I", len(head)) + head + body


def decode(data: bytes) -> tuple[dict[str, Any], list[float]]:
    """The inverse of `encode` (for tests and scripts)."""
    (n,) = struct.unpack_from("<I", data)
    header = json.loads(data[4 : 4 + n])
    cells = array.array("f")
    cells.frombytes(data[4 + n :])
    if sys.byteorder != "little":
        cells.byteswap()
    return header, list(cells)


def _swapped(cells: array.array[float]) -> array.array[float]:
    out = array.array("f", cells)
    out.byteswap()
    return out


def name_in_cell(cell: str) -> str:
    """A table's name cell without the tied-weight aliases (`w (= a, b)`) or a slice suffix."""
    return bare_name(cell).strip()


def marks(tables: Mapping[str, Table], summary: Mapping[str, str], live: Mapping[str, str]) -> dict[str, str]:
    """tensor name -> the strongest finding: the final tables at close, the latest step's state before."""
    out = dict(live)

    def put(name: str, kind: str) -> None:
        if MARK_ORDER.index(kind) >= MARK_ORDER.index(out.get(name, MARK_ORDER[0])):
            out[name] = kind

    if summary.get("first_nonfinite_tensor"):
        put(summary["first_nonfinite_tensor"], "nonfinite")
    # stopped slices mark their tensor as such (not "stalled": the tab lists them under "Stopped slices");
    # rounded-away updates as partly updated
    for table, kind in (
        ("precision", "partly_updated"),
        ("partly_updated", "partly_updated"),
        ("stopped_slices", "stopped_slices"),
        ("stalled", "stalled"),
        ("never_updated", "never_updated"),
    ):
        if table in tables:
            columns, rows = tables[table]
            at = columns.index("name") if "name" in columns else 0
            for row in rows:
                if len(row) > at and row[at].strip():
                    put(name_in_cell(row[at]), kind)
    return out


def live_marks(names: Sequence[str], ratio: Series, grad_norm: Series, nonfinite: Series) -> dict[str, str]:
    """Before close: tensors whose latest update ratio is 0 with a non-zero gradient (no update), or
    whose latest gradient held NaN/Inf."""
    out: dict[str, str] = {}
    for name in names:
        pts = ratio.get(name)
        g = dict(grad_norm.get(name, ()))
        if pts:
            s, v = pts[-1]
            if math.isnan(v) or math.isinf(v):
                out[name] = "nonfinite"
            elif v == 0 and g.get(s, 0) not in (0,) and s in g:
                out[name] = "no_update"
        nf = nonfinite.get(name)
        if nf and nf[-1][1] != 0:
            out[name] = "nonfinite"
        elif g and not math.isfinite(g[max(g)]):
            out[name] = "nonfinite"
    return out


def closed(tables: Mapping[str, Table] | None, summary: Mapping[str, str]) -> Any:
    """The `Report` rebuilt from a closed run's tables under the policy it recorded (and its alerts), as
    `gradlog report` rebuilds it; None before close()."""
    if tables is None or "never_updated" not in tables or not summary:
        return None
    from gradlog.runformat.rundata import RunData
    from gradlog.verdict.tables import closed_report, read_alerts  # imports torch: only for a run that closed

    run = RunData("<tensorboard>", "tensorboard", tables={fmt.RUN + k: v for k, v in tables.items()})
    run.tables[fmt.SUMMARY] = (list(fmt.SUMMARY_COLUMNS), [[k, v] for k, v in summary.items()])
    report = closed_report(run)
    if report is not None:
        alerts = tables.get(fmt.ALERTS.removeprefix(fmt.RUN))
        if alerts is not None:
            report.alerts = read_alerts(alerts)
    return report


#: the never-updated table's `suspect` cell in words (the written table holds Python's True/False)
SUSPECT_WORDS = {"True": "yes: looks accidental", "False": "no"}


def grouped_tables(report: Any) -> dict[str, Table]:
    """The record tables of a closed run with one row per cause (`Report.sections(grouped=True)`: a layer's
    units that died at one step in one row, its detail naming the tensors it touches), every cell in full;
    the never-updated table with its `suspect` column in words."""
    from gradlog.verdict.causes import group
    from gradlog.verdict.report import NeverUpdated, grouped_rows

    out: dict[str, Table] = {s.key: (s.columns, s.rows) for s in report.sections(grouped=True)}
    if report.never_updated:
        rows = grouped_rows("never_updated", report.never_updated, NeverUpdated.row)
        groups = group("never_updated", report.never_updated)  # one suspect per cause: it is part of the key
        words = [SUSPECT_WORDS[str(g[0].suspect)] for g in groups]
        out["never_updated"] = (NeverUpdated.columns(written=True), [[*r, w] for r, w in zip(rows, words)])
    return out


#: at most this many index ranges in a finding's line (the table's row has them all)
WHERE_RANGES = 4


def findings(report: Any) -> list[dict[str, Any]]:
    """`Report.findings()` (one per cause) each with `where`: the slices it names and since when ("units 1, 7
    (2 of 64) from step 55"), or "" for a whole tensor. The Findings list names a cause by its layer, so
    without it a layer whose units died at three steps read as three identical lines."""
    from gradlog.verdict.causes import group
    from gradlog.verdict.report import FINDINGS

    found: list[dict[str, Any]] = report.findings()
    places: list[str] = []
    for kind in FINDINGS:  # the causes in `Report.findings`' order
        for records in group(kind.KIND, report.records(kind)):
            if records[0].policy_kind() is None:
                break
            places.append(where(records))
    if len(places) != len(found):  # cannot pair them up: the findings as they are
        return found
    return [{**f, "where": w} for f, w in zip(found, places)]


def where(records: Sequence[Any]) -> str:
    """What of its tensors one cause covers: the slices (`units` where the cause spans a layer's tensors) and
    the step they stopped from; a stalled tensor's step; "" for whole tensors."""
    from gradlog.verdict.records import format_ranges

    first = records[0]
    since = getattr(first, "since_step", None)
    when = f"from step {since}" if isinstance(since, int) and since >= 0 else ""
    indices = getattr(first, "indices", None)
    if not indices:
        return when
    noun = "units" if len(records) > 1 else str(getattr(first, "slices", "slices"))
    n = len(indices)
    ranges = format_ranges(indices, WHERE_RANGES)
    what = f"{noun if n > 1 else noun.removesuffix('s')} {ranges} ({n} of {first.total})"
    return f"{what} {when}".strip()


def table_titles() -> dict[str, str]:
    """The tables the tab lists under the findings, in order, by key, with their titles: the records' own
    (`gradlog.verdict.report.FINDINGS`), then the alerts."""
    from gradlog.verdict.records import Record
    from gradlog.verdict.report import FINDINGS, Alert

    kinds: list[type[Record]] = [*FINDINGS, Alert]
    return {kind.KIND: kind.TITLE for kind in kinds}


def verdict(
    summary: Mapping[str, str],
    run_level: Mapping[str, Sequence[tuple[int, float]]],
    live: Mapping[str, str] | None = None,
    last_step: int | None = None,
    tables: Mapping[str, Table] | None = None,
) -> tuple[str, bool]:
    """(the verdict line, final?): the judge's (`gradlog.verdict.judge`) on the Report rebuilt from the
    run's tables under the policy it recorded, as `gradlog report` does; else the line gradlog wrote at
    close; else a provisional line from the run-level series of the latest step, else (a run without
    them) from the latest step's `live` marks."""
    report = closed(tables, summary)
    if report is not None:
        from gradlog.verdict.judge import judge

        return judge(report).text, summary.get("final") != "False"
    if summary.get("verdict"):
        return summary["verdict"], True
    last: dict[str, float] = {}
    step = None
    for tag, pts in run_level.items():
        if pts:
            step = pts[-1][0] if step is None else max(step, pts[-1][0])
            last[tag.partition("/")[2]] = pts[-1][1]
    if step is None and live and last_step is not None:
        counts = {k: sum(1 for v in live.values() if v == k) for k in ("no_update", "nonfinite")}
        parts = [
            f"{n} with {what}"
            for n, what in ((counts["no_update"], "no update"), (counts["nonfinite"], "NaN/Inf"))
            if n
        ]
        return f"{PROVISIONAL} at step {last_step}: {'; '.join(parts)}. {FINAL_LATER}", False
    if step is None:
        return "gradlog: no measured step yet", False
    parts = []
    for key, what in (
        ("no_update_tensors", "no update"),
        ("no_grad_tensors", "no gradient"),
        ("zero_grad_tensors", "all-zero gradient"),
        ("nonfinite_tensors", "NaN/Inf gradient"),
    ):
        if last.get(key):
            parts.append(f"{int(last[key])} with {what}")
    state = "; ".join(parts) if parts else "every tensor got a gradient and an update"
    return f"{PROVISIONAL} at step {step}: {state}. {FINAL_LATER}", False


__all__ = [
    "METRICS",
    "NOT_MEASURED",
    "NO_GRAD",
    "ZERO_GRAD",
    "decode",
    "encode",
    "has_tensor_series",
    "heatmap",
    "marks",
    "metric_prefix",
    "verdict",
]


# --- the packed rows (gradlog's TensorBoard writer writes one per step) --------------------------------------
# Row order of a packed step: `PACKED`; `PACK_MISSING` (= NOT_MEASURED) there means "no value".


def packed_matrices(points: Sequence[tuple[int, Any]], n: int) -> tuple[list[int], dict[str, Any]]:
    """(steps, {metric: float32 array [n, steps]}) from (step, array [len(PACKED), n_i]) points; tensors
    that did not exist yet at a step (n_i < n) are missing there. A step written twice keeps its last."""
    import numpy as np

    by_step: dict[int, Any] = {}
    for step, arr in points:
        by_step[int(step)] = arr
    steps = sorted(by_step)
    full = np.full((len(PACKED), n, len(steps)), NOT_MEASURED, dtype=np.float32)
    for j, step in enumerate(steps):
        try:  # a damaged step (not numbers, not a whole row per metric) stays not measured
            arr = np.asarray(by_step[step], dtype=np.float32).reshape(len(PACKED), -1)
        except (ValueError, TypeError):
            continue
        m = min(n, arr.shape[1])
        full[:, :m, j] = arr[:, :m]
    return steps, {metric: full[i] for i, metric in enumerate(PACKED)}


def packed_heatmap(metric: str, mats: Mapping[str, Any]) -> Any:
    """The same cells as `heatmap`, computed on whole arrays (a million cells in milliseconds)."""
    import numpy as np

    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; choose from {', '.join(METRICS)}")
    m = mats[metric]
    g = mats["grad_norm"]
    present = np.zeros(m.shape, dtype=bool)
    for arr in mats.values():
        present |= arr != NOT_MEASURED
    seen = np.maximum.accumulate(present, axis=1) if m.size else present
    seen[~present.any(axis=1)] = True  # never any value: no gradient wherever others had one
    no_grad = (g == NOT_MEASURED) & (g != NOT_MEASURED).any(axis=0)[None, :] & seen
    out = m.copy()
    if metric == "update_ratio":
        # a tensor with a gradient and never an update ratio is in no optimizer: no update, not "not measured"
        outside = (m == NOT_MEASURED).all(axis=1)[:, None] & (g != NOT_MEASURED)
        out[outside] = np.where(g[outside] == 0, ZERO_GRAD, 0.0)
        out[(m == 0) & (g == 0)] = ZERO_GRAD
        out[no_grad & ((m == NOT_MEASURED) | (m == 0))] = NO_GRAD
    elif metric == "grad_norm":
        out[m == 0] = ZERO_GRAD
        out[no_grad] = NO_GRAD
    else:
        if metric == "grad_zero_frac":
            out[m == 1] = ZERO_GRAD
        out[no_grad & (m == NOT_MEASURED)] = NO_GRAD
    return np.ascontiguousarray(out, dtype="<f4")


def packed_live_marks(names: Sequence[str], mats: Mapping[str, Any]) -> dict[str, str]:
    """`live_marks` from the latest packed step."""
    import numpy as np

    ratio, grad, nonfinite = mats["update_ratio"], mats["grad_norm"], mats["grad_nonfinite"]
    if ratio.shape[1] == 0:
        return {}
    r, g, nf = ratio[:, -1], grad[:, -1], nonfinite[:, -1]
    out: dict[str, str] = {}
    bad = ~np.isfinite(r) | ((nf != NOT_MEASURED) & (nf > 0)) | ~np.isfinite(g)
    stuck = (r == 0) & (g != NOT_MEASURED) & (g > 0)
    for i, name in enumerate(names[: len(r)]):
        if bad[i]:
            out[name] = "nonfinite"
        elif stuck[i]:
            out[name] = "no_update"
    return out
