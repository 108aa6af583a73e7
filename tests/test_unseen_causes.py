"""Causes of never-learning weights that no earlier test planted, and the words that must point at them: a
custom autograd.Function whose backward() gives a weight None or zeros, a reentrant activation checkpoint in
front of which nothing requires grad, a loss term multiplied by 0, a gradient hook that zeroes a layer's
gradient, gradients clipped with max_norm=0, and a Hugging Face LM whose labels are all -100. Each bug beside
its healthy twin, which must stay OK.

The tensors that truly never learned come from the run itself (copies of the weights before training); the
file and line a record must name come from a marker comment on the planted statement (`planted_site`)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from catalogue import (
    CustomFunctionLayer,
    ReentrantCheckpointed,
    TwoHeadLoss,
    _LinearFn,
    planted_site,
    site_in,
    tiny_gpt2,
)
from torch import nn

import gradlog
from gradlog import Reason

STEPS = 30


def _site_here(marker: str) -> str:
    """This file's line marked `# planted: <marker>`."""
    return site_in(__file__, marker)


def _run(model: nn.Module, opt: torch.optim.Optimizer, step: Any, every: int = 5) -> tuple[gradlog.Report, set[str]]:
    """`step(s)` (forward, backward, whatever comes before `opt.step()`), then the step and `log`, STEPS times;
    the report and, from copies made here, the names of the trainable tensors that never changed."""
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    gl = gradlog.GradLogger(model, opt, writer="memory", every=every, print_report=False)
    for s in range(STEPS):
        opt.zero_grad()
        step(s)
        opt.step()
        gl.log(s)
    report = gl.close()
    same = {n for n, p in model.named_parameters() if p.requires_grad and torch.equal(p.detach(), start[n])}
    return report, same


def _batch(s: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(s)
    x = torch.randn(32, 8, generator=gen)
    return x, (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()


def _classify(model: nn.Module) -> Any:
    def step(s: int) -> None:
        x, y = _batch(s)
        nn.functional.cross_entropy(model(x), y).backward()

    return step


def _details(report: gradlog.Report) -> dict[str, tuple[Reason, str]]:
    return {r.name: (r.reason, r.detail) for r in report.never_updated}


# --- a custom autograd.Function --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("mode", "reason", "gave"), [("none", Reason.NO_GRAD, "None"), ("zeros", Reason.ZERO_GRAD, "an all-zero gradient")]
)
def test_a_custom_function_whose_backward_drops_a_weight_is_named(mode: str, reason: Reason, gave: str) -> None:
    """Before: backward() returning None for the weight read "backward() wrote its gradient and it was None at
    step(): cleared in between; fix: clear the gradients before backward()" (torch fires the post-accumulate
    hook with no gradient), and zeros read "grad exactly zero" with no place. Now the Function, its backward()'s
    file and line, and the argument are named."""
    torch.manual_seed(0)
    model = CustomFunctionLayer(mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    report, same = _run(model, opt, _classify(model))
    assert same == {"mid.weight"}
    got = _details(report)
    assert set(got) == same and got["mid.weight"][0] == reason
    detail = got["mid.weight"][1]
    line = inspect.getsourcelines(_LinearFn.backward)[1] + 1  # past @staticmethod: the def line
    assert "custom autograd.Function `_LinearFn`, whose backward() at " in detail, detail
    assert f"catalogue.py:{line} (`def backward(ctx: Any, g: torch.Tensor) -> Any:`) returns" in detail, detail
    assert f"returns {gave} for forward's tensor argument 2" in detail, detail
    assert "cleared in between" not in detail and "torch.no_grad()" not in detail, detail
    assert "fix: return that argument's gradient from _LinearFn.backward()" in detail
    assert planted_site(_LinearFn, mode)  # the planted line is in that backward()


def test_a_custom_function_that_is_right_reports_nothing() -> None:
    torch.manual_seed(0)
    model = CustomFunctionLayer("ok")
    report, same = _run(model, torch.optim.SGD(model.parameters(), lr=0.1), _classify(model))
    assert not same and report.healthy and not report.never_updated, report.table()


# --- a reentrant activation checkpoint behind a frozen embedding ---------------------------------------------------
def _ids_step(model: nn.Module) -> Any:
    def step(s: int) -> None:
        gen = torch.Generator().manual_seed(s)
        ids = torch.randint(0, 20, (16, 5), generator=gen)
        nn.functional.cross_entropy(model(ids), ids[:, 0] % 3).backward()

    return step


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_reentrant_checkpoint_with_no_input_requiring_grad(reentrant: bool) -> None:
    """Before: "cut at ... by `linear` run under torch.no_grad(); fix: move this call out of the torch.no_grad()
    block": there is no such block in the user's code. Now the checkpoint is named, and use_reentrant=False."""
    torch.manual_seed(0)
    model = ReentrantCheckpointed(reentrant)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    report, same = _run(model, opt, _ids_step(model))
    if not reentrant:
        assert not same and report.healthy, report.table()
        return
    blocks = {f"blocks.{i}.{w}" for i in range(2) for w in ("weight", "bias")}
    assert same == blocks
    got = _details(report)
    assert {n for n, (r, _) in got.items() if r == Reason.NO_GRAD} == blocks
    site = planted_site(ReentrantCheckpointed, "checkpoint")
    for name in blocks:
        detail = got[name][1]
        assert f"{site} (`" in detail and "run by reentrant activation checkpointing" in detail, detail
        assert "fix: pass use_reentrant=False to checkpoint()" in detail and "no_grad() block" not in detail


# --- a loss term times 0 ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("b_weight", [0.0, 0.5])
def test_a_loss_term_multiplied_by_zero_is_named_by_its_line(b_weight: float) -> None:
    """Before: "grad exactly zero at all 6 measured steps", with no place. Now the line of `loss_a + 0 * loss_b`."""
    torch.manual_seed(0)
    model = TwoHeadLoss(b_weight)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    report, same = _run(model, opt, lambda s: model(*_batch(s)).backward())
    if b_weight:
        assert not same and report.healthy, report.table()
        return
    assert same == {"b.weight", "b.bias"}
    got = _details(report)
    assert set(got) == same and {r for r, _ in got.values()} == {Reason.ZERO_GRAD}
    site = planted_site(TwoHeadLoss, "times_zero")
    for _, detail in got.values():
        assert f"{site} (`out: torch.Tensor = loss_a + self.b_weight * loss_b`) by `* 0`" in detail, detail
        assert "fix: a term multiplied by 0 passes no gradient" in detail


# --- a gradient hook that zeroes a layer; clipping with max_norm=0 -------------------------------------------------
def test_a_gradient_hook_that_zeroes_a_layer_is_named() -> None:
    torch.manual_seed(0)
    model = CustomFunctionLayer("ok")
    for p in model.mid.parameters():
        p.register_hook(lambda g: g * 0)  # planted: hook
    report, same = _run(model, torch.optim.SGD(model.parameters(), lr=0.1), _classify(model))
    assert same == {"mid.weight", "mid.bias"}
    got = _details(report)
    assert set(got) == same and {r for r, _ in got.values()} == {Reason.ZERO_GRAD}
    for _, detail in got.values():
        assert (
            "its gradient hook (register_hook) `" in detail
            and f"{_site_here('hook')} (`p.register_hook(lambda g: g * 0)`)" in detail
        )
        assert "returns an all-zero gradient; fix: return the gradient from the hook" in detail, detail


@pytest.mark.parametrize("max_norm", [0.0, 1.0])
def test_gradients_clipped_with_max_norm_zero(max_norm: float) -> None:
    """Before: every tensor zero_grad, and the hint's three guesses (zero_grad misplaced, clipped to 0, constant
    loss). Now each record and the hint say backward() computed non-zero gradients and the clip on the user's
    line zeroed them, with the fix; max_norm=1.0 is the healthy twin."""
    torch.manual_seed(0)
    model = CustomFunctionLayer("ok")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(s: int) -> None:
        _classify(model)(s)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=max_norm)  # planted: clip

    report, same = _run(model, opt, step)
    if max_norm:
        assert not same and report.healthy, report.table()
        return
    got = _details(report)
    assert set(got) == {n for n, _ in model.named_parameters()}
    assert {r for r, _ in got.values()} == {Reason.ZERO_GRAD}
    said = f"{_site_here('clip')} (`torch.nn.utils.clip_grad_norm_("
    for _, detail in got.values():
        assert "backward() wrote a non-zero gradient and it was all zero at step()" in detail and said in detail
        assert "set to zero in between by `_foreach_mul_` at " in detail
        assert "fix: gradient clipping with max_norm=0 scales every gradient to 0" in detail
    assert report.hint is not None and said in report.hint and "or is the loss constant?" not in report.hint


# --- a Hugging Face LM whose labels are all -100 ---------------------------------------------------------------
def test_a_hugging_face_lm_whose_labels_are_all_ignored() -> None:
    """GPT-2 trained with every label -100 (a prompt mask that covers every token): the loss is 0 and every
    gradient zero. Before: the hint's three guesses. Now the user's line and the cross-entropy whose every
    target is the ignore_index."""
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(s: int) -> None:
        ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(s))
        labels = torch.full_like(ids, -100)
        model(input_ids=ids, labels=labels).loss.backward()  # planted: labels

    report, _ = _run(model, opt, step)
    assert {r.reason for r in report.never_updated} == {Reason.ZERO_GRAD}
    assert len(report.never_updated) == len(list(model.parameters()))  # the tied head counted once
    said = f"{_site_here('labels')} (`model(input_ids=ids, labels=labels).loss.backward()`) by `cross_entropy`"
    assert report.hint is not None and said in report.hint, report.hint
    assert report.hint.startswith("every trainable tensor had an all-zero grad: cut at ")
    assert "whose every target is its ignore_index" in report.hint and "fix: check the labels" in report.hint


# --- a head replaced after the optimizer was built ----------------------------------------------------------------
def test_a_head_replaced_after_the_optimizer_is_named_as_replaced() -> None:
    """`model.head = nn.Linear(...)` after the optimizer was built, then gradlog started: before, the new head read
    "in no optimizer param group (added after the optimizer was built?)" and, apart, the optimizer's two orphans
    "not in the model passed to gradlog". Now the two records are paired by shape: head was replaced, and the fix.
    A whole model copied after the optimizer keeps its own hint (deepcopy), unpaired."""
    torch.manual_seed(0)
    model = CustomFunctionLayer("ok")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    old = {id(p) for p in model.head.parameters()}
    model.head = nn.Linear(16, 3)  # planted: replaced
    report, same = _run(model, opt, _classify(model))
    assert same == {"head.weight", "head.bias"}
    got = _details(report)
    assert {n for n, (r, _) in got.items() if r == Reason.NOT_IN_OPTIMIZER} == same
    orphans = {n for n, (r, _) in got.items() if r == Reason.NOT_IN_MODEL}
    assert len(orphans) == len(old) == 2
    for name in same:
        detail = got[name][1]
        assert "the optimizer steps 2 tensors of the same shapes (3x16, 3) that the model no longer has" in detail
        assert "head was replaced after the optimizer was built" in detail and "added after" not in detail, detail
        assert "fix: build the optimizer after replacing it, or optimizer.add_param_group(" in detail
    assert all(got[n][1].endswith("; replaced in the model by head") for n in orphans)
