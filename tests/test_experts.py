"""Experts named as experts: fused 3-D expert tensors (transformers' Mixtral) and per-expert modules.

The expected experts come from the gradients the test reads itself at every step (which experts' slices of
the expert tensors were ever non-zero), never from gradlog.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from catalogue import ConvExperts, TwoLayerMoE, lm_loss, loop, mask_router, mse, random_mse, tiny_mixtral, train
from torch import nn

import gradlog
from gradlog import Reason
from gradlog.measure.owners import describe
from gradlog.readers.run import closed_report, load
from gradlog.verdict.experts import expert_layout, is_fused_experts

transformers = pytest.importorskip("transformers")


def expert_grads_ever(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: torch.zeros(p.shape[0], dtype=torch.bool) for n, p in model.named_parameters() if p.dim() == 3}


def train_mixtral(
    model: nn.Module, steps: int, every: int = 1, spy: dict[str, torch.Tensor] | None = None
) -> gradlog.Report:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gl = gradlog.GradLogger(model, opt, writer=gradlog.MemoryWriter(), every=every, print_report=False)
    gen = torch.Generator().manual_seed(0)

    def record(step: int) -> None:
        if spy is not None:
            params = dict(model.named_parameters())
            for n in spy:
                g = params[n].grad
                if g is not None:
                    spy[n] |= (g != 0).reshape(g.shape[0], -1).any(1)

    return train(opt, gl, steps, lambda step: lm_loss(model, gen), after_backward=record)


def test_fused_mixtral_experts_never_routed_are_named_per_expert_and_layer() -> None:
    model = tiny_mixtral()
    hooks = mask_router(model, [5, 6, 7], lambda: True)
    spy = expert_grads_ever(model)
    report = train_mixtral(model, steps=6, spy=spy)
    for h in hooks:
        h.remove()
    # reference: experts whose slice of every fused tensor had a zero gradient at every step
    for name, ever in spy.items():
        assert tuple((~ever).nonzero().flatten().tolist()) == (5, 6, 7), name
    got = {(e.layer, e.state, e.experts, e.total) for e in report.experts}
    want = {(f"model.layers.{i}.mlp.experts", "never", (5, 6, 7), 8) for i in range(2)}
    assert got == want
    for e in report.experts:
        assert "experts 5-7 of 8 got no gradient" in e.detail
    # the partly-updated rows of the fused tensors are called experts too
    fused = [r for r in report.partly_updated if r.name.endswith(("gate_up_proj", "down_proj"))]
    assert fused and all(r.dim == 0 and r.indices == (5, 6, 7) for r in fused)
    assert all("experts 5-7 (3 of 8)" in r.detail for r in fused)
    assert "Experts (2 records)" in report.table()


def test_per_expert_modules_never_used_are_grouped_per_layer() -> None:
    torch.manual_seed(0)
    model = TwoLayerMoE()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gl = gradlog.GradLogger(model, opt, writer=gradlog.MemoryWriter(), print_report=False, every=1)
    used: dict[str, bool] = {n: False for n, _ in model.named_parameters()}

    def record(step: int) -> None:
        for n, p in model.named_parameters():
            used[n] |= p.grad is not None and bool((p.grad != 0).any())

    report = train(opt, gl, 4, random_mse(model, 6, 8), after_backward=record)
    # reference: per layer, the experts none of whose tensors ever had a non-zero gradient
    want = set()
    for i in range(2):
        idle = tuple(
            k for k in range(6) if not any(v for n, v in used.items() if n.startswith(f"layers.{i}.experts.{k}."))
        )
        want.add((f"layers.{i}.experts", "never", idle, 6))
    assert want == {("layers.0.experts", "never", (4, 5), 6), ("layers.1.experts", "never", (2, 3, 5), 6)}
    assert {(e.layer, e.state, e.experts, e.total) for e in report.experts} == want


def test_a_conv1d_weight_is_never_taken_for_experts() -> None:
    torch.manual_seed(0)
    model = ConvExperts()
    owner = describe(model, {id(model.experts.weight): 0}).get(0)
    assert owner is not None and owner.family == "conv"
    assert not is_fused_experts(owner, "experts.weight", model.experts.weight.dim())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gl = gradlog.GradLogger(model, opt, writer=gradlog.MemoryWriter(), print_report=False, every=1)
    report = train(opt, gl, 3, random_mse(model, 2, 4, 9))
    assert report.experts == []
    rows = [r for r in report.partly_updated if r.name == "experts.weight" and r.dim == 0]
    assert len(rows) == 1 and rows[0].indices == (4, 5) and rows[0].reason is Reason.ZERO_GRAD
    assert "filters 4-5" in rows[0].detail and "expert" not in rows[0].detail.split(";")[0]
    assert expert_layout(gl.table.owners(), gl.pipeline.table.live) == {}


@pytest.mark.parametrize("every", [1, 3])
def test_mixtral_router_collapse_at_step_k_reports_experts_stopped_from_k(every: int) -> None:
    # every=3: 18 measured steps, as 9 (3 before the collapse) are no evidence: experts routed at random would
    # put their 3 steps with a token first with chance 1 / C(9, 3) = 1/84 (`stopped_slices.MAX_CHANCE`)
    k, steps = (9, 27) if every == 1 else (18, 54)
    model = tiny_mixtral()
    step_now = [0]
    hooks = mask_router(model, [4, 5, 6, 7], lambda: step_now[0] >= k)
    params = dict(model.named_parameters())
    watched = [n for n, p in params.items() if p.dim() == 3 or n.endswith("mlp.gate.weight")]
    last = {n: torch.full((params[n].shape[0],), -1) for n in watched}  # reference, at measured steps
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gl = gradlog.GradLogger(model, opt, writer=gradlog.MemoryWriter(), every=every, print_report=False)
    gen = torch.Generator().manual_seed(0)

    def loss(step: int) -> torch.Tensor:
        step_now[0] = step
        return lm_loss(model, gen)

    def record(step: int) -> None:
        if step % every == 0:
            for n in watched:
                g = params[n].grad
                assert g is not None
                last[n][(g != 0).reshape(g.shape[0], -1).any(1)] = step

    report = train(opt, gl, steps, loss, after_backward=record)
    for h in hooks:
        h.remove()
    since = k + (-k) % every  # the first measured step from k on
    for n in watched:  # the reference: experts 4-7 (and the router's rows for them) last had a gradient before k
        assert (
            bool((last[n][4:] < k).all())
            and bool((last[n][4:] >= 0).all())
            and bool((last[n][:4] == steps - 1 - (steps - 1) % every).all())
        )
    got = {(r.name, r.dim, r.indices, r.since_step, r.reason) for r in report.stopped_slices}
    want = {(n, 0, (4, 5, 6, 7), since, Reason.NOT_ROUTED) for n in watched}
    assert got == want
    experts = {(e.layer, e.state, e.experts, e.total, e.since_step, e.reason) for e in report.experts}
    layers = {f"model.layers.{i}.mlp.experts" for i in range(2)}
    assert experts == {(layer, "stopped", (4, 5, 6, 7), 8, since, Reason.NOT_ROUTED) for layer in layers}
    assert all(f"experts 4-7 of 8 got no gradient from step {since} on" in e.detail for e in report.experts)


def test_per_expert_modules_that_stop_being_routed_are_one_record_per_layer() -> None:
    torch.manual_seed(0)
    model = TwoLayerMoE()
    model.routes = [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gl = gradlog.GradLogger(model, opt, writer=gradlog.MemoryWriter(), print_report=False, every=1)
    last: dict[str, int] = {}  # reference: the last step each tensor had a non-zero gradient

    def loss(step: int) -> torch.Tensor:
        if step == 6:
            model.routes[0] = [0, 1, 0, 1, 4, 5]  # layer 0 stops routing tokens to experts 2 and 3
        return mse(model, torch.randn(6, 8))

    def record(step: int) -> None:
        for n, p in model.named_parameters():
            if p.grad is not None and bool((p.grad != 0).any()):
                last[n] = step

    report = train(opt, gl, 16, loss, after_backward=record)
    stopped = {n for n, s in last.items() if s < 15}
    assert stopped == {f"layers.0.experts.{k}.{m}.{w}" for k in (2, 3) for m in (0, 2) for w in ("weight", "bias")}
    assert {last[n] for n in stopped} == {5}
    got = {(e.layer, e.state, e.experts, e.total, e.since_step, e.reason) for e in report.experts}
    assert got == {("layers.0.experts", "stopped", (2, 3), 6, 6, Reason.NO_GRAD)}
    assert "experts 2-3 of 6 got no gradient from step 6 on" in report.experts[0].detail


def test_experts_that_stop_at_different_steps_are_one_record_per_step() -> None:
    """Two experts of one layer that stopped at different steps are two records, each from its own step: one
    record for both would say the later one stopped at the earlier one's step."""
    torch.manual_seed(0)
    model = TwoLayerMoE()
    model.routes = [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gl = gradlog.GradLogger(model, opt, writer=gradlog.MemoryWriter(), print_report=False, every=1)
    drop = {4: [0, 1, 0, 3, 4, 5], 9: [0, 1, 0, 0, 4, 5]}  # step -> layer 0's routes from then on: 2 goes, then 3
    last: dict[str, int] = {}  # reference: the last step each tensor had a non-zero gradient

    def loss(step: int) -> torch.Tensor:
        model.routes[0] = drop.get(step, model.routes[0])
        return mse(model, torch.randn(6, 8))

    def record(step: int) -> None:
        for n, p in model.named_parameters():
            if p.grad is not None and bool((p.grad != 0).any()):
                last[n] = step

    report = train(opt, gl, 20, loss, after_backward=record)
    ends = {k: max(s for n, s in last.items() if n.startswith(f"layers.0.experts.{k}.")) for k in range(6)}
    assert {k: s for k, s in ends.items() if s < 19} == {2: 3, 3: 8}
    got = {(e.layer, e.state, e.experts, e.since_step) for e in report.experts}
    assert got == {("layers.0.experts", "stopped", (k,), s + 1) for k, s in ends.items() if s < 19}
    assert [e.since_step for e in report.experts] == [4, 9]  # in the order they stopped


# --- a resumed run: the Experts table spans the segments ------------------------------------------------
def checkpointed(model: nn.Module, opt: torch.optim.Optimizer, fresh: nn.Module, path: Path) -> torch.optim.Optimizer:
    """`model` and `opt` saved to `path` as a training script checkpoints them, loaded into `fresh` and a new
    optimizer of the same class as a resumed script does: the new optimizer."""
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    state = torch.load(path)
    fresh.load_state_dict(state["model"])
    again = type(opt)(fresh.parameters())  # its settings (lr, weight decay) come with the state dict
    again.load_state_dict(state["optimizer"])
    return again


def mixtral_segment(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    folder: Path,
    steps: range,
    masked_at: Callable[[int], list[int]],
    writer: str,
    last: dict[str, torch.Tensor],
) -> gradlog.Report:
    """One segment of a Mixtral run (every step measured; a resumed one from `steps.start`): the routers
    send no token to the experts `masked_at(step)`; `last` gets, per fused expert tensor and expert, the
    last step whose gradient was non-zero in that expert's slice (the reference)."""
    masked: list[int] = []
    hooks = mask_router(model, masked, lambda: bool(masked))
    params = dict(model.named_parameters())
    out = gradlog.Output(writer, resume=steps.start > 0)
    gl = gradlog.GradLogger(model, opt, writer=out, log_dir=str(folder), every=1, print_report=False)
    gen = torch.Generator().manual_seed(steps.start)

    def loss(step: int) -> torch.Tensor:
        masked[:] = masked_at(step)
        return lm_loss(model, gen)

    def record(step: int) -> None:
        for n, vec in last.items():
            g = params[n].grad
            assert g is not None
            vec[(g != 0).reshape(g.shape[0], -1).any(1)] = step

    loop(opt, gl, len(steps), loss, after_backward=record, start=steps.start)
    report = gl.close()
    for h in hooks:
        h.remove()
    return report


@pytest.mark.parametrize("writer", ["tensorboard", "wandb"])
def test_mixtral_experts_idle_across_a_resume_span_the_run(
    tmp_path: Path, writer: str, request: pytest.FixtureRequest
) -> None:
    """A Mixtral run checkpointed at step 16 and resumed from the checkpoint (a fresh model and optimizer, a
    new GradLogger with resume=True): experts 6-7 routed in neither segment were never routed in the run;
    5, routed until step 5, stopped at its own step; 4, routed until the checkpoint, stopped at the
    resume; 3, routed only after the resume, is no finding. The steps come from the gradients read here."""
    if writer == "wandb":
        request.getfixturevalue("wandb_offline")
    first, second = range(16), range(16, 30)
    model = tiny_mixtral()
    opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    last = {n: torch.full((p.shape[0],), -1) for n, p in model.named_parameters() if p.dim() == 3}
    plan = {3: first, 5: range(6, 16), 6: first, 7: first}  # expert -> the steps of the first segment it is masked
    mixtral_segment(model, opt, tmp_path / "run", first, lambda s: [k for k, r in plan.items() if s in r], writer, last)
    resumed = tiny_mixtral()
    opt = checkpointed(model, opt, resumed, tmp_path / "ckpt.pt")
    report = mixtral_segment(resumed, opt, tmp_path / "run", second, lambda s: [4, 5, 6, 7], writer, last)

    # the reference: an expert whose slices never had a gradient was never routed; one whose last gradient
    # came before the last step stopped at the next step (every step is measured)
    latest = torch.stack(list(last.values())).max(0).values.tolist()
    assert all(v.tolist() == latest for v in last.values())  # every fused tensor of every layer agrees
    never = tuple(k for k, s in enumerate(latest) if s < 0)
    stopped = {k: s + 1 for k, s in enumerate(latest) if 0 <= s < second.stop - 1}
    assert never == (6, 7) and stopped == {5: 6, 4: second.start}  # the plan held: 4 stopped at the resume
    layers = [f"model.layers.{i}.mlp.experts" for i in range(2)]
    want = {(layer, "never", never, -1) for layer in layers}
    want |= {(layer, "stopped", (k,), since) for layer in layers for k, since in stopped.items()}
    got = {(e.layer, e.state, e.experts, e.since_step) for e in report.experts}
    assert got == want
    assert {e.reason for e in report.experts if e.state == "stopped"} == {Reason.NOT_ROUTED}
    # 4's last gradient came at or before the resume, at a step no segment passes on: not named
    assert (
        sum(
            "expert 4 of 8 got no gradient from step 16 on (the last before step 16;" in e.detail
            for e in report.experts
        )
        == 2
    )
    assert (
        sum("expert 5 of 8 got no gradient from step 6 on (the last at step 5;" in e.detail for e in report.experts)
        == 2
    )
    back = closed_report(load(str(tmp_path / "run")))  # the merged table is the one written
    assert back is not None and {(e.layer, e.state, e.experts, e.since_step) for e in back.experts} == want


def test_per_expert_modules_idle_across_a_resume_span_the_run(tmp_path: Path) -> None:
    """Per-expert modules (TwoLayerMoE, SGD) checkpointed at step 14 and resumed: in layer 0, expert 5
    routed in neither segment was never routed; 3, routed until step 6, stopped at its own step; 2, routed
    until the checkpoint, stopped at the resume; 4, routed only after it, is no finding. Layer 1's routes
    never change. The steps come from the gradients read here. (The first segment holds 7 routed, then 7
    quiet steps of expert 3: evidence of a stop, chance 1 / C(14, 7); 6 and 6 would not be, 1 / C(12, 6).)"""
    torch.manual_seed(0)
    model = TwoLayerMoE()
    opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    routes = {range(0, 7): [0, 1, 2, 3, 0, 1], range(7, 14): [0, 1, 2, 0, 0, 1], range(14, 28): [0, 1, 4, 0, 4, 1]}
    last: dict[str, int] = {}  # reference: the last step each tensor had a non-zero gradient

    def segment(model: TwoLayerMoE, opt: torch.optim.Optimizer, steps: range) -> gradlog.Report:
        out = gradlog.Output(resume=steps.start > 0)
        gl = gradlog.GradLogger(model, opt, writer=out, log_dir=str(tmp_path), every=1, print_report=False)

        def loss(step: int) -> torch.Tensor:
            model.routes[0] = next(r for s, r in routes.items() if step in s)
            return mse(model, torch.randn(6, 8))

        def record(step: int) -> None:
            for n, p in model.named_parameters():
                if p.grad is not None and bool((p.grad != 0).any()):
                    last[n] = step

        loop(opt, gl, len(steps), loss, after_backward=record, start=steps.start)
        return gl.close()

    segment(model, opt, range(14))
    resumed = TwoLayerMoE()
    opt = checkpointed(model, opt, resumed, tmp_path / "ckpt.pt")
    report = segment(resumed, opt, range(14, 28))

    want = set()
    for i in range(2):  # per layer: experts none of whose tensors had a gradient, or none from some step on
        ends = [
            max((s for n, s in last.items() if n.startswith(f"layers.{i}.experts.{k}.")), default=-1) for k in range(6)
        ]
        want.add((f"layers.{i}.experts", "never", tuple(k for k, s in enumerate(ends) if s < 0), -1))
        want |= {(f"layers.{i}.experts", "stopped", (k,), s + 1) for k, s in enumerate(ends) if 0 <= s < 27}
    assert want == {
        ("layers.0.experts", "never", (5,), -1),
        ("layers.0.experts", "stopped", (3,), 7),
        ("layers.0.experts", "stopped", (2,), 14),  # the resume step
        ("layers.1.experts", "never", (2, 3, 5), -1),
    }
    assert {(e.layer, e.state, e.experts, e.since_step) for e in report.experts} == want
    back = closed_report(load(str(tmp_path)))
    assert back is not None and {(e.layer, e.state, e.experts, e.since_step) for e in back.experts} == want
