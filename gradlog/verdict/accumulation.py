"""Gradients cleared between the backward() passes of one optimizer step: ``optimizer.zero_grad()`` inside a
gradient-accumulation loop, so only the last micro-batch's gradient reaches step().

Nothing in the measured gradients tells it apart from a healthy run: every tensor gets a gradient, the model
learns (from a quarter of its data under 4 micro-batches), and an embedding's rows that only earlier micro-batches
used look like ids "in no batch". The evidence is the run's first optimizer step, watched pass by pass
(`gradlog.measure.trace.PassWatch`): each backward() pass but the last had its gradients gone (None, or zeroed)
before the next forward, with no weight written in between. A healthy accumulation keeps them; a loop whose
other optimizer, or a hand-written update (SAM), used a pass's gradient is not counted.

A kind of finding in one module: its record (`AccumulationCleared`), registered in
`gradlog.verdict.report.FINDINGS`; its records come from the watch at close(), not from the measured evidence
(`detect` finds none).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from gradlog.measure.trace import ClearedPasses
from gradlog.verdict.policy import PROBLEM
from gradlog.verdict.records import INT, TEXT, Case, Record, cell


@dataclass(frozen=True)
class AccumulationCleared(Record):
    """At optimizer step `step`, `passes` backward() passes, and the gradients of `cleared` of them (all but the
    last) cleared before the next: `name` is the backward() line."""

    KIND = "accumulation"
    TITLE = "Gradients cleared between backward() passes"
    NOUN = "optimizer step"
    SAID = "with gradients cleared between its backward() passes (zero_grad() inside the accumulation loop)"
    #: gradient accumulation broken by a zero_grad() inside it
    SEVERITY: ClassVar[dict[str, tuple[str, str]]] = {
        "accumulation.cleared": (
            PROBLEM,
            "zero_grad() between the backward() passes of one optimizer step (inside a gradient-accumulation "
            "loop): only the last pass's gradient reaches step(), the other micro-batches are lost",
        ),
    }

    name: str = cell(TEXT)
    step: int = cell(INT)
    passes: int = cell(INT)
    cleared: int = cell(INT)
    detail: str = cell(TEXT)

    def policy_kind(self) -> str:
        return "accumulation.cleared"

    @classmethod
    def detect(cls, case: Case) -> list[AccumulationCleared] | None:
        """None: the records come from the run's pass watch (`from_passes`), added at close()."""
        return None


def from_passes(found: ClearedPasses) -> AccumulationCleared:
    """The record of what the pass watch found, with the evidence and the fix in words."""
    at = f" at {found.site.quoted()}" if found.site else ""
    detail = (
        f"optimizer step {found.step} took {found.passes} backward() passes{at}, and the gradients of the first "
        f"{found.cleared} were cleared (None or zero) before the next forward: only the last pass's gradient "
        f"reached step(), so {found.cleared} of {found.passes} micro-batches are lost (ids or rows only they held "
        "never learn); fix: call optimizer.zero_grad() once per optimizer step, after step(), not in the "
        "accumulation loop"
    )
    return AccumulationCleared(str(found.site) if found.site else "backward()", found.step, found.passes,
                               found.cleared, detail)  # fmt: skip
