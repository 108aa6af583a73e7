"""The calibration zoo through the frameworks' documented knobs (tests/zoo_loops.py): each run, first verified
healthy by the zoo's own evidence (training metric and held-out evaluation fall >= 15%, every trainable tensor
changed), must get `gradlog OK` with notes only, at `every=5` and at the default `every`. The cheapest
`zoo_loops.FAST` runs by default, the rest with `-m heavy`. docs/verdict.md ("Calibration zoo") has the rows.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import zoo  # tests/ is on sys.path (rootdir conftest)
import zoo_loops

from gradlog.verdict.judge import findings

CASES = [
    pytest.param(f, id=f.__name__, marks=() if i < zoo_loops.FAST else pytest.mark.heavy)
    for i, f in enumerate(zoo_loops.FAMILIES)
]


@pytest.mark.parametrize("every", [5, None], ids=["every5", "default"])
@pytest.mark.parametrize("family", CASES)
def test_a_healthy_run_through_a_framework_knob_is_ok_with_notes_only(
    family: Callable[[], zoo.Setup], every: int | None
) -> None:
    outcome = zoo.run(family, every)
    assert outcome.healthy, f"{outcome.evidence()}; never changed: {outcome.unchanged}"  # healthy, by itself
    for report in outcome.reports:
        loud = [(f.severity, f.kind, f.name) for f in findings(report) if f.severity not in ("note", "ignore")]
        assert report.healthy and loud == [], (report.verdict, loud, zoo.findings(report))
        assert set(report.severities()) <= {"note"}, report.verdict


def test_every_run_says_why_it_is_healthy() -> None:
    names = [f.__name__ for f in zoo_loops.FAMILIES]
    assert len(set(names)) == len(names) >= 8
    assert all(f.__doc__ and "Healthy" in f.__doc__ for f in zoo_loops.FAMILIES), names
