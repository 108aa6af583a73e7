"""A W&B run read back from its offline run files: series, the report's tables and summary, the model order.

A resumed run (`wandb.init(id=..., resume="allow")`, as gradlog's `Output(resume=...)` does) writes one
`offline-run-<time>-<id>` folder per segment, all with the same run id: `groups` puts them together and
`read_run_files` reads them as one run. Every file goes through `runformat.files` (a regular file inside
the run folder, within the size caps); a bad row or value is skipped and named, never fatal.
`gradlog.readers.run` reads a run a user names with it; a resumed run (gradlog/run/resume.py) reads its
earlier W&B segments with `runs_in`, so the training path never imports the readers.
"""

from __future__ import annotations

import math
import os
import posixpath
import sys
from collections import defaultdict
from typing import Any

from gradlog.runformat import names
from gradlog.runformat.cells import summary_text
from gradlog.runformat.files import Limits, Refused, inside, loads_json, read_regular, real_root
from gradlog.runformat.points import SeriesBuilder
from gradlog.runformat.rundata import (
    BadRun,
    RunData,
    Table,
    model_order,
    settle_provisional,
    wanted_table,
)

#: The W&B writer logs some tables under another key (the plain name already holds a scalar there).
_WANDB_TABLES = {key: name for name, key in names.WANDB_TABLE_KEYS.items()}
_STEP_KEY = names.STEP_KEY
#: The largest integer a float holds (about 1.8e308); JSON integers past it make `float()` raise.
_FLOAT_INT = int(sys.float_info.max)


def _tensor_order(config: dict[str, Any]) -> list[str]:
    """The model order the W&B writer keeps in run.config (a plain list, or wandb's {"value": list})."""
    value = config.get(names.ORDER_KEY)
    if isinstance(value, dict):
        value = value.get("value")
    return [str(v) for v in value] if isinstance(value, list) else []


def _table_path(rel: Any) -> str | None:
    """A table path named in the run file, if it is a relative path that stays inside `files/`, else None."""
    if not isinstance(rel, str) or not rel or "\0" in rel or "\\" in rel:
        return None
    norm = posixpath.normpath(rel)
    if posixpath.isabs(norm) or os.path.isabs(rel) or norm == ".." or norm.startswith("../") or norm == ".":
        return None
    return norm


#: A table holds one row (one JSON list) per tensor: a million is far past any model, and parsing that many costs
#: ~60 MB. A 30 MB file of empty rows (`[[],[],...]`, 10 million) took 7.8 GB before this cap.
_MAX_TABLE_CONTAINERS = 1_000_000


def _read_table(run_dir: str, root: str, rel: Any, limits: Limits) -> tuple[Table, int]:
    """One W&B table file (only a relative path inside the run's `files/` folder, only a regular file), and how
    many of its rows were left out for having another number of cells than it has columns."""
    norm = _table_path(rel)
    if norm is None:
        raise Refused(f"path {str(rel)[:200]!r} is not a relative path inside the run's files/ folder; not opened")
    files_dir = os.path.join(run_dir, "files")
    files_root = real_root(files_dir)
    if not inside(files_root, root):
        raise Refused(f"{files_dir}: the run's files/ folder points outside the run folder (to {files_root})")
    data = read_regular(
        os.path.join(files_dir, *norm.split("/")),
        files_root,
        max_bytes=limits.max_table_bytes,
        what="table file",
        cap="max_table_bytes",
    )
    containers = data.count(b"[") + data.count(b"{")  # what parsing costs most: ~60 bytes each, from 2 bytes
    if containers > _MAX_TABLE_CONTAINERS:
        raise ValueError(
            f"{containers:,} lists and objects, more than the {_MAX_TABLE_CONTAINERS:,} a table of gradlog's holds "
            "(one row per tensor); not parsed"
        )
    doc = loads_json(data)
    if not isinstance(doc, dict) or not isinstance(doc.get("columns"), list) or not isinstance(doc.get("data"), list):
        raise ValueError("not a W&B table (no columns and data lists)")
    columns = [summary_text(c) for c in doc["columns"]]
    rows = []
    for r in doc["data"]:
        if not isinstance(r, list):
            raise ValueError("a table row is not a list")
        if len(r) == len(columns):  # W&B writes whole rows: another length is damage, left out and counted
            rows.append([summary_text(c) for c in r])
    return (columns, rows), len(doc["data"]) - len(rows)


def runs_in(folder: str) -> dict[str, list[str]]:
    """The W&B runs under `folder` (a W&B `dir`'s `wandb/` folder): run id -> its segments' files."""
    from gradlog.runformat.wandb_offline import find_run_files

    return groups(find_run_files(folder)) if os.path.isdir(folder) else {}


def groups(run_files: list[str]) -> dict[str, list[str]]:
    """W&B run files by run id (`run-<id>.wandb`), each group oldest first. Folders sort by their start
    time (`offline-run-<time>-<id>`), then by the file's age."""
    out: dict[str, list[str]] = {}
    for f in run_files:
        name = os.path.basename(f)
        key = name[len("run-") : -len(".wandb")] if name.startswith("run-") else f
        out.setdefault(key, []).append(f)
    for files in out.values():
        files.sort(key=lambda f: (os.path.basename(os.path.dirname(f)), _mtime(f), f))
    return out


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return 0.0


def read_run_files(run_files: list[str], root: str, limits: Limits) -> RunData:
    """One W&B run from its segments' files, oldest first: the series of every segment (a step written twice
    keeps its last value); the tables and summary of the last segment that wrote any (at close a resumed run's
    tables speak for every segment)."""
    dirs = [os.path.dirname(f) for f in run_files]
    path = dirs[0] if len(set(dirs)) == 1 else os.path.commonpath(dirs)
    run = RunData(path=path, backend="wandb", files=list(run_files))
    points: defaultdict[str, SeriesBuilder] = defaultdict(SeriesBuilder)
    order: list[str] = []
    answer: tuple[str, dict[str, Any], dict[str, Any]] | None = None
    for run_file in run_files:
        offline = _read_file(run_file, root, limits, run)
        table_files = _history(offline.history, points, run.skipped)
        if table_files or names.summary_key(names.VERDICT) in offline.summary:
            answer = (os.path.dirname(run_file), table_files, offline.summary)
        order = _tensor_order(offline.config) or order
    scalars = {tag: b.build() for tag, b in points.items()}
    run.scalars = model_order(scalars, order)
    if answer is not None:
        _answer(run, *answer, root, limits)
    return run


#: The longest JSON object a reader parses where it expects a table-file reference (gradlog's are ~200 bytes).
_MAX_REF = 4096


def _wanted(where: str, path: list[str], text: str) -> bool:
    """The items this reader uses, told from their JSON text before parsing it: in history rows the numbers and
    the table-file references (wandb writes one as a short object, or as one short item per field), in the
    summary anything but a list, in the config the model order. The rest (histogram lists, long strings) is
    left unparsed: a 40 MB file of `[[],[],...]` rows took 1.3 GB."""
    head = text[:1]
    if where == "history":
        return head in _NUMBER_START or (head != "[" and len(text) <= _MAX_REF)
    if where == "summary":
        return head != "[" and (head != "{" or len(text) <= _MAX_REF)
    return path[0] == names.ORDER_KEY


_NUMBER_START = frozenset("-0123456789NI")  # NaN, Infinity, -Infinity too: parsed however long


def _read_file(run_file: str, root: str, limits: Limits, run: RunData) -> Any:
    """One `.wandb` file read; what is damaged goes to `run.skipped`, a missing exit record to `run.notes`."""
    from gradlog.runformat.wandb_offline import WandbFileError, read_offline_run

    try:
        offline = read_offline_run(
            run_file, root=root, max_bytes=limits.max_file_bytes, keep=_wanted, max_record_bytes=limits.max_record_bytes
        )
    except (WandbFileError, ImportError) as exc:  # ImportError names pip install 'gradlog[wandb]'
        raise BadRun(str(exc)) from exc
    except OSError as exc:
        raise BadRun(f"{run_file!r} cannot be read ({exc.strerror or exc})") from exc
    run.skipped += list(offline.skipped)
    if offline.torn_tail:
        if offline.finished:  # the exit record was written, so the damage after it is damage
            run.skipped += offline.torn_tail
        else:
            run.notes.append(
                "the W&B run has no exit record: it was killed or is still running; " + "; ".join(offline.torn_tail)
            )
    elif not offline.finished:
        run.notes.append("the W&B run has no exit record: it was killed or is still running")
    return offline


def _history(history: list[dict[str, Any]], points: dict[str, SeriesBuilder], skipped: list[str]) -> dict[str, Any]:
    """Add the history rows' numbers to `points`; returns the tables they name (table name -> file path)."""
    table_files: dict[str, Any] = {}
    bad_steps: dict[str, list[int]] = {}
    bad_values: dict[str, list[int]] = {}
    for n, row in enumerate(history):
        step = row.get(_STEP_KEY, row.get("_step"))
        if isinstance(step, bool) or not isinstance(step, (int, float)):
            bad_steps.setdefault(f"{_STEP_KEY} is not a number", []).append(n)
            continue
        if not math.isfinite(step):
            bad_steps.setdefault(f"{_STEP_KEY} is {step}", []).append(n)
            continue
        for key, value in row.items():
            if key.startswith("_") or key == _STEP_KEY:
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if isinstance(value, int) and not -_FLOAT_INT <= value <= _FLOAT_INT:  # float() would raise
                    bad_values.setdefault(key, []).append(n)
                    continue
                points[key].add(int(step), float(value))
            elif isinstance(value, dict) and value.get("_type") == "table-file" and "path" in value:
                table_files[_WANDB_TABLES.get(key, key)] = value["path"]
    for why, numbers in bad_steps.items():
        skipped.append(f"{len(numbers)} history row{'s' * (len(numbers) != 1)} skipped: {why} (rows {_rows(numbers)})")
    for key, numbers in bad_values.items():
        skipped.append(
            f"{key[:200]!r}: {len(numbers)} value{'s' * (len(numbers) != 1)} skipped, an integer beyond any "
            f"float (rows {_rows(numbers)})"
        )
    return table_files


def _rows(numbers: list[int]) -> str:
    return ", ".join(str(r) for r in numbers[:5]) + (", ..." if len(numbers) > 5 else "")


def _answer(
    run: RunData, run_dir: str, table_files: dict[str, Any], summary: dict[str, Any], root: str, limits: Limits
) -> None:
    """The tables (their files in `run_dir`) and the summary of one segment into `run`."""
    for name, rel in table_files.items():
        if not wanted_table(name):
            continue
        try:
            run.tables[name], bad = _read_table(run_dir, root, rel, limits)
        except (Refused, OSError, ValueError, RecursionError) as exc:
            run.skipped.append(f"table {name}: {str(rel)[:200]} cannot be read ({type(exc).__name__}: {exc})")
            continue
        if bad:
            columns = len(run.tables[name][0])
            run.skipped.append(f"table {name}: {bad} row{'s' * (bad != 1)} without {columns} cells left out")
    if names.summary_key(names.VERDICT) in summary:  # the summary table, kept by W&B in run.summary
        keys = [(k, names.summary_key(k)) for k in names.SUMMARY_KEYS]
        rows = [[k, summary_text(summary[key])] for k, key in keys if key in summary]
        run.tables[names.SUMMARY] = (list(names.SUMMARY_COLUMNS), rows)


def read_segments(run_files: list[str], folder: str, limits: Limits | None = None) -> RunData:
    """Every segment of one W&B run under `folder`, its provisional tables settled; `BadRun` when they hold
    no gradlog data (what a resumed run reads back)."""
    limits = limits if limits is not None else Limits()
    try:
        run = settle_provisional(read_run_files(run_files, real_root(folder), limits))
    except (OSError, Refused) as exc:
        raise BadRun(f"{folder!r} cannot be read ({exc})") from None
    if not run.has_gradlog_data():
        raise BadRun(f"{folder!r} holds no gradlog data")
    return run
