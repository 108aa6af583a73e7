"""`gradlog demo`: a small training run with three planted bugs, to show what gradlog finds."""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
from torch import nn

from gradlog.logger import GradLogger
from gradlog.verdict.report import Report


class DemoNet(nn.Module):
    """A small MLP classifier with three planted bugs (see `build`)."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Linear(16, width)
        self.frozen = nn.Linear(width, width, bias=False)  # bug 1: frozen by accident
        self.block = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
        self.late = nn.Linear(width, width, bias=False)  # bug 3: created after the optimizer
        self.head = nn.Linear(width, 4)
        self.aux_head = nn.Linear(width, 4, bias=False)  # bug 2: never used in forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.embed(x))
        h = h + torch.relu(self.frozen(h))
        h = h + self.block(h)
        h = h + 0.1 * self.late(h)
        out: torch.Tensor = self.head(h)
        return out


def build(seed: int = 0) -> tuple[DemoNet, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = DemoNet()
    model.frozen.requires_grad_(False)
    late = set(map(id, model.late.parameters()))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if id(p) not in late], lr=3e-3)
    return model, optimizer


def _progress(i: int, n: int, loss: float, start: float) -> None:
    width = 30
    done = int(width * (i + 1) / n)
    rate = (i + 1) / max(time.perf_counter() - start, 1e-9)
    line = f"\rgradlog demo [{'#' * done}{'.' * (width - done)}] {i + 1}/{n} loss {loss:.3f} {rate:.0f} it/s"
    if sys.stderr.isatty():
        sys.stderr.write(line)
    elif (i + 1) % max(n // 5, 1) == 0 or i + 1 == n:
        sys.stderr.write(line.strip("\r") + "\n")
    sys.stderr.flush()


def run(
    steps: int = 300, every: int = 10, writer: Any = "tensorboard", log_dir: str | None = None, seed: int = 0
) -> Report:
    """Train DemoNet on a synthetic 4-class problem and return gradlog's report.

    By default it writes TensorBoard files to a new folder under `runs/` and prints where.
    """
    model, optimizer = build(seed)
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(16, 4, generator=gen)
    gl = GradLogger(model, optimizer, writer=writer, every=every, log_dir=log_dir)
    loss_fn = nn.CrossEntropyLoss()
    start = time.perf_counter()
    for step in range(steps):
        x = torch.randn(64, 16, generator=gen)
        y = (x @ teacher).argmax(dim=1)
        loss = loss_fn(model(x), y)
        loss.backward()  # gradlog needs no call here: it measures inside optimizer.step()
        optimizer.step()
        gl.log(step)
        optimizer.zero_grad()
        _progress(step, steps, loss.item(), start)
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    return gl.close()  # prints the table, and where the TensorBoard files went
