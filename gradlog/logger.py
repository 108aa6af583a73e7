"""`GradLogger`: the one object a user creates. It wires hooks -> meter -> writers and ledger -> report."""

from __future__ import annotations

import inspect
import logging
import math
import operator
import os
import sys
import weakref
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from torch import nn

import gradlog.lifecycle as lifecycle
from gradlog.measure.amp import AmpState
from gradlog.measure.distributed import DistributedMismatchError, check_supported, is_rank_zero
from gradlog.measure.meter import Measurement, Meter
from gradlog.measure.optimizers import steppable
from gradlog.measure.params import NameFilter, ParamTable
from gradlog.options import (
    AlertOptions,
    HistogramOptions,
    Output,
    alert_options,
    check_moved,
    histogram_options,
    output,
)
from gradlog.pipeline import Pipeline
from gradlog.publishing import Failures, Publisher
from gradlog.resume import Earlier, Resume, Segment, checkpoint_step, find_earlier
from gradlog.runformat.names import ALERT_COUNT, SKIPPED_STEPS
from gradlog.verdict.alerts import Alerts
from gradlog.verdict.ledger import Ledger
from gradlog.verdict.policy import Policy, PolicyLike
from gradlog.verdict.report import Report
from gradlog.writers import WriterSpec, make_writers
from gradlog.writers.guard import GuardedWriters
from gradlog.writers.overview import Overview
from gradlog.writers.tensorboard import TensorBoardWriter

logger = logging.getLogger("gradlog")
logger.addHandler(logging.NullHandler())

DEFAULT_EVERY = 50
#: log() calls in a row with no step of the watched optimizer (and 4x the longest such gap seen between
#: two steps, for gradient accumulation) before gradlog says that nothing it watches is stepping.
IDLE_LOG_CALLS = 200
#: Seconds a collective at close may wait for the other ranks when a signal is ending the run.
SIGNAL_SYNC_TIMEOUT_S = 10.0


class Options(NamedTuple):
    """The validated option objects a logger runs with (`GradLogger.options`)."""

    histograms: HistogramOptions
    alerts: AlertOptions | None
    output: Output


def _whole_step(step: object) -> int:
    """`log(step)`'s x-axis value as an int: a whole number (int, numpy integer, 2.0, a one-element tensor
    holding one). Anything else is a bug in the loop, named at the first call rather than written as a
    truncated or garbled axis (2.5 was silently 2, "4" a string)."""
    value: object = step
    if isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_complex():
        value = step.item()
    elif hasattr(step, "__index__") and not isinstance(step, (bool, torch.Tensor)):
        value = operator.index(step)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ValueError(
        f"log(step={step!r}): step is the x-axis value and must be a whole number (an int, or a one-element "
        "tensor holding one); pass your loop's step or batch index, or call log() with none to use the "
        "optimizer step"
    )


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
    norm and update ratio; histograms of gradients, weights and updates on histogram steps
    (``histograms=True``, or a `gradlog.HistogramOptions` for their period, kinds, bins, zero
    counting and the overview image).

    Run-level series (``gradlog/no_update_tensors``, ``gradlog/update_ratio_median``, ...) come with
    every published step; the overview image (the update-ratio heatmap, findings marked) is drawn on
    a background thread on histogram steps, at most one per 20 s, and once more at close.

    Alerts during training (``alerts=True``, or a `gradlog.AlertOptions` with their thresholds): a
    NaN/Inf gradient, a gradient-norm spike, an update ratio out of its band, a tensor with no gradient.

    Unmeasured steps cost one counter increment. ``close()`` removes every hook, writes the
    never-updated table and returns a `Report`; it also runs at interpreter exit if forgotten, on
    SIGTERM, and when the model is garbage-collected.

    Nothing lost: on histogram steps, at most every ``Output.provisional_every`` seconds (the first one
    always), the tables as of that step are written as ``gradlog/provisional/...``, so a run killed
    with ``kill -9`` or by the OOM killer still has an answer on disk. Writers other than TensorBoard
    and memory run behind a bounded queue on a thread of their own; one slower than
    ``Output.timeout`` seconds per call has its records dropped and counted (``dropped``).

    With a GradScaler and a non-fused optimizer pass ``scaler=`` so that skipped steps are counted.
    Under FSDP2/DTensor every rank must create, step, ``log()`` and ``close()`` alike: gradlog's
    collectives run there (a gloo rank waiting over ``Output.sync_timeout`` seconds raises).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> GradLogger:
        check_moved(kwargs)  # a keyword that moved into an option object: say where, before Python's bare error
        return super().__new__(cls)

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
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}; pass the module you train")
        if optimizer is not None:
            optimizer = steppable(optimizer)  # a wrapper's (accelerate, Lightning) inner optimizer
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an integer >= 1 (measure every k-th optimizer step), got {every!r}")
        hist = histogram_options(histograms)
        alert = alert_options(alerts)
        out = output(writer)
        self.options = Options(hist, alert, out)
        options = dict(out.options)
        if "log_dir" in options:  # the writers' own spelling, accepted where it cannot be ambiguous
            opt_dir = options.pop("log_dir")
            if log_dir is not None and os.fspath(opt_dir) != os.fspath(log_dir):
                raise ValueError(
                    f"log_dir={log_dir!r} and Output(options={{'log_dir': {opt_dir!r}}}) disagree; pass log_dir= only"
                )
            log_dir = opt_dir
        check_supported(model)
        self._model = weakref.ref(model)  # weak: a logger never keeps a model (and its weights) alive
        self.print_report = print_report
        self.policy = Policy.coerce(policy)  # how much each kind of finding matters (gradlog/verdict/policy.py)
        self.handle_signals = out.handle_signals
        self.strict = out.strict
        self.failures = Failures(out.strict)
        self.rank_zero = is_rank_zero()
        # Alerts (gradlog/verdict/alerts.py) read the host-side Measurement only; every rank judges the same
        # reduced numbers, only rank 0 says so.
        watch = alert.make() if alert is not None else None
        if watch is not None:
            watch.emit = self.rank_zero
        self.pipeline = Pipeline(
            model,
            optimizer,
            every,
            hist,
            watch,
            scaler,
            include,
            exclude,
            out.sync_timeout,
            self.failures,
            self.rank_zero,
        )
        wstrict = bool(options.pop("strict", out.strict))  # the writer options may set the writers' own strictness
        writers = make_writers(out.writer, log_dir=log_dir, strict=wstrict, **options) if self.rank_zero else []
        self.writers = GuardedWriters(writers, strict=out.strict, timeout=out.timeout)
        self.overview = Overview(hist.overview_every)
        self.publisher = Publisher(self.writers, self.overview, out.provisional_every, self.failures)
        self.earlier: Earlier | None = None  # the earlier segments of a resumed run
        self.segment: Segment | None = None
        if self.rank_zero:
            self._start_segment(out.resume, writers)
        self._last_index = -1
        self._report: Report | None = None
        self._steps_at_log = 0  # optimizer steps at the last log() call, and log() calls since they changed
        self._idle_logs = 0
        self._longest_idle = 0  # the most log() calls between two steps so far (gradient accumulation)
        self._warned_idle = False
        #: "file:line" of the user's constructor call, named when a later logger replaces this one
        self.made_at = lifecycle.caller()
        lifecycle.replace_earlier(self, model, optimizer)
        self._registration = lifecycle.register(self, model)

    def _start_segment(self, resume: Resume, writers: list[Any]) -> None:
        """This run's id (its TensorBoard file mark), and with `resume` the earlier run it continues:
        its id, its step count, its evidence (merged at close). A run that cannot be continued (none
        there, another model's) is said once and a new run starts beside it; nothing is overwritten."""
        tb = next((w for w in writers if isinstance(w, TensorBoardWriter)), None)
        self.segment = Segment(tb.run if tb is not None else f"{os.getpid()}-{id(self)}")
        self.publisher.segment = self._segment_rows
        if resume is False:
            return
        said = f"resume={resume!r}"
        if tb is None:
            lifecycle.warn(
                f"gradlog: {said} needs the TensorBoard writer (its log_dir holds the run); a new run starts"
            )
            return
        found = find_earlier(tb.log_dir) if os.path.isdir(tb.log_dir) else f"{tb.log_dir!r} does not exist"
        if isinstance(found, str):
            if resume is True:  # "auto" on a first start is the normal case, not worth a word
                lifecycle.warn(f"gradlog: {said}: {found}; nothing to continue, a new run starts")
            return
        why = found.mismatch(self.table.live)
        if why is not None:
            lifecycle.warn(
                f"gradlog: {said}: the run in {tb.log_dir!r} is of another model ({why}); a new run starts "
                "beside it (pass another log_dir to keep them apart)"
            )
            return
        opt = self.optimizer
        if resume == "auto" and (opt is None or not opt.state):
            lifecycle.warn(
                f"gradlog: resume='auto': {tb.log_dir!r} holds a run of this model, but the optimizer's state "
                "was not loaded from a checkpoint, so this is taken for a new run (written beside it); pass "
                "resume=True to continue it"
            )
            return
        tb.continue_run(found.run_id)
        self.earlier = found
        # the checkpoint's own step count where the optimizer keeps one (Adam's "step"): a job preempted
        # some steps after its last checkpoint redoes them, and the x-axis should say so
        start = checkpoint_step(opt)
        start = found.end_step if start is None else start
        self.segment = Segment(found.run_id, found.segments + 1, start)
        self.pipeline.start_at(start)
        logger.info("gradlog: continuing the run in %s from step %d", tb.log_dir, start)

    def _segment_rows(self) -> tuple[list[list[str]], list[list[str]]]:
        assert self.segment is not None
        ev = self.ledger.evidence
        last = {i: e.last_update for i, e in ev.items()}
        return self.segment.summary_rows(), Segment.rows(self.table.live, last, self.earlier)

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
    def _handles(self) -> list[Any]:  # the step hooks' handles (tests remove them to simulate a lost rank)
        return self.pipeline.handles

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
        if self._report is not None:
            raise RuntimeError("GradLogger.watch_optimizer() called after close(); create a new GradLogger")
        if not self.pipeline.with_optimizer:
            raise ValueError(
                "watch_optimizer(): this GradLogger was made with optimizer=None and measures inside log(); "
                "create it with the optimizer instead"
            )
        self.pipeline.follow(steppable(optimizer))

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
        """Gradients of `params` were clipped with total norm `total` (before clipping) to `max_norm`."""
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
        if step is not None and type(step) is not int:
            step = _whole_step(step)
        if not self.pipeline.with_optimizer:
            self.pipeline.count_call(step)
        elif self.pipeline.optimizer_steps == self._steps_at_log:
            self._idle_logs += 1
            if self._idle_logs == max(IDLE_LOG_CALLS, 4 * self._longest_idle) and not self._warned_idle:
                self._warn_idle()
        else:
            self._steps_at_log = self.pipeline.optimizer_steps
            self._longest_idle = max(self._longest_idle, self._idle_logs)
            self._idle_logs = 0
        with lifecycle.LogCall():
            m = self.pipeline.take()
            if m is None or m.index == self._last_index:
                return
            self._last_index = m.index
            self._publish(m, m.index if step is None else step)

    def _warn_idle(self) -> None:
        """log() keeps coming and the optimizer gradlog watches does not step: something else trains the
        model (a manual update, an optimizer whose steps torch's hooks do not see), or nothing does."""
        self._warned_idle = True
        opt = self.optimizer
        name = type(opt).__name__ if opt is not None else "the optimizer (garbage-collected)"
        lifecycle.warn(
            f"gradlog: log() was called {self._idle_logs} times since the last step of {name}, the optimizer "
            f"gradlog measures ({self.pipeline.optimizer_steps} steps so far); nothing new is measured. If another "
            "optimizer trains the model now, pass it with gl.watch_optimizer(optimizer); if the weights are "
            "updated by hand, create the GradLogger with optimizer=None (it then measures inside log())"
        )

    def _publish(self, m: Measurement, step: int) -> None:
        extra = {SKIPPED_STEPS: float(self.ledger.skipped_steps)}
        if self.alerts is not None:
            extra[ALERT_COUNT] = float(len(self.alerts.fired))
        # histogram steps (measured steps when histograms are off): the overview and the provisional tables
        every = self.pipeline.histogram_every
        histogram_step = not every or m.index % every == 0
        self.publisher.step(m, step, extra, histogram_step, lambda: self._provisional(exact=False))

    def _provisional(self, exact: bool) -> Report | None:
        """The answer so far, for a run that never closes (`exact`: every tensor fingerprinted, as at
        close, for the last answer of a run that is ending; otherwise tensors the evidence already
        answers for are not fingerprinted again). None when it failed: a provisional answer is a bonus
        and never costs the step.

        Rank-local: under sharded parameters (FSDP2, DTensor) only rank 0 gets here, so no collective
        may run; the table then speaks for rank 0's shards (said in the summary's `scope`)."""
        try:
            return self._diagnose(collective=False, reuse=not exact)
        except DistributedMismatchError:
            raise
        except Exception as exc:
            self.failures.handle(
                exc,
                lambda key: f"gradlog: the provisional never-updated table failed ({key}); training continues",
            )
            return None

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
        """The pipeline's diagnosis (see `Pipeline.diagnose`), with the model and optimizer if still alive."""
        report = self.pipeline.diagnose(collective, reuse, self.model, self.optimizer, self.policy)
        if self.earlier is not None and self.segment is not None:  # judged over every segment of the run
            names = {r.name for r in self.table.live}
            report = self.earlier.merge(report, self.segment.first_step, names)
        return report

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
        report = self._final_report(collective=not local)
        self._report = report
        try:
            if self.rank_zero:
                self.publisher.report(report, step=max(self._last_index, 0))
                if self.print_report:  # where the files went first: the verdict stays the last line
                    where = self.where()
                    if where:
                        print(where, file=sys.stdout, flush=True)
                    print(report.table(), file=sys.stdout, flush=True)
            self.writers.close()  # logs how many records were dropped, if any (each cause was warned about once)
        finally:  # even when a strict writer raised: a closed logger is gone from every registry
            self.pipeline.release_optimizer()
            lifecycle.unregister(self)
        return report

    def where(self) -> str | None:
        """Where this run's files went, and the commands that read them (None for memory-only writers)."""
        return self.publisher.where()

    def _final_report(self, collective: bool) -> Report:
        """The diagnosis at close; if it fails, a warning and a Report that says so, never a traceback
        at the end of a training run (strict mode and distributed mismatches still raise)."""
        try:
            self.table.rescan()
            # report() itself when collective: a subclass or a wrapper of report() then decides the final answer
            return self.report() if collective else self._diagnose(collective=False, reuse=False)
        except DistributedMismatchError:
            raise
        except Exception as exc:
            if self.strict:
                raise
            key = lifecycle.describe(exc)
            lifecycle.warn(
                f"gradlog: the never-updated diagnosis failed at close() ({key}); the run's data is still written"
            )
            return Report(
                optimizer_steps=self.pipeline.steps,
                measured_steps=self.ledger.measured_steps,
                skipped_steps=self.ledger.skipped_steps,
                tracked_tensors=len(self.table.live),
                error=key,
                policy=self.policy,
            )

    # --- the end of a run that does not reach close(): signals, forks (gradlog.lifecycle) ----------
    def on_sigterm(self, ending: bool) -> None:
        """SIGTERM. `ending`: the process ends after this, so close, with bounded waits for other ranks
        (they may get the signal later, or never): if they do not join, the answer is this rank's own,
        written as provisional. Otherwise (the program handles SIGTERM itself and may go on) only the
        provisional tables are written."""
        if not ending:
            if self.rank_zero:
                self.write_provisional()
                self.writers.flush()
                self.writers.sync()
            return
        reducer = self.meter.reducer
        if reducer is not None:
            reducer.timeout_s = min(reducer.timeout_s, SIGNAL_SYNC_TIMEOUT_S)
        try:
            self.close()
        except DistributedMismatchError as exc:
            logger.warning("gradlog: ranks did not meet at close() after SIGTERM (%s); writing this rank's answer", exc)
            self.meter.abandon()
            self.write_provisional(exact=True)
            self.writers.close()

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


# `__new__` takes anything (to name moved keywords): help() and IDEs show the real parameters.
_INIT = inspect.signature(GradLogger.__init__)
setattr(GradLogger, "__signature__", _INIT.replace(parameters=list(_INIT.parameters.values())[1:]))  # noqa: B010


def watch(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, **kwargs: Any) -> GradLogger:
    """Create a GradLogger that the module-level `gradlog.log()` and `gradlog.close()` drive."""
    return GradLogger(model, optimizer, **kwargs)


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_`, same arguments and result, that also tells every open GradLogger.

    Clipping changes the gradients before the optimizer step, where gradlog reads them: without this,
    `weights/grad_norm/...` would read the clipped norms (pinned at max_norm), and a spike would go unseen.
    With it, the measured step reports the norms before clipping (per tensor and `gradlog/grad_norm_total`)
    and `gradlog/clip_coef`, computed from the clipped gradients and this total: no extra pass.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    total = torch.nn.utils.clip_grad_norm_(
        params, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach
    )
    for gl in list(lifecycle.ACTIVE):
        gl.note_clip(params, total, max_norm)
    return total


def log(step: int | None = None) -> None:
    """Publish the latest measurement of every open GradLogger (see `GradLogger.log`)."""
    if not lifecycle.ACTIVE:
        raise RuntimeError("gradlog.log() needs an open logger: call gradlog.watch(model, optimizer) first")
    for gl in list(lifecycle.ACTIVE):
        gl.log(step)


def close() -> Report | None:
    """Close every open GradLogger; returns the last one's Report (None if none was open)."""
    report = None
    for gl in list(lifecycle.ACTIVE):
        report = gl.close()
    return report
