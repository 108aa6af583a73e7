"""optimizer.step(closure): the gradients are made inside step(), so they are measured after the closure."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gradlog


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))


@pytest.mark.parametrize("as_kwarg", [True, False], ids=["closure=", "positional"])
def test_closure_step_measures_the_gradients_the_closure_made(as_kwarg: bool) -> None:
    model = _model()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=1, print_report=False)
    want_norms, want_ratios = [], []
    for step in range(4):
        x = torch.randn(6, 5)

        def closure(m: nn.Module = model, o: torch.optim.Optimizer = opt, x: torch.Tensor = x) -> torch.Tensor:
            o.zero_grad()  # set_to_none: before the closure runs, the pre-hook sees no gradient at all
            loss = m(x).pow(2).mean()
            loss.backward()
            return loss

        ref_opt.zero_grad()
        ref(x).pow(2).mean().backward()
        w = ref[0].weight
        want_norms.append(torch.linalg.vector_norm(w.grad).item())
        before = w.detach().clone()
        ref_opt.step()
        want_ratios.append((torch.linalg.vector_norm(w.detach() - before) / torch.linalg.vector_norm(before)).item())
        if as_kwarg:
            opt.step(closure=closure)
        else:
            opt.step(closure)
        gl.log(step)
    report = gl.close()
    assert [v for _, v in mem.scalars["weights/grad_norm/0.weight"]] == pytest.approx(want_norms, rel=1e-6)
    assert [v for _, v in mem.scalars["weights/update_ratio/0.weight"]] == pytest.approx(want_ratios, rel=1e-5)
    assert report.never_updated == []


def test_lbfgs_measures_the_whole_step_from_its_starting_point() -> None:
    """LBFGS calls the closure many times and moves the weights in between."""
    model = _model()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=1, print_report=False)
    x = torch.randn(16, 5)
    calls = []

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        calls.append(torch.linalg.vector_norm(model[2].weight.grad).item())
        return loss

    before = model[2].weight.detach().clone()
    opt.step(closure)
    gl.log(0)
    gl.close()
    assert len(calls) > 2  # several evaluations inside one step
    assert mem.last("weights/grad_norm/2.weight") == pytest.approx(calls[0], rel=1e-6)  # the gradient at the start
    moved = torch.linalg.vector_norm(model[2].weight.detach() - before) / torch.linalg.vector_norm(before)
    assert mem.last("weights/update_ratio/2.weight") == pytest.approx(moved.item(), rel=1e-5)  # the whole step's update
