"""`gradlog demo`: a small training run with five planted bugs, to show what gradlog finds.

Two tensors never learn (an unused head, a layer left out of the optimizer), one embedding learns only
in part (half of its ids never occur in a batch), one layer stops learning halfway (its param group's lr
is scheduled to 0) and one a third of the way in (a freeze meant for another layer hits it): the printed
report has all three tables. A layer frozen before training is no bug (a frozen backbone, a fixed table):
gradlog lists it as a note, so the demo's freeze happens mid-run, where it is a mistake.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
from torch import nn

from gradlog.cli.planted import PLANTED as PLANTED
from gradlog.run.logger import GradLogger
from gradlog.verdict.report import Report

#: the demo's token ids come from 8 sign bits of the input, but the "tokenizer" keeps 4 of them:
#: ids 16..31 of the 32-row table never occur in a batch
TOKENS = 32


class DemoNet(nn.Module):
    """A small MLP classifier with five planted bugs (see `build`)."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Linear(16, width)
        self.tokens = nn.Embedding(TOKENS, width)  # bug 4: rows 16..31 are never looked up
        self.fade = nn.Linear(width, width)  # bug 5: its lr is scheduled to 0 halfway
        self.frozen = nn.Linear(width, width, bias=False)  # bug 1: frozen mid-run by mistake
        self.block = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
        self.late = nn.Linear(width, width, bias=False)  # bug 3: created after the optimizer
        self.head = nn.Linear(width, 4)
        self.aux_head = nn.Linear(width, 4, bias=False)  # bug 2: never used in forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.embed(x)) + self.tokens(token_ids(x))
        h = h + torch.relu(self.frozen(h))
        h = h + torch.tanh(self.fade(h))
        h = h + self.block(h)
        h = h + 0.1 * self.late(h)
        out: torch.Tensor = self.head(h)
        return out


def token_ids(x: torch.Tensor) -> torch.Tensor:
    """One id per sample from the signs of its first features; the bug: only 4 bits, so ids < 16."""
    bits = (x[:, :4] > 0).long()
    return (bits * (2 ** torch.arange(4))).sum(dim=1)


def build(seed: int = 0) -> tuple[DemoNet, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = DemoNet()
    late = set(map(id, model.late.parameters()))
    fade = set(map(id, model.fade.parameters()))
    main = [p for p in model.parameters() if id(p) not in late | fade]
    optimizer = torch.optim.AdamW([{"params": main}, {"params": list(model.fade.parameters())}], lr=3e-3)
    return model, optimizer


def scheduler(optimizer: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Constant lr, except that param group 1 (`fade`) is cut to 0 halfway: the scheduler bug of bug 5."""
    half = steps // 2
    return torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda s: 1.0, lambda s: 1.0 if s < half else 0.0])


def freeze_step(steps: int) -> int:
    """The step at which the demo's loop freezes `frozen` (bug 1): a third of the way in."""
    return steps // 3


def freeze_by_mistake(model: DemoNet) -> None:
    """Bug 1: a freeze meant for the input layer (`embed`, once it has warmed up) hits `frozen`, a layer in
    the middle of the network that should keep learning. Called after training began, it is a mistake
    gradlog names (`stalled`, reason `frozen`); the same call before training would be a deliberate freeze."""
    model.frozen.requires_grad_(False)


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
    schedule = scheduler(optimizer, steps)
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(16, 4, generator=gen)
    gl = GradLogger(model, optimizer, writer=writer, every=every, log_dir=log_dir)
    loss_fn = nn.CrossEntropyLoss()
    start = time.perf_counter()
    for step in range(steps):
        if step == freeze_step(steps):
            freeze_by_mistake(model)
        x = torch.randn(64, 16, generator=gen)
        y = (x @ teacher).argmax(dim=1)
        loss = loss_fn(model(x), y)
        loss.backward()  # gradlog needs no call here: it measures inside optimizer.step()
        optimizer.step()
        schedule.step()
        gl.log(step)
        optimizer.zero_grad()
        _progress(step, steps, loss.item(), start)
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    return gl.close()  # prints the table, and where the TensorBoard files went
