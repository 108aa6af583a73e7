"""Device statistics against independent references: torch.linalg.vector_norm, numpy.histogram.

Both code paths run here: the CPU one (reads values back to skip work) and the accelerator one
(branch-free on the device), forced on the CPU by switching `host_reads_free` off.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_fingerprint import assert_huge_page_eligible

from gradlog.measure import bucketing, stats
from gradlog.measure.bucketing import histogram_partials
from gradlog.measure.histogram import Histogram
from gradlog.measure.stats import (
    NONFINITE,
    NONZERO,
    SUMSQ,
    copy_with_sumsq,
    dense_values,
    norm_partials,
    subtract_with_sumsq,
)

CPU = torch.device("cpu")


def _patch(mp: pytest.MonkeyPatch, name: str, value: object) -> None:
    """Sets `name` in `stats` and in `bucketing` (which imports some of stats' names), where each has it."""
    for mod in (stats, bucketing):
        if hasattr(mod, name):
            mp.setattr(mod, name, value)


@pytest.fixture(params=["host", "device"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "device":
        _patch(monkeypatch, "host_reads_free", lambda device: False)
        _patch(monkeypatch, "_SCRATCH_BYTES", 256)  # several scratch slices even for these small tensors
    return str(request.param)


def _poisoned(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    x[x.abs() < 0.3] = 0  # exact zeros
    x = x.to(dtype)
    flat = x.view(-1)
    flat[3] = math.nan
    flat[7] = math.inf
    flat[11] = -math.inf
    return x


def _mixed() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [
        torch.randn(17, 5),
        _poisoned((40, 3), torch.float32, 1),
        torch.randn(9, dtype=torch.float64),
        _poisoned((64,), torch.bfloat16, 2),
        torch.randn(33).to(torch.float16),
        torch.randn(6, 4, dtype=torch.complex64),
        torch.zeros(5),
        torch.empty(0),
        torch.full((8,), math.nan),
        torch.tensor([3e38, 3e38, -3e38]),  # finite entries whose fp32 sum of squares overflows
        torch.arange(-3, 4),
    ]


def test_norm_partials_match_vector_norm_and_exact_counts(path: str) -> None:
    xs = _mixed()
    out = norm_partials(xs, CPU)
    assert out.shape == (len(xs), 3) and out.dtype == torch.float64
    for i, x in enumerate(xs):
        ref = x.double() if not x.is_complex() else x.to(torch.complex128)
        expected = torch.linalg.vector_norm(ref).item() ** 2
        got = out[i, SUMSQ].item()
        if math.isfinite(expected) and expected < 1e30:
            assert got == pytest.approx(expected, rel=1e-5, abs=1e-12), (i, x.dtype)
        elif x.dtype == torch.float32 and torch.isfinite(x).all():
            assert got == math.inf  # fp32 accumulation overflows, as clip_grad_norm_ would
        else:
            assert not math.isfinite(got), i
        assert out[i, NONZERO].item() == torch.count_nonzero(x).item(), i  # NaN/Inf are non-zero
        assert out[i, NONFINITE].item() == (~torch.isfinite(x)).sum().item(), i


def test_norm_partials_without_counts_and_sparse_values() -> None:
    dense = torch.zeros(50, 4)
    dense[[1, 7, 7, 30]] = torch.tensor([1.0, 2.0, 3.0, -4.0]).unsqueeze(1)
    sparse = dense.to_sparse()
    out = norm_partials([dense_values(sparse)], CPU)
    assert out[0, SUMSQ].item() == pytest.approx(torch.linalg.vector_norm(dense).item() ** 2)
    assert out[0, NONZERO].item() == 12 and out[0, NONFINITE].item() == 0
    only = norm_partials([dense], CPU, counts=False)
    assert only[0, SUMSQ].item() == pytest.approx(torch.linalg.vector_norm(dense).item() ** 2)
    assert only[0, NONZERO].item() == 0 and only[0, NONFINITE].item() == 0


def test_zero_flags_without_counting_tell_all_zero_tensors_apart(path: str) -> None:
    xs = [*_mixed(), torch.full((4,), 1e-30), torch.zeros(3, dtype=torch.bfloat16)]
    counted = norm_partials(xs, CPU)
    flags = norm_partials(xs, CPU, zero_counts=False)
    torch.testing.assert_close(flags[:, [SUMSQ, NONFINITE]], counted[:, [SUMSQ, NONFINITE]], equal_nan=True)
    for i, x in enumerate(xs):
        if path == "device" and i == len(xs) - 2:
            assert flags[i, NONZERO].item() == 0  # documented: below ~1e-23 everywhere reads as zero there
            continue
        assert (flags[i, NONZERO].item() > 0) == bool(torch.count_nonzero(x) > 0), (i, x)


@pytest.mark.parametrize("cache_bytes", [1 << 20, 64])
def test_copy_and_subtract_give_norms_of_copies_and_differences(
    path: str, cache_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snapshot and update helpers work a cache-sized slice at a time on the CPU; slicing must not show."""
    _patch(monkeypatch, "_CACHE_BYTES", cache_bytes)
    torch.manual_seed(6)
    xs = [
        torch.randn(30, 7),
        torch.randn(5, dtype=torch.float64),
        torch.randn(40).to(torch.bfloat16),
        torch.randn(3, 3, dtype=torch.complex64),
        torch.randn(100),
        torch.zeros(0),
    ]
    copies, before = copy_with_sumsq(xs, CPU)
    assert len(copies) == len(xs) and before.shape == (len(xs),)
    for i, (x, c) in enumerate(zip(xs, copies)):
        assert c.dtype == x.dtype and torch.equal(c, x)
        assert x.numel() == 0 or c.data_ptr() != x.data_ptr()  # a copy, not a view
        assert before[i].item() == pytest.approx(
            torch.linalg.vector_norm(x.double() if not x.is_complex() else x).item() ** 2, rel=1e-5
        )
    after = [x + 0.5 if not x.is_complex() else x * 2 for x in xs]
    diffs = [c.double() - a.double() if not c.is_complex() else c - a for c, a in zip(copies, after)]
    weight, update = subtract_with_sumsq(copies, after, CPU)
    for i, a in enumerate(after):
        assert weight[i].item() == pytest.approx(
            torch.linalg.vector_norm(a.double() if not a.is_complex() else a).item() ** 2, rel=1e-5
        )
        assert update[i].item() == pytest.approx(
            torch.linalg.vector_norm(diffs[i]).item() ** 2, rel=1e-2 if a.dtype == torch.bfloat16 else 1e-5
        )
        assert torch.allclose(
            copies[i], (xs[i] - a).to(copies[i].dtype)
        )  # in place: the copies now hold before - after


def _near_edge(values: np.ndarray, lo: float, hi: float, bins: int) -> int:
    """Values so close to a bucket edge that fp32 rounding may put them on either side."""
    if values.size == 0 or hi <= lo:
        return 0
    edges = np.linspace(lo, hi, bins + 1)
    gap = np.min(np.abs(values[:, None] - edges[None, 1:-1]), axis=1) if bins > 1 else np.full(values.size, np.inf)
    return int((gap <= 1e-5 * (hi - lo)).sum())


@pytest.mark.parametrize("bins", [1, 7, 64, 300])
def test_histogram_partials_match_numpy(path: str, bins: int) -> None:
    xs = _mixed()
    out = histogram_partials(xs, bins, CPU)
    assert out.shape == (len(xs), bins + 5)
    for i, x in enumerate(xs):
        v = x.abs() if x.is_complex() else x
        v = v.double().numpy().reshape(-1)
        finite = v[np.isfinite(v)]
        h = Histogram.from_partials(out[i].tolist(), x.numel())
        assert h.nonfinite == v.size - finite.size, i
        assert h.count == finite.size, i
        if finite.size == 0:
            assert h.counts == (0.0,) * bins and (h.min, h.max, h.sum) == (0.0, 0.0, 0.0)
            continue
        lo, hi = finite.min(), finite.max()
        if h.nonfinite:  # NaN/Inf stand at 0 for the range
            lo, hi = min(lo, 0.0), max(hi, 0.0)
        assert (h.min, h.max) == (lo, hi), i
        if np.abs(finite).max() < 1e18:  # beyond, fp32 accumulation overflows (as torch.sum does)
            assert h.sum == pytest.approx(finite.sum(), rel=1e-3, abs=1e-3)
            assert h.sum_squares == pytest.approx(np.dot(finite, finite), rel=1e-3)
        if lo == hi:
            assert h.counts[0] == finite.size  # a constant tensor: everything in bucket 0
            continue
        ref, _ = np.histogram(finite, bins=bins, range=(lo, hi))
        diff = np.abs(np.asarray(h.counts) - ref).sum()
        assert diff <= 2 * _near_edge(finite, lo, hi, bins), (i, h.counts, ref.tolist())


def test_histogram_of_many_values_is_exact_against_numpy(path: str) -> None:
    torch.manual_seed(3)
    x = torch.randn(100_000)
    x[::997] = math.nan
    x[5::1009] = math.inf
    out = histogram_partials([x], 64, CPU)
    h = Histogram.from_partials(out[0].tolist(), x.numel())
    finite = x[torch.isfinite(x)].double().numpy()
    lo, hi = min(finite.min(), 0.0), max(finite.max(), 0.0)
    ref, _ = np.histogram(finite, bins=64, range=(lo, hi))
    assert h.nonfinite == x.numel() - finite.size
    assert sum(h.counts) == finite.size
    assert np.abs(np.asarray(h.counts) - ref).sum() <= 2 * _near_edge(finite, lo, hi, 64)


def test_histogram_agrees_with_torch_histc_on_finite_data() -> None:
    torch.manual_seed(4)
    x = torch.rand(4096) * 10 - 3
    out = histogram_partials([x], 50, CPU)
    ref = torch.histc(x, 50, x.min().item(), x.max().item())
    assert (out[0, :50] - ref.double()).abs().sum().item() <= 2 * _near_edge(
        x.double().numpy(), x.min().item(), x.max().item(), 50
    )


def test_host_and_device_paths_agree() -> None:
    xs = _mixed()
    host = histogram_partials(xs, 16, CPU)
    stats_host = norm_partials(xs, CPU)
    with pytest.MonkeyPatch.context() as mp:
        _patch(mp, "host_reads_free", lambda device: False)
        dev = histogram_partials(xs, 16, CPU)
        stats_dev = norm_partials(xs, CPU)
    torch.testing.assert_close(stats_host, stats_dev, equal_nan=True)
    torch.testing.assert_close(host[:, 16:], dev[:, 16:], equal_nan=True, rtol=1e-5, atol=1e-5)
    assert (host[:, :16].sum(1) == dev[:, :16].sum(1)).all()


@pytest.mark.parametrize("slice_entries", [1 << 20, 4096, 1000])
def test_counts_of_large_tensors_take_the_same_values(
    path: str, slice_entries: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU counts large tensors a slice at a time; the counts must not depend on the slicing."""
    _patch(monkeypatch, "_COUNT_SLICE", slice_entries)
    torch.manual_seed(5)
    x = torch.randn(300_000)
    x[x.abs() < 0.1] = 0
    x[7::13] = -0.0  # equal to zero, though its bits are not
    x[::4099] = math.nan
    x[1::5003] = -math.inf
    half = x[:200_000].to(torch.bfloat16)
    cplx = torch.complex(x[:50_000], torch.zeros(50_000))
    strided = x[: 200 * 300].reshape(200, 300).t()  # not contiguous
    out = norm_partials([x, half, cplx, strided], CPU)
    for i, t in enumerate([x, half, cplx, strided]):
        assert out[i, NONZERO].item() == torch.count_nonzero(t).item()
        assert out[i, NONFINITE].item() == (~torch.isfinite(t)).sum().item()
        assert not math.isfinite(out[i, SUMSQ].item())


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.double() if not t.is_complex() else t.to(torch.complex128)


def test_tiny_cache_slices_and_histograms_in_pieces_give_the_same_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU statistics work a cache-sized slice of tensors at a time, and a histogram buckets a
    tensor bigger than the slice in flat pieces (views): with a 64-byte slice every tensor here is cut,
    and norms, counts, copies, updates and histograms must come out as with 1 MB (references: torch, numpy)."""
    torch.manual_seed(9)
    xs = [
        _poisoned((300, 7), torch.float32, 3),
        torch.randn(1000, dtype=torch.float64),
        _poisoned((40, 25), torch.bfloat16, 4),
        torch.randn(13, 11, dtype=torch.complex64),
        torch.randn(50, 40).t(),  # not contiguous: stays whole
        torch.zeros(999),
        torch.randn(3),
    ]
    whole = norm_partials(xs, CPU)
    whole_flags = norm_partials(xs, CPU, zero_counts=False)
    _patch(monkeypatch, "_CACHE_BYTES", 64)  # every tensor above 64 bytes is cut
    cut = norm_partials(xs, CPU)
    torch.testing.assert_close(cut, whole, rtol=1e-5, atol=0, equal_nan=True)
    assert torch.equal(cut[:, NONZERO], whole[:, NONZERO]) and torch.equal(cut[:, NONFINITE], whole[:, NONFINITE])
    flags = norm_partials(xs, CPU, zero_counts=False)
    assert torch.equal(flags[:, NONZERO] > 0, whole_flags[:, NONZERO] > 0)
    assert torch.equal(flags[:, NONFINITE], whole[:, NONFINITE])

    finite = [x for x in xs if bool(torch.isfinite(x).all())]
    copies, before = copy_with_sumsq(finite, CPU)
    for x, c, b in zip(finite, copies, before.tolist()):
        assert torch.equal(c, x) and c.shape == x.shape and c.data_ptr() != x.data_ptr()
        ref = torch.linalg.vector_norm(x.double() if not x.is_complex() else x).item() ** 2
        assert b == pytest.approx(ref, rel=1e-5)
    after = [x * 0.5 + 1 if not x.is_complex() else x * 2 for x in finite]
    expect = [c.clone() - a for c, a in zip(copies, after)]
    weight, update = subtract_with_sumsq(copies, after, CPU)
    for a, c, e, w, u in zip(after, copies, expect, weight.tolist(), update.tolist()):
        assert torch.equal(c, e)  # in place, piece by piece
        assert w == pytest.approx(torch.linalg.vector_norm(_wide(a)).item() ** 2, rel=1e-5)
        assert u == pytest.approx(
            torch.linalg.vector_norm(_wide(e)).item() ** 2, rel=1e-2 if a.dtype == torch.bfloat16 else 1e-5
        )

    _patch(monkeypatch, "_CACHE_BYTES", 1 << 20)
    hist_whole = histogram_partials(xs, 64, CPU)
    _patch(monkeypatch, "_CACHE_BYTES", 64)
    _patch(monkeypatch, "_GROUP_BYTES", 64)  # and each tensor's moments read back on their own
    hist_cut = histogram_partials(xs, 64, CPU)
    assert torch.equal(hist_cut[:, :64], hist_whole[:, :64])  # bucket counts are exact
    torch.testing.assert_close(hist_cut[:, 64:], hist_whole[:, 64:], rtol=1e-5, atol=1e-6, equal_nan=True)
    for i, x in enumerate(xs):
        v = (x.abs() if x.is_complex() else x).double().reshape(-1).numpy()
        v = v[np.isfinite(v)]
        assert hist_cut[i, :64].sum().item() == v.size
        if v.size:
            assert hist_cut[i, 64 + 2].item() == pytest.approx(v.sum(), rel=1e-4, abs=1e-3)


@pytest.mark.parametrize("bins", [1, 64, 300])
def test_small_tensors_bucketed_in_batches_match_one_by_one_and_numpy(
    bins: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many small tensors of one size are bucketed as one stacked block; each must get exactly the buckets
    it gets alone, and numpy's (up to values on a bucket edge). NaN/Inf rows leave the block."""
    torch.manual_seed(11)
    xs = [torch.randn(8, 4) * 10.0**k for k in range(-3, 4)]  # one size, very different ranges
    xs += [torch.full((8, 4), 2.5), torch.zeros(32), torch.randn(32, dtype=torch.float64)]
    xs += [torch.randn(32).abs() + 1, _poisoned((8, 4), torch.float32, 5), torch.randn(7), torch.randn(7)]
    batched = histogram_partials(xs, bins, CPU)
    _patch(monkeypatch, "_BATCH_NUMEL", 0)  # every tensor one by one
    alone = histogram_partials(xs, bins, CPU)
    assert torch.equal(batched[:, :bins], alone[:, :bins])
    torch.testing.assert_close(batched[:, bins:], alone[:, bins:], rtol=1e-5, atol=1e-9)
    for i, x in enumerate(xs):
        v = x.double().reshape(-1).numpy()
        v = v[np.isfinite(v)]
        lo, hi = batched[i, bins].item(), batched[i, bins + 1].item()
        assert lo == v.min() and hi == v.max()
        if hi > lo:
            ref, _ = np.histogram(v, bins=bins, range=(lo, hi))
            assert np.abs(batched[i, :bins].numpy() - ref).sum() <= 2 * _near_edge(v, lo, hi, bins), i
        else:
            assert batched[i, 0].item() == v.size


@pytest.mark.parametrize("bins", [1, 64, 300])
def test_negated_histograms_are_those_of_the_negated_tensors(path: str, bins: int) -> None:
    """`negate=True` (the update histogram, from the negated update the meter holds) gives exactly the rows
    of `-x`, negated by hand first: same buckets, min, max, sum and sum of squares, NaN/Inf counts; on the
    CPU x itself is neither copied nor changed. Big tensors, strided views, many small ones bucketed as a
    block, a block mixing real and integer tensors, and the mixed set above."""
    torch.manual_seed(12)
    xs = [
        *_mixed(),
        torch.randn(70_000) * 0.01,  # one by one, cut into cache-sized pieces by the 1 KB limit below
        _poisoned((300, 7), torch.float32, 13),
        torch.randn(3000)[::3],  # strided: sums follow a contiguous copy's order, as -x's would
        torch.randn(50, 40).t(),
        torch.tensor([-0.0, 0.0, 2.0, -1.0]),
        torch.zeros(20_000).index_fill_(0, torch.tensor([5]), 1e-44),  # subnormal range: the scale overflows fp32
        *[torch.randn(8, 4) * 10.0**k for k in range(-3, 4)],
        torch.randint(-9, 9, (32,)),
        torch.full((32,), -2.0),
    ]
    before = [x.clone() for x in xs]
    want = histogram_partials([-x for x in xs], bins, CPU)
    got = histogram_partials(xs, bins, CPU, negate=True)
    assert torch.equal(got.nan_to_num(nan=-7.0), want.nan_to_num(nan=-7.0))
    assert all(torch.equal(x.nan_to_num(nan=-7.0), b.nan_to_num(nan=-7.0)) for x, b in zip(xs, before))
    if path == "host":
        with pytest.MonkeyPatch.context() as mp:
            _patch(mp, "_CACHE_BYTES", 1024)
            _patch(mp, "_GROUP_BYTES", 1024)  # moments read back a few tensors at a time
            cut = histogram_partials(xs, bins, CPU, negate=True)
        assert torch.equal(cut[:, :bins], want[:, :bins])
        torch.testing.assert_close(cut[:, bins:], want[:, bins:], rtol=1e-5, atol=1e-6, equal_nan=True)


def test_the_weight_snapshot_of_a_big_tensor_is_advised_for_huge_pages() -> None:
    """A measured step's snapshot is fresh memory each time; a big one (the frozen backbone's 4 MB head)
    paid 2-3 ms of 4 KiB page faults a step. Its copy must hold the same values and its norm, and on Linux
    in THP "madvise" mode the kernel must mark the copy's mapping eligible for huge pages."""
    x = torch.randn(1024, 1536, generator=torch.Generator().manual_seed(2))  # 6 MB of fp32
    (copy,), sumsq = copy_with_sumsq([x], CPU)
    assert torch.equal(copy, x) and copy.data_ptr() != x.data_ptr()
    assert sumsq[0].item() == pytest.approx(torch.linalg.vector_norm(x.double()).item() ** 2, rel=1e-4)  # fp32 sums
    assert_huge_page_eligible(copy.data_ptr() + (3 << 20))


@pytest.mark.parametrize("every", [1, 3, 50])
def test_the_snapshot_buffers_are_reused_while_measuring_often_and_the_ratios_stay_exact(every: int) -> None:
    """On the CPU, with measured steps at most 10 optimizer steps apart, each measured step copies the
    weights into the buffers of the step before (no fresh memory to fault in); measured rarely, nothing is
    held between steps; close() lets them go. Each step's update ratio is checked against copies kept here."""
    import copy

    import gradlog
    from gradlog.measure.meter import KEEP_SNAPSHOT_EVERY

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=every, histograms=False, print_report=False)
    ptrs: list[set[int]] = []
    for step in range(3 * every + 1):
        before = copy.deepcopy(model.state_dict())
        model(torch.randn(4, 6)).pow(2).mean().backward()
        opt.step()
        gl.log(step)
        opt.zero_grad()
        if step % every:
            continue
        kept = gl.meter._kept
        ptrs.append({t.data_ptr() for t in kept.values()})
        assert gl.meter.kept_bytes == (0 if step == 0 or every > KEEP_SNAPSHOT_EVERY else 4 * (30 + 5 + 10 + 2))
        for name, p in model.named_parameters():
            want = torch.linalg.vector_norm(p.detach().double() - before[name].double()) / torch.linalg.vector_norm(
                before[name].double()
            )
            assert mem.last(f"weights/update_ratio/{name}") == pytest.approx(want.item(), rel=1e-5), (step, name)
    if every <= KEEP_SNAPSHOT_EVERY:
        assert ptrs[1] and ptrs[1] == ptrs[2] == ptrs[3]  # the same four buffers, step after step
    gl.close()
    assert gl.meter.kept_bytes == 0


def test_a_snapshot_over_the_cap_is_made_fresh_each_measured_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kept copy would be there during forward and backward too (raising the step's peak by its size):
    above KEEP_SNAPSHOT_BYTES nothing is held between measured steps, and the ratios are the same."""
    import gradlog
    from gradlog.measure import meter

    monkeypatch.setattr(meter, "KEEP_SNAPSHOT_BYTES", 4 * 20)  # below this model's 4 * 47 bytes
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=1, histograms=False, print_report=False)
    for step in range(3):
        before = model[0].weight.detach().clone()
        model(torch.randn(4, 6)).pow(2).mean().backward()
        opt.step()
        gl.log(step)
        opt.zero_grad()
        assert gl.meter.kept_bytes == 0
        want = torch.linalg.vector_norm(model[0].weight.detach() - before) / torch.linalg.vector_norm(before)
        assert mem.last("weights/update_ratio/0.weight") == pytest.approx(want.item(), rel=1e-5)
    gl.close()


def _bincount_by_hand(x: torch.Tensor, edge: float, scale: float, bins: int) -> torch.Tensor:
    """[bins + 1] counts of every value's bucket position `(x - edge) * scale`, in x's dtype, truncated:
    one numpy expression over the whole tensor, then one count (no pieces, no scratch, no lanes)."""
    v = x.numpy()
    pos = ((v - v.dtype.type(edge)) * v.dtype.type(scale)).astype(np.int64)
    return torch.from_numpy(np.bincount(pos, minlength=bins + 1))


@pytest.mark.parametrize("bins", [1, 64, 254, 300, 4094, 5000])
def test_crowded_pieces_are_counted_exactly(monkeypatch: pytest.MonkeyPatch, bins: int) -> None:
    """A piece crowded into one bucket makes the next pieces count on interleaved sets of counters; the
    counts must stay those of one plain count of every position (reference: numpy by hand), for
    pieces of odd sizes, spread and crowded data in turn, and bucket counts at the int16 limit."""
    _patch(monkeypatch, "_BUCKET_BYTES", 4 * 999)  # pieces of 999 floats: odd, many per tensor
    torch.manual_seed(bins)
    x = torch.zeros(20_011)
    x[5000:9000] = torch.randn(4000)  # spread between crowded stretches: the mode switches both ways
    x[15000::3] = torch.randn(x[15000::3].numel())
    for flip in (False, True):
        lo, hi = (float(v) for v in torch.aminmax(x))
        edge = -hi if flip else lo
        scale = bins / (hi - lo)
        got = bucketing._bucket_counts(x, edge, scale, bins, flip, {})
        ref = _bincount_by_hand(x.neg() if flip else x, edge, scale, bins)
        assert torch.equal(got, ref) and int(got.sum()) == x.numel()


def test_a_tensor_after_a_crowded_one_is_counted_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor's first piece is counted on the lanes when the previous tensor's last piece was crowded (this
    thread's state, carried from tensor to tensor and step to step): the counts of a spread tensor after a
    crowded one, a crowded one after a spread one, and one-piece tensors in turn must equal a plain bincount."""
    _patch(monkeypatch, "_BUCKET_BYTES", 4 * 1000)  # pieces of 1000 floats
    torch.manual_seed(5)
    crowded = torch.zeros(1000)
    crowded[:100] = torch.randn(100)
    tensors = [crowded, torch.randn(1000), crowded.clone(), torch.randn(3000), torch.randn(700), crowded[:999]]
    for bins in (64, 300):
        for x in tensors + tensors[::-1]:
            lo, hi = (float(v) for v in torch.aminmax(x))
            scale = bins / (hi - lo)
            got = bucketing._bucket_counts(x, lo, scale, bins, False, {})
            ref = _bincount_by_hand(x, lo, scale, bins)
            assert torch.equal(got, ref) and int(got.sum()) == x.numel()


def test_a_subnormal_range_is_bucketed_in_float64() -> None:
    """A float32 tensor whose range is subnormal (one 1e-44 among zeros): its scale overflows float32, so its
    buckets are counted in float64, where they are exact: the zeros in the first bucket, the maximum in the
    last, as numpy's histogram has them and as the same values in float64 get them. (Counted in float32, every
    value fell in the first bucket.) A float64 range so narrow that even float64's scale overflows puts every
    value in the first bucket, as a constant tensor's."""
    x = torch.zeros(20_000).index_fill_(0, torch.tensor([5]), 1e-44)
    small = x[:100].clone()  # small tensors of one size are bucketed as a block: these leave it
    tiny = torch.tensor([0.0, 5e-324, 1e-323], dtype=torch.float64)
    out = histogram_partials([x, x.double(), small, small.clone(), tiny], 8, CPU)
    ref, _ = np.histogram(x.double().numpy(), bins=8, range=(0.0, float(x.max())))
    assert out[0, :8].tolist() == out[1, :8].tolist() == ref.tolist() == [19_999, 0, 0, 0, 0, 0, 0, 1]
    assert out[2, :8].tolist() == out[3, :8].tolist() == [99, 0, 0, 0, 0, 0, 0, 1]
    assert out[4, :8].tolist() == [3, 0, 0, 0, 0, 0, 0, 0]


def test_the_host_copy_is_unpacked_into_named_fields() -> None:
    """Each part a step queues comes back in the `HostStep` field of its name (histogram blocks by kind), the
    CPU's owned float64 parts as they are and the others copied; the vocabulary of parts mypy checks (`Part`)
    names exactly the fields; and a name that is not a field raises instead of being dropped."""
    import dataclasses
    import typing

    fields = {f.name for f in dataclasses.fields(stats.HostStep)} - {"hist"}
    assert set(typing.get_args(stats.Part)) == fields
    packer = stats.Packer(CPU)
    grad, weight, dead = torch.rand(4, 3, dtype=torch.float64), torch.rand(4), torch.rand(4, dtype=torch.float64)
    block = torch.rand(4, 69, dtype=torch.float64)
    packer.add("grad", grad, owned=True)
    packer.add("weight", weight, owned=True)
    packer.add("dead", dead)
    packer.add(stats.hist_key("update"), block, owned=True)
    host = packer.fetch()
    assert host.grad is grad and host.hist["update"] is block  # owned, float64: no copy on the CPU
    assert host.weight is not None and host.weight.dtype == torch.float64 and torch.equal(host.weight, weight.double())
    assert host.dead is not None and host.dead is not dead and torch.equal(host.dead, dead)  # not owned: copied
    assert host.before is None and host.slices_done is None and list(host.hist) == ["update"]
    assert not packer and packer.fetch() == stats.HostStep()
    with pytest.raises(TypeError, match="slices/done"):
        stats.HostStep.of([("slices/done", torch.zeros(1))])  # type: ignore[list-item]
