"""`GradlogCallback`: gradlog inside a Hugging Face `Trainer`, which owns the loop and the optimizer.

Importing this module imports transformers; gradlog itself never does.
"""

from __future__ import annotations

from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "gradlog.integrations.huggingface needs transformers: pip install 'gradlog[huggingface]' "
        "(or create gradlog.GradLogger(model, optimizer) yourself in your own loop)"
    ) from exc

from gradlog.integrations._run import CallbackRun, RunAccess


class GradlogCallback(RunAccess, TrainerCallback):
    """Creates a `GradLogger` when training begins (the Trainer builds its optimizer only then),
    publishes at each optimizer step with the Trainer's `global_step` as x-axis, and closes at the end.

    Keyword arguments go to `GradLogger`; `log_dir` defaults to ``<output_dir>/gradlog``. The
    report of the run is kept in `report` after training.
    """

    def __init__(self, **gradlog_kwargs: Any) -> None:
        self.run = CallbackRun(gradlog_kwargs)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs.get("model")
        if model is None:
            raise RuntimeError("GradlogCallback: the Trainer passed no model to on_train_begin")
        self.run.start(model, kwargs.get("optimizer"), args.output_dir)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.run.publish(state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.run.finish()
