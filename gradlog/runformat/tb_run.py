"""A TensorBoard run read back from its event files: scalars, the report's tables, the model order.

Every file is opened through `runformat.files` (a regular file inside the run folder, within the size
caps) and read with gradlog's own record reader (`runformat.tfevents`: damage is skipped and named).
`gradlog.readers.run` reads a run a user names with it; a resumed run (gradlog/run/resume.py) reads its
earlier segment with `read_folder`, so the training path never imports the readers.
"""

from __future__ import annotations

import os
import struct
from collections import defaultdict
from typing import Any

from gradlog.runformat.files import Limits, Refused, open_regular, real_root
from gradlog.runformat.markdown import parse_markdown_table
from gradlog.runformat.names import ORDER_TAG, RUN_MARK, TEXT_SUFFIXES
from gradlog.runformat.points import SeriesBuilder
from gradlog.runformat.rundata import BadRun, RunData, model_order, settle_provisional, wanted_table

#: gradlog's TensorBoard writer ends each event file's name with `.gradlog-run-<id>` (one id per writer).
_MARK = "." + RUN_MARK


def is_event_file(name: str) -> bool:
    return "tfevents" in name


def run_key(name: str) -> str:
    """The run id an event file's name carries (`...gradlog-run-<id>`), "" for another writer's file."""
    return name.rsplit(_MARK, 1)[1] if _MARK in name else ""


def write_order(path: str) -> tuple[int, int, int, str]:
    """Sort key of event files in the order they were written: `events.out.tfevents.<time>.<host>.<pid>.
    <serial>[.gradlog-run-<id>]` by its numbers (time, pid, serial), not as text, where serial 10 sorts
    before 9 (a process's tenth writer in the same second as its ninth: a resume in one process, a test
    suite). Names of another form come first, in text order."""
    name = os.path.basename(path).split(_MARK, 1)[0]
    parts = name.split(".")
    if len(parts) >= 6 and all(p.isdigit() for p in (parts[3], parts[-2], parts[-1])):
        return int(parts[3]), int(parts[-2]), int(parts[-1]), name
    return -1, -1, -1, name


def _table_name(tag: str) -> str:
    """The table a text tag holds: `gradlog/never_updated/table` -> `gradlog/never_updated`."""
    for suffix in TEXT_SUFFIXES:
        if tag.endswith(suffix) and wanted_table(tag[: -len(suffix)]):
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


def read_event_files(target: str, root: str, files: list[str], limits: Limits) -> RunData:
    """The run in `files` (event files inside `root`), as `RunData`; damage is named in its `skipped`."""
    try:
        from tensorboard.compat.proto import event_pb2

        from gradlog.runformat.tfevents import events
    except ImportError as exc:
        raise BadRun(
            f"{target!r} is a TensorBoard run; reading it needs tensorboard: pip install 'gradlog[tensorboard]'"
        ) from exc
    del event_pb2  # imported only to fail early, with the install hint

    run = RunData(path=target, backend="tensorboard", files=sorted(files, key=write_order))  # the last one wins
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
                        elif kind == "tensor" and v.tensor.string_val and wanted_table(_table_name(v.tag)):
                            texts[_table_name(v.tag)] = v.tensor.string_val[0]  # the last one written wins
        except Refused as exc:
            run.skipped.append(str(exc))
        except OSError as exc:
            run.skipped.append(f"{name}: cannot be read ({exc.strerror or exc})")
    run.scalars = {tag: b.build() for tag, b in points.items()}
    for table, raw in texts.items():
        try:
            run.tables[table] = parse_markdown_table(raw.decode("utf-8", "replace"))
        except ValueError as exc:
            run.skipped.append(f"table {table}: {exc}")
    if order_raw is not None:  # the writer's model-order record
        run.scalars = model_order(run.scalars, order_raw.decode("utf-8", "replace").split("\n"))
    return run


def read_folder(log_dir: str, limits: Limits | None = None) -> RunData:
    """The run whose event files lie in `log_dir` itself (not its subfolders), its provisional tables
    settled; `BadRun` when they hold no gradlog data."""
    limits = limits if limits is not None else Limits()
    try:
        root = real_root(log_dir)
        with os.scandir(root) as it:
            files = sorted(e.path for e in it if is_event_file(e.name) and e.is_file(follow_symlinks=False))
        run = settle_provisional(read_event_files(root, root, files[: limits.max_files], limits))
    except (OSError, Refused) as exc:
        raise BadRun(f"{log_dir!r} cannot be read ({exc})") from None
    if not run.has_gradlog_data():
        raise BadRun(f"{log_dir!r} holds no gradlog data")
    return run
