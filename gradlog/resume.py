"""A resumed run: a new process continues an earlier gradlog run in the same folder as one logical run.

At start, the earlier segment's tables are read back (through `gradlog.runformat`): its report, its step
count, and its `gradlog/segment` table (every tracked tensor's name, shape and last measured update). The new
segment writes under the same run id (the TensorBoard event files' `.gradlog-run-<id>` mark), counts its
steps on from the earlier ones, and at close merges the earlier evidence into its report: a tensor updated
in any segment is not never-updated; one updated before the resume and not since has stalled. Readers
then see one run whose last tables speak for all segments. See docs/resume.md.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Union

import torch

from gradlog.measure.params import Tracked
from gradlog.runformat import names
from gradlog.runformat.rundata import BadRun
from gradlog.runformat.tables import closed_report
from gradlog.runformat.tb_run import is_event_file, read_folder, run_key
from gradlog.verdict.report import PartlyUpdated, Report, Stalled

__all__ = [
    "SEGMENT_COLUMNS",
    "SEGMENT_TABLE",
    "Earlier",
    "Segment",
    "check_resume",
    "checkpoint_step",
    "find_earlier",
]

#: `Output(resume=...)`: False (a new run), True (continue the run in log_dir), "auto" (continue it when
#: it is safe to tell: see `Earlier.mismatch` and docs/resume.md).
Resume = Union[bool, Literal["auto"]]

SEGMENT_TABLE = names.SEGMENT
SEGMENT_COLUMNS = names.SEGMENT_COLUMNS


def check_resume(value: object) -> None:
    if value not in (False, True, "auto") or (isinstance(value, int) and not isinstance(value, bool)):
        raise ValueError(
            f"Output(resume={value!r}): must be False (a new run), True (continue the gradlog run in log_dir) "
            "or 'auto' (continue it when the folder holds an earlier run of this model and the optimizer "
            "state was loaded from a checkpoint)"
        )


def _shape(text: str) -> tuple[int, ...] | None:
    if text in ("", "scalar"):
        return ()
    try:
        return tuple(int(d) for d in text.split("x"))
    except ValueError:
        return None


def shape_text(shape: Sequence[int]) -> str:
    return "x".join(str(d) for d in shape) if shape else "scalar"


@dataclass
class Segment:
    """What this segment writes so that a later one can continue it: the run id and the segment number
    (summary rows), and per tensor its name, shape and last measured update (`gradlog/segment`)."""

    run_id: str
    number: int = 1
    first_step: int = 0

    def summary_rows(self) -> list[list[str]]:
        return [["run_id", self.run_id], ["segment", str(self.number)], ["segment_first_step", str(self.first_step)]]

    @staticmethod
    def rows(tracked: list[Tracked], last_update: dict[int, int], earlier: Earlier | None) -> list[list[str]]:
        """One row per tracked tensor; a tensor not updated in this segment keeps its earlier last update."""
        out = []
        for r in tracked:
            last = last_update.get(r.index, -1)
            if last < 0 and earlier is not None:
                last = earlier.last_update.get(r.name, -1)
            out.append([r.name, shape_text(r.shape), str(last)])
        return out


@dataclass
class Earlier:
    """The earlier segments of a run, as their last tables say."""

    log_dir: str
    run_id: str
    report: Report
    segments: int
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    last_update: dict[str, int] = field(default_factory=dict)

    @property
    def end_step(self) -> int:
        """Optimizer steps of the earlier segments: this segment's first step."""
        return self.report.optimizer_steps

    def mismatch(self, tracked: list[Tracked]) -> str | None:
        """Why the watched model is not the earlier run's (other tensor names or shapes), or None."""
        mine = {r.name: tuple(r.shape) for r in tracked if r.in_model}
        theirs = {n: s for n, s in self.shapes.items() if not n.startswith("optimizer.param_groups.")}
        missing = sorted(set(theirs) - set(mine))
        added = sorted(set(mine) - set(theirs))
        if missing or added:
            parts = []
            if missing:
                parts.append(f"{len(missing)} of its tensors are not in this model (e.g. {missing[0]!r})")
            if added:
                parts.append(f"this model has {len(added)} tensors it did not (e.g. {added[0]!r})")
            return "; ".join(parts)
        for name, shape in mine.items():
            if theirs[name] != shape:
                return f"{name!r} had shape {shape_text(theirs[name])} there and has {shape_text(shape)} here"
        return None

    def merge(self, report: Report, first_step: int, tracked: set[str]) -> Report:
        """This segment's report, judged over the whole run: a tensor updated in any segment is not
        never-updated; one updated earlier but not in this segment (from `first_step` on) has stalled."""
        earlier = self.report
        before_never = {r.name: r for r in earlier.never_updated}
        known = set(self.shapes) | set(before_never)
        never = []
        stalled = list(report.stalled)
        earlier_stalled = {s.name: s for s in earlier.stalled}
        for r in report.never_updated:
            if r.name in before_never or r.name not in known:  # never updated in any segment (or new now)
                never.append(r)
                continue
            was = earlier_stalled.get(r.name)
            since = was.since_step if was is not None else first_step
            last = was.last_update_step if was is not None else self.last_update.get(r.name, -1)
            stalled.append(
                Stalled(r.name, since, last, r.reason, f"updated before the resume at step {first_step}; {r.detail}")
            )
        for name, r in before_never.items():  # earlier findings on tensors this segment no longer tracks
            if name not in tracked:
                never.append(r)
        return replace(
            report,
            never_updated=never,
            stalled=stalled,
            partly_updated=_merge_partly(earlier, report),
            first_nonfinite=earlier.first_nonfinite or report.first_nonfinite,
            measured_steps=earlier.measured_steps + report.measured_steps,
            skipped_steps=earlier.skipped_steps + report.skipped_steps,
        )


def _merge_partly(earlier: Report, report: Report) -> list[PartlyUpdated]:
    """Slices never updated in the whole run: never updated in every segment. A segment that left the
    whole tensor alone counts as all of its slices; one that updated it whole (no row) as none."""
    before = {p.name: p for p in earlier.partly_updated}
    now = {p.name: p for p in report.partly_updated}
    never_before = {r.name for r in earlier.never_updated}
    never_now = {r.name for r in report.never_updated}
    out = []
    for name, p in now.items():
        if name in never_before:
            out.append(p)
        elif name in before and before[name].dim == p.dim:
            both = tuple(sorted(set(p.indices) & set(before[name].indices)))
            if both:
                out.append(replace(p, indices=both, never=len(both)))
    for name, p in before.items():
        if name in never_now and name not in now:
            out.append(p)
    return out


def checkpoint_step(optimizer: torch.optim.Optimizer | None) -> int | None:
    """The optimizer steps a loaded checkpoint had taken, where the optimizer counts them (Adam and most
    adaptive ones keep a per-tensor "step"); None where it does not (plain SGD)."""
    steps = []
    for state in optimizer.state.values() if optimizer is not None else []:
        step = state.get("step") if isinstance(state, dict) else None
        if isinstance(step, torch.Tensor) and step.numel() == 1:
            step = step.item()
        if isinstance(step, (int, float)) and not isinstance(step, bool) and step >= 0:
            steps.append(int(step))
    return max(steps) if steps else None


def run_id_of(log_dir: str) -> tuple[str | None, int]:
    """The run id in the folder's event file names (`...gradlog-run-<id>`), and how many distinct ids."""
    try:
        names = os.listdir(log_dir)
    except OSError:
        return None, 0
    ids = sorted({run_key(n) for n in names if is_event_file(n)} - {""})
    return (ids[-1] if ids else None), len(ids)


def find_earlier(log_dir: str) -> Earlier | str:
    """The earlier run in `log_dir`, or why there is none to continue (a sentence for the warning)."""
    run_id, count = run_id_of(log_dir)
    if run_id is None:
        return f"{log_dir!r} holds no gradlog run"
    if count > 1:
        return f"{log_dir!r} holds {count} gradlog runs already (not one to continue)"
    try:
        run = read_folder(log_dir)
    except BadRun as exc:
        return f"{log_dir!r} cannot be read as one gradlog run ({exc})"
    report = closed_report(run)
    table = run.tables.get(SEGMENT_TABLE)
    if report is None or table is None:
        return (
            f"the run in {log_dir!r} wrote no gradlog/segment table (it was written by an older gradlog, or "
            "killed before its first table)"
        )
    summary = run.summary()
    if run.provisional_step is not None and not summary.get("optimizer_steps", "").isdigit():
        report.optimizer_steps = run.provisional_step + 1
    segments = int(summary["segment"]) if summary.get("segment", "").isdigit() else 1
    columns, rows = table
    index = {c: i for i, c in enumerate(columns)}
    shapes: dict[str, tuple[int, ...]] = {}
    last: dict[str, int] = {}
    for row in rows:
        cells = {c: row[i] if i < len(row) else "" for c, i in index.items()}
        shape = _shape(cells.get("shape", ""))
        if shape is None or not cells.get("name"):
            continue
        shapes[cells["name"]] = shape
        step = cells.get("last_update_step", "-1")
        last[cells["name"]] = int(step) if step.lstrip("-").isdigit() else -1
    return Earlier(log_dir, run_id, report, segments, shapes, last)
