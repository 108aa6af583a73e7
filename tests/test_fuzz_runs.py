"""Run files as untrusted input, damaged *inside* records whose checksums still hold.

tests/test_untrusted_runs.py flips bits and truncates: the CRCs catch nearly all of that. What they cannot
catch is a run file someone wrote (or a gradlog of another version, or a tool that rewrote it) with
well-framed records that say odd things: a table cell of "²" or 30 digits, a NaN run-level value, a packed
heatmap row of the wrong shape, a tensor order of the wrong dtype. Here a real gradlog run is written, its
records are decoded, one thing in one record is changed, the file is framed again with valid CRCs, and
every reader entry point runs on it:

- `gradlog report` (text and --json), in process: exit 0, 1 or 2 and never the catch-all "cannot read
  PATH (SomeError: ...)" that means a reader failed deep inside;
- `gradlog.readers.run.load` + `gradlog.views.health.analyze`: a result or `BadRun`, nothing else;
- the TensorBoard tab's routes (`/runs`, `/overview`, `/heatmap`, `/series`) on TensorBoard's own data
  provider: never an error 500;
- a resumed run (`Output(resume=True)`) on the damaged folder: the training script's `GradLogger()` never
  raises; it continues the run or warns once and starts a new one, and training goes on.

Each case runs under a CPU-time alarm (a hang fails it). The default run takes a seeded sample of a few
seconds; `-m heavy` sweeps every table cell with every odd value. A W&B run file (built by
tests/test_untrusted_runs.py's writer) gets the same treatment in its history, summary and table files.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import re
import shutil
import signal
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from catalogue import train
from torch import nn

import gradlog
from gradlog.cli.report import run_report
from gradlog.readers.run import BadRun, load
from gradlog.runformat.markdown import parse_markdown_table
from gradlog.views.health import analyze

pytest.importorskip("tensorboard")
pytest.importorskip("crc32c")

from tensorboard.compat.proto import event_pb2

from gradlog.runformat.tfevents import events, frame

#: Cells a reader may meet in someone else's table: digits `int()` refuses though `isdigit()` accepts them,
#: numbers beyond an int64 or a float, non-numbers where numbers go, terminal escapes, a cell the size of a page.
ODD_CELLS = [
    "²",
    "٣",
    "--5",
    "-1",
    "",
    "nan",
    "inf",
    "-inf",
    "1e400",
    "9" * 30,
    "9" * 5000,
    "0-" + "9" * 25,
    "3x-4",
    "99999999999x99999999999",
    "True",
    "None",
    "\x1b[2J\x1b[31m",
    "x" * 20000,
]
#: The whole text of a table replaced: not markdown, a header only, a row longer than its header.
ODD_TABLES = ["", "not a table", "| a |", "| a | b |\n|---|---|\n| 1 | 2 | 3 | 4 |", "|" * 5000]
#: Values a run-level or per-tensor series may hold.
ODD_VALUES = [float("nan"), float("inf"), -float("inf"), 3.0e38, -1.0]
#: Steps an event may carry.
ODD_STEPS = [-1, 2**62, 2**63 - 1, -(2**63)]
CPU_SECONDS = 30.0  # per case: a hang guard on a shared 2-core machine, not a speed check


# --- the run and its records --------------------------------------------------------------------------
class Net(nn.Module):
    """An embedding half of whose ids never occur (a partly-updated table), a ReLU layer, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc(self.emb(ids))))


def _write_run(log_dir: Path) -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    gl = gradlog.GradLogger(model, opt, writer="tensorboard", log_dir=str(log_dir), every=2, print_report=False)
    train(opt, gl, 12, lambda step: model(torch.randint(0, 5, (3,))).pow(2).mean())


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    """(the event file of a closed run, its events decoded): provisional and final tables, packed rows."""
    log_dir = tmp_path_factory.mktemp("fuzz") / "run"
    _write_run(log_dir)
    (path,) = log_dir.glob("events.out.tfevents.*")
    skipped: list[str] = []
    with open(path, "rb") as f:
        decoded = list(events(f, path.stat().st_size, path.name, skipped, 1 << 30))
    assert not skipped
    return path, decoded


def _tables(decoded: list[Any]) -> list[tuple[int, int, str]]:
    """(event, value, text) of every gradlog table record (final and provisional) in the run."""
    out = []
    for i, ev in enumerate(decoded):
        for j, v in enumerate(ev.summary.value):
            if v.tag.startswith("gradlog/") and v.tensor.string_val:
                with contextlib.suppress(UnicodeDecodeError, ValueError):
                    text = v.tensor.string_val[0].decode("utf-8")
                    parse_markdown_table(text)
                    out.append((i, j, text))
    return out


def _markdown(columns: list[str], rows: list[list[str]]) -> str:
    esc = [[c.replace("\\", "\\\\").replace("|", "\\|") for c in r] for r in [columns, *rows]]
    lines = ["| " + " | ".join(esc[0]) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in esc[1:]])


Mutation = Callable[[list[Any]], str]


def cell_mutation(event: int, value: int, row: int, col: int, cell: str) -> Mutation:
    def mutate(evs: list[Any]) -> str:
        v = evs[event].summary.value[value]
        columns, rows = parse_markdown_table(v.tensor.string_val[0].decode("utf-8"))
        rows[row][col] = cell
        v.tensor.string_val[0] = _markdown(columns, rows).encode("utf-8")
        return f"{v.tag} row {row} ({rows[row][0][:20]!r}) column {columns[col]!r} = {cell[:20]!r}"

    return mutate


def table_mutation(event: int, value: int, text: str) -> Mutation:
    def mutate(evs: list[Any]) -> str:
        v = evs[event].summary.value[value]
        v.tensor.string_val[0] = text.encode("utf-8")
        return f"{v.tag} = {text[:20]!r}"

    return mutate


def scalar_mutation(prefix: str, number: float) -> Mutation:
    def mutate(evs: list[Any]) -> str:
        for ev in evs:
            for v in ev.summary.value:
                if v.WhichOneof("value") == "simple_value" and v.tag.startswith(prefix):
                    v.simple_value = number
        return f"every {prefix}* value = {number}"

    return mutate


def step_mutation(first: int, step: int) -> Mutation:
    def mutate(evs: list[Any]) -> str:
        for ev in evs[first:]:
            ev.step = step
        return f"events {first}.. at step {step}"

    return mutate


def tensor_mutation(prefix: str, how: str) -> Mutation:
    """A tensor record (the model order, a packed heatmap row) made unreadable to TensorBoard's own reader."""

    def mutate(evs: list[Any]) -> str:
        for ev in evs:
            for v in ev.summary.value:
                if v.WhichOneof("value") != "tensor" or not v.tag.startswith(prefix):
                    continue
                t = v.tensor
                if how == "empty":
                    t.Clear()
                elif how == "dtype":  # strings read as numbers, numbers as strings
                    t.dtype = 1 if t.dtype == 7 else 7
                elif how == "shape":  # a shape the values do not fill
                    del t.tensor_shape.dim[:]
                    t.tensor_shape.dim.add(size=3)
                elif how == "extra":  # a second string where one is expected
                    t.string_val.append(b"\xff\xfe")
        return f"{prefix}* tensors: {how}"

    return mutate


def all_mutations(decoded: list[Any]) -> list[Mutation]:
    """Every mutation of the run: each cell of each table with each odd value, each table's text, each series
    family's values, the steps, the tensors."""
    out: list[Mutation] = []
    for i, j, text in _tables(decoded):
        columns, rows = parse_markdown_table(text)
        for r, row in enumerate(rows):
            for c in range(min(len(columns), len(row))):
                out += [cell_mutation(i, j, r, c, cell) for cell in ODD_CELLS]
        out += [table_mutation(i, j, t) for t in ODD_TABLES]
    families = {"gradlog/"} | {
        v.tag.rsplit("/", 1)[0] + "/"
        for ev in decoded
        for v in ev.summary.value
        if v.tag.startswith("weights/") and v.WhichOneof("value") == "simple_value"
    }
    out += [scalar_mutation(f, n) for f in sorted(families) for n in ODD_VALUES]
    out += [step_mutation(first, s) for first in (1, len(decoded) // 2) for s in ODD_STEPS]
    out += [tensor_mutation(p, how) for p in ("gradlog/tensor_order", "gradlog/heatmap/") for how in
            ("empty", "dtype", "shape", "extra")]  # fmt: skip
    return out


# --- the entry points ---------------------------------------------------------------------------------
class _Hang(Exception):
    pass


def _on_alarm(signum: int, frame: Any) -> None:
    raise _Hang()


@contextlib.contextmanager
def cpu_alarm(what: str) -> Iterator[None]:
    """CPU time, not wall time: pytest-timeout owns SIGALRM, and a loop that never ends burns CPU."""
    previous = signal.signal(signal.SIGVTALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_VIRTUAL, CPU_SECONDS)
    try:
        yield
    except _Hang:
        pytest.fail(f"{what}: no answer after {CPU_SECONDS} s of CPU time")
    finally:
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        signal.signal(signal.SIGVTALRM, previous)


#: What `run_report` prints when a reader raised something it did not expect (its last-resort net).
CATCH_ALL = re.compile(r"cannot read '.*' \(\w+: ")


def check_report(folder: Path, what: str) -> None:
    for as_json in (False, True):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = run_report(str(folder), as_json=as_json)
        text = out.getvalue() + err.getvalue()
        assert code in (0, 1, 2), (what, code)
        assert "Traceback" not in text, what
        assert not CATCH_ALL.search(err.getvalue()), f"{what}: a reader failed inside: {err.getvalue()[-400:]}"
        if as_json and code != 2:
            json.loads(out.getvalue())
    try:
        analyze(load(str(folder))).text()
    except BadRun:
        pass


def check_tab(folder: Path, what: str) -> None:
    """Every route of the gradlog tab, on TensorBoard's own data provider: never an error 500."""
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from werkzeug.test import Client

    from gradlog.views.tensorboard_plugin.plugin import GradlogPlugin

    multiplexer = plugin_event_multiplexer.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(folder))
    multiplexer.Reload()
    context = base_plugin.TBContext(
        data_provider=data_provider.MultiplexerDataProvider(multiplexer, str(folder)), logdir=str(folder)
    )
    apps = GradlogPlugin(context).get_plugin_apps()
    for route, query in [
        ("/runs", ""),
        ("/overview", "?run=."),
        ("/heatmap", "?run=.&metric=update_ratio"),
        ("/heatmap", "?run=.&metric=grad_norm"),
        ("/heatmap", "?run=.&metric=grad_nonfinite"),
        ("/series", "?run=.&name=fc.weight"),
    ]:
        response = Client(apps[route]).get(route + query)
        assert response.status_code < 500, f"{what}: {route}{query} -> {response.status_code}"
        if route == "/overview" and response.status_code == 200:
            json.loads(response.get_data())  # strict JSON: the tab's JSON.parse takes no NaN


def check_resume(folder: Path, what: str) -> None:
    """The training script's `GradLogger(resume=True)` on the damaged run: never raises, and trains on,
    measuring (it continues the run, or warns once and starts a new one: either is allowed)."""
    torch.manual_seed(1)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = gradlog.Output("tensorboard", resume=True)
        gl = gradlog.GradLogger(model, opt, writer=out, log_dir=str(folder), every=1, print_report=False)
        report = train(opt, gl, 2, lambda step: model(torch.randint(0, 10, (3,))).pow(2).mean())
    failed = [str(w.message) for w in caught if "failed" in str(w.message)]
    assert failed == [] and report.error is None, (what, failed, report.error)
    assert report.measured_steps >= 2, (what, report.verdict)


def run_case(src: Path, decoded: list[Any], mutate: Mutation, work: Path, tab: bool, resume: bool) -> None:
    evs = [event_pb2.Event.FromString(e.SerializeToString()) for e in decoded]
    what = mutate(evs)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / src.name).write_bytes(b"".join(frame(e.SerializeToString()) for e in evs))
    with cpu_alarm(what):
        check_report(work, what)
        if tab:
            check_tab(work, what)
        if resume:
            check_resume(work, what)


# --- the regressions the fuzzer found, each named --------------------------------------------------------
def _only(decoded: list[Any], tag: str) -> tuple[int, int, str]:
    (found,) = [(i, j, t) for i, j, t in _tables(decoded) if decoded[i].summary.value[j].tag == tag]
    return found


def _case(real_run: tuple[Path, list[Any]], tmp_path: Path, mutate: Mutation) -> Path:
    src, decoded = real_run
    evs = [event_pb2.Event.FromString(e.SerializeToString()) for e in decoded]
    mutate(evs)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / src.name).write_bytes(b"".join(frame(e.SerializeToString()) for e in evs))
    return tmp_path / "run"


def test_an_index_beyond_int64_skips_its_row_and_keeps_the_report(
    real_run: tuple[Path, list[Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A partly-updated row whose indices cell holds a 30-digit index: that row is skipped and named, the rest
    of the report stands, INCOMPLETE for what it could not read (it was "cannot read ... (ValueError: Overflow
    when unpacking long long)", exit 2, and no report at all)."""
    i, j, text = _only(real_run[1], "gradlog/partly_updated/table")
    columns, rows = parse_markdown_table(text)
    assert rows and rows[0][0] == "emb.weight"
    run = _case(real_run, tmp_path, cell_mutation(i, j, 0, columns.index("indices"), "9" * 30))
    code = run_report(str(run), as_json=True)
    out, err = capsys.readouterr()
    assert code == 2 and "the report above is partial" in err, err
    doc = json.loads(out)
    assert doc["verdict"].startswith("gradlog INCOMPLETE: all 5 tracked tensors were updated; 1 unreadable part"), doc
    assert any("partly_updated" in s and "'emb.weight'" in s and "outside 0..2**63-1" in s for s in doc["skipped"])


@pytest.mark.parametrize("cell", ["²", "--5", "9" * 30])
def test_an_odd_as_of_step_in_a_run_that_did_not_close(
    real_run: tuple[Path, list[Any]], tmp_path: Path, cell: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run killed before close keeps its provisional tables; their `as_of_step` is read back as a number. "²"
    passes `str.isdigit` and "--5" passes it after `lstrip("-")`, and `int()` refused both: `load` raised
    ValueError, `gradlog report` printed "cannot read" and no report, and `GradLogger(resume=True)` on the
    folder raised in the training script."""
    src, decoded = real_run
    first_final = min(i for i, ev in enumerate(decoded) for v in ev.summary.value if v.tag == "gradlog/summary")
    kept = decoded[:first_final]  # killed before close: the provisional tables are the answer
    i, j, text = _only(kept, "gradlog/provisional/summary")
    _columns, rows = parse_markdown_table(text)
    (row,) = [r for r, cells in enumerate(rows) if cells[0] == "as_of_step"]
    run = _case((src, kept), tmp_path, cell_mutation(i, j, row, 1, cell))
    assert load(str(run)).provisional_step == -1  # "as of an unknown step", as for a missing cell
    code = run_report(str(run))
    out, err = capsys.readouterr()
    assert code == 1 and "INCOMPLETE" in out and "cannot read" not in err, (out, err)
    check_resume(run, cell)


def test_a_nan_run_level_value_keeps_the_tab_open(real_run: tuple[Path, list[Any]], tmp_path: Path) -> None:
    """A NaN in a run-level series (`gradlog/...`) made the tab's overview an error 500: its JSON is strict."""
    run = _case(real_run, tmp_path, scalar_mutation("gradlog/", float("nan")))
    check_tab(run, "NaN run-level values")


@pytest.mark.parametrize("prefix", ["gradlog/tensor_order", "gradlog/heatmap/"])
@pytest.mark.parametrize("how", ["empty", "dtype", "shape"])
def test_a_tensor_tensorboard_cannot_convert_keeps_the_tab_open(
    real_run: tuple[Path, list[Any]], tmp_path: Path, prefix: str, how: str
) -> None:
    """TensorBoard's reader converts each tensor to an array when the tab asks for it, and raised on a damaged
    one (the model order, a packed heatmap row): error 500 on /overview and /heatmap. Now the tab shows what
    else it has (the per-tensor scalars, in the order they were read)."""
    run = _case(real_run, tmp_path, tensor_mutation(prefix, how))
    check_tab(run, f"{prefix} {how}")


def test_a_step_count_beyond_int64_is_not_continued_from(real_run: tuple[Path, list[Any]], tmp_path: Path) -> None:
    """An earlier run whose summary says it took 10**30 optimizer steps: the resumed segment counted on from
    there, every measurement failed ("int too big to convert") and the diagnosis too, so the segment kept
    nothing. Now a damaged count is taken from the run's series (one past its last measured step, 10), as for a
    run that never closed."""
    i, j, text = _only(real_run[1], "gradlog/summary")
    _columns, rows = parse_markdown_table(text)
    (row,) = [r for r, cells in enumerate(rows) if cells[0] == "optimizer_steps"]
    run = _case(real_run, tmp_path, cell_mutation(i, j, row, 1, "1" + "0" * 30))
    torch.manual_seed(1)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = gradlog.Output("tensorboard", resume=True)
        gl = gradlog.GradLogger(model, opt, writer=out, log_dir=str(run), every=1, print_report=False)
        report = train(opt, gl, 2, lambda step: model(torch.randint(0, 10, (3,))).pow(2).mean())
    assert [str(w.message) for w in caught] == []
    assert report.optimizer_steps == 11 + 2 and report.measured_steps == 6 + 2, report.verdict


def test_a_segment_counter_beyond_int64_starts_a_new_run(real_run: tuple[Path, list[Any]], tmp_path: Path) -> None:
    """A `gradlog/segment` counter of 30 digits is no count gradlog wrote: the run is not continued (one warning
    naming the cell, a new run beside it), as for a counter that is not a number (docs/resume.md)."""
    i, j, text = _only(real_run[1], "gradlog/segment")
    columns, _rows = parse_markdown_table(text)
    run = _case(real_run, tmp_path, cell_mutation(i, j, 0, columns.index("measured"), "9" * 30))
    torch.manual_seed(1)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    with pytest.warns(RuntimeWarning, match=r"its 'measured' cell of 'emb.weight' is '9{30}', not a number"):
        gl = gradlog.GradLogger(
            model, opt, writer=gradlog.Output("tensorboard", resume=True), log_dir=str(run), every=1, print_report=False
        )
    report = train(opt, gl, 2, lambda step: model(torch.randint(0, 10, (3,))).pow(2).mean())
    assert report.optimizer_steps == 2 and report.measured_steps == 2, report.verdict


# --- the fuzzer ----------------------------------------------------------------------------------------
def _sweep(real_run: tuple[Path, list[Any]], tmp_path: Path, n: int | None, seed: int) -> int:
    src, decoded = real_run
    mutations = all_mutations(decoded)
    assert len(mutations) > 1000  # every cell of every table, each with every odd value
    chosen = mutations if n is None else random.Random(seed).sample(mutations, n)
    for k, mutate in enumerate(chosen):
        # the tab and a resume cost more than a report (a resume trains two steps): a share of the cases
        run_case(src, decoded, mutate, tmp_path / "case", tab=k % 4 == 0, resume=k % 8 == 0)
    return len(chosen)


def test_fuzzed_records_with_valid_checksums(real_run: tuple[Path, list[Any]], tmp_path: Path) -> None:
    """A seeded sample of the mutations (a few seconds): every entry point answers, cleanly, every time."""
    assert _sweep(real_run, tmp_path, n=24, seed=20261207) == 24


@pytest.mark.heavy
def test_fuzzed_records_every_mutation(real_run: tuple[Path, list[Any]], tmp_path: Path) -> None:
    """A seeded sample of 800 of the ~4,000 mutations: the report on each, the tab on every 4th, a resume on
    every 8th (all 3,984 took 9 minutes on a busy 2-core machine, past the suite's 300 s per test; `_sweep(...,
    n=None)` runs them all, and did, without a failure, on 2026-12-07)."""
    assert _sweep(real_run, tmp_path, n=800, seed=0) == 800


# --- W&B: the same odd values in a run file's history, summary, config and table files -------------------
#: JSON values where gradlog writes numbers, strings and table-file references.
ODD_JSON = [
    "NaN",
    "Infinity",
    "-Infinity",
    "1e400",
    "9" * 30,
    "-1",
    "null",
    "true",
    '"²"',
    "[1, 2]",
    '{"a": 1}',
    '{"_type": "table-file", "path": 5}',
    '{"_type": "table-file", "path": ["a"]}',
    '{"_type": "table-file"}',
    "[" * 200 + "]" * 200,
    '"' + "x" * 10000 + '"',
]
#: A table file's whole text.
ODD_TABLE_FILES = [
    '{"columns": 5, "data": []}',
    '{"columns": ["name"], "data": [[1, 2, 3]]}',
    '{"columns": ["name", "shape"], "data": [[NaN, Infinity], [null, true], [{"a": 1}, [1]]]}',
    '{"columns": [], "data": [[]]}',
    '{"columns": [{"a": 1}], "data": [[{"b": 2}]]}',
    "[]",
    '"x"',
    "[" * 5000,
]


def wandb_mutations() -> list[tuple[str, dict[str, Any]]]:
    """(what, keyword arguments of test_untrusted_runs.wandb_run) for every odd value in every place."""
    out: list[tuple[str, dict[str, Any]]] = []
    for key in ("weights/grad_norm/w", "gradlog/step"):
        for value in ODD_JSON:
            rows = [
                {"gradlog/step": str(s), "weights/grad_norm/w": "1.0", "weights/update_ratio/w": "0.001"}
                for s in range(8)
            ]
            rows[3][key] = value
            out.append((f"history {key} = {value[:20]}", {"rows": rows}))
    for key in ("gradlog/verdict", "gradlog/measured_steps", "gradlog/optimizer_steps", "gradlog/as_of_step"):
        out += [(f"summary {key} = {v[:20]}", {"summary": {key: v}}) for v in ODD_JSON]
    out += [(f"table file {t[:20]}", {"table_files": {"media/table/never.table.json": t}}) for t in ODD_TABLE_FILES]
    return out


def _wandb_case(folder: Path, what: str, kwargs: dict[str, Any]) -> None:
    from test_untrusted_runs import wandb_run

    from gradlog.run.resume import find_earlier_wandb

    shutil.rmtree(folder, ignore_errors=True)
    wandb_run(folder / "wandb" / "offline-run-20260101_000000-abc", **kwargs)
    with cpu_alarm(what):
        check_report(folder / "wandb", what)
        found = find_earlier_wandb(str(folder))  # what a resume reads first: an Earlier or why not, no raise
        assert not isinstance(found, str) or "holds no W&B run" not in found, (what, found)


def test_fuzzed_wandb_values(tmp_path: Path) -> None:
    """A seeded sample of odd JSON values in a W&B run file and its table files: the report and a resume's
    reading answer every time."""
    pytest.importorskip("wandb")
    for what, kwargs in random.Random(5).sample(wandb_mutations(), 16):
        _wandb_case(tmp_path / "case", what, kwargs)


@pytest.mark.heavy
def test_fuzzed_wandb_values_every_mutation(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    for what, kwargs in wandb_mutations():
        _wandb_case(tmp_path / "case", what, kwargs)
