"""Alerts during training: checked against streaks recomputed by hand from the weights themselves."""

from __future__ import annotations

import logging
import statistics

import pytest
import torch
from catalogue import FastSlowMid, train
from torch import nn

import gradlog
from gradlog.verdict.alerts import NO_GRAD, NONFINITE, RATIO_HIGH, RATIO_LOW, Alerts, Entry
from gradlog.verdict.report import CONSOLE_WIDTH


def _records(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "gradlog" and "alert" in r.getMessage()]


def test_update_ratio_alert_fires_when_the_hand_computed_streak_reaches_patience(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(0)
    model = FastSlowMid()
    opt = torch.optim.SGD(
        [
            {"params": model.fast.parameters(), "lr": 5.0},
            {"params": model.slow.parameters(), "lr": 1e-7},
            {"params": model.mid.parameters(), "lr": 1e-2},
        ]
    )
    mem = gradlog.MemoryWriter()
    band, patience = (1e-4, 1e-2), 3
    gl = gradlog.GradLogger(
        model,
        opt,
        writer=mem,
        every=1,
        print_report=False,
        alerts=gradlog.AlertOptions(ratio_band=band, ratio_patience=patience),
    )
    streak: dict[tuple[str, str], int] = {}
    expected: dict[tuple[str, str], int] = {}  # (name, kind) -> first optimizer step it should fire
    caplog.set_level(logging.WARNING, logger="gradlog")
    for step in range(8):
        model(torch.randn(16, 8)).pow(2).mean().backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        for n, p in model.named_parameters():
            ratio = (torch.linalg.vector_norm(p.detach() - before[n]) / torch.linalg.vector_norm(before[n])).item()
            for kind, outside in ((RATIO_HIGH, ratio > band[1]), (RATIO_LOW, ratio < band[0])):
                streak[n, kind] = streak.get((n, kind), 0) + 1 if outside else 0
                if streak[n, kind] >= patience:
                    expected.setdefault((n, kind), step)
        gl.log(step)
        opt.zero_grad()
    gl.close()
    assert gl.alerts is not None
    got = {(a.name, a.kind): a.step for a in gl.alerts.fired}
    assert got == expected
    # The planted extremes are really caught, at the third measured step; the sane layer is not.
    assert got[("fast.weight", RATIO_HIGH)] == 2 and got[("slow.weight", RATIO_LOW)] == 2
    assert not any(name == "mid.weight" for name, _ in got)
    msgs = _records(caplog)
    assert any("step 2" in m and "fast.weight" in m and "above the healthy band" in m for m in msgs)
    assert any("step 2" in m and "slow.weight" in m and "below the healthy band" in m for m in msgs)
    # Each tensor and kind warns once, however long the streak goes on.
    assert sum("fast.weight" in m for m in msgs) == 1
    # Writer side: a running count per published step, and the table at close.
    assert [v for _, v in mem.scalars["gradlog/alerts"]][-1] == len(expected)
    assert next(s for s, v in mem.scalars["gradlog/alerts"] if v > 0) == 2
    columns, rows = mem.tables["gradlog/alerts"]
    assert columns == ["step", "kind", "name", "detail"]
    assert {(r[2], r[1]) for r in rows} == set(expected)


def test_nonfinite_alert_names_tensor_and_step_once(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=2, print_report=False)
    caplog.set_level(logging.WARNING, logger="gradlog")

    def plant_nan(step: int) -> None:
        if step >= 5:  # planted: the second layer's bias gradient goes NaN from step 5 on
            model[1].bias.grad.fill_(float("nan"))

    report = train(opt, gl, 10, lambda step: model(torch.randn(8, 4)).sum(), after_backward=plant_nan)
    assert gl.alerts is not None
    nonfinite = [a for a in gl.alerts.fired if a.kind == NONFINITE]
    # every=2: step 5 is not measured, step 6 is the first measured step that sees the NaN.
    assert [(a.name, a.step) for a in nonfinite] == [("1.bias", 6)]
    assert report.first_nonfinite is not None and report.first_nonfinite.step == 6
    msgs = [m for m in _records(caplog) if "non-finite" in m]
    assert len(msgs) == 1 and "1.bias" in msgs[0] and "step 6" in msgs[0]
    assert "1 NaN/Inf gradient entries" in msgs[0]


def test_no_grad_alert_after_patience_skips_frozen_tensors(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict({"used": nn.Linear(4, 4), "unused": nn.Linear(4, 4), "frozen": nn.Linear(4, 4)})
    model["frozen"].requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    gl = gradlog.GradLogger(
        model,
        opt,
        writer=gradlog.MemoryWriter(),
        every=3,
        print_report=False,
        alerts=gradlog.AlertOptions(no_grad_patience=4),
    )
    caplog.set_level(logging.WARNING, logger="gradlog")
    train(opt, gl, 15, lambda step: model["used"](model["frozen"](torch.randn(2, 4))).sum())
    assert gl.alerts is not None
    got = sorted((a.name, a.kind, a.step) for a in gl.alerts.fired if a.kind == NO_GRAD)
    # Measured steps are 0, 3, 6, 9, 12: the fourth of them in a row is step 9.
    assert got == [("unused.bias", NO_GRAD, 9), ("unused.weight", NO_GRAD, 9)]
    msgs = [m for m in _records(caplog) if "no gradient" in m]
    assert len(msgs) == 1 and "in 2 tensors" in msgs[0] and "unused.weight" in msgs[0] and "frozen" not in msgs[0]


def test_an_alert_on_many_long_names_keeps_every_line_within_the_console_width(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Seven unused layers with Hugging Face-long names: the first line says what and when, then each tensor
    shown by its name with its evidence under it (both do not fit on one line), then how many more; no line wider
    than CONSOLE_WIDTH. Before, one line of 591 characters."""
    names = [f"encoder_layer_{i}_cross_attention_output_projection" for i in range(7)]
    model = nn.ModuleDict({"used": nn.Linear(4, 4)} | {n: nn.Linear(4, 4, bias=False) for n in names})
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    alerts = gradlog.AlertOptions(no_grad_patience=2)
    gl = gradlog.GradLogger(model, opt, writer="memory", every=1, print_report=False, alerts=alerts)
    caplog.set_level(logging.WARNING, logger="gradlog")
    train(opt, gl, 3, lambda step: model["used"](torch.randn(2, 4)).sum())
    msgs = [m for m in _records(caplog) if "no gradient" in m]
    assert len(msgs) == 1
    lines = msgs[0].splitlines()
    assert lines[0] == "gradlog alert at optimizer step 1: no gradient in 7 tensors", lines
    assert lines[1:11:2] == [f"  {n}.weight:" for n in names[:5]], lines
    assert lines[2:11:2] == ["    .grad was None on 2 measured steps in a row"] * 5, lines
    assert lines[11:] == ["  and 2 more"], lines
    assert max(map(len, lines)) <= CONSOLE_WIDTH, lines


def test_alerts_off_logs_and_writes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    model = nn.ModuleDict({"used": nn.Linear(4, 4), "unused": nn.Linear(4, 4)})
    opt = torch.optim.SGD(model.parameters(), lr=100.0)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=1, alerts=False, print_report=False)
    caplog.set_level(logging.WARNING, logger="gradlog")
    train(opt, gl, 5, lambda step: model["used"](torch.randn(2, 4)).sum())
    assert gl.alerts is None
    assert _records(caplog) == []
    assert "gradlog/alerts" not in mem.scalars and "gradlog/alerts" not in mem.tables


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ratio_band": (1e-2, 1e-4)}, r"0 < low < high.*\(0\.01, 0\.0001\)"),
        ({"ratio_band": (0.0, 1e-2)}, r"0 < low < high"),
        ({"ratio_band": (1e-3,)}, r"two numbers"),
        ({"ratio_patience": 0}, r"ratio_patience must be an integer >= 1.*got 0"),
        ({"no_grad_patience": 2.5}, r"no_grad_patience must be an integer >= 1.*got 2\.5"),
        ({"spike_factor": 1}, r"spike_factor must be a number > 1"),
    ],
)
def test_bad_thresholds_name_the_value(kwargs: dict[str, object], match: str) -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=match):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gradlog.GradLogger(model, opt, writer="memory", alerts=gradlog.AlertOptions(**kwargs))  # type: ignore[arg-type]


def test_histogram_of_a_huge_finite_range_does_not_crash_training() -> None:
    """fp32 values near ±3e38 made hi - lo overflow to inf and bincount fail, losing the measured step."""
    from gradlog.measure.bucketing import histogram_partials

    x = torch.tensor([3e38, -3e38, 1.0, float("nan")])
    row = histogram_partials([x], 4, torch.device("cpu"))[0]
    assert row[:4].sum().item() == 3  # the three finite values are bucketed, the NaN is counted apart
    assert row[4].item() == x[0].neg().item() and row[5].item() == x[0].item() and row[-1].item() == 1
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    gl = gradlog.GradLogger(model, opt, writer=gradlog.MemoryWriter(), every=1, print_report=False)
    model(torch.ones(1, 2)).sum().backward()
    model.weight.grad.copy_(torch.tensor([[3e38, -3e38], [0.0, 1.0]]))
    opt.step()  # before the fix the pre-hook failed here and the step went unmeasured
    gl.log(0)
    assert gl.close().measured_steps == 1


def test_update_ratio_of_nan_weights_is_nan_not_zero() -> None:
    """Weights that went NaN must not read as 'no update' (ratio 0) in the series, the plot or the alerts."""
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=1, print_report=False)

    def plant_nan(step: int) -> None:
        if step >= 1:
            model.weight.grad.fill_(float("nan"))  # SGD writes NaN into the weights at step 1

    train(opt, gl, 3, lambda step: model(torch.ones(1, 2)).sum(), after_backward=plant_nan)
    ratios = [v for _, v in mem.scalars["weights/update_ratio/weight"]]
    assert ratios[0] > 0 and all(v != v for v in ratios[1:])


def test_overflow_that_gradscaler_skipped_raises_no_nonfinite_alert(caplog: pytest.LogCaptureFixture) -> None:
    """Under AMP, Inf gradients on a step the scaler skips are routine (scale calibration), not an alert."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # fused: the hooks see the skipped step
    scaler = torch.amp.GradScaler("cpu")
    gl = gradlog.GradLogger(model, opt, writer="memory", every=1, print_report=False, scaler=scaler)
    caplog.set_level(logging.WARNING, logger="gradlog")
    for step in range(4):
        scaler.scale(model(torch.randn(2, 4)).sum()).backward()
        if step == 2:
            model.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        gl.log(step)
        opt.zero_grad()
    report = gl.close()
    assert report.skipped_steps == 1 and report.measured_steps == 4  # the step was measured, and skipped
    assert gl.alerts is not None and not [a for a in gl.alerts.fired if a.kind == NONFINITE]
    assert not [m for m in _records(caplog) if "non-finite" in m]


_STDERR_SCRIPT = """
import logging, sys, torch, gradlog
from torch import nn

def run(mode):
    print(f"== {mode}", file=sys.stderr, flush=True)
    print(f"== {mode}", flush=True)
    if mode == "logging":
        logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    gl = gradlog.GradLogger(model, opt, writer="memory", every=1, print_report=False, alerts=mode != "off")
    for step in range(4):
        loss = model(torch.randn(8, 4)).sum() * (float("nan") if step >= 2 else 1.0)
        loss.backward(); opt.step(); gl.log(step); opt.zero_grad()
    gl.close()

for mode in ("plain", "off", "logging"):  # logging last: once configured, it stays configured
    run(mode)
"""


def test_alerts_reach_stderr_without_logging_once_per_kind() -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", _STDERR_SCRIPT], capture_output=True, text=True, env=env, timeout=120, check=True
    )

    def part(text: str, mode: str) -> str:
        return text.split(f"== {mode}\n", 1)[1].split("== ", 1)[0]

    # nothing configured: the first alert of each kind on stderr
    assert part(out.stderr, "plain").count("non-finite gradient") == 1 and "weight" in part(out.stderr, "plain")
    # what and when on the first line, each tensor's evidence on its own, the pointer to the rest last; every line
    # within the console's width (before: one line of 214 characters)
    lines = [line for line in part(out.stderr, "plain").splitlines() if line.strip()]
    assert lines[0] == "gradlog alert at optimizer step 2: non-finite gradient in 2 tensors", lines
    assert lines[1:3] == ["  weight: 16 NaN/Inf gradient entries", "  bias: 4 NaN/Inf gradient entries"], lines
    assert lines[3] == "  (later 'nonfinite_grad' alerts: gl.alerts.fired, and the report at close)", lines
    assert max(map(len, lines)) <= CONSOLE_WIDTH
    # alerts=False: nothing anywhere
    assert "alert" not in part(out.stderr, "off") + part(out.stdout, "off")
    # configured: through logging only
    assert "non-finite gradient" not in part(out.stderr, "logging")
    assert "non-finite gradient" in part(out.stdout, "logging")


def _spikes(series: list[float]) -> list[tuple[int, float | None]]:
    judge = Alerts(emit=False)
    for step, g in enumerate(series):
        judge.step(step, [Entry(key="w", name="w", grad_norm=g)])
    judge.finish()  # the end of the run: a candidate still waiting is judged on what came after it
    return [(a.step, round(a.reference or 0.0, 9)) for a in judge.fired if a.kind == "grad_norm_spike"]


def test_a_level_already_reached_is_no_spike_but_a_jump_past_it_is() -> None:
    """Measured every 50 steps, a norm that rose 20x between two measured steps and stayed there still had the
    old level as the median of its short history: it is judged against its previous norm too."""
    risen = [1.0, 1.1, 0.9, 20.0, 21.0, 22.0, 19.0, 20.0]
    assert 22.0 > 10 * statistics.median(risen[:5])  # what the median alone called a spike at step 5
    assert _spikes(risen) == []
    assert _spikes([*risen, 800.0]) == [(8, 20.0)]  # 40x its previous norm and its median: named, at its step


def test_one_tensor_jumping_alone_needs_three_times_the_factor_but_tensors_jumping_together_do_not() -> None:
    """Healthy tiny-batch runs (RoBERTa, DistilBERT under Trainer: tests/zoo.py) show one tensor jumping 13-15x
    for one step and coming back; a bad batch or a lr kick moves several tensors at once. A lone jump is named
    from 30x (LONE_SPIKE_FACTOR x the factor), a jump shared by another tensor at the same step from 10x."""
    calm = [1.0, 1.1, 0.9, 1.0, 1.05, 0.95]

    def run(a: list[float], b: list[float]) -> list[tuple[str, int]]:
        judge = Alerts(emit=False)
        for step, (x, y) in enumerate(zip(a, b)):
            judge.step(step, [Entry(key="a", name="a", grad_norm=x), Entry(key="b", name="b", grad_norm=y)])
        judge.finish()
        return [(al.name, al.step) for al in judge.fired if al.kind == "grad_norm_spike"]

    assert run([*calm, 15.0, 1.0, 1.0], [*calm, 1.0, 1.0, 1.0]) == []  # one tensor, 15x, back at once
    assert run([*calm, 40.0, 1.0, 1.0], [*calm, 1.0, 1.0, 1.0]) == [("a", 6)]  # one tensor, 40x
    assert sorted(run([*calm, 15.0, 1.0, 1.0], [*calm, 15.0, 1.0, 1.0])) == [("a", 6), ("b", 6)]  # together


def test_a_layers_weight_and_bias_jumping_together_are_one_lone_jump() -> None:
    """The Perceiver's decoder query (tests/zoo5.py, healthy) had its weight and bias jump 24x for one step and
    come back: one layer's jump (the bias's gradient sums the weight's error signals), named only from 30x as
    one tensor's is. The same jump in two layers is shared and named from 10x."""
    calm = [1.0, 1.1, 0.9, 1.0, 1.05, 0.95]
    jump, quiet = [*calm, 24.0, 1.0, 1.0], [*calm, 1.0, 1.0, 1.0]

    def run(names: list[str], norms: list[list[float]]) -> list[tuple[str, int]]:
        judge = Alerts(emit=False)
        for step, row in enumerate(zip(*norms)):
            judge.step(step, [Entry(key=n, name=n, grad_norm=g) for n, g in zip(names, row)])
        judge.finish()
        return sorted((al.name, al.step) for al in judge.fired if al.kind == "grad_norm_spike")

    one_layer = ["dec.q.weight", "dec.q.bias", "enc.k.weight"]
    assert run(one_layer, [jump, jump, quiet]) == []
    assert run(one_layer, [[*calm, 40.0, 1.0, 1.0], jump, quiet]) == [("dec.q.weight", 6)]  # 40x: news alone
    two_layers = ["dec.q.weight", "enc.k.weight", "enc.v.weight"]
    assert run(two_layers, [jump, jump, quiet]) == [("dec.q.weight", 6), ("enc.k.weight", 6)]


def test_a_noisy_norm_is_judged_against_its_own_step_to_step_changes() -> None:
    """A norm that swings 10x from step to step (LoRA's A early on) needs more than 10x to be news: the limit is
    5 robust spreads of its log10 changes, and the alert says so."""
    noisy = [1.0, 10.0] * 6
    assert 60.0 > 10 * statistics.median(noisy)
    assert _spikes([*noisy, 60.0]) == []
    judge = Alerts(emit=False)
    for step, g in enumerate([*noisy, 1e9, 1.0]):
        judge.step(step, [Entry(key="w", name="w", grad_norm=g)])
    (alert,) = judge.fired  # named once it came back, at its own step
    assert "back to 1 at step 13 (1 measured step later)" in alert.detail, alert.detail
    assert alert.step == 12 and alert.reference == pytest.approx(10.0)
    limit = 10 ** (5 * 1.4826 * 1.0)  # every change is one decade
    assert f"only > {limit:.3g}x counts" in alert.detail, alert.detail
