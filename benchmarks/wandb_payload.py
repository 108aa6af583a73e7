"""Measure how many bytes one tensor costs in a W&B history row (offline run file), to size the per-step limit.

    PYTHONPATH=. python benchmarks/wandb_payload.py

Logs one gradlog step for N tensors (5 scalars + 3 histograms each) through WandbWriter in offline mode,
then reads the history record back and reports its size next to gradlog's upper-bound estimate.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch

from gradlog.measure.histogram import Histogram
from gradlog.readers.wandb_offline import find_run_files, read_chunks, read_finished_run
from gradlog.writers.wandb import StepPayload, WandbWriter, histogram_bytes, scalar_bytes


def step_payload(tensors: int, bins: int) -> StepPayload:
    torch.manual_seed(0)
    payload = StepPayload(1000)
    for t in range(tensors):
        name = f"model.layers.{t}.mlp.down_proj.weight"
        for metric in ("grad_norm", "update_ratio", "grad_zero_frac", "grad_nonfinite", "weight_norm"):
            payload.scalars[f"weights/{metric}/{name}"] = float(torch.rand(()).item())
        for kind in ("grad", "weight", "update"):
            x = torch.randn(4096) * 1e-3
            counts = torch.histc(x, bins=bins, min=float(x.min()), max=float(x.max()))
            payload.histograms[f"weights/{kind}/{name}"] = Histogram(
                tuple(counts.tolist()), float(x.min()), float(x.max()), float(x.sum()), float((x * x).sum()), 4096, 0
            )
    return payload


def main() -> None:
    from wandb.proto import wandb_internal_pb2 as pb

    tensors = 100
    for bins in (64, 512):
        payload = step_payload(tensors, bins)
        estimate = sum(scalar_bytes(k) for k in payload.scalars) + sum(
            histogram_bytes(t, h) for t, h in payload.histograms.items()
        )
        with tempfile.TemporaryDirectory() as root:
            os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
            writer = WandbWriter(log_dir=root, max_payload_bytes=10**9)
            writer.log_scalars(payload.scalars, payload.step)
            for tag, hist in payload.histograms.items():
                writer.log_histogram(tag, hist, payload.step)
            start = time.perf_counter()
            writer.flush()
            flush_s = time.perf_counter() - start
            writer.close()
            (path,) = find_run_files(root)
            read_finished_run(path)  # wait for wandb's service to write the tail
            with open(path, "rb") as f:
                data = f.read()
            sizes = []
            for raw in read_chunks(data, []):
                rec = pb.Record()
                rec.ParseFromString(raw)
                if rec.WhichOneof("record_type") == "history":
                    sizes.append(len(raw))
        real = max(sizes)
        print(
            f"bins={bins}: {tensors} tensors -> history record {real / 1e3:.0f} kB "
            f"({real / tensors / 1e3:.1f} kB per tensor), estimate {estimate / 1e3:.0f} kB; "
            f"4 MB budget fits ~{4_000_000 * tensors // estimate} tensors per row; flush {flush_s * 1e3:.0f} ms",
            file=sys.stdout,
        )


if __name__ == "__main__":
    main()
