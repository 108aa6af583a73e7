"""How long `gradlog report` takes to read runs: a large TensorBoard run, and a folder of 10,000 empty event files.

The large run is written with gradlog's own TensorBoardWriter: 404 tensors x 100 measured steps, 5 scalars
and 3 histograms (64 bins) per tensor, like `GradLogger(..., histograms=True)` on a 404-tensor model, plus
the never-updated table. Then `gradlog.readers.run.load` reads it back (each event file once, records
checked with the C CRC32C). Run: PYTHONPATH=. python benchmarks/report_read.py [--tensors 404 --steps 100]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from gradlog.measure.bucketing import histogram_partials
from gradlog.measure.histogram import Histogram
from gradlog.readers.run import load
from gradlog.writers.tensorboard import TensorBoardWriter

METRICS = ("grad_norm", "update_ratio", "grad_zero_frac", "grad_nonfinite", "weight_norm")


def write_run(log_dir: str, tensors: int, steps: int) -> None:
    torch.manual_seed(0)
    sample = [torch.randn(64, 64) for _ in range(8)]
    rows = histogram_partials(sample, 64, torch.device("cpu")).tolist()
    hists = [Histogram.from_partials(r, 4096) for r in rows]
    writer = TensorBoardWriter(log_dir)
    for step in range(steps):
        row = {f"weights/{m}/layer{i}.weight": float(step + i) for m in METRICS for i in range(tensors)}
        writer.log_scalars(row, step)
        for i in range(tensors):
            for kind in ("grad", "weight", "update"):
                writer.log_histogram(f"weights/{kind}/layer{i}.weight", hists[i % len(hists)], step)
        writer.flush()
    writer.log_table("gradlog/never_updated", ["name", "shape", "numel", "reason", "detail"], [])
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tensors", type=int, default=404)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--empty", type=int, default=10_000, help="empty event files next to a small run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        big = os.path.join(tmp, "big")
        write_run(big, args.tensors, args.steps)
        size = sum(os.path.getsize(os.path.join(big, f)) for f in os.listdir(big))
        t0 = time.perf_counter()
        run = load(big)
        took = time.perf_counter() - t0
        print(
            f"{args.tensors} tensors x {args.steps} steps, {size / 1e6:.0f} MB: load {took:.2f} s, "
            f"{len(run.scalars)} scalar tags, skipped {len(run.skipped)}"
        )
        many = os.path.join(tmp, "many")
        write_run(many, 4, 5)
        for i in range(args.empty):
            open(os.path.join(many, f"events.out.tfevents.{i}.empty"), "wb").close()
        t0 = time.perf_counter()
        run = load(many)
        print(
            f"{args.empty:,} empty event files + 1 run: load {time.perf_counter() - t0:.2f} s ({len(run.files)} files)"
        )


if __name__ == "__main__":
    main()
