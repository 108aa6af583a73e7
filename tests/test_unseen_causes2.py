"""More causes of weights that never learn, planted where no earlier test did, and the words that must point at
them: a branch silenced by ``torch.where``, dropout with p=1 or an all-zero mask; a whole ReLU layer dead from its
bias; gradients clipped by value to 0 (second round after tests/test_unseen_causes.py). Each bug beside its
healthy twin, which must stay OK.

The tensors that truly never learned come from the run itself (copies of the weights before training); the file
and line a record must name come from a marker comment on the planted statement (`planted_site`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from catalogue import (
    DeadLayer,
    DecoratedEncoder,
    GatedBranch,
    IdsByMicroBatch,
    LooseParameters,
    PaddedTokens,
    SaturatedGate,
    planted_site,
    site_in,
)
from test_unseen_causes import _classify, _details
from torch import nn

import gradlog
from gradlog import Reason

STEPS = 30


def _site_here(marker: str) -> str:
    """This file's line marked `# planted: <marker>`."""
    return site_in(__file__, marker)


def _run(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    step: Callable[[int], Any],
    after: Callable[[int], Any] | None = None,
    every: int = 5,
    capsys: pytest.CaptureFixture[str] | None = None,
) -> tuple[gradlog.Report, set[str], str]:
    """`step(s)` (forward, backward, whatever comes before `opt.step()`), the step, `after(s)` (a scheduler), and
    `log`, STEPS times; the report, the names of the trainable tensors that never changed (from copies made here)
    and, with `capsys`, the console report a user reads."""
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    gl = gradlog.GradLogger(model, opt, writer="memory", every=every, print_report=capsys is not None)
    for s in range(STEPS):
        opt.zero_grad()
        step(s)
        opt.step()
        if after is not None:
            after(s)
        gl.log(s)
    report = gl.close()
    same = {n for n, p in model.named_parameters() if p.requires_grad and torch.equal(p.detach(), start[n])}
    console = capsys.readouterr().out if capsys is not None else ""
    return report, same, console


# --- a branch silenced by where, dropout p=1, an all-zero mask ----------------------------------------------------
@pytest.mark.parametrize(
    ("cut", "said", "fix"),
    [
        ("where", "by `where` whose condition chose the other branch everywhere", "fix: check the condition"),
        ("dropout", "by `dropout` in module `drop (Dropout(p=1.0, inplace=False))` with p >= 1", "fix: give dropout"),
        ("mask", "by `mul` by an all-zero tensor (a mask with no non-zero entry", "fix: check the mask"),
        ("none", "", ""),
    ],
)
def test_a_branch_silenced_in_forward_is_named_by_its_line(cut: str, said: str, fix: str) -> None:
    """Before: "grad exactly zero at all 6 measured steps with a gradient", with no place (the traced step knew
    no zero-gradient cut but `* 0` and round/floor/sign). Now the line, the op and the fix."""
    torch.manual_seed(0)
    model = GatedBranch(cut)
    report, same, _ = _run(model, torch.optim.SGD(model.parameters(), lr=0.1), _classify(model))
    if cut == "none":
        assert not same and report.healthy and not report.never_updated, report.table()
        return
    assert same == {"b.weight", "b.bias"}
    got = _details(report)
    assert set(got) == same and {r for r, _ in got.values()} == {Reason.ZERO_GRAD}
    site = planted_site(GatedBranch, cut)
    for _, detail in got.values():
        assert f"{site} (`" in detail and said in detail and fix in detail, detail


# --- a whole ReLU layer dead from its bias ----------------------------------------------------------------------
@pytest.mark.parametrize("bias", [-100.0, 0.0])
def test_a_relu_layer_dead_from_its_bias_is_named(bias: float) -> None:
    """Before: `zero_grad` on inp.*, mid.* and head.weight with no place. Now each names the ReLU none of whose
    outputs was positive, on forward's line, and the fix (head.weight reads its zeros: the same cause)."""
    torch.manual_seed(0)
    model = DeadLayer(bias)
    report, same, _ = _run(model, torch.optim.SGD(model.parameters(), lr=0.1), _classify(model))
    if not bias:
        assert not same and report.healthy, report.table()
        return
    assert same == {"inp.weight", "inp.bias", "mid.weight", "mid.bias", "head.weight"}
    got = _details(report)
    assert set(got) == same and {r for r, _ in got.values()} == {Reason.ZERO_GRAD}
    line = inspect.getsourcelines(DeadLayer.forward)[1] + 1
    for _, detail in got.values():
        assert f"catalogue.py:{line} (`out: torch.Tensor = self.head(torch.relu(" in detail, detail
        assert "by `relu` none of whose outputs was positive (every unit dead" in detail, detail
        assert "fix: the layer in front drives every unit below 0" in detail


# --- gradients clipped by value to 0 ------------------------------------------------------------------------------
@pytest.mark.parametrize("clip_value", [0.0, 1.0])
def test_gradients_clipped_by_value_zero_name_clip_value(clip_value: float) -> None:
    """Before: the clip's line was named, and the fix said "gradient clipping with max_norm=0 ...: give max_norm a
    positive value": clip_grad_value_ has no max_norm. Now its own knob."""
    torch.manual_seed(0)
    model = DeadLayer(0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(s: int) -> None:
        _classify(model)(s)
        torch.nn.utils.clip_grad_value_(model.mid.parameters(), clip_value=clip_value)  # planted: clip_value

    report, same, _ = _run(model, opt, step)
    if clip_value:
        assert not same and report.healthy, report.table()
        return
    assert same == {"mid.weight", "mid.bias"}
    for _, detail in _details(report).values():
        assert f"{_site_here('clip_value')} (`torch.nn.utils.clip_grad_value_(" in detail, detail
        assert "fix: clip_grad_value_ with clip_value=0 clamps every gradient to 0: give clip_value a" in detail
        assert "max_norm" not in detail


# --- a scheduler that takes the lr to 0 or far below its start ----------------------------------------------------
def _scheduled(make: Callable[[torch.optim.Optimizer], Any], per_step: int = 1) -> tuple[gradlog.Report, set[str]]:
    """DeadLayer(0) (healthy) on SGD lr 0.1 with the scheduler `make` builds, stepped `per_step` times after each
    optimizer step (4: once per micro-batch of an accumulation of 4)."""
    torch.manual_seed(0)
    model = DeadLayer(0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = make(opt)

    def after(s: int) -> None:
        for _ in range(per_step):
            sched.step()

    report, same, _ = _run(model, opt, _classify(model), after)
    return report, same


@pytest.mark.parametrize(
    ("make", "said", "healthy"),
    [
        (
            lambda o, end=0.0: torch.optim.lr_scheduler.LinearLR(o, 1.0, end, total_iters=10),
            "its lr comes from LinearLR(start_factor=1.0, end_factor=0.0, total_iters=10), which set group 0's lr to "
            "0 (from 0.1); fix: end_factor=0.0 takes the lr to 0: give it a value > 0",
            lambda o: torch.optim.lr_scheduler.LinearLR(o, 1.0, 0.1, total_iters=10),
        ),
        (
            lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=10, gamma=0.0),
            "its lr comes from StepLR(step_size=10, gamma=0.0), which set group 0's lr to 0 (from 0.1); fix: "
            "gamma=0.0 takes the lr to 0: give it a value > 0",
            lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=10, gamma=0.5),
        ),
    ],
    ids=["linear_end_factor_0", "step_gamma_0"],
)
def test_a_scheduler_knob_that_takes_the_lr_to_zero_is_named(make: Any, said: str, healthy: Any) -> None:
    """Before: "lr of param group 0 is 0 since step 10 (a scheduler?)". Now the scheduler, its arguments, the lr it
    set, and the argument at 0. The same scheduler with that argument above 0 is the healthy twin."""
    report, same = _scheduled(make)
    assert not same and {r.reason for r in report.stalled} == {Reason.ZERO_LR}
    assert len(report.stalled) == 6 and not report.healthy
    for rec in report.stalled:
        assert "lr of param group 0 is 0 since step 10; " + said in rec.detail, rec.detail
        assert "(a scheduler?)" not in rec.detail
    report, same = _scheduled(healthy)
    assert not same and report.healthy and not report.stalled, report.table()


@pytest.mark.parametrize("per_step", [4, 1])
def test_a_scheduler_stepped_per_micro_batch_is_named_with_its_count(per_step: int) -> None:
    """LinearLR to 0 over the run's 30 steps, stepped once per micro-batch of 4: it reaches 0 at step 8. Before:
    "(a scheduler?)". Now it and how often it was stepped against the optimizer's steps; stepped once per
    optimizer step (the twin) its lr reaches 0 only after the last step: OK."""
    report, same = _scheduled(lambda o: torch.optim.lr_scheduler.LinearLR(o, 1.0, 0.0, total_iters=STEPS), per_step)
    if per_step == 1:
        assert not same and report.healthy, report.table()
        return
    assert {r.reason for r in report.stalled} == {Reason.ZERO_LR}
    for rec in report.stalled:
        assert "its lr comes from LinearLR(start_factor=1.0, end_factor=0.0, total_iters=30)" in rec.detail
        assert "it was stepped 120 times in 30 optimizer steps: step it once per optimizer step" in rec.detail


@pytest.mark.parametrize("gamma", [0.3, 0.95])
def test_an_exponential_decay_that_vanishes_the_updates_is_named(gamma: float) -> None:
    """ExponentialLR(gamma=0.3) stepped every step: the lr falls 1e15x in 30 steps and every tensor's updates
    fall below float32's resolution (`stalled.tiny_update`). Before: "... or the lr far too small", no scheduler.
    Now ExponentialLR(gamma=0.3), the lr it set and how far it cut it; gamma 0.95 is the healthy twin."""
    report, same = _scheduled(lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=gamma))
    if gamma > 0.9:
        assert not same and report.healthy, report.table()
        return
    assert report.stalled and {r.reason for r in report.stalled} == {Reason.TINY_UPDATE}
    for rec in report.stalled:
        assert "its lr comes from ExponentialLR(gamma=0.3), which set group 0's lr to " in rec.detail, rec.detail
        assert "times below its start, so the updates vanish: check its factor" in rec.detail


@pytest.mark.parametrize("warmup", [1e7, 5.0])
def test_a_warm_up_longer_than_the_run_names_its_lambda(warmup: float) -> None:
    """AdamW 1e-3 under `LambdaLR(lambda s: min(1, s / 1e7))`: after 30 steps the lr is 3e-9 and most entries'
    updates round away (`partly.tiny_update` notes, the verdict OK as before). Before, each note ended "or the lr
    far too small"; now it names the LambdaLR's lambda by its line and how far it holds the lr below its start.
    A 5-step warm-up is the healthy twin (no record)."""
    torch.manual_seed(0)
    model = DeadLayer(0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / warmup))  # planted: warmup
    report, same, _ = _run(model, opt, _classify(model), lambda s: sched.step())
    assert not same and report.healthy
    tiny = [r for r in report.partly_updated if r.reason == Reason.TINY_UPDATE]
    if warmup < 10:
        assert not tiny, report.table()
        return
    assert tiny
    for rec in tiny:
        assert "its lr comes from LambdaLR(lr_lambda at " in rec.detail, rec.detail
        assert f"{_site_here('warmup')} (`sched = torch.optim.lr_scheduler.LambdaLR(" in rec.detail
        assert "times below its start, so the updates vanish: check its factor (a warm-up longer" in rec.detail


# --- a second optimizer that is never stepped ---------------------------------------------------------------------
@pytest.mark.parametrize("stepped", [False, True])
def test_a_layer_in_a_second_optimizer_never_stepped_is_named(stepped: bool) -> None:
    """`mid` sits in its own optimizer, whose step() the loop never calls (marked). Before: "in no optimizer param
    group (added after the optimizer was built?)", which points at the wrong fix. Now the other optimizer holds it
    and never moved it. Stepped (the twin): `mid` learns and nothing is named."""
    torch.manual_seed(0)
    model = DeadLayer(0.0)
    opt = torch.optim.SGD([*model.inp.parameters(), *model.head.parameters()], lr=0.1)
    other = torch.optim.SGD(model.mid.parameters(), lr=0.1)  # planted: other

    def step(s: int) -> None:
        other.zero_grad()
        _classify(model)(s)
        if stepped:
            other.step()

    report, same, _ = _run(model, opt, step)
    if stepped:
        assert not same and not report.never_updated, report.table()
        return
    assert same == {"mid.weight", "mid.bias"}
    got = _details(report)
    assert set(got) == same and {r for r, _ in got.values()} == {Reason.NOT_IN_OPTIMIZER}
    for _, detail in got.values():
        assert detail.startswith("in no param group of the optimizer gradlog watches"), detail
        assert "it is in param group 0 of another optimizer (SGD, lr 0.1), which never moved it" in detail
        assert "fix: call that optimizer's step() too" in detail and "added after" not in detail


# --- zero_grad() inside a gradient-accumulation loop ------------------------------------------------------------
@pytest.mark.parametrize("inside", [True, False])
def test_zero_grad_inside_the_accumulation_loop_is_named(inside: bool, capsys: pytest.CaptureFixture[str]) -> None:
    """4 micro-batches per optimizer step, `zero_grad()` before each backward (marked): only the last reaches
    step(). Before: `gradlog OK` with the note "ids 0, 1, 2, 3, 4, ... (30 of 40) were in no measured batch" (they
    were, in the lost micro-batches). Now a problem naming the step's passes, the backward() line and the fix, and
    the not_in_batch record says those ids may be the lost micro-batches'. zero_grad() once per step is the twin."""
    torch.manual_seed(0)
    model = IdsByMicroBatch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(s: int) -> None:
        for m in range(4):
            if inside:
                opt.zero_grad()  # planted: inside
            ids = model.ids(s, m)
            nn.functional.cross_entropy(model(ids), ids % 3).backward()  # planted: backward

    before = model.emb.weight.detach().clone()
    report, _, console = _run(model, opt, step, capsys=capsys)
    rows_same = [i for i in range(40) if torch.equal(model.emb.weight[i].detach(), before[i])]
    if not inside:
        assert not rows_same and report.healthy and not report.accumulation, console
        return
    assert rows_same == list(range(30))
    assert not report.healthy and len(report.accumulation) == 1
    found = report.accumulation[0]
    assert (found.step, found.passes, found.cleared) == (0, 4, 3)
    said = f"{_site_here('backward')} (`nn.functional.cross_entropy("
    assert found.detail.startswith("optimizer step 0 took 4 backward() passes at ") and said in found.detail
    assert "only the last pass's gradient reached step()" in found.detail
    assert "fix: call optimizer.zero_grad() once per optimizer step, after step()" in found.detail
    (partly,) = report.partly_updated
    assert partly.indices[:1] == (0,) and "zero_grad() cleared earlier micro-batches' gradients" in partly.detail
    assert "Gradients cleared between backward() passes (1 optimizer step):" in console
    assert "gradlog PROBLEM: " in console and "zero_grad() inside the accumulation loop" in console


def test_a_sam_like_second_pass_is_not_a_cleared_accumulation() -> None:
    """Healthy: SAM's two passes per step (backward, perturb the weights in place by the gradient, zero_grad,
    backward again at the perturbed point, restore, step). The first pass's gradient is used, not lost: the weights
    moved in between, so nothing is named."""
    torch.manual_seed(0)
    model = DeadLayer(0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(s: int) -> None:
        _classify(model)(s)
        with torch.no_grad():
            eps = [0.05 * p.grad / (p.grad.norm() + 1e-12) for p in model.parameters()]
            for p, e in zip(model.parameters(), eps):
                p.add_(e)
        opt.zero_grad()
        _classify(model)(s)
        with torch.no_grad():
            for p, e in zip(model.parameters(), eps):
                p.sub_(e)

    report, same, _ = _run(model, opt, step)
    assert not same and report.healthy and not report.accumulation, report.table()


# --- a forward decorated with @torch.no_grad() ----------------------------------------------------------------
@pytest.mark.parametrize("decorated", [True, False])
def test_a_forward_decorated_with_no_grad_names_the_decorator(decorated: bool) -> None:
    """Before: "cut at <forward's line> by `linear` run under torch.no_grad(); fix: move this call out of the
    torch.no_grad() block": there is no block, the decorator is the cause. Now the decorator's line, and its fix."""
    torch.manual_seed(0)
    model = DecoratedEncoder(decorated)
    report, same, _ = _run(model, torch.optim.SGD(model.parameters(), lr=0.1), _classify(model))
    if not decorated:
        assert not same and report.healthy, report.table()
        return
    assert same == {"enc.weight", "enc.bias"}
    got = _details(report)
    assert set(got) == same and {r for r, _ in got.values()} == {Reason.NO_GRAD}
    encoder = type(model.enc)  # catalogue's _NoGradEncoder
    call, deco = planted_site(encoder, "call"), planted_site(encoder, "decorator")
    for _, detail in got.values():
        assert f"{call} (`out: torch.Tensor = super().forward(x)`) by `linear` run under torch.no_grad()" in detail
        assert "(by the decorator at " in detail and f"{deco} (`@torch.no_grad()`))" in detail, detail
        assert "fix: remove `@torch.no_grad()` from this function" in detail and "block" not in detail


# --- padding_idx set to a frequent real token ---------------------------------------------------------------
@pytest.mark.parametrize("padding_idx", [1, 0])
def test_a_real_token_as_padding_idx_is_said_with_its_evidence(padding_idx: int) -> None:
    """`nn.Embedding(padding_idx=1)` where 1 is half of every sequence's tokens. Before: the note "the embedding's
    padding_idx row, never updated by design" (true of padding, not of a real token). Now the same note adds what
    the first batch showed: id 1's share and the sequences it sat inside, and the fix. padding_idx=0, the ids that
    do pad the sequences' ends, keeps the plain note."""
    torch.manual_seed(0)
    model = PaddedTokens(padding_idx)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(s: int) -> None:
        ids = model.batch(s)
        nn.functional.cross_entropy(model(ids), ids[:, 1] % 3).backward()

    report, _, _ = _run(model, opt, step)
    (rec,) = report.partly_updated
    assert rec.reason == Reason.PADDING_IDX and rec.indices == (padding_idx,) and report.healthy
    if padding_idx == 0:
        assert rec.detail.endswith("never updated by design"), rec.detail
        return
    share = float((model.batch(0) == 1).float().mean())  # the first batch, counted here
    said = f"; but id 1 was {share:.0%} of the first batch's ids and sat between other ids in 16 of 16 sequences"
    assert said in rec.detail, rec.detail
    assert "fix: pass the padding id your tokenizer uses" in rec.detail


# --- found right before, and no test had them ---------------------------------------------------------------------
@pytest.mark.parametrize(("holder", "names", "fix"), [
    ("list", {"ws[0]", "ws[1]"}, "ws is a Python list of 2 Parameter, so no optimizer sees it; fix: hold them in "
     "nn.ParameterList"),
    ("dict", {"ws['a']", "ws['b']"}, "ws is a Python dict of 2 Parameter, so no optimizer sees it; fix: hold them in "
     "nn.ParameterDict"),
    ("parameterlist", set(), ""),
])  # fmt: skip
def test_parameters_in_a_plain_list_or_dict_are_not_registered(holder: str, names: set[str], fix: str) -> None:
    torch.manual_seed(0)
    model = LooseParameters(holder)
    report, same, _ = _run(model, torch.optim.SGD(model.parameters(), lr=0.1), _classify(model))
    got = _details(report)
    assert not same and set(got) == names and report.healthy == (not names), report.table()
    for reason, detail in got.values():
        assert reason == Reason.NOT_REGISTERED and fix in detail, detail


@pytest.mark.parametrize("bias", [-40.0, 0.0])
def test_a_saturated_sigmoid_gate_under_sgd_is_a_tiny_update(bias: float) -> None:
    """The gate's gradient is ~1e-18 of the others': under SGD its updates round away (under Adam, which rescales
    them, it learns: tests/test_unseen_causes.py's table)."""
    torch.manual_seed(0)
    model = SaturatedGate(bias)
    report, same, _ = _run(model, torch.optim.SGD(model.parameters(), lr=0.1), _classify(model))
    if not bias:
        assert not same and report.healthy, report.table()
        return
    assert same == {"gate.weight", "gate.bias"}
    got = _details(report)
    assert set(got) == same and {r for r, _ in got.values()} == {Reason.TINY_UPDATE}
    assert all("the gradient is numerically zero" in d for _, d in got.values())


@pytest.mark.parametrize("after", [True, False])
def test_a_parameter_registered_after_the_optimizer_is_not_in_it(after: bool) -> None:
    torch.manual_seed(0)
    model = DeadLayer(0.0)
    if not after:
        model.scale = nn.Parameter(torch.ones(16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if after:
        model.scale = nn.Parameter(torch.ones(16))  # planted: registered
    inner = model.forward
    model.forward = lambda x: inner(x) * model.scale[:3].sum()  # type: ignore[method-assign]
    report, same, _ = _run(model, opt, _classify(model))
    got = _details(report)
    if not after:
        assert not same and not got, report.table()
        return
    assert same == {"scale"} and got["scale"][0] == Reason.NOT_IN_OPTIMIZER
    assert "in no optimizer param group (added after the optimizer was built?)" in got["scale"][1]
