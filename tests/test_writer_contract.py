"""What gradlog asks a writer is declared on `gradlog.Writer`, with defaults: a writer of one's own gets each
part of the contract by implementing it, never by being one of gradlog's classes (issue 42)."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import catalogue
import pytest
import torch
from torch import nn

import gradlog
from gradlog.writers.guard import GuardedWriters


class Minimal(gradlog.Writer):
    """Only the three methods a writer must have (docs/configuration.md's custom writer)."""

    def __init__(self) -> None:
        self.scalars: list[int] = []
        self.tables: list[str] = []
        self.threads: set[str] = set()

    def log_scalars(self, scalars: Mapping[str, float], step: int) -> None:
        self.scalars.append(step)
        self.threads.add(threading.current_thread().name)

    def log_histogram(self, tag: str, hist: Any, step: int) -> None:
        pass

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
        self.tables.append(name)


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    return model, torch.optim.Adam(model.parameters())


def test_a_writer_with_only_the_three_methods_answers_the_whole_contract() -> None:
    w = Minimal()
    assert (w.inline, w.ordered, w.dropped, w.where(), w.run_id, w.resume_dir) == (False, False, 0, None, None, None)
    w.record_dropped(3)
    w.after_fork()
    with pytest.raises(NotImplementedError, match="Minimal has no resume_dir"):
        w.continue_run("x")
    model, opt = _model()
    with pytest.warns(RuntimeWarning, match="needs a TensorBoard or W&B writer"):
        gl = gradlog.GradLogger(model, opt, writer=gradlog.Output(w, resume=True), every=1, print_report=False)
    catalogue.train(opt, gl, 3, catalogue.random_mse(model, 4, 3))
    assert gl.dropped == 0 and gl.where() is None
    assert w.scalars[:3] == [0, 1, 2] and "gradlog/summary" in w.tables
    assert threading.main_thread().name not in w.threads  # not inline: called from its own thread


def test_where_a_writer_of_ones_own_put_its_files_is_printed_before_the_report(
    capsys: pytest.CaptureFixture[str],
) -> None:
    class Csv(Minimal):
        def where(self) -> str:
            return "gradlog: CSV files in out/ (check: cat out/*.csv)"

    model, opt = _model()
    gl = gradlog.GradLogger(model, opt, writer=Csv(), every=1)
    catalogue.train(opt, gl, 2, catalogue.random_mse(model, 4, 3))
    out = capsys.readouterr().out.splitlines()
    at = out.index("gradlog: CSV files in out/ (check: cat out/*.csv)")
    assert any(line.startswith("gradlog OK") for line in out[at + 1 :]), out


class Mirror(gradlog.Writer):
    """A writer of one's own that keeps its records in TensorBoard event files (through a TensorBoardWriter it
    holds, not one it is) and declares how it continues a run from them."""

    inline = True

    def __init__(self, log_dir: str) -> None:
        self.tb = gradlog.TensorBoardWriter(log_dir)

    def log_scalars(self, scalars: Mapping[str, float], step: int) -> None:
        self.tb.log_scalars(scalars, step)

    def log_histogram(self, tag: str, hist: Any, step: int) -> None:
        self.tb.log_histogram(tag, hist, step)

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
        self.tb.log_table(name, columns, rows)

    def close(self) -> None:
        self.tb.close()

    @property
    def run_id(self) -> str:
        return self.tb.run_id

    @property
    def resume_dir(self) -> str:
        return self.tb.resume_dir

    def continue_run(self, run: str) -> None:
        self.tb.continue_run(run)


def test_a_writer_that_declares_its_resume_dir_continues_the_run(tmp_path: Path) -> None:
    model, opt = _model()
    first = Mirror(str(tmp_path))
    gl = gradlog.GradLogger(model, opt, writer=first, every=1, print_report=False)
    catalogue.train(opt, gl, 3, catalogue.random_mse(model, 4, 3))
    second = Mirror(str(tmp_path))
    gl = gradlog.GradLogger(model, opt, writer=gradlog.Output(second, resume=True), every=1, print_report=False)
    report = catalogue.train(opt, gl, 2, catalogue.random_mse(model, 4, 3))
    assert report.optimizer_steps == 5 and report.measured_steps == 5  # both segments, one run
    assert second.run_id == first.run_id
    assert len({p.name.split(".gradlog-run-")[1] for p in tmp_path.glob("events.out.tfevents.*")}) == 1


def test_the_guard_asks_every_writer_through_the_contract() -> None:
    """`dropped` and `after_fork` reach a writer that implements them; one that does not keeps the defaults."""
    forked: list[str] = []

    class Counting(Minimal):
        inline = True

        @property
        def dropped(self) -> int:
            return 4

        def after_fork(self) -> None:
            forked.append("counting")

    guard = GuardedWriters([Counting(), Minimal()], timeout=1.0)
    assert guard.dropped == 4
    guard.after_fork()
    assert forked == ["counting"] and guard.writers == []


@pytest.mark.parametrize(("count", "said"), [(1, "1 record was dropped"), (4, "4 records were dropped")])
def test_the_dropped_records_warning_counts_in_words(count: int, said: str, caplog: pytest.LogCaptureFixture) -> None:
    """The close-time line about dropped records agrees with its count ('record(s) were' read wrong for one)."""

    class Dropping(Minimal):
        inline = True

        @property
        def dropped(self) -> int:
            return count

    guard = GuardedWriters([Dropping()], timeout=1.0)
    with caplog.at_level("WARNING", logger="gradlog"):
        guard.close()
    assert [r.getMessage() for r in caplog.records if "dropped during this run" in r.getMessage()] == [
        f"gradlog: {said} during this run (slow, stalled or failing writers)"
    ]
