"""Optimizers handed over inside a wrapper: accelerate's AcceleratedOptimizer, a Lightning-style holder."""

from __future__ import annotations

import warnings

import pytest
import torch
from catalogue import BodyHeadUnused

import gradlog
from gradlog import Reason


def test_accelerate_with_gradient_accumulation_counts_real_optimizer_steps() -> None:
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = BodyHeadUnused()
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert type(opt).__name__ == "AcceleratedOptimizer"
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=1, print_report=False)
    steps = []
    for _ in range(8):
        with accelerator.accumulate(model):
            loss = model(torch.randn(4, 6)).pow(2).mean()
            accelerator.backward(loss)
            if accelerator.sync_gradients:  # the step that really updates; its gradient, by hand
                w = model.body.weight
                steps.append((torch.linalg.vector_norm(w.grad).item(), w.detach().clone(), w.grad.detach().clone()))
            opt.step()
            opt.zero_grad()
        gl.log()
    report = gl.close()
    assert len(steps) == 4 and gl.optimizer_steps == 4  # 8 micro-batches, 4 real optimizer steps
    got = mem.scalars["weights/grad_norm/body.weight"]
    assert [s for s, _ in got] == [0, 1, 2, 3]
    assert [v for _, v in got] == pytest.approx([n for n, _, _ in steps], rel=1e-6)
    _, before, grad = steps[-1]
    ratio = (torch.linalg.vector_norm(0.1 * grad) / torch.linalg.vector_norm(before)).item()
    assert mem.last("weights/update_ratio/body.weight") == pytest.approx(ratio, rel=1e-4)
    assert {r.name: r.reason for r in report.never_updated} == {
        "unused.weight": Reason.NO_GRAD,
        "unused.bias": Reason.NO_GRAD,
    }


class Holder:
    """Like Lightning's LightningOptimizer: not an Optimizer, keeps the real one and steps it."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer

    def step(self) -> None:
        self._optimizer.step()


def test_a_holder_that_is_not_an_optimizer_is_unwrapped() -> None:
    torch.manual_seed(0)
    model = BodyHeadUnused()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, Holder(inner), writer=mem, every=1, print_report=False)  # type: ignore[arg-type]
    for step in range(3):
        model(torch.randn(4, 6)).pow(2).mean().backward()
        Holder(inner).step()
        inner.zero_grad()
        gl.log(step)
    gl.close()
    assert gl.optimizer is inner and not inner._optimizer_step_pre_hooks  # hooked there, and unhooked by close()
    assert [s for s, _ in mem.scalars["weights/update_ratio/head.weight"]] == [0, 1, 2]


class Lookahead(torch.optim.Optimizer):
    """A full Optimizer that wraps another and adds to its update: it must be measured itself."""

    def __init__(self, base: torch.optim.Optimizer, alpha: float = 0.5) -> None:
        self.optimizer = base
        super().__init__(base.param_groups, {})
        self.alpha = alpha
        self.slow = [p.detach().clone() for g in base.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self, closure: object = None) -> None:  # type: ignore[override]
        self.optimizer.step()
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        for p, s in zip(params, self.slow):
            s.add_(p - s, alpha=self.alpha)
            p.copy_(s)


def test_a_wrapper_that_is_a_full_optimizer_is_measured_itself() -> None:
    torch.manual_seed(0)
    model = BodyHeadUnused()
    opt = Lookahead(torch.optim.SGD(model.parameters(), lr=0.1))
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=1, print_report=False)
    model(torch.randn(4, 6)).pow(2).mean().backward()
    before = model.head.weight.detach().clone()
    opt.step()
    gl.log(0)
    gl.close()
    assert gl.optimizer is opt
    moved = torch.linalg.vector_norm(model.head.weight.detach() - before) / torch.linalg.vector_norm(before)
    assert mem.last("weights/update_ratio/head.weight") == pytest.approx(
        moved.item(), rel=1e-5
    )  # the half step, not SGD's


def test_an_object_holding_no_optimizer_is_refused() -> None:
    with pytest.raises(TypeError, match=r"optimizer must be a torch\.optim\.Optimizer .*got Holder"):
        gradlog.GradLogger(BodyHeadUnused(), Holder(object()), writer="memory")  # type: ignore[arg-type]


class SAM(torch.optim.Optimizer):
    """SAM's common form: a full Optimizer holding its `base_optimizer` and sharing its param groups (the same
    list), stepped by `first_step` (climb) and `second_step` (restore, then the base's step), never `step`."""

    def __init__(self, params: object, rho: float = 0.05) -> None:
        super().__init__(params, {"rho": rho})  # type: ignore[arg-type]
        self.base_optimizer = torch.optim.SGD(self.param_groups, lr=0.1)
        self.param_groups = self.base_optimizer.param_groups
        self.saved: list[torch.Tensor] = []

    @torch.no_grad()
    def first_step(self) -> None:
        params = [p for g in self.param_groups for p in g["params"]]
        self.saved = [p.detach().clone() for p in params]
        for p in params:
            if p.grad is not None:
                p.add_(p.grad, alpha=0.05)

    @torch.no_grad()
    def second_step(self) -> None:
        for p, s in zip([p for g in self.param_groups for p in g["params"]], self.saved):
            p.copy_(s)
        self.base_optimizer.step()


def test_sam_is_measured_through_its_base_optimizer_without_a_warning() -> None:
    """SAM's own `step` never runs (first_step/second_step do): following SAM itself measured nothing until the
    base's steps were noticed, with a warning that "a new optimizer (SGD)" replaced it."""
    torch.manual_seed(0)
    model = BodyHeadUnused()
    opt = SAM(model.parameters())
    mem = gradlog.MemoryWriter()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gl = gradlog.GradLogger(model, opt, writer=mem, every=1, print_report=False)
        for step in range(3):
            x = torch.randn(4, 6)
            model(x).pow(2).mean().backward()
            opt.first_step()
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.second_step()
            opt.zero_grad()
            gl.log(step)
        report = gl.close()
    assert gl.optimizer is opt.base_optimizer
    assert [s for s, _ in mem.scalars["weights/update_ratio/head.weight"]] == [0, 1, 2]
    assert [(r.name, r.reason) for r in report.never_updated] == [
        ("unused.weight", Reason.NO_GRAD),
        ("unused.bias", Reason.NO_GRAD),
    ]
