"""The calibration zoo through optimizers, peft methods and training styles (tests/zoo_styles.py): each run, first
verified healthy by the zoo's own evidence (training metric and held-out evaluation fall >= 15%, every trainable
tensor changed), must get `gradlog OK` with notes only, at `every=5` and at the default `every`. The cheapest
`zoo_styles.FAST` runs by default, the rest with `-m heavy`. docs/verdict.md ("Optimizers, adapters and training
styles") has the rows.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import zoo  # tests/ is on sys.path (rootdir conftest)
import zoo_styles

import gradlog
from gradlog import Reason
from gradlog.measure import fingerprint

CASES = [
    pytest.param(f, id=f.__name__, marks=() if i < zoo_styles.FAST else pytest.mark.heavy)
    for i, f in enumerate(zoo_styles.FAMILIES)
]


@pytest.mark.parametrize("every", [5, None], ids=["every5", "default"])
@pytest.mark.parametrize("family", CASES)
def test_a_healthy_run_with_an_unseen_optimizer_or_style_is_ok_with_notes_only(
    family: Callable[[], zoo.Setup], every: int | None
) -> None:
    outcome = zoo.run(family, every)
    by_design = zoo_styles.UNCHANGED_BY_DESIGN.get(family.__name__, lambda name: False)
    outcome.unchanged = [n for n in outcome.unchanged if not by_design(n)]
    assert outcome.healthy, f"{outcome.evidence()}; never changed: {outcome.unchanged}"  # healthy, by itself
    for report in outcome.reports:  # one per optimizer's logger (Muon + AdamW has two)
        loud = [f for f in zoo.findings(report) if f[0] != "note"]
        assert report.healthy and loud == [], (report.verdict, loud)
        assert set(report.severities()) <= {"note"}, report.verdict


def test_every_run_says_why_it_is_healthy() -> None:
    names = [f.__name__ for f in zoo_styles.FAMILIES]
    assert len(set(names)) == len(names) >= 12
    assert all(f.__doc__ and "Healthy" in f.__doc__ for f in zoo_styles.FAMILIES), names


@pytest.mark.parametrize("shape", [(6, 1), (1, 6), (6, 2)])
def test_a_one_column_tensor_compares_slice_by_slice(shape: tuple[int, int]) -> None:
    """AdaLoRA's `lora_E` is [r, 1]: its column signature is one [1, 2] pair whose strides are (1, 1), which
    viewing the int32 pair as one int64 refused (every later measured step failed, "measuring step N failed")."""
    t = torch.zeros(shape)
    u = t.clone()
    u.view(-1)[2] = 1.0  # one element: its row and its column changed, no other
    changed = fingerprint.compare(fingerprint.take(t), fingerprint.take(u))
    rows, cols = divmod(2, shape[1])
    assert changed.rows is not None and changed.cols is not None
    assert changed.rows.tolist() == [i == rows for i in range(shape[0])]
    assert changed.cols.tolist() == [j == cols for j in range(shape[1])]
    assert not fingerprint.compare(fingerprint.take(t), fingerprint.take(t.clone())).rows.any()  # type: ignore[union-attr]


class _SVDAdapter(torch.nn.Module):
    """AdaLoRA's form, by hand: P diag(E) Q, E ([6, 1]) zero-initialised as peft initialises `lora_E`, P and Q
    random, with AdaLoRA's orthogonality penalty on P and Q (which keeps their pruned ranks' slices learning)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Parameter(torch.randn(6, 8) / 3)
        self.e = torch.nn.Parameter(torch.zeros(6, 1))
        self.p = torch.nn.Parameter(torch.randn(4, 6) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ (self.q * self.e).T) @ self.p.T  # type: ignore[no-any-return]

    def orthogonality(self) -> torch.Tensor:
        eye = torch.eye(6)
        return (self.p.T @ self.p - eye).pow(2).sum() + (self.q @ self.q.T - eye).pow(2).sum()


def _prune_e(rows: list[int], start: int, every: int, steps: int = 40) -> tuple[gradlog.Report, torch.Tensor]:
    """The adapter fitted by Adam, rows `rows` of E zeroed in place (`masked_fill_`, as AdaLoRA's allocator
    does) after every step from `start` on; returns the report and E before the first zeroing."""
    torch.manual_seed(0)
    model = _SVDAdapter()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, target = torch.randn(64, 8), torch.randn(64, 4)
    mask = torch.zeros(6, 1, dtype=torch.bool)
    mask[rows] = True
    gl = gradlog.GradLogger(model, opt, writer="memory", every=every, print_report=False)
    learned = model.e.detach().clone()
    for i in range(steps):
        (torch.nn.functional.mse_loss(model(x), target) + 0.1 * model.orthogonality()).backward()
        opt.step()
        opt.zero_grad()
        if i == start - 1:
            learned = model.e.detach().clone()
        if i >= start:
            with torch.no_grad():
                model.e.masked_fill_(mask, 0.0)
        gl.log(i)
    return gl.close(), learned


@pytest.mark.parametrize("every", [1, 5])
def test_rows_zeroed_after_they_learned_are_pruned_a_note(every: int) -> None:
    """AdaLoRA's pruned ranks: rows of a zero-initialised tensor learn for 20 steps, then are zeroed in place
    after every step. At close they equal their start (zero), so gradlog said `partly.overwritten` (a problem),
    though the optimizer's updates stayed for 20 steps: now `partly.pruned`, a note."""
    report, learned = _prune_e([1, 3, 4], start=20, every=every)
    assert bool((learned[[1, 3, 4]] != 0).all())  # by hand: they learned before the first zeroing
    got = [(r.name, r.dim, r.indices, r.reason) for r in report.partly_updated]
    assert got == [("e", 0, (1, 3, 4), Reason.PRUNED)], report.partly_updated
    assert "learned (an optimizer update stayed" in report.partly_updated[0].detail
    assert report.healthy and report.never_updated == [], report.verdict


def test_a_tensor_zeroed_whole_after_it_learned_is_pruned_a_note() -> None:
    report, learned = _prune_e(list(range(6)), start=20, every=5)
    assert bool((learned != 0).all())
    assert [(r.name, r.reason) for r in report.never_updated] == [("e", Reason.PRUNED)], report.never_updated
    assert report.healthy, report.verdict


@pytest.mark.parametrize("every", [1, 5])
def test_rows_zeroed_from_the_first_step_stay_overwritten(every: int) -> None:
    """The same zeroing from the first step on: the rows never kept an update, a mask that stops them learning."""
    report, _ = _prune_e([1, 3, 4], start=0, every=every)
    assert [(r.indices, r.reason) for r in report.partly_updated] == [((1, 3, 4), Reason.OVERWRITTEN)]
    assert not report.healthy
