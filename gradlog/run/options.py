"""The option objects that group `GradLogger`'s tuning knobs, validated once, where they are made.

`GradLogger` takes at most twelve parameters; everything a user rarely touches lives in one of these,
each with defaults that need no tuning:

- `HistogramOptions` (``histograms=``): which histograms, how often, how many bins, zero counting and
  the overview image;
- `AlertOptions` (``alerts=``): the thresholds of the alerts raised during training;
- `Output` (``writer=``): where records go and how long they may take: the writer and its options,
  the writer timeout, provisional tables, SIGTERM handling, the collective timeout, strict mode.

A bad value raises `ValueError` naming it when the object is made, not at the first measured step.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import operator
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, NamedTuple, TypeVar, cast

import torch

from gradlog.measure.bucketing import DEFAULT_SAMPLE
from gradlog.measure.distributed import DEFAULT_TIMEOUT_S as DEFAULT_SYNC_TIMEOUT_S
from gradlog.measure.histogram import MAX_BINS
from gradlog.measure.meter import SNAPSHOT_FLOOR, SNAPSHOT_SHARE, Budget
from gradlog.runformat.tags import HISTOGRAM_KINDS
from gradlog.verdict.alerts import (
    DEFAULT_NO_GRAD_PATIENCE,
    DEFAULT_RATIO_DECADES,
    DEFAULT_RATIO_MIN_PEERS,
    DEFAULT_RATIO_PATIENCE,
    DEFAULT_SPIKE_FACTOR,
    Alerts,
    check_band,
)
from gradlog.writers import REGISTRY, Writer, WriterSpec
from gradlog.writers.guard import DEFAULT_TIMEOUT_S as DEFAULT_WRITER_TIMEOUT_S
from gradlog.writers.overview import check_every as check_overview_every

#: Seconds of wall time between two provisional tables (written on histogram steps; the first one always).
DEFAULT_PROVISIONAL_EVERY_S = 120.0

__all__ = [
    "DEFAULT_PROVISIONAL_EVERY_S",
    "AlertOptions",
    "HistogramOptions",
    "Options",
    "Output",
    "alert_options",
    "check_every",
    "check_spelling",
    "histogram_options",
    "output",
    "spelled",
    "whole_step",
    "writer_options",
]


def _seconds(name: str, value: object, allow_zero: bool) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        verb = "" if name.endswith(" or") else " must be"
        raise ValueError(f"{name}{verb} a number of seconds {bound}, got {value!r}")
    return float(value)  # type: ignore[arg-type]  # checked just above


class _Spelled:
    """Option objects: a misspelt keyword names the nearest field before the dataclass's bare TypeError."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        check_spelling(cls.__name__, kwargs, [f.name for f in fields(cls)])  # type: ignore[arg-type]
        return super().__new__(cls)


@dataclass(frozen=True)
class HistogramOptions(_Spelled):
    """``histograms=gradlog.HistogramOptions(...)``: histograms and the other work done on histogram steps.

    - `every`: histograms every k-th optimizer step, a multiple of the logger's ``every`` (None: on every
      measured step);
    - `kinds`: which of ``"grad"``, ``"weight"``, ``"update"`` (an empty tuple: no histograms, as
      ``histograms=False``);
    - `bins`: buckets per histogram, 1..512;
    - `count_zeros`: ``grad_zero_frac`` (a pass of its own) on histogram steps (None), on every measured
      step (True) or never (False);
    - `overview_every`: the overview heatmap image every that many published steps (None: on histogram
      steps, at most one per 20 s; 0: never);
    - `sample`: a tensor of more entries than this has its histogram's buckets counted on that many of its
      entries, at fixed random positions, and scaled to its size (min, max, the sum of squares and the NaN/Inf
      count stay exact, the sum is the sample's scaled; a
      bucket holding a share q is off by about sqrt(q (1 - q) / sample) of the total): the histograms' cost
      then follows the number of tensors, not of parameters. None: every entry is counted (exact).
    """

    every: int | None = None
    kinds: tuple[str, ...] = HISTOGRAM_KINDS
    bins: int = 64
    count_zeros: bool | None = None
    overview_every: int | None = None
    sample: int | None = DEFAULT_SAMPLE

    def __post_init__(self) -> None:
        if self.every is not None and (
            isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1
        ):
            raise ValueError(
                f"HistogramOptions(every={self.every!r}): must be None (every measured step) or a positive multiple "
                "of the logger's every"
            )
        kinds = (self.kinds,) if isinstance(self.kinds, str) else tuple(self.kinds)
        bad = [k for k in kinds if k not in HISTOGRAM_KINDS]
        if bad:
            raise ValueError(
                f"HistogramOptions(kinds=...): unknown histogram kinds {bad}; choose from {list(HISTOGRAM_KINDS)}"
            )
        object.__setattr__(self, "kinds", kinds)
        if isinstance(self.bins, bool) or not isinstance(self.bins, int) or not 1 <= self.bins <= MAX_BINS:
            raise ValueError(f"HistogramOptions: bins must be an integer in 1..{MAX_BINS}, got {self.bins!r}")
        if self.count_zeros is not None and not isinstance(self.count_zeros, bool):
            raise ValueError(
                "HistogramOptions: count_zeros must be None (count on histogram steps), True (every measured "
                f"step) or False, got {self.count_zeros!r}"
            )
        check_overview_every(self.overview_every)
        if self.sample is not None and (
            isinstance(self.sample, bool) or not isinstance(self.sample, int) or self.sample < 1
        ):
            raise ValueError(
                f"HistogramOptions(sample={self.sample!r}): must be a positive number of entries (default "
                f"{DEFAULT_SAMPLE}) or None (exact histograms)"
            )

    @property
    def enabled(self) -> bool:
        return bool(self.kinds)

    def histogram_every(self, every: int) -> int:
        """The optimizer-step period of histograms under the logger's `every` (0: no histograms)."""
        if not self.enabled:
            return 0
        if self.every is not None and self.every % every:
            raise ValueError(f"HistogramOptions(every={self.every}) must be a positive multiple of every={every}")
        return self.every or every


@dataclass(frozen=True)
class AlertOptions(_Spelled):
    """``alerts=gradlog.AlertOptions(...)``: thresholds of the alerts raised during training.

    - `ratio_band`: None (default) calibrates to the run: a tensor's update is an outlier when it sits
      `ratio_decades` or more (and well outside the spread) from the median of its peers of the same
      role, for `ratio_patience` measured steps in a row; a (low, high) pair judges the update ratio
      ‖Δw‖/‖w‖ against that fixed band instead (1-D tensors get a wider one);
    - `ratio_decades`: how many decades from its peers' median an update must sit to be an outlier;
    - `ratio_min_peers`: tensors of one role needed before they are compared (fewer: not judged);
    - `ratio_patience`: measured steps in a row out of line before it alerts;
    - `no_grad_patience`: measured steps in a row with no gradient before it alerts;
    - `spike_factor`: a gradient norm this many times its own recent median is a spike.
    """

    ratio_band: tuple[float, float] | None = None
    ratio_decades: float = DEFAULT_RATIO_DECADES
    ratio_min_peers: int = DEFAULT_RATIO_MIN_PEERS
    ratio_patience: int = DEFAULT_RATIO_PATIENCE
    no_grad_patience: int = DEFAULT_NO_GRAD_PATIENCE
    spike_factor: float = DEFAULT_SPIKE_FACTOR

    def __post_init__(self) -> None:
        self.make()  # the one validation: Alerts' own (it names the bad value and the valid range)
        if self.ratio_band is not None:
            object.__setattr__(self, "ratio_band", check_band(self.ratio_band))

    def make(self) -> Alerts:
        """A fresh `Alerts` watcher with these thresholds (one per logger: it keeps per-tensor state)."""
        return Alerts(
            self.ratio_band,
            self.ratio_patience,
            self.no_grad_patience,
            self.spike_factor,
            ratio_decades=self.ratio_decades,
            ratio_min_peers=self.ratio_min_peers,
        )


def check_resume(value: object) -> None:
    if value not in (False, True, "auto") or (isinstance(value, int) and not isinstance(value, bool)):
        raise ValueError(
            f"Output(resume={value!r}): must be False (a new run), True (continue the gradlog run in log_dir) "
            "or 'auto' (continue it when the folder holds an earlier run of this model and the optimizer "
            "state was loaded from a checkpoint)"
        )


@dataclass(frozen=True)
class Output(_Spelled):
    """``writer=gradlog.Output(...)``: where records go, and what keeps them coming when things go wrong.

    - `writer`: a registered name (``"tensorboard"``, ``"wandb"``, ``"memory"``), a `gradlog.Writer`, or a
      list of either;
    - `options`: keyword arguments for the writers gradlog constructs from names (``{"project": "p"}``
      for W&B, ``{"fsync": True}`` for TensorBoard); with several, each key goes to the writers that take
      it, or one dict per writer name (``{"wandb": {...}, "tensorboard": {...}}``);
    - `timeout`: seconds one writer call may take before its records are dropped and counted;
    - `provisional_every`: seconds between two provisional tables, the answer a ``kill -9`` leaves on
      disk (0: every histogram step; None: none);
    - `handle_signals`: on SIGTERM, write the final tables before the process ends;
    - `sync_timeout`: seconds a rank waits for the others in gradlog's collectives (FSDP2/DTensor);
    - `strict`: raise instead of warning when measuring or writing fails (for tests and debugging);
    - `resume`: continue the gradlog run in ``log_dir`` (TensorBoard, or W&B: the same W&B run id) as one
      logical run (a preempted job restarted from its checkpoint): True, or ``"auto"`` (only when that run
      is of this model and the optimizer state was loaded from a checkpoint); False (default) starts a new
      run. See docs/resume.md.
    """

    writer: WriterSpec = "tensorboard"
    options: Mapping[str, Any] = field(default_factory=dict)
    timeout: float = DEFAULT_WRITER_TIMEOUT_S
    provisional_every: float | None = DEFAULT_PROVISIONAL_EVERY_S
    handle_signals: bool = True
    sync_timeout: float = DEFAULT_SYNC_TIMEOUT_S
    strict: bool = False
    resume: bool | Literal["auto"] = False

    def __post_init__(self) -> None:
        check_resume(self.resume)
        if isinstance(self.writer, Output):
            raise ValueError("Output(writer=Output(...)): pass the writer name or instance, not another Output")
        check_writer(self.writer)
        if self.options is None:
            object.__setattr__(self, "options", {})
        if not isinstance(self.options, Mapping):
            raise ValueError(f"Output(options=...) must be a dict of writer keyword arguments, got {self.options!r}")
        _seconds("Output: timeout", self.timeout, allow_zero=False)
        if self.provisional_every is not None:
            _seconds("Output: provisional_every must be None (no provisional tables) or", self.provisional_every, True)
        _seconds("Output: sync_timeout", self.sync_timeout, allow_zero=False)
        for name in ("handle_signals", "strict"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Output({name}=...) must be True or False, got {getattr(self, name)!r}")


def check_writer(spec: object) -> None:
    """`writer=` holds registered names and `Writer` instances only: a typo, a class or a stray value is named
    where the user wrote it, not as "'int' object is not iterable" from deep inside."""
    valid = ", ".join(repr(n) for n in sorted(REGISTRY))
    items = [spec] if isinstance(spec, (str, Writer, type)) else spec
    if not isinstance(items, (list, tuple)):
        raise TypeError(
            f"writer={spec!r}: must be a writer name ({valid}), a gradlog.Writer instance or a list of them"
        )
    for item in items:
        if isinstance(item, Writer):
            continue
        if isinstance(item, str):
            if item not in REGISTRY:
                near = difflib.get_close_matches(item, list(REGISTRY), n=1, cutoff=0.5)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise ValueError(
                    f"unknown writer {item!r}; valid names are {valid}, or pass a gradlog.Writer instance{hint}"
                )
        elif isinstance(item, type) and issubclass(item, Writer):
            raise TypeError(f"writer={item.__name__}: pass an instance, {item.__name__}(...), not the class")
        else:
            raise TypeError(
                f"writer={item!r}: must be a writer name ({valid}), a gradlog.Writer instance or a list of them; "
                f"got {type(item).__name__}"
            )


def histogram_options(value: bool | HistogramOptions) -> HistogramOptions:
    if isinstance(value, HistogramOptions):
        return value
    if isinstance(value, bool):
        return HistogramOptions() if value else HistogramOptions(kinds=())
    raise ValueError(f"histograms must be True, False or a gradlog.HistogramOptions(...), got {value!r}")


def alert_options(value: bool | AlertOptions) -> AlertOptions | None:
    if isinstance(value, AlertOptions):
        return value
    if isinstance(value, bool):
        return AlertOptions() if value else None
    raise ValueError(f"alerts must be True, False or a gradlog.AlertOptions(...), got {value!r}")


def output(value: WriterSpec | Output) -> Output:
    return value if isinstance(value, Output) else Output(writer=value)


def check_spelling(who: str, kwargs: Mapping[str, object], known: Iterable[str]) -> None:
    """A keyword `who` does not take: "did you mean `histograms=`?" for the nearest one it takes, or the list
    of those it takes (issue 41: `histogram=False` got Python's bare "unexpected keyword argument")."""
    valid = list(known)
    for key in kwargs:
        if key in valid:
            continue
        near = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
        hint = f"did you mean `{near[0]}=`?" if near else f"it takes {', '.join(f'{k}=' for k in valid)}"
        raise TypeError(f"{who}() got an unexpected keyword argument {key!r}: {hint}")


_Init = TypeVar("_Init", bound=Callable[..., None])


def spelled(init: _Init) -> _Init:
    """`__init__` that names the nearest keyword it takes for a misspelt one (`check_spelling`) before
    Python's bare "unexpected keyword argument"; help() and IDEs still show its own parameters (`__wrapped__`)."""
    known = [name for name in inspect.signature(init).parameters if name != "self"]

    @functools.wraps(init)
    def checked(self: object, *args: Any, **kwargs: Any) -> None:
        check_spelling(type(self).__name__, kwargs, known)
        init(self, *args, **kwargs)

    return cast(_Init, checked)


class Options(NamedTuple):
    """The validated option objects a logger runs with (`GradLogger.options`)."""

    histograms: HistogramOptions
    alerts: AlertOptions | None
    output: Output
    snapshot_budget: Budget = "auto"


def check_budget(value: object) -> Budget:
    """`GradLogger(snapshot_budget=...)`: "auto", a positive number of bytes, or None."""
    if value is None or value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"snapshot_budget={value!r}: must be 'auto' (at most {SNAPSHOT_SHARE:.0%} of the trainable weights' "
            f"bytes, or {SNAPSHOT_FLOOR >> 20} MB where that is more), a positive number of bytes, or None (every "
            "tensor copied on every measured step)"
        )
    return value


def check_every(every: object) -> int:
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be an integer >= 1 (measure every k-th optimizer step), got {every!r}")
    return every


def writer_options(out: Output, log_dir: str | None) -> tuple[str | None, dict[str, Any], bool]:
    """(log_dir, the writers' keyword arguments, the writers' strictness) from `out` and ``log_dir=``.
    `log_dir` in the writer options (the writers' own spelling) is accepted where it cannot be ambiguous;
    the writer options may set the writers' own strictness."""
    options = dict(out.options)
    if "log_dir" in options:
        opt_dir = options.pop("log_dir")
        if log_dir is not None and os.fspath(opt_dir) != os.fspath(log_dir):
            raise ValueError(
                f"log_dir={log_dir!r} and Output(options={{'log_dir': {opt_dir!r}}}) disagree; pass log_dir= only"
            )
        log_dir = opt_dir
    if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
        raise TypeError(
            f"log_dir={log_dir!r}: must be a folder path (a str or pathlib.Path) such as 'runs/exp1', "
            f"got {type(log_dir).__name__}"
        )
    if log_dir is not None and os.path.exists(log_dir) and not os.path.isdir(log_dir):
        raise ValueError(
            f"log_dir={os.fspath(log_dir)!r} is a file, not a folder: gradlog writes a run's files into a folder "
            "(made if missing); pass a folder path such as 'runs/exp1'"
        )
    strict = bool(options.pop("strict", out.strict))
    return log_dir, options, strict


def whole_step(step: object) -> int:
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
