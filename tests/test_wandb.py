"""The W&B writer, proven with the real wandb package in offline mode: what gradlog sent is read back
from the run-*.wandb file with gradlog's own reader and compared with a MemoryWriter of the same run."""

from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import catalogue
import numpy as np
import pytest
import torch
from catalogue import InfPlanted
from torch import nn

import gradlog
from gradlog.measure.histogram import Histogram
from gradlog.readers.run import load
from gradlog.readers.wandb_offline import (
    OfflineRun,
    WandbFileError,
    find_run_files,
    read_chunks,
    read_finished_run,
    read_offline_run,
)
from gradlog.writers.wandb import EDGE_RESOLUTION, StepPayload, histogram_bytes, histogram_payload, split_payload

wandb = pytest.importorskip("wandb")

STEPS = 12
EVERY = 2
POISON_STEP = 6  # optimizer step whose gradients of `bad` and `worse` get Inf entries


def offline_env(mp: pytest.MonkeyPatch, root: Path) -> None:
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_DIR", str(root))
    mp.setenv("WANDB_SILENT", "true")
    mp.setenv("WANDB_CONFIG_DIR", str(root / "config"))
    mp.setenv("WANDB_CACHE_DIR", str(root / "cache"))
    mp.setenv("WANDB_DATA_DIR", str(root / "data"))


@pytest.fixture(autouse=True)
def no_leftover_run() -> Iterator[None]:
    """A test that fails half-way must not leave its run active for the next one (gradlog would adopt it)."""
    yield
    if wandb.run is not None:
        wandb.run.finish()


def train(writer: Any, steps: int = STEPS, after_log: Any = None, **kwargs: Any) -> gradlog.Report:
    torch.manual_seed(0)
    model = InfPlanted()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad and p is not model.unused.weight], lr=0.1)
    state = {"step": 0}

    def poison(index: slice) -> Any:
        def hook(g: torch.Tensor) -> torch.Tensor:
            if state["step"] == POISON_STEP:
                g = g.clone()
                g[index] = math.inf
            return g

        return hook

    model.bad.register_hook(poison(slice(1, 2)))
    model.worse.register_hook(poison(slice(None)))
    out = gradlog.Output(writer, options=kwargs.pop("writer_options", {}), strict=kwargs.pop("strict", False))
    gl = gradlog.GradLogger(model, opt, writer=out, every=EVERY, print_report=False, **kwargs)

    def loss(i: int) -> torch.Tensor:
        state["step"] = i
        value: torch.Tensor = model(torch.randn(5, 4))  # InfPlanted returns its own loss
        return value

    return catalogue.train(opt, gl, steps, loss, after_log=after_log)


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[gradlog.MemoryWriter, OfflineRun, gradlog.Report]:
    """One training run logged to a MemoryWriter and, in the same run, to W&B offline."""
    root = tmp_path_factory.mktemp("wandb_offline")
    mem = gradlog.MemoryWriter()
    with pytest.MonkeyPatch.context() as mp:
        offline_env(mp, root)
        # by registry name: GradLogger passes log_dir (-> wandb.init(dir=)) and writer_options along
        options = {"project": "gradlog-test"}
        # 128 bins: a history row larger than one 32 KiB block, so the reader's first/middle/last pieces are exercised
        report = train(
            [mem, "wandb"],
            log_dir=str(root / "logs"),
            writer_options=options,
            strict=True,
            histograms=gradlog.HistogramOptions(bins=128),
        )
        assert wandb.run is None, "gradlog started this run, so close() must finish it"
    files = find_run_files(root / "logs")
    assert len(files) == 1
    return mem, read_finished_run(files[0]), report


def gradlog_rows(run: OfflineRun) -> list[dict[str, Any]]:
    return [row for row in run.history if "gradlog/step" in row]


def quiet(mem: gradlog.MemoryWriter) -> dict[tuple[int, str], float]:
    """The memory writer's scalars as the W&B writer logs them: a tensor's `grad_nonfinite/` count only
    from its first non-zero value on (the run-level `gradlog/nonfinite_tensors` counts the rest)."""
    out = {}
    for key, points in mem.scalars.items():
        started = not key.startswith("weights/grad_nonfinite/")
        for step, value in points:
            started = started or value != 0
            if started:
                out[(step, key)] = value
    return out


def test_every_scalar_matches_the_memory_writer(offline_run: tuple[Any, OfflineRun, Any]) -> None:
    mem, run, _ = offline_run
    expected = quiet(mem)
    assert {k for _, k in expected if k.startswith("weights/grad_nonfinite/")} == {
        "weights/grad_nonfinite/bad",
        "weights/grad_nonfinite/worse",
    }
    got: dict[tuple[int, str], float] = {}
    for row in gradlog_rows(run):
        for key, value in row.items():
            if key.startswith("_") or key == "gradlog/step" or isinstance(value, dict):
                continue
            assert (row["gradlog/step"], key) not in got, f"{key} logged twice at step {row['gradlog/step']}"
            got[(row["gradlog/step"], key)] = float(value)
    assert got.keys() == expected.keys()
    bad = {k: (got[k], expected[k]) for k in expected if not same(got[k], expected[k])}
    assert not bad
    # the poisoned tensor really exercised the non-finite path: Inf and NaN went through W&B intact
    assert got[(POISON_STEP, "weights/grad_nonfinite/bad")] == 1.0
    assert math.isinf(got[(POISON_STEP, "weights/weight_norm/bad")])
    assert math.isnan(got[(POISON_STEP + EVERY, "weights/update_ratio/bad")])


def test_one_row_per_measured_step_with_gradlog_step(offline_run: tuple[Any, OfflineRun, Any]) -> None:
    mem, run, report = offline_run
    measured = list(range(0, STEPS, EVERY))
    rows = gradlog_rows(run)
    # one row per measured step, plus the close() row (final counts and the table) at the last step
    assert [r["gradlog/step"] for r in rows] == [*measured, measured[-1]]
    assert [s for s, _ in mem.scalars["gradlog/grad_norm_total"]] == measured
    assert [r["_step"] for r in run.history] == list(range(len(run.history)))
    assert report.measured_steps == len(measured)
    # every key gradlog wrote is plotted against gradlog/step
    globs = {m["glob_name"][:-2] for m in run.metrics if m.get("step_metric") == "gradlog/step"}
    keys = {k for row in rows for k in row if not k.startswith("_")}
    assert all(k.split("/")[0] in globs for k in keys), keys


def assert_same_edges(got: list[float], expected: list[float]) -> None:
    """The edges W&B holds are the expected ones rounded to decimals at `EDGE_RESOLUTION` of a bucket's width
    (the first down, the last up: the data's min and max stay inside)."""
    assert len(got) == len(expected)
    width = (expected[-1] - expected[0]) / (len(expected) - 1)
    assert all(abs(g - e) <= width * EDGE_RESOLUTION for g, e in zip(got, expected)), (got, expected)
    assert got[0] <= expected[0] and got[-1] >= expected[-1]
    assert all(a < b for a, b in zip(got, got[1:]))


def test_histogram_bins_and_counts(offline_run: tuple[Any, OfflineRun, Any]) -> None:
    mem, run, _ = offline_run
    by_step = {row["gradlog/step"]: row for row in gradlog_rows(run)[:-1]}
    checked = skipped = 0
    for tag, points in mem.histograms.items():
        for step, hist in points:
            logged = by_step[step].get(tag)
            if hist.count == 0:  # nothing finite to draw (worse's weights after the Inf): left out
                assert logged is None, tag
                skipped += 1
                continue
            assert logged["_type"] == "histogram"
            assert logged["values"] == [round(c) for c in hist.counts]
            assert_same_edges(logged["bins"], list(hist.edges))
            assert sum(logged["values"]) == hist.count
            checked += 1
    assert checked > 0 and skipped > 0
    partial = [h for step, h in mem.histograms["weights/weight/bad"] if step > POISON_STEP]
    assert partial and all(h.nonfinite == 1 and h.count == 2 for h in partial)  # drawn without its Inf
    logged_tags = {
        k for row in by_step.values() for k, v in row.items() if isinstance(v, dict) and v.get("_type") == "histogram"
    }
    assert logged_tags <= set(mem.histograms)


def test_never_updated_table_file(offline_run: tuple[Any, OfflineRun, Any]) -> None:
    mem, run, report = offline_run
    ref = run.history[-1]["gradlog/never_updated_table"]
    assert ref["_type"] == "table-file"
    path = Path(run.path).parent / "files" / ref["path"]
    assert glob.glob(str(Path(run.path).parent / "files" / "media" / "table" / "**" / "*.table.json"), recursive=True)
    table = json.loads(path.read_text())
    columns, rows = mem.tables["gradlog/never_updated"]
    assert table["columns"] == columns
    assert table["data"] == rows
    assert {r[0] for r in rows} == {"frozen.weight", "frozen.bias", "unused.weight", "unused.bias"}
    assert ref["nrows"] == len(report.never_updated) == 4


def test_summary_values(offline_run: tuple[Any, OfflineRun, Any]) -> None:
    mem, run, report = offline_run
    s = run.summary
    assert s["gradlog/verdict"] == report.verdict
    assert s["gradlog/healthy"] is False
    assert s["gradlog/optimizer_steps"] == STEPS
    assert s["gradlog/measured_steps"] == report.measured_steps
    assert s["gradlog/skipped_steps"] == 0
    assert s["gradlog/first_nonfinite_step"] == POISON_STEP
    assert s["gradlog/first_nonfinite_tensor"] == report.first_nonfinite.name in ("bad", "worse")
    assert s["gradlog/never_updated"] == 4
    for reason, n in report.counts().items():
        assert s[f"gradlog/never_updated/{reason}"] == n == mem.last(f"gradlog/never_updated/{reason}")
    assert run.finished and run.exit_code == 0
    assert run.project == "gradlog-test"  # writer_options reached wandb.init


def test_segment_table_and_segment_row_keep_their_own_keys(offline_run: tuple[Any, OfflineRun, Any]) -> None:
    """The summary row `segment` is `gradlog/segment` in the run summary; the per-tensor segment table goes
    under `gradlog/segment_table`, so neither hides the other in W&B's run table, and both read back."""
    mem, run, _ = offline_run
    assert run.summary["gradlog/segment"] == 1  # the summary row, not the table
    ref = run.history[-1]["gradlog/segment_table"]
    assert ref["_type"] == "table-file"
    table = json.loads((Path(run.path).parent / "files" / ref["path"]).read_text())
    assert table["columns"] == mem.tables["gradlog/segment"][0]
    assert {r[0] for r in table["data"]} == {r[0] for r in mem.tables["gradlog/segment"][1]}
    back = load(str(Path(run.path).parent))
    assert back.tables["gradlog/segment"] == mem.tables["gradlog/segment"]
    assert back.summary()["segment"] == "1"


@pytest.mark.parametrize("style", ["explicit_step", "auto_step"])
def test_user_steps_survive_interleaving(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, style: str) -> None:
    """The user logs every iteration, right after gradlog did. `explicit_step`: wandb.log(..., step=i), the
    order that loses the user's data when another logger commits rows first. `auto_step`: plain
    wandb.log(...), whose steps another logger's rows would shift. Every user point must keep step i."""
    offline_env(monkeypatch, tmp_path)
    run = wandb.init(project="user-run", dir=str(tmp_path))
    losses: list[float] = []

    def user_log(i: int) -> None:
        losses.append(float(i) / 3)
        run.log({"train/loss": losses[-1]}, **({"step": i} if style == "explicit_step" else {}))
        # the writer reads W&B's step from the client-side counter instead of asking wandb's service
        assert run._local_step == run.step

    report = train("wandb", steps=10, after_log=user_log, strict=True)
    assert wandb.run is run, "gradlog must not finish a run the user started"
    run.log({"train/loss": -1.0}, **({"step": 10} if style == "explicit_step" else {}))
    run.finish()
    (path,) = find_run_files(tmp_path)
    back = read_finished_run(path)
    assert back.column("train/loss") == [(i, v) for i, v in enumerate([*losses, -1.0])]
    steps = [row["gradlog/step"] for row in back.history if "gradlog/grad_norm_total" in row]
    assert steps == list(range(0, 10, EVERY))
    assert back.summary["gradlog/measured_steps"] == report.measured_steps


def test_a_step_over_the_size_budget_is_split_into_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    offline_env(monkeypatch, tmp_path)
    mem = gradlog.MemoryWriter()
    writer = gradlog.WandbWriter(log_dir=str(tmp_path), max_payload_bytes=4096)
    with pytest.warns(RuntimeWarning, match="split over") as caught:
        train([mem, writer], steps=4, strict=True)
    assert len([w for w in caught if "split over" in str(w.message)]) == 1
    (path,) = find_run_files(tmp_path)
    run = read_finished_run(path)
    rows = gradlog_rows(run)
    assert len(rows) > 3 * 2  # 2 measured steps + close, each in several rows
    merged: dict[tuple[int, str], Any] = {}
    for row in rows:
        for key, value in row.items():
            skip = (  # tables: their own tests; images: test_overview_images
                "gradlog/step",
                "gradlog/never_updated_table",
                "gradlog/partly_updated_table",
                "gradlog/stalled_table",
                "gradlog/segment_table",  # per-tensor record for a resumed run (tests/test_resume.py)
                "gradlog/overview",
            )
            if not key.startswith(("_", "gradlog/provisional/")) and key not in skip:
                assert (row["gradlog/step"], key) not in merged
                merged[(row["gradlog/step"], key)] = value
    scalars = quiet(mem)
    hists = {(step, k): h for k, points in mem.histograms.items() for step, h in points if h.count}
    assert merged.keys() == scalars.keys() | hists.keys()
    assert all(same(float(merged[k]), v) for k, v in scalars.items())
    assert all(merged[k]["values"] == [round(c) for c in h.counts] for k, h in hists.items())


def test_failing_run_log_warns_once_and_training_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The user finishes their run mid-training (wandb then refuses every log call; asking the finished run
    its step would block for 30 s, so the writer checks first): one warning, the other writers go on."""
    offline_env(monkeypatch, tmp_path)
    run = wandb.init(project="finished-early", dir=str(tmp_path))
    mem = gradlog.MemoryWriter()

    def finish_early(i: int) -> None:
        if i == 3:
            run.finish()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = train([gradlog.WandbWriter(), mem], after_log=finish_early)
    flush_warnings = [w for w in caught if "WandbWriter.flush failed" in str(w.message)]
    assert len(flush_warnings) == 1
    # the writer runs on its own thread, so it meets the run either finished or finishing: both say so
    assert "finished" in str(flush_warnings[0].message)
    assert [s for s, _ in mem.scalars["gradlog/grad_norm_total"]] == list(range(0, STEPS, EVERY))
    assert report.optimizer_steps == STEPS


def test_disabled_mode_still_measures_and_reports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    offline_env(monkeypatch, tmp_path)
    monkeypatch.delenv("WANDB_MODE")
    writer = gradlog.WandbWriter(mode="disabled")
    assert writer.run.disabled
    report = train(writer, strict=True)
    assert report.measured_steps == STEPS // EVERY
    assert {r.name for r in report.never_updated} == {"frozen.weight", "frozen.bias", "unused.weight", "unused.bias"}
    assert find_run_files(tmp_path) == []


def run_python(code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), **env}
    cmd = [sys.executable, "-c", textwrap.dedent(code)]
    return subprocess.run(cmd, cwd=cwd, env=full, capture_output=True, text=True, timeout=120)


def test_online_without_credentials_is_one_clear_error(tmp_path: Path) -> None:
    """In a fresh process: wandb reads WANDB_* settings once per process, so this cannot follow offline tests."""
    proc = run_python(
        """
        import os, gradlog, torch
        from gradlog.writers.wandb import WandbSetupError
        os.environ.pop("WANDB_API_KEY", None)
        try:
            gradlog.GradLogger(torch.nn.Linear(2, 2), writer="wandb", print_report=False)
        except WandbSetupError as exc:
            print("ERROR", exc)
        """,
        tmp_path,
        WANDB_MODE="online",
        WANDB_SILENT="true",
        WANDB_DIR=str(tmp_path),
        WANDB_CONFIG_DIR=str(tmp_path / "config"),
        HOME=str(tmp_path),
        NETRC=str(tmp_path / "no-netrc"),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ERROR W&B could not start a run (UsageError: No API key configured")
    assert "WANDB_MODE=offline" in proc.stdout and "wandb login" in proc.stdout


DDP_SCRIPT = """
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
import gradlog

def worker(rank, root):
    dist.init_process_group("gloo", init_method="file://" + os.path.join(root, "rendezvous"), rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # a writer built by hand on every rank: only rank 0 may produce a run
    out = gradlog.Output(gradlog.WandbWriter(log_dir=os.path.join(root, "logs")), strict=True)
    gl = gradlog.GradLogger(model, opt, writer=out, every=1, print_report=False)
    for step in range(3):
        model(torch.randn(4, 3) + rank).pow(2).sum().backward()
        opt.step()
        gl.log(step)
        opt.zero_grad()
    gl.close()
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(worker, args=(sys.argv[1],), nprocs=2)
"""


@pytest.mark.slow
def test_ddp_only_rank_zero_makes_a_run(tmp_path: Path) -> None:
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(tmp_path), WANDB_CONFIG_DIR=str(tmp_path))
    cmd = [sys.executable, str(script), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = find_run_files(tmp_path / "logs")
    run = read_finished_run(path)
    assert [row["gradlog/step"] for row in run.history if "gradlog/grad_norm_total" in row] == [0, 1, 2]


def test_import_gradlog_does_not_import_wandb(tmp_path: Path) -> None:
    proc = run_python(
        """
        import sys, gradlog
        assert gradlog.WandbWriter.__name__ == "WandbWriter"
        print("wandb" in sys.modules)
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


@pytest.mark.parametrize("how", ["missing", "stray_folder"])
def test_import_error_names_the_extra(tmp_path: Path, how: str) -> None:
    """`missing`: wandb not importable. `stray_folder`: an empty ./wandb directory, which Python imports as
    a namespace package when wandb is not installed; built here with the path finder Python itself uses."""
    (tmp_path / "wandb").mkdir()
    setup = {
        "missing": "sys.modules['wandb'] = None",
        "stray_folder": (
            "import importlib.machinery, importlib.util\n"
            f"spec = importlib.machinery.PathFinder.find_spec('wandb', [{str(tmp_path)!r}])\n"
            "assert spec.origin is None  # a namespace package\n"
            "sys.modules['wandb'] = importlib.util.module_from_spec(spec)"
        ),
    }[how]
    proc = run_python(
        "import sys\n" + setup + "\n"
        "import gradlog\n"
        "try:\n"
        "    gradlog.GradLogger(__import__('torch').nn.Linear(2, 2), writer='wandb')\n"
        "except ImportError as exc:\n"
        "    print(exc)\n",
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "pip install 'gradlog[wandb]'" in proc.stdout
    if how == "stray_folder":
        assert "stray ./wandb" in proc.stdout


# --- payload size and histogram edge cases (pure functions, no W&B run) -------------------------
def hist(bins: int, count: int = 10, lo: float = -1.0, hi: float = 1.0) -> Histogram:
    counts = [0.0] * bins
    counts[0] = float(count)
    return Histogram(tuple(counts), lo, hi, 0.0, 0.0, count, 0)


def test_histogram_payload_skips_what_wandb_cannot_draw() -> None:
    assert histogram_payload(hist(8, count=0)) is None  # all NaN/Inf, or an empty tensor
    assert histogram_payload(hist(8, lo=1e308, hi=1.7976931348623157e308)) is not None
    assert histogram_payload(Histogram((float("nan"),), 0.0, 1.0, 0.0, 0.0, 1, 0)) is None
    counts, edges = histogram_payload(hist(4, lo=2.0, hi=2.0)) or ([], [])  # a constant tensor
    assert counts == (10, 0, 0, 0) and len(edges) == 5 and edges[0] == 2.0 < edges[-1]


def test_histogram_size_estimate_is_an_upper_bound() -> None:
    for bins in (1, 64, 512):
        h = Histogram(tuple(float(10**9 + i) for i in range(bins)), -1.2345678901234567e-300, 1.0, 0.0, 0.0, 1, 0)
        counts, edges = histogram_payload(h) or ([], [])
        tag = "weights/grad/some.module.weight"
        exact = 3 * len(tag) + len(json.dumps(counts)) + len(json.dumps(edges)) + len('"histogram"')
        assert exact <= histogram_bytes(tag, h)


def test_split_payload_keeps_every_item_under_the_budget() -> None:
    payload = StepPayload(7, scalars={f"weights/grad_norm/l{i}": float(i) for i in range(50)})
    payload.histograms = {f"weights/grad/l{i}": hist(64) for i in range(40)}
    budget = 3 * histogram_bytes("weights/grad/l10", hist(64))
    parts = split_payload(payload, budget)
    assert len(parts) > 10
    assert all(p.step == 7 for p in parts)
    merged_s = {k: v for p in parts for k, v in p.scalars.items()}
    merged_h = {k: v for p in parts for k, v in p.histograms.items()}
    assert merged_s == payload.scalars and merged_h == payload.histograms
    assert all(sum(histogram_bytes(t, h) for t, h in p.histograms.items()) <= budget for p in parts)
    assert split_payload(payload, 10**9) == [payload]


# --- the reader on damaged files ---------------------------------------------------------------
def test_reader_reports_truncation_and_corruption(offline_run: tuple[Any, OfflineRun, Any], tmp_path: Path) -> None:
    _, run, _ = offline_run
    data = Path(run.path).read_bytes()
    assert len(data) > 3 * 32 * 1024  # several blocks, so block boundaries were exercised
    assert max(len(r) for r in read_chunks(data, [])) > 32 * 1024  # a record in first/middle/last pieces

    torn = tmp_path / "torn.wandb"
    torn.write_bytes(data[: len(data) // 2])
    partial = read_offline_run(torn)
    assert 0 < len(partial.history) < len(run.history)
    assert partial.history == run.history[: len(partial.history)]
    assert partial.torn_tail and not partial.skipped and not partial.complete  # cut off, not corrupt
    with pytest.raises(WandbFileError, match="damaged"):
        read_offline_run(torn, strict=True)

    flipped = bytearray(data)
    flipped[32 * 1024 + 100] ^= 0xFF  # inside the second block
    bad = tmp_path / "flipped.wandb"
    bad.write_bytes(bytes(flipped))
    damaged = read_offline_run(bad)
    assert any("checksum" in s or "corrupt" in s for s in damaged.skipped)
    assert 0 < len(damaged.history) < len(run.history)
    assert damaged.history[-1] == run.history[-1]  # reading resumed after the damaged block

    other = tmp_path / "not-wandb.bin"
    other.write_bytes(b"hello world, not a run file")
    with pytest.raises(WandbFileError, match="not a W&B run file"):
        read_offline_run(other)


def test_overview_images_run_level_series_and_model_order(
    offline_run: tuple[Any, OfflineRun, Any], tmp_path: Path
) -> None:
    from PIL import Image

    from gradlog.readers.run import load

    mem, run, report = offline_run
    images = [(row["gradlog/step"], row["gradlog/overview"]) for row in gradlog_rows(run) if "gradlog/overview" in row]
    assert images and images[-1][0] == STEPS - 1 - (STEPS - 1) % EVERY  # the final one, in the close() row
    ref = images[-1][1]
    assert ref["_type"] == "image-file" and ref["format"] == "png"
    png = Path(run.path).parent / "files" / ref["path"]
    assert png.read_bytes() == mem.images["gradlog/overview"][-1][1]  # the same picture as TensorBoard's
    with Image.open(png) as im:
        assert (im.width, im.height) == (ref["width"], ref["height"])
    # run-level series, the same as the memory writer's
    for key in ("gradlog/no_update_tensors", "gradlog/no_grad_tensors", "gradlog/update_ratio_median"):
        assert run.column(key, "gradlog/step") == mem.scalars[key]
    # W&B writes a row's keys in any order; the model order comes back through run.config
    order = [n for n, p in InfPlanted().named_parameters() if p.requires_grad]  # frozen tensors are not measured
    assert run.config["gradlog/tensor_order"] in (order, {"value": order})
    data = load(str(Path(run.path).parent))
    names = [t.split("/", 2)[2] for t in data.scalars if t.startswith("weights/weight_norm/")]
    assert names == order
    assert [t.split("/", 2)[2] for t in data.scalars if t.startswith("weights/update_ratio/")] == [
        n for n in order if f"weights/update_ratio/{n}" in mem.scalars
    ]
    # the tables and verdict W&B keeps match what TensorBoard shows
    assert data.tables["gradlog/never_updated"] == mem.tables["gradlog/never_updated"]
    assert data.tables["gradlog/summary"][1][0] == ["verdict", report.verdict]


def test_model_order_sorts_each_family_by_the_recorded_order() -> None:
    from gradlog.readers.run import model_order

    shuffled = {
        "weights/update_ratio/c": 1,
        "gradlog/x": 2,
        "weights/update_ratio/a": 3,
        "weights/grad_norm/b": 4,
        "weights/grad_norm/a": 5,
    }
    got = model_order(shuffled, ["a", "b", "c"])
    assert list(got) == [
        "weights/update_ratio/a",
        "weights/update_ratio/c",
        "gradlog/x",
        "weights/grad_norm/a",
        "weights/grad_norm/b",
    ]
    assert got == shuffled and model_order(shuffled, []) is shuffled


# --- issue 30: the cheaper form holds the same histograms and series ------------------------------------------
def numpy_histogram(x: np.ndarray, bins: int) -> tuple[list[int], list[float]]:
    """gradlog's buckets computed here with numpy from the tensor itself: `bins` equal buckets from its min to its
    max, `[edge_i, edge_i+1)` with the last one closed; a constant tensor gets one tiny bucket from its value."""
    lo, hi = float(x.min()), float(x.max())
    if not hi > lo:
        hi = lo + max(abs(lo), 1.0) * 1e-6
    width = (hi - lo) / bins
    edges = [lo + i * width for i in range(bins)] + [hi]
    at = np.clip(np.floor((x.astype(np.float64) - lo) / (hi - lo) * bins), 0, bins - 1).astype(np.int64)
    return np.bincount(at, minlength=bins).tolist(), edges


def test_histograms_and_series_equal_a_numpy_reference_and_the_verdict_reads_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fixed-seed run through the W&B writer: every histogram in the run file has the bucket counts numpy
    finds in the same gradients, weights and updates (recorded here from the tensors), its edges are those
    within `EDGE_RESOLUTION` of a bucket, every norm is the tensor's own, and `gradlog report` on the run
    folder gives the verdict close() gave."""
    from gradlog.cli.entry import main

    offline_env(monkeypatch, tmp_path)
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gl = gradlog.GradLogger(model, opt, writer="wandb", every=2, print_report=False, log_dir=str(tmp_path / "logs"))
    names = [n for n, _ in model.named_parameters()]
    seen: dict[tuple[int, str, str], np.ndarray] = {}
    x, y = torch.randn(32, 6), torch.randn(32, 3)
    for step in range(8):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        nn.functional.mse_loss(model(x), y).backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        gl.log(step)
        if step % 2 == 0:
            for n, p in model.named_parameters():
                seen[(step, "grad", n)] = grads[n].numpy()
                seen[(step, "weight", n)] = p.detach().numpy().copy()
                seen[(step, "update", n)] = (p.detach() - before[n]).numpy()
        opt.zero_grad()
    report = gl.close()
    (run_file,) = find_run_files(tmp_path / "logs")
    rows = {row["gradlog/step"]: row for row in gradlog_rows(read_finished_run(run_file))[:-1]}
    assert sorted(rows) == [0, 2, 4, 6]
    for (step, kind, name), values in seen.items():
        logged = rows[step][f"weights/{kind}/{name}"]
        counts, edges = numpy_histogram(values.ravel(), 64)
        assert logged["_type"] == "histogram"
        assert logged["values"] == counts, (step, kind, name)
        assert_same_edges(logged["bins"], edges)
        assert logged["bins"][0] <= values.min() and values.max() <= logged["bins"][-1]
        if kind == "grad":
            norm = float(np.linalg.norm(values.astype(np.float64)))
            assert rows[step][f"weights/grad_norm/{name}"] == pytest.approx(norm, rel=1e-5)
    assert len(seen) == 4 * 3 * len(names)
    code = main(["report", str(tmp_path / "logs"), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["backend"] == "wandb" and out["verdict"] == report.verdict
    assert code == (0 if report.healthy else 1)


def test_records_dropped_behind_a_stuck_writer_are_counted_in_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W&B cannot keep up (its thread is stuck in a call): training does not wait, the queue stays bounded, the
    records that did not fit are dropped and counted, and the count is in the run's summary."""
    import threading

    from gradlog.writers.guard import GuardedWriters
    from gradlog.writers.wandb import DROPPED_KEY, WandbWriter

    offline_env(monkeypatch, tmp_path)
    writer = WandbWriter(log_dir=str(tmp_path / "logs"), project="gradlog-test")
    guarded = GuardedWriters([writer], max_queue=3)
    release = threading.Event()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guarded.log_scalars({"weights/grad_norm/a": 1.0}, 0)
        guarded._each("stuck", lambda w: release.wait(30))  # W&B's thread is now busy in one call
        for step in range(1, 11):
            guarded.log_scalars({"weights/grad_norm/a": float(step)}, step)  # returns at once: queued or dropped
            guarded.flush()
        dropped = guarded.dropped
        assert dropped > 0 and guarded._lanes[id(writer)].queue.qsize() <= 3
        release.set()
        guarded.close()
    assert any("falling behind" in str(w.message) for w in caught)
    (run_file,) = find_run_files(tmp_path / "logs")
    run = read_finished_run(run_file)
    assert run.summary[DROPPED_KEY] == dropped
    steps = [s for s, _ in run.column("weights/grad_norm/a", x="gradlog/step")]
    assert steps[0] == 0 and len(steps) < 11  # what got through is in the run, what was dropped is not


def test_options_reach_the_writers_that_take_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`writer=["tensorboard", "wandb"]` with one flat options dict: W&B's project goes to W&B only,
    TensorBoard's fsync to TensorBoard only; one dict per writer works too; a key no writer takes is an
    error naming it (it was TensorBoardWriter's 'unexpected keyword argument project')."""
    offline_env(monkeypatch, tmp_path)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for n, options in enumerate(({"project": "flat", "fsync": True}, {"wandb": {"project": "nested"}})):
        out = gradlog.Output(["tensorboard", "wandb"], options=options)
        gl = gradlog.GradLogger(model, opt, writer=out, log_dir=str(tmp_path / f"tb{n}"), every=1, print_report=False)
        tb = next(w for w in gl.publisher.writers.writers if isinstance(w, gradlog.TensorBoardWriter))
        assert tb._sink.fsync is ("fsync" in options)  # the writer keeps it where it syncs
        catalogue.train(opt, gl, 2, lambda i: model(torch.randn(3, 4)).sum())
        assert glob.glob(str(tmp_path / f"tb{n}" / "events.out.tfevents.*"))
    projects = sorted(read_finished_run(p).project or "" for p in find_run_files(tmp_path))
    assert projects == ["flat", "nested"]
    with pytest.raises(TypeError, match=r"'flush_sec' is not an option of the writers tensorboard, memory"):
        gradlog.GradLogger(model, opt, writer=gradlog.Output(["tensorboard", "memory"], options={"flush_sec": 5}))


def user_owned_run(root: Path, steps: int) -> tuple[dict[tuple[int, str], float], set[str], OfflineRun]:
    """The issue-41 loop: the user's own `wandb.init`, `run.log({"user/loss": ...})` every iteration, a
    GradLogger on that run with `every=1` (not strict: the W&B writer on its own thread, as users run it),
    `gl.close()`, then `run.finish()`. Returns the memory writer's scalars (the reference, same run), the
    per-step histogram tags, and the run file read back."""
    torch.manual_seed(0)
    model = catalogue.TwoLayer(torch.tanh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = wandb.init(project="user-owned", dir=str(root))
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=[mem, "wandb"], every=1, print_report=False)
    for step in range(steps):
        loss = catalogue.mse(model, torch.randn(8, 6))
        run.log({"user/loss": loss.item()})
        loss.backward()
        opt.step()
        gl.log(step)
        opt.zero_grad()
    gl.close()
    assert wandb.run is run, "gradlog must not finish the user's run"
    run.finish()
    (path,) = find_run_files(root)
    hists = {tag for tag, points in mem.histograms.items() if any(h.count for _, h in points)}
    return quiet(mem), hists, read_finished_run(path)


def assert_every_step_whole(
    steps: int, scalars: dict[tuple[int, str], float], hists: set[str], back: OfflineRun
) -> None:
    """Every measured step is in the run file with every scalar (equal to the memory writer's) and every
    histogram, no key of a step in two rows, and every one of the user's points kept."""
    got: dict[tuple[int, str], Any] = {}
    for row in gradlog_rows(back):
        for key, value in row.items():
            if key.startswith(("weights/", "gradlog/")) and key != "gradlog/step" and "table" not in key:
                if key == "gradlog/overview" or key.startswith("gradlog/provisional/"):
                    continue
                assert (row["gradlog/step"], key) not in got, f"step {row['gradlog/step']}: {key} in two rows"
                got[(row["gradlog/step"], key)] = value
    missing = sorted({s for s, k in scalars if (s, k) not in got})
    assert not missing, f"measured steps missing keys in the run file: {missing}"
    assert all(same(float(got[k]), v) for k, v in scalars.items())
    assert {s for s, _ in scalars} == set(range(steps))
    hist_keys = {(s, k) for (s, k) in got if k.startswith("weights/") and isinstance(got[(s, k)], dict)}
    assert hist_keys == {(s, tag) for s in range(steps) for tag in hists}
    assert len(back.column("user/loss")) == steps


@pytest.mark.parametrize("steps", [1, 2, 5, 50])
def test_user_owned_run_keeps_every_measured_step(steps: int, tmp_path: Path, wandb_offline: Any) -> None:
    """Issue 41: with the user logging into their own run on the training thread and gradlog's writer on its
    thread, both called wandb's client at once; 2-8 of 50 measured steps lost their keys, and once the last
    step's row held `gradlog/step` alone. Each step must be there whole, whoever owns the run."""
    assert_every_step_whole(steps, *user_owned_run(tmp_path, steps))


@pytest.mark.heavy
@pytest.mark.parametrize("attempt", range(5))
def test_user_owned_run_keeps_every_step_every_time(attempt: int, tmp_path: Path, wandb_offline: Any) -> None:
    """The same, repeated: not a matter of timing (about 20 s an attempt)."""
    for steps in (1, 2, 5, 50):
        assert_every_step_whole(steps, *user_owned_run(tmp_path / str(steps), steps))
