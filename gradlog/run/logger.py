"""`GradLogger`: the one object a user creates. It wires hooks -> meter -> writers and ledger -> report."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
import weakref
from typing import Any

import torch
from torch import nn

import gradlog.run.lifecycle as lifecycle
from gradlog.measure.amp import AmpState
from gradlog.measure.distributed import is_rank_zero
from gradlog.measure.engines import attach
from gradlog.measure.meter import Measurement, Meter
from gradlog.measure.optimizers import steppable
from gradlog.measure.params import NameFilter, ParamTable, Selection
from gradlog.measure.trace import OnceTrace, PaddingWatch, PassWatch, starved
from gradlog.run.lifecycle import clip_grad_norm_, close, log
from gradlog.run.measuring import IDLE_LOG_CALLS, Pipeline
from gradlog.run.options import (
    AlertOptions,
    HistogramOptions,
    Options,
    Output,
    alert_options,
    check_budget,
    check_every,
    histogram_options,
    output,
    spelled,
    whole_step,
    writer_options,
)
from gradlog.run.publishing import Failures, Publisher
from gradlog.run.resume import Continuation, open_run
from gradlog.verdict.accumulation import AccumulationCleared, from_passes
from gradlog.verdict.alerts import Alerts
from gradlog.verdict.judge import plural
from gradlog.verdict.knobs import explain_padding
from gradlog.verdict.ledger import Ledger
from gradlog.verdict.located import locate, not_registered, remade, traced_hint
from gradlog.verdict.policy import Policy, PolicyLike
from gradlog.verdict.report import Reason, Report
from gradlog.writers import WriterSpec
from gradlog.writers.guard import GuardedWriters
from gradlog.writers.overview import Overview

__all__ = ["DEFAULT_EVERY", "IDLE_LOG_CALLS", "GradLogger", "clip_grad_norm_", "close", "log", "watch"]

DEFAULT_EVERY = 50


class GradLogger:
    """Measures gradients and updates every `every` optimizer steps and names the tensors that never learned.

    When a step is measured: inside the optimizer's step hooks, counting optimizer steps from 0.
    Step k is measured when ``k % every == 0`` (so the first step always is). The pre-hook reads
    the gradients the optimizer is about to use and snapshots the weights; the post-hook measures
    the update it really applied. Where you call ``zero_grad()``, and how many backward passes
    make one step, therefore does not matter.

    When it is written: ``log(step)`` publishes the latest measurement not yet published, at x-axis
    value ``step`` (default: the 0-based index of the measured optimizer step). Calling ``log`` more
    often than measurements happen (every micro-batch, say) is cheap and publishes nothing new.

    Without an optimizer (``optimizer=None``) gradients are measured inside ``log()`` itself, on
    every ``every``-th call, and no update can be measured.

    Which tensors: every parameter of the model and of the optimizer, or those whose name matches
    ``include`` (globs such as ``"encoder.*"``, a list of them, or a callable on the name) and not
    ``exclude``. Unwatched tensors are not measured, written or diagnosed.

    Where it goes: ``writer`` (default ``"tensorboard"``, into ``log_dir``, by default a new
    ``runs/<timestamp>-<host>`` folder per logger), a `Writer`, a list of either, or a
    `gradlog.Output` that adds the writer options, its timeout, provisional tables, SIGTERM
    handling and strict mode.

    What is measured: every measured step, per tensor, the gradient norm, NaN/Inf count, weight
    norm and update ratio, and run-level series (``gradlog/no_update_tensors``, ...); histograms of
    gradients, weights and updates and the overview image (the update-ratio heatmap, drawn in the
    background, at most one per 20 s) on histogram steps (``histograms=True``, or a
    `gradlog.HistogramOptions` for their period, kinds, bins, zero counting and the overview image).

    Alerts during training (``alerts=True``, or a `gradlog.AlertOptions` with their thresholds): a
    NaN/Inf gradient, a gradient-norm spike, an update ratio out of its band, a tensor with no gradient.

    Memory: to measure the update, a measured step copies the weights it measures the update of, at most
    ``snapshot_budget`` bytes of them (``"auto"``: 10% of the trainable weights' bytes, or 64 MB where that is
    more); the others' updates are measured on the next measured steps, in rotation (docs/configuration.md).
    Whether a tensor changed stays exact on every measured step. None: every tensor on every measured step.

    Unmeasured steps cost one counter increment. ``close()`` removes every hook, writes the
    never-updated table and returns a `Report`; it also runs at interpreter exit if forgotten, on
    SIGTERM, and when the model is garbage-collected.

    Nothing lost: on histogram steps, at most every ``Output.provisional_every`` seconds, the tables
    as of that step are written as ``gradlog/provisional/...`` (what a ``kill -9`` leaves). A writer
    slower than ``Output.timeout`` seconds per call has its records dropped and counted (``dropped``).

    With a GradScaler and a non-fused optimizer pass ``scaler=`` so that skipped steps are counted.
    Under FSDP2/DTensor every rank must create, step, ``log()`` and ``close()`` alike: gradlog's
    collectives run there (a gloo rank waiting over ``Output.sync_timeout`` seconds raises).
    """

    @spelled
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        writer: WriterSpec | Output = "tensorboard",
        every: int = DEFAULT_EVERY,
        *,
        log_dir: str | None = None,
        include: NameFilter = None,
        exclude: NameFilter = None,
        histograms: bool | HistogramOptions = True,
        alerts: bool | AlertOptions = True,
        scaler: Any = None,
        print_report: bool = True,
        policy: PolicyLike = None,
        snapshot_budget: int | str | None = "auto",
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}; pass the module you train")
        # DeepSpeed ZeRO-1/2: the engine's module and a view of its optimizer; ZeRO-3, FSDP1, pipelines: refused
        model, optimizer, zero = attach(model, optimizer)
        if next(iter(model.parameters()), None) is None:
            raise ValueError(
                f"model {type(model).__name__} has no parameters, so gradlog has nothing to watch; pass the module "
                "you train (the one whose parameters the optimizer holds), not a parameter-free part of it"
            )
        if optimizer is not None:
            optimizer = steppable(optimizer)  # a wrapper's (accelerate, Lightning) inner optimizer
        every = check_every(every)
        hist, alert, out = histogram_options(histograms), alert_options(alerts), output(writer)
        self.options = Options(hist, alert, out, check_budget(snapshot_budget))
        log_dir, options, wstrict = writer_options(out, log_dir)
        self._model = weakref.ref(model)  # weak: a logger never keeps a model (and its weights) alive
        self.print_report = print_report
        self.policy = Policy.coerce(policy)  # how much each kind of finding matters (gradlog/verdict/policy.py)
        self.handle_signals = out.handle_signals
        self.strict = out.strict
        self.failures = Failures(out.strict)
        self.rank_zero = is_rank_zero()
        selection = Selection(include, exclude)
        with zero.shown() if zero is not None else contextlib.nullcontext():  # ZeRO-3: each rank's part
            self.pipeline = Pipeline(
                model, optimizer, every, self.options, scaler, selection, self.failures, self.rank_zero
            )
        self._zero = zero
        if zero is not None:
            zero.connect(self.pipeline.measures_next, self.pipeline.meter.reducer, lambda: self.pipeline.steps)
        #: this run's segment, and the earlier segments it continues (gradlog/run/resume.py); None off rank 0
        self.segments: Continuation | None
        try:
            run_id = f"{os.getpid()}-{id(self)}"
            writers, self.segments = open_run(out, log_dir, wstrict, options, self.pipeline, run_id)
        except BaseException:
            # a bad writer name or log_dir: the pipeline's hooks go with the logger that never was (its global
            # pre-hook would otherwise run at every optimizer step in the process, holding the model alive)
            self.pipeline.detach()
            raise
        self.writers = GuardedWriters(writers, strict=out.strict, timeout=out.timeout)
        segs = self.segments
        rows = (lambda: segs.rows(self.table.live, self.ledger.evidence)) if segs is not None else None
        self.overview = Overview(hist.overview_every)
        self.publisher = Publisher(self.writers, self.overview, out.provisional_every, self.failures, rows)
        self._last_index = -1
        self._logged = False  # log() was called at least once (close() warns when measurements never went out)
        self._report: Report | None = None
        #: "file:line" of the user's constructor call, named when a later logger replaces this one
        self.made_at = lifecycle.caller()
        lifecycle.replace_earlier(self, model, optimizer)
        self._registration = lifecycle.register(self, model)
        #: one step traced for the report's causes: the cut's line, tensors outside the model (issue 39)
        self._once = OnceTrace(model, optimizer)
        #: how the first batch used each embedding's padding_idx (a real token as padding: bugs3)
        self._padding = PaddingWatch(model)
        #: the first optimizer step's backward() passes, for gradients cleared between them (bugs3)
        self._passes: PassWatch | None = None
        if optimizer is not None:
            with contextlib.suppress(Exception):  # advice: a tensor that takes no hook leaves the run unwatched
                self._passes = PassWatch(optimizer, self.pipeline.steps)
        if zero is not None:
            self._once.disable()
            if self._passes is not None:  # ZeRO moves the gradients between backward() and step() too
                self._passes.close()
                self._passes = None

    # --- what the pipeline holds, for reading (tests, integrations, the curious) -------------------
    @property
    def every(self) -> int:
        """Measure every k-th optimizer step."""
        return self.pipeline.every

    @property
    def histogram_every(self) -> int:
        """Histograms every k-th optimizer step (0: none)."""
        return self.pipeline.histogram_every

    @property
    def count_zeros(self) -> bool | None:
        """`HistogramOptions.count_zeros`."""
        return self.pipeline.count_zeros

    @property
    def table(self) -> ParamTable:
        """The watched tensors."""
        return self.pipeline.table

    @property
    def meter(self) -> Meter:
        """The device statistics of a measured step."""
        return self.pipeline.meter

    @property
    def ledger(self) -> Ledger:
        """The evidence kept across measured steps."""
        return self.pipeline.ledger

    @property
    def alerts(self) -> Alerts | None:
        """The alerts raised so far (None with alerts=False)."""
        return self.pipeline.alerts

    @property
    def amp(self) -> AmpState:
        """GradScaler and skipped-step state."""
        return self.pipeline.amp

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps seen so far."""
        return self.pipeline.optimizer_steps

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer whose steps are measured (None without one, or once it was garbage-collected)."""
        return self.pipeline.optimizer

    def watch_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Measure `optimizer`'s steps from now on, in place of the one given so far (a second phase of
        training with an optimizer of its own). The step count goes on; tensors it adds are tracked from
        its next measured step. gradlog also follows a new optimizer by itself at its first step (with a
        warning): calling this when you create it only says so. Not for a logger made with
        ``optimizer=None`` (that one measures inside log())."""
        self.pipeline.watch(steppable(optimizer), closed=self.closed)

    @property
    def model(self) -> nn.Module | None:
        """The model being watched (None once it was garbage-collected: the logger then closed itself)."""
        return self._model()

    @property
    def dropped(self) -> int:
        """Records the writers lost so far (slow, stalled or failing writers); 0 in a healthy run."""
        return self.writers.dropped

    def clip_due(self) -> bool:
        """Whether gradients clipped now belong to a step that will be measured (so clipping is worth noting)."""
        return self.pipeline.clip_due()

    def note_clip(self, params: list[torch.Tensor], total: torch.Tensor, max_norm: float) -> None:
        """Gradients of `params` were clipped with total norm `total` (before clipping) to `max_norm`. Not under
        DeepSpeed ZeRO: it clips inside its step, after gradlog read the gradients (accelerate's clip_grad_norm_
        there only returns the engine's last norm)."""
        if self._zero is None:
            self.pipeline.note_clip(params, total, max_norm)

    # --- public API --------------------------------------------------------------------------
    def log(self, step: int | None = None) -> None:
        """Publish the latest measurement not yet published, at x-axis value `step`.

        Never raises because of a writer; see the class docstring for when steps are measured.
        """
        if self.pipeline.inert:
            return
        if self._report is not None:
            raise RuntimeError("GradLogger.log() called after close(); create a new GradLogger for a new run")
        self._logged = True
        if step is not None and type(step) is not int:
            step = whole_step(step)
        self.pipeline.on_log(step)
        with lifecycle.LogCall():
            m = self.pipeline.take()
            fresh = m is not None and m.index != self._last_index
            if self._passes is not None and self._passes.done and self._passes.hooked:
                self._passes.release()  # its hooks, after the first step (not from inside torch's loop over them)
            if self._once.state in ("waiting", "tracing"):
                self._trace_after_log(m if fresh else None)
            if m is None or not fresh:
                return
            self._last_index = m.index
            if self._zero is not None and m.clip_coef is None:  # DeepSpeed clipped inside its step
                m.clip_coef = self._zero.clip_coef(m.index)
            self._publish(m, m.index if step is None else step)

    def _trace_after_log(self, m: Measurement | None) -> None:
        """The run's one traced step (`gradlog.measure.trace.OnceTrace`): armed by a measured step that shows a
        trainable tensor without a gradient, read out after the traced step. Advice: a failure ends it quietly."""
        try:
            check = (
                None if m is None else (lambda: starved(m.rows, m.has_grad, m.lists.nonzero) or self._once.refrozen())
            )
            self._once.after_log(check, self.pipeline.steps)
        except Exception as exc:  # never kill the run for advice
            self._once.close(self.pipeline.steps)
            self._once.result = None
            warnings.warn(f"gradlog: the traced step failed and is skipped ({exc!r})", RuntimeWarning, stacklevel=3)

    def _publish(self, m: Measurement, step: int) -> None:
        histogram_step = self.pipeline.histogram_step(m.index)  # the overview and the provisional tables then
        extra = self.pipeline.run_scalars()
        self.publisher.step(m, step, extra, histogram_step, lambda: self._provisional(exact=False))

    def _provisional(self, exact: bool) -> Report | None:
        """The answer so far, for a run that never closes (`exact`: every tensor fingerprinted, as at
        close, for the last answer of a run that is ending), or None when it failed. Rank-local: under
        sharded parameters only rank 0 gets here, so no collective may run (the summary's `scope` says so)."""
        return self.publisher.attempt(lambda: self._diagnose(collective=False, reuse=not exact))

    def write_provisional(self, step: int | None = None, exact: bool = False) -> None:
        """Write the answer as of now as `gradlog/provisional/...` tables (at `step`, default the last
        published one); gradlog does this by itself on histogram steps and on SIGTERM."""
        if not self.rank_zero:
            return
        at = max(self._last_index, 0) if step is None else step
        report = self._provisional(exact)
        if report is not None:
            self.publisher.report(report, provisional_step=at, rank_local=self.pipeline.rank_local())

    def report(self) -> Report:
        """The never-updated diagnosis as of now (close() calls this once more at the end)."""
        return self._diagnose(collective=True, reuse=False)

    def _diagnose(self, collective: bool, reuse: bool) -> Report:
        """The pipeline's diagnosis (`Pipeline.diagnose`), judged over every segment of a resumed run."""
        with self._zero.shown() if self._zero is not None else contextlib.nullcontext():  # ZeRO-3: each rank's part
            return self.pipeline.diagnose(collective, reuse, self.optimizer, self.policy, self.segments)

    @property
    def closed(self) -> bool:
        return self._report is not None

    def close(self) -> Report:
        """Remove the hooks, diagnose, print and write the never-updated table. Idempotent."""
        if self._report is not None:
            return self._report
        if self.pipeline.inert:
            self._report = Report(error="closed in a forked child: the parent process owns this run")
            return self._report
        local = self._registration.gone  # the model was garbage-collected: the other ranks are not there
        self._registration.detach()
        self.pipeline.detach()
        if self._passes is not None:
            self._passes.close()  # its result stays for the report
        if self._zero is not None:
            self._zero.release()
        # report() itself when collective: a subclass or a wrapper of report() then decides the final answer
        diagnose = (lambda: self._diagnose(collective=False, reuse=False)) if local else self.report
        report = self._report = self._traced(self.pipeline.final_report(diagnose, self.policy, self.strict))
        try:
            if self.rank_zero:
                self._warn_never_logged(report)
                self.publisher.report(report, step=max(self._last_index, 0))
                if self.print_report:
                    self.publisher.print_final(report)
            self.writers.close()  # logs how many records were dropped, if any (each cause was warned about once)
        finally:  # even when a strict writer raised: a closed logger is gone from every registry
            self.pipeline.release_optimizer()
            lifecycle.unregister(self)
        return report

    def _warn_never_logged(self, report: Report) -> None:
        """Steps were measured but `log()` never called: the writers got the tables and no series at all
        (dashboards empty, and nothing said so; issue 41). Once, at close."""
        if self._logged or report.measured_steps == 0 or not self.writers.writers:
            return
        lifecycle.warn(
            f"gradlog: {plural(report.measured_steps, 'measured step')}, but GradLogger.log(step) was never called, so "
            "no series reached the writers (only the tables at close): call gl.log(step) after optimizer.step() "
            "(or gradlog.log(step) after gradlog.watch)"
        )

    def _traced(self, report: Report) -> Report:
        """The report with what the run's one traced step found (nothing when no step was traced)."""
        result = self._once.close(self.pipeline.steps)
        report = self._cleared_passes(report)
        if result is None or report.error is not None:
            return report
        ids = {row.name: id(row.param) for row in self.table.live}
        outside = not_registered(result)
        return dataclasses.replace(
            report,
            hint=traced_hint(report.hint, [*report.never_updated, *report.stalled], ids, result),
            never_updated=remade(locate(report.never_updated, ids, result), result) + outside,
            tracked_tensors=report.tracked_tensors + len(outside),
        )

    def _cleared_passes(self, report: Report) -> Report:
        """The report with the accumulation whose gradients were cleared between passes, where the first optimizer
        step showed one (`gradlog.measure.trace.PassWatch`), and the evidence against a padding_idx row that the
        first batch used as a real token (`PaddingWatch`)."""
        self._padding.close()
        if self._padding.found:
            report = dataclasses.replace(
                report, partly_updated=explain_padding(report.partly_updated, self._padding.found)
            )
        watch = self._passes
        if watch is None:
            return report
        watch.close()
        if watch.result is None or report.error is not None:
            return report
        said = "; zero_grad() cleared earlier micro-batches' gradients (Gradients cleared between backward() passes):"
        said += " ids only they held are among these"
        partly = [
            dataclasses.replace(r, detail=r.detail + said) if r.reason == Reason.NOT_IN_BATCH else r
            for r in report.partly_updated
        ]
        report = dataclasses.replace(report, partly_updated=partly)
        return report.with_records({AccumulationCleared: [from_passes(watch.result)]})

    def where(self) -> str | None:
        """Where this run's files went, and the commands that read them (None for memory-only writers)."""
        return self.publisher.where()

    # --- the end of a run that does not reach close(): signals, forks (gradlog.run.lifecycle) ----------
    def on_sigterm(self, ending: bool) -> None:
        """SIGTERM: close (`ending`), or write the provisional tables (see `lifecycle.end_on_sigterm`)."""
        lifecycle.end_on_sigterm(self, ending)

    def after_fork(self) -> None:
        """In a forked child (DataLoader workers, multiprocessing): the parent owns the run. No table, no
        writes, no waiting for writer threads that did not come along."""
        self.pipeline.inert = True
        self.print_report = False
        self.writers.after_fork()

    def __enter__(self) -> GradLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def watch(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, **kwargs: Any) -> GradLogger:
    """Create a GradLogger that the module-level `gradlog.log()` and `gradlog.close()` drive."""
    return GradLogger(model, optimizer, **kwargs)
