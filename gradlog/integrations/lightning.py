"""`GradlogCallback` for Lightning's `Trainer`, which owns the loop and builds optimizers in `fit()`.

Importing this module imports Lightning (the `lightning` package, else `pytorch_lightning`).
"""

from __future__ import annotations

from typing import Any

import torch

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # pragma: no cover - the older package name
    try:
        from pytorch_lightning.callbacks import Callback  # type: ignore[assignment]
    except ImportError as exc:
        raise ImportError(
            "gradlog.integrations.lightning needs Lightning: pip install 'gradlog[lightning]' "
            "(or create gradlog.GradLogger(model, optimizer) yourself in your own loop)"
        ) from exc

from gradlog.integrations._run import CallbackRun, RunAccess


class GradlogCallback(RunAccess, Callback):
    """Creates a `GradLogger` for the LightningModule and one of its optimizers when fitting starts,
    publishes after each training batch at the Trainer's `global_step` (optimizer steps), and closes
    when fitting ends.

    Keyword arguments go to `GradLogger`; `log_dir` defaults to ``<trainer.log_dir>/gradlog``.
    `optimizer_index` picks the optimizer when `configure_optimizers` returns several (a GAN: one
    callback per optimizer). The run's report is kept in `report`.
    """

    def __init__(self, optimizer_index: int = 0, **gradlog_kwargs: Any) -> None:
        self.optimizer_index = optimizer_index
        self.run = CallbackRun(gradlog_kwargs)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        optimizers = trainer.optimizers
        if not 0 <= self.optimizer_index < len(optimizers):
            raise ValueError(
                f"GradlogCallback(optimizer_index={self.optimizer_index}): configure_optimizers returned "
                f"{len(optimizers)} optimizer(s); pass an index below {len(optimizers)}"
            )
        self.run.start(pl_module, optimizers[self.optimizer_index], trainer.log_dir or trainer.default_root_dir)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """Lightning clips (`gradient_clip_val`) right after this hook, inside the step's closure and before
        gradlog measures: on measured steps, note the total norm before clipping (one fused norm) so the
        measurement reports norms before clipping and the clip coefficient."""
        gl = self.run.logger
        clip_val = getattr(trainer, "gradient_clip_val", None)
        algorithm = str(getattr(trainer, "gradient_clip_algorithm", "norm") or "norm")
        if gl is None or not clip_val or not algorithm.endswith("norm") or not gl.clip_due():
            return
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if params:
            total = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
            gl.note_clip(params, total, float(clip_val))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.run.publish(trainer.global_step)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self.run.finish()
