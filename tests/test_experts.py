"""Experts named as experts: fused 3-D expert tensors (transformers' Mixtral) and per-expert modules.

The expected experts come from the gradients the test reads itself at every step (which experts' slices of
the expert tensors were ever non-zero), never from gradlog.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from catalogue import ConvExperts, TwoLayerMoE, lm_loss, mse, random_mse, tiny_mixtral, train
from torch import nn

import gradlog
from gradlog import Reason
from gradlog.verdict.experts import expert_layout, is_fused_experts

transformers = pytest.importorskip("transformers")


def mask_router(model: nn.Module, masked: list[int], active: Callable[[], bool]) -> list[Any]:
    """A forward hook on every router that sets the logits of `masked` experts to -inf while `active()`:
    those experts get no token, and the router's rows for them no gradient."""

    def hook(mod: nn.Module, args: Any, out: Any) -> Any:
        if not active():
            return None
        logits = out[0]
        mask = torch.zeros(logits.shape[-1], dtype=torch.bool)
        mask[masked] = True
        logits = logits.masked_fill(mask, float("-inf"))
        probs = torch.softmax(logits.float(), dim=-1)
        top, idx = torch.topk(probs, mod.top_k, dim=-1)
        return logits, top / top.sum(-1, keepdim=True), idx

    return [m.register_forward_hook(hook) for n, m in model.named_modules() if n.endswith("mlp.gate")]


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
    assert not is_fused_experts(model.experts, "experts.weight", model.experts.weight)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gl = gradlog.GradLogger(model, opt, writer=gradlog.MemoryWriter(), print_report=False, every=1)
    report = train(opt, gl, 3, random_mse(model, 2, 4, 9))
    assert report.experts == []
    rows = [r for r in report.partly_updated if r.name == "experts.weight" and r.dim == 0]
    assert len(rows) == 1 and rows[0].indices == (4, 5) and rows[0].reason is Reason.ZERO_GRAD
    assert "filters 4-5" in rows[0].detail and "expert" not in rows[0].detail.split(";")[0]
    assert expert_layout(model, gl.pipeline.table.live) == {}


@pytest.mark.parametrize("every", [1, 3])
def test_mixtral_router_collapse_at_step_k_reports_experts_stopped_from_k(every: int) -> None:
    k, steps = 9, 27
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
