"""Alerts that know the math: a gradient that is rounding noise by construction (an attention key bias, to which
softmax is invariant) is judged by neither the update-ratio rule nor the spike rule, and a gradient-norm spike is
a jump that comes back, judged a few measured steps later: a lasting level change is none."""

from __future__ import annotations

import catalogue
import pytest
import torch

import gradlog
from gradlog.verdict.alerts import NOISE_FRACTION, SPIKE, SPIKE_CONFIRM, Alerts, Entry


def test_attention_key_biases_whose_gradient_is_noise_get_no_update_ratio_warning() -> None:
    """Four blocks of diffusers' own Attention with biases (as its UNets build them), AdamW: the old rule named
    every to_k.bias update_ratio_low (4 warnings, like a UNet's on every run). The premise by hand: each key
    bias's gradient norm is below NOISE_FRACTION of the median tensor's at every step, while the loss falls."""
    pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = catalogue.KeyBiasAttention()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gl = gradlog.GradLogger(model, opt, writer="memory", every=1, print_report=False)
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(16, generator=gen)
    losses: list[float] = []
    noise_share: list[float] = []

    def loss(step: int) -> torch.Tensor:
        x = torch.randn(8, 6, 16, generator=gen)
        out = (model(x) - (x @ target).tanh()).pow(2).mean()
        losses.append(float(out.detach()))
        return out

    def after_backward(step: int) -> None:
        norms = {n: float(p.grad.norm()) for n, p in model.named_parameters() if p.grad is not None}
        keys = [v for n, v in norms.items() if n.endswith("to_k.bias")]
        noise_share.append(max(keys) / sorted(norms.values())[len(norms) // 2])

    catalogue.train(opt, gl, 40, loss, after_backward=after_backward)
    report = gl.close()
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5])  # it learns
    assert len(noise_share) == 40 and max(noise_share) < NOISE_FRACTION, max(noise_share)
    assert report.alerts == [], [(a.kind, a.name) for a in report.alerts]
    assert report.healthy and report.warnings() == {}, report.verdict


def _replay(series: dict[str, list[float]]) -> list[tuple[int, str]]:
    judge = Alerts(emit=False)
    for step in range(len(next(iter(series.values())))):
        judge.step(step, [Entry(key=n, name=n, grad_norm=v[step]) for n, v in series.items()])
    judge.finish()
    return [(a.step, a.name) for a in judge.fired if a.kind == SPIKE]


def _peers(n: int) -> dict[str, list[float]]:
    """Six ordinary tensors whose norms wander by a few percent around 1e-2."""
    gen = torch.Generator().manual_seed(1)
    return {f"blocks.{k}.weight": (1e-2 * (1 + 0.05 * torch.randn(n, generator=gen))).tolist() for k in range(6)}


def test_a_key_bias_whose_noise_norm_jumps_130x_is_no_spike() -> None:
    """The issue's key bias: gradient norm ~1e-11, then 1.3e-9 ("130x its previous one") beside tensors at 1e-2.
    Rounding noise jumps like that; the old rule warned."""
    n = 20
    key = [1e-11 * (1 + 0.1 * (k % 3)) for k in range(n)]
    key[12] = 130 * key[11]
    series = {**_peers(n), "attn.to_k.bias": key}
    assert key[12] < NOISE_FRACTION * 1e-2
    assert _replay(series) == []
    # the same jump on a tensor with a real gradient is a spike, named at its step
    real = [1e-3 * (1 + 0.1 * (k % 3)) for k in range(n)]
    real[12] = 130 * real[11]
    assert _replay({**_peers(n), "attn.to_q.bias": real}) == [(12, "attn.to_q.bias")]


def _plateau_exit(n: int = 24, at: int = 10, rise: float = 12.0) -> dict[str, list[float]]:
    """Attention gradient norms of a masked LM leaving its loss plateau: flat (a few % noise), then `rise` x
    higher from step `at` on, and staying there."""
    gen = torch.Generator().manual_seed(2)
    out = {}
    for name in ("q.weight", "k.weight", "v.weight", "o.weight", "k.bias"):
        base = 1e-3 * (1 + 0.05 * torch.randn(n, generator=gen))
        out[f"layer.0.attention.{name}"] = [float(v) * (rise if k >= at else 1.0) for k, v in enumerate(base)]
    return out


def test_a_lasting_level_change_is_no_spike_but_a_jump_that_comes_back_is() -> None:
    exit_ = _plateau_exit()
    assert _replay(exit_) == []  # the old rule: 5 warnings at step 10
    # the same tensors with a one-step 50x jump that comes back: named at its own step, once it came back
    jump = {n: [v * (50.0 if k == 10 else 1.0) for k, v in enumerate(s[:10] + s[:10])] for n, s in exit_.items()}
    assert sorted(_replay(jump)) == sorted((10, n) for n in jump)
    judge = Alerts(emit=False)
    for step in range(12):
        judge.step(step, [Entry(key=n, name=n, grad_norm=v[step]) for n, v in jump.items()])
    (first, *_) = [a for a in judge.fired if a.kind == SPIKE]  # confirmed at step 11, the next measured one
    assert first.step == 10 and "back to" in first.detail and "at step 11 (1 measured step later)" in first.detail
    # a jump at the run's last measured step: nothing after it tells it from a real spike's start: named
    ends = {n: [*s[:10], s[9] * 50.0] for n, s in exit_.items()}
    assert sorted(_replay(ends)) == sorted((10, n) for n in ends)


def test_a_jump_is_judged_on_the_next_measured_steps_before_it_is_dropped() -> None:
    """Up 20x and still up at each of the next SPIKE_CONFIRM measured steps: a level, not a spike, and nothing is
    said; falling back by most of the way over them: a spike, named at its step."""
    flat = [1.0, 1.05, 0.95, 1.0, 1.02, 0.98, 1.0]
    stays = [*flat, 20.0, *[19.0, 21.0, 20.0][:SPIKE_CONFIRM], 20.5]
    assert _replay({"w": stays}) == []
    falls = [*flat, 40.0, 24.0, 10.0, 8.0, 7.0]  # 40x: a lone tensor's jump is news from 30x (LONE_SPIKE_FACTOR)
    assert _replay({"w": falls}) == [(7, "w")]


def _converging(steps: int, outlier: float | None) -> Alerts:
    """Six LayerNorm gains at Adam's update size lr=1e-3 for 10 measured steps, then five of them converge (their
    updates shrink 30% a step to ~3e-5) while the sixth keeps carrying the loss's gradient at 6e-4 (what the
    DeBERTa classifier of tests/zoo.py shows); `outlier`: a seventh gain at that update size from the start."""
    judge = Alerts(emit=False)
    for step in range(steps):
        fading = 1e-3 * 0.7 ** max(0, step - 10)
        sizes = {f"ln{k}.weight": fading for k in range(5)} | {"ln5.weight": 6e-4 if step >= 10 else 1e-3}
        if outlier is not None:
            sizes["hot.weight"] = outlier
        judge.step(
            step,
            [
                Entry(key=n, name=n, grad_norm=1e-2, ratio=s, zero_start=False, vector=True, rms_update=s)
                for n, s in sizes.items()
            ],
        )
    return judge


def test_a_tensor_still_learning_while_its_peers_converge_is_not_update_ratio_high() -> None:
    # its update (6e-4, under the lr) is 20x its converged peers' median: a warning on the old rule
    assert [a for a in _converging(30, None).fired if a.kind == "update_ratio_high"] == []
    # a tensor at 30x its peers' update size from its first step is still named, against the level they held
    named = [(a.name, a.step) for a in _converging(30, 3e-2).fired if a.kind == "update_ratio_high"]
    assert named == [("hot.weight", 2)]
