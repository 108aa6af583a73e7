"""The two-phase (sharded) histogram must give what the one-pass histogram gives on the whole tensor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradlog
from gradlog.measure.bucketing import histogram_bucket, histogram_partials, histogram_ranges

CPU = torch.device("cpu")
BINS = 16


def sharded_histogram(shards: list[torch.Tensor]) -> torch.Tensor:
    """What the ranks compute: each its range, MIN/MAX over ranks, each buckets, SUM over ranks."""
    ranges = torch.cat([histogram_ranges([s], CPU) for s in shards])
    glob = torch.stack([ranges[:, 0].min(), ranges[:, 1].max()]).reshape(1, 2)
    parts = torch.cat([histogram_bucket([s], BINS, glob, CPU) for s in shards])
    out = parts.sum(0)
    out[BINS : BINS + 2] = parts[0, BINS : BINS + 2]  # min/max: the global range, kept, not summed
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_sharded_histogram_equals_whole_tensor(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(7, 5).to(dtype)
    x[1, 2] = float("nan")
    x[4, 0] = float("inf")
    x[6, 4] = -float("inf")
    shards = [x[:3], x[3:7], x[7:]]  # the last shard is empty, as on a rank holding no rows
    assert shards[2].numel() == 0
    want = histogram_partials([x], BINS, CPU)[0]
    got = sharded_histogram(shards)
    assert torch.equal(got[:BINS], want[:BINS])  # bucket counts, NaN/Inf taken out
    assert got[BINS : BINS + 2].tolist() == want[BINS : BINS + 2].tolist()  # min, max
    assert got[BINS + 4] == want[BINS + 4] == 3  # non-finite count
    scale = float(want[BINS + 3].sqrt()) * x.numel() ** 0.5  # fp32 sums in another order differ by rounding
    assert float(got[BINS + 2]) == pytest.approx(float(want[BINS + 2]), abs=1e-6 * scale)
    assert float(got[BINS + 3]) == pytest.approx(float(want[BINS + 3]), rel=1e-6)


def test_every_shard_empty_gives_an_empty_histogram() -> None:
    got = sharded_histogram([torch.zeros(0, 3), torch.zeros(0, 3)])
    assert got.abs().sum() == 0
    h = gradlog.Histogram.from_partials(got.tolist(), 0)
    assert h.count == 0 and h.min == 0 and h.max == 0


def test_single_process_run_makes_no_collective() -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gl = gradlog.GradLogger(model, opt, every=1, print_report=False)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    gl.log()
    gl.close()
    assert gl.meter.reducer is not None and not gl.meter.reducer.used


@pytest.mark.parametrize("bad", [0, -1.0, "30", True])
def test_sync_timeout_is_checked(bad: object) -> None:
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"sync_timeout must be a number of seconds > 0, got"):
        gradlog.GradLogger(model, None, writer=gradlog.Output(sync_timeout=bad))  # type: ignore[arg-type]
