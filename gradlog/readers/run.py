"""Read a finished (or crashed) gradlog run back from disk, with each backend's own reader.

TensorBoard: a log dir or one event file, through tensorboard's `EventAccumulator` (scalars, and the
text summaries gradlog writes for its tables). A separate pass over the TFRecord framing says what the
accumulator silently skips: a torn last record, or everything after a CRC mismatch.

W&B: an offline run dir (or the `.wandb` file in it), through `gradlog.readers.wandb_offline`.

The result is backend-neutral `RunData`: the same shape `MemoryWriter` keeps in memory.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from gradlog.verdict.report import (
    DIM_NAMES,
    PARTLY_COLUMNS,
    STALLED_COLUMNS,
    TABLE_COLUMNS,
    NeverUpdated,
    NonFinite,
    PartlyUpdated,
    Reason,
    Report,
    Stalled,
    parse_ranges,
)

Table = tuple[list[str], list[list[str]]]

#: Tag prefixes gradlog writes; a run with none of them is not a gradlog run.
GRADLOG_PREFIXES = (
    "grad_norm/",
    "update_ratio/",
    "weight_norm/",
    "grad_nonfinite/",
    "grad_zero_frac/",
    "dead_frac/",
    "gradlog/",
)
TABLE_NAMES = (
    "gradlog/never_updated",
    "gradlog/partly_updated",
    "gradlog/stalled",
    "gradlog/summary",
    "gradlog/alerts",
)


class BadInput(Exception):
    """The path cannot be read as a gradlog run; the message says what was found and what to pass instead."""


@dataclass
class RunData:
    """`scalars[tag] = [(step, value), ...]` in step order, `tables[name] = (columns, rows)`, and what was skipped."""

    path: str
    backend: str
    scalars: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    tables: dict[str, Table] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @classmethod
    def from_memory(cls, writer: Any, path: str = "<memory>") -> RunData:
        """From a `MemoryWriter` (notebooks, tests): the same analysis without a file in between."""
        scalars = {tag: sorted(points) for tag, points in writer.scalars.items()}
        tables = {name: (list(cols), [list(r) for r in rows]) for name, (cols, rows) in writer.tables.items()}
        return cls(path=path, backend="memory", scalars=scalars, tables=tables)

    def has_gradlog_data(self) -> bool:
        return any(t.startswith(GRADLOG_PREFIXES) for t in self.scalars) or any(n in self.tables for n in TABLE_NAMES)


def load(path: str) -> RunData:
    """Read the run at `path`: a TensorBoard log dir or event file, or a W&B offline run dir or `.wandb` file."""
    if not os.path.exists(path):
        raise BadInput(f"{path!r} does not exist; pass a TensorBoard log dir, an event file or a W&B offline run dir")
    kind, target = _detect(path)
    run = _load_tensorboard(target) if kind == "tensorboard" else _load_wandb(target)
    if not run.has_gradlog_data():
        what = ", ".join(sorted(run.scalars)[:5]) or "no scalars"
        skipped = f"; skipped: {'; '.join(run.skipped)}" if run.skipped else ""
        raise BadInput(
            f"{path!r} holds no gradlog data (found {what}{skipped}); "
            "pass the log dir a GradLogger wrote (log_dir=...) or its W&B offline run dir"
        )
    return run


def _is_event_file(name: str) -> bool:
    return "tfevents" in os.path.basename(name)


def _wandb_files(root: str) -> list[str]:
    """Every W&B run file under `root`, once each (wandb/latest-run is a symlink to one of the run dirs)."""
    found = {os.path.realpath(p) for p in glob.glob(os.path.join(root, "**", "*.wandb"), recursive=True)}
    return sorted(found)


_PROBE_BYTES = 1 << 16


def _looks_like_gradlog(run_dir: str) -> bool:
    """Whether a folder's own event files hold gradlog tags, from their first 64 KB (tags are plain bytes)."""
    for name in sorted(os.listdir(run_dir)):
        full = os.path.join(run_dir, name)
        if not _is_event_file(name) or not os.path.isfile(full):
            continue
        try:
            with open(full, "rb") as f:
                head = f.read(_PROBE_BYTES)
        except OSError:
            continue
        if any(p.encode() in head for p in GRADLOG_PREFIXES):
            return True
    return False


def _detect(path: str) -> tuple[str, str]:
    """('tensorboard', log dir or event file) or ('wandb', the run's .wandb file)."""
    if os.path.isfile(path):
        if _is_event_file(path):
            return "tensorboard", path
        if path.endswith(".wandb"):
            return "wandb", path
        raise BadInput(
            f"{path!r} is neither a TensorBoard event file (events.out.tfevents.*) nor a W&B run file (*.wandb)"
        )
    entries = sorted(os.listdir(path))
    tb_runs = sorted({os.path.dirname(f) for f in glob.glob(os.path.join(path, "**", "*tfevents*"), recursive=True)})
    if any(_is_event_file(e) for e in entries) and (len(tb_runs) == 1 or _looks_like_gradlog(path)):
        return "tensorboard", path
    # Lightning writes its own event files in lightning_logs/version_N/ and the callback's run in its
    # gradlog/ subfolder: other programs' runs do not count when gradlog's are there.
    ours = [r for r in tb_runs if _looks_like_gradlog(r)]
    tb_runs = ours or tb_runs
    runs = [("tensorboard", r) for r in tb_runs] + [("wandb", f) for f in _wandb_files(path)]
    if len(runs) == 1:
        return runs[0]
    if not runs:
        raise BadInput(
            f"{path!r} holds no TensorBoard event file and no W&B offline run; "
            "pass the log dir a GradLogger wrote (log_dir=...) or a wandb/offline-run-* dir"
        )
    listed = "\n  ".join(r if kind == "tensorboard" else os.path.dirname(r) for kind, r in runs[:20])
    raise BadInput(f"{path!r} holds {len(runs)} runs; pass one of them:\n  {listed}")


# --- TensorBoard -------------------------------------------------------------------------------------
_LENGTH = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_MASK_DELTA = 0xA282EAD8


def _masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC32C: the C `crc32c` package (the tensorboard extra), else tensorboard's own."""
    try:
        import crc32c

        crc = int(crc32c.crc32c(data))
    except ImportError:
        from tensorboard.compat.tensorflow_stub import pywrap_tensorflow as stub

        return int(stub.masked_crc32c(data))
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def scan_records(path: str) -> tuple[int, str | None]:
    """Walk the TFRecord framing of one event file: (records intact, what stops the reader there or None).

    TensorBoard's reader stops without a word at the first torn or corrupt record; this says where and why.
    """
    size = os.path.getsize(path)
    n = 0
    with open(path, "rb") as f:
        offset = 0
        while offset < size:
            header = f.read(12)
            if len(header) < 12:
                return n, f"truncated record header at byte {offset} ({size - offset} bytes not read)"
            length_bytes = header[:8]
            if _U32.unpack(header[8:])[0] != _masked_crc(length_bytes):
                return n, f"corrupt record header at byte {offset}: the remaining {size - offset} bytes were skipped"
            (length,) = _LENGTH.unpack(length_bytes)
            if offset + 12 + length + 4 > size:
                return n, f"truncated last record at byte {offset} ({size - offset} bytes not read)"
            payload = f.read(length)
            (crc,) = _U32.unpack(f.read(4))
            if crc != _masked_crc(payload):
                return n, f"corrupt record at byte {offset}: the remaining {size - offset} bytes were skipped"
            n += 1
            offset += 12 + length + 4
    return n, None


#: gradlog's writer tags a table `name/table` when a scalar already holds `name` (TensorBoard keeps one kind
#: of data per tag); torch's SummaryWriter.add_text appends `/text_summary`.
_TEXT_SUFFIXES = ("/table", "/text_summary")


@contextlib.contextmanager
def c_crc_for_tensorboard() -> Iterator[bool]:
    """Let tensorboard's reader check CRCs with the C `crc32c` package while we read.

    Without TensorFlow, tensorboard verifies every record with a pure-Python CRC32C: 75% of the time
    reading a 111 MB run (20 s). The C function returns the same numbers (checked on a probe first);
    it is swapped in only inside this block, and the slow path stays whenever anything looks different.
    Yields whether the fast path is on.
    """
    try:
        import crc32c
        from tensorboard.compat.tensorflow_stub import pywrap_tensorflow as stub

        original = stub.crc32c
        probe = bytes(range(256)) * 3
        usable = original(probe) == crc32c.crc32c(probe)
    except Exception:  # another tensorboard layout, or no crc32c: read the slow way
        usable = False
    if not usable:
        yield False
        return
    stub.crc32c = crc32c.crc32c
    try:
        yield True
    finally:
        stub.crc32c = original


def _event_files(target: str) -> list[str]:
    if os.path.isfile(target):
        return [target]
    return sorted(os.path.join(target, e) for e in os.listdir(target) if _is_event_file(e))


def _load_tensorboard(target: str) -> RunData:
    try:
        from tensorboard.backend.event_processing import event_accumulator as ea
    except ImportError as exc:
        raise BadInput(
            f"{target!r} is a TensorBoard run; reading it needs tensorboard: pip install 'gradlog[tensorboard]'"
        ) from exc

    run = RunData(path=target, backend="tensorboard", files=_event_files(target))
    for f in run.files:
        try:
            records, problem = scan_records(f)
        except OSError as exc:
            run.skipped.append(f"{os.path.basename(f)}: cannot be read ({exc})")
            continue
        if problem is not None:
            run.skipped.append(f"{os.path.basename(f)}: {problem}; {records} records before it were read")
    guidance = {ea.SCALARS: 0, ea.TENSORS: 0, ea.HISTOGRAMS: 1, ea.COMPRESSED_HISTOGRAMS: 1, ea.IMAGES: 1}
    # purge_orphaned_data=False: gradlog writes its close-time tables at an earlier step than some scalars,
    # which the accumulator would otherwise take for a restarted run and throw away.
    acc = ea.EventAccumulator(target, size_guidance=guidance, purge_orphaned_data=False)
    try:
        with c_crc_for_tensorboard():
            acc.Reload()
    except Exception as exc:  # a record with a valid CRC but not an Event: keep what was read before it
        run.skipped.append(f"reading stopped early ({type(exc).__name__}: {exc})")
    tags = acc.Tags()
    for tag in tags.get(ea.SCALARS, []):
        points: dict[int, float] = {}
        for ev in acc.Scalars(tag):
            points[int(ev.step)] = float(ev.value)  # a step written twice (a resumed run): the last one wins
        run.scalars[tag] = sorted(points.items())
    for tag in tags.get(ea.TENSORS, []):
        name = tag
        for suffix in _TEXT_SUFFIXES:
            if tag.endswith(suffix) and tag[: -len(suffix)] in TABLE_NAMES:
                name = tag[: -len(suffix)]
        if name not in TABLE_NAMES:
            continue
        events = acc.Tensors(tag)
        if not events:
            continue
        proto = events[-1].tensor_proto
        if not proto.string_val:
            run.skipped.append(f"table {name}: not a text summary")
            continue
        try:
            run.tables[name] = parse_markdown_table(proto.string_val[0].decode("utf-8"))
        except ValueError as exc:
            run.skipped.append(f"table {name}: {exc}")
    if "gradlog/tensor_order" in tags.get(ea.TENSORS, []):  # the writer's model-order record
        events = acc.Tensors("gradlog/tensor_order")
        if events and events[-1].tensor_proto.string_val:
            order = events[-1].tensor_proto.string_val[0].decode("utf-8", "replace").split("\n")
            run.scalars = model_order(run.scalars, order)
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
    "first_nonfinite_step",
    "first_nonfinite_tensor",
    "first_nonfinite_count",
    "error",
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
    tags = list(scalars)
    first = {tag: i for i, tag in enumerate(tags)}

    def key(tag: str) -> tuple[str, int, int]:
        family, _, name = tag.partition("/")
        return (family, rank.get(name, len(rank)), first[tag])

    families = {tag.partition("/")[0]: i for i, tag in reversed(list(enumerate(tags)))}
    return {t: scalars[t] for t in sorted(tags, key=lambda t: (families[t.partition("/")[0]], *key(t)))}


def _load_wandb(run_file: str) -> RunData:
    from gradlog.readers.wandb_offline import WandbFileError, read_offline_run

    run_dir = os.path.dirname(run_file)
    try:
        offline = read_offline_run(run_file)
    except (WandbFileError, ImportError) as exc:  # ImportError names pip install 'gradlog[wandb]'
        raise BadInput(str(exc)) from exc
    run = RunData(path=run_dir, backend="wandb", files=[run_file], skipped=list(offline.skipped))
    points: dict[str, dict[int, float]] = {}
    table_files: dict[str, str] = {}
    for row in offline.history:
        step = row.get(_STEP_KEY, row.get("_step"))
        if not isinstance(step, (int, float)) or isinstance(step, bool):
            continue
        for key, value in row.items():
            if key.startswith("_") or key == _STEP_KEY:
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                points.setdefault(key, {})[int(step)] = float(value)
            elif isinstance(value, dict) and value.get("_type") == "table-file" and "path" in value:
                table_files[_WANDB_TABLES.get(key, key)] = str(value["path"])
    run.scalars = model_order({tag: sorted(p.items()) for tag, p in points.items()}, _tensor_order(offline.config))
    for name, rel in table_files.items():
        if name not in TABLE_NAMES:
            continue
        file = os.path.join(run_dir, "files", rel)
        try:
            with open(file, encoding="utf-8") as f:
                doc = json.load(f)
            columns = [str(c) for c in doc["columns"]]
            run.tables[name] = (columns, [[str(c) for c in r] for r in doc["data"]])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            run.skipped.append(f"table {name}: {rel} cannot be read ({type(exc).__name__}: {exc})")
    summary = offline.summary
    if "gradlog/verdict" in summary:
        rows = [[k, _summary_text(summary[f"gradlog/{k}"])] for k in _SUMMARY_KEYS if f"gradlog/{k}" in summary]
        run.tables["gradlog/summary"] = (["key", "value"], rows)
    return run


# --- the Report close() returned, rebuilt from its tables ---------------------------------------------
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
        shape = () if c["shape"] in ("scalar", "") else tuple(_int(d) for d in c["shape"].split("x"))
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
            indices = parse_ranges(c["indices"])
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
    first = None
    if "first_nonfinite_step" in summary and "first_nonfinite_tensor" in summary:
        first = NonFinite(
            step=_int(summary["first_nonfinite_step"], -1),
            name=summary["first_nonfinite_tensor"],
            count=_int(summary.get("first_nonfinite_count", "0")),
        )
    names = {t.split("/", 1)[1] for t in run.scalars if t.startswith(("weight_norm/", "grad_norm/", "update_ratio/"))}
    tracked = _int(summary.get("tracked_tensors", ""), -1)
    return Report(
        never_updated=never,
        partly_updated=partly,
        stalled=stalled,
        first_nonfinite=first,
        optimizer_steps=_int(summary.get("optimizer_steps", "0")),
        measured_steps=_int(summary.get("measured_steps", "0")),
        skipped_steps=_int(summary.get("skipped_steps", "0")),
        tracked_tensors=tracked if tracked >= 0 else len(names | {r.name for r in never}),
        error=summary.get("error") or None,
    )
