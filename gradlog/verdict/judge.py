"""The one verdict: OK or PROBLEM, decided from a `Report` alone.

Everything that states a run's health calls `judge`: `Report.healthy` and `Report.verdict`, the line
close() prints, the `gradlog/summary` table written to TensorBoard and W&B (and so the W&B run
summary), and `gradlog report` (which rebuilds the Report from those tables). One function, so they
can never disagree about the same run.

A run is a PROBLEM when any of these holds:
- the diagnosis itself failed (`Report.error`): what never updated is unknown;
- a tensor never updated for a reason that is not intentional (`NeverUpdated.intentional`: frozen,
  unless the freeze looks accidental, `suspect`);
- slices of a tensor never updated for a reason that is not intentional (`padding_idx` rows are);
- a tensor stopped learning (`Report.stalled`), or rows/columns/elements/experts of one did
  (`Report.stopped_slices`);
- a large share of a tensor's updates rounded away (`Report.precision`, see `gradlog.verdict.precision`);
- a gradient went NaN/Inf on a step the optimizer did not skip (`Report.first_nonfinite`).
Steps a GradScaler skipped are routine, and out-of-band update ratios and gradient-norm spikes
(`Report.warnings()`) are warnings: both are mentioned, never a problem.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # report.py imports this module: the types only, for the checker
    from gradlog.verdict.report import Report

OK = "OK"
PROBLEM = "PROBLEM"


@dataclass(frozen=True)
class Verdict:
    """The judgement of one run: `status` ("OK" or "PROBLEM"), the `parts` of the one-line `text`
    (what was found, most basic first) and its `suffix` (the step counts)."""

    healthy: bool
    status: str
    parts: tuple[str, ...]
    suffix: str
    problems: tuple[str, ...]  # the parts that made it a PROBLEM (empty when OK)

    @property
    def text(self) -> str:
        return f"gradlog {self.status}: " + "; ".join(self.parts) + self.suffix


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def _by_reason(reasons: Iterable[object]) -> str:
    counts: dict[str, int] = {}
    for r in reasons:
        key = str(r)
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{k} {v}" for k, v in counts.items())


def judge(report: Report) -> Verdict:
    """OK or PROBLEM for `report`, with the one line that says why."""
    parts: list[str] = []
    problems: list[str] = []

    def add(text: str, problem: bool) -> None:
        parts.append(text)
        if problem:
            problems.append(text)

    if report.first_nonfinite is not None:  # first: the one thing to look at before anything else
        f = report.first_nonfinite
        add(f"first non-finite gradient at step {f.step} in {f.name}", True)
    never = report.never_updated
    if report.error is not None:
        add(f"the diagnosis failed ({report.error}); which tensors never updated is unknown", True)
    elif not never:
        add(f"all {report.tracked_tensors} tracked tensors were updated", False)
    else:
        text = f"{len(never)} of {report.tracked_tensors} tensors never updated ({_by_reason(r.reason for r in never)})"
        add(text, not all(r.intentional for r in never))
    partly = report.partly_updated
    if partly:
        tensors = len({r.name for r in partly})
        text = f"{_plural(tensors, 'tensor')} partly never updated ({_by_reason(r.reason for r in partly)})"
        add(text, not all(r.intentional for r in partly))
    stalled = report.stalled
    if stalled:
        first = min(r.since_step for r in stalled)
        text = f"{_plural(len(stalled), 'tensor')} stopped learning ({_by_reason(r.reason for r in stalled)})"
        add(text + f", the first from step {first}", True)
    sliced = report.stopped_slices
    if sliced:
        first = min(r.since_step for r in sliced)
        text = f"{_plural(len({r.name for r in sliced}), 'tensor')} with slices that stopped learning"
        add(text + f" ({_by_reason(r.reason for r in sliced)}), the first from step {first}", True)
    if report.precision:
        text = (
            f"{_plural(len(report.precision), 'tensor')} with updates partly rounded away (below its dtype's precision)"
        )
        add(text, True)
    if report.skipped_steps:
        add(f"{_plural(report.skipped_steps, 'optimizer step')} skipped", False)
    warned = report.warnings()
    if warned:  # out-of-band ratios and spikes: listed, never a PROBLEM
        by = ", ".join(f"{kind} {v}" for kind, v in warned.items())
        add(f"{_plural(sum(warned.values()), 'warning')} ({by})", False)
    suffix = f" ({report.optimizer_steps} optimizer steps, {report.measured_steps} measured)"
    status = PROBLEM if problems else OK
    return Verdict(not problems, status, tuple(parts), suffix, tuple(problems))
