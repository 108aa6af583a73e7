"""GradScaler, low-precision weights and torch.compile: the numbers must still be the true ones."""

from __future__ import annotations

import collections
import copy
import warnings

import pytest
import torch
from catalogue import TwoLayer, mse, train
from torch import nn

import gradlog
from gradlog import Reason


def batch(step: int) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(step))


def run_scaled(
    make_opt: object,
    skip: set[int],
    steps: int,
    pass_scaler: bool,
    unscale_first: bool = False,
) -> tuple[gradlog.MemoryWriter, gradlog.Report, dict[int, dict[str, float]], list[dict[str, torch.Tensor]]]:
    """Train under GradScaler; the loss is multiplied by inf on the steps in `skip`.

    Returns what gradlog wrote, its report, the unscaled grad norms computed by hand before each
    scaler.step, and the weights after each step.
    """
    torch.manual_seed(0)
    model = TwoLayer(torch.tanh)
    opt = make_opt(model.parameters())  # type: ignore[operator]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=1, print_report=False, scaler=scaler if pass_scaler else None)
    by_hand: dict[int, dict[str, float]] = {}
    weights = []
    for step in range(steps):
        loss = model(batch(step)).pow(2).mean()
        if step in skip:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if unscale_first:
            scaler.unscale_(opt)
            by_hand[step] = {n: torch.linalg.vector_norm(p.grad).item() for n, p in model.named_parameters()}
        else:
            scale = scaler.get_scale()
            by_hand[step] = {n: torch.linalg.vector_norm(p.grad).item() / scale for n, p in model.named_parameters()}
        scaler.step(opt)
        scaler.update()
        gl.log(step)
        opt.zero_grad()
        weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return mem, gl.close(), by_hand, weights


NON_FUSED = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
}


@pytest.mark.parametrize("unscale_first", [False, True], ids=["scaler.step", "unscale_+step"])
@pytest.mark.parametrize("name", sorted(NON_FUSED))
def test_non_fused_grad_norms_are_unscaled_and_skips_counted(name: str, unscale_first: bool) -> None:
    skip = {0, 3, 4, 7}  # a skip before any step ran, consecutive skips, skips right after the scale grew
    mem, report, by_hand, weights = run_scaled(NON_FUSED[name], skip, 9, pass_scaler=True, unscale_first=unscale_first)
    ran = [s for s in range(9) if s not in skip]
    for tensor in ("a.weight", "a.bias", "b.weight"):
        series = mem.scalars[f"weights/grad_norm/{tensor}"]
        assert [s for s, _ in series] == ran  # a skipped step is never published
        for s, v in series:
            assert v == pytest.approx(by_hand[s][tensor], rel=1e-5)
            assert by_hand[s][tensor] < 100  # the reference itself is unscaled (scale is 2**10 and more)
    assert [v for _, v in mem.scalars["gradlog/skipped_steps"]] == [1, 1, 3, 3, 4]  # published at 1 2 5 6 8
    assert report.skipped_steps == 4
    for s in skip - {0}:  # the skipped steps really did not move anything
        assert all(torch.equal(weights[s][n], weights[s - 1][n]) for n in weights[s])


def test_non_fused_trailing_skips_are_counted_at_close() -> None:
    _, report, _, _ = run_scaled(NON_FUSED["adamw"], {5, 6}, 7, pass_scaler=True)
    assert report.skipped_steps == 2


def test_non_fused_every_step_skipped_is_nonfinite_grad() -> None:
    mem, report, _, _ = run_scaled(NON_FUSED["sgd"], set(range(4)), 4, pass_scaler=True)
    assert report.skipped_steps == 4
    assert {r.name: r.reason for r in report.never_updated} == {
        n: Reason.NONFINITE_GRAD for n in ("a.weight", "a.bias", "b.weight", "b.bias")
    }
    assert "skipped all 4 steps" in report.never_updated[0].detail
    assert not any(t.startswith("weights/update_ratio/") for t in mem.scalars)


def test_fused_adamw_grad_norms_are_unscaled_and_skip_is_no_update() -> None:
    fused = lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True)  # noqa: E731
    mem, report, by_hand, weights = run_scaled(fused, {3}, 6, pass_scaler=False)
    for tensor in ("a.weight", "b.bias"):
        series = dict(mem.scalars[f"weights/grad_norm/{tensor}"])
        assert sorted(series) == list(range(6))  # fused optimizers' hooks fire on skipped steps too
        hists = dict(mem.histograms[f"weights/grad/{tensor}"])
        for s in (0, 1, 2, 4, 5):
            assert series[s] == pytest.approx(by_hand[s][tensor], rel=1e-5)
            # the gradient histogram is of the unscaled gradient too (its sums divided by the scale)
            assert hists[s].sum_squares == pytest.approx(by_hand[s][tensor] ** 2, rel=1e-5)
            assert max(abs(hists[s].min), abs(hists[s].max)) <= by_hand[s][tensor] * (1 + 1e-6)
        assert dict(mem.scalars[f"weights/grad_nonfinite/{tensor}"])[3] > 0
        assert dict(mem.scalars[f"weights/update_ratio/{tensor}"])[3] == 0.0  # not reported as an update
        assert dict(mem.scalars[f"weights/update_ratio/{tensor}"])[4] > 0.0
    assert torch.equal(weights[3]["a.weight"], weights[2]["a.weight"])
    assert [v for _, v in mem.scalars["gradlog/skipped_steps"]] == [0, 0, 0, 1, 1, 1]
    assert report.skipped_steps == 1 and report.never_updated == []


def test_fused_adamw_with_scaler_passed_and_unscale_first_is_not_divided_twice() -> None:
    fused = lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True)  # noqa: E731
    mem, report, by_hand, _ = run_scaled(fused, {2}, 4, pass_scaler=True, unscale_first=True)
    for s, v in mem.scalars["weights/grad_norm/a.weight"]:
        if s != 2:
            assert v == pytest.approx(by_hand[s]["a.weight"], rel=1e-5)
    assert report.skipped_steps == 1


def test_optimizer_stepped_directly_with_scaled_grads_is_unscaled() -> None:
    torch.manual_seed(0)
    model = TwoLayer(torch.tanh)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=1, print_report=False, scaler=scaler)
    scaler.scale(model(batch(0)).pow(2).mean()).backward()
    want = torch.linalg.vector_norm(model.a.weight.grad).item() / 2.0**12
    opt.step()  # bypasses scaler.step: the gradients still carry the scale
    gl.log(0)
    gl.close()
    assert mem.last("weights/grad_norm/a.weight") == pytest.approx(want, rel=1e-6)


def test_scaler_argument_is_checked() -> None:
    model = TwoLayer(torch.tanh)
    with pytest.raises(TypeError, match=r"scaler must be a GradScaler .* got float: 65536\.0"):
        gradlog.GradLogger(model, torch.optim.SGD(model.parameters(), lr=0.1), scaler=2.0**16)
    with pytest.raises(TypeError, match=r"got collections\.OrderedDict"):
        gradlog.GradLogger(model, torch.optim.SGD(model.parameters(), lr=0.1), scaler=collections.OrderedDict())


# --- low-precision weights -------------------------------------------------------------------


def _train_dtype(dtype: torch.dtype, lr: float, steps: int = 3) -> tuple[gradlog.MemoryWriter, gradlog.Report, list]:
    torch.manual_seed(0)
    model = TwoLayer(torch.tanh).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=1, print_report=False)
    ratios = []
    for step in range(steps):
        model(batch(step).to(dtype)).float().pow(2).mean().backward()
        before = {n: p.detach().double().clone() for n, p in model.named_parameters()}
        opt.step()
        ratios.append(
            {
                n: (
                    torch.linalg.vector_norm(p.detach().double() - before[n]) / torch.linalg.vector_norm(before[n])
                ).item()
                for n, p in model.named_parameters()
            }
        )
        gl.log(step)
        opt.zero_grad()
    return mem, gl.close(), ratios


def test_bf16_update_lost_to_rounding_is_below_precision() -> None:
    _, report, ratios = _train_dtype(torch.bfloat16, lr=1e-6)
    assert all(r == 0 for step in ratios for r in step.values())  # the update really rounded away
    assert {r.name: r.reason for r in report.never_updated} == {
        n: Reason.BELOW_PRECISION for n in ("a.weight", "a.bias", "b.weight", "b.bias")
    }
    assert "bfloat16" in report.never_updated[0].detail


def test_fp32_same_tiny_lr_is_not_reported() -> None:
    _, report, ratios = _train_dtype(torch.float32, lr=1e-6)
    assert all(r > 0 for step in ratios for r in step.values())
    assert report.never_updated == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_update_ratio_matches_fp64_reference(dtype: torch.dtype) -> None:
    mem, report, ratios = _train_dtype(dtype, lr=0.05)
    for name in ("a.weight", "b.bias"):
        for (step, v), want in zip(mem.scalars[f"weights/update_ratio/{name}"], ratios):
            assert want[name] > 0
            assert v == pytest.approx(want[name], rel=1e-4), (name, step)
    assert report.never_updated == []


# --- torch.compile ---------------------------------------------------------------------------


def _train_compiled(compile_model: bool) -> gradlog.MemoryWriter:
    torch.manual_seed(0)
    model: nn.Module = TwoLayer(torch.tanh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if compile_model:
        model = torch.compile(model, fullgraph=True)  # fullgraph: any graph break raises
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(
        model, opt, writer=mem, every=1, print_report=False, histograms=gradlog.HistogramOptions(bins=8)
    )
    train(opt, gl, 3, lambda step: mse(model, batch(step)))
    return mem


@pytest.mark.slow
def test_compiled_model_metrics_equal_eager() -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager = _train_compiled(False)
    compiled = _train_compiled(True)
    assert not torch._dynamo.utils.counters["graph_break"]
    assert sorted(compiled.scalars) == sorted(eager.scalars)
    assert not any("_orig_mod" in t for t in compiled.scalars)
    for tag, series in eager.scalars.items():
        for (s1, a), (s2, b) in zip(compiled.scalars[tag], series):
            assert s1 == s2
            assert a == pytest.approx(b, rel=1e-4, abs=1e-7), tag


def test_logger_attached_mid_run_counts_only_later_skips() -> None:
    torch.manual_seed(0)
    model = TwoLayer(torch.tanh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    gl = None
    for step in range(8):
        if step == 3:  # after two skips the logger must not see
            gl = gradlog.GradLogger(model, opt, writer="memory", every=1, print_report=False, scaler=scaler)
        loss = model(batch(step)).pow(2).mean() * (float("inf") if step in (1, 2, 5) else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert gl is not None
    assert gl.close().skipped_steps == 1


def _nanogpt_scaler(dtype: str) -> torch.amp.GradScaler:
    """nanoGPT's exact line; on a machine without CUDA the scaler disables itself (with a warning)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scaler = torch.cuda.amp.GradScaler(enabled=(dtype == "float16"))  # type: ignore[attr-defined]
    return scaler


@pytest.mark.parametrize(
    "make",
    [
        lambda: _nanogpt_scaler("float32"),
        lambda: _nanogpt_scaler("float16"),  # enabled=True, but no CUDA: disabled by torch itself
        lambda: torch.amp.GradScaler("cuda", enabled=False),
        lambda: torch.amp.GradScaler("cpu", enabled=False),
    ],
    ids=["nanogpt-float32", "nanogpt-float16-no-cuda", "amp-cuda-disabled", "amp-cpu-disabled"],
)
def test_a_disabled_scaler_is_the_same_as_no_scaler(make: object) -> None:
    """The scaler's step/update pass straight through when disabled: numbers must equal a run without it."""
    results = []
    for pass_scaler in (True, False):
        torch.manual_seed(0)
        model = TwoLayer(torch.tanh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = make()  # type: ignore[operator]
        assert not scaler.is_enabled()
        mem = gradlog.MemoryWriter()
        gl = gradlog.GradLogger(
            model, opt, writer=mem, every=1, print_report=False, scaler=scaler if pass_scaler else None
        )
        for step in range(4):
            scaler.scale(model(batch(step)).pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
            gl.log(step)
            opt.zero_grad()
        report = gl.close()
        assert report.healthy and report.skipped_steps == 0, report.verdict
        results.append({t: [v for _, v in pts] for t, pts in mem.scalars.items()})
    assert results[0] == results[1]


class ScalerLike:
    """Not a GradScaler subclass, only its interface: a wrapper such as a framework's own scaler."""

    def __init__(self, inner: torch.amp.GradScaler) -> None:
        self.inner = inner

    def is_enabled(self) -> bool:
        return self.inner.is_enabled()

    def get_scale(self) -> float:
        return self.inner.get_scale()

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def test_an_object_with_gradscalers_interface_is_accepted_and_followed() -> None:
    """Duck typing: skipped steps are counted through the wrapper exactly as through the scaler itself."""
    _, direct, _, _ = run_scaled(NON_FUSED["adamw"], {2, 3}, 6, pass_scaler=True)
    torch.manual_seed(0)
    model = TwoLayer(torch.tanh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    gl = gradlog.GradLogger(model, opt, writer="memory", every=1, print_report=False, scaler=ScalerLike(scaler))
    for step in range(6):
        loss = model(batch(step)).pow(2).mean() * (float("inf") if step in (2, 3) else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        gl.log(step)
        opt.zero_grad()
    report = gl.close()
    assert direct.skipped_steps == 2
    assert report.skipped_steps == 2, report.verdict


def _compiled_steps(
    histograms: bool | None, steps: int = 3
) -> tuple[tuple[int, int], dict[str, int], gradlog.MemoryWriter | None, dict[str, list[tuple[float, float]]]]:
    """`torch.compile(opt.step)` for `steps` steps, with gradlog (histograms on or off) or without it (None).

    Returns what `torch._dynamo.explain` counts on the first step (graphs, breaks), dynamo's own counters over
    the compiled steps (graphs, breaks, frames compiled: a recompile is one frame more), what gradlog wrote,
    and per tensor and step the gradient norm and update ratio computed by hand with vector_norm."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = TwoLayer(torch.tanh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mem = gradlog.MemoryWriter() if histograms is not None else None
    gl = None
    if mem is not None:
        gl = gradlog.GradLogger(model, opt, writer=mem, every=1, print_report=False, histograms=bool(histograms))
    step_fn = torch.compile(opt.step)
    by_hand: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    explained = (0, 0)
    for step in range(steps):
        model(batch(step)).pow(2).mean().backward()
        if step == 0:  # explain on a copy of the state: it runs the step once
            state, weights = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
            ex = torch._dynamo.explain(opt.step)()
            explained = (ex.graph_count, ex.graph_break_count)
            opt.load_state_dict(state)
            model.load_state_dict(weights)
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            if gl is not None:
                gl.log(-1)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        grads = {n: torch.linalg.vector_norm(p.grad).item() for n, p in model.named_parameters() if p.grad is not None}
        step_fn()
        for n, p in model.named_parameters():
            ratio = (torch.linalg.vector_norm(p.detach() - before[n]) / torch.linalg.vector_norm(before[n])).item()
            by_hand[n].append((grads[n], ratio))
        if gl is not None:
            gl.log(step)
        opt.zero_grad()
    if gl is not None:
        gl.close()
    c = torch._dynamo.utils.counters
    counted = {
        "graphs": c["stats"]["unique_graphs"],
        "breaks": sum(c["graph_break"].values()),
        "frames": c["frames"]["total"],
    }
    torch._dynamo.reset()
    return explained, counted, mem, by_hand


@pytest.mark.slow  # compiling takes seconds
@pytest.mark.parametrize("histograms", [False, True])
def test_compiled_optimizer_step_gets_no_graph_break_or_recompile_from_gradlog(histograms: bool) -> None:
    """torch.compile(opt.step) used to trace gradlog's step hooks: torch's own graph_break() calls around the
    step body (torch/optim/optimizer.py) then split gradlog's work into graphs of their own (2 breaks against 0
    in explain; 9 against 2 when gradlog read values on the host there), and the step counter recompiled.
    The hooks are `torch.compiler.disable`d: dynamo skips them and they run eagerly around the compiled step,
    so the graphs and breaks are those of the same step without gradlog, and nothing recompiles."""
    base_explained, base_counted, _, base_by_hand = _compiled_steps(None)
    explained, counted, mem, by_hand = _compiled_steps(histograms)
    assert base_explained[0] >= 1  # the step body really was compiled
    assert explained == base_explained, (explained, base_explained)
    # over the compiled steps: the same graphs, and no break or compiled frame more than without gradlog (on
    # torch 2.13 fewer: 0 breaks and 5 frames against 1 and 8, as dynamo resumes after the skipped pre-hook)
    assert counted["graphs"] == base_counted["graphs"], (counted, base_counted)
    assert counted["breaks"] <= base_counted["breaks"] and counted["frames"] <= base_counted["frames"], counted
    # the numbers: gradlog's, on the compiled step, against vector_norm by hand (explain's step is logged at -1)
    assert mem is not None and sorted(by_hand) == sorted(base_by_hand)
    for name, series in by_hand.items():  # gradlog does not change the training either
        assert [v for pair in series for v in pair] == pytest.approx([v for pair in base_by_hand[name] for v in pair])
    for name, series in by_hand.items():
        logged_grads = [v for s, v in mem.scalars[f"weights/grad_norm/{name}"] if s >= 0]
        logged_ratios = [v for s, v in mem.scalars[f"weights/update_ratio/{name}"] if s >= 0]
        assert logged_grads == pytest.approx([g for g, _ in series], rel=1e-5), name
        assert logged_ratios == pytest.approx([r for _, r in series], rel=1e-4), name
        assert all(r > 0 for _, r in series)
