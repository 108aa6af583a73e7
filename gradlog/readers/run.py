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

Table = tuple[list[str], list[list[str]]]

#: Tag prefixes gradlog writes; a run with none of them is not a gradlog run.
GRADLOG_PREFIXES = ("grad_norm/", "update_ratio/", "weight_norm/", "grad_nonfinite/", "grad_zero_frac/", "gradlog/")
TABLE_NAMES = ("gradlog/never_updated", "gradlog/summary", "gradlog/alerts")
#: The answer so far, written on histogram steps: `gradlog/provisional/<name>` for `gradlog/<name>`.
PROVISIONAL_PREFIX = "gradlog/provisional/"


def _wanted_table(name: str) -> bool:
    return name in TABLE_NAMES or name.startswith(PROVISIONAL_PREFIX)


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
    #: Set when the run never closed and its tables are the last provisional ones: the step they are as of.
    provisional_step: int | None = None

    @classmethod
    def from_memory(cls, writer: Any, path: str = "<memory>") -> RunData:
        """From a `MemoryWriter` (notebooks, tests): the same analysis without a file in between."""
        scalars = {tag: sorted(points) for tag, points in writer.scalars.items()}
        tables = {name: (list(cols), [list(r) for r in rows]) for name, (cols, rows) in writer.tables.items()}
        return settle_provisional(cls(path=path, backend="memory", scalars=scalars, tables=tables))

    def has_gradlog_data(self) -> bool:
        return any(t.startswith(GRADLOG_PREFIXES) for t in self.scalars) or any(n in self.tables for n in TABLE_NAMES)


def load(path: str) -> RunData:
    """Read the run at `path`: a TensorBoard log dir or event file, or a W&B offline run dir or `.wandb` file."""
    if not os.path.exists(path):
        raise BadInput(f"{path!r} does not exist; pass a TensorBoard log dir, an event file or a W&B offline run dir")
    kind, target = _detect(path)
    run = settle_provisional(_load_tensorboard(target) if kind == "tensorboard" else _load_wandb(target))
    if not run.has_gradlog_data():
        what = ", ".join(sorted(run.scalars)[:5]) or "no scalars"
        skipped = f"; skipped: {'; '.join(run.skipped)}" if run.skipped else ""
        raise BadInput(
            f"{path!r} holds no gradlog data (found {what}{skipped}); "
            "pass the log dir a GradLogger wrote (log_dir=...) or its W&B offline run dir"
        )
    return run


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
    return "tfevents" in os.path.basename(name)


def _wandb_files(root: str) -> list[str]:
    """Every W&B run file under `root`, once each (wandb/latest-run is a symlink to one of the run dirs)."""
    found = {os.path.realpath(p) for p in glob.glob(os.path.join(root, "**", "*.wandb"), recursive=True)}
    return sorted(found)


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
    if any(_is_event_file(e) for e in entries):
        _one_run(path, [e for e in entries if _is_event_file(e)])
        return "tensorboard", path
    tb_runs = sorted({os.path.dirname(f) for f in glob.glob(os.path.join(path, "**", "*tfevents*"), recursive=True)})
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


#: gradlog's TensorBoard writer ends each event file's name with `.gradlog-run-<id>` (one id per writer).
_RUN_MARK = ".gradlog-run-"


def _one_run(path: str, event_files: list[str]) -> None:
    """Two GradLoggers that wrote into one folder are two runs: list them instead of merging them."""
    runs: dict[str, list[str]] = {}
    for name in event_files:
        key = name.rsplit(_RUN_MARK, 1)[1] if _RUN_MARK in name else ""
        runs.setdefault(key, []).append(name)
    if len(runs) < 2:
        return
    listed = "\n  ".join(
        f"{key or 'other writers'}: "
        + ", ".join(os.path.join(path, n) for n in names[:3])
        + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")
        for key, names in sorted(runs.items())
    )
    raise BadInput(
        f"{path!r} holds {len(runs)} runs written into the same folder (one per GradLogger); "
        f"pass one event file of the run you want:\n  {listed}"
    )


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
            if tag.endswith(suffix) and _wanted_table(tag[: -len(suffix)]):
                name = tag[: -len(suffix)]
        if not _wanted_table(name):
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
    return cells


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
_WANDB_TABLES = {"gradlog/never_updated_table": "gradlog/never_updated", "gradlog/alerts_table": "gradlog/alerts"}
#: Keys of the `gradlog/summary` table, in the order the logger writes them; W&B keeps them in run.summary.
_SUMMARY_KEYS = (
    "verdict",
    "healthy",
    "optimizer_steps",
    "measured_steps",
    "skipped_steps",
    "first_nonfinite_step",
    "first_nonfinite_tensor",
)
_STEP_KEY = "gradlog/step"


def _summary_text(value: Any) -> str:
    """Back to the strings gradlog wrote: W&B stores True/40 where the table said "True"/"40"."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


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
    run.scalars = {tag: sorted(p.items()) for tag, p in points.items()}
    for name, rel in table_files.items():
        if not _wanted_table(name):
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
