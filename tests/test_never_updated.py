"""Planted-bug training runs: each asserts the exact set of reported tensors and each one's reason."""

from __future__ import annotations

import copy
from collections.abc import Callable

import catalogue
import pytest
import torch
from catalogue import TiedLM, TinyEncoderLM, TwoPath, mse
from torch import nn

import gradlog
from gradlog import Reason

Loss = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: int = 12,
    every: int = 3,
    loss_fn: Loss = mse,
    dim: int = 6,
    gl: gradlog.GradLogger | None = None,
    histograms: bool = True,
) -> gradlog.Report:
    gl = gl or gradlog.GradLogger(model, opt, writer="memory", every=every, print_report=False, histograms=histograms)
    gen = torch.Generator().manual_seed(1)
    return catalogue.train(opt, gl, steps, lambda step: loss_fn(model, torch.randn(16, dim, generator=gen)))


def reported(report: gradlog.Report) -> dict[str, Reason]:
    return {r.name: r.reason for r in report.never_updated}


def test_frozen_layer() -> None:
    torch.manual_seed(0)
    model = TwoPath()
    model.branch.requires_grad_(False)
    report = train(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))
    assert reported(report) == {"branch.weight": Reason.FROZEN, "branch.bias": Reason.FROZEN}
    assert report.healthy  # frozen before the optimizer was built from the trainable tensors: intentional
    assert all(r.intentional and not r.suspect for r in report.never_updated)


def test_frozen_before_training_inside_the_optimizer_is_a_note() -> None:
    """Frozen before gradlog started, yet handed to the optimizer (built from model.parameters(), as most
    examples do): harmless, it never gets a gradient. A note that says so, not a suspect freeze."""
    torch.manual_seed(0)
    model = TwoPath()
    model.branch.requires_grad_(False)
    report = train(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert reported(report) == {"branch.weight": Reason.FROZEN, "branch.bias": Reason.FROZEN}
    assert all(r.intentional and not r.suspect for r in report.never_updated)
    detail = report.never_updated[0].detail
    assert "already False when gradlog started" in detail and "param group 0" in detail and "harmless" in detail
    assert report.healthy and report.verdict.startswith("gradlog OK")


def test_a_model_that_freezes_its_sinusoidal_table_is_healthy() -> None:
    """The issue's case: a model freezes its fixed sinusoidal position table in __init__ and the optimizer is
    built from model.parameters(), as README's quickstart does: the table is a `frozen` note, the run OK."""
    torch.manual_seed(0)
    model = catalogue.SinusoidalEncoder()
    table = model.positions.detach().clone()
    report = train(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert torch.equal(model.positions, table)  # the reference: it truly never changed
    assert reported(report) == {"positions": Reason.FROZEN}
    assert not report.never_updated[0].suspect and report.healthy, report.verdict
    assert "frozen_suspect" not in report.verdict


def test_frozen_mid_run_inside_the_optimizer_is_a_suspect_finding() -> None:
    """Trainable when gradlog started, in a param group, then frozen before it ever updated: frozen after
    training began, a mistake; the detail says that, not a cause that fits a deliberate freeze."""
    torch.manual_seed(0)
    model = TwoPath()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gl = gradlog.GradLogger(model, opt, writer="memory", every=3, print_report=False)
    model.branch.requires_grad_(False)  # a freeze meant for another layer, run once training began
    report = train(model, opt, gl=gl)
    assert reported(report) == {"branch.weight": Reason.FROZEN, "branch.bias": Reason.FROZEN}
    assert all(r.suspect and not r.intentional for r in report.never_updated)
    detail = report.never_updated[0].detail
    assert "was True when gradlog started" in detail and "in optimizer param group 0" in detail
    assert "frozen during the run" in detail and "build the optimizer from the trainable" not in detail
    assert not report.healthy and "frozen_suspect 2" in report.verdict


def test_frozen_after_the_logger_started_is_a_suspect_finding() -> None:
    torch.manual_seed(0)
    model = TwoPath()
    opt = torch.optim.AdamW([model.main.weight, model.main.bias], lr=1e-2)  # branch: not in the optimizer
    gl = gradlog.GradLogger(model, opt, writer="memory", every=1, print_report=False)
    model.branch.requires_grad_(False)  # trainable when gradlog started, frozen before any step
    report = train(model, opt, gl=gl)
    assert reported(report) == {"branch.weight": Reason.FROZEN, "branch.bias": Reason.FROZEN}
    assert all(r.suspect for r in report.never_updated)
    assert "frozen during the run" in report.never_updated[0].detail and not report.healthy


def test_layer_added_after_the_optimizer_was_built() -> None:
    torch.manual_seed(0)
    model = TwoPath()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gl = gradlog.GradLogger(model, opt, writer="memory", every=3, print_report=False)
    model.extra = nn.Linear(4, 4)  # the logger picks it up at the next measured step
    report = train(model, opt, gl=gl, loss_fn=lambda m, x: m.extra(m(x)).pow(2).mean())
    assert reported(report) == {"extra.weight": Reason.NOT_IN_OPTIMIZER, "extra.bias": Reason.NOT_IN_OPTIMIZER}
    assert not report.healthy


def test_unused_head() -> None:
    torch.manual_seed(0)
    model = TwoPath()
    model.head = nn.Linear(4, 2)
    report = train(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert reported(report) == {"head.weight": Reason.NO_GRAD, "head.bias": Reason.NO_GRAD}
    assert "4 measured steps" in report.never_updated[0].detail


def test_detached_branch() -> None:
    torch.manual_seed(0)
    model = TwoPath("detached")
    report = train(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert reported(report) == {"branch.weight": Reason.NO_GRAD, "branch.bias": Reason.NO_GRAD}


def test_param_group_with_lr_zero() -> None:
    torch.manual_seed(0)
    model = TwoPath()
    opt = torch.optim.Adam(
        [{"params": model.main.parameters()}, {"params": model.branch.parameters(), "lr": 0.0}], lr=1e-2
    )
    report = train(model, opt)
    assert reported(report) == {"branch.weight": Reason.ZERO_LR, "branch.bias": Reason.ZERO_LR}


# Without histograms zeros are not counted: "all zero" then comes from the norm, and must agree.
SCALARS_ONLY = pytest.mark.parametrize("histograms", [True, False], ids=["counted", "scalars_only"])


@SCALARS_ONLY
@pytest.mark.parametrize("weight_decay", [0.0, 0.1], ids=["adam", "adamw_decay"])
def test_branch_multiplied_by_zero(weight_decay: float, histograms: bool) -> None:
    torch.manual_seed(0)
    model = TwoPath("times_zero")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=weight_decay)
    report = train(model, opt, histograms=histograms)
    # with weight decay the branch does move, but only by decay: it still never learned
    assert reported(report) == {"branch.weight": Reason.ZERO_GRAD, "branch.bias": Reason.ZERO_GRAD}


@SCALARS_ONLY
def test_dead_relu_layer(histograms: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    with torch.no_grad():
        model[0].bias.fill_(-100.0)  # every pre-activation negative: the ReLU never fires
    report = train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), histograms=histograms)
    # the dead layer, and the weight that only ever sees its zeros; the output bias still learns
    assert reported(report) == {"0.weight": Reason.ZERO_GRAD, "0.bias": Reason.ZERO_GRAD, "2.weight": Reason.ZERO_GRAD}


@SCALARS_ONLY
def test_a_gradient_too_small_to_square_is_not_a_zero_gradient(histograms: bool) -> None:
    """|g| ~ 1e-30: its fp32 sum of squares is 0, yet it is not zero; SGD's update rounds away."""
    torch.manual_seed(0)
    model = TwoPath()

    def loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m.main(x).pow(2).mean() + 1e-30 * m.branch(x).sum()

    report = train(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=loss, histograms=histograms)
    # fp32: no ordinary update rounds away, so the reason is the gradient's size, not bf16 rounding
    assert reported(report) == {"branch.weight": Reason.TINY_UPDATE, "branch.bias": Reason.TINY_UPDATE}
    assert all("master weights" not in r.detail and "float32" in r.detail for r in report.never_updated)


def test_nan_gradients_from_log_of_a_negative() -> None:
    torch.manual_seed(0)
    model = TwoPath()
    model.gate = nn.Linear(6, 1)
    with torch.no_grad():
        model.gate.bias.fill_(-100.0)

    def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x).pow(2).mean() + torch.log(m.gate(x)).pow(2).mean()  # log of a negative: NaN grads

    report = train(model, torch.optim.SGD(model.parameters(), lr=0.01), loss_fn=loss_fn)
    assert reported(report) == {"gate.weight": Reason.NONFINITE_GRAD, "gate.bias": Reason.NONFINITE_GRAD}
    assert report.first_nonfinite is not None
    assert (report.first_nonfinite.step, report.first_nonfinite.name) == (0, "gate.weight")
    assert "step 0 in gate.weight" in report.verdict


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bf16_weights_with_a_tiny_adam_lr(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = TwoPath().to(dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-7)
    report = train(model, opt, loss_fn=lambda m, x: m(x.to(dtype)).float().pow(2).mean())
    if dtype == torch.bfloat16:
        assert set(reported(report).values()) == {Reason.BELOW_PRECISION}
        assert set(reported(report)) == {"main.weight", "main.bias", "branch.weight", "branch.bias"}
        assert "bfloat16" in report.never_updated[0].detail
    else:
        assert reported(report) == {}


def _lm_loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    tokens = (x.abs() * 7).long().clamp(max=19)
    return nn.functional.cross_entropy(m(tokens).reshape(-1, 20), tokens.reshape(-1))


def test_tied_embeddings_healthy_are_not_reported_and_counted_once() -> None:
    torch.manual_seed(0)
    model = TiedLM()
    mem = gradlog.MemoryWriter()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gl = gradlog.GradLogger(model, opt, writer=mem, every=3, print_report=False)
    report = train(model, opt, gl=gl, loss_fn=_lm_loss)
    assert reported(report) == {}
    assert report.tracked_tensors == 3  # emb.weight (= head.weight), norm.weight, norm.bias
    assert "weights/grad_norm/emb.weight" in mem.scalars and "weights/grad_norm/head.weight" not in mem.scalars


def test_tied_embeddings_frozen_are_reported_once_with_alias() -> None:
    torch.manual_seed(0)
    model = TiedLM()
    model.emb.weight.requires_grad_(False)
    report = train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=_lm_loss)
    assert reported(report) == {"emb.weight": Reason.FROZEN}
    assert report.never_updated[0].aliases == ("head.weight",)


def test_healthy_transformer_like_model_reports_nothing() -> None:
    torch.manual_seed(0)
    model = TinyEncoderLM()

    def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        tokens = (x.abs() * 10).long().clamp(max=31)[:, :8]
        return nn.functional.cross_entropy(m(tokens).reshape(-1, 32), tokens.reshape(-1))

    report = train(model, torch.optim.AdamW(model.parameters(), lr=3e-3), steps=20, every=5, loss_fn=loss_fn, dim=8)
    assert report.never_updated == []
    assert report.healthy and report.first_nonfinite is None
    assert report.verdict.startswith("gradlog OK")


def _fused_amp_run(steps: int, overflow: set[int]) -> gradlog.Report:
    """Fused AdamW under GradScaler: the loss is multiplied by inf on the `overflow` steps."""
    torch.manual_seed(0)
    model = TwoPath()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    gl = gradlog.GradLogger(model, opt, writer="memory", every=1, print_report=False)
    for step in range(steps):
        loss = model(torch.randn(4, 6)).pow(2).mean() * (float("inf") if step in overflow else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        gl.log(step)
        opt.zero_grad()
    return gl.close()


def test_every_step_skipped_is_nonfinite_grad_with_fused_found_inf() -> None:
    """A fused optimizer under GradScaler is told to skip through `found_inf`; the post-hook still fires."""
    report = _fused_amp_run(4, overflow={0, 1, 2, 3})
    assert set(reported(report).values()) == {Reason.NONFINITE_GRAD}
    assert report.skipped_steps == 4


def test_a_routine_gradscaler_overflow_skip_keeps_the_run_healthy() -> None:
    report = _fused_amp_run(5, overflow={1})
    assert report.never_updated == [] and report.skipped_steps == 1
    assert report.first_nonfinite is None and report.healthy
    assert "1 optimizer step skipped" in report.verdict


# --- bugs that explain every record at once get a run-level hint ----------------------------------


def _step_wrongly(order: str, steps: int = 4) -> gradlog.Report:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gl = gradlog.GradLogger(model, opt, writer="memory", every=1, print_report=False)
    for step in range(steps):
        model(torch.randn(4, 6)).pow(2).mean().backward()
        opt.zero_grad(set_to_none=order == "zero_grad_to_none")
        opt.step()
        gl.log(step)
    return gl.close()


def test_zero_grad_between_backward_and_step_is_named() -> None:
    report = _step_wrongly("zero_grad_to_none")
    assert set(reported(report).values()) == {Reason.NO_GRAD} and len(report.never_updated) == 4
    assert report.hint is not None and "zero_grad() called between backward() and step()" in report.hint
    # said once, in the report, not repeated on every row
    assert not any("zero_grad()" in r.detail for r in report.never_updated)
    assert report.table().count("zero_grad() called between") == 1


def test_zero_grad_keeping_zeros_between_backward_and_step_is_named() -> None:
    report = _step_wrongly("zero_grad_to_zeros")
    assert set(reported(report).values()) == {Reason.ZERO_GRAD} and len(report.never_updated) == 4
    assert report.hint is not None and "zero_grad(set_to_none=False)" in report.hint


def test_one_unused_head_gets_no_run_level_hint() -> None:
    torch.manual_seed(0)
    model = TwoPath()
    model.head = nn.Linear(4, 2)
    report = train(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert reported(report) == {"head.weight": Reason.NO_GRAD, "head.bias": Reason.NO_GRAD}
    assert not any("zero_grad" in r.detail for r in report.never_updated) and report.hint is None


def test_optimizer_built_for_another_copy_of_the_model_is_named() -> None:
    torch.manual_seed(0)
    original = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = torch.optim.SGD(original.parameters(), lr=0.1)
    model = copy.deepcopy(original)
    with pytest.warns(UserWarning, match="optimizer holds a parameter the model does not have"):
        gl = gradlog.GradLogger(model, opt, writer="memory", every=1, print_report=False)
    for step in range(3):
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
        opt.zero_grad()
        gl.log(step)
    report = gl.close()
    mine = {r.name: r for r in report.never_updated if not r.name.startswith("optimizer.")}
    assert set(mine) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for rec in mine.values():
        assert rec.reason == Reason.NOT_IN_OPTIMIZER
    assert report.hint is not None
    assert "another copy of the model" in report.hint and "holds 4 tensors the model does not have" in report.hint
    theirs = [r for r in report.never_updated if r.name.startswith("optimizer.")]
    assert len(theirs) == 4 and {r.reason for r in theirs} == {Reason.NOT_IN_MODEL}
    assert all("not in the model passed to gradlog" in r.detail for r in theirs)


class _CountReads(torch.overrides.TorchFunctionMode):
    """Counts torch operations that take one of `watched` (by identity) as an argument; property reads
    such as `.requires_grad` or `.grad` are not reads of the values and are not counted."""

    def __init__(self, watched: list[torch.Tensor]) -> None:
        super().__init__()
        self.ids = {id(t) for t in watched}
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") != "__get__":
            flat = [*args, *kwargs.values()]
            flat += [x for a in flat if isinstance(a, (list, tuple)) for x in a]
            self.reads += sum(id(a) in self.ids for a in flat)
        return func(*args, **kwargs)


def test_frozen_tensors_are_not_read_on_measured_steps_only_fingerprinted_at_start_and_close() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    model[0].requires_grad_(False)
    frozen = [model[0].weight, model[0].bias]
    opt = torch.optim.AdamW(model[2].parameters(), lr=1e-2)
    mem = gradlog.MemoryWriter()
    # histograms on every step; no provisional tables: those are a wall-clock-gated snapshot of the close-time
    # answer (issue 15), which fingerprints every tensor like close() does, not part of the per-step measurement
    gl = gradlog.GradLogger(
        model, opt, every=1, print_report=False, writer=gradlog.Output(writer=mem, provisional_every=None)
    )
    counter = _CountReads(frozen)
    for step in range(3):
        model(torch.randn(4, 6)).pow(2).mean().backward()
        with counter:
            opt.step()  # a measured step: gradlog's hooks run here
            gl.log(step)
        opt.zero_grad()
    assert counter.reads == 0
    assert not any(t.endswith(("/0.weight", "/0.bias")) for t in [*mem.scalars, *mem.histograms])
    with counter:  # the counter does see reads: close() fingerprints every tensor once more
        report = gl.close()
    assert counter.reads > 0
    assert {r.name: r.reason for r in report.never_updated} == {"0.weight": Reason.FROZEN, "0.bias": Reason.FROZEN}
    assert report.healthy


def test_a_replaced_head_still_in_the_optimizer_is_named_so() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gl = gradlog.GradLogger(model, opt, writer="memory", every=1, print_report=False)
    model[2] = nn.Linear(8, 3)  # a new head after the optimizer was built
    report = train(model, opt, gl=gl, steps=3)
    by = {(r.name, r.reason) for r in report.never_updated}
    assert by == {
        ("2.weight", Reason.NOT_IN_MODEL),
        ("2.bias", Reason.NOT_IN_MODEL),
        ("2.weight", Reason.NOT_IN_OPTIMIZER),
        ("2.bias", Reason.NOT_IN_OPTIMIZER),
    }
    old = [r for r in report.never_updated if r.reason == Reason.NOT_IN_MODEL]
    assert all("no longer in the model" in r.detail and "unused in forward" not in r.detail for r in old)


def test_console_groups_thousands_of_frozen_tensors_into_a_few_lines() -> None:
    from gradlog.verdict.report import NeverUpdated

    recs = [
        NeverUpdated(f"transformer.h.{i}.{part}", (64, 64), 4096, Reason.FROZEN, "requires_grad is False")
        for i in range(100)
        for part in ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "ln_1.weight")
    ]
    recs += [NeverUpdated("transformer.wte.weight", (50, 64), 3200, Reason.FROZEN, "requires_grad is False")]
    recs += [NeverUpdated("head.weight", (2, 64), 128, Reason.NO_GRAD, "grad None")]
    report = gradlog.Report(never_updated=recs, tracked_tensors=403)
    text = report.table()
    lines = text.replace("\n  ", " ").splitlines()  # a note wrapped at the console's width is one line
    # heading, header, rule, the finding, two frozen lines, a blank line, the frozen note, the verdict
    assert len(lines) <= 9
    assert len(text.splitlines()) <= 9 + 2  # the note names its first few tensors in at most 3 lines
    assert sum(ln.startswith("note: never.frozen in 401 tensors") for ln in lines) == 1  # one line, not 401
    assert lines[0].startswith("Never updated") and lines[3].startswith("head.weight")  # the row that matters first
    assert any(ln.startswith("transformer.h.*") and "400 tensors, 1.6M params: frozen" in ln for ln in lines)
    assert len(report.never_updated) == 402  # the writers' table keeps every row
