"""A logger whose model is garbage-collected while it is open closes itself with the whole verdict.

A notebook cell run again rebinds `model = Model()`, a script does `del model` before exit: the logger
(which holds the model weakly) is closed by the model's finalizer, when its modules are already gone.
Each scenario is trained twice the same way, once ended by `gl.close()` and once by dropping the model;
the two Reports must be equal, and the slices they name must be the ones the test finds itself from
a copy of the initial weights and the gradients it reads at every step.
"""

from __future__ import annotations

import copy
import gc
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from catalogue import Bag, DeadUnits, lm_loss, loop, mask_router, random_mse, tiny_mixtral
from torch import nn

import gradlog
from gradlog import Reason
from gradlog.measure import params as params_module

Records = set[tuple[str, int | None, tuple[int, ...], Reason]]  # (name, dim, indices, reason)


@dataclass
class Want:
    """What a scenario's report must say, from the test's own reference."""

    status: str
    partly: Records
    stopped: Records = field(default_factory=set)
    experts: set[tuple[str, str, tuple[int, ...], int]] = field(default_factory=set)  # layer, state, experts, of


Scenario = Callable[[bool], tuple[gradlog.Report, Want]]


def ended(gl: gradlog.GradLogger, model: weakref.ref[nn.Module], gone: bool) -> gradlog.Report:
    """`gl`'s report: after `gl.close()`, or (`gone`: the caller dropped its model) after the model's
    finalizer closed it, which it must have done once the model is collected."""
    if gone:
        gc.collect()
        assert model() is None, "something of gradlog's keeps the model alive"
        assert gl.closed and gl not in gradlog.run.lifecycle.ACTIVE
    return gl.close()


def unchanged(before: torch.Tensor, after: torch.Tensor, dim: int | None) -> tuple[int, ...]:
    """Reference: the slices along `dim` (None: elements) that are bit-for-bit what they were."""
    same = before == after
    if dim is not None:
        same = same.movedim(dim, 0).reshape(same.shape[dim], -1).all(1)
    return tuple(same.nonzero().flatten().tolist())


def partly(report: gradlog.Report) -> Records:
    return {(r.name, r.dim, r.indices, r.reason) for r in report.partly_updated}


def dead_units(gone: bool) -> tuple[gradlog.Report, Want]:
    """The reviewer's reproduction: units 0-7 of fc1 never fire."""
    torch.manual_seed(0)
    model = DeadUnits()
    start = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gl = gradlog.GradLogger(model, opt, every=2, print_report=False, writer=gradlog.MemoryWriter())
    loop(opt, gl, 10, random_mse(model, 16, 16, gen=torch.Generator().manual_seed(5)))
    units = unchanged(start.fc1.weight, model.fc1.weight, 0)
    assert units == unchanged(start.fc1.bias, model.fc1.bias, None) == unchanged(start.fc2.weight, model.fc2.weight, 1)
    assert units and len(units) < 32
    want = Want(
        "PROBLEM",
        {
            ("fc1.weight", 0, units, Reason.ZERO_GRAD),
            ("fc1.bias", None, units, Reason.ZERO_GRAD),
            ("fc2.weight", 1, units, Reason.ZERO_GRAD),
        },
    )
    ref = weakref.ref(model)
    if gone:
        del model
    return ended(gl, ref, gone), want


def low_ids(model: nn.Module, gen: torch.Generator, fed: set[int]) -> Callable[[int], torch.Tensor]:
    """The loss of `model` (a `Bag`) on batches of ids 0-9 only, each noted in `fed`."""

    def loss(step: int) -> torch.Tensor:
        ids = torch.randint(0, 10, (8, 6), generator=gen)
        fed.update(ids.flatten().tolist())
        out: torch.Tensor = model(ids).pow(2).mean()
        return out

    return loss


def padded_embedding(gone: bool) -> tuple[gradlog.Report, Want]:
    """Ids 0-9 of 20, 0 being the padding row: row 0 and the ids never fed stay, as notes."""
    torch.manual_seed(0)
    model = Bag(padding_idx=0, vocab=20)
    start = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gl = gradlog.GradLogger(model, opt, every=1, print_report=False, writer=gradlog.MemoryWriter())
    fed: set[int] = set()
    loop(opt, gl, 8, low_ids(model, torch.Generator().manual_seed(0), fed))
    rows = unchanged(start.emb.weight, model.emb.weight, 0)
    unseen = tuple(sorted(set(range(20)) - fed))
    assert 0 in fed and rows == (0, *unseen) and unseen
    # notes, not problems: the padding row by design, the others ids no batch had
    want = Want("OK", {("emb.weight", 0, (0,), Reason.PADDING_IDX), ("emb.weight", 0, unseen, Reason.NOT_IN_BATCH)})
    ref = weakref.ref(model)
    if gone:
        del model
    return ended(gl, ref, gone), want


def mixtral(gone: bool) -> tuple[gradlog.Report, Want]:
    """A tiny Mixtral whose routers never pick experts 6-7 and stop picking 4-5 at step 9: the fused expert
    tensors' rows are experts, grouped per layer, and the routers' rows for them stop with them."""
    k, steps = 9, 24
    model = tiny_mixtral()
    step_now = [0]
    mask_router(model, [6, 7], lambda: True)
    mask_router(model, [4, 5], lambda: step_now[0] >= k)
    params = dict(model.named_parameters())
    fused = [n for n, p in params.items() if p.dim() == 3]
    watched = fused + [n for n in params if n.endswith("mlp.gate.weight")]
    start = {n: params[n].detach().clone() for n in watched}
    last = {n: torch.full((params[n].shape[0],), -1) for n in watched}  # reference: each row's last gradient
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gl = gradlog.GradLogger(model, opt, every=1, print_report=False, writer=gradlog.MemoryWriter())
    gen = torch.Generator().manual_seed(0)

    def loss(step: int) -> torch.Tensor:
        step_now[0] = step
        return lm_loss(model, gen)

    def record(step: int) -> None:
        for n in watched:
            g = params[n].grad
            assert g is not None
            last[n][(g != 0).reshape(g.shape[0], -1).any(1)] = step

    loop(opt, gl, steps, loss, after_backward=record)
    for n in watched:  # rows 6-7 never had a gradient nor changed, 4-5 had one until before k, the rest to the end
        assert last[n][6:].tolist() == [-1, -1] and unchanged(start[n], params[n], 0) == (6, 7)
        assert 0 <= int(last[n][4:6].max()) < k and bool((last[n][:4] == steps - 1).all())
    layers = {n.rsplit(".", 1)[0] for n in fused}
    assert len(layers) == 2 and len(watched) == 3 * len(layers)
    want = Want(
        "PROBLEM",
        {(n, 0, (6, 7), Reason.ZERO_GRAD) for n in watched},
        {(n, 0, (4, 5), Reason.NOT_ROUTED) for n in watched},
        {(layer, state, idle, 8) for layer in layers for state, idle in (("never", (6, 7)), ("stopped", (4, 5)))},
    )
    ref = weakref.ref(model)
    if gone:
        del model
    return ended(gl, ref, gone), want


@pytest.mark.parametrize("scenario", [dead_units, padded_embedding, mixtral])
def test_a_model_garbage_collected_before_close_gives_the_same_report(scenario: Scenario) -> None:
    closed, want = scenario(False)
    gone, again = scenario(True)
    assert want == again  # the same training both times
    for report in (closed, gone):
        assert report.status == want.status
        assert partly(report) == want.partly
        assert {(s.name, s.dim, s.indices, s.reason) for s in report.stopped_slices} == want.stopped
        assert {(e.layer, e.state, e.experts, e.total) for e in report.experts} == want.experts
    assert gone == closed


def test_the_reviewers_dead_units_read_problem_with_3_partly_updated_tensors() -> None:
    report, _ = dead_units(True)
    assert report.verdict.startswith("gradlog PROBLEM: all 4 tracked tensors were updated; 3 tensors partly never")


def test_slices_of_the_gone_model_keep_their_names() -> None:
    """What the tables say of each slice comes from its module: units, an embedding's padding row, experts."""
    report, _ = dead_units(True)
    assert {r.detail.split(" (")[0] for r in report.partly_updated} == {
        "output units 0-7",
        "units 0-7",
        "input features 0-7",
    }
    report, _ = padded_embedding(True)
    pad = next(r for r in report.partly_updated if r.reason is Reason.PADDING_IDX)
    assert pad.detail.startswith("row 0 (1 of 20) never changed: the embedding's padding_idx row")
    report, _ = mixtral(True)
    assert all("experts 6-7 (2 of 8)" in r.detail for r in report.partly_updated if "experts" in r.name)
    assert all("experts 4-5 (2 of 8)" in s.detail for s in report.stopped_slices if "experts" in s.name)


def test_the_description_follows_a_module_replaced_mid_run_and_is_not_rebuilt_on_other_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The owners are described when the tracked tensors change (here: a new embedding at step 4), not on
    measured steps where nothing did: after the model is gone, the new table's unseen rows are still an
    embedding's (notes), not zero-gradient rows of an unknown tensor (a problem)."""
    built: list[int] = []
    real = params_module.describe
    monkeypatch.setattr(params_module, "describe", lambda *a: built.append(1) or real(*a))
    torch.manual_seed(0)
    model = Bag(vocab=20)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # no provisional tables: a diagnosis describes the live model again (it may have changed in place)
    out = gradlog.Output(gradlog.MemoryWriter(), provisional_every=None)
    gl = gradlog.GradLogger(model, opt, every=1, print_report=False, writer=out)
    assert len(built) == 1
    gen = torch.Generator().manual_seed(0)
    fed: set[int] = set()
    loop(opt, gl, 4, low_ids(model, gen, set()))
    assert len(built) == 1  # four measured steps, nothing changed: nothing described again
    model.emb = nn.Embedding(20, 16)
    opt.param_groups[0]["params"][0] = model.emb.weight
    start = model.emb.weight.detach().clone()
    loop(opt, gl, 6, low_ids(model, gen, fed), start=4)
    assert len(built) == 2  # once, at the first measured step after the change
    unseen = tuple(sorted(set(range(20)) - fed))
    assert unseen and unchanged(start, model.emb.weight, 0) == unseen
    ref = weakref.ref(model)
    del model
    report = ended(gl, ref, True)
    assert partly(report) == {("emb.weight", 0, unseen, Reason.NOT_IN_BATCH)} and report.status == "OK"
