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
