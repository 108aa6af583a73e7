"""The calibration zoo through the frameworks' documented knobs (issue 38, part two): healthy runs trained by
`transformers.Trainer` (with `GradlogCallback`), Lightning's `Trainer` (with its `GradlogCallback`) and an
`accelerate` loop, each turning on one knob that changes when gradients exist, when the optimizer steps, or sets
weights outside the optimizer (accumulation, gradient checkpointing, restoring the best checkpoint, bf16, a
cosine schedule with warm-up, label smoothing, tight clipping, Adafactor, LoRA, stochastic weight averaging,
early stopping).

Every family is a `zoo.Setup` and runs through `zoo.run`, so the evidence of health is the zoo's own (training
metric and a fixed held-out evaluation fall >= 15%, every trainable tensor ends different from its start),
measured on the same run gradlog watched. `python tests/zoo_loops.py [family,...]` prints the JSON lines of
`zoo.main` for these families.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import torch
import zoo
from torch import nn
from torch.nn import functional as F

import gradlog

Batch = zoo.Batch


# --- transformers.Trainer ---------------------------------------------------------------------------------
def _llama(layers: int = 2) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(cfg)


def _lm_rows(gen: torch.Generator, batches: int) -> list[Batch]:
    return zoo.rows([{"input_ids": (ids := zoo.counting(gen, 8, 16, 64)[0]), "labels": ids} for _ in range(batches)])


def _trainer(
    model: nn.Module,
    steps: int,
    lr: float = 2e-3,
    accumulate: int = 1,
    check: Callable[[Any], None] | None = None,
    **args: Any,
) -> zoo.Setup:
    """A tiny Llama causal LM on counting streams, trained by `transformers.Trainer` with `GradlogCallback` and
    the knob in `args`; an eval set (the held-out batch's rows) is handed to the Trainer for the knobs that
    evaluate during training. `check(trainer)` asserts, after training, that the knob did what it says."""
    import catalogue
    import transformers

    from gradlog.integrations.huggingface import GradlogCallback

    gen = torch.Generator().manual_seed(1)
    data = _lm_rows(gen, steps * accumulate)
    test = zoo.held_out(lambda g: {"input_ids": (ids := zoo.counting(g, 32, 16, 64)[0]), "labels": ids})

    def fit(kwargs: dict[str, Any]) -> tuple[list[gradlog.Report], list[float]]:
        callback = GradlogCallback(**kwargs)
        with tempfile.TemporaryDirectory() as out:
            targs = catalogue.hf_args(
                out,
                max_steps=steps,
                learning_rate=lr,
                per_device_train_batch_size=8,
                gradient_accumulation_steps=accumulate,
                logging_steps=1,
                seed=0,
                **args,
            )
            trainer = transformers.Trainer(
                model=model, args=targs, train_dataset=data, eval_dataset=zoo.rows([test]), callbacks=[callback]
            )
            trainer.train()
        if check is not None:
            check(trainer)
        losses = [float(h["loss"]) for h in trainer.state.log_history if "loss" in h]
        assert callback.run.report is not None
        return [callback.run.report], losses

    return zoo.Setup(model, steps, zoo.eval_loss(model, test), fit=fit)


def hf_accumulation() -> zoo.Setup:
    """Trainer with `gradient_accumulation_steps=4`: gradients exist on every micro-batch, the optimizer steps on
    every fourth. Healthy: the logged loss and the held-out LM loss fall."""
    return _trainer(_llama(), 40, accumulate=4)


def hf_checkpointing() -> zoo.Setup:
    """Trainer with `gradient_checkpointing=True`: each decoder layer's activations are dropped and recomputed
    in backward (the layers run under `torch.utils.checkpoint`), which must not read as a cut graph.
    Healthy: the logged loss and the held-out LM loss fall."""
    return _trainer(_llama(), 80, gradient_checkpointing=True)


def hf_best_model() -> zoo.Setup:
    """Trainer with `load_best_model_at_end=True` at a constant learning rate of 1e-2, evaluating and saving
    every 10 steps of 90: the held-out loss is lowest at step 80 (0.129, 0.157 at step 90), so the Trainer
    loads step 80's checkpoint back at the end, outside the optimizer, after the last measured step (the fit
    checks that it did). Healthy: the logged loss and the held-out LM loss (of the restored model) fall."""

    def restored(trainer: Any) -> None:
        assert str(trainer.state.best_model_checkpoint).endswith("checkpoint-80"), trainer.state.best_model_checkpoint

    knobs = {"eval_strategy": "steps", "eval_steps": 10, "save_strategy": "steps", "save_steps": 10}
    return _trainer(
        _llama(), 90, 1e-2, check=restored, lr_scheduler_type="constant", load_best_model_at_end=True, **knobs
    )


def hf_bf16() -> zoo.Setup:
    """Trainer with `bf16=True` on the CPU: forward and backward under bf16 autocast, fp32 weights and optimizer.
    Healthy: the logged loss and the held-out LM loss fall."""
    return _trainer(_llama(), 80, bf16=True)


def hf_cosine_warmup() -> zoo.Setup:
    """Trainer with `lr_scheduler_type="cosine"` and `warmup_ratio=0.2`: the learning rate rises from 0 and
    decays back to 0 at the last step, so the first and last updates are tiny. Healthy: the losses fall."""
    return _trainer(_llama(), 80, 4e-3, lr_scheduler_type="cosine", warmup_steps=0.2)


def hf_label_smoothing() -> zoo.Setup:
    """Trainer with `label_smoothing_factor=0.1` (the Trainer computes the loss itself from the logits).
    Healthy: the logged (smoothed) loss and the held-out LM loss fall."""
    return _trainer(_llama(), 80, label_smoothing_factor=0.1)


def hf_clip_tight() -> zoo.Setup:
    """Trainer with `max_grad_norm=0.1`: every step is clipped hard (clip coefficient well below 1).
    Healthy: the logged loss and the held-out LM loss fall."""
    return _trainer(_llama(), 80, max_grad_norm=0.1)


def hf_adafactor() -> zoo.Setup:
    """Trainer with `optim="adafactor"` (factored second moments, no momentum, fixed learning rate 1e-2).
    Healthy: the logged loss and the held-out LM loss fall."""
    return _trainer(_llama(), 80, 1e-2, optim="adafactor")


def hf_lora() -> zoo.Setup:
    """A peft LoRA adapter (r=8 on every linear layer, the base frozen) with a trainable copy of the LM head
    (`modules_to_save`) through the Trainer at 2e-2: only the adapters and the copy train (`lora_B` starts at
    zero). Healthy: the logged loss and the held-out LM loss fall, every trainable tensor changes."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", modules_to_save=["lm_head"])
    return _trainer(get_peft_model(_llama(), config), 100, 2e-2)


def hf_lora_checkpointing() -> zoo.Setup:
    """The LoRA adapter of `hf_lora` with `gradient_checkpointing=True` and the re-entrant checkpoint
    (`gradient_checkpointing_kwargs={"use_reentrant": True}`), the combination PEFT's guides show: the frozen
    embedding's output needs no gradient, so the checkpointed layers' adapters only get one because peft makes
    the inputs require it. Healthy: the logged loss and the held-out LM loss fall, every trainable tensor
    changes."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", modules_to_save=["lm_head"])
    return _trainer(
        get_peft_model(_llama(), config),
        100,
        2e-2,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": True},
    )


# --- Lightning ---------------------------------------------------------------------------------------------
_CENTRES = 1.5 * torch.randn(4, 16, generator=torch.Generator().manual_seed(7))


def _lightning_module(manual: bool = False) -> Any:
    """The classifier; `manual`: under manual optimisation, with one Adam for the body and one SGD for the head,
    both stepped by `training_step` itself."""
    import lightning.pytorch as pl

    class Classifier(pl.LightningModule):
        """An MLP on clustered vectors, Adam 1e-3; it keeps its per-batch training losses."""

        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
            self.losses: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = F.cross_entropy(self.net(batch[0]), batch[1])
            self.losses.append(float(loss.detach()))
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", F.cross_entropy(self.net(batch[0]), batch[1]))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    class TwoOptimizers(Classifier):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            body, head = self.optimizers()
            loss = F.cross_entropy(self.net(batch[0]), batch[1])
            self.losses.append(float(loss.detach()))
            self.manual_backward(loss)
            body.step()
            head.step()
            body.zero_grad()
            head.zero_grad()
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.net[:4].parameters(), lr=1e-3), torch.optim.SGD(self.net[4].parameters(), 0.1)

    return TwoOptimizers() if manual else Classifier()


def _lightning(
    batches: int,
    epochs: int = 1,
    val: bool = False,
    callbacks: Callable[[], list[Any]] = list,
    manual: bool = False,
    **args: Any,
) -> zoo.Setup:
    """The classifier trained by Lightning's `Trainer` on `batches` batches of 32 per epoch for `epochs` epochs
    (shuffled by a seeded sampler), with `GradlogCallback` and the knob in `args` / `callbacks`; `manual`: the
    two-optimizer module, with one callback per optimizer (`optimizer_index`), as docs/integrations.md says."""
    import lightning.pytorch as pl

    from gradlog.integrations.lightning import GradlogCallback

    module = _lightning_module(manual)
    if args.get("precision") == "bf16-true":  # bf16 from the start, so the changed-tensor check compares bf16 to bf16
        module = module.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    x, y = zoo._clusters(gen, _CENTRES, 32 * batches, 1.0)
    tx, ty = zoo.held_out(lambda g: zoo._clusters(g, _CENTRES, 256, 1.0))
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(2)
    )
    held = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tx, ty), batch_size=256)

    def fit(kwargs: dict[str, Any]) -> tuple[list[gradlog.Report], list[float]]:
        callback = GradlogCallback(**kwargs)
        ours = [callback]
        if manual:
            ours.append(GradlogCallback(optimizer_index=1, **{**kwargs, "writer": gradlog.MemoryWriter()}))
        with tempfile.TemporaryDirectory() as out:
            trainer = pl.Trainer(
                max_epochs=epochs,
                accelerator="cpu",
                default_root_dir=out,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                num_sanity_val_steps=0,
                callbacks=[*ours, *callbacks()],
                **args,
            )
            trainer.fit(module, loader, held if val else None)
        reports = [c.run.report for c in ours]
        assert all(r is not None for r in reports)
        return reports, module.losses  # type: ignore[return-value]

    evaluate = zoo._evaluator(module, lambda: F.cross_entropy(module.net(tx.to(module.dtype)).float(), ty))
    return zoo.Setup(module, epochs * batches, evaluate, fit=fit)


def pl_accumulation() -> zoo.Setup:
    """Lightning with `accumulate_grad_batches=4`: the optimizer steps on every fourth batch (and `global_step`
    counts optimizer steps). Healthy: the training cross-entropy and the held-out one fall."""
    return _lightning(100, 2, accumulate_grad_batches=4)


def pl_clip() -> zoo.Setup:
    """Lightning with `gradient_clip_val=0.5` (by norm), clipped inside the step's closure. Healthy: the
    training cross-entropy and the held-out one fall."""
    return _lightning(100, 2, gradient_clip_val=0.5)


def pl_bf16() -> zoo.Setup:
    """Lightning with `precision="bf16-mixed"` on the CPU (bf16 autocast, fp32 weights). Healthy: the training
    cross-entropy and the held-out one fall."""
    return _lightning(100, 2, precision="bf16-mixed")


def pl_manual_two_optimizers() -> zoo.Setup:
    """Lightning under manual optimisation (`automatic_optimization = False`): `training_step` runs
    `manual_backward` and steps two optimizers itself (Adam on the body, SGD on the head), so `global_step`
    counts two per batch; one `GradlogCallback` per optimizer, each given the whole module. Healthy: the
    training cross-entropy and the held-out one fall."""
    return _lightning(100, 2, manual=True)


def pl_swa() -> zoo.Setup:
    """Lightning's `StochasticWeightAveraging` from the second of 4 epochs: the optimizer's learning rate is
    swapped to SWA's, and after the last epoch the averaged weights are copied into the module, outside the
    optimizer. Healthy: the training cross-entropy and the held-out one (of the averaged model) fall."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    return _lightning(40, 4, callbacks=lambda: [StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1)])


def pl_bf16_true() -> zoo.Setup:
    """Lightning with `precision="bf16-true"`: the weights themselves are bf16 (8 bits of mantissa), Adam at
    1e-3, trained on past the point where the loss levels off. Healthy: both losses fall 99%. Its updates
    register while it learns (3-25% rounded away a step over the first measured steps) and round away once
    Adam's steps shrink near the fit (60-93% from step 80): `precision.rounded_late` and, for the head's
    4-element bias unchanged from step 75, `stalled.shrank_below_precision`, both notes (they were problems
    before gradlog judged the share's course, see docs/verdict.md)."""
    return _lightning(100, 2, precision="bf16-true")


def pl_ema() -> zoo.Setup:
    """Lightning's `EMAWeightAveraging` (decay 0.99) over 4 epochs with a validation loop: the averaged weights
    are swapped into the module for each validation and swapped back after it (outside the optimizer, between
    steps), and copied in at the end of training. Healthy: the training cross-entropy and the held-out one (of
    the averaged model) fall."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    return _lightning(40, 4, val=True, callbacks=lambda: [EMAWeightAveraging(decay=0.99)])


def pl_early_stopping() -> zoo.Setup:
    """Lightning's `EarlyStopping` on the held-out loss (min_delta 0.02, patience 1) over at most 30 epochs of 10
    batches: training stops when the held-out loss levels off, before `max_epochs`. Healthy: the losses fall."""
    from lightning.pytorch.callbacks import EarlyStopping

    stop = lambda: [EarlyStopping(monitor="val_loss", min_delta=0.02, patience=1)]  # noqa: E731
    return _lightning(10, 30, val=True, callbacks=stop)


def pl_resume() -> zoo.Setup:
    """Lightning stopped and resumed: a first fit of 1 epoch saves its last checkpoint (`ModelCheckpoint`), a
    second `Trainer` continues to 3 epochs with `fit(ckpt_path=...)` (weights, Adam's moments and the loops
    restored, outside the optimizer's step). gradlog writes to its default TensorBoard folder, so the second
    callback continues the first's run (`Output(resume=True)`); its report is judged. Healthy: the training
    cross-entropy and the held-out one fall."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from gradlog.integrations.lightning import GradlogCallback

    module = _lightning_module()
    gen = torch.Generator().manual_seed(1)
    x, y = zoo._clusters(gen, _CENTRES, 32 * 60, 1.0)
    tx, ty = zoo.held_out(lambda g: zoo._clusters(g, _CENTRES, 256, 1.0))
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(2)
    )

    def fit(kwargs: dict[str, Any]) -> tuple[list[gradlog.Report], list[float]]:
        options = {k: v for k, v in kwargs.items() if k != "writer"}  # the default writer: a folder to resume
        with tempfile.TemporaryDirectory() as out:
            callbacks = []
            for epochs, ckpt in ((1, None), (3, f"{out}/lightning_logs/version_0/checkpoints/last.ckpt")):
                callbacks.append(GradlogCallback(**options))
                trainer = pl.Trainer(
                    max_epochs=epochs,
                    accelerator="cpu",
                    default_root_dir=out,
                    enable_progress_bar=False,
                    enable_model_summary=False,
                    callbacks=[callbacks[-1], ModelCheckpoint(save_last=True)],
                )
                trainer.fit(module, loader, ckpt_path=ckpt)
        report = callbacks[-1].run.report
        assert report is not None
        return [report], module.losses

    evaluate = zoo._evaluator(module, lambda: F.cross_entropy(module.net(tx), ty))
    return zoo.Setup(module, 180, evaluate, fit=fit)


# --- accelerate --------------------------------------------------------------------------------------------
def _accelerate(steps: int, **accelerator: Any) -> zoo.Setup:
    """An MLP on clustered vectors in an `accelerate` loop (Adam 1e-3, `Accelerator(**accelerator)`) with
    `accelerator.accumulate(model)`, `accelerator.backward` and `accelerator.clip_grad_norm_(..., 1.0)` when
    the gradients are synchronised; gradlog hooks the prepared optimizer."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    # one process, several configurations: accelerate's state is process-wide, and a Trainer's leaves its own
    # accumulation behind (then `accumulate` syncs, and the optimizer steps, on every micro-batch)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    acc = Accelerator(cpu=True, **accelerator)
    model, opt = acc.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    gen = torch.Generator().manual_seed(1)
    tx, ty = zoo.held_out(lambda g: zoo._clusters(g, _CENTRES, 256, 1.0))

    def step(i: int) -> float:
        x, y = zoo._clusters(gen, _CENTRES, 32, 1.0)
        with acc.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            acc.backward(loss)
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        return float(loss.detach())

    return zoo.Setup(model, steps, zoo._evaluator(model, lambda: F.cross_entropy(model(tx), ty)), step, [(model, opt)])


def acc_bf16() -> zoo.Setup:
    """An `accelerate` loop with `Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2)` (bf16
    autocast around the prepared model's forward, fp32 weights). Healthy: the training cross-entropy and the
    held-out one fall."""
    return _accelerate(300, mixed_precision="bf16", gradient_accumulation_steps=2)


def acc_accumulation() -> zoo.Setup:
    """An `accelerate` loop with `Accelerator(gradient_accumulation_steps=4)`: the prepared optimizer's wrapper
    skips the step on three micro-batches of four, and `clip_grad_norm_` clips on the fourth. Healthy: the
    training cross-entropy and the held-out one fall."""
    return _accelerate(400, gradient_accumulation_steps=4)


FAMILIES = [
    pl_clip,
    acc_accumulation,
    pl_accumulation,
    pl_bf16,
    hf_accumulation,
    hf_checkpointing,
    hf_best_model,
    hf_bf16,
    hf_cosine_warmup,
    hf_label_smoothing,
    hf_clip_tight,
    hf_adafactor,
    hf_lora,
    pl_swa,
    pl_early_stopping,
    pl_manual_two_optimizers,
    pl_resume,
    pl_ema,
    hf_lora_checkpointing,
    acc_bf16,
    pl_bf16_true,
]
FAST = 2
#: measured and documented, not asserted OK
MEASURED: list[Callable[[], zoo.Setup]] = []


if __name__ == "__main__":
    import sys

    zoo.FAMILIES[:] = FAMILIES + MEASURED
    zoo.main(sys.argv[1:])
