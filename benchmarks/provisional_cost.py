"""Cost of one provisional table (issue 15) on the overhead benchmark's 200-block residual MLP (400 tensors).

A provisional table is `GradLogger.report()` (one fingerprint pass over every weight, one host copy)
plus writing three small tables. It runs on histogram steps, at most every `provisional_every`
seconds (default 120), so its cost per training step is this number divided by the steps in 120 s.
Printed: the median of `--repeats` provisional tables, next to the median training step of the same
model without gradlog, on this machine.
`--frozen-backbone N`: a fine-tuning model instead (N frozen backbone parameters under a trainable
head, the overhead benchmark's `frozen` model); the provisional table reads no frozen tensor, so it is
printed next to the exact diagnosis close() runs (every tensor fingerprinted), interleaved, min of N.
Run: PYTHONPATH=. python benchmarks/provisional_cost.py [--repeats 10] [--frozen-backbone 100e6]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import _frozen, _mlp

import gradlog


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--frozen-backbone", type=float, default=0.0, help="frozen backbone parameters (0: the MLP)")
    args = ap.parse_args()
    device = torch.device("cpu")
    if args.frozen_backbone:
        frozen(device, args.frozen_backbone, args.repeats)
        return
    model, loss_fn = _mlp(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        loss_fn(model).backward()
        opt.step()
        opt.zero_grad()
        steps.append(time.perf_counter() - t)
    gl = gradlog.GradLogger(
        model, opt, every=1, print_report=False, writer=gradlog.Output(writer="memory", provisional_every=None)
    )
    loss_fn(model).backward()
    opt.step()
    gl.log(0)
    opt.zero_grad()
    costs = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        gl.write_provisional(0)
        costs.append(time.perf_counter() - t)
    gl.close()
    n = sum(p.numel() for p in model.parameters())
    step, cost = statistics.median(steps), statistics.median(costs)
    print(f"model: residual MLP, {len(list(model.parameters()))} tensors, {n / 1e6:.1f} M parameters")
    print(f"training step (no gradlog), median of {args.repeats}: {step * 1e3:.1f} ms")
    print(f"one provisional table, median of {args.repeats}: {cost * 1e3:.1f} ms ({cost / step:.2f} steps)")
    print(f"at most one per 120 s: {cost / 120 * 100:.3f}% of wall time")


def frozen(device: torch.device, backbone: float, repeats: int) -> None:
    model, loss_fn = _frozen(device, backbone)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    gl = gradlog.GradLogger(
        model, opt, every=1, print_report=False, writer=gradlog.Output(writer="memory", provisional_every=None)
    )
    for step in range(2):
        loss_fn(model).backward()
        opt.step()
        gl.log(step)
        opt.zero_grad()
    provisional, exact = [], []
    for _ in range(repeats):  # interleaved A/B in one process: the machine's load hits both alike
        t = time.perf_counter()
        gl.write_provisional(1)
        provisional.append(time.perf_counter() - t)
        t = time.perf_counter()
        gl.write_provisional(1, exact=True)
        exact.append(time.perf_counter() - t)
    gl.close()
    n = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"model: frozen backbone, {n / 1e6:.1f} M parameters, {trainable / 1e6:.1f} M trainable")
    print(f"one provisional table, min of {repeats}: {min(provisional) * 1e3:.1f} ms")
    print(f"the exact diagnosis (close()), min of {repeats}: {min(exact) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
