"""Per-logged-step cost of writing TensorBoard files: gradlog's TensorBoardWriter vs torch's SummaryWriter.

One logged step = 1,200 scalars + 400 histograms (64 bins), as a model with 400 tensors logs them
(5 scalar metrics x ~240 tensors, rounded). Measured on the training thread, including gradlog's
`flush()` that waits until the step is written to the OS; SummaryWriter is timed with and without
its `flush()`. Run: PYTHONPATH=. python benchmarks/tb_writer_cost.py [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from gradlog.measure.bucketing import histogram_partials
from gradlog.measure.histogram import Histogram
from gradlog.writers.tensorboard import TensorBoardWriter

N_SCALARS, N_HIST, BINS = 1200, 400, 64


def inputs() -> tuple[dict[str, float], list[tuple[str, Histogram, torch.Tensor]]]:
    torch.manual_seed(0)
    scalars = {f"metric{i % 5}/layer{i // 5}.weight": float(torch.rand(())) for i in range(N_SCALARS)}
    tensors = [torch.randn(64, 64) for _ in range(N_HIST)]
    rows = histogram_partials(tensors, BINS, torch.device("cpu")).tolist()
    hists = [
        (f"weights/grad/layer{i}.weight", Histogram.from_partials(r, 4096), t)
        for i, (r, t) in enumerate(zip(rows, tensors))
    ]
    return scalars, hists


def timed(step: Callable[[int], None], steps: int) -> float:
    """Median milliseconds per step, after two warm-up steps."""
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    scalars, hists = inputs()
    from torch.utils.tensorboard import SummaryWriter

    with tempfile.TemporaryDirectory() as tmp:
        gw = TensorBoardWriter(f"{tmp}/gradlog")
        enqueue: list[float] = []

        def gradlog_step(i: int) -> None:
            t0 = time.perf_counter()
            gw.log_scalars(scalars, i)
            for tag, h, _ in hists:
                gw.log_histogram(tag, h, i)
            enqueue.append(time.perf_counter() - t0)
            gw.flush()

        ms_gradlog = timed(gradlog_step, args.steps)
        gw.close()

        sw = SummaryWriter(f"{tmp}/torch")

        def torch_raw(i: int, flush: bool = True) -> None:
            for tag, v in scalars.items():
                sw.add_scalar(tag, v, i)
            for tag, h, _ in hists:
                sw.add_histogram_raw(
                    tag, h.min, h.max, h.count, h.sum, h.sum_squares, list(h.edges[1:]), list(h.counts), i
                )
            if flush:
                sw.flush()

        ms_torch_raw = timed(torch_raw, args.steps)
        ms_torch_raw_noflush = timed(lambda i: torch_raw(i, flush=False), args.steps)

        def torch_hist(i: int) -> None:
            for tag, _, t in hists:
                sw.add_histogram(tag, t, i)
            sw.flush()

        ms_torch_hist = timed(torch_hist, max(args.steps // 4, 3))
        sw.close()

    print(
        f"one logged step = {N_SCALARS} scalars + {N_HIST} histograms ({BINS} bins), median ms on the training thread"
    )
    print(f"gradlog TensorBoardWriter, incl. flush to the OS : {ms_gradlog:8.2f} ms")
    print(f"  of which enqueueing (before flush)              : {1e3 * statistics.median(enqueue[2:]):8.2f} ms")
    print(f"torch SummaryWriter add_scalar + add_histogram_raw + flush : {ms_torch_raw:8.2f} ms")
    print(f"torch SummaryWriter add_scalar + add_histogram_raw, no flush: {ms_torch_raw_noflush:8.2f} ms")
    print(f"torch SummaryWriter add_histogram (64x64 tensors) + flush, histograms only: {ms_torch_hist:8.2f} ms")


if __name__ == "__main__":
    main()
