"""One catalogue of the tiny models, planted bugs and training loop the tests share (issue 32).

Each model's docstring says which bug it plants and what ground truth that lets a test assert. The
models are tiny on purpose: a test computes its reference (norms by hand, copies of the weights before
and after a step) next to gradlog, and a whole run takes well under a second on a CPU. Attribute names
and creation order are part of a model's contract: tests assert on `name.weight` strings, and the
weights a seed gives depend on the order the layers are built in.

`import catalogue` works from any test module and from the child scripts in tests/ (run as scripts,
their folder is on sys.path); it imports torch and gradlog only, transformers only when asked.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import gradlog
from gradlog import Reason

Step = Callable[[int], None]


# --- the training loop -----------------------------------------------------------------------------------
def train(
    opt: torch.optim.Optimizer,
    gl: gradlog.GradLogger,
    steps: int,
    loss: Callable[[int], torch.Tensor],
    after_backward: Step | None = None,
    after_step: Step | None = None,
    after_log: Step | None = None,
    after_zero: Step | None = None,
) -> gradlog.Report:
    """`loop`, then `gl.close()`: the whole run most tests make; returns the report."""
    loop(opt, gl, steps, loss, after_backward, after_step, after_log, after_zero)
    return gl.close()


def loop(
    opt: torch.optim.Optimizer,
    gl: gradlog.GradLogger,
    steps: int,
    loss: Callable[[int], torch.Tensor],
    after_backward: Step | None = None,
    after_step: Step | None = None,
    after_log: Step | None = None,
    after_zero: Step | None = None,
    start: int = 0,
) -> None:
    """The loop most tests run: backward, step, log, zero_grad, `steps` times (the run stays open).

    `loss(step)` draws its own batch, so each test keeps its own data and generator. The hooks run
    where a test plants a bug or records its reference: after backward (gradients are there, the
    weights are not yet updated), after the optimizer step (the new weights, before gradlog's `log`
    could touch anything), after `gl.log` (the step is measured and published), after zero_grad
    (between two steps). `start` numbers the steps from there (a run continued after a pause).
    """
    for step in range(start, start + steps):
        loss(step).backward()
        if after_backward is not None:
            after_backward(step)
        opt.step()
        if after_step is not None:
            after_step(step)
        gl.log(step)
        if after_log is not None:
            after_log(step)
        opt.zero_grad()
        if after_zero is not None:
            after_zero(step)


def mse(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The default loss: the mean square of the output, so every used weight gets a gradient."""
    out: torch.Tensor = model(x).pow(2).mean()
    return out


def random_mse(model: nn.Module, *shape: int, gen: torch.Generator | None = None) -> Callable[[int], torch.Tensor]:
    """`loss` for `train`: `mse` on a fresh `torch.randn(*shape)` each step (from `gen`, else the global
    generator, as the test's own loop drew it)."""
    return lambda step: mse(model, torch.randn(*shape, generator=gen))


# --- healthy small nets (the bug, if any, is planted by the test) ----------------------------------------
class TwoLayer(nn.Module):
    """`a` (6->8), `act`, `b` (8->3): every tensor learns, so each metric has a hand-computed reference.

    `act` is the test's choice (test_metrics uses relu, whose dead units give exact zero gradients;
    test_amp uses tanh); it is a parameter so neither test silently changes the other's model.
    """

    def __init__(self, act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b(self.act(self.a(x)))
        return out


class BodyHeadUnused(nn.Module):
    """`body` (6->8), `head` (8->3) and `unused` (3->3), never called: exactly `unused.*` never learns
    (reason `no_grad`), whatever optimizer wrapper drives the step."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)
        self.unused = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.tanh(self.body(x)))
        return out


class FrozenInFront(nn.Module):
    """`frozen` (6->6) feeds `body` (6->5) and `head` (5->3), for two-phase fine-tuning: `head` alone, then
    `body` too under a new optimizer; `frozen` stays frozen in both, so it alone is never updated."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 5)
        self.frozen = nn.Linear(6, 6)  # frozen in both phases
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.tanh(self.body(self.frozen(x))))
        return out


class EncoderHead(nn.Module):
    """`encoder` (Sequential 6->8->8), `head` (8->3), `unused` (3->3, never called): include/exclude
    patterns select `encoder.*` and the hand-computed total norm covers exactly those tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)
        self.unused = nn.Linear(3, 3)  # never called: no_grad, when watched

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.tanh(self.encoder(x)))
        return out


class Recommender(nn.Module):
    """`items` (Embedding 50x8) and `head`: a test that feeds ids below 40 only leaves rows 40-49 never
    updated, a partly-updated embedding whose rows are known."""

    def __init__(self) -> None:
        super().__init__()
        self.items = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.items(ids).mean(1))
        return out


class FrozenMainLateSlow(nn.Module):
    """`frozen` (4->4), `main` (4->6), `late` (6->6), `slow` (6->2) in a row: tests/resume_child.py freezes
    `frozen` throughout, `late` until the resume, and zeroes `slow`'s lr at the resume, so the tables of a
    run stitched from two processes are known."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(4, 4)
        self.main = nn.Linear(4, 6)
        self.late = nn.Linear(6, 6)
        self.slow = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.slow(torch.tanh(self.late(torch.tanh(self.main(self.frozen(x))))))
        return out


class FastSlowMid(nn.Module):
    """Three bias-free 8->8 layers `fast`, `slow`, `mid` in a row: a test gives each its own lr, so the
    update ratio of each is known to be far above, far below and inside the alert band."""

    def __init__(self) -> None:
        super().__init__()
        self.fast = nn.Linear(8, 8, bias=False)
        self.slow = nn.Linear(8, 8, bias=False)
        self.mid = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mid(torch.tanh(self.slow(torch.tanh(self.fast(x)))))
        return out


class GatedThree(nn.Module):
    """`a` (6->8), a residual `b` (8->8), `c` (8->3). `use_b = False` cuts `b` out of the forward pass and
    `scale_b` shrinks its share: the step at which `b` stops learning is the test's to choose."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 3)
        self.use_b = True
        self.scale_b = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.use_b:
            h = h + self.scale_b * torch.tanh(self.b(h))
        out: torch.Tensor = self.c(h)
        return out


def frozen_tail() -> tuple[nn.Module, torch.optim.Optimizer]:
    """Seed 0, a 4->4->2->2 Sequential whose last layer is frozen (a finding every table must show) and SGD
    (lr 0.005) over the rest: the run the crash, signal and disk-full tests kill and read back."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(2, 2))
    model[2].requires_grad_(False)  # a finding every table must show: frozen
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.005)
    return model, opt


class ConvNet(nn.Module):
    """A small ResNet-like net, built by hand (torchvision cannot be installed beside the CPU torch)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.layer1 = nn.ModuleList(
            nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU()) for _ in range(3)
        )
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.layer1:
            h = h + block(h)
        out: torch.Tensor = self.fc(h.mean((2, 3)))
        return out


# --- nets with the bugs planted in them ------------------------------------------------------------------
class EmbeddingPlanted(nn.Module):
    """`emb` (20x8), `body`, a residual `frozen` layer (requires_grad off: reason `frozen`), `tail`, and
    `unused` (8->2, never called: reason `no_grad`). test_verdict swaps `unused` for an Identity when
    its scenario is not "never_updated" and stalls or poisons `tail` through its own param group."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.body = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8)
        self.tail = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 2)
        self.frozen.requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(self.emb(ids).mean(1)))
        h = h + self.frozen(h)
        out: torch.Tensor = self.tail(h)
        return out


class InfPlanted(nn.Module):
    """Returns its own loss. `frozen` never learns (frozen), `unused` never learns (not in forward);
    `bad` and `worse` are where a test plants Inf gradients (one entry, all entries) with a hook."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 2)
        self.frozen = nn.Linear(2, 2)  # never learns: frozen
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(2, 2)  # never learns: not used in forward
        self.bad = nn.Parameter(torch.ones(3))  # one Inf gradient entry, then one Inf weight
        self.worse = nn.Parameter(torch.ones(2))  # an all-Inf gradient: no finite weight left to draw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The sum's backward does not multiply by its value: body/head gradients stay finite even
        # after bad holds Inf, so only bad's own numbers go non-finite.
        out: torch.Tensor = (
            self.head(torch.relu(self.body(x))).pow(2).mean() + (self.bad * 0.5).sum() + self.worse.sum()
        )
        return out


class NonfinitePlanted(nn.Module):
    """A small net plus tensors whose gradients or weights are NaN, Inf, empty or constant; after each
    backward, `plant_nonfinite` writes the NaN/Inf gradients, so the flags and counts are known exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 5)
        self.norm = nn.LayerNorm(5)
        self.head = nn.Linear(5, 1)
        self.const = nn.Parameter(torch.full((7,), 2.5))  # lr 0 and zero grad: constant weight, grad and update
        self.nan_part = nn.Parameter(torch.randn(8))  # 3 NaN gradient entries
        self.nan_all = nn.Parameter(torch.randn(4))  # all-NaN gradient
        self.inf_part = nn.Parameter(torch.randn(3))  # one +Inf gradient entry
        self.empty = nn.Parameter(torch.empty(0))  # an empty tensor with an (empty) gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.norm(self.lin(x)))
        return out + self.empty.sum() + (self.const * 0).sum()


def plant_nonfinite(model: NonfinitePlanted) -> None:
    """Entries 1, 4 and 6 of `nan_part`'s gradient NaN, all of `nan_all`'s, entry 0 of `inf_part`'s +Inf
    (draws from the global generator, as the hand reference does)."""
    g = torch.randn(8)
    g[[1, 4, 6]] = math.nan
    model.nan_part.grad = g
    model.nan_all.grad = torch.full((4,), math.nan)
    g = torch.randn(3)
    g[0] = math.inf
    model.inf_part.grad = g


class ResidualPlanted(nn.Module):
    """Residual MLP with planted bugs: a frozen layer, an unused head, a layer left out of the optimizer.

    The test freezes `frozen` and leaves `orphan` out of the optimizer, so the never-updated table is
    known: frozen.* (frozen), unused.weight (no_grad), orphan.weight (not_in_optimizer).
    """

    def __init__(self, width: int = 16, blocks: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.frozen = nn.Linear(width, width)
        self.orphan = nn.Linear(width, width, bias=False)
        self.head = nn.Linear(width, 4)
        self.unused = nn.Linear(width, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + torch.tanh(b(x))
        x = x + 0.1 * torch.tanh(self.frozen(x)) + 0.1 * self.orphan(x)
        out: torch.Tensor = self.head(x)
        return out


class StallPlanted(nn.Module):
    """Returns its own (summed) loss. `stall` gets its own param group, whose lr a run sets to 0 (stalled);
    `aux` is summed into the loss, so a NaN planted in its gradient never reaches other gradients;
    `unused` is never in the forward pass (no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.stall = nn.Linear(8, 8)
        self.out = nn.Linear(8, 2)
        self.aux = nn.Linear(4, 2)  # summed into the loss: its NaN weight never reaches other gradients
        self.unused = nn.Linear(2, 2)  # never in the forward pass: no gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(torch.relu(self.stall(torch.relu(self.inp(x))))).sum() + self.aux(x).sum()
        return out


class CheckpointPlanted(nn.Module):
    """For `gradlog diff`: an embedding whose rows `seen`.. never appear in a batch, a frozen layer, an
    unused head, a `mid` layer whose lr the run sets to 0 midway, and an `out` layer that gets a NaN
    before the last checkpoint (see tests/diff_models.py)."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.frozen = nn.Linear(dim, dim)
        self.mid = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, 4)
        self.head = nn.Linear(dim, 3)  # never used in forward
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).mean(dim=1)
        h = torch.tanh(self.mid(torch.tanh(self.frozen(h))))
        out: torch.Tensor = self.out(h)
        return out


class SparseDyingUnit(nn.Module):
    """Zero-element, 1-D and sparse-gradient tensors next to a unit that dies: `emb` (10x4, sparse
    gradients), `empty` (0x3), `fc` (4->6, relu) and `out` (6->1); the test sets one of `fc`'s biases to
    -100 at a step of its choosing, so that unit's slices stop from then on."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.empty = nn.Parameter(torch.zeros(0, 3))
        self.fc = nn.Linear(4, 6)
        self.out = nn.Linear(6, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc(self.emb(ids).mean(1)))
        out: torch.Tensor = self.out(h) + self.empty.sum()
        return out


class OddTensors(nn.Module):
    """Tensors that are easy to get wrong: zero-element, a 0-d scalar, an fp16 layer, a lazy layer
    (materialised by the first forward) and a complex weight; a run must measure them without crashing."""

    def __init__(self) -> None:
        super().__init__()
        self.empty = nn.Parameter(torch.zeros(0, 4))
        self.scalar = nn.Parameter(torch.tensor(1.5))
        self.fp16 = nn.Linear(4, 4).half()
        self.lazy = nn.LazyLinear(3)
        self.cplx = nn.Parameter(torch.randn(3, 4, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fp16(x.half()).float() * self.scalar + self.empty.sum()
        h = h + (self.cplx @ torch.ones(4, dtype=torch.complex64)).real.sum()
        out: torch.Tensor = self.lazy(h)
        return out


# --- slices that never learn: embedding rows, dead units, dead filters; a branch cut off ------------------
class Bag(nn.Module):
    """An embedding bag (`emb`, 16 wide, optionally sparse or with a padding row) and a `head`: feed ids
    from part of the vocab only and exactly the other rows never change (reason `not_in_batch`)."""

    def __init__(self, sparse: bool = False, padding_idx: int | None = None, vocab: int = 100) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 16, sparse=sparse, padding_idx=padding_idx)
        self.head = nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.emb(ids).mean(1))
        return out


class DeadUnits(nn.Module):
    """Units 0..7 of fc1 never fire (bias -100 before the ReLU): rows 0-7 of `fc1.weight`, entries 0-7 of
    `fc1.bias` and columns 0-7 of `fc2.weight` never change."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)
        with torch.no_grad():
            self.fc1.bias[:8] = -100.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(torch.relu(self.fc1(x)))
        return out


class RareUnits(nn.Module):
    """A ReLU layer whose chosen units fire rarely on purpose, healthy: `fc1` (16->16, relu) and `fc2`
    (16->1). Units 0-11 of `fc1` are triggers: weight row j is 1 at input j and 0 elsewhere, bias -5, so a
    unit fires only on steps whose batch sets its input j to 10 (`batch` does, with probability `RATES[j]`
    per step: 5% for units 0-3, 10% for 4-7, 20% for 8-11); units 12-15 read inputs 12-15 (random) with bias
    +1 and fire on every step. What a test can assert, from its own per-step record of the gradient rows:
    units 0-11 get gradients on about their rate of steps to the end of the run, so none of them stopped;
    `kill` (bias -100, as a bad update would) stops a unit for good at the step a test chooses."""

    RATES = (0.05,) * 4 + (0.1,) * 4 + (0.2,) * 4

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 1)
        with torch.no_grad():
            self.fc1.weight[:12] = 0.0
            self.fc1.weight[:12, :12] = torch.eye(12)
            self.fc1.bias[:12] = -5.0
            self.fc1.weight[12:, :12] = 0.0
            self.fc1.bias[12:] = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(torch.relu(self.fc1(x)))
        return out

    def batch(self, gen: torch.Generator, size: int = 8) -> torch.Tensor:
        """One step's inputs: trigger j on (10) for the whole batch with probability `RATES[j]`, inputs
        12-15 standard normal."""
        fire = torch.rand(12, generator=gen) < torch.tensor(self.RATES)
        x = torch.randn(size, 16, generator=gen)
        x[:, :12] = 10.0 * fire.float()
        return x

    def kill(self, unit: int) -> None:
        with torch.no_grad():
            self.fc1.bias[unit] = -100.0


class RareBranch(nn.Module):
    """A healthy model with a branch taken now and then: `body` (8->8) on every step, `branch` (8->8) added
    only when `take` is set (a test draws it per step, e.g. on 10% of steps), `head` (8->1). `branch` gets a
    gradient (and an update) on exactly the steps that take it, to the end of the run: it never stopped,
    unless a test stops taking it for good."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.branch = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        self.take = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        if self.take:
            h = h + self.branch(h)
        out: torch.Tensor = self.head(h)
        return out


class WideReLU(nn.Module):
    """A ReLU layer of `width` units, healthy but for the units a test names: `fc1` (16->width, relu, bias +1:
    every other unit fires on every batch) and `fc2` (width->4). `dead` units never fire (bias -100 from the
    start): rows of `fc1.weight`, entries of `fc1.bias` and columns of `fc2.weight` that never change (the
    test's copy of the weights says which). `kill(units)` does the same mid-run (a bad update), so those units
    stop from that step on."""

    def __init__(self, width: int = 64, dead: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, width)
        self.fc2 = nn.Linear(width, 4)
        with torch.no_grad():
            self.fc1.bias.fill_(1.0)
        self.kill(dead)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(torch.relu(self.fc1(x)))
        return out

    def kill(self, units: tuple[int, ...] | list[int]) -> None:
        with torch.no_grad():
            self.fc1.bias[list(units)] = -100.0


class ResumePlanted(nn.Module):
    """A record of each kind a resumed run merges: `emb` (20x8, padding_idx 0: row 0 never learns by design;
    rows no batch holds never learn), `fc1` (8->16) whose units 0-2 never fire (bias -100 before the ReLU:
    rows 0-2 of `fc1.weight`, entries 0-2 of `fc1.bias` and columns 0-2 of `fc2.weight` get zero gradients),
    while its other units always fire (bias 1: none dies unless a test kills it), `fc2` (16->4), `late` (4->4,
    called while `use_late`: a test turns it off at a resume, so it stalls there) and `unused` (4->4, never
    called: grad None at every step). Input: token ids (batch, length)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8, padding_idx=0)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        self.late = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)
        self.use_late = True
        with torch.no_grad():
            self.fc1.bias[:3] = -100.0
            self.fc1.bias[3:] = 1.0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = self.fc2(torch.relu(self.fc1(self.emb(ids).mean(1))))
        return self.late(h) if self.use_late else h


class DeadFilters(nn.Module):
    """Filters 1, 4 and 5 of `conv1` never fire (bias -100 before the ReLU): those output channels of
    `conv1` and the matching input channels of `conv2` never change."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3)
        self.conv2 = nn.Conv2d(8, 4, 3)
        with torch.no_grad():
            self.conv1.bias[[1, 4, 5]] = -100.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.conv2(torch.relu(self.conv1(x)))
        return out


class SinusoidalEncoder(nn.Module):
    """A tiny sequence model that freezes its fixed sinusoidal position table in `__init__` (an
    `nn.Parameter` with requires_grad=False, as several libraries do), so an optimizer built from
    `model.parameters()` holds it. Input (T <= 16, 6): each row one position. Plants nothing: the table is
    frozen by design, every other tensor learns."""

    def __init__(self, positions: int = 16, d: int = 8) -> None:
        super().__init__()
        pos = torch.arange(positions, dtype=torch.float32)[:, None]
        freq = torch.exp(-math.log(10_000.0) * torch.arange(0, d, 2, dtype=torch.float32) / d)
        table = torch.cat([torch.sin(pos * freq), torch.cos(pos * freq)], dim=1)
        self.positions = nn.Parameter(table, requires_grad=False)
        self.proj = nn.Linear(6, d)
        self.head = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.tanh(self.proj(x) + self.positions[: x.shape[0]]))
        return out


class TwoPath(nn.Module):
    """`main` plus a `branch` (both 6->4), summed; each test plants a bug into the branch: frozen, or
    `mode` "detached" (no gradient reaches it: `no_grad`) or "times_zero" (an all-zero gradient: `zero_grad`)."""

    def __init__(self, mode: str = "ok") -> None:
        super().__init__()
        self.mode = mode
        self.main = nn.Linear(6, 4)
        self.branch = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.branch(x)
        if self.mode == "detached":
            b = b.detach()
        elif self.mode == "times_zero":
            b = b * 0
        return self.main(x) + b


# --- every bug at once; experts ---------------------------------------------------------------------------
class BiasedAttention(nn.Module):
    """One attention layer whose fused qkv projection has a bias, as `nn.Linear(d, 3 * d)` makes it: the key
    part of that bias gets no gradient but rounding noise (softmax is invariant to adding one constant to every
    score of a query, and q . b_k is that constant).

    Plants nothing: `key_bias_stuck` sets the key bias where fp32 rounds its noise-sized steps away."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.out(torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v)


class KeyBiasAttention(nn.Module):
    """`blocks` residual blocks of diffusers' own `Attention` (as its UNets use it, with `bias=True`: separate
    to_q/to_k/to_v projections, each with a bias) and a small MLP, then a linear head. Every `to_k.bias` gets
    no gradient but rounding noise (softmax is invariant to a key bias), ~1e-7 of the other tensors'; Adam
    barely moves it. Plants nothing: a healthy model whose key biases are harmless by construction."""

    def __init__(self, d: int = 16, blocks: int = 4) -> None:
        super().__init__()
        from diffusers.models.attention_processor import Attention

        self.attn = nn.ModuleList(Attention(d, heads=2, dim_head=d // 2, bias=True) for _ in range(blocks))
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(blocks))
        self.mlps = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)) for _ in range(blocks)
        )
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for attn, norm, mlp in zip(self.attn, self.norms, self.mlps):
            x = x + attn(norm(x))
            x = x + mlp(x)
        out: torch.Tensor = self.head(x).squeeze(-1)
        return out


def key_bias_stuck(model: BiasedAttention, value: float = 1.0) -> tuple[int, ...]:
    """Sets the key part of the qkv bias to `value` (1.0: fp32 resolves ~6e-8 there; the key bias's gradient is
    ~3e-9 noise, so SGD(lr=0.1, momentum=0.9) steps round away) and returns the key elements' indices."""
    d = model.qkv.out_features // 3
    with torch.no_grad():
        model.qkv.bias[d : 2 * d] = value
    return tuple(range(d, 2 * d))


class EveryBug(nn.Module):
    """One tensor per bug gradlog knows, around a healthy body and head."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.orphan = nn.Linear(8, 8, bias=False)  # left out of the optimizer
        self.unused = nn.Linear(8, 3)  # never called
        self.detached = nn.Linear(8, 8, bias=False)  # run under torch.no_grad()
        self.zero_lr = nn.Linear(8, 8, bias=False)  # its param group has lr 0
        self.times_zero = nn.Linear(8, 8, bias=False)  # output multiplied by 0
        self.nan = nn.Parameter(torch.ones(4))  # NaN gradient through the where-sqrt trap
        self.bf16 = nn.Parameter(torch.ones(8, dtype=torch.bfloat16))  # Adam's ~lr step rounds away in bf16
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        h = h + self.frozen(h) + self.orphan(h)
        with torch.no_grad():
            d = self.detached(h)
        h = h + d + self.zero_lr(h) + 0 * self.times_zero(h)
        h = h * self.bf16.float()
        trap = torch.where(torch.zeros(4, dtype=torch.bool), torch.sqrt(self.nan - 10), torch.zeros(4)).sum()
        return self.head(h) + trap


#: the reason gradlog must give for each tensor `EveryBug` plants a bug into (the rest learn)
EVERY_BUG = {
    "frozen.weight": Reason.FROZEN,
    "frozen.bias": Reason.FROZEN,
    "orphan.weight": Reason.NOT_IN_OPTIMIZER,
    "unused.weight": Reason.NO_GRAD,
    "unused.bias": Reason.NO_GRAD,
    "detached.weight": Reason.NO_GRAD,
    "zero_lr.weight": Reason.ZERO_LR,
    "times_zero.weight": Reason.ZERO_GRAD,
    "nan": Reason.NONFINITE_GRAD,
    "bf16": Reason.BELOW_PRECISION,
}


def every_bug_optimizer(model: EveryBug) -> torch.optim.Optimizer:
    """Adam over what `EveryBug` trains: `orphan` left out, `zero_lr` in its own group at lr 0."""
    skip = {"orphan.weight", "zero_lr.weight"}
    main = [p for n, p in model.named_parameters() if n not in skip and p.requires_grad]
    return torch.optim.Adam([{"params": main}, {"params": [model.zero_lr.weight], "lr": 0.0}], lr=1e-3)


class PerExpertMoE(nn.Module):
    """A MoE layer with one module per expert (`experts.3.w1.weight`) and a fixed routing: token t goes to
    expert `route[t]`, so the experts never in `route` get no gradient."""

    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d)) for _ in range(n)
        )

    def forward(self, x: torch.Tensor, route: list[int]) -> torch.Tensor:
        out = torch.zeros_like(x)
        for k in sorted(set(route)):
            at = torch.tensor([t for t, r in enumerate(route) if r == k])
            out = out.index_add(0, at, self.experts[k](x[at]))
        return out


class TwoLayerMoE(nn.Module):
    """Two `PerExpertMoE` layers of 6 experts with fixed `routes`: experts never routed to (4 and 5 in
    layer 0; 2, 3 and 5 in layer 1) get no gradient, and a test can change `routes` mid-run."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([PerExpertMoE(8, 6), PerExpertMoE(8, 6)])
        self.routes = [[0, 1, 2, 3, 0, 1], [0, 0, 1, 1, 4, 4]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, route in zip(self.layers, self.routes):
            x = x + layer(x, route)
        return x


class ConvExperts(nn.Module):
    """A Conv1d whose path says "experts": its 3-D weight holds filters, not experts."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Conv1d(4, 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.experts(x)
        return y[:, :4]  # filters 4-5 never reach the loss


# --- language-model shapes ------------------------------------------------------------------------------
class TiedLM(nn.Module):
    """`head.weight` is `emb.weight`: one tensor under two names, so a report must count it once and
    name the other as its alias."""

    def __init__(self, vocab: int = 20, dim: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.norm(self.emb(tokens)))
        return out


class TinyEncoderLM(nn.Module):
    """A healthy transformer-shaped LM (2 encoder layers, no dropout, a learned position table): nothing
    in it is planted, so any never-updated row it reports is a false alarm."""

    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(8, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.norm(self.blocks(self.emb(tokens) + self.pos)))
        return out


class TinyLM(nn.Module):
    """A healthy one-block transformer LM (token and position embeddings, optionally tied head): under
    AdamW with decay no slice is stuck, so any partly-updated record is a false alarm."""

    def __init__(self, vocab: int = 32, seq: int = 8, d: int = 16, tied: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.block = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        out: torch.Tensor = self.head(self.norm(self.block(h)))
        return out


class BiasesBeforeNorm(nn.Module):
    """Three Linear layers each followed by a BatchNorm (SimSiam's and many CNNs' pattern), then a head. No bug:
    the three biases in front of the BatchNorms get a gradient of rounding noise (~1e-9: the norm takes any
    shift back out), the head's bias a real one. Healthy: a run's update-ratio alerts must name nothing,
    though the three noise biases are the head bias's only 1-D bias peers."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.body = nn.Sequential(
            *(m for i in range(3) for m in (nn.Linear(8 if i == 0 else d, d), nn.BatchNorm1d(d), nn.ReLU()))
        )
        self.head = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))  # type: ignore[no-any-return]


class TinyClassifier(nn.Module):
    """Token and position embeddings (padding row 0), one encoder layer with dropout, a BatchNorm, a head;
    `model(ids=..., labels=...)` returns the loss, as a Hugging Face model does. Healthy: `check` on one
    dict batch must call it OK, its unseen rows only notes "in this batch"."""

    def __init__(self, vocab: int = 50, d: int = 16, max_len: int = 32) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d, padding_idx=0)
        self.pos = nn.Embedding(max_len, d)
        self.layer = nn.TransformerEncoderLayer(d, nhead=2, dim_feedforward=32, dropout=0.1, batch_first=True)
        self.norm = nn.BatchNorm1d(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        h = self.layer(self.tok(ids) + self.pos(pos))
        h = self.norm(h.mean(dim=1))
        logits = self.head(h)
        if labels is None:
            return logits
        return nn.functional.cross_entropy(logits, labels)


def tiny_gpt2(dtype: torch.dtype = torch.float32, activation: str = "gelu_new") -> nn.Module:
    """A 2-layer Hugging Face GPT-2 (n_embd 32, vocab 64, no dropout), seeded with 0 as it is built.

    `activation` is GPT-2's own default unless a test needs another (test_stopped_slices kills MLP
    units with a large negative bias, which only relu turns into exact zeros).
    """
    import transformers

    cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=16,
        activation_function=activation,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    model: nn.Module = transformers.GPT2LMHeadModel(cfg).to(dtype)
    return model


def tiny_mixtral(experts: int = 8) -> nn.Module:
    """A 2-layer Hugging Face Mixtral (hidden 16, vocab 64, top-2 of `experts` fused experts, no router
    jitter), seeded with 0 as it is built: a test masks the router to starve the experts it chooses."""
    import transformers

    cfg = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=experts,
        num_experts_per_tok=2,
        max_position_embeddings=32,
        router_jitter_noise=0.0,
    )
    torch.manual_seed(0)
    model: nn.Module = transformers.MixtralForCausalLM(cfg)
    return model


def mask_router(model: nn.Module, masked: list[int], active: Callable[[], bool]) -> list[Any]:
    """A forward hook on every router of a `tiny_mixtral` that sets the logits of `masked` experts to -inf
    while `active()`: those experts get no token, and the router's rows for them no gradient. Returns the
    hooks' handles."""

    def hook(mod: nn.Module, args: Any, out: Any) -> Any:
        if not active():
            return None
        logits = out[0]
        mask = torch.zeros(logits.shape[-1], dtype=torch.bool)
        mask[masked] = True
        logits = logits.masked_fill(mask, float("-inf"))
        probs = torch.softmax(logits.float(), dim=-1)
        top, idx = torch.topk(probs, mod.top_k, dim=-1)
        return logits, top / top.sum(-1, keepdim=True), idx

    return [m.register_forward_hook(hook) for n, m in model.named_modules() if n.endswith("mlp.gate")]


def lm_loss(model: nn.Module, gen: torch.Generator) -> torch.Tensor:
    """A Hugging Face causal LM's loss on a fresh batch of 4x12 token ids below 64 (the vocab of
    `tiny_gpt2` and `tiny_mixtral`), the labels being the ids themselves."""
    ids = torch.randint(0, 64, (4, 12), generator=gen)
    out: torch.Tensor = model(input_ids=ids, labels=ids).loss
    return out


def hf_args(output_dir: str, **kw: Any) -> Any:
    """`transformers.TrainingArguments` for a quiet CPU run (no reporting, no progress bar, no
    checkpoints unless `save_strategy` says so); `kw` holds what the test itself is about."""
    import transformers

    base: dict[str, Any] = {"report_to": [], "use_cpu": True, "save_strategy": "no", "disable_tqdm": True}
    return transformers.TrainingArguments(output_dir=output_dir, **{**base, **kw})


# --- helpers around a run --------------------------------------------------------------------------------
def untraced(found: Any) -> Any:
    """A report's dict with each detail cut before the traced step's explanation ("; traced step (..."): one
    process, DDP and FSDP2 trace a step to name the op that zeroed a gradient; under FSDP1 and
    DeepSpeed ZeRO the engine owns the gradients and the record says only what the measured steps showed
    (docs/distributed.md), so sharded runs are compared with their replica on everything else."""
    if isinstance(found, str):
        return found.split("; traced step (", 1)[0]
    if isinstance(found, dict):
        return {k: untraced(v) for k, v in found.items()}
    if isinstance(found, (list, tuple)):
        return type(found)(untraced(v) for v in found)
    return found


def two_ranks(
    worker: str, out: Path, suite: str, timeout: float = 120, env: dict[str, str] | None = None
) -> dict[str, list[Any]]:
    """Run `tests/<worker> OUT SUITE` on two gloo ranks with torchrun; each rank's records (`*-rank<r>.json`
    in `out`), grouped by name, rank 0 first. The repository is on the workers' PYTHONPATH."""
    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    cmd += ["--master_port", str(free_port()), str(root / "tests" / worker), str(out), suite]
    path = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run(
        cmd, env={**os.environ, "PYTHONPATH": path, **(env or {})}, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    found: dict[str, list[Any]] = {}
    for rank in (0, 1):
        for f in sorted(out.glob(f"*-rank{rank}.json")):
            found.setdefault(f.name.rsplit("-rank", 1)[0], []).append(json.loads(f.read_text()))
    return found


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a tensorboard server or a torchrun rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DyingUnitsCNN(nn.Module):
    """A small CNN of one's own: `conv` (1->4, 3x3 on 8x8), `fc1` (256->32), ReLU, `fc2` (32->10), then `extra`
    (10->10), which a test leaves out of the optimizer (`optimizer_without_extra`: reason not_in_optimizer).
    `kill(units)` drives those units of fc1 negative (bias -1e4): from the next step on they never fire, so
    `fc1.weight` rows, `fc1.bias` elements and `fc2.weight` columns stop getting a gradient there: one cause in
    three tensors. A test kills units at two steps and reads the last step each unit's gradient was non-zero
    itself (`fc1.bias.grad`)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.fc1 = nn.Linear(4 * 8 * 8, 32)
        self.fc2 = nn.Linear(32, 10)
        self.extra = nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x)).flatten(1)
        out: torch.Tensor = self.extra(self.fc2(torch.relu(self.fc1(h))))
        return out

    def kill(self, units: Sequence[int]) -> None:
        with torch.no_grad():
            self.fc1.bias[list(units)] = -1e4

    def optimizer_without_extra(self, lr: float = 0.01) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for n, p in self.named_parameters() if not n.startswith("extra.")], lr=lr)


# --- issue 39: where the path from the loss is cut, and tensors outside the model -------------------------
# Each planted statement carries a `# planted: <marker>` comment: a test finds its line with `planted_site`
# (never a hard-coded number) and asserts that the report names that file and line.
def planted_site(obj: Any, marker: str) -> str:
    """ "catalogue.py:123": the file and line of the statement in `obj`'s source marked `# planted: <marker>`."""
    import inspect
    import os

    lines, start = inspect.getsourcelines(obj)
    hits = [start + i for i, line in enumerate(lines) if line.rstrip().endswith(f"# planted: {marker}")]
    assert len(hits) == 1, f"{marker!r} marks {len(hits)} lines of {obj!r}"
    return f"{os.path.basename(inspect.getsourcefile(obj) or '')}:{hits[0]}"


def site_in(path: str, marker: str) -> str:
    """ "test_x.py:123": the line of the file at `path` (a test file's `__file__`) marked `# planted: <marker>`."""
    import os

    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    hits = [i + 1 for i, line in enumerate(lines) if line.rstrip().endswith(f"# planted: {marker}")]
    assert len(hits) == 1, f"{marker!r} marks {len(hits)} lines of {path}"
    return f"{os.path.basename(path)}:{hits[0]}"


class CutEncoder(nn.Module):
    """An encoder and a decoder; `cut` says how forward cuts the encoder off the loss: "detach"
    (``.detach()``), "no_grad" (a ``torch.no_grad()`` region), "inference" (``torch.inference_mode()``),
    "data" (``.data``), or "none" (the healthy twin). With a cut, enc.weight and enc.bias get grad None and
    the report must name the marked line; the decoder learns."""

    def __init__(self, cut: str = "none") -> None:
        super().__init__()
        self.cut = cut
        self.enc = nn.Linear(8, 6)
        self.dec = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cut == "detach":
            h = self.enc(x).detach()  # planted: detach
        elif self.cut == "no_grad":
            with torch.no_grad():
                h = self.enc(x)  # planted: no_grad
        elif self.cut == "inference":
            with torch.inference_mode():
                h = self.enc(x).clone()  # planted: inference
            h = h.clone()
        elif self.cut == "data":
            h = self.enc(x).data  # planted: data
        else:
            h = self.enc(x)
        out: torch.Tensor = self.dec(torch.relu(h))
        return out


class VQAutoencoder(nn.Module):
    """A VQ-VAE in miniature: encoder, a 5-entry codebook chosen by nearest neighbour (argmin), decoder.
    `straight_through=True` is the healthy twin (van den Oord et al.: ``z + (q - z).detach()`` and the
    codebook/commitment terms: every tensor learns though three ``.detach()`` cut the graph on purpose).
    False plants the classic bug: the decoder reads the code vectors themselves, so the argmin (marked) cuts
    the encoder off: enc.* get grad None. Forward returns the loss."""

    def __init__(self, straight_through: bool = True) -> None:
        super().__init__()
        self.straight_through = straight_through
        self.enc = nn.Linear(8, 3)
        self.book = nn.Embedding(5, 3)
        self.dec = nn.Linear(3, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.enc(x)
        idx = torch.cdist(z, self.book.weight).argmin(-1)  # planted: argmin
        q = self.book(idx)
        if not self.straight_through:
            return nn.functional.mse_loss(self.dec(q), x)
        st = z + (q - z).detach()
        commit = nn.functional.mse_loss(q, z.detach()) + 0.25 * nn.functional.mse_loss(z, q.detach())
        return nn.functional.mse_loss(self.dec(st), x) + commit


class RoundedCode(nn.Module):
    """An encoder whose output is rounded before the decoder: ``torch.round`` (marked) has a zero derivative,
    so enc.* get an exactly-zero gradient (`zero_grad`). `straight_through=True`, the healthy twin, rounds
    with ``h + (h.round() - h).detach()`` and the encoder learns."""

    def __init__(self, straight_through: bool = False) -> None:
        super().__init__()
        self.straight_through = straight_through
        self.enc = nn.Linear(8, 6)
        self.dec = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = 4 * self.enc(x)
        if self.straight_through:
            h = h + (h.round() - h).detach()
        else:
            h = torch.round(h)  # planted: round
        out: torch.Tensor = self.dec(h)
        return out


class EMATeacher(nn.Module):
    """Healthy: a student and a frozen teacher updated as the student's moving average under
    ``torch.no_grad()`` inside forward (BYOL, DINO, mean teacher); the loss pulls the student towards the
    teacher's output. The teacher's in-place updates read the student's weights under no_grad (cuts), yet the
    student learns: nothing may be reported but the teacher's intended freeze."""

    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Linear(8, 8)
        self.teacher = nn.Linear(8, 8)
        self.teacher.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = self.teacher(x)
            for t, s in zip(self.teacher.parameters(), self.student.parameters()):
                t.mul_(0.99).add_(s, alpha=0.01)
        return nn.functional.mse_loss(self.student(x), target)


class SimSiam(nn.Module):
    """Healthy: SimSiam's symmetric loss, each view's branch stopped with ``.detach()`` (a stop-gradient
    branch of a contrastive loss): encoder and predictor both learn."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 8)
        self.pred = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z1, z2 = self.enc(x), self.enc(x + 0.1 * torch.randn_like(x))
        sim = nn.functional.cosine_similarity
        return -(sim(self.pred(z1), z2.detach()).mean() + sim(self.pred(z2), z1.detach()).mean()) / 2


class Stacked(nn.Module):
    """Three Linear layers and a head. `container="list"` plants the bug: the layers sit in a plain Python
    list (marked), so they are used and get gradients but are no parameters of the model: the 6 tensors
    `layers[i].weight/bias` are `not_registered` and the model has only the head's 2. "modulelist" is the
    healthy twin (it also keeps a plain list of references to the registered layers, which is fine)."""

    def __init__(self, container: str = "modulelist") -> None:
        super().__init__()
        made = [nn.Linear(8, 8) for _ in range(3)]
        if container == "list":
            self.layers = made  # planted: list
        else:
            self.layers = nn.ModuleList(made)
            self.refs = list(made)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        out: torch.Tensor = self.head(x)
        return out


class MadeInForward(nn.Module):
    """Planted: a Linear created inside forward on every call (marked): its weight and bias take part and
    get gradients, but are new at every step and no parameter of the model (`not_registered`). Plus (with
    `scale`) a scale held as a plain ``requires_grad=True`` tensor attribute (`scale`: `not_registered`, fix
    nn.Parameter). Without `scale` nothing in the model's attributes gives the bug away: only the forward
    does. `in_init=True` is the healthy twin: the same Linear built once in __init__ (`mid`)."""

    def __init__(self, scale: bool = True, in_init: bool = False) -> None:
        super().__init__()
        self.head = nn.Linear(8, 4)
        self.scale = torch.ones(8, requires_grad=True) if scale else torch.ones(8)
        self.mid = nn.Linear(8, 8) if in_init else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mid is not None:
            h = self.mid(x * self.scale)
        else:
            h = nn.Linear(8, 8)(x * self.scale)  # planted: made
        out: torch.Tensor = self.head(h)
        return out


# --- issue 43: DeepSpeed ZeRO-1/2 measured against a plain-PyTorch replica --------------------------------
class ZeroPlanted(nn.Module):
    """`inp` (8->16), ReLU, `frozen` (16->16, requires_grad False: reason frozen), `dead` (16->16, added
    times 0.0: its gradient is exactly zero every step, reason zero_grad), `out` (16->4), then `extra` (4->4),
    which `groups()` leaves out of the optimizer (not_in_optimizer). `groups()`: two AdamW param groups of
    their own lr (the dead layer's without weight decay, so that nothing but its gradient could move it).
    `batch(step)`: the global batch of a step (8 rows), the same on every rank and in the replica."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.frozen = nn.Linear(16, 16).requires_grad_(False)
        self.dead = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)
        self.extra = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.frozen(torch.relu(self.inp(x)))
        h = h + 0.0 * self.dead(h)
        out: torch.Tensor = self.extra(self.out(h))
        return out

    def groups(self) -> list[dict[str, Any]]:
        return [
            {"params": [*self.inp.parameters(), *self.dead.parameters()], "lr": 1e-2, "weight_decay": 0.0},
            {"params": list(self.out.parameters()), "lr": 5e-3, "weight_decay": 0.1},
        ]

    @staticmethod
    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(1000 + step)
        return torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)


class FrozenDeadLeftOut(nn.Module):
    """`inp` (8->16), `frozen` (16->16, requires_grad False: reason `frozen`), `dead` (16->16, its output times 0:
    a gradient exactly zero at every step, reason `zero_grad`), `left` (16->16, left out of the optimizer by
    `optimizer_without_left`: reason `not_in_optimizer`) and `head` (16->4), tanh between them (no dead unit by
    chance: no per-slice finding). Exactly those six tensors never learn; the other four do. Under FSDP1 on two
    ranks with `inp` and `head` wrapped on their own, every flat parameter is cut inside a tensor and rank 0
    holds none of `head.bias` (tests/fsdp1_worker.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.dead = nn.Linear(16, 16)
        self.left = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.frozen(torch.tanh(self.inp(x)))
        h = h + 0.0 * self.dead(h)
        out: torch.Tensor = self.head(torch.tanh(self.left(h)))
        return out

    @staticmethod
    def optimizer_without_left(model: nn.Module, lr: float = 1e-2) -> torch.optim.Optimizer:
        """AdamW over the trainable tensors but `left.*` (names as the model, or a wrapper of it, gives them)."""
        params = [p for n, p in model.named_parameters() if p.requires_grad and ".left." not in f".{n}."]
        return torch.optim.AdamW(params, lr=lr)


# --- causes nobody planted before: a custom autograd.Function, a reentrant checkpoint, a term times 0 ------------
class _LinearFn(torch.autograd.Function):
    """A hand-written linear layer, y = x W^T + b, whose backward() is the test's to choose (`mode`: "ok" gives
    every input its gradient, "none" returns None for the weight, "zeros" an all-zero gradient for it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, mode: str) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.mode = mode
        return x @ w.t() + b

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        x, w = ctx.saved_tensors
        gw = g.t() @ x
        if ctx.mode == "none":
            gw = None  # planted: none
        elif ctx.mode == "zeros":
            gw = torch.zeros_like(w)  # planted: zeros
        return g @ w, gw, g.sum(0), None


class CustomFunctionLayer(nn.Module):
    """`inp` (8->16), `mid` (16->16) run through `_LinearFn` (a custom torch.autograd.Function), `head` (16->3),
    tanh between. `mode` "none" / "zeros" plants a backward() that gives `mid.weight` None / zeros (its bias
    still learns); "ok" is the healthy twin. Before, a weight given None was said to be "cleared between
    backward() and step()" (torch fires the post-accumulate hook with no gradient), and the Function's forward,
    run under no_grad by torch, would read as a torch.no_grad() block to move out of."""

    def __init__(self, mode: str = "ok") -> None:
        super().__init__()
        self.mode = mode
        self.inp = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(_LinearFn.apply(h, self.mid.weight, self.mid.bias, self.mode))
        out: torch.Tensor = self.head(h)
        return out


class ReentrantCheckpointed(nn.Module):
    """A frozen embedding (`emb`, 20x16), two Linear blocks run under ``torch.utils.checkpoint`` with
    use_reentrant=True (marked), and a `head`. As the embedding is frozen, no input of a checkpointed block
    requires grad: the reentrant checkpoint runs the block under no_grad and its weights get none (the LoRA /
    frozen-embedding bug Hugging Face's enable_input_require_grads() exists for). `reentrant=False` is the
    healthy twin. Input: token ids (batch, length)."""

    def __init__(self, reentrant: bool = True) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.emb = nn.Embedding(20, 16)
        self.emb.requires_grad_(False)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.emb(ids).mean(1)
        for block in self.blocks:
            h = checkpoint(lambda t, b=block: torch.tanh(b(t)), h, use_reentrant=self.reentrant)  # planted: checkpoint
        out: torch.Tensor = self.head(h)
        return out


class TwoHeadLoss(nn.Module):
    """A `body` and two heads, `a` (classes) and `b` (a regression), whose losses forward returns summed with the
    weight `b_weight`: 0 (marked, `loss_a + 0 * loss_b`, a head switched off by its weight) gives `b.*` an exactly zero
    gradient at every step; 0.5 is the healthy twin."""

    def __init__(self, b_weight: float = 0.0) -> None:
        super().__init__()
        self.b_weight = b_weight
        self.body = nn.Linear(8, 16)
        self.a = nn.Linear(16, 3)
        self.b = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        loss_a = nn.functional.cross_entropy(self.a(h), y)
        loss_b = nn.functional.mse_loss(self.b(h).squeeze(1), x[:, 0])
        out: torch.Tensor = loss_a + self.b_weight * loss_b  # planted: times_zero
        return out


# --- bugs3: more causes no test planted (tests/test_unseen_causes2.py) ----------------------------------------
class GatedBranch(nn.Module):
    """`a` (8->8) and a branch `b` (8->8) summed into `head` (8->3); `cut` says how forward silences the branch,
    each on its own marked line: "where" (``torch.where`` whose condition is True everywhere: `b` is never
    chosen), "dropout" (``nn.Dropout(p=1.0)``: every element dropped), "mask" (a mask built with the wrong
    comparison, all zeros), or "none", the healthy twin (the same where, dropout p=0.1 and mask, chosen right).
    With a cut, `b.weight` and `b.bias` get an exactly zero gradient at every step; the rest learns."""

    def __init__(self, cut: str = "none") -> None:
        super().__init__()
        self.cut = cut
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        self.drop = nn.Dropout(1.0 if cut == "dropout" else 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.relu(self.a(x)), self.b(x)
        if self.cut == "where":
            h = torch.where(x.abs() < 1e6, a, b)  # planted: where
        elif self.cut == "dropout":
            h = a + self.drop(b)  # planted: dropout
        elif self.cut == "mask":
            h = a + b * (x > 1e6).float()  # planted: mask
        else:
            h = torch.where(x > 0, a, b) + self.drop(b) * (x > 0).float()
        out: torch.Tensor = self.head(h)
        return out


class DeadLayer(nn.Module):
    """`inp` (8->16), ReLU, `mid` (16->16), ReLU, `head` (16->3). `bias` initialises `mid.bias` (marked): -100
    drives every `mid` unit below 0 for inputs of this scale, so the ReLU after it outputs zeros only: `inp.*` and
    `mid.*` get a zero gradient through it and `head.weight` reads only zeros (`head.bias` learns); 0 is the
    healthy twin."""

    def __init__(self, bias: float = -100.0) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)
        with torch.no_grad():
            self.mid.bias.fill_(bias)  # planted: bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.relu(self.mid(torch.relu(self.inp(x)))))
        return out


class IdsByMicroBatch(nn.Module):
    """An embedding (`emb`, 40x8) and a `head` (8->3) for gradient accumulation over 4 micro-batches, micro-batch m
    holding ids 10m..10m+9 only (`ids(step, m)`): with ``zero_grad()`` inside the accumulation loop only micro-batch
    3's gradient reaches step(), so rows 0-29 never change although every id was in a batch; with it once per
    optimizer step (the healthy twin) every row learns."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 8)
        self.head = nn.Linear(8, 3)

    @staticmethod
    def ids(step: int, micro: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(step * 4 + micro)
        return torch.randint(micro * 10, micro * 10 + 10, (16,), generator=gen)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.emb(ids))
        return out


class LooseParameters(nn.Module):
    """Two 8x8 matrices applied in turn, then a `head` (8->3). `holder` "list" or "dict" plants the bug: the matrices
    are nn.Parameters in a plain Python list (`ws[0]`, `ws[1]`) or dict (`ws['a']`, `ws['b']`), used and given
    gradients but no parameters of the model (`not_registered`); "parameterlist" is the healthy twin."""

    def __init__(self, holder: str = "parameterlist") -> None:
        super().__init__()
        made = [nn.Parameter(torch.randn(8, 8) * 0.3) for _ in range(2)]
        if holder == "list":
            self.ws: Any = made  # planted: list
        elif holder == "dict":
            self.ws = {"a": made[0], "b": made[1]}  # planted: dict
        else:
            self.ws = nn.ParameterList(made)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.ws.values() if isinstance(self.ws, dict) else self.ws:
            x = torch.relu(x @ w)
        out: torch.Tensor = self.head(x)
        return out


class SaturatedGate(nn.Module):
    """`a` (8->16) gated by sigmoid(`gate`(x)) plus a residual, then `head`: `gate.bias` at `bias` (-40, marked)
    saturates the sigmoid, whose derivative (~4e-18) leaves `gate.*` gradients far below fp32's resolution of their
    values under SGD (`tiny_update`); bias 0 is the healthy twin."""

    def __init__(self, bias: float = -40.0) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.gate = nn.Linear(8, 16)
        self.head = nn.Linear(16, 3)
        nn.init.constant_(self.gate.bias, bias)  # planted: saturated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        out: torch.Tensor = self.head(h * torch.sigmoid(self.gate(x)) + h)
        return out


class _NoGradEncoder(nn.Linear):
    """A Linear whose forward a decorator runs under no_grad (marked): what it computes has no graph."""

    @torch.no_grad()  # planted: decorator
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = super().forward(x)  # planted: call
        return out


class DecoratedEncoder(nn.Module):
    """`enc` (8->8) then `head` (8->3). `decorated=True` makes `enc` a `_NoGradEncoder`, whose forward carries
    ``@torch.no_grad()``: `enc.*` get grad None at every step, cut inside that forward by the decorator, not by a
    ``with`` block; False (a plain Linear) is the healthy twin."""

    def __init__(self, decorated: bool = True) -> None:
        super().__init__()
        self.enc = _NoGradEncoder(8, 8) if decorated else nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.relu(self.enc(x)))
        return out


class PaddedTokens(nn.Module):
    """Token embeddings (`emb`, 20x8) averaged into a `head` (8->3), with `padding_idx` (marked). `batch(step)`:
    16 sequences of 6 ids where id 1 is a frequent real token (every other position) and id 0 pads the last 0-2
    positions. padding_idx=1 plants the bug (a real token's row never learns, said "by design"); padding_idx=0,
    the true padding, is the healthy twin (its row is the note)."""

    def __init__(self, padding_idx: int = 1) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8, padding_idx=padding_idx)  # planted: padding_idx
        self.head = nn.Linear(8, 3)

    @staticmethod
    def batch(step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(2, 20, (16, 6), generator=gen)
        ids[:, ::2] = 1
        for row, pad in enumerate(torch.randint(0, 3, (16,), generator=gen).tolist()):
            ids[row, 6 - pad :] = 0
        return ids

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.emb(ids).mean(1))
        return out


# --- zoo4: an input feature no batch sets ---------------------------------------------------------------------
class MeanScaledInputs(nn.Module):
    """What transformers' time-series models (TimeSeriesTransformer, Informer, Autoformer) feed their first layer:
    the values divided by their mean absolute value, with log1p(|loc|) and log(scale) appended as features; under
    mean scaling loc is always 0, so input feature `self.zero_feature` of `inp` is 0 in every batch (by design: the
    column has nothing to learn from). Tanh after it, so no unit of the model is ever dead. Input (batch, 4)."""

    zero_feature = 4

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.abs().mean(1, keepdim=True).clamp_min(1e-10)
        loc = torch.zeros_like(scale)  # mean scaling has no location
        features = torch.cat([x / scale, loc.abs().log1p(), scale.log()], 1)
        out: torch.Tensor = self.out(torch.tanh(self.inp(features)))
        return out


class SaturatedBranch(nn.Module):
    """`a` (8->8) and a branch `b` (8->8) combined into `head` (8->3); `cut` says how forward saturates the branch,
    each on its own marked line: "clamp" (``clamp(min=50)`` above every value of `b`'s output: each output is the
    bound), "maximum" (``torch.maximum(a + 100, b)``: `a`'s side wins everywhere), "masked_fill" (a mask True
    everywhere fills every element of `b`'s output), or "none", the healthy twin (the same three ops with bounds,
    offsets and masks that let `b` through somewhere). With a cut, `b.weight` and `b.bias` get an exactly zero
    gradient at every step; the rest learns."""

    def __init__(self, cut: str = "none") -> None:
        super().__init__()
        self.cut = cut
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.relu(self.a(x)), self.b(x)
        if self.cut == "clamp":
            h = a + b.clamp(min=50.0)  # planted: clamp
        elif self.cut == "maximum":
            h = torch.maximum(a + 100.0, b)  # planted: maximum
        elif self.cut == "masked_fill":
            h = a + b.masked_fill(x.abs() < 1e6, 0.0)  # planted: masked_fill
        else:
            h = a + b.clamp(min=-0.5) + torch.maximum(a, b) + b.masked_fill(x > 1.0, 0.0)
        out: torch.Tensor = self.head(h)
        return out


class LearnedScale(nn.Module):
    """`inp` (8->16), ReLU, times a per-unit `scale` (16), `head` (16->3). `as_buffer` keeps `scale` as a buffer
    made with requires_grad=True (marked): backward() gives it a gradient every step, yet it is no parameter, so
    no optimizer built from ``parameters()`` steps it and it never changes; False makes it an nn.Parameter, the
    healthy twin."""

    def __init__(self, as_buffer: bool = True) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.head = nn.Linear(16, 3)
        if as_buffer:
            self.register_buffer("scale", torch.ones(16, requires_grad=True))  # planted: buffer
        else:
            self.scale = nn.Parameter(torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.relu(self.inp(x)) * self.scale)
        return out


class GainMadeInForward(DeadLayer):
    """DeadLayer(0) (healthy) times a per-unit `gain` that forward makes anew at every call (marked:
    ``self.gain = nn.Parameter(torch.ones(16))``), as a user who meant it to learn writes it in the wrong method:
    the optimizer holds the first one (when `warm`: one forward ran before it was built) or none, forward reads a
    new one each step, and no `gain` ever learns. `made_in="init"` is the healthy twin (made once in __init__)."""

    def __init__(self, made_in: str = "forward") -> None:
        super().__init__(0.0)
        self.made_in = made_in
        if made_in == "init":
            self.gain = nn.Parameter(torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.made_in == "forward":
            self.gain = nn.Parameter(torch.ones(16))  # planted: gain
        out: torch.Tensor = self.head(torch.relu(self.mid(torch.relu(self.inp(x)))) * self.gain)
        return out


class FreezesInForward(DeadLayer):
    """DeadLayer(0) (healthy) whose forward calls ``self.mid.requires_grad_(False)`` at every call when `freeze`
    (marked): a freeze meant for a later phase, written in the wrong place. `mid.*` never gets a gradient, though
    it required grad when the optimizer and gradlog started; False is the healthy twin."""

    def __init__(self, freeze: bool = True) -> None:
        super().__init__(0.0)
        self.freeze = freeze

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.freeze:
            self.mid.requires_grad_(False)  # planted: freeze
        return super().forward(x)


class CutInForward(DeadLayer):
    """DeadLayer(0) (healthy) whose forward cuts `inp` and `mid` off the loss on one marked line, as a user writes
    it by mistake: "argmax" (a hard choice fed to an embedding, no straight-through estimator), "compare" (a
    ``> 0`` gate), "tensor" (``torch.tensor(h)``: a copy with no graph), or "none", the healthy twin. With a cut,
    `inp.*` and `mid.*` get no gradient; the head learns (and `codes`, the embedding argmax and the twin read)."""

    def __init__(self, cut: str = "none") -> None:
        super().__init__(0.0)
        self.cut = cut
        self.codes = nn.Embedding(16, 16) if cut in ("argmax", "none") else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mid(torch.relu(self.inp(x)))
        if self.cut == "argmax" and self.codes is not None:
            h = self.codes(h.argmax(-1))  # planted: argmax
        elif self.cut == "compare":
            h = (h > 0).float() * x.sum(1, keepdim=True)  # planted: compare
        elif self.cut == "tensor":
            h = torch.tensor(h)  # planted: tensor
        elif self.codes is not None:
            h = torch.relu(h) + self.codes(x.abs().argmax(-1))
        out: torch.Tensor = self.head(h)
        return out
