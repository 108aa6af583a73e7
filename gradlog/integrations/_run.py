"""What every framework callback does: start a GradLogger when the framework has built its
optimizer, publish at its step counter, close at the end and keep the report."""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from gradlog.logger import GradLogger
from gradlog.verdict.report import Report


class CallbackRun:
    def __init__(self, gradlog_kwargs: dict[str, Any]) -> None:
        self.kwargs = gradlog_kwargs
        self.logger: GradLogger | None = None
        self.report: Report | None = None

    def start(self, model: nn.Module, optimizer: Any, default_dir: str) -> None:
        options = dict(self.kwargs)
        options.setdefault("log_dir", os.path.join(default_dir, "gradlog"))
        if self.logger is not None:  # training started again (resumed): a new run
            self.logger.close()
        self.logger = GradLogger(model, optimizer, **options)

    def publish(self, step: int) -> None:
        if self.logger is not None:
            self.logger.log(step)

    def finish(self) -> None:
        if self.logger is not None:
            self.report = self.logger.close()


class RunAccess:
    """`logger` and `report` of a callback's run, for users who want them after training."""

    run: CallbackRun

    @property
    def logger(self) -> GradLogger | None:
        return self.run.logger

    @property
    def report(self) -> Report | None:
        return self.run.report
