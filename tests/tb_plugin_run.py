"""A small run with a planted stalled layer (its param group's lr goes to 0 at STALL_STEP) and a planted
NaN gradient (one entry of `aux.weight.grad` at NAN_STEP), written with the TensorBoard writer.

Shared by the TensorBoard-tab tests and `benchmarks/plugin_paint.py`; run as a script it writes one run.
"""

from __future__ import annotations

import os
import sys

import torch
from catalogue import StallPlanted, loop
from torch import nn

import gradlog
from gradlog.verdict.report import STALLED_COLUMNS

STALL_STEP = 6
NAN_STEP = 9
STEPS = 12
STALLED = "stall.weight"
NAN_TENSOR = "aux.weight"


#: Models of runs left open: alive until the process ends, as in a loop still training.
_STILL_TRAINING: list[nn.Module] = []


def write_run(log_dir: str, close: bool = True) -> tuple[gradlog.GradLogger, dict[str, list[float]]]:
    """Train the planted model and write it; without `close` the run looks like one still training.

    Returns the logger and, as an independent reference, each tensor's update ratio per step computed
    here with `torch.linalg.vector_norm` from copies of the weights before and after the step.
    """
    torch.manual_seed(0)
    model = StallPlanted()
    stall_params = list(model.stall.parameters())
    others = [p for n, p in model.named_parameters() if not n.startswith("stall.")]
    opt = torch.optim.SGD([{"params": others, "lr": 0.05}, {"params": stall_params, "lr": 0.05}])
    writer = gradlog.TensorBoardWriter(log_dir)
    gl = gradlog.GradLogger(
        model, opt, writer=writer, every=1, print_report=False, histograms=gradlog.HistogramOptions(overview_every=1)
    )
    expected: dict[str, list[float]] = {n: [] for n, _ in model.named_parameters()}
    before: dict[str, torch.Tensor] = {}

    def loss(step: int) -> torch.Tensor:
        if step == STALL_STEP:
            opt.param_groups[1]["lr"] = 0.0
        value: torch.Tensor = model(torch.randn(5, 4))  # StallPlanted returns its own loss
        return value

    def plant_nan(step: int) -> None:
        if step == NAN_STEP:
            assert model.aux.weight.grad is not None
            model.aux.weight.grad[0, 0] = float("nan")
        before.update({n: p.detach().clone() for n, p in model.named_parameters()})

    def ratios(step: int) -> None:
        for n, p in model.named_parameters():
            delta = torch.linalg.vector_norm(p.detach() - before[n]).item()
            expected[n].append(delta / torch.linalg.vector_norm(before[n]).item())

    loop(opt, gl, STEPS, loss, after_backward=plant_nan, after_step=ratios)
    if not close:
        writer.flush()
        _STILL_TRAINING.append(model)  # gradlog closes a logger whose model is garbage-collected (issue 15)
        return gl, expected
    # The stalled table's producer is issue 12's close() (Report.stalled_rows); on a branch without it, the
    # table is written here by hand, through the writer, as close() would.
    since = str(STALL_STEP)
    if not hasattr(gradlog.Report, "stalled_rows"):
        writer.log_table(
            "gradlog/stalled",
            STALLED_COLUMNS,
            [[n, since, str(STALL_STEP - 1), "zero_lr", "lr 0 in its param group"] for n in (STALLED, "stall.bias")],
        )
    gl.close()
    return gl, expected


if __name__ == "__main__":
    # tb_plugin_run.py DIR: a finished run; tb_plugin_run.py --training DIR: the process stops without close(),
    # as if still training (or killed): its data is on disk, its tables are not.
    if sys.argv[1] == "--training":
        write_run(sys.argv[2], close=False)
        sys.stdout.flush()
        os._exit(0)
    print(write_run(sys.argv[1])[0].close().verdict)
