"""A notebook cell run twice: a second GradLogger on the same model and optimizer replaces the first."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from torch import nn

import gradlog


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(8, 4)).pow(2).sum().backward()
    opt.step()


def test_second_logger_on_same_model_and_optimizer_replaces_the_first() -> None:
    model, opt = _model()
    before = len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)
    first = gradlog.GradLogger(model, opt, writer="memory", every=1, print_report=False)  # the cell, run once
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second = gradlog.GradLogger(model, opt, writer="memory", every=1, print_report=False)  # ... and again
    replaced = [w for w in caught if "already open" in str(w.message)]
    assert len(replaced) == 1
    # the warning names the line that made the first logger, in this file
    assert f"{__file__}:" in str(replaced[0].message)
    assert replaced[0].filename == __file__  # and points at the user's line, not at gradlog
    assert first.closed and not second.closed
    assert gradlog.run.lifecycle.ACTIVE == [second]
    # exactly one set of step hooks on the optimizer: the second logger's
    assert len(opt._optimizer_step_pre_hooks) == before[0] + 1
    assert len(opt._optimizer_step_post_hooks) == before[1] + 1
    for _ in range(3):
        _step(model, opt)
        second.log()
    assert second.optimizer_steps == 3
    assert first.optimizer_steps == 0  # closed before any step: it measured nothing
    assert second.close().optimizer_steps == 3
    assert len(opt._optimizer_step_pre_hooks) == before[0]


def test_loggers_on_other_models_or_optimizers_stay_open() -> None:
    model, opt = _model()
    other, other_opt = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no replacement warning
        a = gradlog.GradLogger(model, opt, writer="memory", print_report=False)
        b = gradlog.GradLogger(other, other_opt, writer="memory", print_report=False)
    assert not a.closed and not b.closed
    a.close()
    b.close()


def test_where_a_logger_was_made_skips_every_frame_of_gradlog() -> None:
    """`made_at` (and the replace warning) name the first frame outside the whole package: a logger an
    integration makes (gradlog/integrations/, not gradlog/run/) is named at the user's line."""
    from gradlog.run.lifecycle import caller

    package = os.path.dirname(os.path.abspath(gradlog.__file__))
    inside: dict[str, Any] = {}
    code = compile("def made():\n    return caller()\n", os.path.join(package, "integrations", "_run.py"), "exec")
    exec(code, {"caller": caller}, inside)
    assert inside["made"]().startswith(f"{__file__}:")
