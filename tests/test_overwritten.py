"""Weights set back outside the optimizer (issue 39): the optimizer updates them at every step, something
after the step puts the old values back, and the weight never learns although every measured update was
non-zero. Each planted bug's reference is a copy of the initial weights (or of the values the reset
holds), compared with the values before every step by the test itself; each healthy twin changes its
weights outside the optimizer too, but never back to where they were.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import setback_child
import torch
from catalogue import TwoLayer, lm_loss, planted_site, random_mse, tiny_gpt2
from torch import nn

import gradlog
from gradlog.verdict.report import Reason, Report

STEPS = 10
HERE = Path(__file__).parent


def run(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    loss: Callable[[int], torch.Tensor],
    after_step: Callable[[int], None] | None = None,
    every: int = 1,
    steps: int = STEPS,
    before_step: Callable[[int], None] | None = None,
) -> tuple[Report, dict[str, list[bool]]]:
    """The run, and per tensor and step whether its values before that step equal the ones before the
    previous step (by hand, from copies)."""
    params = dict(model.named_parameters())
    last: dict[str, torch.Tensor] = {}
    same: dict[str, list[bool]] = {n: [] for n in params}

    def copy(step: int) -> None:
        for n, p in params.items():
            if n in last:
                same[n].append(torch.equal(last[n], p.detach()))
            last[n] = p.detach().clone()

    def at_start(step: int) -> None:
        if before_step is not None:
            before_step(step)

    gl = gradlog.GradLogger(model, opt, writer="memory", every=every, print_report=False)
    for step in range(steps):
        at_start(step)
        loss(step).backward()
        copy(step)
        opt.step()
        if after_step is not None:
            after_step(step)
        gl.log(step)
        opt.zero_grad()
    return gl.close(), same


def never(report: Report) -> dict[str, tuple[Reason, str]]:
    return {r.name: (r.reason, r.detail) for r in report.never_updated}


def mlp() -> tuple[TwoLayer, torch.optim.Optimizer, Callable[[int], torch.Tensor]]:
    torch.manual_seed(0)
    model = TwoLayer(torch.tanh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2), random_mse(model, 16, 6)


@pytest.mark.parametrize("premasked", [True, False])
def test_a_pruning_mask_applied_to_the_saved_initial_weights_is_overwritten(premasked: bool) -> None:
    model, opt, loss = mlp()
    w = model.a.weight
    mask = (torch.rand(w.shape, generator=torch.Generator().manual_seed(1)) > 0.5).float()
    if premasked:  # pruned once before training, then the bug: the saved weights masked again after each step
        w.data = w.data * mask
    w0 = w.detach().clone()
    start = w.detach().clone()

    def reset(step: int) -> None:
        w.data = w0 * mask  # planted: mask

    report, same = run(model, opt, loss, reset)
    got = never(report)
    reason, detail = got["a.weight"]
    assert reason is Reason.OVERWRITTEN
    # the planted line, read from the report's text (the console wraps details: joined back with spaces)
    text = " ".join(str(report).split())
    site = planted_site(test_a_pruning_mask_applied_to_the_saved_initial_weights_is_overwritten, "mask")
    assert f"{site} (`w.data = w0 * mask`)" in text and "set back outside the optimizer at " in text, text
    assert "fix: change that write so it keeps the optimizer's updates" in text
    assert not torch.overrides._get_current_function_mode_stack()  # the write watch left nothing pushed
    if premasked:
        assert torch.equal(w.detach(), start)  # the reference: bit-identical to its start
        assert "back where they started" in detail and "between steps 0 and 1" in detail
    else:
        assert not torch.equal(w.detach(), start) and all(same["a.weight"][1:])
        assert "between steps 1 and 2" in detail
    assert "updated by the optimizer at 10 of 10 measured steps" in detail and "w0 * mask" in detail
    assert set(got) == {"a.weight"}  # every other tensor learned
    assert not report.healthy and "overwritten" in report.verdict


def test_gpt2_layer_set_back_every_step_is_named_with_the_step() -> None:
    """A real transformers GPT-2: one block's MLP weight set back to a copy of its initial values after
    every step; gradlog names that tensor alone, overwritten, and the steps."""
    model = tiny_gpt2()
    gen = torch.Generator().manual_seed(0)
    target = model.transformer.h[1].mlp.c_fc.weight
    init = target.detach().clone()

    def reset(step: int) -> None:
        with torch.no_grad():
            target.copy_(init)  # planted: gpt2

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    report, _ = run(model, opt, lambda step: lm_loss(model, gen), reset, steps=6)
    assert torch.equal(target.detach(), init)
    got = never(report)
    assert set(got) == {"transformer.h.1.mlp.c_fc.weight"}
    reason, detail = got["transformer.h.1.mlp.c_fc.weight"]
    assert reason is Reason.OVERWRITTEN and "between steps 0 and 1" in detail
    text = " ".join(str(report).split())
    assert "transformer.h.1.mlp.c_fc.weight" in text and "overwritten" in text
    site = planted_site(test_gpt2_layer_set_back_every_step_is_named_with_the_step, "gpt2")
    assert f"{site} (`target.copy_(init)`)" in text


@pytest.mark.parametrize("saved_at", [0, 4])
def test_a_checkpoint_reloaded_before_every_step(saved_at: int) -> None:
    """load_state_dict of an old checkpoint at the top of the loop: the values before every step are the
    checkpoint's (the final values differ from it by the last step's update). Saved before step 0: never
    updated; saved before step 4: it learned until then, and stalled from step 5, the first that found the
    values put back."""
    model, opt, loss = mlp()
    saved: dict[str, torch.Tensor] = {}

    def reload(step: int) -> None:
        if step == saved_at:
            saved.update({k: v.clone() for k, v in model.b.state_dict().items()})
        if step > saved_at:
            model.b.load_state_dict(saved)  # planted: reload

    report, same = run(model, opt, loss, before_step=reload)
    # the reference, by hand: the values before step k+1 equal those before step k from `saved_at` on
    assert all(same["b.weight"][saved_at:]) and not any(same["b.weight"][:saved_at]) and not any(same["a.weight"])
    if saved_at == 0:
        got = never(report)
        assert set(got) == {"b.weight", "b.bias"}
        assert all(reason is Reason.OVERWRITTEN and "between steps 0 and 1" in d for reason, d in got.values())
        site = planted_site(test_a_checkpoint_reloaded_before_every_step, "reload")
        assert all(f"{site} (`model.b.load_state_dict(saved)`)" in d for _, d in got.values())
    else:
        assert report.never_updated == []
        stalled = {s.name: s for s in report.stalled}
        assert set(stalled) == {"b.weight", "b.bias"}
        s = stalled["b.weight"]
        assert s.reason is Reason.OVERWRITTEN and (s.last_update_step, s.since_step) == (4, 5)
        assert "between steps 4 and 5" in s.detail and "those before step 4: it learned until then" in s.detail


def test_set_back_measured_every_third_step() -> None:
    model, opt, loss = mlp()
    init = model.a.bias.detach().clone()

    def reset(step: int) -> None:
        model.a.bias.data.copy_(init)

    report, _ = run(model, opt, loss, reset, every=3, steps=12)
    reason, detail = never(report)["a.bias"]
    assert reason is Reason.OVERWRITTEN and "between steps 0 and 3" in detail and "at 4 of 4 measured" in detail


# --- healthy twins: weights changed outside the optimizer, never back ------------------------------------------
def test_torch_prune_stays_quiet_weight_orig_learns() -> None:
    """torch.nn.utils.prune: the parameter is `weight_orig` (it learns: its unmasked entries move); the
    effective `weight` is weight_orig * weight_mask, recomputed in forward, not a parameter. Pruned entries
    of weight_orig get an exactly-zero gradient by design. gradlog says OK: no row of `a.weight_orig` is
    fully pruned at 50% unstructured sparsity, so every row and column changed."""
    from torch.nn.utils import prune

    model, _, loss = mlp()
    prune.l1_unstructured(model.a, "weight", amount=0.5)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    start = model.a.weight_orig.detach().clone()
    report, _ = run(model, opt, loss)
    mask = model.a.weight_mask.bool()
    moved = model.a.weight_orig.detach() != start
    assert bool(moved[mask].all()) and not bool(moved[~mask].any())  # the reference: kept entries learned
    assert bool((model.a.weight.detach()[~mask] == 0).all())
    assert report.never_updated == [] and report.stalled == [] and report.partly_updated == []
    assert report.healthy, report.verdict


def test_torch_structured_prune_is_a_note_naming_the_pruned_rows() -> None:
    """Structured pruning (whole rows of `a.weight_orig`): the pruned rows get no gradient and never
    change, by design. They are a note (`partly.pruned`, intentional), not dead units; the verdict is OK."""
    from torch.nn.utils import prune

    model, _, loss = mlp()
    prune.ln_structured(model.a, "weight", amount=0.25, n=1, dim=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    start = model.a.weight_orig.detach().clone()
    report, _ = run(model, opt, loss)
    pruned_rows = (model.a.weight_mask == 0).all(dim=1).nonzero().flatten().tolist()
    unchanged_rows = (model.a.weight_orig.detach() == start).all(dim=1).nonzero().flatten().tolist()
    assert len(pruned_rows) == 2 and unchanged_rows == pruned_rows  # the reference, from copies and the mask
    [rec] = report.partly_updated
    assert (rec.name, rec.dim, list(rec.indices), rec.reason) == ("a.weight_orig", 0, pruned_rows, Reason.PRUNED)
    assert rec.intentional and "a.weight_mask is zero there" in rec.detail
    assert report.healthy and "gradlog OK" in report.verdict and "1 note" in report.verdict


def test_weight_clipping_max_norm_ema_and_tying_stay_quiet() -> None:
    """WGAN's clamp after each step, a max-norm renormalisation of each row after each step (the norm is
    the same before every step, the values are not), an EMA copy updated outside the optimizer (its
    tensors are in no param group), and tied weights (GPT-2's wte and lm_head)."""
    model, opt, loss = mlp()
    ema = nn.Linear(6, 8)
    for p in ema.parameters():
        p.requires_grad_(False)

    def outside(step: int) -> None:
        with torch.no_grad():
            model.a.weight.clamp_(-0.3, 0.3)  # WGAN-style: some entries pinned, the others move
            w = model.b.weight
            w.mul_(1.0 / w.norm(dim=1, keepdim=True))  # every row renormalised to unit norm
            for e, p in zip(ema.parameters(), model.a.parameters()):
                e.mul_(0.9).add_(p, alpha=0.1)

    report, same = run(model, opt, loss, outside)
    assert not any(same["b.weight"]) and not any(same["a.weight"])  # the reference: always new values
    assert report.never_updated == [] and report.stalled == [], report.format()
    assert report.healthy, report.verdict

    tied = tiny_gpt2()
    gen = torch.Generator().manual_seed(0)
    assert tied.lm_head.weight is tied.transformer.wte.weight
    report, _ = run(tied, torch.optim.AdamW(tied.parameters(), lr=1e-3), lambda step: lm_loss(tied, gen), steps=5)
    assert not [r for r in report.never_updated if r.reason is Reason.OVERWRITTEN]
    assert not [s for s in report.stalled if s.reason is Reason.OVERWRITTEN]


# --- rows set back while the rest of the tensor learns -----------------------------------------------------------
def partly(report: Report) -> dict[tuple[str, int | None], tuple[list[int], Reason, str]]:
    return {(p.name, p.dim): (list(p.indices), p.reason, p.detail) for p in report.partly_updated}


@pytest.mark.parametrize("every", [1, 3])
def test_rows_put_back_from_saved_weights_are_partly_overwritten(every: int) -> None:
    """`a.weight.data[rows] = w0[rows]` after every step: rows 3 and 7 end bit-identical to their start while
    the other rows learn. Before, those rows read as `tiny_update` (a note: "rounding noise"); now they are
    partly never updated, `overwritten`, naming the rows and the step at which the optimizer moved them."""
    model, opt, loss = mlp()
    w = model.a.weight
    rows = [3, 7]
    w0 = w.detach().clone()

    def reset(step: int) -> None:
        w.data[rows] = w0[rows]  # planted: rows

    report, _ = run(model, opt, loss, reset, every=every, steps=12)
    same = (w.detach() == w0).all(dim=1)  # the reference, from the copy: which rows are as they started
    assert same.nonzero().flatten().tolist() == rows
    got = partly(report)
    assert set(got) == {("a.weight", 0)}, report.partly_updated
    indices, reason, detail = got[("a.weight", 0)]
    assert indices == rows and reason is Reason.OVERWRITTEN
    assert detail.startswith("output units 3, 7 (2 of 8) never changed, although the optimizer updated them at step 0")
    fix = "fix: change that write so it keeps the optimizer's updates" if every == 1 else "w.data[mask] = w0[mask]"
    assert "set back outside the optimizer" in detail and fix in detail
    assert report.never_updated == [] and report.stalled == []
    assert not report.healthy and "partly never updated (overwritten 1)" in report.verdict
    text = " ".join(str(report).split())
    assert "a.weight" in text and "3, 7" in text and "overwritten" in text
    # the line, where consecutive measured steps show the values changed between them (every=1)
    site = planted_site(test_rows_put_back_from_saved_weights_are_partly_overwritten, "rows")
    assert (f"{site} (`w.data[rows] = w0[rows]`)" in text) == (every == 1), text
    # when: the first two consecutive measured steps whose values differ (after one, before the next), by hand
    # above; without consecutive measured steps, after the step that moved them
    when = f"{site} (`w.data[rows] = w0[rows]`) between steps 0 and 1," if every == 1 else "optimizer after step 0,"
    assert when in detail and "after that update" not in detail, detail


def test_elements_of_a_bias_put_back_in_place_are_partly_overwritten() -> None:
    """A 1-D tensor's elements: `bias.data[idx].copy_`-style writes (`index_copy_`) put entries 1 and 5 of
    `a.bias` back after every step; the other entries learn."""
    model, opt, loss = mlp()
    b = model.a.bias
    idx = torch.tensor([1, 5])
    b0 = b.detach().clone()

    def reset(step: int) -> None:
        b.data.index_copy_(0, idx, b0[idx])  # planted: bias

    report, _ = run(model, opt, loss, reset)
    assert (b.detach() == b0).nonzero().flatten().tolist() == [1, 5]  # the reference, from the copy
    got = partly(report)
    assert set(got) == {("a.bias", None)}
    indices, reason, detail = got[("a.bias", None)]
    assert (indices, reason) == ([1, 5], Reason.OVERWRITTEN)
    assert detail.startswith("units 1, 5 (2 of 8) never changed, although the optimizer updated them at step 0")
    site = planted_site(test_elements_of_a_bias_put_back_in_place_are_partly_overwritten, "bias")
    assert f"{site} (`b.data.index_copy_(0, idx, b0[idx])`)" in " ".join(str(report).split())


def test_gpt2_mlp_units_set_back_are_named_as_units() -> None:
    """A real transformers GPT-2 (Conv1D: the units of `c_fc` are its weight's columns): units 2 and 9 of
    h[0]'s MLP put back from a saved copy after every step; gradlog names those columns, overwritten."""
    model = tiny_gpt2()
    gen = torch.Generator().manual_seed(0)
    w = model.transformer.h[0].mlp.c_fc.weight
    units = [2, 9]
    w0 = w.detach().clone()

    def reset(step: int) -> None:
        w.data[:, units] = w0[:, units]  # planted: units

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    report, _ = run(model, opt, lambda step: lm_loss(model, gen), reset, steps=5)
    assert (w.detach() == w0).all(dim=0).nonzero().flatten().tolist() == units  # the reference
    over = [p for p in report.partly_updated if p.reason is Reason.OVERWRITTEN]
    assert [(p.name, p.dim, list(p.indices)) for p in over] == [("transformer.h.0.mlp.c_fc.weight", 1, units)]
    assert over[0].detail.startswith("output units 2, 9 (2 of 128) never changed")
    site = planted_site(test_gpt2_mlp_units_set_back_are_named_as_units, "units")
    assert f"{site} (`w.data[:, units] = w0[:, units]`)" in " ".join(str(report).split())
    assert "overwritten" in report.verdict


@pytest.mark.parametrize("every", [1, 3])
def test_a_mask_applied_in_place_after_every_step_is_partly_overwritten(every: int) -> None:
    """`a.weight.data.mul_(mask)` after every step, the mask zeroing output units 2 and 5, which were not zero
    at the start: they are zero from the first mask on, the optimizer moves them at every step, the mask puts
    them back to zero. At close they differ from their start (so "back where they started" cannot see them);
    before, the verdict said OK. Now they are partly never updated, overwritten, with the steps between which
    they were set back; with every=1 also the line (the ledger sees the tensor change between two consecutive
    measured steps, and the write watch names the write)."""
    model, opt, loss = mlp()
    w = model.a.weight
    units = [2, 5]
    mask = torch.ones(w.shape[0], 1)
    mask[units] = 0.0
    assert bool((w.detach()[units] != 0).all())  # non-zero at the start: not the premasked case

    seen: list[torch.Tensor] = []

    def reset(step: int) -> None:
        seen.append(w.detach().clone())  # the reference: the values after each update, before the mask
        w.data.mul_(mask)  # planted: mul

    report, same = run(model, opt, loss, reset, every=every, steps=12)
    # by hand: the masked units moved at every update and are zero before every later step
    assert all(bool((s[units] != 0).any(dim=1).all()) for s in seen)
    assert bool((w.detach()[units] == 0).all()) and not same["a.weight"][-1]
    got = partly(report)
    assert set(got) == {("a.weight", 0)}, report.partly_updated
    indices, reason, detail = got[("a.weight", 0)]
    assert indices == units and reason is Reason.OVERWRITTEN
    k, k2 = (1, 2) if every == 1 else (3, 6)  # the first two watched steps both after the first mask
    assert detail.startswith(f"output units 2, 5 (2 of 8) updated by the optimizer at step {k}, yet their values")
    assert f"between steps {k} and {k2}" in detail, detail
    assert report.never_updated == [] and report.stalled == [] and not report.healthy
    text = " ".join(str(report).split())
    site = planted_site(test_a_mask_applied_in_place_after_every_step_is_partly_overwritten, "mul")
    assert (f"{site} (`w.data.mul_(mask)`)" in text) == (every == 1), text


def test_weights_restored_once_after_the_first_step_stay_quiet() -> None:
    """An LR finder's pattern: one step, every weight put back (load_state_dict of a copy taken before it),
    then training on. Every slice that step moved is back before the next: the whole tensor, once, which is
    no slice set back while the rest learns (and no set-back streak): no record."""
    import copy

    model, opt, loss = mlp()
    saved = copy.deepcopy(model.state_dict())

    def restore(step: int) -> None:
        if step == 0:
            model.load_state_dict(saved)

    report, same = run(model, opt, loss, restore)
    assert same["a.weight"][0] and not any(same["a.weight"][1:])  # the reference: back once, then learning
    assert report.partly_updated == [] and report.never_updated == [] and report.stalled == []
    assert report.healthy, report.verdict


def test_tiny_updates_of_a_deep_mlp_are_no_set_back_and_arm_no_watch() -> None:
    """The healthy twin of the set-back findings: 40 layers at lr 1e-4, whose deep biases move by rounding noise
    (update ratios ~1e-7). Such an element can come back to its start by itself, and a sum of squares can stay
    bit for bit: before, `5.bias` unit 54 was 'set back outside the optimizer' (a problem), and the screen's
    unproven streaks started the write watch on 22 tensors. Now nothing is overwritten and nothing watched."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(40)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(8, 64)
    gl = gradlog.GradLogger(model, opt, writer="memory", every=1, print_report=False, histograms=False)
    watched = []
    for step in range(10):
        model(x).pow(2).mean().backward()
        opt.step()
        gl.log(step)
        opt.zero_grad()
        watched.append(gl.pipeline.writes.active)
    report = gl.close()
    assert not any(watched) and not gl.pipeline.writes.sites
    assert [p.name for p in report.partly_updated if p.reason is Reason.OVERWRITTEN] == []
    assert "overwritten" not in report.verdict and report.never_updated == []


def test_gpt2_units_masked_in_place_every_step_are_named() -> None:
    """A real transformers GPT-2: h[1]'s MLP units 4 and 11 masked in place after every step
    (`w.data.mul_(mask)`, the columns of Conv1D's weight); the rest of GPT-2 learns. gradlog names the columns,
    overwritten, and the line."""
    model = tiny_gpt2()
    gen = torch.Generator().manual_seed(0)
    w = model.transformer.h[1].mlp.c_fc.weight
    units = [4, 11]
    mask = torch.ones(1, w.shape[1])
    mask[0, units] = 0.0

    def reset(step: int) -> None:
        w.data.mul_(mask)  # planted: gpt2 mul

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    report, _ = run(model, opt, lambda step: lm_loss(model, gen), reset, steps=5)
    assert bool((w.detach()[:, units] == 0).all())  # the reference: zero at the end, not at the start
    over = [p for p in report.partly_updated if p.reason is Reason.OVERWRITTEN]
    assert [(p.name, p.dim, list(p.indices)) for p in over] == [("transformer.h.1.mlp.c_fc.weight", 1, units)]
    assert "between steps 1 and 2" in over[0].detail
    site = planted_site(test_gpt2_units_masked_in_place_every_step_are_named, "gpt2 mul")
    assert f"{site} (`w.data.mul_(mask)`)" in " ".join(str(report).split())
    assert "overwritten" in report.verdict


# --- a resumed run keeps the set-back state -----------------------------------------------------------------------
@pytest.mark.parametrize("ended", ["closed", "killed"])
@pytest.mark.parametrize("fixed", [False, True])
def test_a_resumed_run_keeps_reporting_the_set_back_tensor(tmp_path: Path, ended: str, fixed: bool) -> None:
    """Segment 1 (10 steps, `b` reloaded from a saved copy before every step) finds `b` overwritten; it is
    closed, or killed by SIGTERM in its own process (a preempted job). Segment 2 resumes from the checkpoint
    for 2 steps: too few to prove the set-back again (a streak needs two fingerprints), and before it forgot
    it ("gradlog OK"). It keeps the finding while no update stays; the twin whose bug was fixed before the
    resume learns in segment 2 and is let go."""
    folder, saved_path, ckpt = tmp_path / "run", tmp_path / "saved.pt", tmp_path / "ckpt.pt"
    if ended == "killed":
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(gradlog.__file__).parents[1]), str(HERE)])}
        done = subprocess.run(
            [sys.executable, str(HERE / "setback_child.py"), str(folder), str(saved_path), str(ckpt)],
            env={**env, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == -signal.SIGTERM, done.stderr
    else:
        torch.manual_seed(0)
        model = TwoLayer(torch.tanh)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        saved = {k: v.clone() for k, v in model.b.state_dict().items()}
        torch.save(saved, saved_path)
        with gradlog.GradLogger(model, opt, every=1, log_dir=str(folder), print_report=False) as gl:
            setback_child.segment(model, opt, range(10), saved)
            first = gl.report()
        assert {r.name: r.reason for r in first.never_updated} == {
            "b.weight": Reason.OVERWRITTEN,
            "b.bias": Reason.OVERWRITTEN,
        }
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, ckpt)
    state = torch.load(ckpt)
    model = TwoLayer(torch.tanh)
    model.load_state_dict(state["model"])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt.load_state_dict(state["optimizer"])
    saved = {} if fixed else torch.load(saved_path)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = gradlog.Output(resume=True)
    with gradlog.GradLogger(model, opt, writer=out, every=1, log_dir=str(folder), print_report=False) as gl:
        setback_child.segment(model, opt, range(10, 12), saved)
    report = gl.report()
    # the reference: in segment 2, b's values before each step are the saved copy's (the bug) or not (fixed)
    assert report.optimizer_steps == 12 and report.measured_steps == 12
    if fixed:
        assert not torch.equal(model.b.weight.detach(), start["b.weight"])
        assert report.never_updated == [] and report.healthy, report.verdict
        return
    got = never(report)
    assert set(got) == {"b.weight", "b.bias"}
    reason, detail = got["b.weight"]
    assert reason is Reason.OVERWRITTEN
    assert detail.startswith(
        "set back outside the optimizer before the resume (found by an earlier segment of this run)"
    )
    assert "updated by the optimizer at 2 of 2 measured steps since the resume" in detail
    assert "from step 10 on are the same" in detail
    assert "overwritten 2" in report.verdict and not report.healthy


def test_the_write_watch_keeps_the_first_write_between_steps_and_ends() -> None:
    """`gradlog.measure.writes.WriteWatch` by hand: the optimizer's own writes (inside step()), a `.grad = None`
    and a `requires_grad_` are no write; `p.data[0] = ...` between two steps is, with this file's line; a watch
    whose tensor is never written ends by itself after its windows, leaving no mode and no hook behind."""
    from gradlog.measure.params import Tracked
    from gradlog.measure.writes import WINDOWS, WriteWatch

    model, opt, loss = mlp()
    w, b = model.a.weight, model.a.bias
    watch = WriteWatch()
    watch.watch([Tracked.of(0, w, "a.weight"), Tracked.of(1, b, "a.bias")], opt)
    for step in range(WINDOWS + 2):
        loss(step).backward()
        opt.step()
        w.grad = None
        b.requires_grad_(True)
        if step == 1:
            w.data[0] = 0.0  # planted: write
        opt.zero_grad()
    site = planted_site(test_the_write_watch_keeps_the_first_write_between_steps_and_ends, "write")
    assert set(watch.sites) == {0} and watch.words()[0].endswith(f"{site} (`w.data[0] = 0.0`)")
    assert not watch.active and not torch.overrides._get_current_function_mode_stack()


def test_a_healthy_write_every_step_is_watched_once() -> None:
    """WGAN's clamp after every step, and a decay written through a numpy view (which no TorchFunctionMode
    sees), change the weights between every two measured steps: the write watch runs once for each flagged
    tensor, then never again (not one watch, with its mode, every few steps, for a write it cannot see)."""
    model, opt, loss = mlp()
    gl = gradlog.GradLogger(model, opt, writer="memory", every=1, print_report=False)
    watched = []
    for step in range(12):
        loss(step).backward()
        opt.step()
        with torch.no_grad():
            model.a.weight.clamp_(-0.3, 0.3)
        model.b.weight.detach().numpy()[:] *= 0.99
        gl.log(step)
        opt.zero_grad()
        watched.append(gl.pipeline.writes.active)
    report = gl.close()
    assert report.healthy and report.never_updated == [] and report.partly_updated == []
    assert any(watched[:4]) and not any(watched[6:]), watched
    assert set(gl.pipeline.writes.sites) == {r.index for r in gl.pipeline.table.live if r.name == "a.weight"}
    assert not torch.overrides._get_current_function_mode_stack()


def _mode_stack() -> list[object]:
    return list(torch.overrides._get_current_function_mode_stack())  # type: ignore[no-untyped-call]


def _compiled_set_back(with_gradlog: bool) -> tuple[int, list[bool], gradlog.GradLogger | None]:
    """torch.compile(opt.step), a.weight put back after every step, with gradlog or without: dynamo's frames
    compiled, whether a mode was on the stack after each step, and the logger."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, opt, loss = mlp()
    w0 = model.a.weight.detach().clone()
    gl = gradlog.GradLogger(model, opt, writer="memory", every=1, print_report=False) if with_gradlog else None
    step_fn = torch.compile(opt.step)
    pushed = []
    for step in range(6):
        loss(step).backward()
        step_fn()
        pushed.append(bool(_mode_stack()))
        with torch.no_grad():
            model.a.weight.copy_(w0)
        if gl is not None:
            gl.log(step)
        opt.zero_grad()
    frames = int(counters["frames"]["total"])
    torch._dynamo.reset()
    return frames, pushed, gl


@pytest.mark.slow  # compiling takes seconds
def test_a_compiled_step_never_meets_the_write_watch() -> None:
    """Dynamo guards compiled frames on the torch-function mode stack: the write watch's mode, pushed after one
    step and popped in the next step's pre-hook, was on the stack when the compiled optimizer.step() was entered,
    which recompiled it (test_amp's compiled step: 7 frames against 5). Once torch.compile has compiled anything
    the watch pushes no mode: the frames are those of the same run without gradlog, and the set-back is still
    found, without its line."""
    base, _, _ = _compiled_set_back(False)
    frames, pushed, gl = _compiled_set_back(True)
    assert gl is not None
    report = gl.close()
    # no mode after any step (the old watch's was on after the third), and no frame more than without gradlog
    assert not any(pushed) and frames <= base, (frames, base, pushed)
    assert gl.pipeline.writes.skipped == "torch.compile" and not gl.pipeline.writes.sites
    assert never(report)["a.weight"][0] is Reason.OVERWRITTEN
    assert not _mode_stack()


def test_the_write_watch_never_pops_a_mode_of_the_users() -> None:
    """A mode the user enters between two steps and leaves after the next step (here around every other
    forward and step) is above the watch's mode at that step's pre-hook: the watch turns its own off and pops it
    once it is on top again, never the user's (TorchFunctionMode.__exit__ pops whatever is on top); it pushes
    nothing on a stack that is not empty. The user's mode sees its calls; the stack ends empty."""
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    model, opt, loss = mlp()
    w0 = model.a.weight.detach().clone()
    gl = gradlog.GradLogger(model, opt, writer="memory", every=1, print_report=False)
    pushed = []
    for step in range(10):
        user = Count()
        if step % 2:
            with user:
                loss(step).backward()
                opt.step()
                assert _mode_stack()[-1] is user
        else:
            loss(step).backward()
            opt.step()
        pushed.append(gl.pipeline.writes.pushed)
        assert user not in _mode_stack()
        with torch.no_grad():
            model.a.weight.copy_(w0)
        gl.log(step)
        opt.zero_grad()
    report = gl.close()
    assert any(pushed) and Count.calls > 0 and not _mode_stack()
    assert never(report)["a.weight"][0] is Reason.OVERWRITTEN


def test_close_pops_the_write_watch_a_loop_left_between_steps() -> None:
    """A training loop that stops between two steps (an exception, a break) while the watch's mode is on: the
    mode stays until the next step, so close() pops it, or the optimizer garbage-collected with the logger."""
    model, opt, loss = mlp()
    w0 = model.a.weight.detach().clone()
    gl = gradlog.GradLogger(model, opt, writer="memory", every=1, print_report=False)
    for step in range(10):
        loss(step).backward()
        opt.step()
        if gl.pipeline.writes.pushed:
            break  # the loop ends here, before its write
        with torch.no_grad():
            model.a.weight.copy_(w0)
        gl.log(step)
        opt.zero_grad()
    assert gl.pipeline.writes.pushed and len(_mode_stack()) == 1
    gl.close()
    assert not _mode_stack() and not gl.pipeline.writes.active
    # the optimizer garbage-collected while the mode is on: gone with it
    model, opt, loss = mlp()
    gl = gradlog.GradLogger(model, opt, writer="memory", every=1, print_report=False)
    w0 = model.a.weight.detach().clone()
    for step in range(10):
        loss(step).backward()
        opt.step()
        if gl.pipeline.writes.pushed:
            break
        with torch.no_grad():
            model.a.weight.copy_(w0)
        gl.log(step)
        opt.zero_grad()
    assert len(_mode_stack()) == 1
    del gl, opt, model, loss
    import gc

    gc.collect()
    assert not _mode_stack()
