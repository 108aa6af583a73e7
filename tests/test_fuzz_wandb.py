"""W&B run files as untrusted input: a real offline run's records changed, framed again with valid CRCs.

tests/test_fuzz_runs.py does this for TensorBoard runs (and for a hand-built W&B run's values). Here the run
is a real one: gradlog's W&B writer logs a short training run in offline mode (`WANDB_MODE=offline`), its
`run-<id>.wandb` file is decoded into `wandb_internal_pb2.Record`s, one thing is changed (an item's value or
key, a history step, a whole record, the chunk framing, a table file), the file is written back with valid
checksums (or torn, or with a chunk claiming a huge length), and every consumer runs on it:

- `gradlog report` (text and --json), in process: exit 0, 1 or 2, never a traceback and never the catch-all
  "cannot read PATH (SomeError: ...)" that means a reader failed deep inside;
- `gradlog.readers.run.load` + `gradlog.views.health.analyze`: a result or `BadRun`, nothing else;
- what a resume reads first (`find_earlier_wandb`): an earlier run or a reason, never a raise; and on a share
  of the cases a real resume, `GradLogger(writer=Output("wandb", resume=True))` in offline mode: it never
  raises, warns at most that it starts a new run, and training goes on measuring.

Each case runs under a CPU-time alarm (a hang fails it). The default run takes a seeded sample of a few
seconds; `-m heavy` takes a larger seeded sample of the whole sweep.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import resource
import shutil
import struct
import subprocess
import sys
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from catalogue import train
from test_fuzz_runs import check_report as check_run_read
from test_fuzz_runs import cpu_alarm
from test_untrusted_runs import wandb_bytes
from torch import nn

import gradlog
from gradlog.cli.report import run_report
from gradlog.readers.run import load
from gradlog.run.resume import find_earlier_wandb
from gradlog.runformat.wandb_offline import find_run_files, read_chunks

wandb = pytest.importorskip("wandb")
pb: Any = pytest.importorskip("wandb.proto.wandb_internal_pb2")

#: JSON texts where the run file holds numbers, strings, histograms and table references.
ODD_JSON = [
    "NaN",
    "Infinity",
    "-Infinity",
    "1e400",
    "-1e400",
    "9" * 30,
    "-" + "9" * 30,
    "1" + "0" * 400,  # an int no float holds
    "9" * 5000,  # past Python's 4,300-digit int parsing limit
    "-1",
    "0",
    "1e-320",
    "null",
    "true",
    '"²"',
    '"\\u001b[2J"',
    '"\\ud800"',
    "[1, 2]",
    "[]",
    "{}",
    '{"a": {"b": {"c": 1}}}',
    '{"_type": "histogram", "values": [1, 2], "bins": [0]}',
    '{"_type": "histogram", "values": "x", "bins": null}',
    '{"_type": "table-file", "path": 5}',
    '{"_type": "table-file", "path": "../../../../etc/passwd"}',
    '{"_type": "table-file", "path": "/etc/passwd"}',
    '{"_type": "table-file"}',
    "[" * 100_000 + "]" * 100_000,
    '"' + "x" * 2_000_000 + '"',
    "not json",
    "",
]
#: Keys an item may carry instead of the one gradlog wrote.
ODD_KEYS: list[list[str]] = [
    [""],
    ["_step"],
    ["gradlog/step"],
    ["gradlog/tensor_order"],
    ["weights/grad_norm/" + "x" * 100_000],
    ["a"] * 5000,
    ["weights", "grad_norm", "fc.weight"],
    ["\x1b[2J"],
]
#: Step numbers a history record may carry.
ODD_STEPS = [-1, 2**62, 2**63 - 1, -(2**63)]
#: The whole text of a table file.
ODD_TABLE_FILES = [
    "",
    "{",
    "[]",
    '{"columns": 5, "data": []}',
    '{"columns": ["name"], "data": [[1, 2, 3]]}',
    '{"columns": ["name", "shape"], "data": [[NaN, Infinity], [null, true], [{"a": 1}, [1]]]}',
    '{"columns": [], "data": [[]]}',
    '{"columns": ["x"], "data": ' + "[" * 100_000 + "]" * 100_000 + "}",
]
ODD_CELLS: list[Any] = ["²", "9" * 30, 10**30, -1, 1e308, None, True, [1], {"a": 1}, "x" * 200_000, "\x1b[2J"]


class Net(nn.Module):
    """An embedding half of whose ids never occur (a partly-updated table), a layer, a head, an unused layer
    (never-updated tensors): every table gradlog writes has rows."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        self.unused = nn.Linear(2, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.relu(self.fc(self.emb(ids))))
        return out


@contextlib.contextmanager
def offline(root: Path) -> Iterator[None]:
    """wandb in offline mode, every file it writes under `root`."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        for var, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
            mp.setenv(var, str(root / sub))
        try:
            yield
        finally:
            if wandb.run is not None:  # a failed case must not leave a run for the next one to adopt
                wandb.run.finish()


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, list[Any]]:
    """(the log_dir of a closed W&B offline run, its run file relative to log_dir, its records decoded)."""
    root = tmp_path_factory.mktemp("wandb_fuzz")
    with offline(root):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        gl = gradlog.GradLogger(model, opt, writer="wandb", log_dir=str(root / "logs"), every=2, print_report=False)
        train(opt, gl, 12, lambda step: model(torch.randint(0, 5, (3,))).pow(2).mean())
    (path,) = find_run_files(root / "logs")
    skipped: list[str] = []
    records = [pb.Record.FromString(raw) for raw in read_chunks(Path(path).read_bytes(), skipped)]
    assert not skipped and records[-1].WhichOneof("record_type") == "exit"
    return root / "logs", os.path.relpath(path, root / "logs"), records


# --- mutations: each changes a copy of the records (or the file's bytes, or a table file) and says what ---
Records = list[Any]
Mutation = Callable[[Records, Path], "bytes | None"]


def _items(rec: Any) -> Any:
    kind = rec.WhichOneof("record_type")
    if kind == "history":
        return rec.history.item
    if kind == "summary":
        return rec.summary.update
    if kind == "config":
        return rec.config.update
    return rec.run.config.update


def _item_places(records: Records) -> list[tuple[int, int]]:
    kinds = ("history", "summary", "config", "run")
    return [
        (r, i)
        for r, rec in enumerate(records)
        if rec.WhichOneof("record_type") in kinds
        for i in range(len(_items(rec)))
    ]


def value_mutation(r: int, i: int, text: str) -> tuple[str, Mutation]:
    def mutate(records: Records, logs: Path) -> None:
        _items(records[r])[i].value_json = text

    return f"record {r} item {i} value = {text[:30]!r}", mutate


def key_mutation(r: int, i: int, key: list[str]) -> tuple[str, Mutation]:
    def mutate(records: Records, logs: Path) -> None:
        item = _items(records[r])[i]
        item.key = ""
        del item.nested_key[:]
        if len(key) == 1:
            item.key = key[0]
        else:
            item.nested_key.extend(key)

    return f"record {r} item {i} key = {'/'.join(key)[:30]!r}", mutate


def step_mutation(r: int, step: int) -> tuple[str, Mutation]:
    def mutate(records: Records, logs: Path) -> None:
        records[r].history.step.num = step

    return f"history record {r} step = {step}", mutate


def record_mutation(r: int, how: str) -> tuple[str, Mutation]:
    def mutate(records: Records, logs: Path) -> None:
        if how == "drop":
            del records[r]
        elif how == "repeat":
            records[r + 1 : r + 1] = [records[r]] * 3
        elif how == "clear":
            records[r].Clear()
        elif how == "junk":  # a CRC-valid record that is no Record: protobuf bytes of the wrong kind
            records[r] = pb.Record.FromString(b"\xc2\x3e\x03abc")  # field 1000: unknown, an empty Record
        elif how == "as_summary" and records[r].WhichOneof("record_type") == "history":
            items = list(records[r].history.item)
            records[r] = pb.Record(
                summary=pb.SummaryRecord(
                    update=[
                        pb.SummaryItem(key=it.key, nested_key=it.nested_key, value_json=it.value_json) for it in items
                    ]
                )
            )

    return f"record {r}: {how}", mutate


def framing_mutation(how: str, at: float) -> tuple[str, Mutation]:
    """The file's bytes: torn at a fraction `at` of its length, or a chunk inserted there (between records)."""

    def mutate(records: Records, logs: Path) -> bytes:
        data = wandb_bytes(records)
        cut = int(len(data) * at)
        if how == "truncate":
            return data[:cut]
        n = int(len(records) * at)
        head = wandb_bytes(records[:n])
        tail = wandb_bytes(records[n:])[7:]
        if how == "huge_length":  # a chunk header claiming 65,535 bytes, with a CRC of what follows
            piece = b"\0" * 16
            chunk = struct.pack("<IHB", zlib.crc32(b"\x01" + piece), 0xFFFF, 1) + piece
        elif how == "junk":  # a CRC-valid record of random bytes
            piece = random.Random(n).randbytes(200)
            chunk = struct.pack("<IHB", zlib.crc32(b"\x01" + piece), len(piece), 1) + piece
        elif how == "first_only":  # a record's first piece and nothing after it
            piece = records[n - 1].SerializeToString()[:50] if n else b"x"
            chunk = struct.pack("<IHB", zlib.crc32(b"\x02" + piece), len(piece), 2) + piece
        elif how == "bad_type":
            piece = b"abc"
            chunk = struct.pack("<IHB", zlib.crc32(b"\x09" + piece), len(piece), 9) + piece
        else:
            raise AssertionError(how)
        if (len(head) % (32 * 1024)) + len(chunk) > 32 * 1024:
            return head + tail  # no room in this block: no change
        return _reframe(head + chunk, records[n:])

    return f"framing {how} at {at:.2f}", mutate


def _reframe(prefix: bytes, records: Records) -> bytes:
    """`prefix` then `records` framed from where it ends (blocks count from the file's start)."""
    out = bytearray(prefix)
    for rec in records:
        data = rec.SerializeToString()
        first = True
        while True:
            left = 32 * 1024 - len(out) % (32 * 1024)
            if left < 7:
                out += b"\0" * left
                continue
            n = min(len(data), left - 7)
            last = n == len(data)
            kind = (1 if last else 2) if first else (4 if last else 3)
            out += struct.pack("<IHB", zlib.crc32(bytes([kind]) + data[:n]), n, kind) + data[:n]
            data, first = data[n:], False
            if last:
                break
    return bytes(out)


def _table_files(logs: Path) -> list[Path]:
    return sorted(logs.glob("wandb/offline-run-*/files/media/table/**/*.table.json"))


def table_mutation(k: int, text: str) -> tuple[str, Mutation]:
    def mutate(records: Records, logs: Path) -> None:
        files = _table_files(logs)
        files[k % len(files)].write_text(text)

    return f"table file {k} = {text[:30]!r}", mutate


def cell_mutation(k: int, row: int, col: int, cell: Any) -> tuple[str, Mutation]:
    def mutate(records: Records, logs: Path) -> None:
        path = _table_files(logs)[k]
        doc = json.loads(path.read_text())
        if doc["data"]:
            data_row = doc["data"][row % len(doc["data"])]
            data_row[col % len(data_row)] = cell
        path.write_text(json.dumps(doc))

    return f"table file {k} row {row} col {col} = {str(cell)[:30]!r}", mutate


def all_mutations(logs: Path, records: Records) -> list[tuple[str, Mutation]]:
    out: list[tuple[str, Mutation]] = []
    for r, i in _item_places(records):
        out += [value_mutation(r, i, text) for text in ODD_JSON]
        out += [key_mutation(r, i, key) for key in ODD_KEYS]
    history = [r for r, rec in enumerate(records) if rec.WhichOneof("record_type") == "history"]
    out += [step_mutation(r, s) for r in history for s in ODD_STEPS]
    out += [record_mutation(r, how) for r in range(len(records)) for how in ("drop", "repeat", "clear", "junk")]
    out += [record_mutation(r, "as_summary") for r in history]
    out += [
        framing_mutation(how, at / 20)
        for how in ("truncate", "huge_length", "junk", "first_only", "bad_type")
        for at in range(1, 20)
    ]
    tables = _table_files(logs)
    out += [table_mutation(k, text) for k in range(len(tables)) for text in ODD_TABLE_FILES]
    for k, path in enumerate(tables):
        doc = json.loads(path.read_text())
        for row in range(len(doc["data"])):
            for col in range(len(doc["columns"])):
                out += [cell_mutation(k, row, col, cell) for cell in ODD_CELLS]
    return out


# --- the consumers ----------------------------------------------------------------------------------------
def check_report(logs: Path, what: str) -> None:
    """The TensorBoard fuzzer's checks (`gradlog report`, text and --json; load + analyze), and what a resume
    reads first."""
    check_run_read(logs, what)
    found = find_earlier_wandb(str(logs))  # what a resume reads first: an earlier run or why not, no raise
    assert found is not None, what


def check_resume(logs: Path, what: str) -> None:
    """`GradLogger(writer=Output("wandb", resume=True))` on the damaged run: never raises, trains on, measuring
    (it continues the run, or warns once and starts a new one)."""
    torch.manual_seed(1)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    with offline(logs.parent), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = gradlog.Output("wandb", resume=True)
        gl = gradlog.GradLogger(model, opt, writer=out, log_dir=str(logs), every=1, print_report=False)
        report = train(opt, gl, 2, lambda step: model(torch.randint(0, 10, (3,))).pow(2).mean())
    failed = [str(w.message) for w in caught if "failed" in str(w.message)]
    assert failed == [] and report.error is None, (what, failed, report.error)
    assert report.measured_steps >= 2, (what, report.verdict)


def run_case(real: tuple[Path, str, Records], name: str, mutate: Mutation, work: Path, resume: bool) -> None:
    src, rel, records = real
    copies = [pb.Record.FromString(rec.SerializeToString()) for rec in records]
    shutil.rmtree(work, ignore_errors=True)
    logs = work / "logs"
    shutil.copytree(src, logs, symlinks=True)
    data = mutate(copies, logs)
    (logs / rel).write_bytes(data if data is not None else wandb_bytes(copies))
    with cpu_alarm(name):
        check_report(logs, name)
        if resume:
            check_resume(logs, name)


def _sweep(real: tuple[Path, str, Records], tmp_path: Path, n: int, seed: int, resume_every: int) -> int:
    mutations = all_mutations(real[0], real[2])
    assert len(mutations) > 3000  # every item of every record with every odd value, every table cell, ...
    for k, (name, mutate) in enumerate(stratified(mutations, n, seed)):
        run_case(real, name, mutate, tmp_path / "case", resume=k % resume_every == 0)
    return n


def _family(name: str) -> str:
    """What a mutation changes: an item's value or key, a step, a record, the framing, a table file or cell."""
    words = name.split(" ")
    return words[0] + (" " + words[4] if words[0] == "record" and len(words) > 4 and words[2] == "item" else "")


def stratified(mutations: list[tuple[str, Mutation]], n: int, seed: int) -> list[tuple[str, Mutation]]:
    """`n` mutations, seeded, spread evenly over the families (a plain sample is nearly all item values)."""
    rng = random.Random(seed)
    families: dict[str, list[tuple[str, Mutation]]] = {}
    for m in mutations:
        families.setdefault(_family(m[0]), []).append(m)
    pools = [rng.sample(ms, len(ms)) for _, ms in sorted(families.items())]
    out: list[tuple[str, Mutation]] = []
    while len(out) < n:
        for pool in pools:
            if pool and len(out) < n:
                out.append(pool.pop())
    rng.shuffle(out)
    return out


def test_fuzzed_wandb_records_with_valid_checksums(real_run: tuple[Path, str, Records], tmp_path: Path) -> None:
    """A seeded sample of the mutations, 4 of each family (a few seconds): every consumer answers, cleanly."""
    assert _sweep(real_run, tmp_path, n=24, seed=20261207, resume_every=8) == 24


@pytest.mark.heavy
def test_fuzzed_wandb_records_sample(real_run: tuple[Path, str, Records], tmp_path: Path) -> None:
    """A seeded sample of 400 of the ~35,000 mutations, spread over the families, a real resume on every 20th
    (61 s on a busy 2-core machine). On 2026-12-07 a sweep of 2,122 cases, up to 600 of each family, found one
    fault (the integer beyond any float, now a named test); the memory and table faults came from sized inputs."""
    assert _sweep(real_run, tmp_path, n=400, seed=0, resume_every=20) == 400


# --- the regressions the fuzzer found, each named --------------------------------------------------------
def _write(real: tuple[Path, str, Records], work: Path, records: Records) -> Path:
    src, rel, _ = real
    logs = work / "logs"
    shutil.copytree(src, logs, symlinks=True)
    (logs / rel).write_bytes(wandb_bytes(records))
    return logs


def _place(records: Records, key: str, nth: int = 0) -> tuple[int, int]:
    """(record, item) of the `nth` history item named `key`."""
    found = [
        (r, i)
        for r, rec in enumerate(records)
        if rec.WhichOneof("record_type") == "history"
        for i, item in enumerate(rec.history.item)
        if (item.key or "/".join(item.nested_key)) == key
    ]
    return found[nth]


def test_an_integer_beyond_any_float_is_skipped_and_named(
    real_run: tuple[Path, str, Records], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A history value of 10**400 (valid JSON, no float holds it): `gradlog report` printed "cannot read ...
    (OverflowError: int too large to convert to float)", exit 2 and no report, and a resume on the folder could
    not read the earlier run. Now that value is skipped and named, and the rest of the run is reported."""
    records = [pb.Record.FromString(rec.SerializeToString()) for rec in real_run[2]]
    r, i = _place(records, "weights/grad_norm/fc.weight", nth=1)
    step = records[r].history.step.num
    records[r].history.item[i].value_json = "1" + "0" * 400
    logs = _write(real_run, tmp_path, records)
    code = run_report(str(logs), as_json=True)
    out, err = capsys.readouterr()
    assert code == 2 and "the report above is partial" in err, err
    doc = json.loads(out)
    verdict = doc["verdict"]
    assert verdict.startswith("gradlog PROBLEM: 2 of 7 tensors never updated") and "1 unreadable part" in verdict
    assert any(
        "'weights/grad_norm/fc.weight': 1 value skipped, an integer beyond any float" in s for s in doc["skipped"]
    )
    series = load(str(logs)).scalars
    steps = [s for s, _ in series["weights/grad_norm/fc.weight"]]
    assert step not in steps and len(steps) == len([s for s, _ in series["weights/grad_norm/head.weight"]]) - 1
    found = find_earlier_wandb(str(logs))
    assert not isinstance(found, str), found


MEASURE = """
import resource, sys
from gradlog.cli.report import run_report
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
code = run_report(sys.argv[1])
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print("grew", (after - before) // 1024, "exit", code, file=sys.stderr)
"""


def measured_report(logs: Path) -> tuple[subprocess.CompletedProcess[str], int]:
    """`run_report(logs)` in a child limited to 2.5 GB of address space (importing torch takes ~0.7 GB of it):
    (the finished process, how many MB its peak RSS grew while reading the run)."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (5 << 29, 5 << 29))

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE, str(logs)],
        capture_output=True,
        text=True,
        env=env,
        timeout=250,
        preexec_fn=limit,
    )
    assert "grew" in proc.stderr, proc.stderr[-2000:]
    return proc, int(proc.stderr.rsplit("grew", 1)[1].split()[0])


def test_history_lists_are_not_parsed_into_memory(real_run: tuple[Path, str, Records], tmp_path: Path) -> None:
    """A run file with 20 MB of extra history rows whose values are lists of empty lists (`[[],[],...]`, the
    shape of a histogram's values): each parsed into a Python list of lists, 25 times the file's size (a 40 MB
    file took 1.3 GB and 9 s in `gradlog report`). The reader only ever uses a history row's numbers and
    table references; the rest is left unparsed, and the report needs what the file itself takes."""
    records = [pb.Record.FromString(rec.SerializeToString()) for rec in real_run[2]]
    junk = "[" + "[]," * 200_000 + "[]]"
    extra = [
        pb.Record(
            history=pb.HistoryRecord(
                item=[
                    pb.HistoryItem(nested_key=["weights", "grad", "fc.weight", "values"], value_json=junk),
                    pb.HistoryItem(key="gradlog/step", value_json=str(100 + n)),
                ]
            )
        )
        for n in range(33)
    ]
    logs = _write(real_run, tmp_path, records[:-1] + extra + records[-1:])
    assert (logs / real_run[1]).stat().st_size > 19_000_000
    proc, grew = measured_report(logs)
    assert "exit 1" in proc.stderr and "gradlog PROBLEM: 2 of 7 tensors never updated" in proc.stdout, proc.stderr
    assert grew < 150, f"reading a 20 MB run file grew the process by {grew} MB"


def _never_table(logs: Path) -> Path:
    (path,) = logs.glob("wandb/offline-run-*/files/media/table/gradlog/never_updated_table_*.table.json")
    return path


def test_table_rows_without_their_cells_are_left_out_and_counted(
    real_run: tuple[Path, str, Records], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """50,000 empty rows (`[]`) after the real rows of the never-updated table: each was read as a never-updated
    tensor named "" ("50002 of 7 tensors never updated (unknown 50000)", one skipped line per row where a cell
    was unreadable). A row without its cells is damage: left out and counted in one line, and the rows beside
    it still count."""
    logs = _write(real_run, tmp_path, [pb.Record.FromString(rec.SerializeToString()) for rec in real_run[2]])
    table = _never_table(logs)
    doc = json.loads(table.read_text())
    assert [r[0] for r in doc["data"]] == ["unused.weight", "unused.bias"]
    doc["data"] += [[]] * 50_000
    table.write_text(json.dumps(doc))
    code = run_report(str(logs), as_json=True)
    out = json.loads(capsys.readouterr().out)
    assert code == 2 and out["verdict"].startswith("gradlog PROBLEM: 2 of 7 tensors never updated (no_grad 2)"), out
    assert [r["name"] for r in out["never_updated"]] == ["unused.weight", "unused.bias"]
    (said,) = [s for s in out["skipped"] if "never_updated" in s]
    assert said == f"table gradlog/never_updated: 50000 rows without {len(doc['columns'])} cells left out", said


def test_a_table_file_of_millions_of_lists_is_not_parsed(real_run: tuple[Path, str, Records], tmp_path: Path) -> None:
    """A 30 MB never-updated table of ten million empty rows: `gradlog report` grew to 7.8 GB and was still
    parsing after 4 minutes of CPU. No table of gradlog's holds a million rows (one per tensor): such a file is
    refused unparsed and named, and the report comes from the rest of the run."""
    logs = _write(real_run, tmp_path, [pb.Record.FromString(rec.SerializeToString()) for rec in real_run[2]])
    with open(_never_table(logs), "w") as f:
        f.write('{"columns": ["name"], "data": [' + ",".join(["[]"] * 10_000_000) + "]}")
    proc, grew = measured_report(logs)
    assert "exit 2" in proc.stderr and "1 unreadable part skipped" in proc.stdout, proc.stdout[-500:]
    assert "(ValueError: 10,000,003 lists and objects, more than the 1,000,000" in proc.stdout, proc.stdout[-1500:]
    assert grew < 150, f"reading the run grew the process by {grew} MB"


def test_a_record_over_max_record_bytes_is_skipped_unassembled(
    real_run: tuple[Path, str, Records], tmp_path: Path
) -> None:
    """A record of 2 MB (63 chunks) under `Limits(max_record_bytes=1 MiB)`: the TensorBoard reader skips a record
    over the cap, the W&B reader assembled any size (its pieces copied twice, then parsed: up to the 4 GiB file
    cap in one record). Now it is skipped and named, and the records after it (the exit record) still read."""
    from gradlog.runformat.files import Limits

    records = [pb.Record.FromString(rec.SerializeToString()) for rec in real_run[2]]
    big = pb.Record(history=pb.HistoryRecord(item=[pb.HistoryItem(key="note", value_json='"' + "x" * (2 << 20) + '"')]))
    logs = _write(real_run, tmp_path, [*records[:-1], big, records[-1]])
    run = load(str(logs), limits=Limits(max_record_bytes=1 << 20))
    (said,) = run.skipped
    assert re.fullmatch(r"record started at offset \d+ is over 1,048,576 bytes \(max_record_bytes\); skipped", said)
    assert not run.notes, run.notes  # the exit record after it was read: a finished run
    assert load(str(logs)).skipped == []  # under the default cap (64 MiB) it is an ordinary record
