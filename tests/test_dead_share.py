"""Severity by impact (issue 38): dead units weigh by their share of their layer.

A few truly dead ReLU units are normal: at most `policy.SMALL_SHARE` (5%) of a layer's units, never-active and
stopped together, is the note `partly.few_dead` / `stopped.few_dead`; a larger share, many units stopping at
one measured step (`policy.EVENT_SLICES`), or a whole layer is a problem. Which units are dead comes from the
test's copy of the weights (rows that never changed), never from gradlog.
"""

from __future__ import annotations

import pytest
import torch
from catalogue import WideReLU, random_mse, train

import gradlog
from gradlog.verdict.judge import slice_kinds
from gradlog.verdict.policy import NOTE, PROBLEM, Policy


def run(
    model: WideReLU, steps: int = 60, kill_at: int | None = None, killed: tuple[int, ...] = (), **kw: object
) -> tuple[gradlog.Report, set[int]]:
    """The report and, from a copy of `fc1.weight` before and after, the units whose row never changed."""
    torch.manual_seed(0)
    first = model.fc1.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.2 / model.fc1.out_features)  # no divergence at 256 wide
    gl = gradlog.GradLogger(model, opt, writer=gradlog.MemoryWriter(), every=1, print_report=False, **kw)  # type: ignore[arg-type]
    draw = random_mse(model, 8, 16)

    def loss(step: int) -> torch.Tensor:
        if step == kill_at:
            model.kill(killed)
        return draw(step)

    report = train(opt, gl, steps, loss)
    same = (model.fc1.weight.detach() == first).all(1).nonzero().flatten().tolist()
    return report, set(same)


def kinds(report: gradlog.Report) -> set[str]:
    """The kinds the judge gives the partly-updated and stopped-slice records."""
    partly, stopped = slice_kinds(report)
    return {*partly, *stopped}


def test_one_dead_unit_of_64_is_a_note_with_its_count_and_share() -> None:
    report, same = run(WideReLU(64, dead=(5,)))
    assert same == {5}  # the reference: exactly unit 5 never changed
    rows = {(r.name, r.dim): r for r in report.partly_updated}
    assert set(rows) == {("fc1.weight", 0), ("fc1.bias", None), ("fc2.weight", 1)}
    assert all(r.indices == (5,) for r in rows.values())
    assert kinds(report) == {"partly.few_dead"}
    assert (
        "(1 of 64)" in rows[("fc1.weight", 0)].detail
        and "1.6% of the layer's output units" in rows[("fc1.weight", 0)].detail
    )
    assert report.healthy and report.verdict.startswith("gradlog OK")
    assert report.severities() == {NOTE: 3}
    assert all(d["severity"] == NOTE for d in report.to_dict()["partly_updated"])
    # the policy still decides: every dead unit a problem where the user wants it so
    strict = Policy(problem=["few_dead"])
    report.policy = strict
    assert not report.healthy and report.severities() == {PROBLEM: 3}


def test_a_large_share_of_dead_units_is_a_problem() -> None:
    dead = tuple(range(0, 64, 8))  # 8 of 64: 12.5%
    report, same = run(WideReLU(64, dead=dead))
    assert same == set(dead)
    assert kinds(report) == {"partly.zero_grad"}
    assert not report.healthy and "12.5% of the layer's output units" in report.partly_updated[0].detail


def test_a_few_never_active_and_a_few_stopped_units_count_together() -> None:
    """2 never active + 2 killed at step 20 = 4 of 64 (6.3%): over the line, both tables are problems."""
    report, same = run(WideReLU(64, dead=(1, 2)), kill_at=20, killed=(40, 41))
    assert same == {1, 2}
    stopped = {(r.name, r.dim): r for r in report.stopped_slices}
    assert stopped[("fc1.bias", None)].indices == (40, 41) and stopped[("fc1.bias", None)].since_step == 20
    assert kinds(report) == {"partly.zero_grad", "stopped.dead_units"}
    assert not report.healthy
    # ...while 1 + 1 of 64 (3.1%) are notes
    report, _ = run(WideReLU(64, dead=(1,)), kill_at=20, killed=(40,))
    assert kinds(report) == {"partly.few_dead", "stopped.few_dead"} and report.healthy


@pytest.mark.parametrize("killed, kind", [((10,), "stopped.few_dead"), (tuple(range(10, 18)), "stopped.dead_units")])
def test_many_units_stopping_at_one_step_are_an_event(killed: tuple[int, ...], kind: str) -> None:
    """1 of 256 killed: a note; 8 of 256 (3.1%) killed at the same step: a problem that names the step."""
    report, _ = run(WideReLU(256), kill_at=30, killed=killed)
    assert {(r.name, r.indices, r.since_step) for r in report.stopped_slices if r.name == "fc1.bias"} == {
        ("fc1.bias", killed, 30)
    }
    assert kinds(report) == {kind}
    assert report.healthy is (kind == "stopped.few_dead")
    if not report.healthy:
        # one event in three tensors (fc1 rows, fc1 bias, fc2 columns): one cause, its step named
        assert (
            "3 tensors with slices that stopped learning (1 cause: dead_units 1), the first silent at every "
            in (report.verdict)
            and "measured step from step 30 on" in report.verdict
        )
