"""A preempted run resumed in a new process from its checkpoint: one logical run, judged whole."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import catalogue
import pytest
import torch
from torch import nn

import gradlog
from gradlog.readers.run import closed_report, load
from gradlog.verdict.located import CLEARED_HINT

HERE = Path(__file__).resolve().parent
CHILD = HERE / "resume_child.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(CHILD), *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("resume", ["True", "auto"])
def test_a_resumed_run_is_one_run_judged_over_both_segments(tmp_path: Path, resume: str) -> None:
    log_dir, ckpt = str(tmp_path / "run"), str(tmp_path / "ckpt.pt")
    first = _run("first", log_dir, ckpt)
    assert first.returncode == -15, first.stderr  # preempted by SIGTERM, as a scheduler does
    second = _run("second", log_dir, ckpt, resume)
    assert second.returncode == 0, second.stderr
    assert "a new run starts" not in second.stderr
    # ground truth from the weights themselves
    initial, at_ckpt = torch.load(ckpt + ".initial"), torch.load(ckpt)["model"]
    final = torch.load(ckpt + ".final")
    assert torch.equal(initial["frozen.weight"], final["frozen.weight"])
    assert torch.equal(initial["late.weight"], at_ckpt["late.weight"])
    assert not torch.equal(at_ckpt["late.weight"], final["late.weight"])
    assert not torch.equal(initial["slow.weight"], at_ckpt["slow.weight"])
    assert torch.equal(at_ckpt["slow.weight"], final["slow.weight"])

    run = load(log_dir)  # one run, not "holds 2 runs"
    assert len(run.files) == 2
    report = closed_report(run)
    assert report is not None
    assert report.optimizer_steps == 60 and report.measured_steps == 12
    assert {r.name for r in report.never_updated} == {"frozen.weight", "frozen.bias"}
    stalled = {s.name: s for s in report.stalled}
    assert set(stalled) == {"slow.weight", "slow.bias"}
    assert all(s.since_step == 30 and s.reason.value == "zero_lr" for s in stalled.values())
    assert all(0 <= s.last_update_step < 30 for s in stalled.values())
    assert not any(r.name.startswith("late.") for r in report.never_updated)

    # TensorBoard's own reader sees one run whose x-axis goes on from the first segment's last step
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    mux = EventMultiplexer()
    mux.AddRunsFromDirectory(str(tmp_path))
    mux.Reload()
    assert list(mux.Runs()) == ["run"]
    steps = [e.step for e in mux.Scalars("run", "weights/grad_norm/main.weight")]
    assert steps == list(range(0, 60, 5))
    late = [e.step for e in mux.Scalars("run", "weights/grad_norm/late.weight")]
    assert late and min(late) == 30  # no gradient before the resume

    cli = subprocess.run(
        [sys.executable, "-m", "gradlog", "report", log_dir],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(HERE.parent)},
        timeout=300,
    )
    assert cli.returncode != 2, cli.stderr
    assert "slow.weight" in cli.stdout and "frozen.weight" in cli.stdout


def _train(model: nn.Module, opt: torch.optim.Optimizer, gl: gradlog.GradLogger, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        gl.log()


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_resume_on_an_empty_folder_warns_and_starts_fresh(tmp_path: Path) -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(RuntimeWarning, match="holds no gradlog run.*a new run starts"):
        gl = gradlog.GradLogger(
            model, opt, writer=gradlog.Output(resume=True), log_dir=str(tmp_path), every=1, print_report=False
        )
    _train(model, opt, gl, 3)
    assert gl.close().optimizer_steps == 3


def test_resume_on_another_models_run_warns_and_overwrites_nothing(tmp_path: Path) -> None:
    old = nn.Linear(3, 2)
    opt = torch.optim.Adam(old.parameters())
    gl = gradlog.GradLogger(old, opt, log_dir=str(tmp_path / "old"), every=1, print_report=False)
    _train(old, opt, gl, 3)
    gl.close()
    before = _files(tmp_path / "old")
    for n, other in enumerate((nn.Linear(3, 5), nn.Sequential(nn.Linear(3, 2)))):  # other shapes, other names
        folder = tmp_path / f"copy{n}"
        shutil.copytree(tmp_path / "old", folder)
        opt = torch.optim.Adam(other.parameters())
        _train(other, opt, gradlog.GradLogger(other, opt, writer="memory", print_report=False), 1)  # state loaded
        gradlog.close()
        with pytest.warns(RuntimeWarning, match="of another model"):
            gl = gradlog.GradLogger(
                other, opt, writer=gradlog.Output(resume=True), log_dir=str(folder), print_report=False
            )
        _train(other, opt, gl, 2)
        assert gl.close().optimizer_steps == 2  # a fresh run: its own steps only
        after = _files(folder)
        assert len(after) == len(before) + 1  # its own event file, beside the old one
        assert all(after[name] == data for name, data in before.items())


def test_auto_does_not_resume_a_fresh_start(tmp_path: Path) -> None:
    """The same script run again from scratch (no checkpoint loaded) is a new run, not a continuation."""
    for attempt in range(2):
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        opt = torch.optim.Adam(model.parameters())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gl = gradlog.GradLogger(
                model, opt, writer=gradlog.Output(resume="auto"), log_dir=str(tmp_path), print_report=False
            )
        said = [str(w.message) for w in caught if "resume" in str(w.message)]
        assert said == [] if attempt == 0 else len(said) == 1 and "not loaded from a checkpoint" in said[0]
        _train(model, opt, gl, 2)
        assert gl.close().optimizer_steps == 2


def test_resume_option_is_checked() -> None:
    with pytest.raises(ValueError, match="resume"):
        gradlog.Output(resume="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="resume"):
        gradlog.Output(resume=1)  # type: ignore[arg-type]


# --- W&B: a resumed run continues the same W&B run id ------------------------------------------------
@pytest.mark.parametrize("resume", ["True", "auto"])
def test_a_resumed_wandb_run_continues_the_same_run(tmp_path: Path, resume: str, wandb_offline: Any) -> None:
    log_dir, ckpt = str(tmp_path / "run"), str(tmp_path / "ckpt.pt")
    first = _run("first", log_dir, ckpt, "wandb")
    assert first.returncode == -15, first.stderr
    second = _run("second", log_dir, ckpt, resume, "wandb")
    assert second.returncode == 0, second.stderr
    assert "a new run starts" not in second.stderr
    closed = torch.load(ckpt + ".report")
    # one W&B run id, one offline-run folder per segment
    files = sorted((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and files[0].name == files[1].name and files[0].parent != files[1].parent
    run_id = files[0].name[len("run-") : -len(".wandb")]
    assert f"gradlog report {tmp_path / 'run' / 'wandb'}" in second.stdout  # the whole run, not the last segment

    run = load(log_dir)  # both segments, one logical run
    assert sorted(run.files) == [str(f) for f in files]
    report = closed_report(run)
    assert report is not None
    assert report.optimizer_steps == 60 and report.measured_steps == 12
    assert {r.name for r in report.never_updated} == {"frozen.weight", "frozen.bias"} == set(closed["never"])
    stalled = {s.name: s for s in report.stalled}
    assert set(stalled) == {"slow.weight", "slow.bias"}
    assert all(s.since_step == 30 and s.reason.value == "zero_lr" for s in stalled.values())
    assert not any(r.name.startswith("late.") for r in report.never_updated)
    assert report.verdict == closed["verdict"]
    summary = dict(run.tables["gradlog/summary"][1])
    assert summary["run_id"] == run_id and summary["segment"] == "2" and summary["segment_first_step"] == "30"
    assert [s for s, _ in run.scalars["weights/grad_norm/main.weight"]] == list(range(0, 60, 5))
    assert [s for s, _ in run.scalars["weights/grad_norm/late.weight"]] == list(range(30, 60, 5))

    for folder in (log_dir, str(tmp_path / "run" / "wandb")):
        cli = subprocess.run(
            [sys.executable, "-m", "gradlog", "report", folder],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(HERE.parent)},
            timeout=300,
        )
        assert cli.returncode != 2, cli.stderr
        assert cli.stdout.strip().splitlines()[-1] == closed["verdict"]


def _wandb_logger(model: nn.Module, opt: torch.optim.Optimizer, folder: Path, resume: bool | str) -> gradlog.GradLogger:
    output = gradlog.Output("wandb", options={"mode": "offline"}, resume=resume)  # type: ignore[arg-type]
    return gradlog.GradLogger(model, opt, writer=output, log_dir=str(folder), every=1, print_report=False)


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (not W&B's `latest-run` and `debug*.log` links, which follow the newest run)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file() and not p.is_symlink()}


def test_wandb_resume_of_nothing_or_another_model_starts_fresh(tmp_path: Path, wandb_offline: Any) -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    with pytest.warns(RuntimeWarning, match="holds no W&B run.*a new run starts"):
        gl = _wandb_logger(model, opt, tmp_path / "old", True)
    _train(model, opt, gl, 3)
    assert gl.close().optimizer_steps == 3
    before = _tree(tmp_path / "old")
    other = nn.Linear(3, 5)  # another model: other shapes
    opt = torch.optim.Adam(other.parameters())
    with pytest.warns(RuntimeWarning, match=r"of another model \('weight' had shape 2x3 there"):
        gl = _wandb_logger(other, opt, tmp_path / "old", True)
    _train(other, opt, gl, 2)
    assert gl.close().optimizer_steps == 2  # a fresh run: its own steps only
    after = _tree(tmp_path / "old")
    assert all(after[name] == data for name, data in before.items())  # nothing of the old run overwritten
    ids = {p.name for p in (tmp_path / "old" / "wandb").glob("offline-run-*/run-*.wandb")}
    assert len(ids) == 2  # a second run beside the first, under its own id
    with pytest.raises(gradlog.readers.run.BadRun, match="holds 2 runs; pass one of them"):
        load(str(tmp_path / "old"))  # two unrelated runs: today's clear message


def test_tensorboard_and_wandb_together_continue_both(tmp_path: Path, wandb_offline: Any) -> None:
    """The TensorBoard folder holds the evidence; the W&B run goes on under its earlier id beside it."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    gl = gradlog.GradLogger(model, opt, writer=["tensorboard", "wandb"], log_dir=str(tmp_path), print_report=False)
    _train(model, opt, gl, 3)
    gl.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # nothing to warn about: both runs continue
        output = gradlog.Output(["tensorboard", "wandb"], resume="auto")
        gl = gradlog.GradLogger(model, opt, writer=output, log_dir=str(tmp_path), every=1, print_report=False)
    _train(model, opt, gl, 2)
    report = gl.close()
    assert report.optimizer_steps == 5 and report.measured_steps == 3  # every=50, then every=1: steps 0, 3, 4
    files = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and files[0].name == files[1].name
    assert len(list(tmp_path.glob("*tfevents*"))) == 2
    tb = closed_report(load(str(tmp_path)))
    wb = closed_report(load(str(tmp_path / "wandb")))
    assert tb is not None and wb is not None and tb.verdict == wb.verdict == report.verdict


def test_units_that_die_span_the_resume(tmp_path: Path) -> None:
    """Dead units across segments: killed before the resume and still dead after it stay stopped from their
    own step; killed at the resume, they stopped at the resume step; killed before and revived after, they
    are not stopped. The stop steps come from the gradients read here, never from gradlog."""
    dead_early, dead_at_resume, revived = [0, 1], [5, 6], [9]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    with torch.no_grad():
        model[0].bias.fill_(1.0)  # every unit alive until the test kills it
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    last_nonzero: dict[int, int] = {}  # unit -> last step its row had a non-zero gradient

    def segment(steps: range, resume: bool, kill: list[int], revive: list[int]) -> gradlog.Report:
        out = gradlog.Output(resume=resume)
        gl = gradlog.GradLogger(model, opt, writer=out, log_dir=str(tmp_path), every=2, print_report=False)
        for step in steps:
            if step == steps.start + 8 or (resume and step == steps.start):
                with torch.no_grad():
                    model[0].bias[kill] = -100.0
                    model[0].bias[revive] = 1.0
            opt.zero_grad()
            model(torch.randn(16, 4)).pow(2).mean().backward()
            for unit in range(16):
                if model[0].weight.grad[unit].abs().sum() > 0:
                    last_nonzero[unit] = step
            opt.step()
            gl.log(step)
        return gl.close()

    segment(range(30), False, dead_early + revived, [])
    report = segment(range(30, 60), True, dead_at_resume, revived)
    assert last_nonzero[dead_early[0]] < 8 <= last_nonzero[revived[0]] - 30 + 8 and last_nonzero[5] == 29
    rows = [s for s in report.stopped_slices if s.name == "0.weight" and s.dim == 0]
    by_unit = {i: s for s in rows for i in s.indices}
    assert set(by_unit) == set(dead_early + dead_at_resume)  # the revived unit is not stopped
    first_measured_after = {u: next(k for k in range(0, 60, 2) if k > last_nonzero[u]) for u in dead_early}
    assert all(by_unit[u].since_step == first_measured_after[u] for u in dead_early)
    assert all(by_unit[u].since_step == 30 for u in dead_at_resume)  # stopped at the resume
    assert not any(p.name == "0.weight" and p.dim == 0 for p in report.partly_updated)  # all had learned once
    back = closed_report(load(str(tmp_path)))
    assert back is not None and back.verdict == report.verdict
    assert {i for s in back.stopped_slices if s.name == "0.weight" and s.dim == 0 for i in s.indices} == set(by_unit)


def test_wandb_dir_given_per_writer_is_where_the_resume_looks(tmp_path: Path, wandb_offline: Any) -> None:
    """`options={"wandb": {"dir": ...}}` (one dict per writer) puts the W&B run outside log_dir; the resumed
    run looks there, and continues the same W&B run id."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    elsewhere = tmp_path / "wandb_elsewhere"
    elsewhere.mkdir()
    for resume in (False, "auto"):
        out = gradlog.Output(["tensorboard", "wandb"], options={"wandb": {"dir": str(elsewhere)}}, resume=resume)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # found and continued: nothing to warn about
            gl = gradlog.GradLogger(model, opt, writer=out, log_dir=str(tmp_path / "tb"), every=1, print_report=False)
        _train(model, opt, gl, 2)
        gl.close()
    files = sorted(elsewhere.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 2 and files[0].name == files[1].name  # two segments of one W&B run id
    assert not (tmp_path / "tb" / "wandb").exists()


def test_tb_continues_and_the_wandb_run_is_gone_says_so(tmp_path: Path, wandb_offline: Any) -> None:
    """Both writers, and the W&B folder of the earlier run was removed: TensorBoard continues, W&B cannot; one
    warning says the run is split instead of a second W&B run id appearing silently."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    gl = gradlog.GradLogger(model, opt, writer=["tensorboard", "wandb"], log_dir=str(tmp_path), print_report=False)
    _train(model, opt, gl, 3)
    gl.close()
    shutil.rmtree(tmp_path / "wandb")
    with pytest.warns(RuntimeWarning, match="TensorBoard run in .* continues, but no W&B run of it was found"):
        output = gradlog.Output(["tensorboard", "wandb"], resume="auto")
        gl = gradlog.GradLogger(model, opt, writer=output, log_dir=str(tmp_path), every=1, print_report=False)
    _train(model, opt, gl, 2)
    assert gl.close().optimizer_steps == 5  # the TensorBoard run did continue


def test_segments_written_in_one_second_read_in_write_order(tmp_path: Path) -> None:
    """Both segments' event files from one process in the same second, its 9th and 10th writers: read as
    text, `.10` sorts before `.9` and the first segment's tables would speak last (seen in the test suite)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    for resume in (False, True):
        gl = gradlog.GradLogger(
            model, opt, writer=gradlog.Output(resume=resume), log_dir=str(tmp_path), every=1, print_report=False
        )
        _train(model, opt, gl, 3)
        report = gl.close()
    first, second = sorted(tmp_path.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime_ns)
    mark = first.name.split(".gradlog-run-")[1]
    first.rename(tmp_path / f"events.out.tfevents.1700000000.host.4242.9.gradlog-run-{mark}")
    second.rename(tmp_path / f"events.out.tfevents.1700000000.host.4242.10.gradlog-run-{mark}")
    back = load(str(tmp_path))
    assert back.summary()["segment"] == "2" and back.summary()["optimizer_steps"] == "6" == str(report.optimizer_steps)
    assert closed_report(back) is not None and closed_report(back).verdict == report.verdict


def _maybe_misplaced(
    model: nn.Module, opt: torch.optim.Optimizer, folder: Path, steps: range, bug: bool
) -> gradlog.Report:
    """One segment (a resumed one from `steps.start`); with `bug`, zero_grad() runs between backward() and
    step(), so the optimizer never sees a gradient."""
    out = gradlog.Output(resume=steps.start > 0)
    gl = gradlog.GradLogger(model, opt, writer=out, log_dir=str(folder), every=1, print_report=False)
    for step in steps:
        model(torch.randn(4, 6)).pow(2).mean().backward()
        if bug:
            opt.zero_grad()
        opt.step()
        opt.zero_grad()
        gl.log(step)
    return gl.close()


@pytest.mark.parametrize(("before", "after"), [(False, True), (True, True), (True, False)])
def test_the_hint_speaks_for_the_whole_run(tmp_path: Path, before: bool, after: bool) -> None:
    """zero_grad() misplaced before the checkpoint, after the resume, or both: the hint is judged on the merged
    records. A mistake made in the resumed script explains every record from the resume on, and says so; one
    in both segments explains the whole run; one fixed at the resume explains nothing (the weights learned).
    Which segment moved the weights is read from copies of them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    first = _maybe_misplaced(model, opt, tmp_path, range(8), before)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "ckpt.pt")
    ckpt = torch.load(tmp_path / "ckpt.pt")
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model.load_state_dict(ckpt["model"])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt.load_state_dict(ckpt["optimizer"])
    report = _maybe_misplaced(model, opt, tmp_path, range(8, 16), after)

    moved = [  # per segment: whether each tensor moved in it
        {not torch.equal(a[k], b[k]) for k in initial}
        for a, b in ((initial, ckpt["model"]), (ckpt["model"], model.state_dict()))
    ]
    assert moved == [{not before}, {not after}]  # all tensors or none, as planted
    whole = CLEARED_HINT  # each segment traced one step: backward() wrote the gradients, step() found none
    assert first.hint == (whole if before else None)
    if not after:
        assert report.hint is None and report.stalled == [] and report.never_updated == []
    elif before:
        assert report.hint == whole and len(report.never_updated) == 4
    else:
        assert report.hint == f"from the resume at step 8 on, {whole}"
        assert {(s.since_step, s.reason) for s in report.stalled} == {(8, gradlog.Reason.NO_GRAD)}
        assert len(report.stalled) == 4 and report.never_updated == []
    back = closed_report(load(str(tmp_path)))
    assert back is not None and back.hint == report.hint


# --- a resumed run's details count the whole run -----------------------------------------------------
def _resumed(model: nn.Module, opt: torch.optim.Optimizer, path: Path) -> tuple[nn.Module, torch.optim.Optimizer]:
    """`model` and `opt` checkpointed to `path` and loaded into a fresh model and optimizer, as a resumed
    script does."""
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    state = torch.load(path)
    fresh = catalogue.ResumePlanted()
    fresh.load_state_dict(state["model"])
    again = torch.optim.Adam(fresh.parameters())
    again.load_state_dict(state["optimizer"])
    return fresh, again


def _planted_segment(
    model: nn.Module, opt: torch.optim.Optimizer, folder: Path, steps: range, every: int, writer: str, seen: list[int]
) -> gradlog.Report:
    """One segment of `ResumePlanted` (a resumed one from `steps.start`) on ids 0-9, measured every `every`
    steps; `seen` counts, per segment, the measured steps as the test sees them: [measured, with a gradient in
    fc1.weight, with one in emb.weight, with grad None in unused.weight and in late.weight]."""
    out = gradlog.Output(writer, resume=steps.start > 0)
    gl = gradlog.GradLogger(model, opt, writer=out, log_dir=str(folder), every=every, print_report=False)
    gen = torch.Generator().manual_seed(steps.start)
    for step in steps:
        model(torch.randint(0, 10, (8, 3), generator=gen)).pow(2).mean().backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        assert grads["fc1.weight"] is not None and grads["fc1.weight"][:3].abs().sum() == 0  # the plant held
        if step % every == 0:  # gradlog measures the steps its count makes multiples of `every`
            found = [grads[n] is not None for n in ("fc1.weight", "emb.weight")]
            seen[:] = [seen[0] + 1, seen[1] + found[0], seen[2] + found[1]] + [
                k + (grads[n] is None) for k, n in zip(seen[3:], ("unused.weight", "late.weight"))
            ]
        opt.step()
        opt.zero_grad()
        gl.log(step)
    return gl.close()


# TensorBoard only: three W&B segments started within one second failed once in ~10 runs (see the report)
@pytest.mark.parametrize("writer", ["tensorboard"])
def test_resumed_details_count_every_segment(tmp_path: Path, writer: str, request: pytest.FixtureRequest) -> None:
    """Three segments (every=1, 2, then 1): a record of the whole run counts the measured steps of all of
    them (`gradlog/segment` passes each tensor's counters on); a stalled tensor's counts are those since the
    resume, and its detail says so; a unit killed at the second resume stopped there, at a last step not
    observed (-1). The counts, the slices and the stop steps come from the gradients and weights read here."""
    if writer == "wandb":
        request.getfixturevalue("wandb_offline")
    torch.manual_seed(0)
    folder = tmp_path / "run"
    model: nn.Module = catalogue.ResumePlanted()
    opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    plan = [(range(16), 1), (range(16, 30), 2), (range(30, 36), 1)]
    seen: list[list[int]] = []
    reports = []
    for k, (steps, every) in enumerate(plan):
        if k:
            model, opt = _resumed(model, opt, tmp_path / "ckpt.pt")
            model.use_late = False  # `late` is not called after the first resume: it stalls there
            if k == 1:
                with torch.no_grad():
                    model.fc1.bias[5] = -100.0  # unit 5 fires no more from the first resume on
        seen.append([0] * 5)
        reports.append(_planted_segment(model, opt, folder, steps, every, writer, seen[-1]))
    final = model.state_dict()
    same = {n: (initial[n] == final[n]).reshape(len(final[n]), -1).all(1) for n in final}  # per row (element)
    unchanged = {n: same[n].nonzero().flatten().tolist() for n in final}
    assert unchanged["fc1.weight"] == [0, 1, 2] and unchanged["unused.weight"] == [0, 1, 2, 3]

    for k in (1, 2):
        report, run = reports[k], [sum(c) for c in zip(*seen[: k + 1])]  # this report's counts: segments 0..k
        assert report.measured_steps == run[0]
        never = {r.name: r for r in report.never_updated}
        assert set(never) == {"unused.weight", "unused.bias"}
        # the whole run's count, then the traced step's words
        assert never["unused.weight"].detail.startswith(f"grad None at all {run[3]} measured steps")
        partly = {(p.name, p.reason): p for p in report.partly_updated}
        fc1 = partly[("fc1.weight", gradlog.Reason.ZERO_GRAD)]
        assert list(fc1.indices) == unchanged["fc1.weight"]  # not unit 5: it learned before the resume
        assert fc1.detail.startswith(
            f"output units 0-2 (3 of 16) never changed; zero gradient at all {run[1]} measured steps with a gradient"
        )
        emb = partly[("emb.weight", gradlog.Reason.NOT_IN_BATCH)]
        assert list(emb.indices) == list(range(10, 20)) == unchanged["emb.weight"][1:]
        assert f"zero gradient at all {run[2]} measured steps with a gradient" in emb.detail
        assert partly[("emb.weight", gradlog.Reason.PADDING_IDX)].indices == (0,) == tuple(unchanged["emb.weight"][:1])
        late = {s.name: s for s in report.stalled}["late.weight"]
        assert (late.since_step, late.last_update_step) == (16, 15)
        since = f"since the resume: grad None at all {seen[k][4]} measured steps: "  # this segment's, and it says so
        assert late.detail.startswith(f"updated before the resume at step {plan[k][0].start} (last at step 15)")
        assert since in late.detail
        dead = [s for s in report.stopped_slices if s.name == "fc1.weight" and s.dim == 0]
        assert [(s.indices, s.since_step, s.last_grad_step) for s in dead] == [((5,), 16, -1)]
        assert "before the resume at step 16 and none at any measured step since" in dead[0].detail
    back = closed_report(load(str(folder)))  # the tables written say the same
    assert back is not None
    assert [r.detail for r in back.never_updated] == [r.detail for r in reports[2].never_updated]
    assert [p.detail for p in back.partly_updated] == [p.detail for p in reports[2].partly_updated]
    assert [s.last_grad_step for s in back.stopped_slices] == [s.last_grad_step for s in reports[2].stopped_slices]


def test_a_segment_table_without_counters_is_not_continued(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A `gradlog/segment` table whose counters are missing (cut to its first three columns here) cannot
    speak for the whole run: the warning names the cell, a new run starts beside it and counts only itself."""
    from gradlog.runformat import names

    torch.manual_seed(0)
    model = catalogue.BodyHeadUnused()
    opt = torch.optim.Adam(model.parameters())
    with monkeypatch.context() as cut:
        cut.setattr(names, "SEGMENT_COLUMNS", names.SEGMENT_COLUMNS[:3])
        gl = gradlog.GradLogger(model, opt, log_dir=str(tmp_path), every=1, print_report=False)
        catalogue.train(opt, gl, 5, catalogue.random_mse(model, 4, 6))
    assert load(str(tmp_path)).tables["gradlog/segment"][0] == ["name", "shape", "last_update_step"]
    with pytest.warns(RuntimeWarning, match=r"unreadable gradlog/segment table \(its 'measured' cell of .* is ''"):
        gl = gradlog.GradLogger(
            model, opt, writer=gradlog.Output(resume=True), log_dir=str(tmp_path), every=1, print_report=False
        )
    report = catalogue.train(opt, gl, 3, catalogue.random_mse(model, 4, 6))
    assert report.measured_steps == 3
