"""A third round of causes of never-learning weights planted where no earlier test did, and the words that must
point at them: a branch saturated by a clamp, an element-wise maximum or a masked_fill (the op and the line); a
buffer made with requires_grad=True that the user meant to learn (a tensor gradlog cannot see as a parameter);
torch.func.functional_call with a copy of the parameters the optimizer does not hold (the swap and its line);
optimizer.step() called before loss.backward() in the loop (both lines). Each bug beside its healthy twin, which
must stay OK; and, as guards, planted bugs gradlog already named right (a weight copied back from its initial
values every step, requires_grad turned off at step 12, an nn.Embedding with max_norm, which is healthy).

The tensors that truly never learned come from the run itself (copies of the weights before training); the file
and line a record must name come from a marker comment on the planted statement (`planted_site`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from catalogue import (
    CutInForward,
    DeadLayer,
    FreezesInForward,
    GainMadeInForward,
    LearnedScale,
    SaturatedBranch,
    planted_site,
    site_in,
)
from test_unseen_causes import _batch, _classify, _details
from torch import nn

import gradlog
from gradlog import Reason
from gradlog.verdict.weight_decay import WeightDecayWipe

STEPS = 30


def _site_here(marker: str) -> str:
    """This file's line marked `# planted: <marker>`."""
    return site_in(__file__, marker)


def _run(
    model: nn.Module, opt: torch.optim.Optimizer, loop: Callable[[int], Any], every: int = 5
) -> tuple[gradlog.Report, set[str]]:
    """`loop(s)` (one whole iteration: zero_grad, forward, backward, step, in the order the test plants), then
    `log`, STEPS times; the report and the names of the trainable tensors that never changed (copies made here)."""
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    gl = gradlog.GradLogger(model, opt, writer="memory", every=every, print_report=False)
    for s in range(STEPS):
        loop(s)
        gl.log(s)
    report = gl.close()
    same = {
        n for n, p in model.named_parameters() if n in start and p.requires_grad and torch.equal(p.detach(), start[n])
    }
    return report, same


def _loop(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[int], None]:
    """The usual iteration: zero_grad, cross-entropy on `_batch(s)`, backward, step."""

    def loop(s: int) -> None:
        opt.zero_grad()
        _classify(model)(s)
        opt.step()

    return loop


# --- a branch saturated by clamp, maximum or masked_fill ----------------------------------------------------------
@pytest.mark.parametrize(
    ("cut", "said", "fix"),
    [
        (
            "clamp",
            "by `clamp` whose every input lay outside its bounds (min=50) (each output is a bound, whose gradient is "
            "zero)",
            "fix: the bounds (min=50) lie beyond every input",
        ),
        (
            "maximum",
            "by `maximum` whose other input won everywhere (this input's gradient is zero)",
            "fix: the other input of maximum is larger everywhere",
        ),
        (
            "masked_fill",
            "by `masked_fill` whose mask is True everywhere (every element filled: the input's gradient is zero)",
            "fix: check the mask: it is True everywhere",
        ),
        ("none", "", ""),
    ],
)
def test_a_branch_saturated_in_forward_is_named_by_its_op_and_line(cut: str, said: str, fix: str) -> None:
    """Before (bd79382): `zero_grad` on b.weight and b.bias, "grad exactly zero at all 6 measured steps with a
    gradient", with no place: the traced step knew no clamp, maximum or masked_fill. Now the line, the op (and the
    clamp's bound) and the fix; one cause, so one finding for the layer."""
    torch.manual_seed(0)
    model = SaturatedBranch(cut)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    report, same = _run(model, opt, _loop(model, opt))
    if cut == "none":
        assert not same and report.healthy and not report.never_updated, report.table()
        return
    assert same == {"b.weight", "b.bias"}
    got = _details(report)
    assert set(got) == same and {r for r, _ in got.values()} == {Reason.ZERO_GRAD}
    assert not report.healthy
    site = planted_site(SaturatedBranch, cut)
    for _, detail in got.values():
        assert f"{site} (`" in detail and said in detail and fix in detail, detail


# --- a buffer that was meant to learn ----------------------------------------------------------------------------
@pytest.mark.parametrize("as_buffer", [True, False])
def test_a_buffer_that_requires_grad_is_named_as_never_stepped(as_buffer: bool) -> None:
    """`register_buffer("scale", torch.ones(16, requires_grad=True))`: backward() gives it a gradient, no
    optimizer built from parameters() holds it, so it never changes. Before: OK, "all 4 tracked tensors were
    updated" (gradlog never saw it: buffers were left out of the attributes scanned). Now a `not_registered`
    problem naming the buffer, the line that uses it, and the fix; as an nn.Parameter (the twin) it learns."""
    torch.manual_seed(0)
    model = LearnedScale(as_buffer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = model.scale.detach().clone()
    report, same = _run(model, opt, _loop(model, opt))
    assert not same
    if not as_buffer:
        assert report.healthy and not report.never_updated, report.table()
        return
    assert torch.equal(model.scale.detach(), start) and model.scale.grad is not None  # truly never stepped
    got = _details(report)
    assert set(got) == {"scale"} and got["scale"][0] == Reason.NOT_REGISTERED
    assert not report.healthy
    detail = got["scale"][1]
    line = inspect.getsourcelines(LearnedScale.forward)[1] + 1
    assert "(first used at " in detail and f"catalogue.py:{line} (`out: torch.Tensor = self.head(" in detail, detail
    assert "scale is a buffer (register_buffer), not an nn.Parameter" in detail
    assert "fix: register it as a parameter (self.scale = nn.Parameter(...)" in detail


# --- functional_call with a copy of the parameters --------------------------------------------------------------
@pytest.mark.parametrize("own", [False, True])
def test_functional_call_with_tensors_the_optimizer_does_not_hold_is_named(own: bool) -> None:
    """`torch.func.functional_call(model, params, x)` with `params` a copy of the model's tensors, the optimizer
    built over the model's own: the copies get every gradient, the optimizer's tensors none. Before: `no_grad`
    on every tensor, "no torch call read it, so it is unused in forward; fix: call its module in forward()" (its
    module was called). Now the swap, its line and the fix; with dict(model.named_parameters()) (the twin) it
    learns."""
    torch.manual_seed(0)
    model = DeadLayer(0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if own:
        params = dict(model.named_parameters())
    else:
        params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}

    def loop(s: int) -> None:
        opt.zero_grad()
        x, y = _batch(s)
        out = torch.func.functional_call(model, params, (x,))  # planted: functional_call
        nn.functional.cross_entropy(out, y).backward()
        opt.step()

    report, same = _run(model, opt, loop)
    if own:
        assert not same and report.healthy, report.table()
        return
    names = {n for n, _ in model.named_parameters()}
    assert same == names
    got = _details(report)
    assert set(got) == names and {r for r, _ in got.values()} == {Reason.NO_GRAD}
    said = f"{_site_here('functional_call')} (`out = torch.func.functional_call(model, params, (x,))`)"
    for name, (_, detail) in got.items():
        assert "its module ran with another tensor in its place, swapped in at " in detail and said in detail, detail
        assert f"({name}: torch.func.functional_call or another stateless call" in detail
        assert "fix: pass the model's own parameters (dict(model.named_parameters()))" in detail
        assert "unused in forward" not in detail
    assert report.hint is not None and said in report.hint, report.hint


# --- step() before backward() ----------------------------------------------------------------------------------
@pytest.mark.parametrize("step_first", [True, False])
def test_step_called_before_backward_names_both_lines(step_first: bool) -> None:
    """The loop calls zero_grad(), step(), then backward(): each step() comes after the next iteration's
    zero_grad() cleared the gradient, so nothing ever moves. Before: `no_grad` everywhere and the hint
    "zero_grad() called between backward() and step() cleared them; fix: call it before backward() or after
    step()", which the user's loop already does. Now both lines in the loop's order and the fix; the usual order
    (the twin) learns."""
    torch.manual_seed(0)
    model = DeadLayer(0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loop(s: int) -> None:
        x, y = _batch(s)
        opt.zero_grad()
        if step_first:
            opt.step()  # planted: step
            nn.functional.cross_entropy(model(x), y).backward()  # planted: backward
        else:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

    report, same = _run(model, opt, loop)
    if not step_first:
        assert not same and report.healthy, report.table()
        return
    names = {n for n, _ in model.named_parameters()}
    assert same == names
    got = _details(report)
    assert set(got) == names and {r for r, _ in got.values()} == {Reason.NO_GRAD}
    step_at = f"{_site_here('step')} (`opt.step()`) before backward() at "
    backward_at = f"{_site_here('backward')} (`nn.functional.cross_entropy(model(x), y).backward()`), so each step()"
    for _, detail in got.values():
        assert "cleared in between: the loop calls step() at " in detail, detail
        assert step_at in detail and backward_at in detail and "fix: call step() after backward()" in detail
    hint = report.hint or ""
    assert step_at in hint and backward_at in hint and "zero_grad() called between" not in hint, hint


# --- right before, kept: guards ----------------------------------------------------------------------------------
def test_a_weight_copied_back_from_its_initial_values_every_step_names_the_copy() -> None:
    """`with torch.no_grad(): w.copy_(init)` before each forward: `overwritten`, the copy's line (already right)."""
    torch.manual_seed(0)
    model = DeadLayer(0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    init = model.mid.weight.detach().clone()

    def loop(s: int) -> None:
        with torch.no_grad():
            model.mid.weight.copy_(init)  # planted: copy
        _loop(model, opt)(s)

    report, _ = _run(model, opt, loop)
    got = _details(report)
    assert set(got) == {"mid.weight"} and got["mid.weight"][0] == Reason.OVERWRITTEN and not report.healthy
    detail = got["mid.weight"][1]
    assert (
        "set back outside the optimizer at " in detail and f"{_site_here('copy')} (`model.mid.weight.copy_(" in detail
    )


def test_requires_grad_turned_off_at_step_12_is_stalled_from_then() -> None:
    """`requires_grad_(False)` on one weight at step 12, the optimizer built before: `stalled.frozen`, the step
    window named (already right)."""
    torch.manual_seed(0)
    model = DeadLayer(0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def loop(s: int) -> None:
        if s == 12:
            model.mid.weight.requires_grad_(False)
        _loop(model, opt)(s)

    report, _ = _run(model, opt, loop)
    assert [(r.name, r.reason) for r in report.stalled] == [("mid.weight", Reason.FROZEN)] and not report.healthy
    assert "last update at step 10; it stopped between steps 10 and 15" in report.stalled[0].detail


def test_an_embedding_with_max_norm_is_healthy() -> None:
    """nn.Embedding(max_norm=1) renormalises the rows it looks up, in place, outside the optimizer: by design,
    and the rows still learn (each changes), so it is no set-back: OK, no finding."""
    torch.manual_seed(0)
    emb, head = nn.Embedding(20, 8, max_norm=1.0), nn.Linear(8, 3)
    model = nn.ModuleDict({"emb": emb, "head": head})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def loop(s: int) -> None:
        ids = torch.randint(0, 20, (16, 5), generator=torch.Generator().manual_seed(s))
        opt.zero_grad()
        nn.functional.cross_entropy(head(emb(ids).mean(1)), ids[:, 0] % 3).backward()
        opt.step()

    report, same = _run(model, opt, loop)
    assert not same and report.healthy and not report.never_updated and not report.partly_updated, report.table()


# --- param groups built by a name test that misses every bias -----------------------------------------------------
@pytest.mark.parametrize("suffix", ["Bias", "bias"])
def test_biases_a_name_filter_left_out_of_the_optimizer_are_one_finding(suffix: str) -> None:
    """Decay and no-decay groups built from named_parameters(), the second with a typo ("Bias"): every bias is in
    no group. Before: 3 findings, one per module, each guessing "added after the optimizer was built?" (they were
    made with the weights the optimizer holds). Now one finding naming the filter and the attribute; the right
    name test (the twin) learns."""
    torch.manual_seed(0)
    model = DeadLayer(0.0)
    decay = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith(suffix)]  # planted: filter
    opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2)
    report, same = _run(model, opt, _loop(model, opt))
    if suffix == "bias":
        assert not same and report.healthy, report.table()
        return
    biases = {"inp.bias", "mid.bias", "head.bias"}
    assert same == biases
    got = _details(report)
    assert set(got) == biases and {r for r, _ in got.values()} == {Reason.NOT_IN_OPTIMIZER} and not report.healthy
    for _, detail in got.values():
        assert "added after the optimizer was built" not in detail, detail
        assert "left out by name: every `bias` of 3 modules (inp.bias, mid.bias, head.bias) is in none" in detail
        assert "while their modules' other tensors are in param group 0" in detail
        assert "fix: check the name test that builds the param groups" in detail
    assert "(30 optimizer steps, 6 measured; 1 problem)" in report.verdict, report.verdict
    assert "inp, mid, head" in report.table() and "3 tensors (inp.bias, mid.bias, head.bias)" in report.table()


def test_a_parameter_added_to_one_module_after_the_optimizer_keeps_its_guess() -> None:
    """One tensor left out (registered on a module after the optimizer was built): no filter explains one name in
    one module, so the record keeps "added after the optimizer was built?"."""
    torch.manual_seed(0)
    model = DeadLayer(0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.mid.extra = nn.Parameter(torch.zeros(16))
    report, _ = _run(model, opt, _loop(model, opt))
    got = _details(report)
    assert set(got) == {"mid.extra"} and got["mid.extra"][0] == Reason.NOT_IN_OPTIMIZER
    assert "(added after the optimizer was built?)" in got["mid.extra"][1]


# --- an nn.Parameter made again in every forward -------------------------------------------------------------------
@pytest.mark.parametrize(("made_in", "warm"), [("forward", True), ("forward", False), ("init", False)])
def test_a_parameter_made_in_every_forward_is_one_finding_with_its_line(made_in: str, warm: bool) -> None:
    """`self.gain = nn.Parameter(torch.ones(16))` inside forward. Before: two records for one cause, `gain`
    not_in_model ("its module was replaced or deleted after the optimizer was built") and `gain` unknown ("never
    materialised (lazy or meta parameter), or first seen after the last step") when a forward ran before the
    optimizer was built; without one, only `gain` unknown (the same words, wrong: it is in no param group). Now one
    record naming the line and the fix; made once in __init__ (the twin) it learns."""
    torch.manual_seed(0)
    model = GainMadeInForward(made_in)
    if warm:
        model(torch.zeros(2, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = getattr(model, "gain", None)
    report, _ = _run(model, opt, _loop(model, opt))
    if made_in == "init":
        assert report.healthy and not report.never_updated, report.table()
        return
    assert model.gain is not first and torch.equal(model.gain.detach(), torch.ones(16))  # never learned
    gains = [r for r in report.never_updated if r.name == "gain"]
    assert len(gains) == 1 and len(report.never_updated) == 1 and not report.healthy, report.table()
    assert gains[0].reason == (Reason.NOT_IN_MODEL if warm else Reason.NOT_IN_OPTIMIZER)
    detail = gains[0].detail
    site = planted_site(GainMadeInForward, "gain")
    assert "forward makes a new nn.Parameter `gain` at every call at " in detail and f"{site} (`self.gain = " in detail
    assert "fix: create it once in __init__ and only use it in forward" in detail, detail


# --- requires_grad_(False) inside forward -------------------------------------------------------------------------
@pytest.mark.parametrize("freeze", [True, False])
def test_a_freeze_inside_forward_names_its_line(freeze: bool) -> None:
    """`self.mid.requires_grad_(False)` in forward. Before: `frozen` (suspect, a problem) "requires_grad was True
    when gradlog started and is False now ...: a freeze meant for another layer, or for later in training?", no
    place. Now the same record, one finding for the layer, with the line that freezes it at every step; without
    the call (the twin) it learns."""
    torch.manual_seed(0)
    model = FreezesInForward(freeze)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    report, same = _run(model, opt, _loop(model, opt))
    if not freeze:
        assert not same and report.healthy, report.table()
        return
    got = _details(report)
    assert set(got) == {"mid.weight", "mid.bias"} and {r for r, _ in got.values()} == {Reason.FROZEN}
    assert not report.healthy and "(30 optimizer steps, 6 measured; 1 problem)" in report.verdict, report.verdict
    site = planted_site(FreezesInForward, "freeze")
    for _, detail in got.values():
        assert "frozen during the run, before it ever updated" in detail
        assert "set to requires_grad=False at " in detail and f"{site} (`self.mid.requires_grad_(False)`)" in detail
        assert "which runs at every step" in detail and "fix: freeze it once before training" in detail


# --- right before, kept: cuts in forward -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("cut", "said"),
    [
        ("argmax", "by `argmax` (returns integers/booleans: not differentiable)"),
        ("compare", "by `gt` (returns integers/booleans: not differentiable)"),
        ("tensor", "by `tensor`"),
        ("none", ""),
    ],
)
@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")
def test_a_non_differentiable_op_in_forward_is_named_by_its_line(cut: str, said: str) -> None:
    """An argmax without a straight-through estimator, a `> 0` gate, `torch.tensor(h)`: `no_grad` on inp.* and
    mid.*, each naming the line and the op (already right; a guard)."""
    torch.manual_seed(0)
    model = CutInForward(cut)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    report, same = _run(model, opt, _loop(model, opt))
    if cut == "none":
        assert not same and report.healthy and not report.never_updated, report.table()
        return
    cut_off = {"inp.weight", "inp.bias", "mid.weight", "mid.bias"}
    got = _details(report)
    assert same >= cut_off and set(got) == cut_off and {r for r, _ in got.values()} == {Reason.NO_GRAD}
    site = planted_site(CutInForward, cut)
    for _, detail in got.values():
        assert f"{site} (`" in detail and said in detail, detail


@pytest.mark.parametrize("bug", ["loss_leaf", "data_assign", "weight_decay"])
def test_loop_bugs_gradlog_already_named_stay_named(bug: str) -> None:
    """A loss rebuilt as `.detach().requires_grad_()` (no_grad on all, the line and `.detach()`), the weight's
    `.data` replaced by its initial copy after every step (`overwritten`, the line), an AdamW group with
    weight_decay 100 at lr 1e-2 (`weight_decay.wipes`): already right; guards."""
    torch.manual_seed(0)
    model = DeadLayer(0.0)
    if bug == "weight_decay":
        rest = [p for n, p in model.named_parameters() if not n.startswith("mid.")]
        groups: list[dict[str, Any]] = [{"params": model.mid.parameters(), "weight_decay": 100.0}, {"params": rest}]
        opt = torch.optim.AdamW(groups, lr=1e-2)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    init = model.mid.weight.detach().clone()

    def loop(s: int) -> None:
        opt.zero_grad()
        x, y = _batch(s)
        loss: torch.Tensor
        if bug == "loss_leaf":
            loss = nn.functional.cross_entropy(model(x), y).detach().requires_grad_()  # planted: leaf
        else:
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if bug == "data_assign":
            model.mid.weight.data = init.clone()  # planted: data_assign

    report, _ = _run(model, opt, loop)
    assert not report.healthy
    got = _details(report)
    if bug == "loss_leaf":
        assert set(got) == {n for n, _ in model.named_parameters()}
        for reason, detail in got.values():
            assert reason == Reason.NO_GRAD and f"{_site_here('leaf')} (`loss = " in detail and "`.detach()`" in detail
    elif bug == "data_assign":
        assert set(got) == {"mid.weight"} and got["mid.weight"][0] == Reason.OVERWRITTEN
        assert f"{_site_here('data_assign')} (`model.mid.weight.data = init.clone()`)" in got["mid.weight"][1]
    else:
        assert not got
        wiped = report.records(WeightDecayWipe)
        assert {r.name for r in wiped} == {"mid.weight", "mid.bias"}, report.table()


# --- a state saved at the start reloaded every epoch ------------------------------------------------------------
@pytest.mark.parametrize(("period", "every"), [(10, 5), (10, 1), (0, 5)])
def test_a_saved_state_reloaded_every_epoch_is_overwritten(period: int, every: int) -> None:
    """`model.load_state_dict(saved)` at the start of every 10-step epoch, `saved` taken before training: the
    model never keeps more than 10 steps of learning. Before: OK at every=5 and every=1 (the values before two
    consecutive measured steps always differ, and only a streak of equal ones was looked for). Now
    `overwritten` naming the steps at which the values were back at step 0's; restored once at step 0 (the
    twin, period 0) it learns."""
    torch.manual_seed(0)
    model = DeadLayer(0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    def loop(s: int) -> None:
        if (period and s % period == 0) or s == 0:
            model.load_state_dict(saved)  # planted: reload
        _loop(model, opt)(s)

    report, same = _run(model, opt, loop, every=every)
    assert not same  # at close each is 9 steps from the start: changed, yet it never learned beyond 10 steps
    if not period:
        assert report.healthy and not report.never_updated, report.table()
        return
    got = _details(report)
    # mid.bias starts at zero (DeadLayer(0.0)): a zero tensor back at zero is left to `pruned` (AdaLoRA's ranks
    # pruned to zero), so the screen leaves zero starts out
    assert set(got) == {n for n, _ in model.named_parameters()} - {"mid.bias"} and not report.healthy
    for reason, detail in got.values():
        assert reason == Reason.OVERWRITTEN, detail
        assert "yet its values before steps 10 and 20 were those before step 0 again" in detail, detail
        assert "so it learns only between the resets" in detail
