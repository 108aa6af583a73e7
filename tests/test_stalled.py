"""Tensors that learned, then stopped: `Report.stalled`, checked against the weights themselves.

Each planted bug runs a real training loop that keeps, by hand, the last optimizer step at which each
tensor's value really changed (a finite, non-zero difference of copies taken around every step). The
expected record follows from that and the measured steps alone: `last_update_step` is the last
measured step at or before the last real change, `since_step` the first measured step after it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import catalogue
import pytest
import torch
from catalogue import GatedThree, mse
from torch import nn

import gradlog
from gradlog.verdict.ledger import Evidence, Quiet, StepIndex
from gradlog.verdict.report import Reason, Stalled
from gradlog.verdict.stalled import MIN_QUIET_FRACTION, MIN_QUIET_STEPS

Hook = Callable[[int, GatedThree, torch.optim.Optimizer], None]


def train(
    steps: int,
    every: int,
    before_step: Hook | None = None,
    after_backward: Hook | None = None,
    optimizer: str = "adam",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[gradlog.Report, dict[str, int], list[int]]:
    """Train `GatedThree`; returns the report, the last step each tensor's value truly changed, and the
    measured steps (every `every`-th optimizer step, counted from 0)."""
    torch.manual_seed(seed)
    model = GatedThree().to(dtype)
    groups = [
        {"params": list(model.a.parameters()) + list(model.c.parameters())},
        {"params": list(model.b.parameters())},
    ]
    opt: torch.optim.Optimizer
    if optimizer == "adam":
        opt = torch.optim.Adam(groups, lr=1e-2)
    else:
        opt = torch.optim.SGD(groups, lr=0.1)
    gl = gradlog.GradLogger(model, opt, writer="memory", every=every, print_report=False)
    gen = torch.Generator().manual_seed(seed + 1)
    last_change: dict[str, int] = {}
    before: dict[str, torch.Tensor] = {}

    def loss(step: int) -> torch.Tensor:
        if before_step is not None:
            before_step(step, model, opt)
        return mse(model, torch.randn(16, 6, generator=gen).to(dtype))

    def plant_and_copy(step: int) -> None:
        if after_backward is not None:
            after_backward(step, model, opt)
        before.update({n: p.detach().clone() for n, p in model.named_parameters()})

    def changed(step: int) -> None:
        for n, p in model.named_parameters():
            diff = p.detach().float() - before[n].float()
            if bool(torch.isfinite(diff).all()) and bool((diff != 0).any()):
                last_change[n] = step

    report = catalogue.train(opt, gl, steps, loss, after_backward=plant_and_copy, after_step=changed)
    return report, last_change, list(range(0, steps, every))


def expected(name: str, last_change: dict[str, int], measured: list[int]) -> tuple[int, int]:
    """(since_step, last_update_step) from the true last change and the measured steps."""
    last = max(s for s in measured if s <= last_change[name])
    since = min(s for s in measured if s > last)
    return since, last


def by_name(report: gradlog.Report) -> dict[str, Stalled]:
    return {r.name: r for r in report.stalled}


@pytest.mark.parametrize("k", [52, 55])  # between two measured steps, and on one
def test_lr_dropped_to_zero_at_step_k(k: int) -> None:
    def schedule(step: int, model: GatedThree, opt: torch.optim.Optimizer) -> None:
        if step == k:
            opt.param_groups[1]["lr"] = 0.0  # a scheduler bug: group 1 (layer b) stops at step k

    report, last_change, measured = train(100, 5, before_step=schedule)
    assert last_change["b.weight"] == k - 1  # the reference: b really stopped at step k
    stalled = by_name(report)
    assert set(stalled) == {"b.weight", "b.bias"}
    for name in ("b.weight", "b.bias"):
        rec = stalled[name]
        since, last = expected(name, last_change, measured)
        assert (rec.since_step, rec.last_update_step) == (since, last) == ((k + 4) // 5 * 5, (k - 1) // 5 * 5)
        assert rec.reason is Reason.ZERO_LR
        assert f"lr of param group 1 is 0 since step {since}" in rec.detail
        assert f"stopped between steps {last} and {since}" in rec.detail
    assert report.never_updated == [] and not report.healthy
    assert report.verdict.startswith("gradlog PROBLEM:") and "2 tensors stopped learning (zero_lr 2)" in report.verdict


def test_frozen_midway_at_step_k() -> None:
    k = 33

    def freeze(step: int, model: GatedThree, opt: torch.optim.Optimizer) -> None:
        if step == k:
            model.b.requires_grad_(False)

    report, last_change, measured = train(90, 3, before_step=freeze)
    assert last_change["b.weight"] == k - 1
    stalled = by_name(report)
    assert set(stalled) == {"b.weight", "b.bias"}
    for name in ("b.weight", "b.bias"):
        rec = stalled[name]
        assert (rec.since_step, rec.last_update_step) == expected(name, last_change, measured) == (33, 30)
        assert rec.reason is Reason.FROZEN
        assert "requires_grad went False (False from step 33 on)" in rec.detail
    assert not report.healthy and report.never_updated == []  # it did change: not "never updated"


def test_nan_gradients_from_step_k_stop_every_tensor_from_there() -> None:
    """A NaN gradient in one tensor at step k: its weights go NaN at k, every other tensor's at k+1
    (the forward pass is NaN from then on). Each stopped learning where its weights stopped changing."""
    k = 41

    def poison(step: int, model: GatedThree, opt: torch.optim.Optimizer) -> None:
        if step == k:
            assert model.b.bias.grad is not None
            model.b.bias.grad.fill_(float("nan"))

    report, last_change, measured = train(80, 2, after_backward=poison, optimizer="sgd")
    assert last_change["b.bias"] == k - 1 and last_change["a.weight"] == k  # the reference
    stalled = by_name(report)
    assert set(stalled) == {n for n, _ in GatedThree().named_parameters()}
    for name, rec in stalled.items():
        assert (rec.since_step, rec.last_update_step) == expected(name, last_change, measured), name
        assert rec.reason is Reason.NONFINITE_GRAD
    assert stalled["b.bias"].since_step == 42 and stalled["a.weight"].since_step == 42
    assert report.first_nonfinite is not None and report.first_nonfinite.name == "a.weight"
    assert report.first_nonfinite.step == 42  # step 41 is not measured: the first NaN it saw is at 42
    assert "NaN/Inf grad at 19 of 19 measured steps since, first at step 42" in stalled["c.weight"].detail


def test_every_step_skipped_by_gradscaler_from_step_k() -> None:
    """Fused AdamW under GradScaler, the loss Inf from step 12 on: every later step is skipped, the
    weights really stop changing, and the run's first non-finite gradient is not set (skips are routine),
    yet the stall is a finding."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    gl = gradlog.GradLogger(model, opt, writer="memory", every=2, print_report=False)
    last_change: dict[str, int] = {}
    for step in range(40):
        loss = model(torch.randn(4, 6)).pow(2).mean() * (float("inf") if step >= 12 else 1.0)
        scaler.scale(loss).backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        scaler.step(opt)
        scaler.update()
        for n, p in model.named_parameters():
            if bool((p.detach() != before[n]).any()):
                last_change[n] = step
        gl.log(step)
        opt.zero_grad()
    report = gl.close()
    assert set(last_change.values()) == {11} and report.skipped_steps == 28
    assert report.first_nonfinite is None and not report.healthy
    assert {(r.name, r.since_step, r.last_update_step, r.reason) for r in report.stalled} == {
        (n, 12, 10, Reason.NONFINITE_GRAD) for n, _ in model.named_parameters()
    }
    assert "the optimizer skipped 14 measured steps with a gradient (GradScaler)" in report.stalled[0].detail


def test_gradient_zero_from_step_k_is_zero_grad() -> None:
    def mute(step: int, model: GatedThree, opt: torch.optim.Optimizer) -> None:
        model.scale_b = 0.0 if step >= 20 else 1.0  # b's output multiplied by 0: its gradient is exactly 0

    report, last_change, measured = train(60, 2, before_step=mute, optimizer="sgd")
    rec = by_name(report)
    assert set(rec) == {"b.weight", "b.bias"}
    assert (rec["b.weight"].since_step, rec["b.weight"].last_update_step) == expected("b.weight", last_change, measured)
    assert (
        rec["b.weight"].reason is Reason.ZERO_GRAD
        and "grad exactly zero at all 20 measured steps" in rec["b.weight"].detail
    )


def test_layer_dropped_from_forward_is_no_grad() -> None:
    def drop(step: int, model: GatedThree, opt: torch.optim.Optimizer) -> None:
        model.use_b = step < 30

    report, last_change, measured = train(60, 2, before_step=drop)  # Adam skips a tensor whose grad is None
    rec = by_name(report)
    assert set(rec) == {"b.weight", "b.bias"}
    assert rec["b.bias"].reason is Reason.NO_GRAD
    assert (rec["b.bias"].since_step, rec["b.bias"].last_update_step) == expected("b.bias", last_change, measured)


def test_update_below_bf16_precision_from_step_k() -> None:
    was: list[float] = []

    def shrink(step: int, model: GatedThree, opt: torch.optim.Optimizer) -> None:
        if step == 24:
            was.append(opt.param_groups[1]["lr"])
            opt.param_groups[1]["lr"] = 1e-9  # an lr so small that b's bf16 update rounds away

    report, last_change, measured = train(60, 2, before_step=shrink, optimizer="sgd", dtype=torch.bfloat16)
    rec = by_name(report)
    assert set(rec) == {"b.weight", "b.bias"}
    assert rec["b.weight"].reason is Reason.BELOW_PRECISION and "bfloat16" in rec["b.weight"].detail
    assert f"its lr fell from {was[0]:.3g} at step 22 to 1e-09" in rec["b.weight"].detail  # the knob named
    assert (
        (rec["b.weight"].since_step, rec["b.weight"].last_update_step)
        == (24, 22)
        == expected("b.weight", last_change, measured)
    )


@pytest.mark.parametrize(
    ("quiet", "found"),
    [(1, False), (4, False), (5, True)],  # 50 measured steps: the stretch needs max(3, 10% of 50) = 5
)
def test_a_short_quiet_stretch_is_not_a_finding(quiet: int, found: bool) -> None:
    steps = 50
    assert max(MIN_QUIET_STEPS, math.ceil(MIN_QUIET_FRACTION * steps)) == 5

    def schedule(step: int, model: GatedThree, opt: torch.optim.Optimizer) -> None:
        opt.param_groups[1]["lr"] = 0.0 if step >= steps - quiet else 1e-2

    report, _, _ = train(steps, 1, before_step=schedule)
    assert bool(report.stalled) is found
    assert report.healthy is not found


def test_a_pause_that_ends_is_not_a_finding() -> None:
    def pause(step: int, model: GatedThree, opt: torch.optim.Optimizer) -> None:
        opt.param_groups[1]["lr"] = 0.0 if 10 <= step < 40 else 1e-2  # 30 quiet steps, then learning again

    report, _, _ = train(60, 1, before_step=pause)
    assert report.stalled == [] and report.healthy


def test_healthy_runs_have_no_stalled_records() -> None:
    report, last_change, _ = train(60, 3)
    assert report.stalled == [] and report.healthy and set(last_change.values()) == {59}
    # a transformer-like block with AdamW and weight decay, a tied embedding and LayerNorm
    torch.manual_seed(0)
    emb = nn.Embedding(20, 16)
    block = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    head = nn.Linear(16, 20, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "block": block, "head": head})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    gl = gradlog.GradLogger(model, opt, writer="memory", every=2, print_report=False)
    gen = torch.Generator().manual_seed(3)

    def loss(step: int) -> torch.Tensor:
        ids = torch.randint(0, 20, (4, 7), generator=gen)
        logits = head(block(emb(ids)))
        return nn.functional.cross_entropy(logits.reshape(-1, 20), ids.reshape(-1))

    report = catalogue.train(opt, gl, 40, loss)
    assert report.stalled == [] and report.never_updated == [] and report.healthy


def test_never_updated_tensors_are_not_repeated_as_stalled() -> None:
    def schedule(step: int, model: GatedThree, opt: torch.optim.Optimizer) -> None:
        opt.param_groups[1]["lr"] = 0.0  # b never learns at all: never updated, not stalled

    report, _, _ = train(30, 1, before_step=schedule)
    assert {r.name: r.reason for r in report.never_updated} == {"b.weight": Reason.ZERO_LR, "b.bias": Reason.ZERO_LR}
    assert report.stalled == []


def test_without_an_optimizer_nothing_is_called_stalled() -> None:
    model = nn.Linear(3, 2)
    gl = gradlog.GradLogger(model, None, writer="memory", every=1, print_report=False)
    for step in range(10):
        model(torch.randn(2, 3)).sum().backward()
        gl.log(step)
        model.zero_grad()
    assert gl.close().stalled == []


def test_step_index_agrees_with_a_plain_list() -> None:
    """The measured steps are kept as arithmetic runs; `after` must equal a brute-force count."""
    rng = random.Random(0)
    for _ in range(200):
        steps: list[int] = []
        s = rng.randrange(3)
        for _ in range(rng.randrange(1, 40)):
            steps.append(s)
            s += rng.choice([1, 5, 5, 5, 7])  # mostly regular, with a dropped or odd step now and then
        index = StepIndex()
        for s in steps:
            index.add(s)
        assert len(index.runs) <= len(steps)
        for probe in range(-1, steps[-1] + 2):
            later = [s for s in steps if s > probe]
            want = (len(later), later[0], later[-1]) if later else (0, -1, -1)
            assert index.after(probe) == want
    regular = StepIndex()
    for s in range(0, 1_000_000, 50):
        regular.add(s)
    assert len(regular.runs) == 1  # a whole run measured every 50 steps is three integers


def test_the_ledger_keeps_counters_only() -> None:
    report, _, _ = train(12, 1)
    assert report.healthy
    for cls in (Evidence, Quiet):
        for f in cls.__dataclass_fields__.values():
            allowed = ("int", "float", "str", "bool | None", "Fingerprint | None", "Quiet")  # float: frozen_sum/max
            if f.name == "frozen_first":  # a tensor's first FIRST_SHARES rounded-away shares, no more
                assert f.type == "tuple[float, ...]"
                continue
            assert f.type in allowed, (cls.__name__, f.name, f.type)
