"""Alerts that calibrate to the run (issue 28): silence on healthy real runs, the planted outlier named.

Real models from their libraries' configs (tests/calibrated_models.py), each first verified healthy against
an independent reference: the loss falls and every trainable tensor differs from a copy of its initial
weights. Then gradlog must say OK with no warning. A GPT-2 block planted at 30x and at 1e-4x the learning
rate of the rest (its own param group) must be named, and only it.
"""

from __future__ import annotations

import math
import random
import statistics
from typing import Any

import pytest
import torch

import gradlog
from gradlog.verdict.alerts import RATIO_HIGH, RATIO_LOW, Alerts, Entry
from gradlog.verdict.slices import unseen_words

pytest.importorskip("transformers")
import calibrated_models as cm  # tests/ is on sys.path (rootdir conftest)

STEPS, EVERY = 40, 2


def train(t: cm.Trainee, **kw: Any) -> tuple[gradlog.Report, list[float], dict[str, bool]]:
    """Train `t` under a GradLogger; return the report, the losses, and per trainable tensor whether it changed."""
    model = t.model
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    gl = gradlog.GradLogger(model, t.optimizer, writer="memory", every=EVERY, print_report=False, **kw)
    losses = []
    for i in range(STEPS):
        loss = t.loss(i)
        loss.backward()
        t.optimizer.step()
        t.optimizer.zero_grad()
        gl.log(i)
        losses.append(float(loss))
    changed = {n: not torch.equal(p.detach(), initial[n]) for n, p in model.named_parameters() if p.requires_grad}
    return gl.close(), losses, changed


def falls(losses: list[float]) -> bool:
    return sum(losses[-5:]) / 5 < 0.99 * sum(losses[:5]) / 5


@pytest.mark.parametrize("name", list(cm.BUILDERS))
def test_healthy_real_runs_are_ok_with_no_warning(name: str) -> None:
    report, losses, changed = train(cm.BUILDERS[name]())
    assert falls(losses), losses  # healthy by an independent measure first
    assert all(changed.values()), [n for n, c in changed.items() if not c]
    assert report.healthy, report.verdict
    assert report.warnings() == {} and report.severities().get("warning", 0) == 0, report.verdict
    assert [a for a in report.alerts if a.kind in (RATIO_HIGH, RATIO_LOW)] == []
    # what is left is a note: GPT-2's last position, ids no batch held, LoRA's frozen base
    assert set(report.severities()) <= {"note"}, report.severities()
    if name == "gpt2":
        (wpe,) = [p for p in report.partly_updated if p.name == "transformer.wpe.weight"]
        assert wpe.indices == (31,) and "position 31 has no target when labels are the inputs" in wpe.detail
    if name == "mixtral":  # untied: the input rows of ids 100..127 (never in the data) never update
        (emb,) = [p for p in report.partly_updated if p.name == "model.embed_tokens.weight"]
        assert emb.indices == tuple(range(100, 128)) and "ids 100, 101, 102, 103, 104, ... (28 of 128)" in emb.detail


@pytest.mark.parametrize("factor", [30.0, 1e-4])
def test_a_block_planted_at_another_lr_is_named_and_only_it(factor: float) -> None:
    t = cm.gpt2(planted=factor, block=1)
    block = dict(t.model.transformer.h[1].named_parameters(prefix="transformer.h.1"))
    with_scale = {n for n, p in block.items() if bool(p.detach().ne(0).any())}  # zero-initialised biases have none
    report, _, _ = train(t)
    kind = RATIO_HIGH if factor > 1 else RATIO_LOW
    named = {a.name for a in report.alerts if a.kind in (RATIO_HIGH, RATIO_LOW)}
    assert named <= set(block), named - set(block)  # nothing outside the planted block
    weights = {n for n in with_scale if n.endswith(".weight")}
    assert weights <= named, weights - named  # every weight of it with a scale of its own
    assert {a.kind for a in report.alerts if a.name in named} == {kind}
    assert report.warnings() == {kind: len(named)}  # a warning, not a problem
    # the lr, not the weights' scale: the update per entry is out too, so no "initialisation" is suggested
    assert not any("weights' scale" in a.detail for a in report.alerts if a.name in named)
    # at 1e-4x some LayerNorm updates (1e-7 on |w| = 1) round away in fp32: true, and only in that block
    records = [r.name for r in [*report.never_updated, *report.partly_updated, *report.stalled]]
    assert set(records) <= set(block) | {"transformer.wpe.weight"}, records


def test_embeddings_at_torch_default_scale_are_named_with_their_scale_not_an_lr() -> None:
    """GPT-2 with its position embedding re-initialised as nn.Embedding does it, N(0, 1) (~50x GPT-2's 0.02):
    Adam moves it by ~lr per entry like every tensor, so its ratio sits far below its peers' and is named; the
    alert says the scale sets it apart (its values' RMS, measured here by hand), not its lr."""
    t = cm.gpt2()
    wpe = t.model.transformer.wpe.weight
    with torch.no_grad():
        wpe.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(2))
    rms = float(wpe.detach().pow(2).mean().sqrt())
    report, _, _ = train(t)
    (alert,) = [a for a in report.alerts if a.kind == RATIO_LOW]
    assert alert.name == "transformer.wpe.weight"
    assert "the weights' scale sets it apart, not the lr" in alert.detail
    said = float(alert.detail.split("its values' RMS ")[1].split(" ")[0])
    assert math.isclose(said, rms, rel_tol=0.05)  # the RMS of the values then, by hand from the init


# --- the rule itself, on hand-made ratios (fast) ---------------------------------------------------------
def entries(ratios: dict[str, float], vector: bool = False) -> list[Entry]:
    return [Entry(key=n, name=n, grad_norm=1.0, ratio=r, zero_start=False, vector=vector) for n, r in ratios.items()]


def test_calibrated_rule_follows_the_run_not_a_band() -> None:
    rng = random.Random(0)
    judge = Alerts(emit=False)
    for step in range(10):
        scale = 3e-2 / (1 + step)  # a decaying lr moves every tensor together: no outlier
        ratios = {f"m{i}.weight": scale * 10 ** rng.uniform(-0.3, 0.3) for i in range(12)}
        judge.step(step, entries(ratios))
    assert judge.fired == []  # 3e-2 .. 3e-3: far outside the old fixed band, normal for this run
    banded = Alerts(ratio_band=(1e-4, 1e-2), emit=False)
    for step in range(4):
        banded.step(step, entries({f"m{i}.weight": 3e-2 for i in range(12)}))
    assert {a.kind for a in banded.fired} == {RATIO_HIGH}  # the band is still there, as an option


@pytest.mark.parametrize(("factor", "kind"), [(30.0, RATIO_HIGH), (1e-4, RATIO_LOW)])
def test_calibrated_rule_names_the_outlier_after_patience(factor: float, kind: str) -> None:
    rng = random.Random(1)
    judge = Alerts(emit=False)
    for step in range(5):
        ratios = {f"m{i}.weight": 1e-3 * 10 ** rng.uniform(-0.25, 0.25) for i in range(10)}
        ratios["odd.weight"] = 1e-3 * factor
        got = judge.step(step, entries(ratios))
        assert (got != []) is (step == 2)  # 3 measured steps in a row (ratio_patience)
    assert [(a.name, a.kind) for a in judge.fired] == [("odd.weight", kind)]
    a = judge.fired[0]
    assert a.reference is not None and math.isclose(math.log10(a.value / a.reference), math.log10(factor), abs_tol=0.3)


def test_roles_are_judged_apart_and_small_roles_not_at_all() -> None:
    judge = Alerts(emit=False)
    for step in range(4):
        judge.step(step, entries({f"m{i}.weight": 1e-3 for i in range(6)}) + entries({"ln.weight": 0.5}, True))
    assert judge.fired == []  # one 1-D tensor: no peers to be an outlier among
    with pytest.raises(ValueError, match="ratio_decades must be a number > 0"):
        Alerts(ratio_decades=0)
    with pytest.raises(ValueError, match="ratio_min_peers must be an integer >= 3"):
        Alerts(ratio_min_peers=1)


def test_words_for_the_common_notes() -> None:
    assert unseen_words("transformer.wpe.weight", [63], 64).startswith("position 63 has no target when labels")
    assert unseen_words("bert.embeddings.position_embeddings.weight", range(40, 64), 64).startswith(
        "positions 40-63 (24 of 64): no batch reached past position 39"
    )
    assert unseen_words("model.embed_tokens.weight", [3, 9, 17, 20, 21, 22, 40], 32000) == (
        "ids 3, 9, 17, 20, 21, ... (7 of 32,000) were in no measured batch"
    )
    # rows in the middle of a position table are ids-like, not "past the longest sequence"
    assert unseen_words("transformer.wpe.weight", [5, 6], 64).startswith("ids 5, 6 (2 of 64)")


def test_lora_under_a_warmup_from_lr_0_has_no_spike() -> None:
    """The Trainer's schedules warm up from lr 0, measured every step: LoRA's `A` has a zero gradient until
    its zero-initialised `B` moves, then a norm growing like t². Padded with those zeros, its history's
    median was 1/12 of step 5's norm: a "spike" on a healthy run. Zero norms are no scale."""
    t = cm.lora()
    # as transformers.get_linear_schedule_with_warmup (20 steps) does
    sched = torch.optim.lr_scheduler.LambdaLR(t.optimizer, lambda i: min(1.0, i / 20))
    a_names = [n for n, p in t.model.named_parameters() if "lora_A" in n]
    norms: dict[str, list[float]] = {n: [] for n in a_names}
    params = dict(t.model.named_parameters())
    gl = gradlog.GradLogger(t.model, t.optimizer, writer="memory", every=1, print_report=False)
    for i in range(12):
        t.loss(i).backward()
        for n in a_names:
            grad = params[n].grad
            norms[n].append(0.0 if grad is None else float(grad.norm()))
        t.optimizer.step()
        sched.step()
        t.optimizer.zero_grad()
        gl.log(i)
    report = gl.close()
    # the case by hand: zero at steps 0 and 1, then a rise the zeros made look like a spike
    assert all(v[0] == 0.0 and v[1] == 0.0 and v[2] > 0 for v in norms.values())
    padded = [n for n, v in norms.items() if any(v[k] > 10 * statistics.median(v[k - 5 : k]) for k in range(5, 12))]
    assert padded, {n: v[:7] for n, v in norms.items()}
    assert [a for a in report.alerts if a.kind == "grad_norm_spike"] == [], report.alerts
    assert report.healthy and report.warnings() == {}, report.verdict


def test_a_spike_after_zero_norms_is_still_one() -> None:
    """Zeros are left out of the history, not the judgement: a tensor unreached for a while (an expert no token
    chose) that then jumps 50x above its non-zero norms is still named, at that step."""
    judge = Alerts(emit=False)
    series = [0.0, 0.0, 1.0, 0.0, 1.2, 0.9, 0.0, 1.1, 1.0, 0.0, 50.0]
    for step, g in enumerate(series):
        judge.step(step, [Entry(key="e", name="experts.3.w1", grad_norm=g)])
    assert [(a.step, a.kind) for a in judge.fired] == [(10, "grad_norm_spike")]
    assert judge.fired[0].reference == 1.0  # median of 1.0, 1.2, 0.9, 1.1, 1.0: the zeros are not in it
