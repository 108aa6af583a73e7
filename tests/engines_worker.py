"""Runs under `torchrun --nproc_per_node 2` (gloo, CPU) for tests/test_engines.py.

Usage: python -m torch.distributed.run --nproc_per_node 2 tests/engines_worker.py OUT_DIR SUITE
Each SUITE hands gradlog a setup it cannot measure exactly and records, per rank and case, the error
gradlog raised (or None) to OUT_DIR/<case>-rank<r>.json, plus whether training still ran afterwards.
SUITE "fsdp1": FSDP1 modules reached through `.module`, and a parameter partitioned to shape (0,).
SUITE "deepspeed": DeepSpeed ZeRO-1, -2 and -3 (DS_ACCELERATOR=cpu, gloo): the engine, its optimizer,
the inner torch optimizer, gradlog.check, and the Hugging Face Trainer with a DeepSpeed config dict.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import gradlog


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _record(out: Path, case: str, make: Callable[..., object], *args: Any, **kwargs: Any) -> None:
    """Run `make(*args, **kwargs)` (which should be refused) and save what it raised on this rank."""
    rank = torch.distributed.get_rank()
    try:
        make(*args, **kwargs)
        payload: dict[str, Any] = {"type": None, "error": None}
    except Exception as exc:  # recorded for the test to check, type and message
        payload = {"type": type(exc).__name__, "error": str(exc)}
    (out / f"{case}-rank{rank}.json").write_text(json.dumps(payload))


def logger(model: nn.Module, optimizer: Any) -> gradlog.GradLogger:
    return gradlog.GradLogger(model, optimizer, writer="memory", print_report=False)


def fsdp1_suite(out: Path) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.distributed.init_process_group("gloo")
    for orig in (True, False):
        fsdp = FSDP(tiny(), use_orig_params=orig, device_id=torch.device("cpu"))
        opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)
        _record(out, f"fsdp1-module-orig{orig}", logger, fsdp.module, opt)
        _record(out, f"fsdp1-wrapper-orig{orig}", logger, fsdp, opt)
    # an unknown engine that leaves each rank a shape-(0,) stand-in for a parameter held elsewhere
    model = tiny()
    with torch.no_grad():
        model[2].bias.data = torch.empty(0)
    _record(out, "empty-param", logger, model, torch.optim.SGD(model.parameters(), lr=0.1))
    torch.distributed.destroy_process_group()


def _ds_config(stage: int) -> dict[str, Any]:
    return {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }


def deepspeed_suite(out: Path) -> None:
    import deepspeed
    import deepspeed.ops

    # on CPU DeepSpeed JIT-builds a shared-memory all-reduce (minutes of C++ compile); gloo does without it
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    batch = torch.randn(2, 8)
    for stage in (1, 2, 3):
        engine, opt, _, _ = deepspeed.initialize(model=tiny(), config=_ds_config(stage))
        inner = opt.optimizer
        _record(out, f"zero{stage}-engine", logger, engine, opt)
        _record(out, f"zero{stage}-engine-module", logger, engine.module, opt)
        _record(out, f"zero{stage}-inner", logger, engine.module, inner)
        _record(out, f"zero{stage}-check", gradlog.check, engine.module, opt, batch, print_report=False)
        # training goes on after the refusals: nothing was hooked or touched
        loss = engine(batch).pow(2).mean()
        engine.backward(loss)
        engine.step()
        rank = torch.distributed.get_rank()
        (out / f"zero{stage}-trained-rank{rank}.json").write_text(json.dumps({"steps": engine.global_steps}))
    hf_trainer(out)
    lightning_callback(out)
    pipeline(out)  # last: its engine leaves DeepSpeed's global parallel state set for a pipeline


def pipeline(out: Path) -> None:
    """DeepSpeed's pipeline parallelism: each rank holds a different half of the layers."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)]
    module = PipelineModule(layers=layers, num_stages=2, loss_fn=nn.MSELoss())
    config = {**_ds_config(0), "gradient_accumulation_steps": 2, "train_micro_batch_size_per_gpu": 2}
    engine, opt, _, _ = deepspeed.initialize(model=module, config=config)
    _record(out, "pipeline-engine", logger, engine, opt)


def hf_trainer(out: Path) -> None:
    """A Trainer run with a DeepSpeed config dict (ZeRO-2, ZeRO-3) and gradlog's callback: measured, or with
    check_first=True refused before the first step."""
    from accelerate.state import AcceleratorState
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from gradlog.integrations.huggingface import GradlogCallback

    ids = torch.randint(0, 32, (8, 8), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    for stage, check_first in ((2, False), (2, True), (3, False), (3, True)):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2))
        args = TrainingArguments(
            output_dir=str(out / "hf"),
            per_device_train_batch_size=2,
            max_steps=2,
            report_to=[],
            use_cpu=True,
            logging_steps=1,
            max_grad_norm=0.5,
            deepspeed={
                **_ds_config(stage),
                "train_batch_size": "auto",
                "train_micro_batch_size_per_gpu": "auto",
                "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
            },
        )
        AcceleratorState._reset_state()  # one Trainer per DeepSpeed config: accelerate keeps its plugin in a singleton
        mem = gradlog.MemoryWriter()
        cb = GradlogCallback(check_first=check_first, writer=mem, every=1, print_report=False)
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])
        case = f"hf-zero{stage}-check{check_first}"
        _record(out, case, trainer.train)
        rank = torch.distributed.get_rank()
        steps = {
            "global_step": trainer.state.global_step,
            "gradlog_steps": cb.run.logger.optimizer_steps if cb.run.logger is not None else None,
            "grad_norm_total": mem.scalars.get("gradlog/grad_norm_total", []),
            "trainer_grad_norm": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
        }
        (out / f"{case}-steps-rank{rank}.json").write_text(json.dumps(steps))


def lightning_callback(out: Path) -> None:
    """gradlog's Lightning callback handed what Lightning's DeepSpeed strategy hands it: the LightningModule (the
    engine's module) and the ZeRO optimizer (`trainer.optimizers`). The strategy itself runs on CUDA only, so a
    stand-in for the Trainer carries them; the engine, its optimizer and the module are real."""
    from types import SimpleNamespace

    import deepspeed
    import lightning

    from gradlog.integrations.lightning import GradlogCallback

    class Module(lightning.pytorch.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = tiny()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.net(x)
            return out

    rank = torch.distributed.get_rank()
    for stage in (2, 3):
        module = Module()
        config = {**_ds_config(stage), "gradient_clipping": 0.01}
        engine, opt, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(), config=config)
        mem = gradlog.MemoryWriter()
        cb = GradlogCallback(writer=mem, every=1, print_report=False)
        trainer = SimpleNamespace(optimizers=[opt], log_dir=str(out), default_root_dir=str(out), ckpt_path=None)
        trainer.global_step, trainer.gradient_clip_val = 0, None
        _record(out, f"lightning-zero{stage}", cb.on_fit_start, trainer, module)
        norms = []
        for step in range(3):
            x = torch.randn(2, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            engine.backward(engine(x).pow(2).mean())
            cb.on_before_optimizer_step(trainer, module, opt)
            engine.step()
            trainer.global_step = step + 1
            cb.on_train_batch_end(trainer, module, None, x, step)
            norms.append(float(engine.get_global_grad_norm()))
        cb.on_fit_end(trainer, module)
        payload = {"grad_norm_total": mem.scalars.get("gradlog/grad_norm_total", []), "norms": norms}
        payload["verdict"] = cb.report.verdict if cb.report is not None else None
        (out / f"lightning-zero{stage}-steps-rank{rank}.json").write_text(json.dumps(payload))


if __name__ == "__main__":
    out_dir, suite = Path(sys.argv[1]), sys.argv[2]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    {"fsdp1": fsdp1_suite, "deepspeed": deepspeed_suite}[suite](out_dir)
