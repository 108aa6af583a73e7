"""The measured-step path: optimizer step hooks -> statistics on the device -> one host copy -> the ledger.

`Pipeline` owns what a measured step touches (the parameter table, the meter, the ledger of evidence,
the alerts); the diagnosis that reads that evidence back is `run.diagnosing`'s. `GradLogger` is the front
that creates it, publishes what it measured and ends the run.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import gradlog.run.lifecycle as lifecycle
from gradlog.measure import once
from gradlog.measure.amp import AmpState
from gradlog.measure.distributed import DistributedMismatchError, Reducer
from gradlog.measure.meter import Budget, Clip, Measurement, Meter
from gradlog.measure.params import ParamTable, Selection
from gradlog.measure.writes import WriteWatch
from gradlog.run.diagnosing import Diagnosis, Segments
from gradlog.run.options import Options
from gradlog.run.publishing import Failures
from gradlog.runformat.names import ALERT_COUNT, SKIPPED_STEPS
from gradlog.runformat.tags import HISTOGRAM_KINDS
from gradlog.verdict.ledger import Ledger
from gradlog.verdict.policy import Policy
from gradlog.verdict.report import Report

__all__ = ["IDLE_LOG_CALLS", "IdleWatch", "Pipeline"]


#: log() calls in a row with no step of the watched optimizer (and 4x the longest such gap seen between
#: two steps, for gradient accumulation) before gradlog says that nothing it watches is stepping.
IDLE_LOG_CALLS = 200


class IdleWatch:
    """log() keeps coming and the optimizer gradlog watches does not step: something else trains the
    model (a manual update, an optimizer whose steps torch's hooks do not see), or nothing does. Said once."""

    def __init__(self) -> None:
        self.steps_at_log = 0  # optimizer steps at the last log() call, and log() calls since they changed
        self.idle = 0
        self.longest = 0  # the most log() calls between two steps so far (gradient accumulation)
        self.warned = False

    def observe(self, steps: int, optimizer: torch.optim.Optimizer | None) -> None:
        """One log() call, with `steps` optimizer steps counted so far."""
        if steps != self.steps_at_log:
            self.steps_at_log = steps
            self.longest = max(self.longest, self.idle)
            self.idle = 0
            return
        self.idle += 1
        if self.idle == max(IDLE_LOG_CALLS, 4 * self.longest) and not self.warned:
            self.warned = True
            name = type(optimizer).__name__ if optimizer is not None else "the optimizer (garbage-collected)"
            once.warn(  # pointing at the user's log() call: observe <- Pipeline.on_log <- GradLogger.log <- user
                f"gradlog: log() was called {self.idle} times since the last step of {name}, the optimizer "
                f"gradlog measures ({steps} steps so far); nothing new is measured. If another optimizer trains "
                "the model now, pass it with gl.watch_optimizer(optimizer); if the weights are updated by hand, "
                "create the GradLogger with optimizer=None (it then measures inside log())",
                stacklevel=4,
            )


class Pipeline:
    """Counts optimizer steps, measures every `every`-th inside the step hooks, and keeps the evidence."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        every: int,
        options: Options,
        scaler: Any,
        selection: Selection,
        failures: Failures,
        rank_zero: bool,
    ) -> None:
        hist = options.histograms
        # Alerts read the host-side Measurement only; every rank judges the same reduced numbers, rank 0 says so
        alerts = options.alerts.make() if options.alerts is not None else None
        if alerts is not None:
            alerts.emit = rank_zero
        self.amp = AmpState(optimizer, scaler)
        self.with_optimizer = optimizer is not None
        self.every = every
        self.histogram_every = hist.histogram_every(every)
        self.count_zeros = hist.count_zeros
        self.alerts = alerts
        self.failures = failures
        self.rank_zero = rank_zero
        self.inert = False  # a forked child's copy: does nothing
        self.closed = False
        self.table = ParamTable(model, optimizer, selection)
        self.table.check_selection()
        self.meter = Meter(
            self.table,
            optimizer,
            hist.bins,
            hist.kinds,
            grad_scale=self.amp.inv_scale,
            skipped=self.amp.found_inf,
            reducer=Reducer(self._layout(hist.bins, hist.kinds, options.snapshot_budget), options.output.sync_timeout),
            skip_count=self.amp.count,
            sample=hist.sample,
            budget=options.snapshot_budget,
        )
        self.ledger = Ledger()
        self.ledger.fingerprint_new(self.table.live, self.table.generation)
        self.optimizer_steps = 0
        #: the line that sets a flagged tensor back, looked for once it is flagged (`measure/writes.py`)
        self.writes = WriteWatch(lambda: self.optimizer_steps)
        self.calls = 0  # log() calls: the step counter without an optimizer
        self.pending: Measurement | None = None  # fetched, not yet published
        self.handles: list[Any] = []
        self.idle = IdleWatch()
        self._clips: list[Clip] = []  # this step's gradient clipping, recorded only when the step is measured
        self._closure_pending = False  # a step(closure) is running and will be measured after its first call
        #: the optimizer whose steps are measured; another one that steps watched parameters takes its place
        self._current: weakref.ref[torch.optim.Optimizer] | None = None
        #: optimizers seen stepping that gradlog does not follow (id -> weak ref: an identity check per step)
        self._others: dict[int, weakref.ref[torch.optim.Optimizer]] = {}
        self._left: dict[int, weakref.ref[torch.optim.Optimizer]] = {}  # optimizers followed before
        self._warned_alternating = False
        self._stepping = False  # between the followed optimizer's pre- and post-hook
        self._global: Any = None
        if optimizer is not None:
            self._hook(optimizer)
            # torch runs global pre-hooks for every optimizer's step, before the optimizer's own: a new
            # optimizer that steps the watched parameters is seen at its first step, and followed from it
            untraced: Callable[[Callable[..., Any]], Any] = torch.compiler.disable  # untyped in torch
            self._global = register_optimizer_step_pre_hook(untraced(self._any_step))

    def _hook(self, optimizer: torch.optim.Optimizer) -> None:
        """Measure `optimizer`'s steps: its own step hooks."""
        self._current = weakref.ref(optimizer)
        # Untraced: a compiled `optimizer.step()` (torch.compile(opt.step)) would otherwise trace the hooks
        # into graphs of their own, split off by torch's own graph_break() calls around the step body (2
        # breaks and 2 graphs more than without gradlog, and recompiles as the step counter changes).
        # Dynamo skips a disabled hook, which runs eagerly around the compiled step instead: the same
        # graphs and breaks as without gradlog. Costs ~1 us per hook call in eager mode (the eval-frame swap).
        untraced: Callable[[Callable[..., Any]], Any] = torch.compiler.disable  # untyped in torch
        self.handles.append(optimizer.register_step_pre_hook(untraced(self._pre_step)))
        self.handles.append(optimizer.register_step_post_hook(untraced(self._post_step)))

    def start_at(self, step: int) -> None:
        """A resumed run: count steps on from the earlier segments' `step` (the x-axis continues)."""
        self.optimizer_steps = self.calls = step

    @property
    def steps(self) -> int:
        """Optimizer steps so far (log() calls without an optimizer)."""
        return self.optimizer_steps if self.with_optimizer else self.calls

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer whose steps are measured now (None without one, or once it was garbage-collected)."""
        return self._current() if self._current is not None else None

    def _any_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Every optimizer step in the process comes here first: an identity check for the one followed
        and for those known not to step watched parameters; an unseen one is looked at once."""
        current = self._current
        if self._stepping or (current is not None and current() is optimizer):
            return  # the followed optimizer, or one it steps inside its own step (Lookahead's inner optimizer)
        seen = self._others.get(id(optimizer))
        if seen is not None and seen() is optimizer:
            return
        self.guarded(lambda: self._consider(optimizer))

    def _consider(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer not seen before steps: follow it when it replaces the followed one (it steps watched
        parameters the followed one also holds, and no other logger watches it), otherwise remember it as
        one to let pass."""
        if self.inert or self.closed:
            return
        before = self.optimizer
        left = self._left.get(id(optimizer))
        if left is not None and left() is optimizer:  # two optimizers take turns: following both ways would flap
            self._others[id(optimizer)] = left
            if not self._warned_alternating:
                self._warned_alternating = True
                lifecycle.warn(
                    f"gradlog: {type(optimizer).__name__} and {type(before).__name__} both step the watched "
                    f"parameters, taking turns; gradlog measures {type(before).__name__}'s steps only. Create one "
                    "GradLogger per optimizer, each with include= naming the tensors that optimizer trains"
                )
            return
        if (
            not self._steps_watched(optimizer)
            or any(gl.optimizer is optimizer for gl in lifecycle.ACTIVE)
            or (before is not None and not _shared(before, optimizer))
        ):  # a second optimizer beside the watched one (sparse embeddings, Muon + AdamW) is no replacement
            self._others[id(optimizer)] = weakref.ref(optimizer)
            return
        self.follow(optimizer)
        instead = f" instead of {type(before).__name__}'s" if before is not None else ""
        lifecycle.warn(
            f"gradlog: a new optimizer ({type(optimizer).__name__}) steps the watched parameters; gradlog now "
            f"measures its steps{instead}, counting on from the run's {self.optimizer_steps} optimizer steps. "
            "Pass it with gl.watch_optimizer(optimizer) when you create it to say so without this warning"
        )

    def _steps_watched(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether `optimizer` holds a watched tensor (one of the model's, selected by include/exclude)."""
        watched = {id(p) for p in (r.held() for r in self.table.live) if p is not None}
        return any(id(p) in watched for g in optimizer.param_groups for p in g["params"])

    def watch(self, optimizer: torch.optim.Optimizer, closed: bool) -> None:
        """`GradLogger.watch_optimizer`: follow `optimizer` from now on, if this run can (`closed`: the
        logger's run has ended)."""
        if closed:
            raise RuntimeError("GradLogger.watch_optimizer() called after close(); create a new GradLogger")
        if not self.with_optimizer:
            raise ValueError(
                "watch_optimizer(): this GradLogger was made with optimizer=None and measures inside log(); "
                "create it with the optimizer instead"
            )
        self.follow(optimizer)

    def follow(self, optimizer: torch.optim.Optimizer) -> None:
        """Measure `optimizer`'s steps from now on instead of the current one's; the tensors it adds are
        tracked from its next measured step on. Registered hooks fire for the step in progress too (torch
        runs the global pre-hooks first, then the optimizer's own)."""
        before = self.optimizer
        if before is optimizer:
            return
        if before is not None:
            self._left[id(before)] = weakref.ref(before)
        self._others.pop(id(optimizer), None)
        for h in self.handles:
            h.remove()
        self.handles = []
        self._hook(optimizer)
        self.meter.optimizer = optimizer
        self.amp.follow(optimizer)
        self.table.follow(optimizer)

    def detach(self) -> None:
        """Remove the hooks and drop what a measurement in flight holds (close())."""
        self.closed = True
        for h in self.handles:
            h.remove()
        self.handles = []
        if self._global is not None:
            self._global.remove()
            self._global = None
        self.meter.abandon()
        self.meter.release()
        self.writes.stop()

    def release_optimizer(self) -> None:
        """A closed logger keeps neither the optimizer nor its tensors alive."""
        self.meter.optimizer = None
        self.amp.optimizer = None

    def on_log(self, step: int | None) -> None:
        """A log() call: without an optimizer it counts (and may measure); with one, it watches for idleness."""
        if not self.with_optimizer:
            self.count_call(step)
        else:
            self.idle.observe(self.optimizer_steps, self.optimizer)

    def count_call(self, step: int | None) -> None:
        """Without an optimizer there are no step hooks: log() counts, and measures every `every`-th call."""
        call = self.calls
        self.calls += 1
        if self.meter.reducer is not None:  # the collective compares it: a skipped call is caught at once
            self.meter.reducer.call = float(call if step is None else step)
        if call % self.every == 0:
            self.guarded(lambda: self._measure_now(call))

    def take(self) -> Measurement | None:
        """The latest measurement not yet handed out (fetched to the host first if it is still in flight)."""
        self.guarded(self.collect)
        m, self.pending = self.pending, None
        return m

    def histogram_step(self, index: int) -> bool:
        """Whether measured step `index` is a histogram step (every measured step when histograms are off)."""
        return not self.histogram_every or index % self.histogram_every == 0

    def run_scalars(self) -> dict[str, float]:
        """The run's counters written with every published step: skipped steps, alerts fired."""
        extra = {SKIPPED_STEPS: float(self.ledger.skipped_steps)}
        if self.alerts is not None:
            extra[ALERT_COUNT] = float(len(self.alerts.fired))
        return extra

    def rank_local(self) -> bool:
        """Whether this rank's answer covers only its shards (FSDP2/DTensor)."""
        reducer = self.meter.reducer
        return reducer is not None and reducer.active(self.table.live)

    # --- hooks (the hot path: unmeasured steps only count) ---------------------------------
    def _pre_step(
        self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        self._stepping = True
        if self.inert:
            return None
        if self.amp.scaler is not None:
            self.guarded(self.amp.before_step)
        index = self.optimizer_steps
        self.optimizer_steps += 1
        if index % self.every:
            return None
        # args as the hook sees them: (optimizer, *positional), so a positional closure is args[1]
        closure = kwargs.get("closure") if "closure" in kwargs else args[1] if len(args) > 1 else None
        if not callable(closure):
            self.guarded(lambda: self._begin(index, snapshot=True))
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
                self.guarded(lambda: self._begin(index, snapshot=True))
            return result

        return measured_closure

    def _post_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._stepping = False
        if self.inert:
            return
        self._clips = []
        self._closure_pending = False
        if self.amp.fused:
            self.guarded(self.amp.after_step)
        if self.meter.busy:
            self.guarded(self.meter.finish)

    def guarded(self, work: Callable[[], object]) -> None:
        """Measuring must never kill a training run: a failure drops this step's measurement, once warned."""
        try:
            work()
        except DistributedMismatchError:
            raise  # carrying on would hang or mix up collectives: this one must stop the run
        except Exception as exc:
            self.meter.abandon()
            step = self.optimizer_steps - 1
            if out_of_memory(exc) and not self.failures.strict:
                self._out_of_memory(step)
                return
            self.failures.handle(exc, lambda key: f"gradlog: measuring step {step} failed ({key}); training continues")

    def _out_of_memory(self, step: int) -> None:
        """An allocation for measuring failed: the step's measurement is dropped (its copies freed with it), said
        once however often it happens (each failure's message names other sizes)."""
        once = self.failures.once
        if OUT_OF_MEMORY not in once.seen:
            budget = self.meter.budget
            once(
                OUT_OF_MEMORY,
                f"gradlog: out of memory while measuring step {step}: that step's measurement is skipped and training "
                f"continues (this is said once; skipped steps are missing from the measured steps). A smaller "
                f"snapshot_budget= (now {budget!r}) or histograms=False needs less.",
                stacklevel=3,
            )

    def _begin(self, index: int, snapshot: bool) -> None:
        self.collect()  # a measurement the user never published still feeds the ledger
        self.table.rescan()  # parameters materialised or added since the last measured step
        self._release_freed()
        self.ledger.fingerprint_new(self.table.live, self.table.generation)
        self.ledger.check_set_back(self.table.live, index)  # weights set back outside the optimizer (the screen's)
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
            grads.forget(index)
            self.meter.slice_moves.forget(index)

    def clip_due(self) -> bool:
        """Whether gradients clipped now belong to a step that will be measured (so clipping is worth noting)."""
        if self.closed:
            return False
        if self._closure_pending:  # inside step(closure): clipping runs in the closure, before gradlog measures
            return True
        if not self.with_optimizer:
            return self.calls % self.every == 0
        return self.optimizer_steps % self.every == 0

    def measures_next(self) -> bool:
        """Whether the followed optimizer's next step is measured."""
        return self.with_optimizer and not self.inert and self.clip_due()

    def note_clip(self, params: list[torch.Tensor], total: torch.Tensor, max_norm: float) -> None:
        """Gradients of `params` were clipped with total norm `total` (before clipping) to `max_norm`: the
        next measurement reports their norms before clipping and the clip coefficient. Cheap: no device work."""
        if self.clip_due() and isinstance(total, torch.Tensor):
            self._clips.append(Clip(frozenset(map(id, params)), total.detach(), float(max_norm)))

    def _measure_now(self, call: int) -> None:
        """Without an optimizer there are no step hooks: measure inside log()."""
        self._begin(call, snapshot=False)
        self.meter.finish()

    def _layout(self, bins: int, kinds: tuple[str, ...] | list[str], budget: Budget = None) -> dict[str, float]:
        """Settings every rank must share under FSDP2/DTensor (compared across ranks before use). The snapshot
        budget too: the ranks copy the same rows from it (`Meter._pick`) and reduce them row by row."""
        return {
            "every": self.every,
            "histogram_every": self.histogram_every,
            "count_zeros": -1 if self.count_zeros is None else int(self.count_zeros),
            "bins": bins,
            "histogram_kinds (bits)": sum(1 << i for i, k in enumerate(HISTOGRAM_KINDS) if k in kinds),
            "optimizer": self.with_optimizer,
            "snapshot_budget (bytes; auto -1, None 0)": -1 if budget == "auto" else int(budget or 0),
        }

    def collect(self) -> Measurement | None:
        """Bring a finished measurement to the host (its one copy) and feed the ledger."""
        m = self.meter.fetch()
        if m is not None:
            self.ledger.observe(m)
            flagged, self.ledger.to_watch = set(self.ledger.to_watch), []
            optimizer = self.optimizer
            if flagged and not self.closed and optimizer is not None:  # look for the line that writes it
                self.writes.watch([r for r in m.rows if r.index in flagged], optimizer)
            if self.alerts is not None:  # every rank judges the same reduced numbers; only rank 0 says so
                self.alerts.emit = self.rank_zero
                self.alerts.observe(m)
            self.pending = m
        return m

    def diagnose(
        self,
        collective: bool,
        reuse: bool,
        optimizer: torch.optim.Optimizer | None,
        policy: Policy,
        segments: Segments | None = None,
    ) -> Report:
        """The diagnosis of the evidence so far (`run.diagnosing.Diagnosis`), once the pending measurement
        is in the ledger. `collective`, `reuse` and `segments`: see `Diagnosis`."""
        self.collect()
        return Diagnosis(
            self.table,
            self.meter,
            self.ledger,
            self.amp,
            self.alerts,
            self.with_optimizer,
            self.steps,
            optimizer,
            policy,
            collective,
            reuse,
            segments,
            self.writes,
        ).report()

    def final_report(self, diagnose: Callable[[], Report], policy: Policy, strict: bool) -> Report:
        """The diagnosis at close (`diagnose`, after a last look for new tensors); if it fails, a warning
        and a Report that says so, never a traceback at the end of a training run (strict mode and
        distributed mismatches still raise)."""
        if self.alerts is not None:  # spike candidates still waiting on later norms are judged on what came
            self.alerts.emit = self.rank_zero
            self.alerts.finish()
        try:
            self.table.rescan()
            return diagnose()
        except DistributedMismatchError:
            raise
        except Exception as exc:
            if strict:
                raise
            key = lifecycle.describe(exc)
            lifecycle.warn(
                f"gradlog: the never-updated diagnosis failed at close() ({key}); the run's data is still written"
            )
            return Report(
                optimizer_steps=self.steps,
                measured_steps=self.ledger.measured_steps,
                skipped_steps=self.ledger.skipped_steps,
                tracked_tensors=len(self.table.live),
                error=key,
                policy=policy,
            )


OUT_OF_MEMORY = "out of memory"


def out_of_memory(exc: BaseException) -> bool:
    """A failed allocation: torch's (CUDA and others), Python's, or the CPU allocator's RuntimeError."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def _shared(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    """Whether two optimizers hold a parameter in common: the newer one replaces the older (two-phase
    fine-tuning rebuilds the optimizer over the head and the body), rather than training other tensors."""
    held = {id(p) for g in a.param_groups for p in g["params"]}
    return any(id(p) in held for g in b.param_groups for p in g["params"])
