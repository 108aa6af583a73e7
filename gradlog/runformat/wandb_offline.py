"""Read a W&B run file (`run-<id>.wandb`, the run's local transaction log) without a W&B server.

wandb ships no reader for these files, so gradlog has its own. The layout (LevelDB's log format with
a file header, checked against wandb 0.31's offline runs):

- a 7-byte header: `:W&B`, magic 0xBEE1 (little-endian u16), version byte 0;
- then 32 KiB blocks, counted from the start of the file, holding chunks. A chunk has a 7-byte header:
  CRC32 (zlib, unmasked) of the type byte followed by the data, u16 little-endian data length, and the
  type byte: 1 a whole record, 2 first, 3 middle, 4 last piece of a record. Fewer than 7 bytes left
  in a block are zero padding.
- each record is a `wandb.proto.wandb_internal_pb2.Record` protobuf. History, summary and config items
  carry `key` (one string) or `nested_key` (a path into a nested dict) and `value_json`.

A damaged file is read as far as possible: a bad chunk makes the reader skip to the next block (as
LevelDB does), and every skip is described in `OfflineRun.skipped`. A torn tail (the record in flight
when the process was killed) is dropped and described in `OfflineRun.torn_tail`: in a run without an
exit record it is the expected end of a crash, not damage.

The file may come from someone else: it is opened through `runformat.files` (a regular file, size cap),
JSON values are parsed with a nesting limit, and a bad value is skipped and named, never fatal.
"""

from __future__ import annotations

import os
import struct
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from gradlog.runformat.files import GIB, MAX_JSON_DEPTH, Limits, find_files, loads_json, read_regular, real_root

HEADER = struct.Struct("<4sHB")
IDENT, MAGIC, VERSION = b":W&B", 0xBEE1, 0
CHUNK = struct.Struct("<IHB")
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
INSTALL_HINT = "pip install 'gradlog[wandb]'"


class WandbFileError(ValueError):
    """The file is not a W&B run file, or (with `strict=True`) part of it could not be read."""


@dataclass
class OfflineRun:
    """What a run file holds. `history` rows are dicts like `wandb.log` received them (nested values
    rebuilt from `nested_key`), with `_step` always set; `summary` is the final summary after every update."""

    path: str
    run_id: str | None = None
    project: str | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    summary_updates: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    #: `define_metric` calls: {"name" or "glob_name": ..., "step_metric": ...}
    metrics: list[dict[str, str]] = field(default_factory=list)
    exit_code: int | None = None
    finished: bool = False
    skipped: list[str] = field(default_factory=list)
    #: what was cut off at the end of the file (a killed or still-running writer), apart from `skipped`
    torn_tail: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """True when every byte was read: no corrupt chunk, no torn record."""
        return not self.skipped and not self.torn_tail

    def column(self, key: str, x: str = "_step") -> list[tuple[Any, Any]]:
        """`(row[x], row[key])` for every history row that has `key` (e.g. `x="gradlog/step"`)."""
        return [(row.get(x), row[key]) for row in self.history if key in row]


def find_run_files(root: str | os.PathLike[str]) -> list[str]:
    """Every `run-*.wandb` under `root` (a WANDB_DIR, its `wandb/` folder or one run folder), oldest first.

    Folder symlinks are not followed (wandb/latest-run points at a run folder that is listed anyway).
    """
    root = os.fspath(root)
    if os.path.isfile(root):
        return [root]
    found = find_files(real_root(root), lambda name: name.startswith("run-") and name.endswith(".wandb"), Limits())
    return sorted(found, key=lambda p: (os.path.getmtime(p), p))


def read_chunks(
    data: bytes, skipped: list[str], tail: list[str] | None = None, max_record: int | None = None
) -> Iterator[bytes]:
    """Reassemble records from the chunk stream; problems are appended to `skipped` and reading goes on.

    A record cut off by the end of the file goes to `tail` instead, when given. A record of more than
    `max_record` bytes is skipped unassembled (its pieces would be copied twice, then parsed).
    """
    torn = skipped if tail is None else tail
    size, oversized = 0, False  # bytes of the record in `parts`; True while skipping the rest of a big one
    pos = HEADER.size
    parts: list[bytes] | None = None
    start = 0
    while pos < len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK.size:  # block trailer: zero padding
            pos += left
            continue
        if pos + CHUNK.size > len(data):
            torn.append(f"torn chunk header at offset {pos} ({len(data) - pos} bytes at the end of the file)")
            break
        crc, length, kind = CHUNK.unpack_from(data, pos)
        body = pos + CHUNK.size
        if kind == 0 and length == 0 and crc == 0:  # preallocated zeros: nothing more was written
            if any(data[pos:]):
                skipped.append(f"zero chunk header at offset {pos} followed by more data")
            break
        if length > left - CHUNK.size or kind not in (FULL, FIRST, MIDDLE, LAST):
            skipped.append(f"corrupt chunk header at offset {pos} (type {kind}, length {length}); skipped its block")
            parts = None
            pos += left
            continue
        if body + length > len(data):
            torn.append(f"torn record at offset {pos}: the chunk claims {length} bytes, {len(data) - body} are left")
            break
        payload = data[body : body + length]
        if zlib.crc32(bytes([kind]) + payload) != crc:
            skipped.append(f"checksum mismatch in chunk at offset {pos} ({length} bytes); skipped its block")
            parts = None
            pos += left
            continue
        offset, pos = pos, body + length
        if kind in (FULL, FIRST):
            oversized = False
        if kind == FULL:
            if parts is not None:
                skipped.append(f"record started at offset {start} has no last piece; dropped")
                parts = None
            yield payload
        elif kind == FIRST:
            if parts is not None:
                skipped.append(f"record started at offset {start} has no last piece; dropped")
            parts, start, size = [payload], offset, length
        elif oversized:
            oversized = kind != LAST
        elif parts is None:
            skipped.append(f"{'middle' if kind == MIDDLE else 'last'} piece at offset {offset} without a first piece")
        else:
            parts.append(payload)
            size += length
            if max_record is not None and size > max_record:
                skipped.append(
                    f"record started at offset {start} is over {max_record:,} bytes (max_record_bytes); skipped"
                )
                parts, oversized = None, kind != LAST
            elif kind == LAST:
                yield b"".join(parts)
                parts = None
    if parts is not None:
        torn.append(f"record started at offset {start} was cut off at the end of the file; dropped")


#: Which items a reader wants: `(where, path, value_json) -> bool`, `where` one of "history", "summary",
#: "config"; the others are left out unparsed (a caller that reads only numbers needs no histogram lists).
Keep = Callable[[str, list[str], str], bool]


def _items(items: Iterable[Any], skipped: list[str], where: str, keep: Keep | None = None) -> dict[str, Any]:
    """`key`/`nested_key` + `value_json` items -> a nested dict."""
    out: dict[str, Any] = {}
    kind = where.split(" ", 1)[0]
    for item in items:
        path = list(item.nested_key) or [item.key]
        if keep is not None and not keep(kind, path, item.value_json):
            continue
        if len(path) > MAX_JSON_DEPTH:
            skipped.append(f"{where}: a key nested {len(path)} levels deep (at most {MAX_JSON_DEPTH}); skipped")
            continue
        try:
            value = loads_json(item.value_json)  # accepts W&B's NaN / Infinity / -Infinity
        except (ValueError, RecursionError) as exc:
            skipped.append(f"{where}: value of {'/'.join(path)[:200]!r} is not usable JSON ({exc}); skipped")
            continue
        node = out
        for part in path[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[path[-1]] = value
    return out


def _merge(into: dict[str, Any], update: dict[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _remove(into: dict[str, Any], items: Iterable[Any]) -> None:
    for item in items:
        path = list(item.nested_key) or [item.key]
        node: Any = into
        for part in path[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(path[-1], None)


def read_offline_run(
    path: str | os.PathLike[str],
    *,
    strict: bool = False,
    root: str | None = None,
    max_bytes: int = 4 * GIB,
    keep: Keep | None = None,
    max_record_bytes: int | None = None,
) -> OfflineRun:
    """Read history rows, summary and config from one `run-*.wandb` file.

    `keep(where, path, value_json)`, when given, chooses the items to parse: JSON costs 10-25 times its
    size in Python objects, so a reader that needs a few values keeps a crafted file from costing gigabytes.
    A record over `max_record_bytes` (None: no cap) is skipped and named.

    Damage is reported in `.skipped`, a torn tail in `.torn_tail` (or either raised as `WandbFileError`
    with `strict=True`); a file that is not a W&B run file at all always raises. The file must be a
    regular file of at most `max_bytes` inside the resolved folder `root` (default: its own folder);
    `runformat.files.Refused` says why not.
    """
    try:
        from wandb.proto import wandb_internal_pb2

        pb: Any = wandb_internal_pb2  # generated protobuf module: no type information
    except ImportError as exc:
        raise ImportError(f"reading W&B run files needs the wandb package: {INSTALL_HINT}") from exc
    path = os.fspath(path)
    if root is None:
        root = os.path.dirname(os.path.realpath(path))
    data = read_regular(path, root, max_bytes=max_bytes, what="W&B run file")
    if len(data) < HEADER.size:
        raise WandbFileError(f"{path} is not a W&B run file: {len(data)} bytes, shorter than the 7-byte header")
    ident, magic, version = HEADER.unpack_from(data)
    if ident != IDENT or magic != MAGIC:
        raise WandbFileError(
            f"{path} is not a W&B run file: header {data[:7]!r}, expected b':W&B' and magic 0xBEE1; "
            "pass a run-<id>.wandb file from a wandb/offline-run-* or wandb/run-* folder"
        )
    if version != VERSION:
        raise WandbFileError(f"{path}: W&B run file version {version} is not supported (only {VERSION})")
    run = OfflineRun(path=path)
    for n, raw in enumerate(read_chunks(data, run.skipped, run.torn_tail, max_record_bytes)):
        rec = pb.Record()
        try:
            rec.ParseFromString(raw)
        except Exception as exc:  # protobuf's DecodeError; a CRC-valid record that is not a Record
            run.skipped.append(f"record {n} ({len(raw)} bytes) is not a wandb Record: {exc}")
            continue
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            row = _items(rec.history.item, run.skipped, f"history record {n}", keep)
            row.setdefault("_step", rec.history.step.num)
            run.history.append(row)
        elif kind == "summary":
            update = _items(rec.summary.update, run.skipped, f"summary record {n}", keep)
            run.summary_updates.append(update)
            _merge(run.summary, update)
            _remove(run.summary, rec.summary.remove)
        elif kind == "config":
            _merge(run.config, _items(rec.config.update, run.skipped, f"config record {n}", keep))
            _remove(run.config, rec.config.remove)
        elif kind == "run":
            run.run_id = rec.run.run_id or run.run_id
            run.project = rec.run.project or run.project
            _merge(run.config, _items(rec.run.config.update, run.skipped, f"config (run record {n})", keep))
        elif kind == "metric":
            m = rec.metric
            entry = {"name": m.name} if m.name else {"glob_name": m.glob_name}
            if m.step_metric:
                entry["step_metric"] = m.step_metric
            run.metrics.append(entry)
        elif kind == "exit":
            run.exit_code = rec.exit.exit_code
            run.finished = True
    if strict and (run.skipped or run.torn_tail):
        raise WandbFileError(f"{path} is damaged: " + "; ".join(run.skipped + run.torn_tail))
    return run


def read_finished_run(path: str | os.PathLike[str], timeout: float = 60.0) -> OfflineRun:
    """`read_offline_run`, waiting until the file ends with the run's exit record.

    `run.finish()` returns before wandb's service has flushed the file's tail (the service closes it
    asynchronously; with multi-MB rows this was seen to take a moment), so a reader started right after
    a run finished can see a torn record. Raises `WandbFileError` if the run is still incomplete after
    `timeout` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        run = read_offline_run(path)
        if run.finished and run.complete:
            return run
        if time.monotonic() > deadline:
            state = "; ".join(run.skipped + run.torn_tail) or "no exit record yet"
            raise WandbFileError(f"{os.fspath(path)} is not a finished run after {timeout:g} s: {state}")
        time.sleep(0.05)


__all__ = ["OfflineRun", "WandbFileError", "find_run_files", "read_chunks", "read_finished_run", "read_offline_run"]
