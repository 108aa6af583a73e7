"""One codec for every finding: each record's table, row, JSON and reading back come from its fields.

The reference is the run format as written before the records owned it (the column lists the run files
hold, spelled out here) and the records themselves: written, then read back, each is the record it was.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from gradlog.runformat.cells import table_cells
from gradlog.verdict.records import INT, TEXT, Record, cell, ranges
from gradlog.verdict.report import (
    FINDINGS,
    Alert,
    IdleExperts,
    NeverUpdated,
    PartlyUpdated,
    PrecisionLoss,
    Reason,
    Stalled,
    StoppedSlice,
)
from gradlog.verdict.tables import SPARSE_TABLES

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
    "precision": ["name", "dtype", "mean_frac", "max_frac", "steps", "detail"],
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
    Alert(4, "update_ratio_high", "fc.weight", "high"),
]


def test_the_columns_are_the_run_formats() -> None:
    kinds: list[type[Record]] = [*FINDINGS, Alert]
    assert {k.KIND: k.columns(written=True) for k in kinds} == WRITTEN
    assert NeverUpdated.columns() == WRITTEN["never_updated"][:-1]  # `suspect` is written, not printed
    assert SPARSE_TABLES == ("gradlog/stopped_slices", "gradlog/experts", "gradlog/precision")


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
