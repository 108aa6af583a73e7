"""GradlogCallback inside a real Lightning Trainer (CPU, automatic optimisation, accumulation)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradlog
from gradlog import Reason

L = pytest.importorskip("lightning.pytorch")
from gradlog.integrations.lightning import GradlogCallback  # noqa: E402


class Regressor(L.LightningModule):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)
        self.unused = nn.Linear(2, 2)  # a planted bug: never called

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return ((self.head(torch.tanh(self.body(x))).squeeze(-1) - y) ** 2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class HandReference(L.Callback):  # type: ignore[misc]
    """The accumulated gradient right before each optimizer step, read by hand."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # type: ignore[no-untyped-def]
        self.norms.append(torch.linalg.vector_norm(pl_module.body.weight.grad).item())


def _loader() -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1)), batch_size=8)


def _trainer(tmp_path, callbacks: list, **kw: object) -> object:  # type: ignore[no-untyped-def,type-arg]
    return L.Trainer(
        default_root_dir=str(tmp_path),
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **kw,
    )


def test_lightning_fit_with_accumulation_measures_the_gradients_of_each_step(tmp_path) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    mem = gradlog.MemoryWriter()
    cb, ref = GradlogCallback(writer=mem, every=1, print_report=False), HandReference()
    _trainer(tmp_path, [cb, ref], accumulate_grad_batches=2).fit(Regressor(), _loader())
    got = mem.scalars["weights/grad_norm/body.weight"]
    assert len(ref.norms) == 4  # 8 batches, 2 per optimizer step
    assert [s for s, _ in got] == [1, 2, 3, 4]  # at Lightning's global_step after each step
    assert [v for _, v in got] == pytest.approx(ref.norms, rel=1e-6)  # measured after the closure ran
    assert cb.report is not None and mem.closed
    assert {r.name: r.reason for r in cb.report.never_updated} == {
        "unused.weight": Reason.NO_GRAD,
        "unused.bias": Reason.NO_GRAD,
    }


def test_an_optimizer_index_out_of_range_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=r"optimizer_index=1.*returned 1 optimizer"):
        _trainer(tmp_path, [GradlogCallback(optimizer_index=1, writer="memory")]).fit(Regressor(), _loader())


class Logged(Regressor):
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


def test_check_first_on_the_first_batch_changes_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = []
    for check_first in (False, True):
        torch.manual_seed(0)
        mem = gradlog.MemoryWriter()
        cb = GradlogCallback(check_first=check_first, writer=mem, every=1, print_report=False)
        module = Logged()
        trainer = _trainer(tmp_path / str(check_first), [cb], max_steps=3)
        trainer.fit(module, _loader())
        results.append((cb, {k: v.detach().clone() for k, v in module.state_dict().items()}, mem, trainer))
    (plain_cb, plain, plain_mem, _), (cb, checked, mem, trainer) = results
    assert plain_cb.check_report is None and cb.check_report is not None
    assert {r.name: r.reason for r in cb.check_report.never_updated} == {
        "unused.weight": Reason.NO_GRAD,
        "unused.bias": Reason.NO_GRAD,
    }
    for k in plain:
        assert torch.equal(plain[k], checked[k]), k
    assert mem.scalars["weights/grad_norm/body.weight"] == plain_mem.scalars["weights/grad_norm/body.weight"]
    assert trainer.global_step == 3


def test_gradient_clip_val_norms_are_reported_before_clipping(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Lightning clips after on_before_optimizer_step: gradlog reports the norms from before, and the coefficient."""
    torch.manual_seed(0)
    mem = gradlog.MemoryWriter()
    cb, ref = GradlogCallback(writer=mem, every=1, print_report=False), HandReference()

    class Totals(L.Callback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.totals: list[float] = []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # type: ignore[no-untyped-def]
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            self.totals.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())

    totals = Totals()
    _trainer(tmp_path, [cb, ref, totals], gradient_clip_val=0.05).fit(Regressor(), _loader())
    assert max(totals.totals) > 0.05  # clipping really happened
    assert [v for _, v in mem.scalars["gradlog/grad_norm_total"]] == pytest.approx(totals.totals, rel=1e-5)
    assert [v for _, v in mem.scalars["weights/grad_norm/body.weight"]] == pytest.approx(ref.norms, rel=1e-5)
    coef = [v for _, v in mem.scalars["gradlog/clip_coef"]]
    assert coef == pytest.approx([min(1.0, 0.05 / (t + 1e-6)) for t in totals.totals], rel=1e-5)


def test_report_finds_the_callbacks_run_beside_lightnings_own_event_files(  # type: ignore[no-untyped-def]
    tmp_path, capsys
) -> None:
    """lightning_logs/version_0 holds Lightning's own event file and the callback's run in gradlog/."""
    pytest.importorskip("tensorboard")
    from gradlog.cli.entry import main

    torch.manual_seed(0)
    model = Regressor()
    model.unused = nn.Identity()  # a healthy run
    trainer = L.Trainer(
        default_root_dir=str(tmp_path),
        accelerator="cpu",
        max_epochs=1,
        logger=L.loggers.TensorBoardLogger(str(tmp_path), name="lightning_logs"),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[GradlogCallback(every=1, print_report=False)],
    )
    trainer.fit(model, _loader())
    version = tmp_path / "lightning_logs" / "version_0"
    assert any("tfevents" in p.name for p in version.iterdir())  # Lightning's own
    assert (version / "gradlog").is_dir()
    for where in (version, tmp_path):
        assert main(["report", str(where)]) == 0, capsys.readouterr()
        out = capsys.readouterr().out
        assert f"gradlog report: {version / 'gradlog'}" in out and "gradlog OK" in out


def test_a_fit_resumed_from_its_checkpoint_continues_the_gradlog_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`fit(ckpt_path=...)` gets a new logger version from Lightning, but the gradlog run beside the
    checkpoint goes on: one run over both fits, steps continuing, judged over both."""
    pytest.importorskip("tensorboard")
    import warnings

    from gradlog.readers.run import closed_report, load

    def trainer(epochs: int, cb: GradlogCallback) -> object:
        return L.Trainer(
            default_root_dir=str(tmp_path),
            accelerator="cpu",
            max_epochs=epochs,
            logger=L.loggers.CSVLogger(str(tmp_path)),
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[cb],
        )

    torch.manual_seed(0)
    first = GradlogCallback(every=1, print_report=False)
    trainer(1, first).fit(Regressor(), _loader())  # 8 optimizer steps, a checkpoint at the epoch's end
    assert first.report is not None and first.report.optimizer_steps == 8
    (ckpt,) = (tmp_path / "lightning_logs" / "version_0" / "checkpoints").iterdir()
    second = GradlogCallback(every=1, print_report=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # continued: no "a new run starts"
        trainer(2, second).fit(Regressor(), _loader(), ckpt_path=str(ckpt))
    assert second.report is not None and second.report.optimizer_steps == 16
    assert (tmp_path / "lightning_logs" / "version_1").is_dir()  # Lightning's own new version ...
    assert not (tmp_path / "lightning_logs" / "version_1" / "gradlog").exists()  # ... gradlog's run goes on
    run = load(str(tmp_path / "lightning_logs" / "version_0" / "gradlog"))  # one run, not "holds 2 runs"
    assert [s for s, _ in run.scalars["weights/grad_norm/body.weight"]] == list(range(1, 17))
    report = closed_report(run)
    assert report is not None and report.optimizer_steps == 16
    assert {r.name for r in report.never_updated} == {"unused.weight", "unused.bias"}
