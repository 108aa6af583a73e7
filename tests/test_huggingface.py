"""GradlogCallback inside a real Hugging Face Trainer (CPU, gradient accumulation)."""

from __future__ import annotations

import subprocess
import sys
import warnings
from typing import Any

import pytest
import torch
from catalogue import hf_args
from torch import nn

import gradlog
from gradlog import Reason

transformers = pytest.importorskip("transformers")
from gradlog.integrations.huggingface import GradlogCallback  # noqa: E402


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)
        self.unused = nn.Linear(2, 2)  # a planted bug: never called

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.head(torch.tanh(self.body(x))).squeeze(-1)
        return {"loss": ((out - labels) ** 2).mean(), "logits": out}


class Data(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = torch.randn(4, generator=torch.Generator().manual_seed(i))
        return {"x": x, "labels": x.sum()}


class HandReference(transformers.TrainerCallback):  # type: ignore[misc]
    """The gradient norm the optimizer is about to use, read by hand right before each step."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):  # type: ignore[no-untyped-def]
        self.norms.append(torch.linalg.vector_norm(model.body.weight.grad).item())


def test_trainer_with_accumulation_logs_every_real_optimizer_step(tmp_path) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    mem = gradlog.MemoryWriter()
    cb, ref = GradlogCallback(writer=mem, every=1, print_report=False), HandReference()
    args = hf_args(
        str(tmp_path),
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        num_train_epochs=1,
        max_grad_norm=0.5,  # the Trainer clips before the step: gradlog must report the norms before clipping
        logging_steps=1,
        seed=0,
    )
    trainer = transformers.Trainer(model=Regressor(), args=args, train_dataset=Data(), callbacks=[cb, ref])
    trainer.train()
    got = mem.scalars["weights/grad_norm/body.weight"]
    assert [s for s, _ in got] == [1, 2, 3, 4]  # 64 samples / (8 x 2): 4 optimizer steps, at HF's global_step
    # The Trainer's own logged grad_norm is the norm before clipping: gradlog's total equals it.
    theirs = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    total = [v for _, v in mem.scalars["gradlog/grad_norm_total"]]
    assert len(theirs) == 4 and total == pytest.approx(theirs, rel=1e-5)
    assert max(theirs) > 0.5  # clipping really happened: the clipped norm would read 0.5
    coef = [v for _, v in mem.scalars["gradlog/clip_coef"]]
    assert coef == pytest.approx([min(1.0, 0.5 / (t + 1e-6)) for t in theirs], rel=1e-5)
    # Per tensor: the clipped gradient the optimizer used (read by hand) divided by the clip coefficient.
    assert [v for _, v in got] == pytest.approx([n / c for n, c in zip(ref.norms, coef)], rel=1e-5)
    assert cb.report is not None and mem.closed
    assert {r.name: r.reason for r in cb.report.never_updated} == {
        "unused.weight": Reason.NO_GRAD,
        "unused.bias": Reason.NO_GRAD,
    }


def test_log_dir_defaults_to_the_trainer_output_dir(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("tensorboard")
    cb = GradlogCallback(every=1, print_report=False)
    args = hf_args(
        str(tmp_path),
        per_device_train_batch_size=16,
        max_steps=2,
    )
    transformers.Trainer(model=Regressor(), args=args, train_dataset=Data(), callbacks=[cb]).train()
    assert any((tmp_path / "gradlog").glob("events.out.tfevents.*"))


def test_gradlog_alone_never_imports_transformers() -> None:
    code = "import sys, gradlog; print(sorted({m.split('.')[0] for m in sys.modules} & {'transformers', 'accelerate'}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


class Dropped(Regressor):
    """Regressor with dropout, so the check must also leave the RNG as it found it."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.head(self.drop(torch.tanh(self.body(x)))).squeeze(-1)
        return {"loss": ((out - labels) ** 2).mean(), "logits": out}


def _train(tmp_path, check_first: bool) -> tuple[GradlogCallback, dict[str, torch.Tensor], gradlog.MemoryWriter]:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    mem = gradlog.MemoryWriter()
    cb = GradlogCallback(check_first=check_first, writer=mem, every=1, print_report=False)
    args = hf_args(str(tmp_path / str(check_first)), per_device_train_batch_size=8, max_steps=3, seed=0)
    model = Dropped()
    transformers.Trainer(model=model, args=args, train_dataset=Data(), callbacks=[cb]).train()
    return cb, {k: v.detach().clone() for k, v in model.state_dict().items()}, mem


def test_check_first_runs_on_the_first_batch_and_changes_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    plain_cb, plain, plain_mem = _train(tmp_path, check_first=False)
    cb, checked, mem = _train(tmp_path, check_first=True)
    assert plain_cb.check_report is None and cb.check_report is not None
    assert {r.name: r.reason for r in cb.check_report.never_updated} == {
        "unused.weight": Reason.NO_GRAD,
        "unused.bias": Reason.NO_GRAD,
    }
    assert cb.check_report.optimizer_steps == 1
    assert plain.keys() == checked.keys()
    for k in plain:
        assert torch.equal(plain[k], checked[k]), k  # same data order, dropout masks and updates
    assert (
        mem.scalars["weights/grad_norm/body.weight"] == plain_mem.scalars["weights/grad_norm/body.weight"]
    )  # check not counted


def test_a_trainer_resumed_from_its_checkpoint_continues_the_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`trainer.train(resume_from_checkpoint=True)` after a first run: one gradlog run over both."""
    pytest.importorskip("tensorboard")
    from gradlog.readers.run import closed_report, load

    def args(max_steps: int) -> Any:
        return hf_args(
            str(tmp_path),
            per_device_train_batch_size=4,
            max_steps=max_steps,
            save_strategy="steps",
            save_steps=3,
            seed=0,
        )

    torch.manual_seed(0)
    first = GradlogCallback(every=1, print_report=False)
    transformers.Trainer(model=Regressor(), args=args(6), train_dataset=Data(), callbacks=[first]).train()
    assert first.report is not None and first.report.optimizer_steps == 6
    second = GradlogCallback(every=1, print_report=False)
    trainer = transformers.Trainer(model=Regressor(), args=args(10), train_dataset=Data(), callbacks=[second])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # continued: no "a new run starts"
        trainer.train(resume_from_checkpoint=True)  # from checkpoint-6
    assert second.report is not None
    assert second.report.optimizer_steps == 10 and second.report.measured_steps == 10
    run = load(str(tmp_path / "gradlog"))  # one run, not "holds 2 runs"
    assert [s for s, _ in run.scalars["weights/grad_norm/body.weight"]] == list(range(1, 11))
    report = closed_report(run)
    assert report is not None and report.optimizer_steps == 10
    assert {r.name for r in report.never_updated} == {"unused.weight", "unused.bias"}
