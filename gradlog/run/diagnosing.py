"""The diagnosis: what the evidence a run measured says at close (or in a provisional table) about every tensor.

`Diagnosis` reads the parts the measuring side keeps (`run.measuring.Pipeline`: the parameter table, the
meter, the ledger, the AMP state, the alerts) and builds the `Report`: one small step per kind of record that
the others build on (never updated, partly updated, stalled, stopped slices), then the detector of every
other registered kind (`Record.detect`, in `FINDINGS`' order: rounded-away updates, and any kind added
later), then, for a resumed run, the merge with the earlier segments, then what the records say together
(the Experts table and the hint).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch

from gradlog.measure.amp import AmpState
from gradlog.measure.meter import Meter
from gradlog.measure.owners import Owners
from gradlog.measure.params import ParamTable, Tracked
from gradlog.measure.writes import WriteWatch
from gradlog.verdict.alerts import Alerts
from gradlog.verdict.diagnosis import diagnose, run_hint
from gradlog.verdict.experts import expert_layout, idle_experts
from gradlog.verdict.knobs import explain_filtered, explain_left_out, explain_lr
from gradlog.verdict.ledger import Evidence, Ledger
from gradlog.verdict.overwritten import overwritten, pruned_whole
from gradlog.verdict.policy import Policy
from gradlog.verdict.records import FINDINGS, Case, Record
from gradlog.verdict.report import NeverUpdated, PartlyUpdated, Report, Stalled, StoppedSlice
from gradlog.verdict.slices import SliceFacts, global_facts, partly_updated, slice_facts
from gradlog.verdict.stalled import stalled
from gradlog.verdict.stopped_slices import global_last_steps, last_steps, silent_slices, stopped_slices

__all__ = ["Diagnosis", "Segments"]


class Segments(Protocol):
    """The earlier segments a resumed run continues (`gradlog.run.resume.Continuation`), as the diagnosis
    needs them: declared here so that the diagnosis does not import the resume module that drives it."""

    @property
    def resumed_after(self) -> int | None: ...

    def merge(self, report: Report, tracked: list[Tracked], silent: list[StoppedSlice]) -> Report: ...

    def never_evidence(self, tracked: list[Tracked], evidence: dict[int, Evidence]) -> dict[int, Evidence]: ...

    def whole_run(self, tracked: list[Tracked], evidence: dict[int, Evidence]) -> dict[int, Evidence]: ...

    def fold_slices(self, tracked: list[Tracked], facts: dict[int, SliceFacts]) -> dict[int, SliceFacts]: ...

    def never_anywhere(self, names: set[str]) -> set[str]: ...

    def set_back_before(self) -> set[str]: ...


@dataclass
class Diagnosis:
    """One diagnosis of the evidence so far. `steps`: the run's optimizer steps (log() calls without an
    optimizer). `collective`: under sharded parameters, meet the other ranks so that a tensor changed if any
    of its shards did (False: this rank's own answer). `reuse`: tensors the evidence already answers for
    (frozen ones, ones never written in place) are not fingerprinted again (`Ledger.changed`), as for
    provisional tables. `segments`: a resumed run's earlier segments, which the records that speak for the
    whole run are built from (`Segments.never_evidence`, `whole_run`, `fold_slices`) and merged with."""

    table: ParamTable
    meter: Meter
    ledger: Ledger
    amp: AmpState
    alerts: Alerts | None
    with_optimizer: bool
    steps: int
    optimizer: torch.optim.Optimizer | None
    policy: Policy
    collective: bool = True
    reuse: bool = False
    segments: Segments | None = None
    writes: WriteWatch | None = None  # where flagged tensors were written outside the optimizer, where seen

    def report(self) -> Report:
        """The records (`records`), of a resumed run merged with the earlier segments' (`Segments.merge`),
        then what is derived from the records alone, the Experts table and the hint (`derived`): so that
        these span the segments too. The slices and experts are named after their owning modules as the
        table describes them (`ParamTable.owners`): the model's, or when it was garbage-collected (the logger
        closing itself), the description kept from when it was there."""
        after = self.segments.resumed_after if self.segments is not None else None
        owners = self.table.owners()
        report, silent = self.records(owners, after)
        if self.segments is not None:
            report = self.segments.merge(report, self.table.live, silent)
        return self.derived(report, owners, None if after is None else after + 1)

    def records(self, owners: Owners, resumed_after: int | None) -> tuple[Report, list[StoppedSlice]]:
        """This segment's records (no Experts table, no hint yet), and with `resumed_after` (a resumed run:
        the earlier segments' last step) its slices with no gradient in it while their tensor had one, as
        stopped right after that step (`verdict.stopped_slices.silent_slices`; the resume merge keeps those
        that learned before)."""
        rows = self.table.live
        changed = self._changed(rows)
        self._count_skipped()
        evidence, spanning = self._evidence(rows)
        earlier = self.segments.set_back_before() if self.segments is not None else set()
        set_back, set_back_stalled = overwritten(
            rows,
            spanning,
            self.ledger.back_to_start,
            self.ledger.set_back,
            earlier,
            self.ledger.evidence,
            self._sites(),
            self.ledger.returns,
        )
        pruned = pruned_whole(rows, self.ledger.back_to_start, self.ledger.set_back, self._learned(), self._sites())
        never = diagnose(
            rows,
            evidence,
            changed,
            self.with_optimizer,
            skipped_steps=self.ledger.skipped_steps,
            overwritten={k: v for k, v in set_back.items() if k not in pruned},
            pruned=pruned,
        )
        partly = self._partly(rows, never, spanning, owners)
        stopped = self._stalled(rows, never, set_back_stalled)
        never, stopped, partly = self._knobs(rows, never, stopped, partly)
        whole = {r.name for r in never} | {r.name for r in stopped}
        slices, silent = self._slices_in_time(owners, whole, resumed_after)
        report = Report(
            never_updated=never,
            partly_updated=partly,
            stalled=stopped,
            stopped_slices=slices,
            alerts=self.alerts.settled() if self.alerts is not None else [],
            first_nonfinite=self.ledger.first_nonfinite,
            optimizer_steps=self.steps,
            measured_steps=self.ledger.measured_steps,
            skipped_steps=self.ledger.skipped_steps,
            tracked_tensors=len(rows),
            policy=self.policy,
            update_rotation=self.meter.rotation,
        )
        return report.with_records(self._detected(rows, spanning, report)), silent

    def _detected(
        self, rows: list[Tracked], spanning: dict[int, Evidence], report: Report
    ) -> dict[type[Record], list[Record]]:
        """The records of every registered kind with a detector of its own (`Record.detect`), from the whole
        run's evidence, each told what the steps above found."""
        found = {kind.KIND: report.records(kind) for kind in FINDINGS}
        case = Case(rows, spanning, self.steps, self.ledger.measured_steps, found)
        out: dict[type[Record], list[Record]] = {}
        for kind in FINDINGS:
            records = kind.detect(case)
            if records is not None:
                out[kind] = list(records)
        return out

    def _sharded(self, rows: list[Tracked]) -> bool:
        """Whether this diagnosis meets the other ranks: collective, and the tensors are sharded."""
        reducer = self.meter.reducer
        return self.collective and reducer is not None and reducer.active(rows)

    def _changed(self, rows: list[Tracked]) -> dict[int, bool]:
        """Which tensors changed since the start (by fingerprint); under sharded parameters a tensor changed
        if any of its shards did (a collective)."""
        changed = self.ledger.changed(rows, provisional=self.reuse)
        reducer = self.meter.reducer
        if self._sharded(rows) and reducer is not None:
            return reducer.changed(rows, changed)
        if self.collective and reducer is not None and reducer.used:
            reducer.warn_local()
        return changed

    def _count_skipped(self) -> None:
        """The AMP steps skipped so far, as the scaler counted them (it may know of more than gradlog saw)."""
        skipped = self.amp.final_count()
        if skipped is not None:
            self.ledger.skipped_steps = max(self.ledger.skipped_steps, skipped)

    def _evidence(self, rows: list[Tracked]) -> tuple[dict[int, Evidence], dict[int, Evidence]]:
        """(the evidence the never-updated diagnosis judges with, the whole run's evidence where records speak
        for all of it): this segment's both, unless a resumed run adds the earlier segments'."""
        evidence = spanning = self.ledger.evidence
        if self.segments is not None:
            evidence = self.segments.never_evidence(rows, spanning)
            spanning = self.segments.whole_run(rows, spanning)
        return evidence, spanning

    def _partly(
        self, rows: list[Tracked], never: list[NeverUpdated], spanning: dict[int, Evidence], owners: Owners
    ) -> list[PartlyUpdated]:
        """Tensors some of whose slices never changed; the never-updated tensors' slices are not judged."""
        facts = slice_facts(
            rows, self.ledger.slice_changes, self.meter.slice_grads, self.optimizer, self.meter.slice_moves
        )
        reducer = self.meter.reducer
        if self._sharded(rows) and reducer is not None:  # shards' slices at global indices
            facts = global_facts(rows, facts, reducer)
        unjudged = {r.name for r in never}
        if self.segments is not None:
            facts, unjudged = self.segments.fold_slices(rows, facts), self.segments.never_anywhere(unjudged)
        return partly_updated(
            rows, facts, spanning, unjudged, owners, self.optimizer, self.steps, self._sites(), self._between()
        )

    def _learned(self) -> set[int]:
        """The tensors back where they started at close that kept an optimizer update from one watched step to
        the next (`SliceMoves.kept`): they learned before they were set back."""
        moves = self.meter.slice_moves
        out = set()
        for index in self.ledger.back_to_start:
            kept = moves.kept(index, 0)
            if kept is not None and bool(kept.any()):
                out.add(index)
        return out

    def _sites(self) -> dict[int, str]:
        """Where each flagged tensor was written outside the optimizer, where the write watch saw it."""
        return self.writes.words() if self.writes is not None else {}

    def _between(self) -> dict[int, tuple[int, int]]:
        """Per tensor, two steps between which it was written outside the optimizer: the first two consecutive
        measured steps that show it (the ledger's), else the optimizer step after which the write watch saw it."""
        out = {index: (k, k + 1) for index, k in self.writes.after.items()} if self.writes is not None else {}
        out.update(self.ledger.written_between)
        return out

    def _stalled(self, rows: list[Tracked], never: list[NeverUpdated], set_back: list[Stalled]) -> list[Stalled]:
        """Tensors that learned and then stopped, and those set back to a value they held before (not
        already reported), in model order."""
        ledger = self.ledger
        names = {r.name for r in never}
        stopped = stalled(
            rows, ledger.evidence, ledger.steps, ledger.measured_steps, self.with_optimizer, exclude=names
        )
        reported = names | {r.name for r in stopped}
        return _in_model_order(rows, stopped, [s for s in set_back if s.name not in reported])

    def _knobs(
        self, rows: list[Tracked], never: list[NeverUpdated], stopped: list[Stalled], partly: list[PartlyUpdated]
    ) -> tuple[list[NeverUpdated], list[Stalled], list[PartlyUpdated]]:
        """The records with the knob behind them named (`verdict.knobs`): the scheduler that set their group's lr
        to 0 or far below its start, the other optimizer that holds a tensor left out of this one."""
        opt = self.optimizer
        if opt is None:
            return never, stopped, partly
        groups = {r.name: r.group for r in rows}
        params = {r.name: p for r in rows if (p := r.held()) is not None}
        never = explain_filtered(explain_left_out(explain_lr(never, groups, opt, self.steps), params, opt), groups)
        return never, explain_lr(stopped, groups, opt, self.steps), explain_lr(partly, groups, opt, self.steps)

    def _slices_in_time(
        self, owners: Owners, whole: set[str], resumed_after: int | None
    ) -> tuple[list[StoppedSlice], list[StoppedSlice]]:
        """Slices that stopped learning (not of the `whole` tensors already reported), and with
        `resumed_after` the ones silent in this segment (`report`), from one set of last-step vectors
        (global ones under sharded parameters: a collective)."""
        rows, ledger, reducer = self.table.live, self.ledger, self.meter.reducer
        lasts = last_steps(rows, self.meter.slice_grads)
        if self._sharded(rows) and reducer is not None:  # shards' slices at global indices
            lasts = global_last_steps(rows, lasts, reducer)
        slices = stopped_slices(rows, lasts, ledger.steps, ledger.measured_steps, owners, exclude=whole)
        if resumed_after is None:
            return slices, []
        return slices, silent_slices(rows, lasts, ledger.steps, ledger.measured_steps, owners, resumed_after)

    def derived(self, report: Report, owners: Owners, resumed_at: int | None) -> Report:
        """`report` with what its records say together: the Experts table (`verdict.experts`) and the hint
        (`verdict.diagnosis.run_hint`; `resumed_at`: a resumed run's first step, whose merged records
        hold tensors stalled from it)."""
        rows = self.table.live
        layout, r = expert_layout(owners, rows), report
        experts = idle_experts(layout, r.never_updated, r.partly_updated, r.stalled, r.stopped_slices)
        hint = run_hint(rows, r.never_updated, self.with_optimizer, r.stalled, resumed_at)
        return replace(report, experts=experts, hint=hint)


def _in_model_order(rows: list[Tracked], *parts: list[Stalled]) -> list[Stalled]:
    """Stalled records of several sources, one list in model order."""
    order = {r.name: k for k, r in enumerate(rows)}
    return sorted((s for part in parts for s in part), key=lambda s: order.get(s.name, len(order)))
