"""A new optimizer mid-run (two-phase fine-tuning): gradlog follows the optimizer that trains the model."""

from __future__ import annotations

import warnings

import pytest
import torch
from catalogue import FrozenInFront
from torch import nn
from torch.optim.optimizer import _global_optimizer_pre_hooks as global_pre_hooks

import gradlog
from gradlog.writers.memory import MemoryWriter


def _step(model: FrozenInFront, opt: torch.optim.Optimizer, x: torch.Tensor) -> dict[str, float]:
    """One training step; returns the body's gradient norms the optimizer is about to use."""
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    norms = {n: float(p.grad.norm()) for n, p in model.named_parameters() if p.grad is not None}
    opt.step()
    return norms


def test_two_phase_fine_tuning_is_followed_and_counted_whole() -> None:
    torch.manual_seed(0)
    model = FrozenInFront()
    model.frozen.requires_grad_(False)
    model.body.requires_grad_(False)  # phase 1: the head alone
    opt1 = torch.optim.SGD(model.head.parameters(), lr=0.05)
    mem = MemoryWriter()
    hooks = len(opt1._optimizer_step_pre_hooks)
    global_before = len(global_pre_hooks)
    gl = gradlog.GradLogger(model, opt1, writer=mem, every=4, histograms=False, alerts=False, print_report=False)
    xs = [torch.randn(16, 6) for _ in range(40)]
    hand: dict[int, dict[str, float]] = {}
    for step in range(20):
        hand[step] = _step(model, opt1, xs[step])
        gl.log()
    # phase 2: a new optimizer over everything that trains; nothing tells gradlog
    model.body.requires_grad_(True)
    opt2 = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(20, 40):
            hand[step] = _step(model, opt2, xs[step])
            gl.log()
    followed = [w for w in caught if "new optimizer" in str(w.message)]
    assert len(followed) == 1 and "Adam" in str(followed[0].message) and "SGD" in str(followed[0].message)
    assert gl.optimizer is opt2
    assert len(opt1._optimizer_step_pre_hooks) == hooks  # the first optimizer's hooks are gone
    report = gl.close()
    assert report.optimizer_steps == 40
    assert report.measured_steps == 10  # steps 0, 4, ..., 36
    assert {r.name for r in report.never_updated} == {"frozen.weight", "frozen.bias"}
    # the body is measured after the swap, with the gradient norms the optimizer used (checked by hand)
    body = dict(mem.scalars["weights/grad_norm/body.weight"])
    for step in (20, 24, 28, 32, 36):
        assert body[step] == pytest.approx(hand[step]["body.weight"], rel=1e-5)
    head = dict(mem.scalars["weights/grad_norm/head.weight"])
    assert set(head) == set(range(0, 40, 4))
    assert head[8] == pytest.approx(hand[8]["head.weight"], rel=1e-5)
    # the switch step itself was measured (hooks registered in the global pre-hook fire for it)
    assert 20 in body
    assert len(global_pre_hooks) == global_before  # close() removed the hook that sees every optimizer


def test_watch_optimizer_follows_without_a_warning_and_adds_its_tensors() -> None:
    torch.manual_seed(1)
    model = nn.Linear(4, 4)
    extra = nn.Parameter(torch.randn(4))  # a tensor the model does not have, handed to the new optimizer
    opt1 = torch.optim.SGD(model.parameters(), lr=0.1)
    gl = gradlog.GradLogger(model, opt1, writer="memory", every=1, histograms=False, print_report=False)
    for _ in range(3):
        opt1.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        opt1.step()
    with pytest.warns(UserWarning, match="optimizer holds a parameter the model does not have"):
        opt2 = torch.optim.SGD([*model.parameters(), extra], lr=0.1)
        gl.watch_optimizer(opt2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # said explicitly: no "new optimizer" warning
        for _ in range(3):
            opt2.zero_grad()
            (model(torch.randn(8, 4)).sum() + extra.sum()).backward()
            opt2.step()
            gl.log()
    report = gl.close()
    assert report.optimizer_steps == 6
    assert report.tracked_tensors == 3  # the extra tensor is tracked (and updated: not named)
    assert report.never_updated == []


def test_an_optimizer_of_other_parameters_is_let_pass() -> None:
    torch.manual_seed(2)
    model, other = nn.Linear(3, 3), nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    gl = gradlog.GradLogger(model, opt, writer="memory", every=1, print_report=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for _ in range(4):
            for m, o in ((model, opt), (other, other_opt)):
                o.zero_grad()
                m(torch.randn(2, 3)).sum().backward()
                o.step()
            gl.log()
    assert gl.optimizer is opt
    assert gl.close().optimizer_steps == 4


def test_log_without_any_watched_step_warns_once() -> None:
    model = nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gl = gradlog.GradLogger(model, opt, writer="memory", every=1, print_report=False)
    opt.zero_grad()
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    gl.log()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3 * gradlog.run.logger.IDLE_LOG_CALLS):
            with torch.no_grad():  # a hand-written update: no optimizer step
                for p in model.parameters():
                    p -= 0.1
            gl.log()
    idle = [w for w in caught if "since the last step" in str(w.message)]
    assert len(idle) == 1 and "watch_optimizer" in str(idle[0].message)
    assert idle[0].filename == __file__
    gl.close()


def test_gradient_accumulation_does_not_warn() -> None:
    model = nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gl = gradlog.GradLogger(model, opt, writer="memory", every=1, print_report=False)
    accumulate = gradlog.run.logger.IDLE_LOG_CALLS // 2
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for _ in range(4):
            for _ in range(accumulate):
                model(torch.randn(2, 3)).sum().backward()
                gl.log()
            opt.step()
            opt.zero_grad()
    gl.close()


def test_a_second_optimizer_over_other_tensors_is_not_followed() -> None:
    """Two optimizers side by side (sparse embeddings + dense, Muon + AdamW): each trains its own tensors, so
    the second is no replacement; gradlog keeps measuring the one it was given, and says nothing."""
    torch.manual_seed(0)
    model = FrozenInFront()
    body, head = list(model.body.parameters()), [*model.head.parameters(), *model.frozen.parameters()]
    first, second = torch.optim.SGD(body, lr=0.1), torch.optim.Adam(head, lr=1e-3)
    gl = gradlog.GradLogger(model, first, writer=MemoryWriter(), every=1, print_report=False)
    hand = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for step in range(6):
            first.zero_grad()
            second.zero_grad()
            model(torch.randn(4, 6)).pow(2).mean().backward()
            hand.append(float(model.body.weight.grad.norm()))
            first.step()
            second.step()
            gl.log(step)
    assert gl.optimizer is first
    report = gl.close()
    assert report.optimizer_steps == 6
    got = [v for _, v in gl.writers.writers[0].scalars["weights/grad_norm/body.weight"]]
    assert got == pytest.approx(hand, rel=1e-6)
