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

import os
import warnings

from gradlog.integrations._run import CallbackRun, RunAccess
from gradlog.measure.engines import refuse_unmeasured


class GradlogCallback(RunAccess, Callback):
    """Creates a `GradLogger` for the LightningModule and one of its optimizers when fitting starts,
    publishes after each training batch at the Trainer's `global_step` (optimizer steps), and closes
    when fitting ends.

    Keyword arguments go to `GradLogger`; `log_dir` defaults to ``<trainer.log_dir>/gradlog``. A fit
    resumed from a checkpoint (``fit(ckpt_path=...)``) continues the gradlog run beside that checkpoint
    (``<version>/gradlog`` of the run that saved it) as one logical run (`gradlog.Output(resume=True)`).
    `optimizer_index` picks the optimizer when `configure_optimizers` returns several (a GAN: one
    callback per optimizer). The run's report is kept in `report`.

    ``check_first=True`` runs `gradlog.check` on the first training batch, in
    `on_train_batch_start` (the batch is already on the device), with the module's own
    `training_step` as the loss (its `self.log` calls are muted during the check), before the run's
    logger hooks the optimizer. Skipped, with a warning, under manual optimisation, where
    `training_step` steps the optimizers itself. The report is printed and kept in `check_report`.
    """

    def __init__(self, optimizer_index: int = 0, check_first: bool = False, **gradlog_kwargs: Any) -> None:
        self.optimizer_index = optimizer_index
        self.run = CallbackRun(gradlog_kwargs, check_first)
        self._deferred: tuple[Any, Any, str] | None = None
        self._resuming = False

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        optimizers = trainer.optimizers
        if not 0 <= self.optimizer_index < len(optimizers):
            raise ValueError(
                f"GradlogCallback(optimizer_index={self.optimizer_index}): configure_optimizers returned "
                f"{len(optimizers)} optimizer{'' if len(optimizers) == 1 else 's'}; "
                f"pass an index below {len(optimizers)}"
            )
        resumed = _resumed_from(trainer)
        where = resumed or trainer.log_dir or trainer.default_root_dir
        start = (pl_module, optimizers[self.optimizer_index], where)
        refuse_unmeasured(pl_module, start[1])  # before the first step, even when the logger starts later
        self._resuming = resumed is not None
        if (self.run.check_first and self.run.check_report is None) or getattr(trainer, "ckpt_path", None):
            # the logger starts on the first batch: after the check, and after Lightning restored the
            # checkpoint's optimizer state and loops (it does so after on_fit_start)
            self._deferred = start
        else:
            self.run.start(*start)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._deferred is None:
            return
        start, self._deferred = self._deferred, None
        if not self.run.check_first or self.run.check_report is not None:
            self.run.start(*start, resuming=self._resuming)
            return
        if getattr(pl_module, "automatic_optimization", True):
            self.run.preflight(pl_module, start[1], batch, _training_step(batch_idx))
        else:
            warnings.warn(
                "GradlogCallback(check_first=True): skipped under manual optimisation (training_step steps the "
                "optimizers itself); call gradlog.check(model, optimizer, batch, loss_fn=...) yourself",
                stacklevel=2,
            )
        self.run.start(*start, resuming=self._resuming)

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


def _resumed_from(trainer: Any) -> str | None:
    """`fit(ckpt_path=...)`: the logger folder of the run that wrote the checkpoint
    (`<version>/checkpoints/x.ckpt` -> `<version>`), when it holds a gradlog run. Lightning gives the
    resumed fit a new `version_N`, but the gradlog run to continue is the earlier one."""
    path = getattr(trainer, "ckpt_path", None)
    if not isinstance(path, (str, os.PathLike)):
        return None
    version = os.path.dirname(os.path.dirname(os.path.abspath(os.fspath(path))))
    return version if os.path.isdir(os.path.join(version, "gradlog")) else None


def _training_step(batch_idx: int) -> Any:
    """The module's own loss, with `self.log` muted so the check leaves no logged values behind."""

    def loss(module: Any, batch: Any) -> Any:
        muted = {name: vars(module).get(name) for name in ("log", "log_dict")}
        module.log = module.log_dict = lambda *args, **kwargs: None
        try:
            return module.training_step(batch, batch_idx)
        finally:
            for name, value in muted.items():
                if value is None:
                    vars(module).pop(name, None)
                else:
                    setattr(module, name, value)

    return loss
