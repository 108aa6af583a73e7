"""`GradlogCallback`: gradlog inside a Hugging Face `Trainer`, which owns the loop and the optimizer.

Importing this module imports transformers; gradlog itself never does.
"""

from __future__ import annotations

import os
from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "gradlog.integrations.huggingface needs transformers: pip install 'gradlog[huggingface]' "
        "(or create gradlog.GradLogger(model, optimizer) yourself in your own loop)"
    ) from exc

from gradlog.logger import GradLogger
from gradlog.report import Report


class GradlogCallback(TrainerCallback):
    """Creates a `GradLogger` when training begins (the Trainer builds its optimizer only then),
    publishes at each optimizer step with the Trainer's `global_step` as x-axis, and closes at the end.

    Keyword arguments go to `GradLogger`; `log_dir` defaults to ``<output_dir>/gradlog``. The
    report of the run is kept in `report` after training.
    """

    def __init__(self, **gradlog_kwargs: Any) -> None:
        self.kwargs = gradlog_kwargs
        self.logger: GradLogger | None = None
        self.report: Report | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
        if model is None:
            raise RuntimeError("GradlogCallback: the Trainer passed no model to on_train_begin")
        options = dict(self.kwargs)
        options.setdefault("log_dir", os.path.join(args.output_dir, "gradlog"))
        if self.logger is not None:  # a second train() call (resuming): a new run
            self.logger.close()
        self.logger = GradLogger(model, optimizer, **options)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.logger is not None:
            self.logger.log(state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.logger is not None:
            self.report = self.logger.close()
