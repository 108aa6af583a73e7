"""What every framework callback does: start a GradLogger when the framework has built its
optimizer, publish at its step counter, close at the end and keep the report."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from gradlog.run.check import LossFn, RngState, check
from gradlog.run.logger import GradLogger
from gradlog.run.options import Output
from gradlog.verdict.report import Report


class CallbackRun:
    def __init__(self, gradlog_kwargs: dict[str, Any], check_first: bool = False) -> None:
        self.kwargs = gradlog_kwargs
        self.logger: GradLogger | None = None
        self.report: Report | None = None
        self.check_first = bool(check_first)
        self.check_report: Report | None = None

    def preflight(self, model: nn.Module, optimizer: Any, batch: Any, loss_fn: LossFn | None = None) -> None:
        """`gradlog.check` on the first batch, before this run's logger hooks the optimizer (so the
        check's step is not counted as the run's first), printed unless print_report=False."""
        if self.check_report is not None:
            return
        kwargs = {k: self.kwargs[k] for k in ("include", "exclude") if k in self.kwargs}
        self.check_report = check(
            model, optimizer, batch, loss_fn=loss_fn, print_report=self.kwargs.get("print_report", True), **kwargs
        )

    def start(self, model: nn.Module, optimizer: Any, default_dir: str, resuming: bool = False) -> None:
        """`resuming`: the framework restored a checkpoint (its step count is past 0), so the gradlog run
        in the same folder is continued (`Output(resume=True)`) unless the user's writer says otherwise."""
        options = dict(self.kwargs)
        options.setdefault("log_dir", os.path.join(default_dir, "gradlog"))
        if resuming:
            writer = options.get("writer", "tensorboard")
            if not isinstance(writer, Output):
                options["writer"] = Output(writer=writer, resume=True)
            elif writer.resume is False:
                options["writer"] = dataclasses.replace(writer, resume=True)
        if self.logger is not None:  # training started again (resumed): a new run
            self.logger.close()
        self.logger = GradLogger(model, optimizer, **options)

    def publish(self, step: int) -> None:
        if self.logger is not None:
            self.logger.log(step)

    def finish(self) -> None:
        if self.logger is not None:
            self.report = self.logger.close()


def first_batch(loader: Any) -> Any:
    """One batch drawn the way the loop draws its first, without disturbing the loop.

    Reads the plain torch DataLoader under a wrapper (accelerate's keeps per-iteration state), and
    puts back every random generator the draw may advance (the global ones, a sampler's own), so
    the training loop's shuffle order is unchanged.
    """
    base = getattr(loader, "base_dataloader", loader)
    generators = []
    for holder in (
        base,
        getattr(base, "sampler", None),
        getattr(getattr(base, "batch_sampler", None), "sampler", None),
    ):
        g = getattr(holder, "generator", None)
        if isinstance(g, torch.Generator):
            generators.append(g)
    rng = RngState(*generators)
    try:
        it = iter(base)
        batch = next(it)
        del it
    finally:
        rng.restore()
    return batch


def to_device(batch: Any, device: torch.device) -> Any:
    """Tensors of a (nested) batch moved to the model's device; containers keep their type where they can."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        moved = {k: to_device(v, device) for k, v in batch.items()}
        try:
            factory: Any = type(batch)
            return factory(moved)
        except Exception:  # a mapping type that cannot be built from a dict
            return moved
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


class RunAccess:
    """`logger` and `report` of a callback's run, for users who want them after training."""

    run: CallbackRun

    @property
    def check_report(self) -> Report | None:
        """The report of `check_first=True`'s dry step on the first batch (None without it)."""
        return self.run.check_report

    @property
    def logger(self) -> GradLogger | None:
        return self.run.logger

    @property
    def report(self) -> Report | None:
        return self.run.report
