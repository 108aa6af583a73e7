"""`Histograms`: one kind's histograms of a step kept as one block of rows, and the writers that receive it.

References: `Histogram.from_partials` of each row on its own, and tensors recorded by hand.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pytest
import torch
from test_stats import _near_edge
from torch import nn

import gradlog
from gradlog.measure.bucketing import histogram_partials
from gradlog.measure.histogram import Histogram, Histograms


def test_the_block_reads_like_a_dict_of_histograms_built_row_by_row() -> None:
    torch.manual_seed(0)
    xs = [torch.randn(5), torch.tensor([1.0, float("nan"), 3.0]), torch.zeros(0), torch.full((4,), 2.0)]
    rows = histogram_partials(xs, 8, torch.device("cpu"))
    block = Histograms(rows, [3, 5, 7, 9])
    expected = {p: Histogram.from_partials(r, 0) for p, r in zip([3, 5, 7, 9], rows.tolist())}
    assert isinstance(block, Mapping) and len(block) == 4 and list(block) == [3, 5, 7, 9]
    assert dict(block.items()) == expected and list(block.values()) == list(expected.values())
    assert block[5] == expected[5] and block[5].nonfinite == 1 and block[5].count == 2
    assert 4 not in block and block.get(4) is None
    assert dict(block.rows(1, 3).items()) == {5: expected[5], 7: expected[7]}
    keep = [False] * 10
    keep[3] = keep[9] = True
    assert dict(block.only(keep).items()) == {3: expected[3], 9: expected[9]}


def test_values_read_in_chunks_equal_each_row_built_alone() -> None:
    """`values()` reads its blocks a chunk of rows at a time: across chunk boundaries (150 rows, chunks of 64)
    every histogram must be the one `from_partials` builds from that row alone, for integer (CPU) and float
    (accelerator-layout) count blocks alike, and its counts must be floats with numpy's totals."""
    torch.manual_seed(3)
    xs = [torch.randn(40 + i) * (i + 1) for i in range(150)]
    xs[70] = torch.tensor([1.0, float("nan"), 2.0])  # a NaN row inside the second chunk
    rows = histogram_partials(xs, 8, torch.device("cpu"))
    positions = list(range(0, 300, 2))
    alone = [Histogram.from_partials(r, 0) for r in rows.tolist()]
    counts = rows[:, :8].to(torch.int32)
    for block in (Histograms(rows, positions), Histograms.of(counts, rows[:, 8:], positions)):
        got = list(block.values())
        assert got == alone and [block[p] for p in positions] == alone
        assert all(type(c) is float for h in got for c in h.counts)
    for x, h in zip(xs, alone):
        finite = x[torch.isfinite(x)].double().numpy()
        assert h.count == finite.size and h.nonfinite == x.numel() - finite.size
        ref, _ = np.histogram(finite, bins=8, range=(h.min, h.max))
        assert np.abs(np.asarray(h.counts) - ref).sum() <= 2 * _near_edge(finite, h.min, h.max, 8)


def test_bad_block_shapes_are_named() -> None:
    with pytest.raises(ValueError, match=r"partials must be \[len\(positions\), bins \+ 5\], got \(2, 13\)"):
        Histograms(torch.zeros(2, 13), [0, 1, 2])


class OneByOne(gradlog.Writer):
    """A custom writer that implements only the per-histogram call (what the docs tell users to write)."""

    def __init__(self) -> None:
        self.got: dict[tuple[str, int], Histogram] = {}

    def log_scalars(self, scalars: Mapping[str, float], step: int) -> None:
        pass

    def log_histogram(self, tag: str, hist: Histogram, step: int) -> None:
        self.got[(tag, step)] = hist

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
        pass


def test_a_writer_with_only_log_histogram_gets_every_histogram_of_the_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    custom = OneByOne()
    gl = gradlog.GradLogger(model, opt, writer=custom, every=2, print_report=False)
    after: dict[int, dict[str, torch.Tensor]] = {}
    for step in range(4):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        gl.log(step)
        after[step] = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.zero_grad()
    gl.close()
    names = [n for n, _ in model.named_parameters()]
    assert set(custom.got) == {
        (f"weights/{k}/{n}", s) for k in ("grad", "weight", "update") for n in names for s in (0, 2)
    }
    for s in (0, 2):
        for n in names:
            w = after[s][n].double()
            h = custom.got[(f"weights/weight/{n}", s)]
            assert h.count == w.numel() and sum(h.counts) == w.numel()
            assert h.sum == pytest.approx(w.sum().item(), abs=1e-6 * w.abs().sum().item())  # summed in float32
            assert (h.min, h.max) == (w.min().item(), w.max().item())


def test_wandb_block_payloads_equal_histogram_payload_row_by_row() -> None:
    pytest.importorskip("wandb")
    from gradlog.writers.wandb import block_payloads, histogram_payload

    torch.manual_seed(0)
    xs = [
        torch.randn(50),
        torch.randn(7) * 1e30,
        torch.full((5,), 3.0),  # constant: one tiny bucket
        torch.full((4,), -2.5e-9),
        torch.zeros(3),
        torch.zeros(0),  # empty: nothing to draw
        torch.tensor([float("nan"), float("inf")]),  # no finite value: nothing to draw
        torch.tensor([1.0, float("nan"), -4.0, float("-inf"), 2.0]),
        torch.tensor([-3.4e38, 3.4e38]),  # edges overflow float32 but not float64
        torch.tensor([-1.7e308, 1.7e308], dtype=torch.float64),  # the width overflows float64: nothing to draw
    ]
    for bins in (1, 7, 64):
        block = Histograms(histogram_partials(xs, bins, torch.device("cpu")), list(range(len(xs))))
        expected = [histogram_payload(h) for h in block.values()]
        assert block_payloads(block) == expected
        assert [i for i, e in enumerate(expected) if e is None] == [5, 6, 9]
    assert block_payloads(Histograms(torch.zeros(0, 69), [])) == []


class Blocks(gradlog.Writer):
    """Keeps each step's histogram blocks as the writers receive them."""

    def __init__(self) -> None:
        self.got: dict[tuple[str, int], Histograms] = {}

    def log_scalars(self, scalars: Mapping[str, float], step: int) -> None:
        pass

    def log_histogram(self, tag: str, hist: Histogram, step: int) -> None:
        raise AssertionError("log_histograms takes the whole block")

    def log_histograms(self, tags: Sequence[str], hists: Histograms, step: int) -> None:
        self.got[(tags[0].split("/")[1], step)] = hists

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
        pass


def test_cpu_steps_hold_integer_counts_that_match_numpy_by_hand() -> None:
    """On the CPU a step's blocks keep int32 counts (half the memory of float64 rows, held beside the
    weight snapshot); every count still equals numpy's histogram of the tensor kept by hand."""
    torch.manual_seed(0)
    # 12 same-shape layers go through the batched path, the 3000-wide one through the one-by-one path
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(12)], nn.Linear(8, 3000), nn.Linear(3000, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    blocks = Blocks()
    gl = gradlog.GradLogger(
        model, opt, writer=blocks, every=1, print_report=False, histograms=gradlog.HistogramOptions(bins=16)
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(torch.randn(4, 8)).pow(2).mean().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]
    opt.step()
    gl.log(0)
    gl.close()
    names = [n for n, _ in model.named_parameters()]
    expected = {
        "weight": {n: p.detach().clone() for n, p in model.named_parameters()},
        "grad": grads,
        "update": {n: p.detach() - before[n] for n, p in model.named_parameters()},
    }
    for kind, values in expected.items():
        block = blocks.got[(kind, 0)]
        assert block.counts.dtype == torch.int32 and block.moments.dtype == torch.float64, kind
        assert len(block) == len(names)
        for n, h in zip(names, block.values()):
            v = values[n].double().numpy().reshape(-1)
            lo, hi = v.min(), v.max()
            assert (h.min, h.max) == pytest.approx((lo, hi), rel=1e-6, abs=1e-12), (kind, n)
            assert h.count == v.size and h.sum == pytest.approx(v.sum(), rel=1e-4, abs=1e-6), (kind, n)
            if lo == hi:  # a constant tensor (the last bias has one entry): everything in bucket 0
                assert h.counts[0] == v.size, (kind, n)
                continue
            ref, _ = np.histogram(v, bins=16, range=(h.min, h.max))
            diff = np.abs(np.asarray(h.counts) - ref).sum()
            assert diff <= 2 * _near_edge(v, h.min, h.max, 16), (kind, n, h.counts, ref.tolist())


def test_integer_blocks_are_checked_for_shape() -> None:
    with pytest.raises(ValueError, match=r"counts must be \[3, bins\] and moments \[3, 5\], got \(3, 4\) and \(2, 5\)"):
        Histograms.of(torch.zeros(3, 4, dtype=torch.int32), torch.zeros(2, 5), [0, 1, 2])
