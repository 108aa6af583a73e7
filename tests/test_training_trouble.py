"""Trouble in a writer never ends, blocks or silences the training run: what tests/test_nothing_lost.py and
tests/test_edge_cases.py do not cover yet.

A backend that calls `sys.exit` (wandb's teardown does, with the service's exit code) raises SystemExit, which
is no `Exception`: on a writer's own thread it ended that thread in silence (every later record of that writer
lost, no warning, no count), and from an inline writer it ended the training script inside `gl.log()`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradlog

STEPS = 5


class Exiting(gradlog.Writer):
    """Every record call raises SystemExit(3), as `sys.exit(3)` inside a backend would."""

    def __init__(self, inline: bool) -> None:
        self.inline = inline
        self.calls = 0

    def log_scalars(self, scalars: Mapping[str, float], step: int) -> None:
        self.calls += 1
        raise SystemExit(3)

    def log_histogram(self, tag: str, hist: Any, step: int) -> None:
        raise SystemExit(3)

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
        raise SystemExit(3)


@pytest.mark.parametrize("inline", [False, True])
def test_a_writer_raising_systemexit_warns_once_and_training_goes_on(inline: bool) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    bad, mem = Exiting(inline), gradlog.MemoryWriter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gl = gradlog.GradLogger(model, opt, writer=[bad, mem], every=1, print_report=False)
        for step in range(STEPS):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            gl.log(step)
        report = gl.close()
    said = [str(w.message) for w in caught if "Exiting.log_scalars failed" in str(w.message)]
    assert said == [
        "gradlog: Exiting.log_scalars failed (RuntimeError: it raised SystemExit(3)); training continues, "
        "further errors of this kind are not shown"
    ], [str(w.message) for w in caught]
    assert bad.calls == STEPS + 1  # every step and the final counts: it kept being asked (its thread lived)
    assert [s for s, _ in mem.scalars["weights/grad_norm/weight"]] == list(range(STEPS))
    assert report.measured_steps == STEPS and report.never_updated == []


def test_ctrl_c_inside_an_inline_writer_still_stops_training() -> None:
    """KeyboardInterrupt is the user's: it is not caught with SystemExit."""

    class Interrupted(Exiting):
        def log_scalars(self, scalars: Mapping[str, float], step: int) -> None:
            self.calls += 1
            if self.calls == 1:  # the user's Ctrl-C, once
                raise KeyboardInterrupt

        def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
            pass

    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gl = gradlog.GradLogger(model, opt, writer=[Interrupted(inline=True)], every=1, print_report=False)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    with pytest.raises(KeyboardInterrupt):
        gl.log(0)
    assert gl.close().measured_steps == 1


def test_a_writer_whose_where_raises_still_gets_the_report_printed(capsys: pytest.CaptureFixture[str]) -> None:
    """`Writer.where()` (the line naming a run's files, printed before the report) raising in a writer of one's
    own made `gl.close()` raise at the end of training: no report, no Report. Now one warning, and the report."""

    class Nowhere(gradlog.MemoryWriter):
        def where(self) -> str | None:
            raise AttributeError("'Nowhere' object has no attribute 'folder'")

    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gl = gradlog.GradLogger(model, opt, writer=[Nowhere()], every=1)
        for step in range(2):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            gl.log(step)
        report = gl.close()
    said = [str(w.message) for w in caught if "where()" in str(w.message)]
    assert said == [
        "gradlog: Nowhere.where() failed (AttributeError: 'Nowhere' object has no attribute 'folder'); where its "
        "files are is not shown"
    ], said
    out = capsys.readouterr().out
    assert report.measured_steps == 2 and out.rstrip().endswith(report.verdict), out


def test_a_writer_whose_dropped_count_raises_still_closes_with_the_report() -> None:
    """An inline writer of one's own whose `dropped` property raises: `gl.close()` raised after the report had been
    printed (the run's Report lost to the script). Now one warning naming it, and close() returns the Report."""

    class Uncounted(gradlog.MemoryWriter):
        @property
        def dropped(self) -> int:
            raise RuntimeError("no count kept")

    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gl = gradlog.GradLogger(model, opt, writer=[Uncounted()], every=1, print_report=False)
        for step in range(2):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            gl.log(step)
        report = gl.close()
    said = [str(w.message) for w in caught if "Uncounted.dropped failed" in str(w.message)]
    assert len(said) == 1 and "RuntimeError: no count kept" in said[0], [str(w.message) for w in caught]
    assert report.measured_steps == 2 and gl.dropped == 0


CHILD = """
import os, resource, signal, sys, time, warnings
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # as EFBIG, not a kill (inherited by wandb-core)
hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, hard))  # `ulimit -f` of ~300 KB, for this process and wandb-core
import torch, gradlog
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    gl = gradlog.GradLogger(model, opt, writer="wandb", log_dir=sys.argv[1], every=1, print_report=False)
    for step in range(40):
        model(torch.randn(8, 32)).sum().backward()
        opt.step()
        opt.zero_grad()
        gl.log(step)
        time.sleep(0.05)
    report = gl.close()
print("measured", report.measured_steps)
for w in caught:
    print("warning:", w.message)
"""


@pytest.mark.slow
def test_a_file_size_limit_on_the_wandb_run_is_warned_about(tmp_path: Path) -> None:
    """`ulimit -f` (RLIMIT_FSIZE), inherited by wandb-core, cut the run file off at the limit with no word: the
    disk had space, so the W&B writer's free-space check said nothing (seen: 40 steps logged, the file stopped at
    300,000 bytes, no warning). Now one warning names the file and the limit; training goes on, and
    `gradlog report` reads what was written."""
    pytest.importorskip("wandb")
    root = Path(__file__).resolve().parent.parent
    # no WANDB_* of this process: an earlier test's run leaves WANDB_SERVICE set, and the child would then use
    # that wandb-core, which has no file size limit
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(PYTHONPATH=str(root), OMP_NUM_THREADS="1", WANDB_MODE="offline", WANDB_SILENT="true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        env[var] = str(tmp_path / var.lower())
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "logs")], capture_output=True, text=True, env=env, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "measured 40", proc.stdout
    said = [line for line in lines if "file size limit" in line]
    assert len(said) == 1 and "300000 bytes, `ulimit -f`" in said[0] and ".wandb" in said[0], proc.stdout
    (run_file,) = (tmp_path / "logs" / "wandb").glob("offline-run-*/run-*.wandb")
    assert run_file.stat().st_size == 300_000  # what the limit let through
    report = subprocess.run(
        [sys.executable, "-m", "gradlog", "report", str(tmp_path / "logs")], capture_output=True, text=True, env=env
    )
    assert report.returncode in (1, 2) and "Traceback" not in report.stderr, report.stderr[-2000:]
    assert "gradlog INCOMPLETE" in report.stdout or "gradlog PROBLEM" in report.stdout, report.stdout[-800:]


@pytest.mark.slow
def test_sigterm_mid_run_finishes_the_wandb_run(tmp_path: Path) -> None:
    """SIGTERM (torchrun, SLURM, `kill`) to a run logging to W&B: the signal's exit status stays, the report is
    printed, and the W&B run file ends with the final tables and its exit record (tests/test_nothing_lost.py
    checks this for TensorBoard only)."""
    pytest.importorskip("wandb")
    import signal

    from gradlog.readers.run import load

    proc, out, err = sigterm_after_ten_steps_with("wandb", tmp_path / "run")
    assert proc.returncode == -signal.SIGTERM, err[-2000:]
    assert "gradlog OK: 2 of 6 tensors never updated (frozen 2)" in out, out[-1000:]
    run = load(str(tmp_path / "run"))
    assert run.backend == "wandb" and run.provisional_step is None and run.notes == [] and run.skipped == []
    assert {r[0] for r in run.tables["gradlog/never_updated"][1]} == {"2.weight", "2.bias"}


def sigterm_after_ten_steps_with(writer: str, run_dir: Path) -> tuple[subprocess.Popen[str], str, str]:
    """tests/fault_child.py's endless training with `writer`, sent SIGTERM once it logged step 10."""
    import signal

    from test_nothing_lost import start_child, wait_for

    proc = start_child("sigterm", str(run_dir), writer)
    try:
        wait_for(proc, "logged 10")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    return proc, out, err
