"""A resumed run: a new process continues an earlier gradlog run in the same folder as one logical run.

At start, the earlier segment's tables are read back (through `gradlog.runformat`): its report, its step count,
and its `gradlog/segment` table (every tracked tensor's name, shape and last measured update). The new
segment writes under the same run id (the TensorBoard event files' `.gradlog-run-<id>` mark, or the W&B
run id, given to `wandb.init(id=..., resume="allow")`), counts its steps on from the earlier ones (on every
rank under FSDP2/DTensor: rank 0 reads, then broadcasts), and at close merges the earlier evidence into its
report: a tensor updated in any segment is not never-updated; one updated before the resume and not since
has stalled. Readers then see one run whose last tables speak for all segments. See docs/resume.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Union

import torch

from gradlog.measure.params import Tracked
from gradlog.run.lifecycle import warn
from gradlog.runformat import names
from gradlog.runformat.cells import parse_shape, shape_cell, table_cells, whole_number
from gradlog.runformat.rundata import BadRun, RunData
from gradlog.runformat.tb_run import is_event_file, read_folder, run_key
from gradlog.runformat.wandb_run import read_segments, runs_in
from gradlog.verdict.ledger import Evidence
from gradlog.verdict.report import NeverUpdated, PartlyUpdated, Reason, Report, Stalled, StoppedSlice
from gradlog.verdict.slices import SliceFacts
from gradlog.verdict.stopped_slices import cut
from gradlog.verdict.tables import closed_report, series_steps
from gradlog.writers import Writer, make_writers, route_options, writer_names

if TYPE_CHECKING:
    from gradlog.run.measuring import Pipeline
    from gradlog.run.options import Output

logger = logging.getLogger("gradlog")

__all__ = [
    "Continuation",
    "Earlier",
    "Segment",
    "checkpoint_step",
    "find_earlier",
    "open_run",
    "share",
    "start",
    "wandb_earlier",
]

#: `Output(resume=...)`: False (a new run), True (continue the run in log_dir), "auto" (continue it when
#: it is safe to tell: see `Earlier.mismatch` and docs/resume.md).
Resume = Union[bool, Literal["auto"]]


@dataclass
class Segment:
    """What this segment writes so that a later one can continue it: the run id and the segment number
    (summary rows), and per tensor its name, shape, last measured update and evidence counters summed over
    the segments so far (`gradlog/segment`)."""

    run_id: str
    number: int = 1
    first_step: int = 0

    def summary_rows(self) -> list[list[str]]:
        return [["run_id", self.run_id], ["segment", str(self.number)], ["segment_first_step", str(self.first_step)]]

    @staticmethod
    def rows(tracked: list[Tracked], evidence: dict[int, Evidence], earlier: Earlier | None) -> list[list[str]]:
        """One row per tracked tensor; a tensor not updated in this segment keeps its earlier last update.
        Its counters are the whole run's, so that a later segment never takes a part of the run for the whole."""
        out = []
        for r in tracked:
            ev = evidence.get(r.index, Evidence())
            last = ev.last_update
            if last < 0 and earlier is not None:
                last = earlier.last_update.get(r.name, -1)
            whole = earlier.whole(r.name, ev) if earlier is not None else ev
            out.append([r.name, shape_cell(r.shape), str(last), *_count_cells(whole)])
        return out


def _count_cells(ev: Evidence) -> list[str]:
    """`ev`'s counters as `gradlog/segment` cells (`names.SEGMENT_COUNTS`; floats exactly, by repr)."""
    values = [getattr(ev, c) for c in names.SEGMENT_COUNTS]
    return [repr(v) if isinstance(v, float) else str(v) for v in values]


def _counts(cells: dict[str, str]) -> Evidence:
    """The counters of one `gradlog/segment` row; ValueError naming the cell that is not a number."""
    values: dict[str, Any] = {}
    for c in names.SEGMENT_COUNTS:
        text = cells[c]
        try:
            values[c] = float(text) if c in ("frozen_sum", "frozen_max") else _count(text)
        except ValueError:
            raise ValueError(f"its {c!r} cell of {cells['name']!r} is {text[:40]!r}, not a number") from None
    return Evidence(**values)


def _count(text: str) -> int:
    """A whole count (`whole_number`); ValueError for anything else ("²", "1e3", 5,000 digits)."""
    value = whole_number(text)
    if value is None or value < 0:
        raise ValueError(text)
    return value


def summed(ev: Evidence, before: Evidence) -> Evidence:
    """`ev` (this segment's evidence) with the earlier segments' counters `before` added: the whole run's
    counters, this segment's fingerprint and last update."""
    sums: dict[str, Any] = {c: getattr(ev, c) + getattr(before, c) for c in names.SEGMENT_COUNTS}
    sums["frozen_max"] = max(ev.frozen_max, before.frozen_max)
    return replace(ev, **sums)


@dataclass
class Earlier:
    """The earlier segments of a run, as their last tables say."""

    log_dir: str
    run_id: str
    report: Report
    segments: int
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    last_update: dict[str, int] = field(default_factory=dict)
    #: per tensor, the evidence counters of every earlier segment together
    counts: dict[str, Evidence] = field(default_factory=dict)

    def whole(self, name: str, ev: Evidence) -> Evidence:
        """The whole run's counters of tensor `name`, this segment's being `ev` (`ev` itself for a tensor
        the earlier segments did not track)."""
        before = self.counts.get(name)
        return summed(ev, before) if before is not None else ev

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
                return f"{name!r} had shape {shape_cell(theirs[name])} there and has {shape_cell(shape)} here"
        return None

    def merge(self, report: Report, first_step: int, tracked: set[str], silent: list[StoppedSlice]) -> Report:
        """This segment's report, judged over the whole run: a tensor updated in any segment is not
        never-updated; one updated earlier but not in this segment (from `first_step` on) has stalled; so
        for slices (`_merge_stopped`, with `silent`: this segment's slices that had no gradient in it).
        `report`'s never-updated, partly-updated and precision records were built from the whole run's
        evidence already (`Continuation.never_evidence`, `fold_slices`, `whole_run`)."""
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
            stalled.append(Stalled(r.name, since, last, r.reason, _stalled_at_resume(r, first_step, since, last)))
        for name, r in before_never.items():  # earlier findings on tensors this segment no longer tracks
            if name not in tracked:
                never.append(r)
        return replace(
            report,
            never_updated=never,
            stalled=stalled,
            partly_updated=_merge_partly(earlier, report),
            stopped_slices=_merge_stopped(earlier, report, silent),
            first_nonfinite=earlier.first_nonfinite or report.first_nonfinite,
            measured_steps=earlier.measured_steps + report.measured_steps,
            skipped_steps=earlier.skipped_steps + report.skipped_steps,
        )


def _stalled_at_resume(r: NeverUpdated, first_step: int, since: int, last: int) -> str:
    """The detail of a tensor updated before the resume (at step `first_step`) and not since, stalled from
    `since` (the resume, or its earlier stall) after its last update at `last` (-1: not known). `r`, its
    record in this segment, counts this segment's measured steps only: the detail says so."""
    when = f"updated before the resume at step {first_step}"
    if last >= 0:
        when += f" (last at step {last})"
    if since < first_step:
        when += f", no update from step {since} on"
    return f"{when}; since the resume: {r.detail}"


#: Reasons of a record whose slices had no non-zero gradient at any measured step with a gradient
_NO_GRADIENT = frozenset(
    {
        Reason.ZERO_GRAD,
        Reason.NOT_IN_BATCH,
        Reason.PADDING_IDX,
        Reason.PRUNED,
        Reason.NO_GRAD,
        Reason.FROZEN,
        Reason.UNKNOWN,
    }
)


def _folded(f: SliceFacts, never: NeverUpdated | None, partly: list[list[PartlyUpdated]]) -> SliceFacts:
    """`f` (one tensor's facts in this segment) with the earlier segments': `never`, its never-updated
    record there, or `partly`, its partly-updated records there per dim of `f.changed` (see
    `Continuation.fold_slices`)."""
    changed: dict[int | None, torch.Tensor] = {}
    nonzero: dict[int | None, torch.Tensor | None] = {}
    for (dim, now), records in zip(f.changed.items(), partly):
        n = now.numel()
        moved = torch.full((n,), never is None, dtype=torch.bool)
        graded = torch.full((n,), never is None or never.reason not in _NO_GRADIENT, dtype=torch.bool)
        for p in records if never is None else []:
            at = torch.tensor([i for i in p.indices if i < n], dtype=torch.long)
            moved[at] = False
            graded[at] = p.reason not in _NO_GRADIENT
        changed[dim] = now | moved
        seen = f.nonzero.get(dim)
        nonzero[dim] = graded if seen is None else seen | graded
    return SliceFacts(changed, nonzero, f.state, f.moved, f.moved_at)


def _merge_partly(earlier: Report, report: Report) -> list[PartlyUpdated]:
    """Slices never updated in the whole run: this segment's records, built from the whole run's slice
    facts (`Continuation.fold_slices`), and the earlier segments' of tensors this segment never updated
    and could not judge by slices (frozen, or out of the optimizer, since)."""
    never_now = {r.name for r in report.never_updated}
    now = {p.name for p in report.partly_updated}
    return [*report.partly_updated, *(p for p in earlier.partly_updated if p.name in never_now and p.name not in now)]


def _merge_stopped(earlier: Report, report: Report, silent: list[StoppedSlice]) -> list[StoppedSlice]:
    """Slices that stopped learning in the whole run: this segment's own; the earlier segments' that had
    no gradient in this one either (their first stop step kept); and slices that learned before the resume
    and had no gradient since (`silent`: stopped at the resume, since a dead unit stays dead across a
    restart). Slices never updated in the earlier segments stay `partly_updated`'s."""
    out = list(report.stopped_slices)
    never_now = {r.name for r in report.never_updated}
    quiet_now = _by_slice(silent)
    covered = _by_slice(earlier.partly_updated)
    for s in earlier.stopped_slices:
        key = (s.name, s.dim)
        quiet = set(s.indices) if s.name in never_now else set(s.indices) & quiet_now.get(key, set())
        if quiet:
            out.append(cut(s, quiet))
            covered.setdefault(key, set()).update(quiet)
    never_before = {r.name for r in earlier.never_updated}
    for s in silent:
        fresh = set(s.indices) - covered.get((s.name, s.dim), set())
        if fresh and s.name not in never_before:
            out.append(cut(s, fresh))
    return out


def _by_slice(records: Sequence[PartlyUpdated | StoppedSlice]) -> dict[tuple[str, int | None], set[int]]:
    """The indices the records name, by (tensor, dim)."""
    out: dict[tuple[str, int | None], set[int]] = {}
    for r in records:
        out.setdefault((r.name, r.dim), set()).update(r.indices)
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
    """The earlier TensorBoard run in `log_dir`, or why there is none to continue (a sentence for the warning)."""
    run_id, count = run_id_of(log_dir)
    if run_id is None:
        return f"{log_dir!r} holds no gradlog run"
    if count > 1:
        return f"{log_dir!r} holds {count} gradlog runs already (not one to continue)"
    return _read_earlier(lambda: read_folder(log_dir), log_dir, run_id)


def find_earlier_wandb(log_dir: str) -> Earlier | str:
    """The earlier W&B run under `log_dir` (its `wandb/` folder: every segment of it, grouped by run id), or
    why there is none to continue."""
    folder = os.path.join(log_dir, "wandb")
    runs = runs_in(folder)
    if not runs:
        return f"{log_dir!r} holds no W&B run"
    if len(runs) > 1:
        return f"{folder!r} holds {len(runs)} W&B runs already (not one to continue)"
    ((run_id, files),) = runs.items()
    return _read_earlier(lambda: read_segments(files, folder), log_dir, run_id)


def _read_earlier(read: Callable[[], RunData], log_dir: str, run_id: str) -> Earlier | str:
    """The earlier run's report, segment count and `gradlog/segment` table, as `read` returns the run.

    The earlier run's files are read at `GradLogger()`, inside the training script: damage there (a cell no
    reader expected, an overflow) must cost the continuation, never the run, so whatever the reading raises
    becomes the reason a new run starts (the caller warns once)."""
    try:
        return _earlier_from(read(), log_dir, run_id)
    except BadRun as exc:
        return f"{log_dir!r} cannot be read as one gradlog run ({exc})"
    except Exception as exc:  # a damaged run file: a new run starts beside it, with the reason said
        return f"the run in {log_dir!r} cannot be read ({type(exc).__name__}: {exc})"


def _earlier_from(run: RunData, log_dir: str, run_id: str) -> Earlier | str:
    """`_read_earlier` on the run read back."""
    report = closed_report(run)
    table = run.tables.get(names.SEGMENT)
    if report is None or table is None:
        return f"the run in {log_dir!r} wrote no gradlog/segment table (it was killed before its first table)"
    summary = run.summary()
    if whole_number(summary.get("optimizer_steps", "")) is None:  # not written yet, or damaged
        report.optimizer_steps = _steps_taken(run)
    segment = whole_number(summary.get("segment", ""))
    segments = segment if segment is not None and segment >= 0 else 1
    try:
        shapes, last, counts = _segment_table(*table)
    except ValueError as exc:
        return f"the run in {log_dir!r} has an unreadable gradlog/segment table ({exc})"
    return Earlier(log_dir, run_id, report, segments, shapes, last, counts)


def _steps_taken(run: RunData) -> int:
    """The earlier run's optimizer steps when its summary does not say (it never closed, or the cell is
    damaged: 10**30 would overflow every event step of this segment): as of its provisional tables, else
    one past its last measured step."""
    if run.provisional_step is not None:
        return run.provisional_step + 1
    steps = series_steps(run)
    return max(steps) + 1 if steps else 0


def _segment_table(
    columns: list[str], rows: list[list[str]]
) -> tuple[dict[str, tuple[int, ...]], dict[str, int], dict[str, Evidence]]:
    """`gradlog/segment`'s shapes, last measured updates and counters, by tensor name."""
    shapes: dict[str, tuple[int, ...]] = {}
    last: dict[str, int] = {}
    counts: dict[str, Evidence] = {}
    for cells in table_cells((columns, rows), names.SEGMENT_COLUMNS):
        shape = parse_shape(cells["shape"])
        if shape is None or not cells["name"]:
            continue
        shapes[cells["name"]] = shape
        step = whole_number(cells["last_update_step"])
        last[cells["name"]] = step if step is not None else -1
        counts[cells["name"]] = _counts(cells)
    return shapes, last, counts


@dataclass
class Continuation:
    """This process's segment of the run and, when it continues an earlier run, that run's segments:
    what the logger writes with every report (`rows`) and how its report is judged (`merge`)."""

    segment: Segment
    earlier: Earlier | None = None

    def rows(self, tracked: list[Tracked], evidence: dict[int, Evidence]) -> tuple[list[list[str]], list[list[str]]]:
        """(summary rows, `gradlog/segment` rows): what a later segment reads back."""
        return self.segment.summary_rows(), Segment.rows(tracked, evidence, self.earlier)

    def whole_run(self, tracked: list[Tracked], evidence: dict[int, Evidence]) -> dict[int, Evidence]:
        """`evidence` (this segment's, by tensor index) with every tensor's counters summed over the run,
        where the earlier segments wrote theirs: what a record that speaks for the whole run is built from
        (a slice never updated in any segment, updates rounded away). The others keep this segment's."""
        if self.earlier is None:
            return evidence
        out = dict(evidence)
        for r in tracked:
            ev = evidence.get(r.index)
            if ev is not None:
                out[r.index] = self.earlier.whole(r.name, ev)
        return out

    def never_evidence(self, tracked: list[Tracked], evidence: dict[int, Evidence]) -> dict[int, Evidence]:
        """The evidence the never-updated diagnosis judges with: the whole run's for tensors the earlier
        segments never updated (a record of theirs is the whole run's: `Earlier.merge` keeps it), this
        segment's for the others (one updated before the resume and not since has stalled, and its
        record speaks of the measured steps since the resume, as `Earlier.merge` says)."""
        if self.earlier is None:
            return evidence
        before = {r.name for r in self.earlier.report.never_updated}
        whole = self.whole_run([r for r in tracked if r.name in before], evidence)
        return whole

    def never_anywhere(self, names: set[str]) -> set[str]:
        """Of the tensors this segment never updated (`names`), those no earlier segment did either (or
        that it did not track): never updated in the whole run, the tensors whose slices are not judged."""
        if self.earlier is None:
            return names
        before = {r.name for r in self.earlier.report.never_updated}
        return {n for n in names if n in before or n not in self.earlier.shapes}

    def fold_slices(self, tracked: list[Tracked], facts: dict[int, SliceFacts]) -> dict[int, SliceFacts]:
        """This segment's slice facts with the earlier segments' folded in, so that the partly-updated
        records are built once for the whole run: a slice changed if it changed in any segment, and had a
        non-zero gradient if any segment saw one. The earlier segments' come from their records: a slice
        in none of them changed; one in a partly-updated record, or of a never-updated tensor, did not, and
        had a gradient only where that record's reason says so (rounded away). A slice that moved only
        through weight decay before the resume is taken for unchanged there (its record does not say
        which of its slices did)."""
        if self.earlier is None:
            return facts
        report = self.earlier.report
        never = {r.name: r for r in report.never_updated}
        partly: dict[tuple[str, int | None], list[PartlyUpdated]] = {}
        for p in report.partly_updated:
            partly.setdefault((p.name, p.dim), []).append(p)
        out = dict(facts)
        for r in tracked:
            f = facts.get(r.index)
            if f is not None and r.name in self.earlier.shapes:  # a tensor new in this segment has no past
                out[r.index] = _folded(f, never.get(r.name), [partly.get((r.name, d), []) for d in f.changed])
        return out

    def set_back_before(self) -> set[str]:
        """The tensors the earlier segments found set back outside the optimizer (never updated or stalled,
        `overwritten`): a segment that cannot prove it again keeps the finding unless an update stayed
        (`gradlog.verdict.overwritten.resumed_set_back`)."""
        if self.earlier is None:
            return set()
        report = self.earlier.report
        never = {r.name for r in report.never_updated if r.reason is Reason.OVERWRITTEN}
        return never | {s.name for s in report.stalled if s.reason is Reason.OVERWRITTEN}

    @property
    def resumed_after(self) -> int | None:
        """The earlier segments' last step (what `Pipeline.diagnose` counts this segment's silent slices
        from), or None for a run that continues nothing."""
        return self.segment.first_step - 1 if self.earlier is not None else None

    def merge(self, report: Report, tracked: list[Tracked], silent: list[StoppedSlice]) -> Report:
        """`report`'s records judged over every segment of the run (itself when there is no earlier one);
        `silent`: this segment's slices with no gradient (`Pipeline.diagnose` with `resumed_after`). The
        Experts table and the hint are derived from the merged records afterwards (`Pipeline.diagnose`):
        they hold no evidence of their own, so the earlier segments' are not read."""
        if self.earlier is None:
            return report
        return self.earlier.merge(report, self.segment.first_step, {r.name for r in tracked}, silent)


def open_run(
    out: Output, log_dir: str | None, strict: bool, options: dict[str, Any], pipeline: Pipeline, new_id: str
) -> tuple[list[Writer], Continuation | None]:
    """The writers (rank 0's; none elsewhere) and the run they write: a new one, or with `out.resume` the
    earlier run they continue. A W&B run to continue is found before `wandb.init`, which then gets its id;
    the step count goes on from the earlier run's (on every rank under FSDP2/DTensor, see `share`)."""
    tracked, optimizer = pipeline.table.live, pipeline.optimizer
    writers: list[Writer] = []
    run = None
    if pipeline.rank_zero:  # the writers, and the options they get, are rank 0's alone
        names = writer_names(out.writer)
        routed = route_options(names, options)  # one dict per writer name
        wandb_dir = routed.get("wandb", {}).get("dir", log_dir)  # wandb.init(dir=...) in the options wins
        wandb = wandb_earlier(out.resume, names, wandb_dir, tracked, optimizer)
        if wandb is not None:  # continue the earlier W&B run under its id
            routed["wandb"] = {**routed["wandb"], "id": wandb.run_id, "resume": "allow"}
        writers = make_writers(out.writer, log_dir, strict, **routed)
        run = start(out.resume, writers, tracked, optimizer, new_id, wandb)
    if out.resume is not False and pipeline.rank_local():  # FSDP2/DTensor: every rank counts on alike
        run = share(run)
    if run is not None and run.earlier is not None:
        pipeline.start_at(run.segment.first_step)
    return writers, run


def wandb_earlier(
    resume: Resume,
    names: list[str],
    log_dir: str | None,
    tracked: list[Tracked],
    optimizer: torch.optim.Optimizer | None,
) -> Earlier | None:
    """Before the writers start: with `resume` and a W&B writer, the W&B run in `log_dir` to continue (its id
    then goes to `wandb.init(id=..., resume="allow")`), or None. Why not is said here unless a TensorBoard
    writer holds the run too (that one's check says it). `names`: the writer names in `writer=`."""
    if resume is False or "wandb" not in names:
        return None
    said = "tensorboard" not in names
    if log_dir is None:
        if said:
            warn(
                f"gradlog: resume={resume!r} with W&B needs log_dir= (the folder that holds the run); a new run starts"
            )
        return None
    found = find_earlier_wandb(log_dir)
    why = _not_continued(found, resume, tracked, optimizer, log_dir)
    if why is not None or isinstance(found, str):
        if why and said:
            warn(why)
        return None
    return found


def start(
    resume: Resume,
    writers: list[Writer],
    tracked: list[Tracked],
    optimizer: torch.optim.Optimizer | None,
    new_id: str,
    wandb: Earlier | None = None,
) -> Continuation:
    """This run's id (its TensorBoard file mark, else its W&B run id, else `new_id`), and with `resume` the
    earlier run it continues: its id, its step count, its evidence (merged at close). The TensorBoard
    writer's folder holds the run where there is one; else the W&B run `wandb` found (`wandb_earlier`). The
    writers are told apart by what they declare (`Writer.resume_dir`, `Writer.run_id`), not by class. A
    run that cannot be continued (none there, another model's) is said once and a new run starts beside it;
    nothing is overwritten."""
    tb = next((w for w in writers if w.resume_dir is not None), None)  # continues from its files
    wb = next((w for w in writers if w.resume_dir is None and w.run_id is not None), None)  # by its run's id
    wb_id = (wb.run_id if wb is not None else None) or ""
    fresh = Continuation(Segment((tb.run_id if tb is not None else None) or wb_id or new_id))
    if resume is False:
        return fresh
    said = f"resume={resume!r}"
    if tb is None and wb is None:
        warn(f"gradlog: {said} needs a TensorBoard or W&B writer (its folder holds the run); a new run starts")
        return fresh
    if tb is None:
        if wandb is not None and wb_id != wandb.run_id:
            warn(
                f"gradlog: {said}: gradlog logs into the active W&B run {wb_id!r}, not the earlier run "
                f"{wandb.run_id!r}; start it with wandb.init(id={wandb.run_id!r}, resume='allow'), or let gradlog "
                "start the run, to continue it; a new run starts"
            )
            return fresh
        return _continued(wandb, optimizer) if wandb is not None else fresh
    folder = tb.resume_dir or ""
    found = find_earlier(folder) if os.path.isdir(folder) else f"{folder!r} does not exist"
    why = _not_continued(found, resume, tracked, optimizer, folder)
    if why is not None or isinstance(found, str):
        if why:
            warn(why)
        return fresh
    tb.continue_run(found.run_id)
    if wb is not None and wandb is None:  # the two writers disagree: say so rather than split the run silently
        warn(
            f"gradlog: {said}: the TensorBoard run in {folder!r} continues, but no W&B run of it was found "
            f"to continue (none, or another, in the W&B dir); W&B logs into a new run {wb_id!r}"
        )
    return _continued(found, optimizer)


def share(continuation: Continuation | None) -> Continuation | None:
    """Rank 0's continuation on every rank (a broadcast; rank 0 alone reads the earlier segment and owns the
    writers). Under sharded parameters (FSDP2/DTensor) every rank must count its steps on from the same step
    (gradlog's collectives compare the measured step) and judge over the same segments, so that `close()`
    returns the same report on every rank. Every rank creates its logger there, so every rank meets here."""
    box: list[Any] = [continuation]
    torch.distributed.broadcast_object_list(box, src=0)
    shared: Continuation | None = box[0]
    return shared


def _continued(found: Earlier, optimizer: torch.optim.Optimizer | None) -> Continuation:
    """The segment that continues `found`: from the checkpoint's own step count where the optimizer keeps
    one (Adam's "step": a job preempted some steps after its last checkpoint redoes them, and the x-axis
    should say so), else from the earlier segments' last step."""
    first = checkpoint_step(optimizer)
    first = found.end_step if first is None else first
    logger.info("gradlog: continuing the run in %s from step %d", found.log_dir, first)
    return Continuation(Segment(found.run_id, found.segments + 1, first), found)


def _not_continued(
    found: Earlier | str, resume: Resume, tracked: list[Tracked], optimizer: torch.optim.Optimizer | None, where: str
) -> str | None:
    """Why the run found in `where` is not continued (a warning; "" for a first start under "auto",
    the normal case, not worth a word), or None when it is."""
    said = f"resume={resume!r}"
    if isinstance(found, str):
        return f"gradlog: {said}: {found}; nothing to continue, a new run starts" if resume is True else ""
    why = found.mismatch(tracked)
    if why is not None:
        return (
            f"gradlog: {said}: the run in {where!r} is of another model ({why}); a new run starts "
            "beside it (pass another log_dir to keep them apart)"
        )
    if resume == "auto" and (optimizer is None or not optimizer.state):
        return (
            f"gradlog: resume='auto': {where!r} holds a run of this model, but the optimizer's state "
            "was not loaded from a checkpoint, so this is taken for a new run (written beside it); pass "
            "resume=True to continue it"
        )
    return None
