"""Updates rounded away in part: a pure-bf16 GPT-2 at lr 1e-5 against its fp32 twin.

The expected shares come from copies of the weights the test takes before and after every step and the
gradients it reads itself (elements with a non-zero gradient whose value did not change), never from gradlog.
"""

from __future__ import annotations

from pathlib import Path

import catalogue
import pytest
import torch
from catalogue import lm_loss, tiny_gpt2

import gradlog
from gradlog.runformat.tags import tag

transformers = pytest.importorskip("transformers")


def train(
    dtype: torch.dtype, steps: int = 12, every: int = 1
) -> tuple[gradlog.Report, gradlog.MemoryWriter, dict[str, list[float]]]:
    model = tiny_gpt2(dtype)
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=every, print_report=False)
    gen = torch.Generator().manual_seed(0)
    ref: dict[str, list[float]] = {n: [] for n in params}  # per measured step: the share, by hand
    before: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}

    def copy_weights_and_grads(step: int) -> None:
        before.update({n: p.detach().clone() for n, p in params.items()})
        grads.update({n: p.grad.clone() for n, p in params.items() if p.grad is not None})

    def share_kept(step: int) -> None:
        if step % every == 0:
            for n, p in params.items():
                graded = grads[n] != 0
                kept = (p.detach() == before[n]) & graded
                ref[n].append(kept.sum().item() / max(1, int(graded.sum())))  # of the elements with a gradient

    report = catalogue.train(
        opt, gl, steps, lambda step: lm_loss(model, gen), copy_weights_and_grads, after_step=share_kept
    )
    return report, mem, ref


def series(mem: gradlog.MemoryWriter, name: str) -> list[float]:
    return [v for _, v in mem.scalars.get(tag("frozen_frac", name), [])]


@pytest.mark.parametrize("every", [1, 3])
def test_bf16_gpt2_reports_the_share_of_updates_rounded_away_and_its_fp32_twin_does_not(every: int) -> None:
    report, mem, ref = train(torch.bfloat16, every=every)
    never = {r.name for r in report.never_updated}
    assert never == {n for n, shares in ref.items() if min(shares) == 1.0}  # the LayerNorm weights, whole
    found = {r.name: r for r in report.precision}
    for name, shares in ref.items():
        assert series(mem, name) == pytest.approx([s for s in shares if s]), name  # each measured step's share
        mean = sum(shares) / len(shares)
        if name in never:
            assert name not in found  # never_updated says it (below_precision): not repeated
        elif mean >= 0.25:
            rec = found[name]
            assert abs(rec.mean_frac - mean) < 0.10 and rec.max_frac == pytest.approx(max(shares))
            assert "fp32 master weights" in rec.detail and "stochastic rounding" in rec.detail
        else:
            assert name not in found
    assert len(found) >= 10  # the weight matrices and embeddings: 65-96% of their updates round away
    assert not report.healthy and "updates partly rounded away" in report.verdict

    twin, twin_mem, twin_ref = train(torch.float32, every=every)
    assert twin.precision == [] and twin.never_updated == []
    for name, shares in twin_ref.items():
        assert series(twin_mem, name) == []  # fp32 is not counted (its LayerNorm weights lose up to 2% a step)
        assert sum(shares) / len(shares) < 0.05


def test_precision_table_reads_back(tmp_path: Path) -> None:
    from gradlog.readers.run import closed_report, load

    model = tiny_gpt2(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    log_dir = str(tmp_path / "tb")
    gl = gradlog.GradLogger(model, opt, every=1, print_report=False, log_dir=log_dir)
    gen = torch.Generator().manual_seed(0)
    report = catalogue.train(opt, gl, 5, lambda step: lm_loss(model, gen))
    back = closed_report(load(log_dir))
    assert back is not None and report.precision
    assert [(r.name, r.dtype, r.steps) for r in back.precision] == [
        (r.name, r.dtype, r.steps) for r in report.precision
    ]
    assert all(abs(a.mean_frac - b.mean_frac) < 1e-3 for a, b in zip(back.precision, report.precision))


LOW_FLOATS = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz]


@pytest.mark.parametrize("dtype", LOW_FLOATS)
def test_host_count_equals_the_count_by_hand_on_signed_zeros_and_nan(dtype: torch.dtype) -> None:
    """The CPU count on the values' bits against the count by hand (float32 compares): signed zeros in the
    difference and the gradient, NaN, several blocks and a ragged end; a strided gradient, a negated view, and
    a gradient of another dtype than the weights; the 8-bit floats (e4m3fnuz has no -0.0: its 0x80 is NaN)."""
    from gradlog.measure.meter import _host_frozen

    gen = torch.Generator().manual_seed(0)
    n = 100_003  # several blocks and a ragged end
    d = torch.randn(n, generator=gen)
    d[torch.rand(n, generator=gen) < 0.7] = 0.0
    d[torch.rand(n, generator=gen) < 0.1] = -0.0  # before -0.0, after +0.0: the value kept
    g = torch.randn(n, generator=gen)
    g[torch.rand(n, generator=gen) < 0.2] = 0.0
    g[torch.rand(n, generator=gen) < 0.1] = -0.0
    g[:50] = float("nan")
    d, low = d.to(dtype), g.to(dtype)

    def by_hand(g: torch.Tensor) -> list[int]:
        graded = g.float() != 0
        return [int(((d.float() == 0) & graded).sum()), int(graded.sum())]

    assert by_hand(low)[0] > 1000 and by_hand(low)[1] > 1000
    assert _host_frozen(d, low).tolist() == by_hand(low)
    wide = torch.stack([g, g], 1)[:, 0]  # a float32 gradient, strided
    assert not wide.is_contiguous() and _host_frozen(d, wide).tolist() == by_hand(wide)
    assert _host_frozen(d, g.neg()._neg_view()).tolist() == by_hand(g)


class HalfSeenPositions(torch.nn.Module):
    """A bf16 position table of 64 positions whose batches are 32 long (rows 32-63 never get a gradient),
    read out linearly, so each reached element's gradient keeps its size from step to step."""

    def __init__(self) -> None:
        super().__init__()
        self.wpe = torch.nn.Embedding(64, 16, dtype=torch.bfloat16)
        self.readout = torch.nn.Parameter(torch.randn(16, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.wpe(torch.arange(x.shape[1])) * x.unsqueeze(-1)) @ self.readout


def test_rounded_away_share_counts_only_the_elements_that_had_a_gradient() -> None:
    """Issue 41: a half-unseen bf16 position table's share was taken of all its elements, so its unseen
    half (no gradient, nothing to round away) diluted it below the finding's threshold."""
    torch.manual_seed(0)
    model = HalfSeenPositions()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=1, print_report=False)
    gen = torch.Generator().manual_seed(1)
    w = model.wpe.weight
    before: list[torch.Tensor] = []
    masks: list[torch.Tensor] = []
    shares: list[float] = []  # by hand: kept / had a gradient
    diluted: list[float] = []  # what the old share was: kept / all elements

    def copy(step: int) -> None:
        before.append(w.detach().clone())
        masks.append(w.grad != 0)

    def share(step: int) -> None:
        kept = (w.detach() == before[-1]) & masks[-1]
        shares.append(int(kept.sum()) / int(masks[-1].sum()))
        diluted.append(int(kept.sum()) / w.numel())

    def loss(step: int) -> torch.Tensor:
        x = torch.randn(8, 32, generator=gen).to(torch.bfloat16)
        return model(x).float().mean()

    report = catalogue.train(opt, gl, 8, loss, copy, after_step=share)
    assert all(int(m[32:].sum()) == 0 for m in masks) and all(bool(m[:32].all()) for m in masks)
    assert series(mem, "wpe.weight") == pytest.approx([s for s in shares if s])
    mean = sum(shares) / len(shares)
    assert mean >= 0.25 > sum(diluted) / len(diluted)  # the old share stayed under the threshold
    rec = {r.name: r for r in report.precision}["wpe.weight"]
    assert rec.mean_frac == pytest.approx(mean) and rec.max_frac == pytest.approx(max(shares))
    assert "of its elements with a non-zero gradient" in rec.detail


def test_updates_that_shrink_below_bf16_as_a_run_converges_are_a_note_not_a_problem() -> None:
    """Pure bf16 weights at Adam's lr 1e-3 fitting a linear map: their updates register while they learn, and
    round away once Adam's steps shrink near the fit (the calibration zoo's Lightning bf16-true run, smaller).
    The shares by hand decide: rounded away from the first measured steps is a problem, only later a note."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).to(torch.bfloat16)
    target = torch.randn(8, 4, dtype=torch.bfloat16)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gl = gradlog.GradLogger(model, opt, writer=gradlog.MemoryWriter(), every=5, print_report=False)
    params = dict(model.named_parameters())
    shares: dict[str, list[float]] = {n: [] for n in params}
    losses = []
    for step in range(300):
        x = torch.randn(64, 8, dtype=torch.bfloat16)
        loss = (model(x) - x @ target).float().pow(2).mean()
        loss.backward()
        before = {n: p.detach().clone() for n, p in params.items()}
        graded = {n: p.grad != 0 for n, p in params.items() if p.grad is not None}
        opt.step()
        if step % 5 == 0:
            for n, p in params.items():
                kept = (p.detach() == before[n]) & graded[n]
                shares[n].append(kept.sum().item() / max(1, int(graded[n].sum())))
        opt.zero_grad()
        gl.log(step)
        losses.append(loss.item())
    report = gl.close()
    assert sum(losses[-20:]) / 20 < 0.2 * sum(losses[:20]) / 20  # it learned
    found = {r.name: r for r in report.precision}
    assert found, "some tensor lost a share of its updates late in the run"
    for name, rec in found.items():
        first = shares[name][: min(3, max(1, len(shares[name]) // 4))]
        early, mean = sum(first) / len(first), sum(shares[name]) / len(shares[name])
        assert rec.early_frac == pytest.approx(early, abs=0.02) and rec.mean_frac == pytest.approx(mean, abs=0.02)
        late = early < 0.25 or early < mean / 2
        assert rec.policy_kind() == ("precision.rounded_late" if late else "precision.rounded_away"), name
        assert ("registered while it learned" in rec.detail) is late
    assert all(r.policy_kind() == "precision.rounded_late" for r in found.values()), found
    assert report.healthy, report.verdict
