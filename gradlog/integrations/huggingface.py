"""`GradlogCallback`: gradlog inside a Hugging Face `Trainer`, which owns the loop and the optimizer.

Importing this module imports transformers; gradlog itself never does.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "gradlog.integrations.huggingface needs transformers: pip install 'gradlog[huggingface]' "
        "(or create gradlog.GradLogger(model, optimizer) yourself in your own loop)"
    ) from exc

from gradlog.integrations._run import CallbackRun, RunAccess, first_batch, to_device
from gradlog.run.check import default_loss


class GradlogCallback(RunAccess, TrainerCallback):
    """Creates a `GradLogger` when training begins (the Trainer builds its optimizer only then),
    publishes at each optimizer step with the Trainer's `global_step` as x-axis, and closes at the end.

    Keyword arguments go to `GradLogger`; `log_dir` defaults to ``<output_dir>/gradlog``. The
    report of the run is kept in `report` after training.

    ``check_first=True`` runs `gradlog.check` once when training begins, before the first step:
    on the first batch of the Trainer's train dataloader (drawn from the DataLoader under
    accelerate's wrapper with every random generator put back, so the training order is
    unchanged), with the model in train mode and the loss the model returns (``.loss``, so the
    batch must hold the labels). Its report is printed and kept in `check_report`.
    """

    def __init__(self, check_first: bool = False, **gradlog_kwargs: Any) -> None:
        self.run = CallbackRun(gradlog_kwargs, check_first)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs.get("model")
        if model is None:
            raise RuntimeError("GradlogCallback: the Trainer passed no model to on_train_begin")
        if self.run.check_first:
            loader = kwargs.get("train_dataloader")
            if loader is None:
                raise RuntimeError("GradlogCallback(check_first=True): the Trainer passed no train_dataloader")
            device = next(model.parameters()).device
            self.run.preflight(model, kwargs.get("optimizer"), to_device(first_batch(loader), device), _train_loss)
        # resume_from_checkpoint: the Trainer restored its state (global_step) before this call
        self.run.start(model, kwargs.get("optimizer"), args.output_dir, resuming=state.global_step > 0)
        self._watch_clipping()

    def _watch_clipping(self) -> None:
        """The Trainer clips (`max_grad_norm`) before any callback that precedes the optimizer step, so
        gradlog wraps its accelerator's `clip_grad_norm_` (which returns the norm before clipping) to
        report norms before clipping. The Trainer does not hand itself to callbacks: it is the caller."""
        trainer = None
        frame = inspect.currentframe()
        for _ in range(12):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                break
            owner = frame.f_locals.get("self")
            handler = getattr(owner, "callback_handler", None)
            if hasattr(owner, "accelerator") and self in getattr(handler, "callbacks", []):
                trainer = owner
                break
        del frame
        accelerator = getattr(trainer, "accelerator", None)
        clip = getattr(accelerator, "clip_grad_norm_", None)
        if accelerator is None or clip is None:
            warnings.warn(
                "gradlog: the Trainer was not found; gradient norms are read after its clipping (max_grad_norm)",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        original = getattr(clip, "__gradlog_original__", clip)
        run = self.run

        def clip_grad_norm_(parameters: Any, max_norm: float, *a: Any, **kw: Any) -> Any:
            params = list(parameters)
            total = original(params, max_norm, *a, **kw)
            if run.logger is not None and total is not None:
                run.logger.note_clip(params, total, max_norm)
            return total

        clip_grad_norm_.__gradlog_original__ = original  # type: ignore[attr-defined]
        accelerator.clip_grad_norm_ = clip_grad_norm_

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.run.publish(state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.run.finish()


def _train_loss(model: Any, batch: Any) -> Any:
    """The Trainer trains in train mode (the check puts the mode back afterwards)."""
    model.train()
    return default_loss(model, batch)
