"""The run format round-trips: a `Report` written through the TensorBoard and W&B writers reads back, with
gradlog's own readers, as the same tables and the same verdict (`gradlog.runformat`).

The report comes from a real run of the demo model's planted bugs (a layer frozen once gradlog started, an
unused head, a layer built after the optimizer, embedding rows never looked up, a layer whose lr is
scheduled to 0 halfway), with alerts and a policy rule, logged to both writers at once.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import gradlog
from gradlog.cli.demo import build, freeze_by_mistake, scheduler
from gradlog.readers.run import RunData, load
from gradlog.readers.wandb_offline import find_run_files
from gradlog.run.resume import Segment
from gradlog.runformat import names
from gradlog.runformat.cells import bare_name, name_cell, parse_shape, shape_cell, split_name_cell
from gradlog.verdict.report import Reason, Report
from gradlog.verdict.tables import closed_report, read_alerts, report_tables, summary_rows
from gradlog.writers.wandb import WandbWriter

wandb = pytest.importorskip("wandb")
pytest.importorskip("tensorboard")

STEPS = 24
#: a rule that changes a finding's severity, so the policy table travels too
POLICY = {"never.no_grad": "warning"}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Report, Path]]:
    """The demo's planted bugs, logged to TensorBoard and W&B offline by one GradLogger: (its report, folder)."""
    root = tmp_path_factory.mktemp("runformat")
    with pytest.MonkeyPatch.context() as mp:
        for key, sub in (("DIR", ""), ("CONFIG_DIR", "config"), ("CACHE_DIR", "cache"), ("DATA_DIR", "data")):
            mp.setenv(f"WANDB_{key}", str(root / sub))
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        model, optimizer = build(0)
        sched = scheduler(optimizer, STEPS)
        g = torch.Generator().manual_seed(1)
        w_and_b = WandbWriter(project="runformat", log_dir=str(root / "run"))
        output = gradlog.Output(["tensorboard", w_and_b], strict=True)
        gl = gradlog.GradLogger(
            model, optimizer, writer=output, every=2, log_dir=str(root / "run"), policy=POLICY, print_report=False
        )
        freeze_by_mistake(model)  # trainable when gradlog started: a suspect freeze, never updated
        for step in range(STEPS):
            x, y = torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            sched.step()
            gl.log(step)
        report = gl.close()
        assert wandb.run is None
    yield report, root / "run"


def _read(run: RunData) -> Report:
    report = closed_report(run)
    assert report is not None, sorted(run.tables)
    report.alerts = read_alerts(run.tables.get(names.ALERTS, ([], [])))
    return report


def test_the_run_has_every_kind_of_finding(written: tuple[Report, Path]) -> None:
    """The round trip below is only worth something if every table has rows."""
    report, _ = written
    assert {r.reason for r in report.never_updated} >= {Reason.FROZEN, Reason.NO_GRAD, Reason.NOT_IN_OPTIMIZER}
    assert [p.name for p in report.partly_updated] == ["tokens.weight"]
    assert {s.name for s in report.stalled} == {"fade.weight", "fade.bias"}
    assert report.alerts and report.policy is not None and report.policy.rules


@pytest.mark.parametrize("backend", ["tensorboard", "wandb"])
def test_a_report_reads_back_as_written(written: tuple[Report, Path], backend: str) -> None:
    report, folder = written
    if backend == "tensorboard":
        run = load(str(folder))
    else:
        (run_file,) = find_run_files(folder)
        run = load(os.path.dirname(run_file))
    assert run.backend == backend and run.skipped == [] and run.provisional_step is None
    back = _read(run)
    assert report_tables(back) == report_tables(report)
    assert summary_rows(back, None, False) == summary_rows(report, None, False)
    assert back.verdict == report.verdict
    assert back.never_updated == report.never_updated  # the records themselves, aliases and shapes included
    assert back.partly_updated == report.partly_updated and back.stalled == report.stalled
    # what the writers wrote is what the codecs make, and the summary holds the segment's rows after it
    written_summary = run.summary()
    assert list(written_summary)[: len(summary_rows(report, None, False))] == [
        k for k, _ in summary_rows(report, None, False)
    ]
    assert set(written_summary) <= set(names.SUMMARY_KEYS)


def test_every_summary_key_written_is_one_the_readers_take_back() -> None:
    """W&B keeps the summary table as run-summary keys; its reader takes exactly `SUMMARY_KEYS` back."""
    report = Report(hint="zero_grad() after backward()", error="boom", tracked_tensors=3)
    report.first_nonfinite = None
    rows = summary_rows(report, provisional_step=5, rank_local=True) + Segment("abc").summary_rows()
    assert {k for k, _ in rows} <= set(names.SUMMARY_KEYS)
    assert len(set(names.SUMMARY_KEYS)) == len(names.SUMMARY_KEYS)


def test_the_name_cell_round_trips() -> None:
    for name, aliases in (("fc.weight", ()), ("emb.weight", ("head.weight",)), ("a", ("b", "c.d"))):
        cell = name_cell(name, aliases)
        assert split_name_cell(cell) == (name, aliases)
        assert bare_name(cell) == name
    assert name_cell("emb.weight", ("head.weight", "lm.weight")) == "emb.weight (= head.weight, lm.weight)"


def test_the_shape_cell_round_trips() -> None:
    for shape, numel, cell in (((3, 4), 12, "3x4"), ((), 1, "scalar"), ((), 0, "not materialised")):
        assert shape_cell(shape, numel) == cell
        assert parse_shape(cell) == shape
    assert parse_shape("3xfour") is None


def test_provisional_and_final_names_are_inverse() -> None:
    for table in names.TABLES:
        assert names.final(names.provisional(table)) == table
        assert names.provisional(table).startswith(names.PROVISIONAL_PREFIX)
    assert names.provisional(names.SEGMENT) in names.HIDDEN_TABLES
