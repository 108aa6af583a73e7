"""What the per-slice gradient evidence adds to a measured step: an interleaved A/B in one process.

On the overhead benchmark's 400-tensor MLP (200 x Linear(256, 256) + LayerNorm-free residual
blocks, AdamW), gradlog's work on a measured step (the optimizer pre-hook's `meter.start`, the
post-hook's `meter.finish`, and `log()`) is timed with the evidence on and off (a private switch
on the meter, `_slice_evidence`), alternating which goes first, best of N per step kind:

- first measured step: every tensor's rows and columns seen for the first time (with zeros not
  counted, and counted: the default logger's step 0 is a histogram step, which counts them);
- steady step: a later measured step (a healthy model's tensors are complete: skipped);
- zero-count step (`count_zeros=True`): zeros counted, so `dead_frac` (rows of every tensor).

    PYTHONPATH=. python benchmarks/slice_evidence.py --repeat 15
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import torch

import gradlog

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import _mlp, adamw  # the benchmark's model, built from its config

KINDS = ("first", "first, zeros counted", "steady", "zero-count")
#: the main thread's CPU time: gradlog's measured-step work runs there, and on a machine shared with
#: other jobs it is inflated far less than wall time (`--wall` for wall time)
CLOCK = time.thread_time


def clocked(fn: Callable[..., Any], spent: list[float]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        t0 = CLOCK()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[0] += CLOCK() - t0

    return run


def evidence_logger(model: torch.nn.Module, opt: torch.optim.Optimizer) -> gradlog.GradLogger:
    """A logger that measures every step with no histograms, alerts or provisional tables: what is left
    of a measured step is the evidence an A/B switches on and off (this script's and stopped_evidence.py's)."""
    gl = gradlog.GradLogger(
        model,
        opt,
        every=1,
        print_report=False,
        alerts=False,
        histograms=gradlog.HistogramOptions(kinds=(), count_zeros=False),
        writer=gradlog.Output(writer=gradlog.MemoryWriter(), provisional_every=None),
    )
    return gl


def measured_steps(
    gl: gradlog.GradLogger,
    opt: torch.optim.Optimizer,
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module], torch.Tensor],
    kinds: Sequence[str],
    zero_kinds: Collection[str],
) -> dict[str, float]:
    """gradlog's time (seconds, `CLOCK`) on each measured step, one step per entry of `kinds` (the best per
    kind); zeros are counted on the `zero_kinds` steps. Closes `gl`."""
    spent = [0.0]
    gl.meter.start = clocked(gl.meter.start, spent)  # type: ignore[method-assign]
    gl.meter.finish = clocked(gl.meter.finish, spent)  # type: ignore[method-assign]
    out: dict[str, float] = {}
    for step, kind in enumerate(kinds):
        gl.pipeline.count_zeros = kind in zero_kinds
        opt.zero_grad()
        loss_fn(model).backward()
        spent[0] = 0.0
        opt.step()
        t0 = CLOCK()
        gl.log(step)
        spent[0] += CLOCK() - t0
        out[kind] = min(out.get(kind, float("inf")), spent[0])
    gl.close()
    return out


def one_run(
    evidence: bool,
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module], torch.Tensor],
    first_counted: bool = False,
) -> dict[str, float]:
    """A fresh logger; gradlog's time on a first, a steady and a zero-count measured step (seconds)."""
    opt = adamw(model)
    gl = evidence_logger(model, opt)
    gl.meter._slice_evidence = evidence
    first = "first, zeros counted" if first_counted else "first"
    kinds = (first, "steady", "steady", "zero-count")
    return measured_steps(gl, opt, model, loss_fn, kinds, ("first, zeros counted", "zero-count"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=15, help="A/B pairs (best of this many per kind and side)")
    ap.add_argument("--wall", action="store_true", help="wall-clock time instead of the thread's CPU time")
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.perf_counter if args.wall else time.thread_time
    model, loss_fn = _mlp(torch.device("cpu"))
    best: dict[tuple[bool, str], float] = defaultdict(lambda: float("inf"))
    for i in range(args.repeat):
        for evidence in (True, False) if i % 2 else (False, True):
            for counted in (False, True):  # the first step: zeros not counted / counted (the default's step 0)
                for kind, t in one_run(evidence, model, loss_fn, counted).items():
                    best[evidence, kind] = min(best[evidence, kind], t)
    clock = "wall" if args.wall else "main thread CPU"
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} threads; {clock} ms, best of {args.repeat} interleaved\n")
    print("| measured step | evidence off | evidence on | on / off |")
    print("|---|---:|---:|---:|")
    for kind in KINDS:
        off, on = best[False, kind], best[True, kind]
        print(f"| {kind} | {off * 1e3:.1f} | {on * 1e3:.1f} | {on / off:.3f} |")


if __name__ == "__main__":
    main()
