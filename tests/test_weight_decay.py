"""Weight decay that wipes the weights: lr x weight_decay at or above one half (AdamW, SGD).

The reference is the optimizer's own settings, read by the test from `param_groups` after each step it
measures (the product and the steps it crossed the line), and the weights themselves: under AdamW at
lr x weight_decay = 1, a step's result does not depend on the weights it started from (checked on a copy).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from catalogue import TwoLayer, loop, random_mse, train
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import gradlog
from gradlog.cli.entry import main
from gradlog.readers.run import load, parse_markdown_table
from gradlog.verdict.tables import closed_report

Build = Callable[[TwoLayer], torch.optim.Optimizer]


def run(build: Build, steps: int = 10, every: int = 2, log_dir: Path | None = None) -> gradlog.Report:
    """TwoLayer trained `steps` steps under `build`'s optimizer (TensorBoard at `log_dir`, else in memory)."""
    torch.manual_seed(0)
    model = TwoLayer(torch.tanh)
    opt = build(model)
    writer = "tensorboard" if log_dir is not None else gradlog.MemoryWriter()
    log = str(log_dir) if log_dir is not None else None
    gl = gradlog.GradLogger(model, opt, writer=writer, log_dir=log, every=every, print_report=False)
    return train(opt, gl, steps, random_mse(model, 5, 6))


def by_hand(build: Build) -> tuple[set[str], float, float, float]:
    """The tensors whose group's lr x weight_decay is at least 0.5, read off the optimizer, with the product,
    lr and weight_decay (one value: the tests plant one)."""
    model = TwoLayer(torch.tanh)
    opt = build(model)
    names = {id(p): n for n, p in model.named_parameters()}
    hit = [(g, float(g["lr"]) * float(g["weight_decay"])) for g in opt.param_groups]
    hit = [(g, prod) for g, prod in hit if prod >= 0.5]
    tensors = {names[id(p)] for g, _ in hit for p in g["params"]}
    (g, prod), *_ = hit
    return tensors, prod, float(g["lr"]), float(g["weight_decay"])


PLANTED = {
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=100),
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, weight_decay=10),
}


@pytest.mark.parametrize("kind", PLANTED)
def test_weight_decay_that_wipes_the_weights_is_a_problem_naming_the_group_the_product_and_the_fix(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    build = PLANTED[kind]
    tensors, product, lr, wd = by_hand(build)
    assert tensors == {"a.weight", "a.bias", "b.weight", "b.bias"} and product == pytest.approx(1.0)
    report = run(build, log_dir=tmp_path / "tb")
    found = report.weight_decay
    assert {r.name for r in found} == tensors
    assert not report.healthy and report.verdict.startswith("gradlog PROBLEM")
    assert "4 tensors wiped by weight decay (lr x weight_decay >= 0.5)" in report.verdict
    for rec in found:
        assert (rec.group, rec.lr, rec.weight_decay, rec.steps, rec.of, rec.since_step) == (0, lr, wd, 5, 5, 0)
        assert rec.product == pytest.approx(product)
        assert f"param group 0 (4 tensors): lr {lr:g} x weight_decay {wd:g} = 1 at 5 of 5 measured steps" in rec.detail
        assert "each step multiplies the weights by 0 (a step leaves only its own update)" in rec.detail
        assert "AdamW's default is 0.01; use lr x weight_decay << 1" in rec.detail
        assert rec.to_dict()["severity"] == "problem"
    assert "Weight decay wipes the weights (4 tensors):" in report.table()
    # the written table, read back by TensorBoard's own reader, and the report a resumed run or the tab reads
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    acc.Reload()
    cols, rows = parse_markdown_table(acc.Tensors("gradlog/weight_decay")[-1].tensor_proto.string_val[0].decode())
    assert cols == ["name", "group", "lr", "weight_decay", "product", "steps", "of", "since_step", "detail"]
    assert rows == [r.row(written=True) for r in found]
    back = closed_report(load(str(tmp_path / "tb")))
    assert back is not None and back.weight_decay == found and back.verdict == report.verdict
    capsys.readouterr()
    assert main(["report", str(tmp_path / "tb")]) == 1  # `gradlog report`: the same table and verdict
    text = capsys.readouterr().out
    assert "Weight decay wipes the weights (4 tensors):" in text and text.rstrip().splitlines()[-1] == report.verdict


def test_at_lr_x_weight_decay_1_a_step_forgets_the_weights_it_started_from() -> None:
    """The claim itself, on a copy: AdamW at lr 1e-2, weight_decay 100 gives the same weights after a step
    from two different starting points with the same gradients and optimizer state."""
    torch.manual_seed(0)
    model = TwoLayer(torch.tanh)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(torch.randn_like(p))
    for m in (model, twin):
        for p in m.parameters():
            p.grad = torch.ones_like(p)
        torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=100).step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(p, q, atol=1e-7)


HEALTHY: dict[str, Build] = {
    "adamw_default": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01),
    "adamw_0.1": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
    "one_group_decayed": lambda m: torch.optim.AdamW(
        [{"params": m.a.parameters(), "weight_decay": 0.05}, {"params": m.b.parameters(), "weight_decay": 0.0}],
        lr=1e-3,
    ),
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, weight_decay=5e-4, momentum=0.9),
    "no_decay": lambda m: torch.optim.SGD(m.parameters(), lr=0.5, weight_decay=0.0),
    # huge weight_decay in a group whose lr is 0: nothing moves, the product is 0
    "lr_0": lambda m: torch.optim.AdamW(
        [{"params": m.a.parameters()}, {"params": m.b.parameters(), "lr": 0.0, "weight_decay": 1e6}], lr=1e-3
    ),
    # Adam's L2 decay goes through its normalisation: the product says nothing (not judged)
    "adam_l2": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, weight_decay=100),
}


@pytest.mark.parametrize("kind", HEALTHY)
def test_healthy_weight_decay_is_not_a_finding(kind: str) -> None:
    report = run(HEALTHY[kind])
    assert report.weight_decay == []
    if kind != "lr_0":  # its frozen group is a finding of its own (lr 0)
        assert report.healthy, report.verdict


def test_only_the_wiped_group_is_named() -> None:
    def build(m: TwoLayer) -> torch.optim.Optimizer:
        groups = [{"params": m.a.parameters(), "weight_decay": 0.01}, {"params": m.b.parameters(), "weight_decay": 60}]
        return torch.optim.AdamW(groups, lr=1e-2)

    tensors, product, lr, wd = by_hand(build)
    assert tensors == {"b.weight", "b.bias"}
    report = run(build)
    assert {r.name for r in report.weight_decay} == tensors
    rec = report.weight_decay[0]
    assert (rec.group, rec.weight_decay, rec.product) == (1, wd, pytest.approx(product))
    assert f"param group 1 (2 tensors): lr {lr:g} x weight_decay {wd:g} = {product:.3g}" in rec.detail
    assert "multiplies the weights by 0.4 (they keep about 1.67 steps of updates)" in rec.detail


class Decoupled(torch.optim.AdamW):
    """A subclass: its decay is AdamW's."""


def test_a_schedule_is_judged_at_the_steps_it_crosses_the_line_and_a_subclass_by_its_base() -> None:
    """lr 1e-4 for four steps, then 1e-2 (weight_decay 100): the product is 0.01, then 1, from step 4."""
    torch.manual_seed(0)
    model = TwoLayer(torch.tanh)
    opt = Decoupled(model.parameters(), lr=1e-2, weight_decay=100)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.01 if e < 4 else 1.0)
    gl = gradlog.GradLogger(model, opt, writer=gradlog.MemoryWriter(), every=1, print_report=False)
    products: list[float] = []

    def read_then_schedule(step: int) -> None:
        products.append(opt.param_groups[0]["lr"] * 100)  # the lr this step ran with
        sched.step()

    loop(opt, gl, 10, random_mse(model, 5, 6), after_step=read_then_schedule)
    report = gl.close()
    crossed = [i for i, p in enumerate(products) if p >= 0.5]
    assert crossed == list(range(4, 10))
    for rec in report.weight_decay:
        assert (rec.steps, rec.of, rec.since_step) == (len(crossed), 10, crossed[0])
        assert "at 6 of 10 measured steps from step 4" in rec.detail
    assert len(report.weight_decay) == 4


def test_a_schedule_that_brings_the_product_down_from_the_first_step_is_not_a_finding() -> None:
    """weight_decay 100 with lr 1e-2 scheduled to 1e-5 before the first step: 1e-3, a healthy product."""
    torch.manual_seed(0)
    model = TwoLayer(torch.tanh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=100)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1e-3)
    gl = gradlog.GradLogger(model, opt, writer=gradlog.MemoryWriter(), every=1, print_report=False)
    loop(opt, gl, 6, random_mse(model, 5, 6), after_step=lambda step: sched.step())
    report = gl.close()
    assert report.weight_decay == [] and report.healthy, report.verdict
