"""One verdict everywhere: `gradlog.verdict.judge` decides, and every place that states a run's health
says the same about the same run.

Compared on a healthy run and on each planted bug: the line close() prints, `Report.healthy`, the
summary table read back with TensorBoard's own `EventAccumulator`, a W&B offline run file read back,
and `gradlog report`'s verdict and exit status (with a band and spike factor so wide that only the
close-time part decides). Partly-updated records come from the per-slice diagnosis (another part of
issue 12); here they are planted into the Report close() writes, to test how they are shown, written,
read back and judged.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from catalogue import EmbeddingPlanted, mse, train
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

import gradlog
from gradlog.cli.entry import main
from gradlog.readers.run import load, parse_markdown_table
from gradlog.verdict.judge import judge
from gradlog.verdict.records import format_ranges, parse_ranges
from gradlog.verdict.report import (
    PARTLY_COLUMNS,
    RANGES_SHOWN,
    STALLED_COLUMNS,
    NeverUpdated,
    NonFinite,
    PartlyUpdated,
    Reason,
    Report,
    Stalled,
)
from gradlog.views.health import analyze

#: a band and spike factor no series finding fits: `gradlog report` then judges only what close() wrote

UNSEEN = PartlyUpdated(
    "emb.weight", 0, 10, 20, tuple(range(10, 20)), Reason.NOT_IN_BATCH, "rows 10-19 (10 of 20) never changed"
)
PADDING = PartlyUpdated("emb.weight", 0, 1, 20, (0,), Reason.PADDING_IDX, "row 0 is padding_idx")
DEAD = PartlyUpdated("body.weight", 0, 2, 8, (3, 4), Reason.ZERO_GRAD, "output units 3-4 (2 of 8) never changed")


SCENARIOS = ("healthy", "never_updated", "stalled", "nan", "partly", "padding_only", "notes_only", "suspect_freeze")


def planted_run(scenario: str, writer: Any, log_dir: Path | None = None) -> gradlog.Report:
    """60 steps, measured every 2; `scenario` plants one bug (or none)."""
    torch.manual_seed(0)
    model = EmbeddingPlanted()
    if scenario != "never_updated":
        model.unused = nn.Identity()  # type: ignore[assignment]
    tail = {id(p) for p in model.tail.parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(
        [{"params": [p for p in trainable if id(p) not in tail]}, {"params": [p for p in trainable if id(p) in tail]}],
        lr=1e-2,
    )
    gl = gradlog.GradLogger(model, opt, writer=writer, every=2, log_dir=None if log_dir is None else str(log_dir))
    real = gl.report
    plant: dict[str, Any] = {}
    if scenario == "partly":
        plant["partly_updated"] = [UNSEEN, PADDING, DEAD]
    elif scenario == "notes_only":  # ids no batch contained and the padding row: notes, not problems
        plant["partly_updated"] = [UNSEEN, PADDING]
    elif scenario == "padding_only":
        plant["partly_updated"] = [PADDING]

    def report() -> gradlog.Report:
        rep = real()
        if scenario == "suspect_freeze":  # what the diagnosis says of a freeze that looks accidental
            plant["never_updated"] = [dataclasses.replace(r, suspect=True) for r in rep.never_updated]
        return dataclasses.replace(rep, **plant)

    gl.report = report  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(1)

    def loss(step: int) -> torch.Tensor:
        if scenario == "stalled" and step == 36:
            opt.param_groups[1]["lr"] = 0.0
        return mse(model, torch.randint(0, 20, (8, 5), generator=gen))

    def plant_nan(step: int) -> None:
        if scenario == "nan" and step >= 50:
            model.tail.bias.grad.fill_(float("nan"))  # type: ignore[union-attr]

    return train(opt, gl, 60, loss, after_backward=plant_nan)


EXPECT = {
    "healthy": True,
    "never_updated": False,
    "stalled": False,
    "nan": False,
    "partly": False,
    "padding_only": True,
    "notes_only": True,
    "suspect_freeze": False,
}


def summary_from_tensorboard(log_dir: Path) -> dict[str, str]:
    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    _, rows = parse_markdown_table(acc.Tensors("gradlog/summary")[-1].tensor_proto.string_val[0].decode())
    return {r[0]: r[1] for r in rows}


def check_report_command(path: Path, report: gradlog.Report, capsys: pytest.CaptureFixture[str]) -> None:
    """`gradlog report` on the run's files: exit status and verdict from the same judge as close()."""
    capsys.readouterr()
    code = main(["report", str(path), "--json"])  # warnings as close() recorded them, not re-judged
    out = json.loads(capsys.readouterr().out)
    assert code == (0 if report.healthy else 1)
    assert out["healthy"] is report.healthy
    assert out["verdict"] == report.verdict  # the line is close()'s, word for word
    want = report.to_dict()
    assert out["partly_updated"] == want["partly_updated"]
    assert out["stalled"] == want["stalled"]
    health = analyze(load(str(path)))
    assert health.closed is not None and health.closed.text == report.verdict


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_output_agrees_tensorboard(scenario: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log_dir = tmp_path / "tb"
    report = planted_run(scenario, "tensorboard", log_dir)
    printed = capsys.readouterr().out.strip().splitlines()
    assert report.healthy is EXPECT[scenario], report.verdict
    assert printed[-1] == report.verdict == judge(report).text  # the console line close() printed
    assert report.verdict.startswith(f"gradlog {'OK' if report.healthy else 'PROBLEM'}: ")
    summary = summary_from_tensorboard(log_dir)  # TensorBoard's own reader
    assert summary["verdict"] == report.verdict
    assert summary["healthy"] == str(report.healthy)
    assert summary["status"] == report.status
    check_report_command(log_dir, report, capsys)
    if scenario == "stalled":
        assert [(r.name, r.since_step, r.last_update_step, r.reason) for r in report.stalled] == [
            ("tail.weight", 36, 34, Reason.ZERO_LR),
            ("tail.bias", 36, 34, Reason.ZERO_LR),
        ]
    if scenario == "nan":
        assert report.first_nonfinite is not None and report.first_nonfinite.step == 50
        assert {r.reason for r in report.stalled} == {Reason.NONFINITE_GRAD}


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["healthy", "stalled", "partly", "suspect_freeze"])
def test_every_output_agrees_wandb(
    scenario: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], wandb_offline: Any
) -> None:
    from gradlog.readers.wandb_offline import find_run_files, read_finished_run
    from gradlog.writers.wandb import WandbWriter

    root = tmp_path / "wb"
    report = planted_run(scenario, WandbWriter(project="gradlog-verdict", log_dir=str(root), mode="offline"))
    assert capsys.readouterr().out.strip().splitlines()[-1] == report.verdict
    assert report.healthy is EXPECT[scenario]
    (run_file,) = find_run_files(root)
    run = read_finished_run(run_file)  # the offline file, read without a W&B server
    s = run.summary
    assert s["gradlog/verdict"] == report.verdict
    assert s["gradlog/healthy"] is report.healthy and s["gradlog/status"] == report.status
    assert s["gradlog/stalled"] == len(report.stalled) and s["gradlog/partly_updated"] == len(report.partly_updated)
    check_report_command(root, report, capsys)


# --- the judge on hand-built reports -------------------------------------------------------------------
def base(**kw: Any) -> Report:
    return Report(optimizer_steps=100, measured_steps=10, tracked_tensors=5, **kw)


FROZEN = NeverUpdated("f.weight", (2, 2), 4, Reason.FROZEN, "requires_grad is False")
STALL = Stalled("t.weight", 50, 45, Reason.ZERO_LR, "lr 0")


@pytest.mark.parametrize(
    ("kw", "healthy", "phrase"),
    [
        ({}, True, "all 5 tracked tensors were updated"),
        ({"never_updated": [FROZEN]}, True, "1 of 5 tensors never updated (frozen 1)"),
        ({"never_updated": [dataclasses.replace(FROZEN, suspect=True)]}, False, "never updated (frozen_suspect 1)"),
        ({"never_updated": [dataclasses.replace(FROZEN, reason=Reason.NO_GRAD)]}, False, "(no_grad 1)"),
        ({"partly_updated": [PADDING]}, True, "1 tensor partly never updated (padding_idx 1)"),
        (
            {"partly_updated": [PADDING, UNSEEN]},
            True,
            "1 tensor partly never updated (2 causes: padding_idx 1, not_in_batch 1)",
        ),
        ({"partly_updated": [UNSEEN, DEAD]}, False, "2 tensors partly never updated (not_in_batch 1, zero_grad 1)"),
        ({"stalled": [STALL]}, False, "1 tensor stopped learning (zero_lr 1), the first from step 50"),
        ({"first_nonfinite": NonFinite(7, "t.weight", 3)}, False, "first non-finite gradient at step 7 in t.weight"),
        ({"skipped_steps": 2}, True, "2 optimizer steps skipped"),
        ({"error": "RuntimeError: boom"}, False, "the diagnosis failed (RuntimeError: boom)"),
    ],
)
def test_judge(kw: dict[str, Any], healthy: bool, phrase: str) -> None:
    report = base(**kw)
    v = judge(report)
    assert (v.healthy, v.status) == (healthy, "OK" if healthy else "PROBLEM")
    assert phrase in v.text and v.text.startswith(f"gradlog {v.status}: ")
    assert v.text.endswith(")") and "(100 optimizer steps, 10 measured" in v.text
    assert (report.healthy, report.status, report.verdict) == (v.healthy, v.status, v.text)
    assert bool(v.problems) is not healthy
    assert report.to_dict()["healthy"] is healthy


# --- presentation ---------------------------------------------------------------------------------------
def test_console_and_markdown_show_all_three_tables_then_the_verdict() -> None:
    scattered = PartlyUpdated(
        "fc.weight", 1, 7, 64, (0, 2, 4, 6, 8, 10, 40), Reason.ZERO_GRAD, "columns 0, 2, ... never changed"
    )
    report = base(
        never_updated=[dataclasses.replace(FROZEN, reason=Reason.NO_GRAD, detail="grad None")],
        partly_updated=[UNSEEN, scattered, PartlyUpdated("b", None, 2, 8, (3, 4), Reason.ZERO_GRAD, "dead")],
        stalled=[STALL],
    )
    text = report.table()
    blocks = text.split("\n\n")
    assert blocks[0].startswith("Never updated (1 of 5 tensors):\nname ")
    assert blocks[1].startswith("Partly updated (3 records: slices that never changed):\n")
    # 100+ columns wide with its detail: the detail column prints under each row (report.CONSOLE_WIDTH)
    assert blocks[1].splitlines()[1].split() == [c for c in PARTLY_COLUMNS if c != "detail"]
    assert blocks[2].startswith("Stopped learning (1 tensor):\n")
    assert blocks[2].splitlines()[1].split() == STALLED_COLUMNS
    assert blocks[3].splitlines()[-1] == report.verdict and text.splitlines()[-1] == report.verdict
    assert blocks[3].splitlines()[0].startswith("note: partly.not_in_batch in 1 tensor: emb.weight")  # never hidden
    partly_lines = blocks[1].splitlines()[3::2]
    assert len(partly_lines) == 3  # one row per record, its detail on the line under it
    assert [line.strip() for line in blocks[1].splitlines()[4::2]] == [UNSEEN.detail, scattered.detail, "dead"]
    assert "10-19" in partly_lines[0] and "rows" in partly_lines[0]
    assert "0, 2, 4, 6, ... (+3 more ranges)" in partly_lines[1] and "columns" in partly_lines[1]
    assert "3-4" in partly_lines[2] and "elements" in partly_lines[2]
    md = report.markdown()
    for head in (
        "**Never updated (1 of 5 tensors)**",
        "**Partly updated (3 records",
        "**Stopped learning (1 tensor)**",
    ):
        assert head in md
    assert md.splitlines()[-1] == f"**{report.verdict}**"
    assert "| t.weight | 50 | 45 | zero_lr | lr 0 |" in md
    # a healthy report is just its verdict
    assert base().table() == base().verdict


def test_to_dict_uses_real_json_types() -> None:
    report = base(
        never_updated=[dataclasses.replace(FROZEN, suspect=True)],
        partly_updated=[UNSEEN, dataclasses.replace(PADDING, dim=None)],
        stalled=[STALL],
        first_nonfinite=NonFinite(7, "t.weight", 3),
    )
    d = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert d["healthy"] is False and d["status"] == "PROBLEM"
    assert d["never_updated"][0]["suspect"] is True and d["never_updated"][0]["intentional"] is False
    assert d["partly_updated"][0] == {
        "name": "emb.weight",
        "dim": 0,
        "never": 10,
        "total": 20,
        "indices": list(range(10, 20)),
        "reason": "not_in_batch",
        "detail": UNSEEN.detail,
        "intentional": False,
        "severity": "note",
    }
    assert d["partly_updated"][1]["dim"] is None and d["partly_updated"][1]["intentional"] is True
    assert d["stalled"] == [
        {
            "name": "t.weight",
            "since_step": 50,
            "last_update_step": 45,
            "reason": "zero_lr",
            "detail": "lr 0",
            "severity": "problem",
        }
    ]
    assert d["first_nonfinite"] == {"step": 7, "name": "t.weight", "count": 3}


def test_index_ranges_round_trip_and_cut() -> None:
    rng = random.Random(0)
    for _ in range(300):
        idx = sorted(rng.sample(range(200), rng.randrange(0, 60)))
        text = format_ranges(idx)
        assert parse_ranges(text) == tuple(idx)
        runs = text.count(",") + 1 if idx else 0
        cut = format_ranges(idx, RANGES_SHOWN)
        assert (
            cut == text
            if runs <= RANGES_SHOWN
            else cut.endswith(f"(+{runs - RANGES_SHOWN} more range{'s' * (runs - RANGES_SHOWN != 1)})")
        )
    assert format_ranges([50, 51, 52, 99, 0]) == "0, 50-52, 99"
    with pytest.raises(ValueError, match="bad index range '9-3'"):
        parse_ranges("9-3")


def test_a_single_tensor_is_said_in_the_singular(tmp_path) -> None:
    """One tracked tensor: "the 1 tracked tensor was updated" (it said "all 1 tracked tensors were updated"),
    in a run and in gradlog diff."""
    from gradlog.compare.checkpoints import diff, open_all

    assert Report(optimizer_steps=3, measured_steps=3, tracked_tensors=1).verdict.startswith(
        "gradlog OK: the 1 tracked tensor was updated ("
    )
    w = nn.Parameter(torch.ones(3))
    paths = []
    for k in range(2):
        paths.append(str(tmp_path / f"{k}.pt"))
        torch.save({"w": w.detach().clone()}, paths[-1])
        with torch.no_grad():
            w.add_(1.0)
    assert diff(open_all(paths)).verdict == "gradlog diff OK: the 1 compared tensor changed across 2 checkpoints"


# --- issue 41: the words of the verdict line ---------------------------------------------------------------
def test_a_logger_that_saw_no_step_says_it_measured_nothing():
    """README's options block copied as is (a logger made and closed with no step between) printed
    'gradlog PROBLEM: 1 of 1 tensors never updated (unknown 1) (0 optimizer steps, 0 measured)'."""
    model = nn.Linear(3, 2)
    gl = gradlog.GradLogger(model, torch.optim.SGD(model.parameters(), lr=0.1), writer="memory", print_report=False)
    report = gl.close()
    assert report.healthy, report.verdict
    assert report.verdict == (
        "gradlog OK: nothing measured, so no answer on the 2 tracked tensors (0 optimizer steps, 0 measured)"
    )
    # the console is that line alone: a "Never updated (2 of 2 tensors)" table of `unknown` above it read as the
    # opposite; the records stay in to_dict() and the written tables
    assert str(report) == report.verdict
    assert [r["reason"] for r in report.to_dict()["never_updated"]] == ["unknown", "unknown"]
    # a finding that needs no measurement still is one: a tensor left out of the optimizer
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    report = gradlog.GradLogger(model, opt, writer="memory", print_report=False).close()
    assert not report.healthy and "not_in_optimizer 2" in report.verdict


def test_counts_meet_their_nouns_in_the_singular():
    """'1 optimizer steps', '1 of 1 tensors', 'in all 2 checkpoints' (issue 41)."""
    from gradlog.verdict.judge import all_of

    model = nn.Sequential(nn.Linear(3, 2))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.0)
    gl = gradlog.GradLogger(model, opt, writer="memory", every=1, print_report=False, include="0.weight")
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    gl.log(0)
    verdict = gl.close().verdict
    assert "1 of 1 tensor never updated (zero_lr 1)" in verdict and "(1 optimizer step, 1 measured" in verdict
    assert [all_of(n, "checkpoint") for n in (1, 2, 3)] == ["the 1 checkpoint", "both checkpoints", "all 3 checkpoints"]


def test_the_report_header_and_the_never_logged_warning_count_in_the_singular(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gradlog report` on a run of one tensor said "(tensorboard, 1 tensors, ...)"; a logger whose log() was
    never called warned of "1 measured step(s)" (issue 41 point 10)."""
    import warnings

    model = nn.Linear(3, 2, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for log in (True, False):
        gl = gradlog.GradLogger(model, opt, log_dir=str(tmp_path / str(log)), every=1, print_report=False)
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if log:
                gl.log(0)
            gl.close()
        said = [str(w.message) for w in caught if "never called" in str(w.message)]
        assert len(said) == (not log)
        assert all(w.startswith("gradlog: 1 measured step, but GradLogger.log(step)") for w in said), said
    assert main(["report", str(tmp_path / "True")]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert head == f"gradlog report: {tmp_path / 'True'} (tensorboard, 1 tensor, 1 measured)", head
