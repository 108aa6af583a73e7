"""`gradlog.check`: the planted-bug catalogue in one step, no false alarm on a healthy model, and nothing
left behind: weights, grads, buffers, optimizer state, RNG and the next training step are bitwise the same."""

from __future__ import annotations

import copy
import random
import warnings

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
    assert not opt._optimizer_step_pre_hooks and not gradlog.run.lifecycle.ACTIVE  # the check's logger is gone


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


# --- issue 41: a check beside an open logger; a batch the model cannot take ---------------------------------
def test_check_leaves_an_open_logger_alone():
    """docs/verdict.md's order: a GradLogger, then gradlog.check. The check must not close the logger (it did,
    and the user's first gl.log raised), and the logger must not count the check's steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=1, print_report=False)
    batch = (torch.randn(4, 8), torch.randint(0, 2, (4,)))
    xent = lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "already open ... closed" warning either
        checked = gradlog.check(model, opt, batch, loss_fn=xent, steps=2, print_report=False)
    assert checked.optimizer_steps == 2 and checked.healthy
    assert not gl.closed
    for step in range(3):
        xent(model, batch).backward()
        opt.step()
        gl.log(step)
        opt.zero_grad()
    report = gl.close()
    assert report.optimizer_steps == 3 and report.measured_steps == 3
    assert [s for s, _ in mem.scalars["gradlog/grad_norm_total"]] == [0, 1, 2]


def test_a_batch_the_model_cannot_take_names_loss_fn():
    """README's quickstart model and an (x, y) batch: the error says what gradlog tried and how to pass a loss,
    instead of Python's bare 'forward() takes 2 positional arguments but 3 were given' from inside gradlog."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match=r"model\(\*batch\).*tuple of 2.*Sequential\.forward.*loss_fn=.*step_fn="):
        gradlog.check(model, opt, (torch.randn(32, 8), torch.randint(0, 2, (32,))), print_report=False)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# --- issue 39.5: check on the user's own training step ---------------------------------------------------
def test_step_fn_catches_zero_grad_between_backward_and_step():
    """A healthy model, a buggy loop: only the user's own step shows the misplaced zero_grad()."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(4, 8), torch.randint(0, 2, (4,)))

    def buggy(b):
        loss = nn.functional.cross_entropy(model(b[0]), b[1])
        loss.backward()
        opt.zero_grad()  # the bug: the gradients are gone before the step
        opt.step()

    def fine(b):
        opt.zero_grad()
        nn.functional.cross_entropy(model(b[0]), b[1]).backward()
        opt.step()

    before = [p.detach().clone() for p in model.parameters()]
    bad = gradlog.check(model, opt, batch, step_fn=buggy, print_report=False)
    assert not bad.healthy
    assert {r.name for r in bad.never_updated} == {n for n, _ in model.named_parameters()}
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    good = gradlog.check(model, opt, batch, step_fn=fine, print_report=False)
    assert good.healthy and good.never_updated == []
    with pytest.raises(RuntimeError, match=r"without calling optimizer\.step"):
        gradlog.check(model, opt, batch, step_fn=lambda b: None, print_report=False)
    with pytest.raises(TypeError, match="not both"):
        gradlog.check(model, opt, batch, loss_fn=lambda m, b: m(b[0]).sum(), step_fn=fine, print_report=False)


def _lora_gpt2() -> nn.Module:
    from catalogue import tiny_gpt2

    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0)
    model: nn.Module = peft.get_peft_model(tiny_gpt2(), config)
    return model


def test_lora_a_first_zero_gradient_is_a_note():
    """peft's LoRA on a tiny GPT-2: B starts at zero, so A's first gradient is exactly zero by design. A note
    naming B, not a zero_grad problem; a planted bug beside it (a lora_B left out of the optimizer) still is."""
    pytest.importorskip("transformers")
    model = _lora_gpt2()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([p for _, p in trainable], lr=1e-3)
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    report = gradlog.check(model, opt, batch, print_report=False)
    assert report.healthy, report.verdict
    lora_a = {n for n, _ in trainable if "lora_A" in n}
    assert len(lora_a) == 2
    named = {r.name: r for r in report.never_updated if r.reason != Reason.FROZEN}  # the base model: frozen, notes
    assert set(named) == lora_a
    for name in lora_a:
        rec = named[name]
        assert rec.reason == Reason.ZERO_GRAD and name.replace("lora_A", "lora_B") in rec.detail
        assert rec.to_dict(report.policy)["severity"] == "note"
    # the same check on a model whose B are not zero: A gets a gradient, and nothing is listed
    for n, p in trainable:
        if "lora_B" in n:
            with torch.no_grad():
                p.normal_(0, 0.02)
    again = gradlog.check(model, opt, batch, print_report=False)
    assert {r.reason for r in again.never_updated} == {Reason.FROZEN}


def test_step_fn_on_peft_lora_with_a_warm_up_from_lr_zero():
    """The user's own step on peft LoRA with a LambdaLR warm-up from 0: lr is 0 on the first step while
    initial_lr is 1e-3. A note saying so, not a zero_lr problem; the scheduler's lr put back."""
    pytest.importorskip("transformers")
    model = _lora_gpt2()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, step / 10))
    assert opt.param_groups[0]["lr"] == 0.0
    gen = torch.Generator().manual_seed(1)

    def train_step(ids):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    report = gradlog.check(
        model, opt, torch.randint(0, 64, (4, 12), generator=gen), step_fn=train_step, print_report=False
    )
    assert report.healthy, report.verdict
    found = [r for r in report.never_updated if r.reason != Reason.FROZEN]
    assert found and {r.reason for r in found} == {Reason.ZERO_LR}
    for rec in found:
        assert "initial_lr is 0.001" in rec.detail and "warm-up" in rec.detail
        assert rec.to_dict(report.policy)["severity"] == "note"
    assert opt.param_groups[0]["lr"] == 0.0 and sched.last_epoch == 0
    # a group at lr 0 with no warm-up is still the problem it was
    plain = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.0)
    assert not gradlog.check(
        model,
        plain,
        torch.randint(0, 64, (4, 12), generator=gen),
        step_fn=lambda ids: (plain.zero_grad(), model(input_ids=ids, labels=ids).loss.backward(), plain.step()),
        print_report=False,
    ).healthy
