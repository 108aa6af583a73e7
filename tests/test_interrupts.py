"""Ctrl-C in a notebook lands wherever the main thread is: between any two lines of gradlog's own step hooks
and `log()`. The run carried on afterwards (the next cell trains on, then `close()`) must judge what really
happened: the interrupted step either ran (and is judged as in an uninterrupted run) or did not (as in a run
that skipped it), never a half-counted step that shows up as a false finding.

KeyboardInterrupt is raised from a trace function at the N-th line gradlog executes during one measured
step and its `log()`, for a seeded sample of N (all of them, about 4,400 lines, with `-m heavy`).
"""

from __future__ import annotations

import os
import random
import sys
import warnings
from types import FrameType
from typing import Any

import pytest
import torch
from torch import nn

import gradlog

PKG = os.path.dirname(gradlog.__file__)
STEPS, INTERRUPTED = 8, 3


class Interrupt:
    """A trace function that raises KeyboardInterrupt at the `at`-th line run inside the gradlog package."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.lines = 0
        self.where = ""

    def global_trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        return self.local_trace if frame.f_code.co_filename.startswith(PKG) else None

    def local_trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            self.lines += 1
            if self.lines == self.at:
                self.where = f"{os.path.relpath(frame.f_code.co_filename, PKG)}:{frame.f_lineno}"
                sys.settrace(None)
                raise KeyboardInterrupt
        return self.local_trace


def _run(interrupt: Interrupt | None, skip: bool = False) -> tuple[gradlog.Report, gradlog.MemoryWriter, bool]:
    """A healthy tanh net (every tensor and unit learns: any finding is false), Adam, every step measured;
    step INTERRUPTED run under `interrupt` (or left out with `skip`); the loop goes on after a KeyboardInterrupt."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    memory = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=memory, every=1, print_report=False)
    interrupted = False
    for step in range(STEPS):
        model(torch.randn(3, 4)).pow(2).mean().backward()
        if step == INTERRUPTED and skip:
            opt.zero_grad()
            continue
        if step == INTERRUPTED and interrupt is not None:
            sys.settrace(interrupt.global_trace)
            try:
                opt.step()
                gl.log(step)
            except KeyboardInterrupt:
                interrupted = True
            finally:
                sys.settrace(None)
        else:
            opt.step()
            gl.log(step)
        opt.zero_grad()
    return gl.close(), memory, interrupted


def _findings(report: gradlog.Report) -> list[tuple[str, str, str]]:
    records = [*report.never_updated, *report.partly_updated, *report.stalled, *report.stopped_slices]
    return sorted((type(r).__name__, r.name, str(getattr(r, "reason", ""))) for r in records)


@pytest.fixture(scope="module")
def references() -> tuple[int, gradlog.Report, gradlog.Report]:
    """(lines gradlog runs in the measured step and its log(), the run uninterrupted, the run without that step)."""
    counter = Interrupt(at=-1)
    ran, _, _ = _run(counter)
    skipped, _, _ = _run(None, skip=True)
    assert ran.healthy and _findings(ran) == [] and ran.measured_steps == STEPS
    assert skipped.healthy and skipped.optimizer_steps == STEPS - 1
    assert counter.lines > 1000
    return counter.lines, ran, skipped


def _check(at: int, references: tuple[int, gradlog.Report, gradlog.Report]) -> None:
    _, ran, skipped = references
    interrupt = Interrupt(at)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report, memory, interrupted = _run(interrupt)
    where = f"KeyboardInterrupt at gradlog line {at} ({interrupt.where})"
    assert interrupted, where
    assert _findings(report) in (_findings(ran), _findings(skipped)), (where, report.verdict)
    assert report.healthy and report.error is None, (where, report.verdict)
    assert report.optimizer_steps in (STEPS - 1, STEPS), where
    # every step before and after the interrupted one was measured and published
    steps = {s for s, _ in memory.scalars["weights/grad_norm/0.weight"]}
    assert set(range(STEPS)) - {INTERRUPTED} <= steps, (where, sorted(steps))


def test_ctrl_c_anywhere_in_a_measured_step_leaves_no_false_finding(
    references: tuple[int, gradlog.Report, gradlog.Report],
) -> None:
    total = references[0]
    points = {1, 2, total - 1, total} | set(random.Random(7).sample(range(3, total - 1), 8))
    for at in sorted(points):
        _check(at, references)


@pytest.mark.heavy
def test_ctrl_c_at_every_line_of_a_measured_step(references: tuple[int, gradlog.Report, gradlog.Report]) -> None:
    """A seeded sample of 300 of the ~4,400 lines (every line is past the suite's 300 s per test on this
    machine): the first and last lines always."""
    total = references[0]
    points = {1, 2, total - 1, total} | set(random.Random(20261207).sample(range(3, total - 1), min(296, total - 4)))
    for at in sorted(points):
        _check(at, references)
