"""`gradlog report`: what it reads back from disk equals what close() said in the same run; bad input never crashes."""

from __future__ import annotations

import json
import math
import os
import statistics
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from catalogue import DeadUnits, ResidualPlanted, random_mse, train
from torch import nn

import gradlog
from gradlog.cli.entry import main
from gradlog.readers.run import RunData, load, parse_markdown_table
from gradlog.runformat import tags
from gradlog.verdict.report import COLUMNS, WARNING_KINDS
from gradlog.views.health import analyze

ROOT = Path(__file__).resolve().parent.parent
PLANTED = {
    "frozen.weight": "frozen",
    "frozen.bias": "frozen",
    "unused.weight": "no_grad",
    "orphan.weight": "not_in_optimizer",
}


def planted_run(
    writer: Any,
    log_dir: Path | None = None,
    steps: int = 40,
    every: int = 2,
    nan_at: int | None = None,
    spike_at: int | None = None,
    blocks: int = 2,
    bugs: bool = True,
    lr: float = 5e-4,
) -> tuple[gradlog.MemoryWriter, gradlog.Report]:
    """Train `ResidualPlanted`; also log to a MemoryWriter, the in-memory copy of the very same run."""
    torch.manual_seed(0)
    model = ResidualPlanted(blocks=blocks)
    if bugs:
        model.frozen.requires_grad_(False)
        params = [p for n, p in model.named_parameters() if p.requires_grad and not n.startswith("orphan")]
    else:
        model.unused = nn.Identity()  # type: ignore[assignment]
        params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=lr)
    mem = gradlog.MemoryWriter()
    writers = [mem, *([writer] if writer is not None else [])]
    gl = gradlog.GradLogger(
        model,
        opt,
        writer=writers,
        every=every,
        log_dir=None if log_dir is None else str(log_dir),
        print_report=False,
        alerts=gradlog.AlertOptions(ratio_band=BAND),  # the fixed band, so the hand check below can follow it
    )
    gen = torch.Generator().manual_seed(1)

    def plant(step: int) -> None:
        if spike_at == step:
            model.blocks[-1].weight.grad.mul_(1000.0)
        if nan_at is not None and step >= nan_at:
            model.blocks[0].bias.grad.fill_(float("nan"))

    report = train(opt, gl, steps, random_mse(model, 32, 16, gen=gen), plant)
    return mem, report


def report_json(path: Path | str, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, dict[str, Any]]:
    code = main(["report", str(path), "--json", *extra])
    out = capsys.readouterr().out
    return code, json.loads(out)


BAND = (1e-4, 1e-2)


def hand_first_spike(series: list[tuple[int, float]], factor: float, history: int = 5) -> int | None:
    """The first step whose value, in log10, stands above both the median of the last <= 64 earlier finite
    non-zero values and the previous one by more than max(log10 factor, 5 x 1.4826 x the median |change|
    between consecutive ones of those values)."""
    seen: list[float] = []
    for step, v in series:
        if v == v and abs(v) != float("inf") and v != 0:
            x = math.log10(v)
            if len(seen) >= history:
                window = seen[-64:]
                noise = 5 * 1.4826 * statistics.median(abs(b - a) for a, b in zip(window, window[1:]))
                if x - max(statistics.median(window), window[-1]) > max(math.log10(factor), noise):
                    return step
            seen.append(x)
    return None


def hand_first_out_of_band(
    series: list[tuple[int, float]], lo: float, hi: float, vector: bool, patience: int = 3
) -> int | None:
    """The first step at which the ratio was out of the tensor's band (10x wider for 1-D) `patience` times in a row."""
    if vector:
        lo, hi = lo / 10, hi * 10
    high = low = 0
    for step, v in series:
        if v != v:
            continue
        high = high + 1 if v > hi else 0
        low = low + 1 if v < lo else 0
        if high >= patience or low >= patience:
            return step
    return None


def assert_matches_close(out: dict[str, Any], report: gradlog.Report, mem: gradlog.MemoryWriter) -> None:
    """The report read from disk says what close() said, and what the in-memory series say."""
    assert [[str(r[c]) for c in COLUMNS] for r in out["never_updated"]] == [r.row() for r in report.never_updated]
    assert all(isinstance(r["numel"], int) for r in out["never_updated"])
    assert {r["name"]: r["reason"] for r in out["never_updated"]} == PLANTED
    assert report.first_nonfinite is not None
    assert out["first_nonfinite"] == {"step": report.first_nonfinite.step, "tensor": report.first_nonfinite.name}
    assert out["summary"]["verdict"] == report.verdict
    assert out["summary"]["healthy"] is report.healthy  # real JSON booleans and numbers, not strings
    assert out["summary"]["measured_steps"] == report.measured_steps
    assert out["measured_steps"] == report.measured_steps
    assert out["problems"] is True and out["healthy"] is False
    # Warnings: exactly what training warned about, and what the series say by hand.
    lo, hi = BAND
    found = {(w["name"], w["kind"]): w["step"] for w in out["out_of_band"] + out["spikes"]}
    assert found == {(a.name, a.kind): a.step for a in report.alerts if a.kind in WARNING_KINDS}
    never = set(PLANTED)
    nan_from = report.first_nonfinite.step
    for tag, pts in mem.scalars.items():
        per_tensor = tags.split(tag)
        if per_tensor is None:
            continue
        kind, name = per_tensor
        if name in never:
            continue
        pts = [(st, v) for st, v in pts if st < nan_from]  # NaN steps are the non-finite finding
        if kind == "update_ratio":
            first = hand_first_out_of_band(pts, lo, hi, vector=name.endswith(".bias"))
            got = [found.get((name, k)) for k in ("update_ratio_high", "update_ratio_low")]
            assert first == min((g for g in got if g is not None), default=None), name
        elif kind == "grad_norm":
            assert hand_first_spike(pts, out["spike_factor"]) == found.get((name, "grad_norm_spike")), name
    assert found[("blocks.1.weight", "grad_norm_spike")] == 12  # the planted spike
    assert out["verdict"].startswith("gradlog PROBLEM: first non-finite gradient at step ")


def test_tensorboard_readback_equals_the_report_close_returned(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log_dir = tmp_path / "tb"
    mem, report = planted_run("tensorboard", log_dir, nan_at=30, spike_at=12)
    code, out = report_json(log_dir, capsys)
    assert code == 1
    assert out["backend"] == "tensorboard" and out["skipped"] == []
    assert_matches_close(out, report, mem)
    # A single event file works the same.
    (event_file,) = [p for p in log_dir.iterdir() if "tfevents" in p.name]
    code, again = report_json(event_file, capsys)
    assert code == 1 and again["never_updated"] == out["never_updated"] and again["spikes"] == out["spikes"]
    # Re-judged from the series with the same rules (the 1-D band aside), the spike is found again.
    code, rejudged = report_json(log_dir, capsys, "--spike", "10")
    assert code == 1 and [(s["name"], s["step"]) for s in rejudged["spikes"]] == [
        (s["name"], s["step"]) for s in out["spikes"]
    ]


def test_healthy_run_exits_0_and_says_ok(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log_dir = tmp_path / "tb"
    _, report = planted_run("tensorboard", log_dir, bugs=False)
    assert report.healthy
    assert main(["report", str(log_dir)]) == 0
    text = capsys.readouterr().out
    assert "Never updated: none" in text and "First non-finite gradient: none" in text
    assert text.strip().splitlines()[-1].startswith("gradlog OK: all ")
    # A band that no update ratio fits gives warnings, re-judged from the series: listed, exit still 0.
    assert main(["report", str(log_dir), "--band", "1e-9", "1e-8"]) == 0
    text = capsys.readouterr().out
    assert "Warning: Update ratio outliers (band 1e-09..1e-08), re-judged from the series" in text
    assert "gradlog OK: " in text and " warnings (update_ratio_high " in text


def _block(text: str, heading: str) -> list[str]:
    """The lines of the table under the line starting with `heading`, up to the next blank line, unindented."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith(heading))
    block = []
    for line in lines[at + 1 :]:
        if not line.strip():
            break
        block.append(line.strip())
    return block


def test_partly_and_stalled_tables_hold_the_rows_close_printed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The two tables `gradlog report` heads itself, read back from the files: the rows close() printed."""
    torch.manual_seed(0)
    model = DeadUnits()  # units 0-7 of fc1 never fire
    opt = torch.optim.SGD([{"params": model.fc1.parameters()}, {"params": model.fc2.parameters()}], lr=0.05)
    log_dir = tmp_path / "tb"
    gl = gradlog.GradLogger(model, opt, every=1, log_dir=str(log_dir), print_report=False)

    def stop_fc2(step: int) -> None:
        if step == 4:
            opt.param_groups[1]["lr"] = 0.0  # fc2 learns for 5 steps, then stops

    report = train(opt, gl, 10, random_mse(model, 16, 16, gen=torch.Generator().manual_seed(1)), after_step=stop_fc2)
    planted = {("fc1.weight", 0), ("fc1.bias", None), ("fc2.weight", 1)}
    assert {(p.name, p.dim, p.indices) for p in report.partly_updated} == {(n, d, tuple(range(8))) for n, d in planted}
    assert {(s.name, s.since_step) for s in report.stalled} == {("fc2.weight", 5), ("fc2.bias", 5)}
    printed = report.table()
    assert main(["report", str(log_dir)]) == 1
    text = capsys.readouterr().out
    # one row per cause (fc1's dead units in three tensors; fc2's two tensors stopped by one lr), as close()
    # printed them; the details under the rows are wrapped 2 columns narrower inside the report's indent
    partly = _block(text, "Partly updated (1 finding in 3 records):")
    assert partly[:3] == _block(printed, "Partly updated (1 finding in 3 records: slices that never changed):")[:3]
    assert " ".join(partly).split() == " ".join(_block(printed, "Partly updated (1 finding in 3 records: ")).split()
    stopped = _block(text, "Stopped learning (1 finding in 2 tensors):")
    assert stopped[:3] == _block(printed, "Stopped learning (1 finding in 2 tensors):")[:3]
    assert " ".join(stopped).split() == " ".join(_block(printed, "Stopped learning (1 finding in ")).split()
    assert partly[2].split()[0] == "fc1" and stopped[2].split()[0] == "fc2"
    assert "Partly updated (1 finding in 3 records:\n" not in text and "Stopped slices" not in text


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    from PIL import Image

    with Image.open(path) as im:  # and the whole file decodes
        im.load()
        assert im.size == (width, height)
    return width, height


def test_plot_option_writes_a_sensible_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    log_dir = tmp_path / "tb"
    planted_run("tensorboard", log_dir, nan_at=30, spike_at=12)
    out_png = tmp_path / "run.png"
    assert main(["report", str(log_dir), "--plot", str(out_png)]) == 1
    assert f"plot written to {out_png}" in capsys.readouterr().err
    width, height = _png_size(out_png)
    assert 800 <= width <= 2000 and 500 <= height <= 2500


def _label_boxes(fig: Any, axis: Any) -> list[Any]:
    renderer = fig.canvas.get_renderer()
    return [t.get_window_extent(renderer) for t in axis.get_yticklabels() if t.get_visible() and t.get_text()]


@pytest.mark.parametrize("blocks", [1, 199])
def test_plot_labels_never_overlap_with_few_or_many_tensors(tmp_path: Path, blocks: int) -> None:
    """blocks=1 -> 9 tensors, blocks=199 -> 405: every label box is disjoint, never-updated rows are named."""
    pytest.importorskip("matplotlib")
    from gradlog.views import plot

    mem, report = planted_run(None, steps=12, every=2, blocks=blocks)
    never = {r.name: r.reason.value for r in report.never_updated}
    fig = plot.figure(mem.scalars, never)
    fig.canvas.draw()
    ax_ratio, ax_heat = fig.axes[0], fig.axes[1]
    left = _label_boxes(fig, ax_heat)
    right_axes = [a for a in ax_heat.child_axes if a.get_ylabel().startswith("never updated")]
    assert len(right_axes) == 1
    right = _label_boxes(fig, right_axes[0])
    for boxes in (left, right):
        ordered = sorted(boxes, key=lambda b: b.y0)
        assert all(a.y1 <= b.y0 + 0.5 for a, b in zip(ordered, ordered[1:])), "tick labels overlap"
    # frozen tensors have no series (not measured), but the plot still names them as never updated
    n_tensors = len({t.split("/", 2)[2] for t in mem.scalars if t.startswith("weights/weight_norm/")} | set(never))
    if blocks == 1:
        assert len(left) == n_tensors  # few tensors: every one is named
        assert {t.get_text().split(" ")[1].rstrip(":") for t in right_axes[0].get_yticklabels()} == set(never)
    else:
        assert n_tensors > 400 and 20 <= len(left) < n_tensors
        assert right  # the never-updated rows are still named on the right
    # The ratio panel shows the band and a legend that fits inside the figure.
    legend = ax_ratio.get_legend()
    assert legend is not None
    assert fig.bbox.contains(*legend.get_window_extent().p1)
    path = tmp_path / f"plot-{blocks}.png"
    fig.savefig(path)
    width, height = _png_size(path)
    assert width == 1300 and 600 <= height <= 2000


# --- bad input: a clear message and exit 2, never a traceback -----------------------------------------
def _bad(args: list[str], capsys: pytest.CaptureFixture[str], match: str) -> str:
    code = main(["report", *args])
    captured = capsys.readouterr()
    assert code == 2, captured
    assert "Traceback" not in captured.err + captured.out
    assert match in captured.err, captured.err
    return captured.out


def test_missing_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _bad([str(tmp_path / "nope")], capsys, "does not exist")


def test_folder_without_any_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    _bad([str(tmp_path)], capsys, "holds no TensorBoard event file and no W&B offline run")


def test_file_that_is_not_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "notes.txt"
    f.write_text("hello")
    _bad([str(f)], capsys, "neither a TensorBoard event file")


def test_event_file_from_another_program_has_no_gradlog_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tmp_path)) as w:
        for step in range(3):
            w.add_scalar("loss", 1.0 / (step + 1), step)
    _bad([str(tmp_path)], capsys, "holds no gradlog data (found loss)")


def test_empty_and_garbage_event_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "a" / "events.out.tfevents.1.host"
    empty.parent.mkdir()
    empty.write_bytes(b"")
    _bad([str(empty)], capsys, "holds no gradlog data")
    garbage = tmp_path / "b" / "events.out.tfevents.2.host"
    garbage.parent.mkdir()
    garbage.write_bytes(os.urandom(4096))
    _bad([str(garbage)], capsys, "corrupt record header at byte 0")


def test_folder_with_two_runs_asks_for_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    planted_run("tensorboard", tmp_path / "run1", steps=4)
    planted_run("tensorboard", tmp_path / "run2", steps=4)
    err = _bad([str(tmp_path)], capsys, "holds 2 runs; pass one of them")
    del err


def _single_event_file(log_dir: Path) -> Path:
    (f,) = [p for p in log_dir.iterdir() if "tfevents" in p.name]
    return f


def test_truncated_event_file_gives_a_partial_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log_dir = tmp_path / "tb"
    planted_run("tensorboard", log_dir, nan_at=30, spike_at=12)
    f = _single_event_file(log_dir)
    f.write_bytes(f.read_bytes()[:-7])  # a torn last record, as a killed writer leaves it
    code = main(["report", str(log_dir)])
    captured = capsys.readouterr()
    assert code == 2 and "Traceback" not in captured.err
    assert "Skipped (unreadable):" in captured.out and "truncated last record at byte" in captured.out
    assert "the report above is partial" in captured.err
    # What was before the torn record is still reported: the NaN at step 30 and the planted spike.
    assert "First non-finite gradient: step 30, blocks.0.bias" in captured.out
    assert "blocks.1.weight" in captured.out


def test_corrupt_record_in_the_middle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One flipped byte loses one record: reading resumes at the next intact record and says what it skipped."""
    log_dir = tmp_path / "tb"
    mem, _ = planted_run("tensorboard", log_dir)
    f = _single_event_file(log_dir)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    run = load(str(log_dir))
    assert len(run.skipped) == 1 and "corrupt record" in run.skipped[0] and "reading resumed at byte" in run.skipped[0]
    written = dict(mem.scalars["weights/grad_norm/head.weight"])
    read = dict(run.scalars["weights/grad_norm/head.weight"])
    assert set(read) < set(written) and len(written) - len(read) == 1  # one step's record is lost, no more
    # The points that were read are the points that were written (float32 on disk).
    for step, value in read.items():
        assert value == pytest.approx(written[step], rel=1e-6)
    code = main(["report", str(log_dir), "--json"])
    captured = capsys.readouterr()
    assert code == 2 and "Traceback" not in captured.err
    out = json.loads(captured.out)
    # The tables gradlog wrote at close, after the damage, are still there.
    assert out["healthy"] is False and out["never_updated_known"] is True and out["skipped"]
    assert {r["name"] for r in out["never_updated"]} == set(PLANTED)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--band", "1e-2", "1e-4"], "--band LO HI must satisfy 0 < low < high"),
        (["--band", "0", "1"], "--band LO HI must satisfy 0 < low < high"),
        (["--spike", "1"], "--spike must be a factor > 1"),
    ],
)
def test_bad_options(tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], match: str) -> None:
    log_dir = tmp_path / "tb"
    planted_run("tensorboard", log_dir, steps=4)
    _bad([str(log_dir), *extra], capsys, match)


def test_command_line_exit_status_and_no_traceback(tmp_path: Path) -> None:
    """Through the real entry point (`python -m gradlog`), as a script would call it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "gradlog", "report", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_markdown_table_round_trip_with_bars_and_backslashes() -> None:
    from gradlog.writers.tb_format import markdown_table

    rows = [["a|b", "c\\d", ""], ["x", "y  z", "w"]]
    cols, back = parse_markdown_table(markdown_table(["one", "two", "three"], rows))
    assert cols == ["one", "two", "three"]
    assert back == [["a|b", "c\\d", ""], ["x", "y z", "w"]]  # the writer folds runs of whitespace


def test_memory_run_data_gives_the_same_findings_as_disk(tmp_path: Path) -> None:
    log_dir = tmp_path / "tb"
    mem, _ = planted_run("tensorboard", log_dir, nan_at=30, spike_at=12)
    disk = analyze(load(str(log_dir))).to_dict()
    memory = analyze(RunData.from_memory(mem)).to_dict()
    for key in ("never_updated", "first_nonfinite", "summary", "measured_steps", "tensors", "verdict"):
        assert disk[key] == memory[key], key
    assert [(s["name"], s["step"]) for s in disk["spikes"]] == [(s["name"], s["step"]) for s in memory["spikes"]]
    assert [o["name"] for o in disk["out_of_band"]] == [o["name"] for o in memory["out_of_band"]]


# --- W&B offline ---------------------------------------------------------------------------------------
def wandb_run(tmp_path: Path, **kwargs: Any) -> tuple[Path, gradlog.MemoryWriter, gradlog.Report]:
    """A planted-bug run logged to W&B offline; returns the folder holding wandb/offline-run-*."""
    from gradlog.readers.wandb_offline import find_run_files, read_finished_run
    from gradlog.writers.wandb import WandbWriter

    root = tmp_path / "wb"
    writer = WandbWriter(project="gradlog-report-test", log_dir=str(root), mode="offline")
    mem, report = planted_run(writer, **kwargs)
    (run_file,) = find_run_files(root)
    read_finished_run(run_file)  # wandb's service finishes writing the file shortly after finish() returns
    return root, mem, report


@pytest.mark.slow
def test_wandb_offline_readback_equals_the_report_close_returned(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], wandb_offline: Any
) -> None:
    root, mem, report = wandb_run(tmp_path, nan_at=30, spike_at=12)
    code, out = report_json(root, capsys)  # the folder wandb.init(dir=...) got; the run dir is found inside
    assert code == 1
    assert out["backend"] == "wandb" and out["skipped"] == []
    assert_matches_close(out, report, mem)
    (run_dir,) = (root / "wandb").glob("offline-run-*")
    code, again = report_json(run_dir, capsys)
    assert code == 1 and again["never_updated"] == out["never_updated"] and again["verdict"] == out["verdict"]
    # The alerts table came through too, under its own key (W&B already holds the alert count as a scalar).
    run = load(str(run_dir))
    columns, rows = run.tables["gradlog/alerts"]
    assert columns == ["step", "kind", "name", "detail"] and ["30", "nonfinite_grad", "blocks.0.bias"] in [
        r[:3] for r in rows
    ]
    assert run.scalars["gradlog/alerts"][-1][1] == len(rows)


@pytest.mark.slow
def test_wandb_damaged_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str], wandb_offline: Any) -> None:
    root, _, report = wandb_run(tmp_path, nan_at=30)
    (run_dir,) = (root / "wandb").glob("offline-run-*")
    (run_file,) = run_dir.glob("*.wandb")
    data = run_file.read_bytes()
    # A torn tail without the exit record (the process was killed): a crashed run, INCOMPLETE and exit 1,
    # with what was read reported and the cut-off record named as a note, not as damage.
    run_file.write_bytes(data[: len(data) - 200])
    code = main(["report", str(run_dir)])
    captured = capsys.readouterr()
    assert code == 1 and "Traceback" not in captured.err
    assert "Skipped (unreadable):" not in captured.out and "the W&B run has no exit record" in captured.out
    assert report.first_nonfinite is not None
    assert f"First non-finite gradient: step {report.first_nonfinite.step}" in captured.out
    # The table file the history points at is gone: named as skipped.
    run_file.write_bytes(data)
    for f in (run_dir / "files" / "media" / "table").rglob("never_updated*.table.json"):
        f.unlink()
    code = main(["report", str(run_dir)])
    captured = capsys.readouterr()
    assert code == 2 and "table gradlog/never_updated: media/table/" in captured.out
    # Not a W&B file at all.
    run_file.write_bytes(b"this is not a wandb file" * 10)
    _bad([str(run_dir)], capsys, "is not a W&B run file")


def test_lost_summary_table_falls_back_to_the_series() -> None:
    """The summary table is written last at close, so a cut-off file loses it first while the other final
    tables survive: the first NaN and the step counts then come from the series, and a note says so."""
    mem, report = planted_run(gradlog.MemoryWriter(), nan_at=30)
    run = RunData.from_memory(mem)
    assert "gradlog/summary" in run.tables
    del run.tables["gradlog/summary"]
    health = analyze(run)
    assert report.first_nonfinite is not None and health.first_nonfinite is not None
    assert (health.first_nonfinite.step, health.first_nonfinite.tensor) == (
        report.first_nonfinite.step,
        report.first_nonfinite.name,
    )
    assert health.measured_steps == report.measured_steps
    assert health.closed is not None and f"first non-finite gradient at step {report.first_nonfinite.step}" in (
        health.closed.text
    )
    assert f" optimizer steps, {report.measured_steps} measured" in health.closed.text  # optimizer: a lower bound
    assert "summary table written at close is missing" in " ".join(run.notes)


def test_rejudged_series_with_gaps_and_a_step_written_twice() -> None:
    """The re-judging walks every tensor's series step by step: a tensor measured only on some steps, and a
    step written twice (a resumed run: the last value counts), give the spikes found by hand."""
    from gradlog.views.health import replay

    a = [(s, 100.0 if s == 12 else 1.0) for s in range(20)]
    b = [(s, 100.0 if s == 14 else 1.0) for s in range(0, 20, 2)]
    b_written = [*b[:3], (6, 500.0), *b[3:]]  # step 6 first written as a spike, then rewritten as 1.0
    ratio = [(s, 1e-3) for s in range(20)]
    gn, ur = tags.prefix("grad_norm"), tags.prefix("update_ratio")
    run = RunData(path="<hand>", backend="memory", scalars={gn + "a": a, gn + "b": b_written, ur + "a": ratio})
    fired = replay(run, (1e-4, 1e-2), spike_factor=10.0)
    spikes = {(x.name, x.step) for x in fired if x.kind == "grad_norm_spike"}
    assert spikes == {("a", hand_first_spike(a, 10.0)), ("b", hand_first_spike(b, 10.0))} == {("a", 12), ("b", 14)}


def test_plot_draws_a_tensor_left_out_of_the_optimizer_on_the_no_update_line() -> None:
    """A tensor in no param group has a gradient and no update-ratio series: the ratio panel must still show
    it, dashed red on the 'no update' line at the steps its gradient was measured, not leave it out."""
    pytest.importorskip("matplotlib")
    from gradlog.views import plot

    torch.manual_seed(0)
    model = nn.ModuleDict({"kept": nn.Linear(4, 4), "left_out": nn.Linear(4, 4)})
    opt = torch.optim.SGD(model["kept"].parameters(), lr=0.1)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=2, print_report=False)
    steps = []
    for step in range(10):
        x = torch.randn(8, 4)
        (model["kept"](x).square().mean() + model["left_out"](x).square().mean()).backward()
        opt.step()
        gl.log(step)
        opt.zero_grad()
        steps.append(step)
    report = gl.close()
    never = {r.name: r.reason.value for r in report.never_updated}
    assert set(never) == {"left_out.weight", "left_out.bias"}
    fig = plot.figure(mem.scalars, never)
    lines = {ln.get_label().split("  ")[0]: ln for ln in fig.axes[0].get_lines()}
    measured = sorted(s for s, _ in mem.scalars[tags.prefix("grad_norm") + "left_out.weight"])
    kept = lines["kept.weight"]
    for name in never:
        line = lines[name]
        assert line.get_linestyle() == "--" and list(line.get_xdata()) == measured
        floor = set(line.get_ydata())
        assert len(floor) == 1 and next(iter(floor)) < min(y for y in kept.get_ydata() if math.isfinite(y))
