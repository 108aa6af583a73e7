"""`gradlog report` on a run folder someone else sent: crafted and damaged runs end in a clean exit and a message.

Crafted cases run `gradlog report` in a child process (tests/untrusted_child.py) under a memory limit
(RLIMIT_AS) and a timeout, with an audit hook recording every file opened and every folder listed: the
test asserts the exit status, the message, and that nothing outside the run folder was touched.

TensorBoard damage (single-bit flips) and the mutation fuzzer run in-process.
"""

from __future__ import annotations

import json
import os
import random
import re
import resource
import signal
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from catalogue import random_mse, train
from torch import nn

import gradlog
from gradlog.cli.entry import main
from gradlog.readers.run import load
from gradlog.runformat.files import Limits, loads_json, parse_size, shown
from gradlog.verdict.report import COLUMNS

ROOT = Path(__file__).resolve().parent.parent
CHILD = Path(__file__).resolve().parent / "untrusted_child.py"
MEMORY_LIMIT = 3 << 30  # address space; importing torch and tensorboard takes about 0.7 GB of it
CHILD_TIMEOUT = 180  # a hang guard on a shared 2-core machine, not a speed check


# --- building runs -------------------------------------------------------------------------------------
def _masked_crc(data: bytes) -> int:
    import crc32c

    crc = crc32c.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(payload: bytes) -> bytes:
    header = struct.pack("<Q", len(payload))
    return header + struct.pack("<I", _masked_crc(header)) + payload + struct.pack("<I", _masked_crc(payload))


def scalar_event(step: int, values: dict[str, float]) -> bytes:
    from tensorboard.compat.proto import event_pb2, summary_pb2

    summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=t, simple_value=v) for t, v in values.items()])
    return bytes(event_pb2.Event(step=step, wall_time=1.0, summary=summary).SerializeToString())


def text_event(step: int, tag: str, text: str) -> bytes:
    from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2

    meta = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text"))
    tensor = tensor_pb2.TensorProto(dtype=7, string_val=[text.encode("utf-8", "surrogatepass")])
    value = summary_pb2.Summary.Value(tag=tag, metadata=meta, tensor=tensor)
    return bytes(event_pb2.Event(step=step, summary=summary_pb2.Summary(value=[value])).SerializeToString())


def markdown(columns: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def tb_run(folder: Path, name: str = "w", never: list[list[str]] | None = None, steps: int = 8) -> Path:
    """A small gradlog-shaped TensorBoard run: steady series for tensor `name`, the close-time tables."""
    folder.mkdir(parents=True, exist_ok=True)
    records = [
        scalar_event(
            s,
            {
                f"weights/grad_norm/{name}": 1.0,
                f"weights/update_ratio/{name}": 1e-3,
                f"weights/weight_norm/{name}": 2.0,
            },
        )
        for s in range(steps)
    ]
    records.append(text_event(steps, "gradlog/never_updated", markdown(list(COLUMNS), never or [])))
    summary = [["verdict", "fine"], ["healthy", "True"], ["measured_steps", str(steps)]]
    records.append(text_event(steps, "gradlog/summary", markdown(["key", "value"], summary)))
    path = folder / "events.out.tfevents.1.host"
    path.write_bytes(b"".join(tfrecord(r) for r in records))
    return path


BLOCK = 32 * 1024


def wandb_bytes(records: list[Any]) -> bytes:
    """W&B's run-file format (LevelDB log chunks in 32 KiB blocks, after a 7-byte header), written by hand."""
    out = bytearray(struct.pack("<4sHB", b":W&B", 0xBEE1, 0))
    for rec in records:
        data = rec.SerializeToString()
        first = True
        while True:
            left = BLOCK - len(out) % BLOCK
            if left < 7:
                out += b"\0" * left
                continue
            n = min(len(data), left - 7)
            last = n == len(data)
            kind = (1 if last else 2) if first else (4 if last else 3)
            piece = data[:n]
            out += struct.pack("<IHB", zlib.crc32(bytes([kind]) + piece), n, kind) + piece
            data, first = data[n:], False
            if last:
                break
    return bytes(out)


def history(pb: Any, row: dict[str, str], nested: dict[tuple[str, ...], str] | None = None) -> Any:
    items = [pb.HistoryItem(key=k, value_json=v) for k, v in row.items()]
    items += [pb.HistoryItem(nested_key=list(k), value_json=v) for k, v in (nested or {}).items()]
    return pb.Record(history=pb.HistoryRecord(item=items))


def wandb_run(
    folder: Path,
    *,
    rows: list[dict[str, str]] | None = None,
    summary: dict[str, str] | None = None,
    tables: dict[str, str] | None = None,
    table_files: dict[str, str] | None = None,
    extra: list[Any] | None = None,
    exit_record: bool = True,
) -> Path:
    """A gradlog-shaped W&B offline run dir; `tables` maps key -> path named in the run file."""
    pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "files" / "media" / "table").mkdir(parents=True, exist_ok=True)
    never = {"columns": list(COLUMNS), "data": []}
    (folder / "files" / "media" / "table" / "never.table.json").write_text(json.dumps(never))
    for rel, text in (table_files or {}).items():
        (folder / "files" / rel).write_text(text)
    records = [pb.Record(run=pb.RunRecord(run_id="abc", project="p"))]
    default_rows = [
        {
            "gradlog/step": str(s),
            "weights/grad_norm/w": "1.0",
            "weights/update_ratio/w": "0.001",
            "weights/weight_norm/w": "2.0",
        }
        for s in range(8)
    ]
    for row in rows if rows is not None else default_rows:
        records.append(history(pb, row))
    tables = {"gradlog/never_updated_table": "media/table/never.table.json", **(tables or {})}
    close_row = {"gradlog/step": "8"}
    for key, rel in tables.items():
        close_row[key] = json.dumps({"_type": "table-file", "path": rel, "ncols": 5, "nrows": 0})
    records.append(history(pb, close_row))
    records += extra or []
    values = {"gradlog/verdict": '"fine"', "gradlog/healthy": "true", "gradlog/measured_steps": "8", **(summary or {})}
    records.append(
        pb.Record(summary=pb.SummaryRecord(update=[pb.SummaryItem(key=k, value_json=v) for k, v in values.items()]))
    )
    if exit_record:
        records.append(pb.Record(exit=pb.RunExitRecord(exit_code=0)))
    (folder / "run-abc.wandb").write_bytes(wandb_bytes(records))
    return folder


# --- the child process ---------------------------------------------------------------------------------
def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def report_child(path: Path | str, *args: str, allowed: Path) -> tuple[int, str, str]:
    """`gradlog report PATH ARGS` in a memory-limited child; asserts it opened and listed nothing outside `allowed`."""
    log = Path(str(allowed) + ".audit.json")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "PYTHONIOENCODING": "utf-8",
    }
    proc = subprocess.run(
        [sys.executable, str(CHILD), str(log), "report", str(path), *args],
        capture_output=True,
        text=True,
        encoding="utf-8",
        errors="strict",  # the output must be valid UTF-8
        env=env,
        timeout=CHILD_TIMEOUT,
        preexec_fn=_limit_memory,
    )
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert proc.returncode in (0, 1, 2), (proc.returncode, proc.stderr)
    audit = json.loads(log.read_text())
    inside = os.path.realpath(allowed)
    python = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}

    def ok(p: str) -> bool:
        real = os.path.realpath(p)
        return real == inside or real.startswith(inside + os.sep) or any(real.startswith(q + os.sep) for q in python)

    assert [p for p in audit["opened"] if not ok(p)] == [], "opened outside the run folder"
    assert [p for p in audit["listed"] if not ok(p)] == [], "listed outside the run folder"
    for p in audit["opened"]:  # the run folder's own files, and no device or pipe among them
        assert not p.startswith(("/dev/", "/proc/", "/etc/")), p
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture
def case(tmp_path: Path) -> Path:
    """The folder handed to `gradlog report`; a secret next to it that must never be opened."""
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.table.json").write_text(json.dumps({"columns": ["s"], "data": [["SECRET"]]}))
    return tmp_path / "case"


SECRET = "SECRET"


# --- paths named inside a W&B run file -----------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    "rel",
    ["../../outside/secret.table.json", "{outside}/secret.table.json", "/etc/passwd", "/proc/self/environ"],
)
def test_wandb_table_paths_outside_files_are_not_opened(case: Path, rel: Any) -> None:
    if isinstance(rel, str):
        rel = rel.format(outside=case.parent / "outside")
    wandb_run(case, tables={"gradlog/alerts_table": rel})
    code, out, err = report_child(case, allowed=case)
    assert code == 2 and "the report above is partial" in err
    assert "table gradlog/alerts" in out and "not a relative path inside the run's files/ folder" in out
    assert SECRET not in out and "root:" not in out
    assert "Never updated: none" in out  # the rest of the report stands


@pytest.mark.slow
def test_wandb_table_symlinks_are_followed_only_inside(case: Path) -> None:
    wandb_run(case, tables={"gradlog/alerts_table": "media/table/alerts.table.json"})
    table_dir = case / "files" / "media" / "table"
    (table_dir / "alerts.table.json").symlink_to(case.parent / "outside" / "secret.table.json")
    code, out, _ = report_child(case, allowed=case)
    assert code == 2 and "points outside the run folder" in out and SECRET not in out
    # A link that stays inside is followed.
    (table_dir / "alerts.table.json").unlink()
    (table_dir / "real.json").write_text(json.dumps({"columns": ["step", "kind", "name", "detail"], "data": []}))
    (table_dir / "alerts.table.json").symlink_to("real.json")
    code, out, err = report_child(case, allowed=case)
    assert code == 0, (out, err)


@pytest.mark.slow
@pytest.mark.parametrize("special", ["fifo", "dev_zero"])
def test_wandb_table_that_is_a_fifo_or_a_device(case: Path, special: str) -> None:
    wandb_run(case, tables={"gradlog/alerts_table": "media/table/alerts.table.json"})
    target = case / "files" / "media" / "table" / "alerts.table.json"
    if special == "fifo":
        os.mkfifo(target)
        expected = "is a named pipe (FIFO), not a regular file"
    else:
        target.symlink_to("/dev/zero")
        expected = "points outside the run folder"
    code, out, _ = report_child(case, allowed=case)
    assert code == 2 and expected in out
    assert "Never updated: none" in out


@pytest.mark.slow
def test_wandb_run_file_linked_to_dev_zero_and_dev_zero_itself(case: Path) -> None:
    case.mkdir()
    (case / "run-abc.wandb").symlink_to("/dev/zero")
    code, _, err = report_child(case, allowed=case)
    assert code == 2 and "points outside the run folder" in err
    code, _, err = report_child("/dev/zero", allowed=case)
    assert code == 2 and "is not a regular file or a folder" in err


@pytest.mark.slow
def test_wandb_file_above_the_size_cap(case: Path) -> None:
    wandb_run(case)
    code, _, err = report_child(case, "--max-file-size", "100", allowed=case)
    assert code == 2 and "above the 100-byte cap" in err and "--max-file-size" in err
    big = {"columns": list(COLUMNS), "data": [["x" * 100] * 5] * 50}
    wandb_run(case, tables={"gradlog/alerts_table": "media/table/big.table.json"}, table_files={})
    (case / "files" / "media" / "table" / "big.table.json").write_text(json.dumps(big))
    code, out, _ = report_child(case, "--max-table-size", "4K", allowed=case)
    assert code == 2 and "above the 4,096-byte cap" in out and "--max-table-size" in out


# --- TensorBoard folders -------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("special", ["fifo", "dev_zero", "outside"])
def test_event_file_that_is_a_fifo_a_device_or_outside(case: Path, special: str) -> None:
    tb_run(case)
    bad = case / "events.out.tfevents.2.host"
    if special == "fifo":
        os.mkfifo(bad)
        expected = "is a named pipe (FIFO), not a regular file"
    elif special == "dev_zero":
        bad.symlink_to("/dev/zero")
        expected = "points outside the run folder"
    else:
        (case.parent / "outside" / "events.out.tfevents.9.host").write_bytes(tfrecord(scalar_event(0, {"x": 1})))
        bad.symlink_to(case.parent / "outside" / "events.out.tfevents.9.host")
        expected = "points outside the run folder"
    code, out, _ = report_child(case, allowed=case)
    assert code == 2 and expected in out
    assert "Never updated: none" in out and "8 measured" in out  # the real event file was read
    if special == "fifo":  # given as the path itself
        code, _, err = report_child(bad, allowed=case)
        assert code == 2 and "is not a regular file or a folder" in err


@pytest.mark.slow
def test_symlink_loops_in_the_folder_tree(case: Path) -> None:
    tb_run(case / "deep" / "run")
    (case / "a").symlink_to(case / "b")
    (case / "b").symlink_to(case / "a")
    (case / "deep" / "self").symlink_to(case / "deep")
    (case / "deep" / "up").symlink_to(case)
    (case / "deep" / "run" / "events.out.tfevents.3.host").symlink_to("events.out.tfevents.3.host")
    code, out, _ = report_child(case, allowed=case)
    assert code == 2 and "8 measured" in out  # the one run found once; the self-link named as unreadable
    assert "Too many levels of symbolic links" in out or "cannot be read" in out


@pytest.mark.slow
def test_ten_thousand_empty_event_files(case: Path) -> None:
    run = case / "run"
    tb_run(run)
    for i in range(10_000):
        (run / f"events.out.tfevents.{1000 + i}.empty").touch()
    code, out, err = report_child(run, allowed=case)
    assert code == 0 and "8 measured" in out, err
    code, _, err = report_child(run, "--max-files", "100", allowed=case)
    assert code == 2 and "holds more than 100 event or W&B run files" in err and "--max-files" in err


@pytest.mark.slow
def test_event_file_above_the_size_cap_is_not_read(case: Path) -> None:
    tb_run(case)
    with open(case / "events.out.tfevents.5.sparse", "wb") as f:  # 5 GiB, sparse: costs no disk
        f.truncate(5 << 30)
    code, out, _ = report_child(case, allowed=case)
    assert code == 2 and "above the 4,294,967,296-byte cap" in out and "--max-file-size" in out
    assert "8 measured" in out


# --- untrusted text ------------------------------------------------------------------------------------
ESCAPE = "\x1b]0;pwned\x07\x1b[2J"


@pytest.mark.slow
def test_terminal_escapes_and_surrogates_in_tensor_names_and_summary(case: Path) -> None:
    """Names, table cells and summary values with escapes and lone surrogates: shown escaped, JSON stays strict."""
    evil = f"w{ESCAPE}\ud800\u202e"  # a lone surrogate fits only in JSON (protobuf keys must be valid UTF-8)
    key = f"k{ESCAPE}\u202e"
    rows = [
        {"gradlog/step": str(s), f"weights/grad_norm/{key}": "1.0", f"weights/update_ratio/{key}": "5.0"}
        for s in range(8)
    ]  # out of the fixed band (--band below): the name is printed
    never = {"columns": list(COLUMNS), "data": [[evil, "[2]", "2", "no_grad", f"detail {ESCAPE} \ud800"]]}
    wandb_run(
        case,
        rows=rows,
        summary={
            "gradlog/verdict": json.dumps(f"verdict {ESCAPE}\ud800"),
            "gradlog/first_nonfinite_tensor": '"\\ud800"',
        },
        table_files={"media/table/never.table.json": json.dumps(never)},
    )
    code, out, _ = report_child(case, "--band", "1e-4", "1e-2", allowed=case)  # the fixed band: a lone tensor
    assert code == 1
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    assert "w\\x1b]0;pwned\\x07\\x1b[2J\ufffd\\u202e" in out  # shown, escaped, surrogate replaced
    assert "k\\x1b]0;pwned\\x07\\x1b[2J\\u202e" in out  # the out-of-band tensor's name
    code, out, _ = report_child(case, "--json", allowed=case)

    def no_constants(name: str) -> None:
        raise AssertionError(f"non-standard JSON constant {name}")

    doc = json.loads(out, parse_constant=no_constants)
    assert "\\ud800" not in out.lower() and "\\udc" not in out.lower()  # no lone surrogate escapes either
    assert doc["never_updated"][0]["name"] == f"w{ESCAPE}\ufffd\u202e"  # the real name, as data


@pytest.mark.slow
def test_terminal_escapes_in_a_tensorboard_tag(case: Path) -> None:
    tb_run(case, name=f"evil{ESCAPE}", never=[[f"evil{ESCAPE}", "[2]", "2", "no_grad", f"d{ESCAPE}"]])
    code, out, _ = report_child(case, allowed=case)
    assert code == 1 and "\x1b" not in out and "evil\\x1b]0;pwned\\x07" in out


# --- bad rows and values -------------------------------------------------------------------------------
@pytest.mark.slow
def test_nan_steps_and_deep_json_are_skipped_and_counted(case: Path) -> None:
    pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")
    deep = "[" * 100_000 + "]" * 100_000
    rows = [
        {
            "gradlog/step": str(s),
            "weights/grad_norm/w": "1.0",
            "weights/update_ratio/w": "0.001",
            "weights/weight_norm/w": "2.0",
        }
        for s in range(8)
    ]
    rows += [{"gradlog/step": v, "weights/grad_norm/w": "1e30"} for v in ("NaN", "Infinity", "-Infinity", '"7"')]
    rows.append({"gradlog/step": "9", "weights/grad_norm/w": deep})
    extra = [history(pb, {"gradlog/step": "10"}, nested={("k",) * 5000: "1"})]
    wandb_run(case, rows=rows, extra=extra)
    code, out, err = report_child(case, allowed=case)
    assert code == 2 and "the report above is partial" in err
    assert "history row skipped: gradlog/step is nan" in out and "history row skipped: gradlog/step is inf" in out
    assert "gradlog/step is not a number" in out
    assert "nested 5000 levels deep" in out
    # a list in a history row (a histogram's parts) is not parsed at all: the report reads the rows' numbers
    assert "JSON nested deeper" not in out and "5 unreadable parts skipped" in out
    assert "Never updated: none" in out
    assert "Gradient-norm spikes (> 10x the tensor's running median and last norm): none" in out


@pytest.mark.slow
def test_huge_index_range_in_a_table_cell(case: Path) -> None:
    """A partly-updated row claiming indices 0-99999999999: skipped as a bad row, not expanded into memory."""
    path = tb_run(case)
    columns = ["name", "dim", "never", "total", "indices", "reason", "detail"]
    row = ["w", "rows", "1", "2", "0-99999999999", "not_in_batch", "x"]
    with open(path, "ab") as f:
        f.write(tfrecord(text_event(9, "gradlog/partly_updated", markdown(columns, [row]))))
    _, out, err = report_child(case, allowed=case)  # exit 0, or 2 where the row is read and skipped
    assert "MemoryError" not in err and "8 measured" in out, err


# --- in-process: the pieces ----------------------------------------------------------------------------
def test_shown_escapes_what_a_terminal_would_act_on() -> None:
    assert shown("weights/grad_norm/layer.0") == "weights/grad_norm/layer.0"
    assert shown("a\x1b[31mb\n\t\x7f") == "a\\x1b[31mb\\x0a\\x09\\x7f"
    assert shown("x\u202ey\ud800z\U000e0001") == "x\\u202ey\ufffdz\\U000e0001"
    assert shown("naïve 名前") == "naïve 名前"


@pytest.mark.parametrize(
    ("rel", "ok"),
    [
        ("media/table/a.table.json", "media/table/a.table.json"),
        ("./media//table/a.json", "media/table/a.json"),
        ("media/../media/a.json", "media/a.json"),
        ("../x.json", None),
        ("media/../../x.json", None),
        ("/etc/passwd", None),
        ("", None),
        (".", None),
        ("a\\..\\..\\x.json", None),
        ("a\0b", None),
        (7, None),
        (None, None),
    ],
)
def test_table_paths_named_in_a_run_file(rel: Any, ok: str | None) -> None:
    from gradlog.runformat.wandb_run import _table_path

    assert _table_path(rel) == ok


def test_open_regular_refuses_pipes_sockets_devices_and_folders_before_opening(tmp_path: Path) -> None:
    import socket

    from gradlog.runformat.files import Refused, open_regular, read_regular

    root = os.path.realpath(tmp_path)
    os.mkfifo(tmp_path / "pipe")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))
    (tmp_path / "dir").mkdir()
    (tmp_path / "ok").write_bytes(b"12345")
    cases = {"pipe": "a named pipe (FIFO)", "sock": "a socket", "dir": "a folder"}
    try:
        for name, kind in cases.items():
            with pytest.raises(Refused, match=re.escape(f"{name}: table file is {kind}, not a regular file")):
                open_regular(str(tmp_path / name), root, max_bytes=100, what="table file")
    finally:
        sock.close()
    with pytest.raises(Refused, match="/dev/null: event file is a device, not a regular file"):
        open_regular("/dev/null", "/dev", max_bytes=100, what="event file")
    assert read_regular(str(tmp_path / "ok"), root, max_bytes=5, what="table file") == b"12345"
    with pytest.raises(Refused, match=r"is 5 bytes, above the 4-byte cap; not read \(raise it with --max-table-size"):
        read_regular(str(tmp_path / "ok"), root, max_bytes=4, what="table file", cap="max_table_bytes")
    with pytest.raises(Refused, match="points outside the run folder"):
        read_regular(str(tmp_path / "dir" / ".." / ".." / "x"), root, max_bytes=5, what="table file")


def test_loads_json_refuses_deep_nesting_without_recursing() -> None:
    assert loads_json('{"a": [1, {"b": NaN}]}')["a"][0] == 1
    assert loads_json('["[[[[[[", "]]]"]') == ["[[[[[[", "]]]"]  # brackets inside strings do not count
    with pytest.raises(ValueError, match="nested deeper than 64 levels"):
        loads_json("[" * 100_000 + "]" * 100_000)
    assert loads_json("[" * 64 + "]" * 64) is not None


@pytest.mark.parametrize(("text", "size"), [("1000", 1000), ("4G", 4 << 30), ("64MiB", 64 << 20), ("1.5k", 1536)])
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


def test_bad_sizes_and_limits_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"'lots' is not a size; write a number of bytes, or e\.g\. 512K"):
        parse_size("lots")
    with pytest.raises(ValueError, match=r"Limits\(max_files=0\): must be a positive whole number"):
        Limits(max_files=0)
    with pytest.raises(SystemExit) as exc:
        main(["report", ".", "--max-file-size", "huge"])
    assert exc.value.code == 2


# --- TensorBoard: resynchronising after damage (issue 15) ----------------------------------------------
def _small_model_run(log_dir: Path, steps: int = 16) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gl = gradlog.GradLogger(model, opt, writer="tensorboard", log_dir=str(log_dir), every=2, print_report=False)
    train(opt, gl, steps, random_mse(model, 3, 4))


def _records(data: bytes) -> list[tuple[int, int, bytes]]:
    """(start, end, payload) of each record, walked by length alone (the file is intact)."""
    out, pos = [], 0
    while pos < len(data):
        (length,) = struct.unpack_from("<Q", data, pos)
        out.append((pos, pos + 16 + length, data[pos + 12 : pos + 12 + length]))
        pos += 16 + length
    assert pos == len(data)
    return out


def _points(payload: bytes) -> set[tuple[str, int]]:
    from tensorboard.compat.proto import event_pb2

    ev = event_pb2.Event.FromString(payload)
    return {(v.tag, ev.step) for v in ev.summary.value if v.WhichOneof("value") == "simple_value"}


def test_single_bit_flips_lose_only_the_damaged_record(tmp_path: Path) -> None:
    """A bit flipped anywhere in a real gradlog event file loses that record's points and nothing else."""
    log_dir = tmp_path / "tb"
    _small_model_run(log_dir)
    (event_file,) = log_dir.glob("events.out.tfevents.*")
    original = event_file.read_bytes()
    records = _records(original)
    per_record = [_points(payload) for _, _, payload in records]
    tables_in = [i for i, (_, _, p) in enumerate(records) if b"gradlog/never_updated" in p and b"| name" in p]
    (summary_in,) = [i for i, (_, _, p) in enumerate(records) if b"gradlog/summary" in p and b"provisional" not in p]
    assert len(tables_in) == 1 and summary_in != tables_in[0]  # the final table and the verdict: two records
    rng = random.Random(0)
    positions = {0, 7, 8, 11, 12, len(original) - 1, len(original) - 4}
    for start, end, _ in records[1:6]:  # every part of a few records: length, its CRC, payload, data CRC
        positions |= {start, start + 3, start + 8, start + 11, start + 12, (start + end) // 2, end - 4, end - 1}
    positions |= {rng.randrange(len(original)) for _ in range(60)}
    for pos in sorted(positions):
        damaged = bytearray(original)
        damaged[pos] ^= 1 << rng.randrange(8)
        event_file.write_bytes(bytes(damaged))
        (hit,) = [i for i, (s, e, _) in enumerate(records) if s <= pos < e]
        expected = set().union(*per_record[:hit], *per_record[hit + 1 :])
        run = load(str(event_file))
        got = {(tag, step) for tag, pts in run.scalars.items() for step, _ in pts}
        assert got == expected, f"flip at byte {pos} (record {hit})"
        assert len(run.skipped) == 1 and f"at byte {records[hit][0]}" in run.skipped[0], (pos, run.skipped)
        if hit == len(records) - 1:
            assert "no intact record after it" in run.skipped[0] or "truncated" in run.skipped[0]
        else:
            assert f"reading resumed at byte {records[hit + 1][0]}" in run.skipped[0], (pos, run.skipped)
        # every table is a record of its own: a flip loses the never-updated table or the summary, never both,
        # so the run still reads as closed, with its final verdict
        assert ("gradlog/never_updated" in run.tables) == (hit not in tables_in), pos
        assert ("gradlog/summary" in run.tables) == (hit != summary_in), pos
        assert run.provisional_step is None, pos


def test_garbage_between_records_and_a_zero_filled_tail(tmp_path: Path) -> None:
    log_dir = tmp_path / "tb"
    _small_model_run(log_dir, steps=6)
    (event_file,) = log_dir.glob("events.out.tfevents.*")
    original = event_file.read_bytes()
    clean = load(str(log_dir)).scalars
    records = _records(original)
    cut = records[2][1]
    event_file.write_bytes(original[:cut] + os.urandom(5000) + b"\0" * 70_000 + original[cut:] + b"\0" * 100_000)
    run = load(str(log_dir))
    assert run.scalars == clean
    assert len(run.skipped) == 2 and "skipped 75000 bytes" in run.skipped[0], run.skipped
    assert "no intact record after it: the remaining 100000 bytes were skipped" in run.skipped[1]


# --- W&B: a crashed run (issue 15) ---------------------------------------------------------------------
_KILLED = """
import os, signal, sys, torch
from torch import nn
import gradlog
from gradlog.writers.wandb import WandbWriter
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
gl = gradlog.GradLogger(model, opt, writer=[WandbWriter(project="p", log_dir=sys.argv[1], mode="offline")],
                        every=1, print_report=False)
for step in range(12):
    model(torch.randn(3, 4)).pow(2).mean().backward()
    opt.step(); gl.log(step); opt.zero_grad()
print("logged", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
def test_wandb_run_killed_mid_run_is_incomplete_not_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("wandb")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        **{v: str(tmp_path / v.lower()) for v in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")},
    }
    root = tmp_path / "wb"
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED, str(root)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == -signal.SIGKILL and "logged" in proc.stdout, proc.stderr
    from gradlog.readers.wandb_offline import find_run_files, read_offline_run

    (run_file,) = find_run_files(root)
    size = -1
    while size != os.path.getsize(run_file):  # wandb's service process may still be writing what it had
        size = os.path.getsize(run_file)
        time.sleep(1.0)
    assert not read_offline_run(run_file).finished  # the premise: no exit record
    # Findings are switched off (--band, --spike): what is left to say is that the run did not finish.
    code = main(["report", str(root), "--band", "1e-12", "1e12", "--spike", "1e12", "--json"])
    captured = capsys.readouterr()
    assert code == 1 and "Traceback" not in captured.err, captured.err
    out = json.loads(captured.out)
    # issue 15: the run wrote provisional tables on its first histogram step, and log() waited until the W&B
    # writer's thread had handed them to wandb (GuardedWriters.sync), so the answer is that one, as of then
    assert out["verdict"].startswith("gradlog INCOMPLETE: as of step 0, run did not close"), out["verdict"]
    assert out["skipped"] == []
    assert any("no exit record" in n for n in out["notes"])
    steps = [s for s, _ in load(str(root)).scalars["weights/grad_norm/0.weight"]]
    assert steps == list(range(len(steps))) and len(steps) >= 1  # whatever history was written, from the start


# --- the mutation fuzzer -------------------------------------------------------------------------------
class _Hang(Exception):
    pass


def _on_alarm(signum: int, frame: Any) -> None:
    raise _Hang()


def _mutations(data: bytes, rng: random.Random, n: int) -> Iterator[bytes]:
    for i in range(n):
        d = bytearray(data)
        kind = i % 5
        if kind == 0:  # a few bit flips
            for _ in range(rng.randint(1, 8)):
                d[rng.randrange(len(d))] ^= 1 << rng.randrange(8)
        elif kind == 1:  # truncation
            del d[rng.randrange(len(d)) :]
        elif kind == 2:  # a stretch overwritten with random bytes or 0xFF
            start = rng.randrange(len(d))
            stop = min(len(d), start + rng.randint(1, 64))
            d[start:stop] = bytes(rng.choice((rng.randrange(256), 0xFF)) for _ in range(stop - start))
        elif kind == 3:  # a stretch zeroed (a hole after a crash)
            start = rng.randrange(len(d))
            stop = min(len(d), start + rng.randint(1, 4096))
            d[start:stop] = bytes(stop - start)
        else:  # a stretch duplicated
            start = rng.randrange(len(d))
            chunk = d[start : start + rng.randint(1, 512)]
            at = rng.randrange(len(d))
            d[at:at] = chunk
        yield bytes(d)


@pytest.mark.slow
def test_mutation_fuzzer_never_tracebacks_or_hangs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Random flips, truncations, overwrites, holes and duplications of a real TensorBoard run and a W&B run
    file: every case ends with exit 0, 1 or 2 and no traceback, within a per-case alarm."""
    from gradlog.cli.report import run_report

    log_dir = tmp_path / "tb"
    _small_model_run(log_dir, steps=20)
    (event_file,) = log_dir.glob("events.out.tfevents.*")
    wb = wandb_run(tmp_path / "wb", table_files={})
    targets = [
        (event_file, log_dir, 160),
        (wb / "run-abc.wandb", wb, 120),
        (wb / "files" / "media" / "table" / "never.table.json", wb, 20),
    ]
    rng = random.Random(1234)
    # CPU time, not wall time: pytest-timeout owns SIGALRM, and a loop that never ends burns CPU
    previous = signal.signal(signal.SIGVTALRM, _on_alarm)
    codes: dict[int, int] = {}
    try:
        for target, folder, n in targets:
            original = target.read_bytes()
            for i, mutated in enumerate(_mutations(original, rng, n)):
                target.write_bytes(mutated)
                signal.setitimer(signal.ITIMER_VIRTUAL, 20.0)
                try:
                    code = run_report(str(folder), as_json=bool(i % 2))
                except _Hang:
                    pytest.fail(f"{target.name} mutation {i}: no answer after 20 s of CPU time")
                finally:
                    signal.setitimer(signal.ITIMER_VIRTUAL, 0)
                captured = capsys.readouterr()
                assert code in (0, 1, 2), (target.name, i)
                assert "Traceback" not in captured.out + captured.err, (target.name, i)
                if i % 2 and captured.out:
                    json.loads(captured.out)
                codes[code] = codes.get(code, 0) + 1
            target.write_bytes(original)
    finally:
        signal.signal(signal.SIGVTALRM, previous)
    assert sum(codes.values()) == 300 and codes.get(2, 0) > 0 and codes.get(0, 0) + codes.get(1, 0) > 0, codes


def test_scalars_written_as_tensors_are_read(tmp_path: Path) -> None:
    """TensorBoard's newer scalar form (a rank-0 tensor under the scalars plugin), as float_val or packed bytes."""
    from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2

    meta = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))
    records = []
    for step in range(4):
        if step % 2:
            tensor = tensor_pb2.TensorProto(dtype=2, tensor_content=struct.pack("<d", step / 8))
        else:
            tensor = tensor_pb2.TensorProto(dtype=1, float_val=[step / 8])
        value = summary_pb2.Summary.Value(
            tag="weights/grad_norm/w", tensor=tensor, metadata=meta if step == 0 else None
        )
        event = event_pb2.Event(step=step, summary=summary_pb2.Summary(value=[value]))
        records.append(tfrecord(event.SerializeToString()))
    (tmp_path / "events.out.tfevents.1.host").write_bytes(b"".join(records))
    run = load(str(tmp_path))
    assert run.scalars["weights/grad_norm/w"] == [(s, s / 8) for s in range(4)] and run.skipped == []


# --- points kept compact -------------------------------------------------------------------------------
def test_points_read_back_in_step_order_with_the_last_write_of_a_step(tmp_path: Path) -> None:
    """A run whose steps come out of order and twice (resumed runs, several event files) reads back one
    point per step in step order, the last value written for it: checked against a dict built beside."""
    rng = random.Random(3)
    steps = [rng.randrange(40) for _ in range(300)]
    expected: dict[int, float] = {}
    records = []
    for n, s in enumerate(steps):
        expected[s] = n / 8  # exact in float32, TensorBoard's simple_value
        records.append(scalar_event(s, {"weights/grad_norm/w": n / 8}))
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "events.out.tfevents.1.host").write_bytes(b"".join(tfrecord(r) for r in records))
    got = load(str(tmp_path)).scalars["weights/grad_norm/w"]
    assert got == sorted(expected.items()) and len(got) == len(expected) == len(set(steps))
    assert got[-1] == max(expected.items()) and list(got[:2]) == sorted(expected.items())[:2]


def test_a_wandb_step_beyond_int64_reads_back(tmp_path: Path) -> None:
    big = 2**70
    rows = [{"gradlog/step": str(big + s), "weights/grad_norm/w": str(s)} for s in (2, 0, 1)]
    run = load(str(wandb_run(tmp_path / "w", rows=rows)))
    assert run.scalars["weights/grad_norm/w"] == [(big, 0.0), (big + 1, 1.0), (big + 2, 2.0)]


def test_a_long_run_reads_back_in_the_memory_of_its_numbers(tmp_path: Path) -> None:
    """100,000 points read back hold under a third of what the same points cost as a list of (step, value)
    tuples (measured the same way, beside): a long run of thousands of tensors fits in memory to report."""
    import tracemalloc

    tags, steps = 200, 500
    records = [scalar_event(s, {f"weights/grad_norm/t{i}": s + i / 1024 for i in range(tags)}) for s in range(steps)]
    (tmp_path / "events.out.tfevents.1.host").write_bytes(b"".join(tfrecord(r) for r in records))
    del records
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        run = load(str(tmp_path))
        read = tracemalloc.get_traced_memory()[0] - before
        before = tracemalloc.get_traced_memory()[0]
        as_lists = {tag: [(s, v) for s, v in pts] for tag, pts in run.scalars.items()}
        lists = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert sum(len(p) for p in run.scalars.values()) == tags * steps
    assert run.scalars["weights/grad_norm/t7"][123] == (123, 123 + 7 / 1024)  # exact in float32
    assert as_lists["weights/grad_norm/t7"] == list(run.scalars["weights/grad_norm/t7"])
    assert read < lists / 3, (read, lists)


def test_series_reads_like_a_list_of_points() -> None:
    from gradlog.runformat.points import Series

    pts = [(0, 1.0), (5, float("nan")), (9, -2.5)]
    s = Series(pts)
    assert len(s) == 3 and s[0] == (0, 1.0) and s[-1] == (9, -2.5) and [p for p, _ in s[1:]] == [5, 9]
    assert s[:1] == [(0, 1.0)] and s != [(0, 1.0)] and s != "abc" and Series(pts[::2]) == Series([pts[0], pts[2]])
    assert s != pts  # NaN is not equal to itself, as between two lists of fresh floats
    assert [v for _, v in s][2] == -2.5 and sorted(s, key=lambda p: -p[0])[0] == (9, -2.5)
    assert repr(Series([(1, 2.0)])) == "Series([(1, 2.0)])"
    with pytest.raises(IndexError):
        s[3]
