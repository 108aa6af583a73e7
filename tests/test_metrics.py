"""Every per-tensor metric against a reference computed by hand in the test."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
from catalogue import TwoLayer
from torch import nn

import gradlog

OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adamw_forloop": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
}


def _reference(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, micro: int, zero_first: bool):
    """One optimizer step done by hand: returns {name: (grad_norm, zero_frac, nonfinite, ratio, weight_norm)}."""
    if zero_first:
        opt.zero_grad()
    for chunk in x.chunk(micro):
        model(chunk).pow(2).mean().backward()
    params = dict(model.named_parameters())
    grads = {n: p.grad.detach().clone() for n, p in params.items()}
    before = {n: p.detach().clone() for n, p in params.items()}
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=float("inf")).item()
    opt.step()
    out = {}
    for n, p in params.items():
        g = grads[n]
        out[n] = (
            torch.linalg.vector_norm(g).item(),
            (g == 0).sum().item() / g.numel(),
            (~torch.isfinite(g)).sum().item(),
            (torch.linalg.vector_norm(p.detach() - before[n]) / torch.linalg.vector_norm(before[n])).item(),
            torch.linalg.vector_norm(p.detach()).item(),
        )
    if not zero_first:
        opt.zero_grad()
    return out, total


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("zero_first", [True, False], ids=["zero_grad_before_backward", "zero_grad_after_step"])
@pytest.mark.parametrize("micro", [1, 3], ids=["no_accum", "accum3"])
def test_metrics_equal_hand_reference(opt_name: str, zero_first: bool, micro: int) -> None:
    torch.manual_seed(0)
    ref_model = TwoLayer(torch.relu)
    model = TwoLayer(torch.relu)
    model.load_state_dict(ref_model.state_dict())
    ref_opt = OPTIMIZERS[opt_name](list(ref_model.parameters()))
    opt = OPTIMIZERS[opt_name](list(model.parameters()))
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=2, print_report=False)
    refs = []
    for step in range(5):
        x = torch.randn(12, 6)
        refs.append(_reference(ref_model, ref_opt, x, micro, zero_first))
        # the monitored model: same data, and log() called after every micro-batch too
        if zero_first:
            opt.zero_grad()
        for chunk in x.chunk(micro):
            model(chunk).pow(2).mean().backward()
            gl.log(step)
        opt.step()
        gl.log(step)
        if not zero_first:
            opt.zero_grad()
    gl.close()
    measured = [0, 2, 4]
    assert [s for s, _ in mem.scalars["weights/grad_norm/a.weight"]] == measured
    for i, step in enumerate(measured):
        ref, total = refs[step]
        for name, (gnorm, zfrac, nonfinite, ratio, wnorm) in ref.items():
            assert mem.scalars[f"weights/grad_norm/{name}"][i] == (step, pytest.approx(gnorm, rel=1e-5))
            assert mem.scalars[f"weights/grad_zero_frac/{name}"][i] == (step, pytest.approx(zfrac, abs=1e-12))
            assert mem.scalars[f"weights/grad_nonfinite/{name}"][i] == (step, nonfinite)
            assert mem.scalars[f"weights/update_ratio/{name}"][i] == (step, pytest.approx(ratio, rel=1e-4))
            assert mem.scalars[f"weights/weight_norm/{name}"][i] == (step, pytest.approx(wnorm, rel=1e-5))
        assert mem.scalars["gradlog/grad_norm_total"][i] == (step, pytest.approx(total, rel=1e-5))


def test_zero_fractions_are_counted_on_histogram_steps_only() -> None:
    torch.manual_seed(0)
    model = TwoLayer(torch.relu)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(
        model, opt, writer=mem, every=2, print_report=False, histograms=gradlog.HistogramOptions(every=4)
    )
    zero_fracs = {}
    for step in range(9):
        model(torch.randn(4, 6)).sum().backward()
        g = model.a.weight.grad
        zero_fracs[step] = (g == 0).sum().item() / g.numel()
        opt.step()
        opt.zero_grad()
        gl.log(step)
    gl.close()
    assert [s for s, _ in mem.scalars["weights/grad_norm/a.weight"]] == [0, 2, 4, 6, 8]
    assert mem.scalars["weights/grad_zero_frac/a.weight"] == [(s, pytest.approx(zero_fracs[s])) for s in (0, 4, 8)]
    assert [s for s, _ in mem.scalars["weights/grad_nonfinite/a.weight"]] == [0, 2, 4, 6, 8]


@pytest.mark.parametrize(("histograms", "count_zeros", "counted"), [(False, True, [0, 2, 4]), (True, False, [])])
def test_count_zeros_overrides_the_histogram_schedule(histograms: bool, count_zeros: bool, counted: list[int]) -> None:
    torch.manual_seed(0)
    model = TwoLayer(torch.relu)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(
        model,
        opt,
        writer=mem,
        every=2,
        print_report=False,
        histograms=gradlog.HistogramOptions(
            kinds=("grad", "weight", "update") if histograms else (), count_zeros=count_zeros
        ),
    )
    zero_fracs = {}
    for step in range(5):
        model(torch.randn(4, 6)).sum().backward()
        g = model.b.weight.grad
        zero_fracs[step] = (g == 0).sum().item() / g.numel()
        opt.step()
        opt.zero_grad()
        gl.log(step)
    gl.close()
    assert mem.scalars.get("weights/grad_zero_frac/b.weight", []) == [
        (s, pytest.approx(zero_fracs[s])) for s in counted
    ]


def test_count_zeros_must_be_a_bool_or_none() -> None:
    with pytest.raises(ValueError, match=r"count_zeros must be None .* got 'yes'"):
        gradlog.GradLogger(
            TwoLayer(torch.relu),
            writer="memory",
            histograms=gradlog.HistogramOptions(count_zeros="yes"),  # type: ignore[arg-type]
        )


def test_weight_norms_of_frozen_and_unoptimised_tensors_beside_moving_ones() -> None:
    """Moving tensors get their weight norm with the update; the others need one of their own."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 3))
    model[2].weight.requires_grad_(False)
    opt = torch.optim.AdamW([model[0].weight, model[0].bias, model[2].bias, model[4].bias], lr=1e-2)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=1, print_report=False)
    for step in range(3):
        model(torch.randn(4, 6)).pow(2).mean().backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        gl.log(step)
        for n, p in model.named_parameters():
            if not p.requires_grad:  # frozen: not read on measured steps (fingerprinted at start and close only)
                assert f"weights/weight_norm/{n}" not in mem.scalars and f"weights/update_ratio/{n}" not in mem.scalars
                continue
            assert mem.last(f"weights/weight_norm/{n}") == pytest.approx(torch.linalg.vector_norm(p).item(), rel=1e-6)
            if p.requires_grad and any(p is q for q in opt.param_groups[0]["params"]):
                want = torch.linalg.vector_norm(p.detach() - before[n]) / torch.linalg.vector_norm(before[n])
                assert mem.last(f"weights/update_ratio/{n}") == pytest.approx(want.item(), rel=1e-4), n
            else:
                assert f"weights/update_ratio/{n}" not in mem.scalars, n
        opt.zero_grad()
    gl.close()


def test_default_x_axis_is_the_measured_optimizer_step_index() -> None:
    torch.manual_seed(0)
    model = TwoLayer(torch.relu)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=3, print_report=False)
    for _ in range(7):
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
        opt.zero_grad()
        gl.log()
    gl.close()
    assert [s for s, _ in mem.scalars["weights/grad_norm/b.bias"]] == [0, 3, 6]


def test_histograms_match_finite_values_and_count_nonfinite() -> None:
    torch.manual_seed(0)
    model = nn.Linear(50, 40)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(
        model, opt, writer=mem, every=1, print_report=False, histograms=gradlog.HistogramOptions(bins=16)
    )
    model(torch.randn(8, 50)).sum().backward()
    model.weight.grad[0, :5] = float("nan")
    model.weight.grad[1, :2] = float("inf")
    g = model.weight.grad.clone()
    opt.step()
    gl.log(0)
    gl.close()
    h = mem.histograms["weights/grad/weight"][0][1]
    finite = g[torch.isfinite(g)]
    assert h.nonfinite == 7
    assert h.count == finite.numel() == sum(h.counts)
    assert h.min == pytest.approx(finite.min().item())
    assert h.max == pytest.approx(finite.max().item())
    assert h.sum == pytest.approx(finite.sum().item(), rel=1e-5)
    assert h.sum_squares == pytest.approx(finite.pow(2).sum().item(), rel=1e-5)
    ref = torch.histc(finite, bins=16, min=h.min, max=h.max)
    # bucket edges are computed the same way; allow values sitting exactly on an edge to move by one bucket
    assert sum(abs(a - b) for a, b in zip(h.counts, ref.tolist())) <= 2
    assert len(h.edges) == 17
    assert mem.scalars["weights/grad_nonfinite/weight"][0][1] == 7
    assert mem.scalars["gradlog/nonfinite_tensors"][0][1] == 1
    assert math.isnan(mem.scalars["weights/grad_norm/weight"][0][1])
    # lr 0 times a NaN gradient is NaN: SGD writes the 7 NaN/Inf into the weights, and the update shows them
    w = mem.histograms["weights/weight/weight"][0][1]
    assert (w.count, w.nonfinite) == (1993, 7)
    u = mem.histograms["weights/update/weight"][0][1]
    assert (u.count, u.nonfinite) == (1993, 7)
    assert u.min == u.max == 0.0  # a constant update lands in one bucket
    assert u.counts[0] == 1993


def test_histogram_of_all_nan_gradient_is_empty_not_poisoned() -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=1, print_report=False)
    model(torch.randn(2, 3)).sum().backward()
    model.weight.grad.fill_(float("nan"))
    opt.step()
    gl.log(0)
    gl.close()
    h = mem.histograms["weights/grad/weight"][0][1]
    assert (h.count, h.nonfinite, sum(h.counts)) == (0, 6, 0)
    assert all(math.isfinite(v) for v in (h.min, h.max, h.sum, h.sum_squares))


def test_update_ratio_of_zero_initialised_tensor_is_finite() -> None:
    model = nn.Linear(3, 2)
    nn.init.zeros_(model.bias)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=1, print_report=False)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    gl.log(0)
    gl.close()
    # measured against the weights after the step: the bias moved by its whole size
    assert mem.last("weights/update_ratio/bias") == pytest.approx(1.0)


def test_optimizer_none_measures_gradients_at_log_time() -> None:
    torch.manual_seed(0)
    model = TwoLayer(torch.relu)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, None, writer=mem, every=2, print_report=False)
    norms = []
    for step in range(4):
        model(torch.randn(4, 6)).sum().backward()
        norms.append(torch.linalg.vector_norm(model.a.weight.grad).item())
        gl.log(step)
        opt.step()
        opt.zero_grad()
    report = gl.close()
    assert mem.scalars["weights/grad_norm/a.weight"] == [(0, pytest.approx(norms[0])), (2, pytest.approx(norms[2]))]
    assert not any(t.startswith("weights/update_ratio/") for t in mem.scalars)
    assert report.never_updated == []


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_is_torchs_and_reports_norms_from_before_clipping(norm_type: float) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=2, print_report=False)
    for step in range(4):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        for m in (model, twin):
            (m(x).pow(2).sum() * 50).backward()
        before = {n: torch.linalg.vector_norm(p.grad).item() for n, p in model.named_parameters()}
        total = gradlog.clip_grad_norm_(model.parameters(), 0.5, norm_type=norm_type)
        want = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.5, norm_type=norm_type)
        assert torch.equal(total, want)  # torch's result, and the same clipped gradients
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), twin.parameters()))
        opt.step()
        twin_opt.step()
        gl.log(step)
        if step % 2 == 0:  # a measured step: norms from before clipping, and the coefficient
            coef = min(1.0, 0.5 / (want.item() + 1e-6))
            assert coef < 1 and mem.last("gradlog/clip_coef") == pytest.approx(coef, rel=1e-6)
            for n, v in before.items():
                assert mem.last(f"weights/grad_norm/{n}") == pytest.approx(v, rel=1e-5), n
        opt.zero_grad()
        twin_opt.zero_grad()
    gl.close()
    assert [s for s, _ in mem.scalars["gradlog/clip_coef"]] == [0, 2]
