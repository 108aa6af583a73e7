"""The calibration zoo (issue 38): every family of tests/zoo.py, first verified healthy without gradlog (its
training metric and a fixed held-out evaluation both fall by >= 15%, every trainable tensor ends different
from its starting copy), must then get `gradlog OK` with no warning and no problem (notes only), at `every=5`
and at the default `every`. The cheapest `zoo.FAST` families run by default, the rest with `-m heavy`.
docs/verdict.md ("Calibration zoo") has the table of what each family measured and what gradlog said.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import zoo  # tests/ is on sys.path (rootdir conftest)

CASES = [
    pytest.param(f, id=f.__name__, marks=() if i < zoo.FAST else pytest.mark.heavy) for i, f in enumerate(zoo.FAMILIES)
]


@pytest.mark.parametrize("every", [5, None], ids=["every5", "default"])
@pytest.mark.parametrize("family", CASES)
def test_a_healthy_family_is_ok_with_no_warning(family: Callable[[], zoo.Setup], every: int | None) -> None:
    outcome = zoo.run(family, every)
    assert outcome.healthy, f"{outcome.evidence()}; never changed: {outcome.unchanged}"  # healthy, by itself
    for report in outcome.reports:  # one per optimizer's logger (the GAN has two)
        loud = [f for f in zoo.findings(report) if f[0] != "note"]
        assert report.healthy and loud == [], (report.verdict, loud)
        assert set(report.severities()) <= {"note"}, report.verdict


def test_the_zoo_is_at_least_25_families_with_a_docstring_each() -> None:
    names = [f.__name__ for f in zoo.FAMILIES]
    assert len(set(names)) == len(names) >= 25
    assert all(f.__doc__ and "Healthy" in f.__doc__ for f in zoo.FAMILIES), names
