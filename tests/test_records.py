"""One codec for every finding: each record's table, row, JSON and reading back come from its fields.

The reference is the run format as written before the records owned it (the column lists the run files
hold, spelled out here) and the records themselves: written, then read back, each is the record it was.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from catalogue import TwoLayer, random_mse, train
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import gradlog
from gradlog.cli.entry import main
from gradlog.readers.run import load, parse_markdown_table
from gradlog.runformat.cells import table_cells
from gradlog.verdict.accumulation import AccumulationCleared
from gradlog.verdict.policy import DEFAULTS, Policy
from gradlog.verdict.records import FINDINGS, INT, SHARE, TEXT, Case, Record, cell, ranges
from gradlog.verdict.report import (
    Alert,
    IdleExperts,
    NeverUpdated,
    PartlyUpdated,
    PrecisionLoss,
    Reason,
    Stalled,
    StoppedSlice,
    WeightDecayWipe,
)
from gradlog.verdict.tables import closed_report, sparse_tables

#: the columns every gradlog run has written, by table (the written never-updated table carries `suspect`)
WRITTEN = {
    "never_updated": ["name", "shape", "numel", "reason", "detail", "suspect"],
    "partly_updated": ["name", "dim", "never", "total", "indices", "reason", "detail"],
    "stalled": ["name", "since_step", "last_update_step", "reason", "detail"],
    "stopped_slices": [
        *("name", "dim", "stopped", "total", "indices"),
        *("since_step", "last_grad_step", "reason", "detail"),
    ],
    "experts": ["layer", "state", "experts", "idle", "total", "since_step", "reason", "detail"],
    "precision": ["name", "dtype", "mean_frac", "max_frac", "steps", "detail", "early_frac"],
    "weight_decay": ["name", "group", "lr", "weight_decay", "product", "steps", "of", "since_step", "detail"],
    "accumulation": ["name", "step", "passes", "cleared", "detail"],
    "alerts": ["step", "kind", "name", "detail"],
}

SAMPLES: list[Record] = [
    NeverUpdated("enc.w", (3, 4), 12, Reason.FROZEN, "frozen", ("dec.w",), suspect=True),
    NeverUpdated("lazy.w", (), 0, Reason.NO_GRAD, "never run"),
    PartlyUpdated("emb.weight", 0, 6, 50, (0, 1, 2, 7, 9, 10), Reason.NOT_IN_BATCH, "rows never seen"),
    PartlyUpdated("ln.bias", None, 1, 8, (3,), Reason.ZERO_GRAD, "an element"),
    Stalled("fc.weight", 10, 9, Reason.ZERO_GRAD, "stopped"),
    StoppedSlice("fc.weight", 1, 2, 8, (4, 5), 12, -1, Reason.DEAD_UNITS, "died"),
    IdleExperts("moe.experts", "stopped", (1, 2, 3), 8, 7, Reason.NOT_ROUTED, "no token"),
    PrecisionLoss("w16", "torch.bfloat16", 0.125, 0.5, 7, "rounded away"),
    WeightDecayWipe("fc.weight", 1, 0.01, 100.0, 1.0, 4, 6, 8, "wiped"),
    AccumulationCleared("train.py:41", 0, 4, 3, "cleared"),
    Alert(4, "update_ratio_high", "fc.weight", "high"),
]


def test_the_columns_are_the_run_formats() -> None:
    kinds: list[type[Record]] = [*FINDINGS, Alert]
    assert {k.KIND: k.columns(written=True) for k in kinds} == WRITTEN
    assert NeverUpdated.columns() == WRITTEN["never_updated"][:-1]  # `suspect` is written, not printed
    assert sparse_tables() == (
        "gradlog/stopped_slices",
        "gradlog/experts",
        "gradlog/precision",
        "gradlog/weight_decay",
        "gradlog/accumulation",
    )


@pytest.mark.parametrize("record", SAMPLES, ids=lambda r: type(r).__name__)
def test_every_record_reads_back_as_written(record: Record) -> None:
    kind = type(record)
    columns = kind.columns(written=True)
    row = record.row(written=True)
    assert len(row) == len(columns)
    (cells,) = table_cells((columns, [row]), columns)
    assert kind.from_cells(cells) == record


def test_cells_read_by_name_whatever_the_column_order() -> None:
    record = SAMPLES[2]
    columns = PartlyUpdated.columns(written=True)
    shuffled = list(reversed(columns))
    row = dict(zip(columns, record.row(written=True)))
    (cells,) = table_cells((shuffled, [[row[c] for c in shuffled]]), columns)
    assert PartlyUpdated.from_cells(cells) == record


def test_json_follows_the_fields_with_the_aliases_after_the_name() -> None:
    got = SAMPLES[0].to_dict()
    assert list(got) == ["name", "aliases", "shape", "numel", "reason", "detail", "suspect", "intentional", "severity"]
    assert got["aliases"] == ["dec.w"] and got["shape"] == [3, 4] and got["reason"] == "frozen"
    assert got["intentional"] is False and got["severity"] == "problem"  # frozen, yet looks accidental
    assert "severity" not in SAMPLES[6].to_dict()  # experts: counted through the records they are built from


def test_a_damaged_cell_is_an_error_a_lenient_one_is_not() -> None:
    columns = PartlyUpdated.columns(written=True)
    bad = dict(zip(columns, SAMPLES[2].row(written=True)), total="x")
    with pytest.raises(ValueError, match="invalid literal"):
        PartlyUpdated.from_cells(bad)
    huge = dict(zip(columns, SAMPLES[2].row(written=True)), indices="0-99999999")
    with pytest.raises(ValueError, match="more than 50 indices"):
        PartlyUpdated.from_cells(huge)  # a range from disk is held to the table's own total
    odd = dict(zip(NeverUpdated.columns(written=True), SAMPLES[1].row(written=True)), reason="new_reason", numel="?")
    back = NeverUpdated.from_cells(odd)
    assert back.reason is Reason.UNKNOWN and back.numel == 0  # still listed, judged a problem


@dataclass(frozen=True)
class Wobbly(Record):
    """A kind made up here: the record alone gives its table, its rows, its JSON and its reading back."""

    KIND = "wobbly"
    TITLE = "Wobbly"

    name: str = cell(TEXT)
    steps: tuple[int, ...] = cell(ranges("total", cap=100, count="wobbles"))
    total: int = cell(INT)
    detail: str = cell(TEXT)


def test_a_new_kind_is_its_record() -> None:
    w = Wobbly("fc.weight", (1, 2, 3, 8), 10, "up and down")
    assert Wobbly.columns() == ["name", "steps", "wobbles", "total", "detail"]
    assert w.row() == ["fc.weight", "1-3, 8", "4", "10", "up and down"]
    assert w.row(limit=1) == ["fc.weight", "1-3, ... (+1 more range)", "4", "10", "up and down"]
    assert w.to_dict() == {"name": "fc.weight", "steps": [1, 2, 3, 8], "total": 10, "detail": "up and down"}
    assert Wobbly.from_cells(dict(zip(Wobbly.columns(), w.row()))) == w


# --- a kind of finding added from outside gradlog: its record and its detector, nothing else -------------
#: the made-up kind's threshold: a weight whose magnitude ends above this is a finding
LIMIT = 2.0


@dataclass(frozen=True)
class LargeWeights(Record):
    """A kind made up here, with its detector: tensors with a weight above `LIMIT` at close. Nothing of
    gradlog is edited for it: registering it (`FINDINGS.register`) is all."""

    KIND = "large_weights"
    TITLE = "Large weights"
    NOUN = "tensor"
    SAID = f"with a weight above {LIMIT}"
    SEVERITY: ClassVar[dict[str, tuple[str, str]]] = {"large_weights.above": ("problem", f"a weight above {LIMIT}")}

    name: str = cell(TEXT)
    largest: float = cell(SHARE)
    detail: str = cell(TEXT)

    def policy_kind(self) -> str:
        return "large_weights.above"

    @classmethod
    def detect(cls, case: Case) -> list[LargeWeights]:
        out = []
        for row in case.rows:
            largest = float(row.param.detach().abs().max())
            if largest > LIMIT and row.name not in case.named("never_updated"):
                out.append(cls(row.name, largest, f"its largest weight is {largest:.3f} after {case.steps} steps"))
        return out


@pytest.fixture
def large_weights() -> Iterator[type[LargeWeights]]:
    FINDINGS.register(LargeWeights)
    yield LargeWeights
    FINDINGS.unregister(LargeWeights)


def _planted_run(log_dir: Path, policy: dict[str, str] | None = None) -> tuple[gradlog.Report, set[str]]:
    """TwoLayer with `b.weight` scaled far above `LIMIT`, trained through TensorBoard; and the tensors whose
    largest weight is above `LIMIT` at close, read off the model by hand."""
    torch.manual_seed(0)
    model = TwoLayer(torch.relu)
    with torch.no_grad():
        model.b.weight.mul_(40.0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gl = gradlog.GradLogger(
        model, opt, writer="tensorboard", log_dir=str(log_dir), every=2, print_report=False, policy=policy
    )
    report = train(opt, gl, 6, random_mse(model, 5, 6))
    large = {n for n, p in model.named_parameters() if float(p.detach().abs().max()) > LIMIT}
    return report, large


def test_a_kind_added_from_outside_reaches_every_output(
    large_weights: type[LargeWeights], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report, large = _planted_run(tmp_path / "tb")
    assert large == {"b.weight"}  # the reference: the planted tensor, and only it
    found = report.records(large_weights)
    assert {r.name for r in found} == large and report.extra == {"large_weights": found}
    # the verdict line and the console
    assert not report.healthy
    assert "1 tensor with a weight above 2.0" in report.verdict
    assert "Large weights (1 tensor):" in report.table()
    assert f"b.weight  {found[0].largest:.3f}" in report.table()
    # to_dict and the findings the tab lists
    got = report.to_dict()
    largest, detail = found[0].largest, found[0].detail
    assert got["large_weights"] == [{"name": "b.weight", "largest": largest, "detail": detail, "severity": "problem"}]
    assert [(f["table"], f["label"], f["severity"]) for f in got["findings"]] == [
        ("large_weights", "b.weight", "problem")
    ]
    # the written table, read back by TensorBoard's own reader
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    acc.Reload()
    cols, rows = parse_markdown_table(acc.Tensors("gradlog/large_weights")[-1].tensor_proto.string_val[0].decode())
    assert cols == ["name", "largest", "detail"] and rows == [found[0].row(written=True)]
    # `gradlog report`: the same table, the same verdict, the same records
    assert main(["report", str(tmp_path / "tb")]) == 1
    text = capsys.readouterr().out
    assert "Large weights (1 tensor):" in text and f"b.weight  {largest:.3f}" in text
    assert text.rstrip().splitlines()[-1] == report.verdict
    assert main(["report", str(tmp_path / "tb"), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == report.verdict and out["large_weights"] == [
        {**got["large_weights"][0], "largest": round(largest, 3)}
    ]
    back = closed_report(load(str(tmp_path / "tb")))  # what a resumed run and the tab read back
    assert back is not None and back.records(large_weights) == [LargeWeights("b.weight", round(largest, 3), detail)]
    assert back.verdict == report.verdict


def test_a_kind_added_from_outside_takes_the_users_policy(large_weights: type[LargeWeights], tmp_path: Path) -> None:
    report, large = _planted_run(tmp_path / "tb", policy={"large_weights.above": "ignore"})
    assert {r.name for r in report.records(large_weights)} == large  # still listed: the tables are the data
    assert report.healthy and "weight above" not in report.verdict
    assert report.to_dict()["large_weights"][0]["severity"] == "ignore"


def test_a_kind_taken_back_leaves_no_trace() -> None:
    FINDINGS.register(LargeWeights)
    try:
        with pytest.raises(ValueError, match="'large_weights': taken"):
            FINDINGS.register(LargeWeights)
        assert Policy({"large_weights.above": "ignore"}).severity("large_weights.above", "w") == "ignore"
    finally:
        FINDINGS.unregister(LargeWeights)
    assert LargeWeights not in FINDINGS and "large_weights.above" not in DEFAULTS
    with pytest.raises(ValueError, match=r"unknown finding kind 'large_weights\.above'"):
        Policy({"large_weights.above": "ignore"})
    assert "large_weights" not in gradlog.Report().to_dict()
    for taken in ("hint", "alerts", "verdict", "summary"):  # a name of the report's own, or of the run's tables
        with pytest.raises(ValueError, match=f"'{taken}': a name of the report's own"):
            FINDINGS.register(type("Taken", (LargeWeights,), {"KIND": taken}))
    assert [k.KIND for k in FINDINGS] == list(WRITTEN)[:-1]
