"""Read a finished (or crashed) gradlog run back from disk.

TensorBoard: a log dir or one event file, read by gradlog's own record reader (`readers.tfevents`):
each file opened once, a corrupt record skipped (reading resumes at the next intact one) and named.

W&B: an offline run dir (or the `.wandb` file in it), through `gradlog.readers.wandb_offline`.

The run folder may come from someone else: every file goes through `readers.files` (regular files inside
the folder only, size caps), and a bad row or value is skipped and named in `RunData.skipped`, never fatal.

The result is backend-neutral `RunData`: the same shape `MemoryWriter` keeps in memory.
"""

from __future__ import annotations

import math
import os
import posixpath
import stat
import struct
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from gradlog.measure import tags
from gradlog.readers.files import (
    Limits,
    Refused,
    find_files,
    inside,
    loads_json,
    open_regular,
    read_regular,
    real_root,
    shown,
)
from gradlog.readers.points import Series, SeriesBuilder
from gradlog.verdict.policy import Policy, Rule
from gradlog.verdict.report import (
    DIM_NAMES,
    EXPERT_COLUMNS,
    PARTLY_COLUMNS,
    PRECISION_COLUMNS,
    STALLED_COLUMNS,
    STOPPED_COLUMNS,
    TABLE_COLUMNS,
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

Table = tuple[list[str], list[list[str]]]

#: Tag prefixes gradlog writes (`weights/grad_norm/`, ..., `gradlog/`) or wrote before the `weights/` group
#: (`grad_norm/`, ...); a run with none of them is not a gradlog run.
GRADLOG_PREFIXES = (*tags.SCALAR_PREFIXES, *tags.OLD_SCALAR_PREFIXES, tags.RUN)
TABLE_NAMES = (
    "gradlog/never_updated",
    "gradlog/partly_updated",
    "gradlog/stalled",
    "gradlog/stopped_slices",
    "gradlog/experts",
    "gradlog/precision",
    "gradlog/summary",
    "gradlog/alerts",
    "gradlog/policy",
    "gradlog/segment",  # a resumed run's segments (gradlog/resume.py)
)
ORDER_TAG = "gradlog/tensor_order"  # written by the TensorBoard writer (writers/tb_format.py)
#: At most this many "Skipped (unreadable)" lines are kept; the last one counts the rest.
MAX_SKIPPED_LINES = 200
#: The answer so far, written on histogram steps: `gradlog/provisional/<name>` for `gradlog/<name>`.
PROVISIONAL_PREFIX = "gradlog/provisional/"


def _wanted_table(name: str) -> bool:
    return name in TABLE_NAMES or name.startswith(PROVISIONAL_PREFIX)


class BadRun(Exception):
    """The path cannot be read as a gradlog run; the message says what was found and what to pass instead."""


@dataclass
class RunData:
    """`scalars[tag]`: (step, value) points in step order (a `Series`: 16 bytes a point), `tables[name] =
    (columns, rows)`, what was skipped (damage: the report is partial) and `notes` (worth saying, not
    damage: a crashed run's torn tail)."""

    path: str
    backend: str
    scalars: dict[str, Sequence[tuple[int, float]]] = field(default_factory=dict)
    tables: dict[str, Table] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: Set when the run never closed and its tables are the last provisional ones: the step they are as of.
    provisional_step: int | None = None

    @classmethod
    def from_memory(cls, writer: Any, path: str = "<memory>") -> RunData:
        """From a `MemoryWriter` (notebooks, tests): the same analysis without a file in between."""
        scalars = current_names({tag: Series(sorted(points)) for tag, points in writer.scalars.items()})
        tables = {name: (list(cols), [list(r) for r in rows]) for name, (cols, rows) in writer.tables.items()}
        return settle_provisional(cls(path=path, backend="memory", scalars=scalars, tables=tables))

    def has_gradlog_data(self) -> bool:
        return any(t.startswith(GRADLOG_PREFIXES) for t in self.scalars) or any(n in self.tables for n in TABLE_NAMES)


def load(path: str, *, limits: Limits | None = None) -> RunData:
    """Read the run at `path`: a TensorBoard log dir or event file, or a W&B offline run dir or `.wandb` file.

    Only regular files inside `path` (symlinks resolved) are opened, within `limits` (`readers.files.Limits`).
    """
    limits = limits if limits is not None else Limits()
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise BadRun(
            f"{path!r} does not exist; pass a TensorBoard log dir, an event file or a W&B offline run dir"
        ) from None
    except OSError as exc:
        raise BadRun(f"{path!r} cannot be read ({exc.strerror or exc})") from None
    try:
        kind, target, root, files = _detect(path, st, limits)
        if kind == "tensorboard":
            _one_run(target, [os.path.basename(f) for f in files])
            run = _load_tensorboard(target, root, files, limits)
        else:
            run = _load_wandb(files, root, limits)
        run = settle_provisional(run)
    except Refused as exc:
        raise BadRun(str(exc)) from None
    if not run.has_gradlog_data():
        what = ", ".join(sorted(run.scalars)[:5]) or "no scalars"
        skipped = f"; skipped: {'; '.join(run.skipped[:5])}" if run.skipped else ""
        raise BadRun(
            f"{path!r} holds no gradlog data (found {what}{skipped}); "
            "pass the log dir a GradLogger wrote (log_dir=...) or its W&B offline run dir"
        )
    if len(run.skipped) > MAX_SKIPPED_LINES:
        extra = len(run.skipped) - MAX_SKIPPED_LINES + 1
        run.skipped[MAX_SKIPPED_LINES - 1 :] = [f"... and {extra} more unreadable parts ({len(run.skipped)} in all)"]
    return run


def current_names(scalars: dict[str, Any]) -> dict[str, Any]:
    """`scalars` under today's tag names: a run written before the `weights/` group (`grad_norm/<name>`,
    ...) gets `weights/grad_norm/<name>`, so every view reads one set of names (`gradlog.measure.tags`)."""
    rename = tags.old_to_new(scalars)
    return {rename.get(t, t): v for t, v in scalars.items()} if rename else scalars


def settle_provisional(run: RunData) -> RunData:
    """The final tables win; a run that never closed gets its last provisional tables under the final
    names, with `provisional_step` saying which step they are as of."""
    provisional = {n: t for n, t in run.tables.items() if n.startswith(PROVISIONAL_PREFIX)}
    for n in provisional:
        del run.tables[n]
    if "gradlog/summary" in run.tables or "gradlog/never_updated" in run.tables or not provisional:
        return run
    for n, table in provisional.items():
        run.tables["gradlog/" + n[len(PROVISIONAL_PREFIX) :]] = table
    summary = {r[0]: r[1] for r in run.tables.get("gradlog/summary", ([], []))[1] if len(r) >= 2}
    step = summary.get("as_of_step", "")
    run.provisional_step = int(step) if step.lstrip("-").isdigit() else -1
    return run


def _is_event_file(name: str) -> bool:
    return "tfevents" in name


def _is_candidate(name: str) -> bool:
    return _is_event_file(name) or name.endswith(".wandb")


_PROBE_BYTES = 1 << 16


def _looks_like_gradlog(run_dir: str, candidates: list[str], limits: Limits) -> bool:
    """Whether a folder's own event files hold gradlog tags, from their first 64 KB (tags are plain bytes)."""
    for full in candidates:
        if os.path.dirname(full) != run_dir or not _is_event_file(os.path.basename(full)):
            continue
        try:
            with open_regular(full, run_dir, max_bytes=limits.max_file_bytes, what="event file") as f:
                head = f.read(_PROBE_BYTES)
        except (OSError, Refused):
            continue
        if any(p.encode() in head for p in GRADLOG_PREFIXES):
            return True
    return False


def _detect(path: str, st: os.stat_result, limits: Limits) -> tuple[str, str, str, list[str]]:
    """(kind, target, root, files): ('tensorboard', log dir or event file, ...) or ('wandb', .wandb file, ...).

    `root` is the resolved folder every file read must stay inside: `path` itself, or a file's folder;
    `files` are the files to read, each once.
    """
    if not stat.S_ISDIR(st.st_mode):
        real = os.path.realpath(path)
        root = os.path.dirname(real)
        if not stat.S_ISREG(st.st_mode):
            raise BadRun(f"{path!r} is not a regular file or a folder; pass a run folder or an event file")
        if _is_event_file(os.path.basename(path)) or _is_event_file(os.path.basename(real)):
            return "tensorboard", real, root, [real]
        if path.endswith(".wandb") or real.endswith(".wandb"):
            return "wandb", real, root, [real]
        raise BadRun(
            f"{path!r} is neither a TensorBoard event file (events.out.tfevents.*) nor a W&B run file (*.wandb)"
        )
    root = real_root(path)
    notes: list[str] = []
    candidates = find_files(root, _is_candidate, limits, notes)
    tb_runs = sorted({os.path.dirname(f) for f in candidates if _is_event_file(os.path.basename(f))})
    # Lightning writes its own event files in lightning_logs/version_N/ and the callback's run in its
    # gradlog/ subfolder: other programs' runs do not count when gradlog's are there.
    ours = [r for r in tb_runs if _looks_like_gradlog(r, candidates, limits)]
    if root in tb_runs and (len(tb_runs) == 1 or root in ours):  # event files right here: this is the run
        tb_runs = [root]
    else:
        tb_runs = ours or tb_runs
    wandb_runs = wandb_groups([f for f in candidates if f.endswith(".wandb")])
    runs = [("tensorboard", r) for r in tb_runs] + [("wandb", group[-1]) for group in wandb_runs.values()]
    if root in tb_runs or len(runs) == 1:
        kind, target = runs[0]
        if kind == "wandb":  # every segment of a resumed W&B run: one logical run
            return kind, target, root, next(g for g in wandb_runs.values() if g[-1] == target)
        here = [f for f in candidates if os.path.dirname(f) == target and _is_event_file(os.path.basename(f))]
        return kind, target, root, here
    if not runs:
        unlisted = f" ({'; '.join(notes[:3])})" if notes else ""
        raise BadRun(
            f"{path!r} holds no TensorBoard event file and no W&B offline run{unlisted}; "
            "pass the log dir a GradLogger wrote (log_dir=...) or a wandb/offline-run-* dir"
        )
    # one escaped line per run: a folder name holding a line break cannot fake a line of the message
    listed = "\n  ".join(shown(r if kind == "tensorboard" else os.path.dirname(r)) for kind, r in runs[:20])
    more = f"\n  ... and {len(runs) - 20} more" if len(runs) > 20 else ""
    raise BadRun(f"{path!r} holds {len(runs)} runs; pass one of them:\n  {listed}{more}")


#: gradlog's TensorBoard writer ends each event file's name with `.gradlog-run-<id>` (one id per writer).
_RUN_MARK = ".gradlog-run-"


def _one_run(path: str, event_files: list[str]) -> None:
    """Two GradLoggers that wrote into one folder are two runs: list them instead of merging them."""
    runs: dict[str, list[str]] = {}
    for name in event_files:
        key = name.rsplit(_RUN_MARK, 1)[1] if _RUN_MARK in name else ""
        runs.setdefault(key, []).append(name)
    if len([k for k in runs if k]) < 2:  # files of other writers (no mark) alone do not make a second run
        return
    listed = "\n  ".join(
        f"{key or 'other writers'}: "
        + ", ".join(os.path.join(path, n) for n in names[:3])
        + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")
        for key, names in sorted(runs.items())
    )
    raise BadRun(
        f"{path!r} holds {len(runs)} runs written into the same folder (one per GradLogger); "
        f"pass one event file of the run you want:\n  {listed}"
    )


# --- TensorBoard -------------------------------------------------------------------------------------
#: gradlog's writer tags a table `name/table` when a scalar already holds `name` (TensorBoard keeps one kind
#: of data per tag); torch's SummaryWriter.add_text appends `/text_summary`.
_TEXT_SUFFIXES = ("/table", "/text_summary")


def _table_name(tag: str) -> str:
    """The table a text tag holds: `gradlog/never_updated/table` -> `gradlog/never_updated`."""
    for suffix in _TEXT_SUFFIXES:
        if tag.endswith(suffix) and _wanted_table(tag[: -len(suffix)]):
            return tag[: -len(suffix)]
    return tag


def _tensor_scalar(tensor: Any) -> float | None:
    """The value of a scalar written as a tensor (TensorBoard's newer form), or None."""
    for values in (tensor.float_val, tensor.double_val, tensor.int_val, tensor.int64_val):
        if len(values) == 1:
            return float(values[0])
    packed = {1: "<f", 2: "<d"}.get(tensor.dtype)  # DT_FLOAT, DT_DOUBLE in tensor_content
    if packed is not None and len(tensor.tensor_content) == struct.calcsize(packed):
        return float(struct.unpack(packed, tensor.tensor_content)[0])
    return None


def _load_tensorboard(target: str, root: str, files: list[str], limits: Limits) -> RunData:
    try:
        from tensorboard.compat.proto import event_pb2

        from gradlog.readers.tfevents import events
    except ImportError as exc:
        raise BadRun(
            f"{target!r} is a TensorBoard run; reading it needs tensorboard: pip install 'gradlog[tensorboard]'"
        ) from exc
    del event_pb2  # imported only to fail early, with the install hint

    run = RunData(path=target, backend="tensorboard", files=files)
    points: defaultdict[str, SeriesBuilder] = defaultdict(SeriesBuilder)
    texts: dict[str, bytes] = {}
    plugins: dict[str, str] = {}  # TensorBoard writes a tag's metadata on its first value only
    order_raw: bytes | None = None  # the writer's tensor names in model order (gradlog/tensor_order)
    for file in run.files:
        name = os.path.basename(file)
        try:
            with open_regular(file, root, max_bytes=limits.max_file_bytes, what="event file") as f:
                size = os.fstat(f.fileno()).st_size
                for ev in events(f, size, name, run.skipped, limits.max_record_bytes):
                    if ev.WhichOneof("what") != "summary":
                        continue
                    step = int(ev.step)
                    for v in ev.summary.value:
                        if v.metadata.plugin_data.plugin_name:
                            plugins.setdefault(v.tag, v.metadata.plugin_data.plugin_name)
                        kind = v.WhichOneof("value")
                        if kind == "simple_value":
                            # a step written twice (a resumed run): the last one wins
                            points[v.tag].add(step, float(v.simple_value))
                        elif kind == "tensor" and plugins.get(v.tag) == "scalars":
                            value = _tensor_scalar(v.tensor)
                            if value is not None:
                                points[v.tag].add(step, value)
                        elif kind == "tensor" and v.tag == ORDER_TAG and v.tensor.string_val:
                            order_raw = v.tensor.string_val[0]
                        elif kind == "tensor" and v.tensor.string_val and _wanted_table(_table_name(v.tag)):
                            texts[_table_name(v.tag)] = v.tensor.string_val[0]  # the last one written wins
        except Refused as exc:
            run.skipped.append(str(exc))
        except OSError as exc:
            run.skipped.append(f"{name}: cannot be read ({exc.strerror or exc})")
    run.scalars = current_names({tag: b.build() for tag, b in points.items()})
    for table, raw in texts.items():
        try:
            run.tables[table] = parse_markdown_table(raw.decode("utf-8", "replace"))
        except ValueError as exc:
            run.skipped.append(f"table {table}: {exc}")
    if order_raw is not None:  # the writer's model-order record
        run.scalars = model_order(run.scalars, order_raw.decode("utf-8", "replace").split("\n"))
    return run


def _split_row(line: str) -> list[str]:
    """Cells of one `| a | b |` line; `\\|` is a literal bar and `\\\\` a literal backslash."""
    body = line.strip()
    if body.startswith("|"):
        body = body[1:]
    cells: list[str] = []
    cur: list[str] = []
    it: Iterator[str] = iter(body)
    for ch in it:
        if ch == "\\":
            nxt = next(it, "")
            cur.append(nxt if nxt in "|\\" else ch + nxt)
        elif ch == "|":
            cells.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        cells.append("".join(cur).strip())
    return [c.replace("<br>", " ") for c in cells]  # the writer wraps long cells with <br> (tb_format.WRAP_AT)


def parse_markdown_table(text: str) -> Table:
    """The inverse of the markdown tables gradlog writes: header row, `|---|` rule, body rows."""
    lines = [ln for ln in text.splitlines() if ln.strip().startswith("|")]
    if len(lines) < 2 or not set(lines[1].replace("|", "").strip()) <= set("-: "):
        raise ValueError("not a markdown table")
    columns = _split_row(lines[0])
    rows = []
    for ln in lines[2:]:
        cells = _split_row(ln)
        cells += [""] * (len(columns) - len(cells))
        rows.append(cells[: len(columns)])
    return columns, rows


# --- W&B ---------------------------------------------------------------------------------------------
#: The W&B writer logs some tables under another key (the plain name already holds a scalar there).
_WANDB_TABLES = {
    "gradlog/never_updated_table": "gradlog/never_updated",
    "gradlog/partly_updated_table": "gradlog/partly_updated",
    "gradlog/stalled_table": "gradlog/stalled",
    "gradlog/alerts_table": "gradlog/alerts",
}
#: Keys of the `gradlog/summary` table, in the order the logger writes them; W&B keeps them in run.summary.
_SUMMARY_KEYS = (
    "verdict",
    "status",
    "healthy",
    "optimizer_steps",
    "measured_steps",
    "skipped_steps",
    "tracked_tensors",
    "warnings",
    "notes",
    "first_nonfinite_step",
    "first_nonfinite_tensor",
    "first_nonfinite_count",
    "error",
    "run_id",  # what a resumed run reads back (gradlog/resume.py)
    "segment",
    "segment_first_step",
)
_STEP_KEY = "gradlog/step"


def _summary_text(value: Any) -> str:
    """Back to the strings gradlog wrote: W&B stores True/40 where the table said "True"/"40"."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _tensor_order(config: dict[str, Any]) -> list[str]:
    """The model order the W&B writer keeps in run.config (a plain list, or wandb's {"value": list})."""
    value = config.get("gradlog/tensor_order")
    if isinstance(value, dict):
        value = value.get("value")
    return [str(v) for v in value] if isinstance(value, list) else []


def model_order(scalars: dict[str, Any], order: list[str]) -> dict[str, Any]:
    """`scalars` with each family's per-tensor tags in model order (tensors not in `order` after, as read).

    W&B writes a history row's keys in arbitrary order, so without this a heatmap's rows would be shuffled."""
    if not order:
        return scalars
    rank = {name: i for i, name in enumerate(order)}
    names = list(scalars)
    first = {tag: i for i, tag in enumerate(names)}

    def family(tag: str) -> tuple[str, str]:
        """(metric, tensor name) of a per-tensor tag (`weights/grad_norm/fc.weight`), else (group, rest)."""
        split = tags.split(tag)
        if split is not None:
            return split
        group, _, rest = tag.partition("/")
        return group, rest

    def key(tag: str) -> tuple[str, int, int]:
        fam, name = family(tag)
        return (fam, rank.get(name, len(rank)), first[tag])

    families = {family(tag)[0]: i for i, tag in reversed(list(enumerate(names)))}
    return {t: scalars[t] for t in sorted(names, key=lambda t: (families[family(t)[0]], *key(t)))}


def _table_path(rel: Any) -> str | None:
    """A table path named in the run file, if it is a relative path that stays inside `files/`, else None."""
    if not isinstance(rel, str) or not rel or "\0" in rel or "\\" in rel:
        return None
    norm = posixpath.normpath(rel)
    if posixpath.isabs(norm) or os.path.isabs(rel) or norm == ".." or norm.startswith("../") or norm == ".":
        return None
    return norm


def _read_table(run_dir: str, root: str, rel: Any, limits: Limits) -> Table:
    """One W&B table file: only a relative path inside the run's `files/` folder, only a regular file."""
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
    doc = loads_json(data)
    if not isinstance(doc, dict) or not isinstance(doc.get("columns"), list) or not isinstance(doc.get("data"), list):
        raise ValueError("not a W&B table (no columns and data lists)")
    columns = [_summary_text(c) for c in doc["columns"]]
    rows = []
    for r in doc["data"]:
        if not isinstance(r, list):
            raise ValueError("a table row is not a list")
        rows.append([_summary_text(c) for c in r])
    return columns, rows


def wandb_runs(folder: str) -> dict[str, list[str]]:
    """The W&B runs under `folder` (a W&B `dir`'s `wandb/` folder): run id -> its segments' files."""
    from gradlog.readers.wandb_offline import find_run_files

    return wandb_groups(find_run_files(folder)) if os.path.isdir(folder) else {}


def wandb_groups(run_files: list[str]) -> dict[str, list[str]]:
    """W&B run files by run id (`run-<id>.wandb`), each group oldest first: a resumed run (`wandb.init(id=...,
    resume="allow")`, as gradlog's `Output(resume=...)` does) writes one `offline-run-<time>-<id>` folder per
    segment, all with the same id. Folders sort by their start time, then by the file's age."""
    groups: dict[str, list[str]] = {}
    for f in run_files:
        name = os.path.basename(f)
        key = name[len("run-") : -len(".wandb")] if name.startswith("run-") else f
        groups.setdefault(key, []).append(f)
    for files in groups.values():
        files.sort(key=lambda f: (os.path.basename(os.path.dirname(f)), _mtime(f), f))
    return groups


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return 0.0


def _load_wandb(run_files: list[str], root: str, limits: Limits) -> RunData:
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
        offline = _read_wandb_file(run_file, root, limits, run)
        table_files = _wandb_history(offline.history, points, run.skipped)
        if table_files or "gradlog/verdict" in offline.summary:
            answer = (os.path.dirname(run_file), table_files, offline.summary)
        order = _tensor_order(offline.config) or order
    scalars = current_names({tag: b.build() for tag, b in points.items()})
    run.scalars = model_order(scalars, order)
    if answer is not None:
        _wandb_answer(run, *answer, root, limits)
    return run


def _read_wandb_file(run_file: str, root: str, limits: Limits, run: RunData) -> Any:
    """One `.wandb` file read; what is damaged goes to `run.skipped`, a missing exit record to `run.notes`."""
    from gradlog.readers.wandb_offline import WandbFileError, read_offline_run

    try:
        offline = read_offline_run(run_file, root=root, max_bytes=limits.max_file_bytes)
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


def _wandb_history(
    history: list[dict[str, Any]], points: dict[str, SeriesBuilder], skipped: list[str]
) -> dict[str, Any]:
    """Add the history rows' numbers to `points`; returns the tables they name (table name -> file path)."""
    table_files: dict[str, Any] = {}
    bad_steps: dict[str, list[int]] = {}
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
                points[key].add(int(step), float(value))
            elif isinstance(value, dict) and value.get("_type") == "table-file" and "path" in value:
                table_files[_WANDB_TABLES.get(key, key)] = value["path"]
    for why, numbers in bad_steps.items():
        first = ", ".join(str(r) for r in numbers[:5]) + (", ..." if len(numbers) > 5 else "")
        skipped.append(f"{len(numbers)} history row{'s' * (len(numbers) != 1)} skipped: {why} (rows {first})")
    return table_files


def _wandb_answer(
    run: RunData, run_dir: str, table_files: dict[str, Any], summary: dict[str, Any], root: str, limits: Limits
) -> None:
    """The tables (their files in `run_dir`) and the summary of one segment into `run`."""
    for name, rel in table_files.items():
        if not _wanted_table(name):
            continue
        try:
            run.tables[name] = _read_table(run_dir, root, rel, limits)
        except (Refused, OSError, ValueError, RecursionError) as exc:
            run.skipped.append(f"table {name}: {str(rel)[:200]} cannot be read ({type(exc).__name__}: {exc})")
    if "gradlog/verdict" in summary:
        rows = [[k, _summary_text(summary[f"gradlog/{k}"])] for k in _SUMMARY_KEYS if f"gradlog/{k}" in summary]
        run.tables["gradlog/summary"] = (["key", "value"], rows)


# --- the Report close() returned, rebuilt from its tables ---------------------------------------------
#: Tags whose tensors count as tracked when the summary lacks the count.
_NAMED_BY = (tags.prefix("weight_norm"), tags.prefix("grad_norm"), tags.prefix("update_ratio"))


def _cells(table: Table, wanted: list[str]) -> Iterator[dict[str, str]]:
    """Each row of `table` as {column: cell} for the `wanted` columns (a missing cell reads as "")."""
    columns, rows = table
    index = {c: i for i, c in enumerate(columns)}
    for r in rows:
        yield {c: (r[index[c]] if c in index and index[c] < len(r) else "") for c in wanted}


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
    if "gradlog/policy" not in run.tables:
        return None
    cols, rows = run.tables["gradlog/policy"]
    kept: list[Rule] = []
    for r in rows:
        try:
            kept.extend(Policy.from_rows(cols, [r]).rules)
        except ValueError as exc:
            run.skipped.append(f"table gradlog/policy: rule {r!r} cannot be read ({exc})")
    return Policy(kept)


def closed_report(run: RunData) -> Report | None:
    """The `Report` that close() returned, rebuilt from the tables it wrote (None when the run never
    closed). `gradlog report` judges it with the same function close() used, so both say the same.
    A row that cannot be read is skipped and named in `run.skipped`."""
    if "gradlog/never_updated" not in run.tables:
        return None
    summary: dict[str, str] = {}
    if "gradlog/summary" in run.tables:
        summary = {r[0]: r[1] for r in run.tables["gradlog/summary"][1] if len(r) >= 2}
    never: list[NeverUpdated] = []
    for c in _cells(run.tables["gradlog/never_updated"], TABLE_COLUMNS):
        name, _, aliases = c["name"].partition(" (= ")
        no_dims = c["shape"] in ("scalar", "not materialised", "")
        shape = () if no_dims else tuple(_int(d) for d in c["shape"].split("x"))
        never.append(
            NeverUpdated(
                name=name,
                shape=shape,
                numel=_int(c["numel"]),
                reason=_reason(c["reason"]),
                detail=c["detail"],
                aliases=tuple(a for a in aliases.rstrip(")").split(", ") if a) if aliases else (),
                suspect=c["suspect"] == "True",
            )
        )
    partly: list[PartlyUpdated] = []
    dims = {v: k for k, v in DIM_NAMES.items()}
    for c in _cells(run.tables.get("gradlog/partly_updated", ([], [])), PARTLY_COLUMNS):
        try:
            indices = parse_ranges(c["indices"], limit=min(int(c["total"]), 10_000_000))  # total is from the file too
            partly.append(
                PartlyUpdated(
                    name=c["name"],
                    dim=dims[c["dim"]],
                    never=int(c["never"]),
                    total=int(c["total"]),
                    indices=indices,
                    reason=_reason(c["reason"]),
                    detail=c["detail"],
                )
            )
        except (KeyError, ValueError) as exc:
            run.skipped.append(f"table gradlog/partly_updated: row {c['name']!r} cannot be read ({exc})")
    stalled: list[Stalled] = []
    for c in _cells(run.tables.get("gradlog/stalled", ([], [])), STALLED_COLUMNS):
        try:
            since, last = int(c["since_step"]), int(c["last_update_step"])
        except ValueError as exc:
            run.skipped.append(f"table gradlog/stalled: row {c['name']!r} cannot be read ({exc})")
            continue
        stalled.append(Stalled(c["name"], since, last, _reason(c["reason"]), c["detail"]))
    stopped, experts, precision = _stopped_expert_precision_tables(run)
    first = None
    if "first_nonfinite_step" in summary and "first_nonfinite_tensor" in summary:
        first = NonFinite(
            step=_int(summary["first_nonfinite_step"], -1),
            name=summary["first_nonfinite_tensor"],
            count=_int(summary.get("first_nonfinite_count", "0")),
        )
    names = series_names(run)
    tracked = _int(summary.get("tracked_tensors", ""), -1)
    if not summary:  # written last at close, so the first thing a cut-off or damaged file loses
        summary = _summary_from_series(run)
        first = series_first_nonfinite(run)
        run.notes.append(
            "the summary table written at close is missing (the file was cut off or damaged): step counts "
            "and the first non-finite gradient come from the logged series"
        )
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
        tracked_tensors=tracked if tracked >= 0 else len(names | {r.name for r in never}),
        error=summary.get("error") or None,
    )


def _stopped_expert_precision_tables(run: RunData) -> tuple[list[StoppedSlice], list[IdleExperts], list[PrecisionLoss]]:
    """The stopped-slice, expert and rounded-away tables (absent in older runs: empty)."""
    dims = {v: k for k, v in DIM_NAMES.items()}
    stopped: list[StoppedSlice] = []
    for c in _cells(run.tables.get("gradlog/stopped_slices", ([], [])), STOPPED_COLUMNS):
        try:
            total = int(c["total"])
            indices = parse_ranges(c["indices"], limit=min(total, 10_000_000))
            stopped.append(
                StoppedSlice(
                    c["name"],
                    dims[c["dim"]],
                    int(c["stopped"]),
                    total,
                    indices,
                    int(c["since_step"]),
                    int(c["last_grad_step"]),
                    _reason(c["reason"]),
                    c["detail"],
                )
            )
        except (KeyError, ValueError) as exc:
            run.skipped.append(f"table gradlog/stopped_slices: row {c['name']!r} cannot be read ({exc})")
    experts: list[IdleExperts] = []
    for c in _cells(run.tables.get("gradlog/experts", ([], [])), EXPERT_COLUMNS):
        try:
            total = int(c["total"])
            idx = parse_ranges(c["experts"], limit=min(total, 1_000_000))
            since = int(c["since_step"])
            experts.append(IdleExperts(c["layer"], c["state"], idx, total, since, _reason(c["reason"]), c["detail"]))
        except ValueError as exc:
            run.skipped.append(f"table gradlog/experts: row {c['layer']!r} cannot be read ({exc})")
    precision: list[PrecisionLoss] = []
    for c in _cells(run.tables.get("gradlog/precision", ([], [])), PRECISION_COLUMNS):
        try:
            mean, top, steps = float(c["mean_frac"]), float(c["max_frac"]), int(c["steps"])
        except ValueError as exc:
            run.skipped.append(f"table gradlog/precision: row {c['name']!r} cannot be read ({exc})")
            continue
        precision.append(PrecisionLoss(c["name"], c["dtype"], mean, top, steps, c["detail"]))
    return stopped, experts, precision
