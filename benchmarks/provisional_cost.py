"""Cost of one provisional table (issue 15) on the overhead benchmark's 200-block residual MLP (400 tensors).

A provisional table is `GradLogger.report()` (one fingerprint pass over every weight, one host copy)
plus writing three small tables. It runs on histogram steps, at most every `provisional_every`
seconds (default 120), so its cost per training step is this number divided by the steps in 120 s.
Printed: the median of `--repeats` provisional tables, next to the median training step of the same
model without gradlog, on this machine.
Run: PYTHONPATH=. python benchmarks/provisional_cost.py [--repeats 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import _mlp

import gradlog


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    device = torch.device("cpu")
    model, loss_fn = _mlp(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        loss_fn(model).backward()
        opt.step()
        opt.zero_grad()
        steps.append(time.perf_counter() - t)
    gl = gradlog.GradLogger(model, opt, writer="memory", every=1, provisional_every=None, print_report=False)
    loss_fn(model).backward()
    opt.step()
    gl.log(0)
    opt.zero_grad()
    costs = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        gl._write_provisional(0)
        costs.append(time.perf_counter() - t)
    gl.close()
    n = sum(p.numel() for p in model.parameters())
    step, cost = statistics.median(steps), statistics.median(costs)
    print(f"model: residual MLP, {len(list(model.parameters()))} tensors, {n / 1e6:.1f} M parameters")
    print(f"training step (no gradlog), median of {args.repeats}: {step * 1e3:.1f} ms")
    print(f"one provisional table, median of {args.repeats}: {cost * 1e3:.1f} ms ({cost / step:.2f} steps)")
    print(f"at most one per 120 s: {cost / 120 * 100:.3f}% of wall time")


if __name__ == "__main__":
    main()
