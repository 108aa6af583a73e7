"""Logger-level behaviour that the overhead work touched, checked against hand-computed references."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import gradlog
from gradlog.measure.histogram import Histogram


def _setup(seed: int = 0) -> tuple[nn.Sequential, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt, torch.randn(8, 6)


def test_update_ratio_and_signed_update_histogram_match_sgd_by_hand() -> None:
    model, opt, x = _setup()
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(
        model, opt, writer=mem, every=1, print_report=False, histograms=gradlog.HistogramOptions(bins=8)
    )
    model(x).pow(2).sum().backward()
    w = model[0].weight
    before, grad = w.detach().clone(), w.grad.detach().clone()
    opt.step()
    gl.log(0)
    gl.close()
    update = -0.1 * grad  # SGD without momentum
    expected_ratio = (torch.linalg.vector_norm(update) / torch.linalg.vector_norm(before)).item()
    assert mem.last("weights/update_ratio/0.weight") == pytest.approx(expected_ratio, rel=1e-5)
    h: Histogram = mem.histograms["weights/update/0.weight"][-1][1]
    assert h.min == pytest.approx(update.min().item(), rel=1e-5)
    assert h.max == pytest.approx(update.max().item(), rel=1e-5)
    assert h.sum == pytest.approx(update.sum().item(), rel=1e-4, abs=1e-7)
    assert h.count == w.numel() and h.nonfinite == 0


def test_total_norm_matches_clip_grad_norm() -> None:
    model, opt, x = _setup(1)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=1, histograms=False, print_report=False)
    model(x).pow(2).sum().backward()
    expected = nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9).item()
    opt.step()
    gl.log(0)
    gl.close()
    assert mem.last("gradlog/grad_norm_total") == pytest.approx(expected, rel=1e-6)


def test_nan_and_inf_gradients_are_counted_and_kept_out_of_histograms() -> None:
    model, opt, x = _setup(2)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=1, print_report=False)
    model(x).pow(2).sum().backward()
    g = model[2].weight.grad
    g[0, 0], g[1, 2], g[2, 4] = math.nan, math.inf, -math.inf
    finite = g[torch.isfinite(g)]
    opt.step()
    gl.log(0)
    gl.close()
    assert mem.last("weights/grad_nonfinite/2.weight") == 3
    assert mem.last("weights/grad_nonfinite/0.weight") == 0
    assert mem.last("gradlog/nonfinite_tensors") == 1
    h: Histogram = mem.histograms["weights/grad/2.weight"][-1][1]
    assert (h.count, h.nonfinite) == (finite.numel(), 3)
    lo, hi = min(finite.min().item(), 0.0), max(finite.max().item(), 0.0)  # NaN/Inf stand at 0 for the range
    assert (h.min, h.max) == (pytest.approx(lo), pytest.approx(hi))
    assert math.isfinite(h.sum) and h.sum == pytest.approx(finite.sum().item(), rel=1e-5, abs=1e-6)
    wh: Histogram = mem.histograms["weights/weight/2.weight"][-1][1]  # SGD wrote the NaN/Inf into the weights
    assert wh.nonfinite == 3 and wh.count == g.numel() - 3
