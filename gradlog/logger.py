"""`GradLogger`: the one object a user creates. It wires hooks -> meter -> writers and ledger -> report."""

from __future__ import annotations

import atexit
import logging
import math
import operator
import os
import signal
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from gradlog.measure import tags
from gradlog.measure.amp import AmpState
from gradlog.measure.distributed import DEFAULT_TIMEOUT_S, DistributedMismatchError, Reducer, check_supported
from gradlog.measure.histogram import MAX_BINS
from gradlog.measure.meter import Clip, Measurement, Meter
from gradlog.measure.optimizers import steppable
from gradlog.measure.params import NameFilter, ParamTable, Selection
from gradlog.measure.tags import HISTOGRAM_KINDS
from gradlog.verdict.alerts import (
    ALERT_COLUMNS,
    DEFAULT_NO_GRAD_PATIENCE,
    DEFAULT_RATIO_PATIENCE,
    DEFAULT_SPIKE_FACTOR,
    Alerts,
)
from gradlog.verdict.diagnosis import diagnose, run_hint
from gradlog.verdict.ledger import Ledger
from gradlog.verdict.policy import POLICY_COLUMNS, Policy, PolicyLike
from gradlog.verdict.report import PARTLY_COLUMNS, STALLED_COLUMNS, TABLE_COLUMNS, Report
from gradlog.verdict.series import run_level
from gradlog.verdict.slices import global_facts, partly_updated, slice_facts
from gradlog.verdict.stalled import stalled
from gradlog.writers import Writer, WriterSpec, make_writers
from gradlog.writers.guard import DEFAULT_TIMEOUT_S as DEFAULT_WRITER_TIMEOUT_S
from gradlog.writers.guard import GuardedWriters
from gradlog.writers.overview import TAG as OVERVIEW_TAG
from gradlog.writers.overview import Overview
from gradlog.writers.tensorboard import TensorBoardWriter  # imports tensorboard only when one is constructed

logger = logging.getLogger("gradlog")
logger.addHandler(logging.NullHandler())

DEFAULT_EVERY = 50
#: Seconds of wall time between two provisional tables (written on histogram steps; the first one always).
DEFAULT_PROVISIONAL_EVERY_S = 120.0
#: Table names of the provisional answer: `gradlog/provisional/<name>` for each final `gradlog/<name>`.
PROVISIONAL_PREFIX = "gradlog/provisional/"
#: Seconds a collective at close may wait for the other ranks when a signal is ending the run.
SIGNAL_SYNC_TIMEOUT_S = 10.0


def _is_rank_zero() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


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
    ``runs/<timestamp>-<host>`` folder per logger), a `Writer`, or a list of either.

    What is measured: every measured step, per tensor, the gradient norm, NaN/Inf count, weight
    norm and update ratio; histograms (``histograms``, every ``histogram_every``-th optimizer
    step) and ``grad_zero_frac`` (counting exact zeros is a pass of its own) on histogram steps,
    or on every measured step with ``count_zeros=True`` (never with ``False``).

    Run-level series (``gradlog/no_update_tensors``, ``gradlog/update_ratio_median``, ...) come with
    every published step; the overview image (the update-ratio heatmap, findings marked) is drawn on
    a background thread on histogram steps, or every ``overview_every`` published steps (0: never),
    at most one per 20 s, and once more at close.

    Unmeasured steps cost one counter increment. ``close()`` removes every hook, writes the
    never-updated table and returns a `Report`; it also runs at interpreter exit if forgotten, on
    SIGTERM (``handle_signals``), and when the model is garbage-collected.

    Nothing lost: on histogram steps, at most every ``provisional_every`` seconds (the first one
    always), the tables as of that step are written as ``gradlog/provisional/...``, so a run killed
    with ``kill -9`` or by the OOM killer still has an answer on disk. Writers other than TensorBoard
    and memory run behind a bounded queue on a thread of their own; one slower than
    ``writer_timeout`` seconds per call has its records dropped and counted (``dropped``).

    With a GradScaler and a non-fused optimizer pass ``scaler=`` so that skipped steps are counted.
    Under FSDP2/DTensor every rank must create, step, ``log()`` and ``close()`` alike: gradlog's
    collectives run there (a gloo rank waiting over ``sync_timeout`` seconds raises).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        writer: WriterSpec = "tensorboard",
        every: int = DEFAULT_EVERY,
        *,
        log_dir: str | None = None,
        histograms: bool = True,
        histogram_every: int | None = None,
        count_zeros: bool | None = None,
        include: NameFilter = None,
        exclude: NameFilter = None,
        histogram_kinds: tuple[str, ...] = HISTOGRAM_KINDS,
        bins: int = 64,
        print_report: bool = True,
        policy: PolicyLike = None,
        strict: bool = False,
        writer_options: dict[str, Any] | None = None,
        scaler: Any = None,
        sync_timeout: float = DEFAULT_TIMEOUT_S,
        alerts: bool = True,
        ratio_band: tuple[float, float] | None = None,
        ratio_patience: int = DEFAULT_RATIO_PATIENCE,
        no_grad_patience: int = DEFAULT_NO_GRAD_PATIENCE,
        spike_factor: float = DEFAULT_SPIKE_FACTOR,
        overview_every: int | None = None,
        handle_signals: bool = True,
        provisional_every: float | None = DEFAULT_PROVISIONAL_EVERY_S,
        writer_timeout: float = DEFAULT_WRITER_TIMEOUT_S,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}; pass the module you train")
        if optimizer is not None:
            optimizer = steppable(optimizer)  # a wrapper's (accelerate, Lightning) inner optimizer
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an integer >= 1 (measure every k-th optimizer step), got {every!r}")
        if isinstance(bins, bool) or not isinstance(bins, int) or not 1 <= bins <= MAX_BINS:
            raise ValueError(f"bins must be an integer in 1..{MAX_BINS}, got {bins!r}")
        if histogram_every is not None and (histogram_every < 1 or histogram_every % every):
            raise ValueError(f"histogram_every must be a positive multiple of every={every}, got {histogram_every!r}")
        if count_zeros is not None and not isinstance(count_zeros, bool):
            raise ValueError(
                "count_zeros must be None (count on histogram steps), True (every measured step) or False, "
                f"got {count_zeros!r}"
            )
        bad = [k for k in histogram_kinds if k not in HISTOGRAM_KINDS]
        if bad:
            raise ValueError(f"unknown histogram kinds {bad}; choose from {list(HISTOGRAM_KINDS)}")
        if isinstance(sync_timeout, bool) or not isinstance(sync_timeout, (int, float)) or not sync_timeout > 0:
            raise ValueError(f"sync_timeout must be a number of seconds > 0, got {sync_timeout!r}")
        self.overview = Overview(overview_every)  # validates overview_every
        if provisional_every is not None and (
            isinstance(provisional_every, bool)
            or not isinstance(provisional_every, (int, float))
            or not provisional_every >= 0
        ):
            raise ValueError(
                "provisional_every must be None (no provisional tables) or a number of seconds >= 0 "
                f"(0: on every histogram step), got {provisional_every!r}"
            )
        options = dict(writer_options or {})
        if "log_dir" in options:  # the writers' own spelling, accepted where it cannot be ambiguous
            opt_dir = options.pop("log_dir")
            if log_dir is not None and os.fspath(opt_dir) != os.fspath(log_dir):
                raise ValueError(
                    f"log_dir={log_dir!r} and writer_options={{'log_dir': {opt_dir!r}}} disagree; pass log_dir= only"
                )
            log_dir = opt_dir
        check_supported(model)
        self.amp = AmpState(optimizer, scaler)
        self._model = weakref.ref(model)  # weak: a logger never keeps a model (and its weights) alive
        self._optimizer = weakref.ref(optimizer) if optimizer is not None else None
        self._with_optimizer = optimizer is not None
        self.every = every
        self.histogram_every = (histogram_every or every) if histograms else 0
        self.count_zeros = count_zeros
        self.print_report = print_report
        self.policy = Policy.coerce(policy)  # how much each kind of finding matters (gradlog/verdict/policy.py)
        self.handle_signals = handle_signals
        self.provisional_every = provisional_every
        self._provisional_at: float | None = None  # monotonic time of the last provisional table
        self._inert = False  # a forked child's copy: does nothing
        self._local_close = False  # close() without collectives (the model was garbage-collected)
        self._no_collective = False  # report() stays rank-local (provisional tables, see _local_report)
        self._provisional = False  # report() reuses what the evidence answers (see _provisional_report)
        # Alerts (gradlog/alerts.py) read the host-side Measurement only; thresholds are validated even when off.
        watch = Alerts(ratio_band, ratio_patience, no_grad_patience, spike_factor)
        self.alerts: Alerts | None = watch if alerts else None
        self.strict = strict
        self._failures: set[str] = set()
        self.table = ParamTable(model, optimizer, Selection(include, exclude))
        self.table.check_selection()
        self.meter = Meter(
            self.table,
            optimizer,
            bins,
            tuple(histogram_kinds),
            grad_scale=self.amp.inv_scale,
            skipped=self.amp.found_inf,
            reducer=Reducer(self._layout(bins, histogram_kinds), sync_timeout),
            skip_count=self.amp.count,
        )
        self.ledger = Ledger()
        self.ledger.fingerprint_new(self.table.live, self.table.generation)
        self.rank_zero = _is_rank_zero()
        wstrict = bool(options.pop("strict", strict))  # writer_options may set the writers' own strictness
        writers = make_writers(writer, log_dir=log_dir, strict=wstrict, **options) if self.rank_zero else []
        self.writers = GuardedWriters(writers, strict=strict, timeout=writer_timeout)
        self.optimizer_steps = 0
        self._calls = 0
        self._pending: Measurement | None = None
        self._last_index = -1
        self._report: Report | None = None
        self._handles: list[Any] = []
        self._clips: list[Clip] = []  # this step's gradient clipping, recorded only when the step is measured
        self._closure_pending = False  # a step(closure) is running and will be measured after its first call
        if optimizer is not None:
            # Untraced: a compiled `optimizer.step()` (torch.compile(opt.step)) would otherwise trace the hooks
            # into graphs of their own, split off by torch's own graph_break() calls around the step body (2
            # breaks and 2 graphs more than without gradlog, and recompiles as the step counter changes).
            # Dynamo skips a disabled hook, which runs eagerly around the compiled step instead: the same
            # graphs and breaks as without gradlog. Costs ~1 us per hook call in eager mode (the eval-frame swap).
            untraced: Callable[[Callable[..., Any]], Any] = torch.compiler.disable  # untyped in torch
            self._handles.append(optimizer.register_step_pre_hook(untraced(self._pre_step)))
            self._handles.append(optimizer.register_step_post_hook(untraced(self._post_step)))
        _active.append(self)
        ref = weakref.ref(self)
        self._atexit: Callable[[], None] = lambda: _close_ref(ref)
        atexit.register(self._atexit)
        # the model garbage-collected: nothing more can be measured, so the run is over
        self._model_gone = weakref.finalize(model, _close_gone, ref)
        self._model_gone.atexit = False  # interpreter exit is the atexit hook's job
        if handle_signals:
            _install_sigterm()

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer whose steps are measured (None without one, or once it was garbage-collected)."""
        return self._optimizer() if self._optimizer is not None else None

    @property
    def model(self) -> nn.Module | None:
        """The model being watched (None once it was garbage-collected: the logger then closed itself)."""
        return self._model()

    @property
    def dropped(self) -> int:
        """Records the writers lost so far (slow, stalled or failing writers); 0 in a healthy run."""
        return self.writers.dropped

    # --- hooks (the hot path: unmeasured steps only count) ---------------------------------
    def _pre_step(
        self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if self._inert:
            return None
        if self.amp.scaler is not None:
            self._guarded(self.amp.before_step)
        index = self.optimizer_steps
        self.optimizer_steps += 1
        if index % self.every:
            return None
        # args as the hook sees them: (optimizer, *positional), so a positional closure is args[1]
        closure = kwargs.get("closure") if "closure" in kwargs else args[1] if len(args) > 1 else None
        if not callable(closure):
            self._guarded(lambda: self._begin(index, snapshot=True))
            return None
        # step(closure): the gradients do not exist yet; they are made by the closure, inside step()
        measured = self._measure_after_first_call(closure, index)
        if "closure" in kwargs:
            return tuple(args), {**kwargs, "closure": measured}
        return (args[0], measured, *args[2:]), dict(kwargs)

    def _measure_after_first_call(self, closure: Callable[[], Any], index: int) -> Callable[[], Any]:
        """Optimizers call the closure before they move any weight (LBFGS calls it again after each
        move): right after the first call the gradients are the ones the step uses, and the weights
        are still the step's starting point."""
        first = [True]
        self._closure_pending = True

        def measured_closure() -> Any:
            result = closure()
            if first[0]:
                first[0] = False
                self._closure_pending = False
                self._guarded(lambda: self._begin(index, snapshot=True))
            return result

        return measured_closure

    def _post_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._inert:
            return
        self._clips = []
        self._closure_pending = False
        if self.amp.fused:
            self._guarded(self.amp.after_step)
        if self.meter.busy:
            self._guarded(self.meter.finish)

    def _guarded(self, work: Callable[[], object]) -> None:
        """Measuring must never kill a training run: a failure drops this step's measurement, once warned."""
        try:
            work()
        except DistributedMismatchError:
            raise  # carrying on would hang or mix up collectives: this one must stop the run
        except Exception as exc:
            self.meter.abandon()
            if self.strict:
                raise
            key = _describe(exc)
            if key not in self._failures:
                self._failures.add(key)
                _warn(f"gradlog: measuring step {self.optimizer_steps - 1} failed ({key}); training continues")

    def _begin(self, index: int, snapshot: bool) -> None:
        self._collect()  # a measurement the user never published still feeds the ledger
        self.table.rescan()  # parameters materialised or added since the last measured step
        self._release_freed()
        self.ledger.fingerprint_new(self.table.live, self.table.generation)
        hist = bool(self.histogram_every) and index % self.histogram_every == 0
        zeros = hist if self.count_zeros is None else self.count_zeros
        clips, self._clips = self._clips, []
        self.meter.start(index, histograms=hist, snapshot=snapshot, zeros=zeros, clips=clips)

    def _release_freed(self) -> None:
        """Per-slice state of tensors freed since the last measured step (replaced parameters) goes: the
        fingerprint and the slice evidence; their counters stay in the ledger."""
        grads = self.meter.slice_grads
        for index in self.table.take_freed():
            self.ledger.release(index)
            grads.rows.pop(index, None)
            grads.cols.pop(index, None)
            grads.full.discard(index)
            grads.rows_full.discard(index)

    def clip_due(self) -> bool:
        """Whether gradients clipped now belong to a step that will be measured (so clipping is worth noting)."""
        if self._report is not None:
            return False
        if self._closure_pending:  # inside step(closure): clipping runs in the closure, before gradlog measures
            return True
        if not self._with_optimizer:
            return self._calls % self.every == 0
        return self.optimizer_steps % self.every == 0

    def note_clip(self, params: list[torch.Tensor], total: torch.Tensor, max_norm: float) -> None:
        """Gradients of `params` were clipped with total norm `total` (before clipping) to `max_norm`: the
        next measurement reports their norms before clipping and the clip coefficient. Cheap: no device work."""
        if self.clip_due() and isinstance(total, torch.Tensor):
            self._clips.append(Clip(frozenset(map(id, params)), total.detach(), float(max_norm)))

    def _measure_now(self, call: int) -> None:
        """Without an optimizer there are no step hooks: measure inside log()."""
        self._begin(call, snapshot=False)
        self.meter.finish()

    def _layout(self, bins: int, kinds: tuple[str, ...] | list[str]) -> dict[str, float]:
        """Settings every rank must share under FSDP2/DTensor (compared across ranks before use)."""
        return {
            "every": self.every,
            "histogram_every": self.histogram_every,
            "count_zeros": -1 if self.count_zeros is None else int(self.count_zeros),
            "bins": bins,
            "histogram_kinds (bits)": sum(1 << i for i, k in enumerate(HISTOGRAM_KINDS) if k in kinds),
            "optimizer": self._with_optimizer,
        }

    def _collect(self) -> Measurement | None:
        """Bring a finished measurement to the host (its one copy) and feed the ledger."""
        m = self.meter.fetch()
        if m is not None:
            self.ledger.observe(m)
            if self.alerts is not None:  # every rank judges the same reduced numbers; only rank 0 says so
                self.alerts.emit = self.rank_zero
                self.alerts.observe(m)
            self._pending = m
        return m

    # --- public API --------------------------------------------------------------------------
    def log(self, step: int | None = None) -> None:
        """Publish the latest measurement not yet published, at x-axis value `step`.

        Never raises because of a writer; see the class docstring for when steps are measured.
        """
        if self._inert:
            return
        if self._report is not None:
            raise RuntimeError("GradLogger.log() called after close(); create a new GradLogger for a new run")
        if step is not None and type(step) is not int:
            step = _whole_step(step)
        if not self._with_optimizer:
            call = self._calls
            self._calls += 1
            if self.meter.reducer is not None:  # the collective compares it: a skipped call is caught at once
                self.meter.reducer.call = float(call if step is None else step)
            if call % self.every == 0:
                self._guarded(lambda: self._measure_now(call))
        main = threading.get_ident() == threading.main_thread().ident
        _Sigterm.busy += main  # a SIGTERM now waits until this call is done (it may hold a writer queue's lock)
        try:
            self._guarded(self._collect)
            m, self._pending = self._pending, None
            if m is None or m.index == self._last_index:
                return
            self._last_index = m.index
            self._publish(m, m.index if step is None else step)
        finally:
            _Sigterm.busy -= main
            if main and _Sigterm.deferred is not None and not _Sigterm.busy:
                signum, _Sigterm.deferred = _Sigterm.deferred, None
                _on_sigterm(signum, None)

    def _publish(self, m: Measurement, step: int) -> None:
        if not self.writers.writers:
            return
        scalars = m.scalars()
        scalars.update(run_level(m))
        scalars["gradlog/skipped_steps"] = float(self.ledger.skipped_steps)
        if self.alerts is not None:
            scalars["gradlog/alerts"] = float(len(self.alerts.fired))
        self.writers.log_scalars(scalars, step)
        for kind, hists in m.histograms.items():
            self.writers.log_histograms([tags.tag(kind, m.rows[pos].name) for pos in hists.positions], hists, step)
        if self.overview.every != 0:
            self._guarded_overview(m, step)
        # histogram steps (measured steps when histograms are off), gated by wall time
        provisional = (m.histograms or not self.histogram_every) and self._provisional_due()
        if provisional:
            self._write_provisional(step)
        self.writers.flush()
        if provisional:  # the provisional answer is what a kill -9 leaves: handed over before training goes on
            self.writers.sync()

    def _guarded_overview(self, m: Measurement, step: int) -> None:
        """Record the step for the overview image; hand over images the drawing thread finished; start the
        next drawing when due. Any failure here costs the image, never the step."""
        try:
            self.overview.observe(m, step)
            for at, png in self.overview.take():
                self.writers.log_image(OVERVIEW_TAG, png, at)
            hist_step = not self.histogram_every or m.index % self.histogram_every == 0
            if self.overview.due(hist_step):
                self.overview.start(self.overview.live_marks())
        except Exception as exc:
            if self.strict:
                raise
            key = _describe(exc)
            if key not in self._failures:
                self._failures.add(key)
                _warn(f"gradlog: the overview image failed ({key}); training continues")

    def _provisional_due(self) -> bool:
        """Histogram steps, at most every `provisional_every` seconds: the only cost on the training path
        outside the wall-time gate is one clock read."""
        if self.provisional_every is None:
            return False
        now = time.monotonic()
        if self._provisional_at is not None and now - self._provisional_at < self.provisional_every:
            return False
        self._provisional_at = now
        return True

    def _write_provisional(self, step: int, exact: bool = False) -> None:
        """The answer so far, as `gradlog/provisional/...` tables at `step`, for a run that never closes
        (`exact`: every tensor fingerprinted, as at close, for the last answer of a run that is ending).

        Rank-local: under sharded parameters (FSDP2, DTensor) only rank 0 gets here, so no collective
        may run; the table then speaks for rank 0's shards (said in the summary's `scope`)."""
        try:
            report = self._local_report() if exact else self._provisional_report()
        except DistributedMismatchError:
            raise
        except Exception as exc:  # the provisional answer is a bonus: never let it cost the step
            key = _describe(exc)
            if key not in self._failures:
                self._failures.add(key)
                _warn(f"gradlog: the provisional never-updated table failed at step {step} ({key}); training continues")
            return
        self._write_report(report, provisional_step=step)

    def _local_report(self) -> Report:
        """`report()` without the collective that makes it global under sharded parameters (a flag, not an
        argument, so that `report` keeps the signature a subclass or a wrapper may rely on)."""
        self._no_collective = True
        try:
            return self.report()
        finally:
            self._no_collective = False

    def _provisional_report(self) -> Report:
        """`_local_report` for a provisional table: tensors the evidence already answers for (frozen ones,
        ones never written in place) are not fingerprinted again (`Ledger.changed`)."""
        self._provisional = True
        try:
            return self._local_report()
        finally:
            self._provisional = False

    def report(self) -> Report:
        """The never-updated diagnosis as of now (close() calls this once more at the end)."""
        self._collect()
        rows = self.table.live
        changed = self.ledger.changed(rows, provisional=self._provisional)
        reducer = self.meter.reducer
        if self._no_collective:
            pass
        elif reducer is not None and reducer.active(rows):  # a tensor changed if any of its shards did
            changed = reducer.changed(rows, changed)
        elif reducer is not None and reducer.used:
            reducer.warn_local()
        skipped = self.amp.final_count()
        if skipped is not None:
            self.ledger.skipped_steps = max(self.ledger.skipped_steps, skipped)
        never = diagnose(
            rows, self.ledger.evidence, changed, self._with_optimizer, skipped_steps=self.ledger.skipped_steps
        )
        steps = self.optimizer_steps if self._with_optimizer else self._calls
        facts = slice_facts(rows, self.ledger.slice_changes, self.meter.slice_grads, self.optimizer)
        if not self._no_collective and reducer is not None and reducer.active(rows):  # shards' slices at global indices
            facts = global_facts(rows, facts, reducer)
        model = self.model  # None once garbage-collected: the slices' owning modules are gone with it
        partly = (
            partly_updated(rows, facts, self.ledger.evidence, {r.name for r in never}, model, self.optimizer, steps)
            if model is not None
            else []
        )
        ledger = self.ledger
        stopped = stalled(
            rows,
            ledger.evidence,
            ledger.steps,
            ledger.measured_steps,
            self._with_optimizer,
            exclude={r.name for r in never},
        )
        return Report(
            never_updated=never,
            partly_updated=partly,
            stalled=stopped,
            hint=run_hint(rows, never, self._with_optimizer),
            alerts=list(self.alerts.fired) if self.alerts is not None else [],
            first_nonfinite=self.ledger.first_nonfinite,
            optimizer_steps=self.optimizer_steps if self._with_optimizer else self._calls,
            measured_steps=self.ledger.measured_steps,
            skipped_steps=self.ledger.skipped_steps,
            tracked_tensors=len(rows),
            policy=self.policy,
        )

    def close(self) -> Report:
        """Remove the hooks, diagnose, print and write the never-updated table. Idempotent."""
        if self._report is not None:
            return self._report
        if self._inert:
            self._report = Report(error="closed in a forked child: the parent process owns this run")
            return self._report
        self._model_gone.detach()
        for h in self._handles:
            h.remove()
        self._handles = []
        self.meter.abandon()
        self.meter.release()
        report = self._final_report()
        self._report = report
        try:
            if self.rank_zero:
                self._write_report(report)
                if self.print_report:  # where the files went first: the verdict stays the last line
                    where = self.where()
                    if where:
                        print(where, file=sys.stdout, flush=True)
                    print(report.table(), file=sys.stdout, flush=True)
            self.writers.close()  # logs how many records were dropped, if any (each cause was warned about once)
        finally:  # even when a strict writer raised: a closed logger is gone from every registry
            self.meter.optimizer = None  # a closed logger keeps neither the optimizer nor its tensors alive
            self.amp.optimizer = None
            if self in _active:
                _active.remove(self)
            atexit.unregister(self._atexit)
            if not any(gl.handle_signals for gl in _active):
                _restore_sigterm()
        return report

    def where(self) -> str | None:
        """Where this run's files went, and the commands that read them (None for memory-only writers)."""
        lines = []
        for w in self.writers.writers:
            run = getattr(w, "run", None)
            if isinstance(w, TensorBoardWriter):
                log_dir = w.log_dir
                root = os.path.dirname(os.path.normpath(log_dir)) or "."
                lines.append(
                    f"gradlog: TensorBoard event files in {log_dir} "
                    f"(view: tensorboard --logdir {root}; check: gradlog report {log_dir})"
                )
            elif run is not None and isinstance(getattr(run, "dir", None), str):
                run_dir = os.path.dirname(os.path.normpath(run.dir))
                lines.append(f"gradlog: W&B run files in {run_dir} (after exit: gradlog report {run_dir})")
        return "\n".join(lines) or None

    def _final_report(self) -> Report:
        """The diagnosis at close; if it fails, a warning and a Report that says so, never a traceback
        at the end of a training run (strict mode and distributed mismatches still raise)."""
        try:
            self.table.rescan()
            return self._local_report() if self._local_close else self.report()
        except DistributedMismatchError:
            raise
        except Exception as exc:
            if self.strict:
                raise
            key = _describe(exc)
            _warn(f"gradlog: the never-updated diagnosis failed at close() ({key}); the run's data is still written")
            return Report(
                optimizer_steps=self.optimizer_steps if self._with_optimizer else self._calls,
                measured_steps=self.ledger.measured_steps,
                skipped_steps=self.ledger.skipped_steps,
                tracked_tensors=len(self.table.live),
                error=key,
                policy=self.policy,
            )

    def _write_report(self, report: Report, provisional_step: int | None = None) -> None:
        """The three tables (never updated, partly updated, stalled), their counts, and the summary whose
        verdict is the judge's (`gradlog.verdict.judge`), the same line close() prints: final at close, or
        provisional (`gradlog/provisional/<name>`, with `final`=False and `as_of_step` in its summary) as of
        `provisional_step`. Every table goes through `out`, so a table added here is written in both forms."""
        out: Writer = self.writers if provisional_step is None else _Provisional(self.writers)
        step = max(self._last_index, 0)
        if provisional_step is None:
            final = {
                "gradlog/never_updated": float(len(report.never_updated)),
                "gradlog/partly_updated": float(len(report.partly_updated)),
                "gradlog/stalled": float(len(report.stalled)),
            }
            for reason, n in report.counts().items():
                final[f"gradlog/never_updated/{reason}"] = float(n)
            for reason, n in report.partly_counts().items():
                final[f"gradlog/partly_updated/{reason}"] = float(n)
            for reason, n in report.stalled_counts().items():
                final[f"gradlog/stalled/{reason}"] = float(n)
            self.writers.log_scalars(final, step)
        self._write_summary(report, out, provisional_step)  # the verdict first
        out.log_table("gradlog/never_updated", TABLE_COLUMNS, report.table_rows())
        out.log_table("gradlog/partly_updated", PARTLY_COLUMNS, report.partly_rows())
        out.log_table("gradlog/stalled", STALLED_COLUMNS, report.stalled_rows())
        if self.alerts is not None and self.alerts.fired:
            out.log_table("gradlog/alerts", ALERT_COLUMNS, self.alerts.rows())
        if self.policy.rules:  # so that `gradlog report` judges from disk as close() did
            out.log_table("gradlog/policy", POLICY_COLUMNS, self.policy.rows())
        if provisional_step is None and self.overview.every != 0 and self.overview.steps:
            self._final_overview(report)

    def _final_overview(self, report: Report) -> None:
        """The last image, with the diagnosis's findings marked (drawn here: training is over)."""
        try:
            self.overview.wait()
            self.overview.take()  # an image still being drawn is superseded by this one (all steps, final marks)
            marks = self.overview.live_marks()
            if report.first_nonfinite is not None:
                marks[report.first_nonfinite.name] = "nonfinite"
            for kind, records in (
                ("partly_updated", report.partly_updated),
                ("stalled", report.stalled),
                ("never_updated", report.never_updated),
            ):
                for rec in records:
                    marks[rec.name] = kind
            self.writers.log_image(OVERVIEW_TAG, self.overview.draw(marks), self.overview.steps[-1])
        except Exception as exc:
            if self.strict:
                raise
            _warn(f"gradlog: the final overview image failed ({_describe(exc)})")

    def _write_summary(self, report: Report, out: Writer, provisional_step: int | None) -> None:
        verdict = report.verdict
        summary = [
            ["verdict", verdict],
            ["status", report.status],
            ["healthy", str(report.healthy)],
            ["optimizer_steps", str(report.optimizer_steps)],
            ["measured_steps", str(report.measured_steps)],
            ["skipped_steps", str(report.skipped_steps)],
            ["tracked_tensors", str(report.tracked_tensors)],
            ["warnings", str(sum(report.warnings().values()))],
            ["notes", str(report.severities().get("note", 0))],
        ]
        if report.hint:
            summary.append(["hint", report.hint])
        if report.first_nonfinite is not None:
            summary += [
                ["first_nonfinite_step", str(report.first_nonfinite.step)],
                ["first_nonfinite_tensor", report.first_nonfinite.name],
                ["first_nonfinite_count", str(report.first_nonfinite.count)],
            ]
        if report.error is not None:
            summary.append(["error", report.error])
        if provisional_step is not None:
            summary += [["final", "False"], ["as_of_step", str(provisional_step)]]
            if self.meter.reducer is not None and self.meter.reducer.active(self.table.live):
                summary.append(["scope", "rank-local"])
        out.log_table("gradlog/summary", ["key", "value"], summary)

    # --- the end of a run that does not reach close(): signals, forks ------------------------
    def _close_on_signal(self) -> None:
        """SIGTERM: the final tables, with bounded waits for other ranks (they may get the signal later,
        or never): if they do not join, the answer is this rank's own, written as provisional."""
        reducer = self.meter.reducer
        if reducer is not None:
            reducer.timeout_s = min(reducer.timeout_s, SIGNAL_SYNC_TIMEOUT_S)
        try:
            self.close()
        except DistributedMismatchError as exc:
            logger.warning("gradlog: ranks did not meet at close() after SIGTERM (%s); writing this rank's answer", exc)
            self.meter.abandon()
            if self.rank_zero:
                self._write_provisional(max(self._last_index, 0), exact=True)
            self.writers.close()

    def _after_fork(self) -> None:
        """In a forked child (DataLoader workers, multiprocessing): the parent owns the run. No table, no
        writes, no waiting for writer threads that did not come along."""
        self._inert = True
        self.print_report = False
        self.writers.after_fork()
        atexit.unregister(self._atexit)
        self._model_gone.detach()

    def __enter__(self) -> GradLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_active: list[GradLogger] = []


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _warn(msg: str) -> None:
    """Trouble inside gradlog: a RuntimeWarning pointing at the user's code, and the gradlog logger."""
    warnings.warn(msg, RuntimeWarning, stacklevel=4)
    logger.warning(msg)


class _Provisional(Writer):
    """Routes the report's tables to `gradlog/provisional/<name>`; scalars are final-only."""

    threaded = True

    def __init__(self, inner: Writer) -> None:
        self.inner = inner

    def log_scalars(self, scalars: Any, step: int) -> None:
        pass

    def log_histogram(self, tag: str, hist: Any, step: int) -> None:
        pass

    def log_histograms(self, tags: Any, hists: Any, step: int) -> None:
        pass

    def log_table(self, name: str, columns: Any, rows: Any) -> None:
        self.inner.log_table(PROVISIONAL_PREFIX + name.removeprefix("gradlog/"), columns, rows)


# --- SIGTERM (torchrun, SLURM, Kubernetes, `kill`): atexit does not run, so gradlog closes here --------
class _Sigterm:
    installed = False
    previous: Any = None
    handling = False
    busy = 0  # log() calls in progress on the main thread
    deferred: int | None = None  # a SIGTERM that arrived during one: handled when it returns


def _install_sigterm() -> None:
    """Once, from the main thread, when nobody else handles SIGTERM from C (a Python handler is chained)."""
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        previous = signal.getsignal(signal.SIGTERM)
        if previous is _on_sigterm:  # already ours (another logger, a forked child): nothing new to chain
            _Sigterm.installed = True
            return
        if previous is None or previous is signal.SIG_IGN:  # a C-level handler, or deliberately ignored
            return
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):  # not the main interpreter, or no SIGTERM on this platform
        return
    _Sigterm.previous = previous
    _Sigterm.installed = True


def _restore_sigterm() -> None:
    """No logger left to close: put the previous handler back (if ours is still the one installed)."""
    if not _Sigterm.installed or threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, _Sigterm.previous)
    except (ValueError, OSError):
        return
    _Sigterm.installed = False


def _on_sigterm(signum: int, frame: Any) -> None:
    """Write the final tables, then do what the signal would have done without gradlog."""
    if _Sigterm.handling:  # a second SIGTERM while the first is handled: that one is already ending the run
        return
    if _Sigterm.busy:  # inside log(): finish it first, then come back here
        _Sigterm.deferred = signum
        return
    previous = _Sigterm.previous
    _Sigterm.handling = True
    try:
        if callable(previous):  # the program handles SIGTERM itself and may go on: keep logging
            for gl in list(_active):
                if gl.handle_signals and gl.rank_zero:
                    gl._write_provisional(max(gl._last_index, 0))
                    gl.writers.flush()
                    gl.writers.sync()
        else:
            for gl in list(_active):
                if gl.handle_signals:
                    gl._close_on_signal()
    except Exception as exc:  # the signal must still end the run
        logger.warning("gradlog: writing the tables on SIGTERM failed: %s", _describe(exc))
    finally:
        _Sigterm.handling = False
    if callable(previous):
        previous(signum, frame)
        return
    _restore_sigterm()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGTERM)  # the exit status stays the signal's (-15, or 143 in a shell)


def _after_fork_in_child() -> None:
    for gl in list(_active):
        gl._after_fork()
    _active.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _close_gone(ref: weakref.ref[GradLogger]) -> None:
    """The model was garbage-collected: close, at whatever point of the program that happened, so with no
    collective (other ranks are not there to meet it): under sharding the table is this rank's own."""
    gl = ref()
    if gl is not None:
        gl._local_close = True
        _close_ref(ref)


def _close_ref(ref: weakref.ref[GradLogger]) -> None:
    gl = ref()
    if gl is not None:
        try:
            gl.close()
        except Exception as exc:  # never turn interpreter exit into a traceback
            logger.warning("gradlog: closing at exit failed: %s", exc)


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
    for gl in list(_active):
        gl.note_clip(params, total, max_norm)
    return total


def log(step: int | None = None) -> None:
    """Publish the latest measurement of every open GradLogger (see `GradLogger.log`)."""
    if not _active:
        raise RuntimeError("gradlog.log() needs an open logger: call gradlog.watch(model, optimizer) first")
    for gl in list(_active):
        gl.log(step)


def close() -> Report | None:
    """Close every open GradLogger; returns the last one's Report (None if none was open)."""
    report = None
    for gl in list(_active):
        report = gl.close()
    return report
