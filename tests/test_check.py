"""`gradlog.check`: the planted-bug catalogue in one step, no false alarm on a healthy model, and nothing
left behind: weights, grads, buffers, optimizer state, RNG and the next training step are bitwise the same."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from catalogue import EVERY_BUG, EveryBug, TinyClassifier, every_bug_optimizer
from torch import nn

import gradlog
from gradlog import Reason


def test_planted_catalogue_in_one_step(capsys):
    torch.manual_seed(0)
    model = EveryBug()
    opt = every_bug_optimizer(model)
    report = gradlog.check(model, opt, torch.randn(16, 8))
    assert {r.name: r.reason for r in report.never_updated} == EVERY_BUG
    assert not report.healthy
    assert report.optimizer_steps == 1 and report.measured_steps == 1
    out = capsys.readouterr().out
    assert "gradlog PROBLEM" in out and "times_zero.weight" in out
    # one batch cannot tell an unused tensor from a rarely used one: the detail says so
    assert "in this batch" in {r.name: r for r in report.never_updated}["unused.weight"].detail


def _batch(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 20, (6, 8), generator=g)  # tokens 20..49 never appear; positions 8..31 neither
    return {"ids": ids, "labels": torch.randint(0, 50, (6,), generator=g)}


def test_healthy_transformer_gives_no_finding(capsys):
    torch.manual_seed(0)
    model = TinyClassifier()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = _batch()
    report = gradlog.check(model, opt, batch)  # dict batch: model(**batch) returns the loss tensor
    assert report.never_updated == [] and report.healthy
    assert report.verdict.startswith("gradlog OK")
    assert isinstance(report, gradlog.CheckReport) and report.partly_updated == []  # kept apart from the verdict
    assert report.to_dict()["in_batch"][0]["detail"].startswith("in this batch")
    by = {(p.name, p.dim): p for p in report.in_batch}
    seen = set(batch["ids"].unique().tolist())
    tok = by[("tok.weight", 0)]
    assert set(tok.indices) == set(range(1, 50)) - seen and tok.reason == Reason.NOT_IN_BATCH
    assert tok.detail.startswith("in this batch")
    unseen = sorted(set(range(1, 50)) - seen)  # worded for one batch, not a run's measured batches
    first = ", ".join(map(str, unseen[:5]))
    assert f": ids {first}, ... ({len(unseen)} of 50) are not in this batch;" in tok.detail
    assert "measured" not in tok.detail
    if 0 in seen:
        assert by.get(("tok.weight", 0)) and ("tok.weight", 0) in by
    pad = [p for p in report.in_batch if p.reason == Reason.PADDING_IDX]
    assert [(p.name, p.indices) for p in pad] == [("tok.weight", (0,))]
    assert by[("pos.weight", 0)].indices == tuple(range(8, 32))
    assert {p.reason for p in report.in_batch} <= {Reason.NOT_IN_BATCH, Reason.PADDING_IDX}
    assert "In this batch only" in capsys.readouterr().out


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, object]:
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "opt": copy.deepcopy(opt.state_dict()),
        "training": [m.training for m in model.modules()],
    }


def _assert_same(a: object, b: object, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _scenario(use_check: bool) -> tuple[list[torch.Tensor], dict[str, object], torch.Tensor]:
    """Two warm-up steps (Adam state, BatchNorm statistics, grads left in .grad), maybe a check, two more steps."""
    torch.manual_seed(0)
    random.seed(0)
    model = TinyClassifier()
    extra = nn.Linear(3, 3)  # in the optimizer with grad None: must stay None
    opt = torch.optim.Adam([*model.parameters(), extra.weight], lr=1e-2)
    losses = []

    def train_step(seed: int) -> None:
        opt.zero_grad()
        loss = model(**_batch(seed))
        loss.backward()
        opt.step()
        losses.append(loss.detach())

    train_step(1)
    train_step(2)
    opt.param_groups[0]["lr"] = 5e-3
    if use_check:
        before = _state(model, opt)
        rng = torch.random.get_rng_state()
        py = random.getstate()
        with pytest.warns(UserWarning, match="optimizer holds a parameter the model does not have"):
            report = gradlog.check(model, opt, _batch(7), steps=2, print_report=False)
        assert report.optimizer_steps == 2
        after = _state(model, opt)
        _assert_same(before, after, "state")
        assert torch.equal(rng, torch.random.get_rng_state()) and py == random.getstate()
        assert extra.weight.grad is None and model.pos.weight.grad is not None
    train_step(3)
    train_step(4)
    return losses, _state(model, opt), torch.rand(3)


def test_check_leaves_training_bitwise_identical():
    plain_losses, plain_state, plain_rand = _scenario(use_check=False)
    checked_losses, checked_state, checked_rand = _scenario(use_check=True)
    for a, b in zip(plain_losses, checked_losses):
        assert torch.equal(a, b)  # the next steps' losses, bit for bit
    _assert_same(plain_state, checked_state, "final")
    assert torch.equal(plain_rand, checked_rand)
    assert plain_state["opt"]["state"][0]["step"] == torch.tensor(4.0)  # Adam's step counter did not move


def test_batch_forms_and_loss_fn():
    torch.manual_seed(0)
    lin = nn.Linear(4, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    assert gradlog.check(lin, opt, torch.randn(3, 4), print_report=False).healthy  # tensor: model(batch).sum()
    bil = nn.Bilinear(4, 4, 2)
    opt2 = torch.optim.SGD(bil.parameters(), lr=0.1)
    assert gradlog.check(bil, opt2, (torch.randn(3, 4), torch.randn(3, 4)), print_report=False).healthy  # model(*batch)

    class Output:
        def __init__(self, loss: torch.Tensor) -> None:
            self.loss = loss

    def hf_like(model: nn.Module, batch: torch.Tensor) -> Output:
        return Output(model(batch).pow(2).mean())

    assert gradlog.check(lin, opt, torch.randn(3, 4), loss_fn=hf_like, print_report=False).healthy
    with pytest.raises(TypeError, match=r"returned str, not a tensor or an output with a .loss tensor; pass loss_fn"):
        gradlog.check(lin, opt, torch.randn(3, 4), loss_fn=lambda m, b: "x", print_report=False)
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        gradlog.check(lin, opt, torch.randn(3, 4), steps=0)
    lazy = nn.LazyLinear(2)
    with pytest.raises(ValueError, match=r"'weight' is not materialised yet .* run one forward pass"):
        gradlog.check(lazy, torch.optim.SGD(lazy.parameters(), lr=0.1), torch.randn(3, 4))
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        gradlog.check(lambda x: x, opt, torch.randn(3, 4))  # type: ignore[arg-type]


def test_failure_inside_the_step_restores_and_raises():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    before = _state(model, opt)
    calls = []

    def bad_loss(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        out = m(batch).sum()
        if len(calls) == 2:
            raise RuntimeError("boom in the second step")
        return out

    with pytest.raises(RuntimeError, match="boom in the second step"):
        gradlog.check(model, opt, torch.randn(5, 4), loss_fn=bad_loss, steps=2, print_report=False)
    _assert_same(before, _state(model, opt), "state")
    assert not opt._optimizer_step_pre_hooks and not gradlog.lifecycle.ACTIVE  # the check's logger is gone


def test_hugging_face_model_output_loss():
    """A real (tiny) GPT-2 from a config: the default loss is the output's .loss; nothing is a finding."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (2, 6))
    report = gradlog.check(model, opt, {"input_ids": ids, "labels": ids}, print_report=False)
    assert report.never_updated == [] and report.healthy
    pos = {(p.name, p.dim): p for p in report.in_batch}[("transformer.wpe.weight", 0)]
    assert pos.indices == tuple(range(5, 16)) and pos.reason == Reason.NOT_IN_BATCH  # position 5 predicts nothing
    assert all(p.reason == Reason.NOT_IN_BATCH for p in report.in_batch)
