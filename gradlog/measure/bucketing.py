"""Fixed-width histograms of tensors: bucket counts of the finite values and their moments (min, max, sum,
sum of squares, NaN/Inf count), one pass for the range and one for the buckets.

The CPU path (`host_histograms`) reads values back to skip work and counts in numpy; the accelerator path
(`histogram_partials`) reads nothing back; the two-phase path (`histogram_ranges`, `histogram_bucket`) is for
tensors sharded across ranks. `gradlog.measure.histogram` holds the containers writers receive.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gradlog.measure.stats import _CACHE_BYTES, _slices, host_reads_free, stat_dtype


def _real(t: torch.Tensor) -> torch.Tensor:
    """Histograms and min/max need an order: complex tensors are described by their magnitude."""
    if t.is_complex():
        return t.abs()
    if not t.is_floating_point():
        return t.double()
    return t


def _hist_input(x: torch.Tensor, keep_low: bool = False) -> torch.Tensor:
    """`x` flat and ordered; fp16/bf16 converted to fp32 (bucketed and summed in fp32), but with `keep_low`: a
    tensor counted on a sample keeps its dtype, and only the sample is converted (`_host_row`): a full fp32 copy
    was 2x the tensor's bytes written and read for 65,536 values."""
    x = _real(x).reshape(-1)
    return x.float() if x.element_size() < 4 and not keep_low else x


def _low(x: torch.Tensor) -> bool:
    """fp16/bf16 (kept so by `_hist_input(keep_low=True)`): bucketed and summed in fp32."""
    return x.is_floating_point() and x.element_size() < 4


def _host_chunks(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A flat tensor in cache-sized pieces (views): the passes over one piece then read it from cache,
    and bucketing's temporaries stay piece-sized instead of the size of a huge tensor (a 200M-element
    tensor's positions were an 800 MB float temporary). Measured on 50M floats: 0.8 s -> 0.3 s.
    fp16/bf16 are cut where their fp32 conversion would be: the same pieces, the same sums as before."""
    step = max(1, _CACHE_BYTES // (4 if _low(x) else x.element_size()))
    n = x.numel()
    return (x,) if n <= step else tuple(x[i : i + step] for i in range(0, n, step))


def _moments(x: torch.Tensor, squares: bool = True) -> list[torch.Tensor]:
    """min, max, sum and sum of squares of a flat tensor (four 0-dim tensors), a cache-sized piece at a time;
    without `squares`, the first three (the step's norm gave the sum of squares: `_known_squares`).

    Left unstacked: the caller stacks every tensor's at once (a stack per tensor cost more than the sums)."""
    pieces = _host_chunks(x)
    if len(pieces) == 1:
        return [*torch.aminmax(x), x.sum(), torch.dot(x, x)] if squares else [*torch.aminmax(x), x.sum()]
    p = torch.stack([torch.stack([*torch.aminmax(c), c.sum(), torch.dot(c, c)]) for c in pieces]).double()
    return [p[:, 0].min(), p[:, 1].max(), p[:, 2].sum(), p[:, 3].sum()][: 4 if squares else 3]


def _known_squares(x: torch.Tensor, known: Known | None) -> float | None:
    """The sum of squares of a tensor counted in full that the step's norm gave (`host_histograms`' `known`), or
    None where it must be read here. The norm's square, not a second dot product over the same values: they agree
    to float rounding (the sum of squares is the norm's for a sampled histogram too)."""
    if known is None or known[1] is None or not math.isfinite(known[1]):
        return None
    return known[1] if len(_host_chunks(x)) == 1 else None


#: Known moments of one tensor a sampled histogram is made of (`host_histograms`): its (min, max) where a pass
#: the measured step made anyway took them (None: read here), and its sum of squares where the step's norms
#: give it (None: read here).
Known = tuple["tuple[float, float] | None", "float | None"]


def _sampled_moments(x: torch.Tensor, known: Known | None) -> list[torch.Tensor]:
    """`_moments` of a tensor whose buckets are counted on a sample: only what the step did not already give is
    read, and the sum is left for the sample (0 here; `_host_row` estimates it). The exact range is the one
    full read a sampled histogram keeps, when no pass of the step took it; the sum of squares is the norm's."""
    rng, s2 = known if known is not None else (None, None)
    pieces = _host_chunks(x) if rng is None or s2 is None else ()
    if rng is None:
        lo_hi = torch.stack([torch.stack(torch.aminmax(c)) for c in pieces]).double()
        lo, hi = lo_hi[:, 0].min(), lo_hi[:, 1].max()  # torch's min/max keep a NaN
    else:
        lo, hi = torch.tensor(rng[0], dtype=torch.float64), torch.tensor(rng[1], dtype=torch.float64)
    if s2 is None:  # fp16/bf16: each piece converted in cache, as the whole tensor's conversion gave it
        sumsq = torch.stack([_self_dot(c.float() if _low(c) else c) for c in pieces]).sum()
    else:
        sumsq = torch.tensor(s2, dtype=torch.float64)
    return [lo, hi, torch.zeros((), dtype=torch.float64), sumsq]


def _self_dot(c: torch.Tensor) -> torch.Tensor:
    """The sum of squares of a piece, float64."""
    return torch.dot(c, c).double()


_BUCKET_BYTES = 1 << 18  # CPU: bucketing's scratch, a float piece (and its positions, a quarter of that)
_LANES = 8  # CPU bucketing: sets of counters for a crowded piece (see `_bucket_counts`)
_LOCAL = threading.local()
_Scratch = dict[tuple[torch.dtype, torch.dtype], tuple[torch.Tensor, torch.Tensor]]


def _bucket_scratch() -> _Scratch:
    """This thread's bucketing scratch per (value, position) dtype (see `_bucket_counts`), kept from one
    measured step to the next: a fixed ~320 kB per dtype instead of a fresh allocation on every step (its page faults,
    and a measured step's peak memory)."""
    bufs: _Scratch = _LOCAL.__dict__.setdefault("bucket", {})
    return bufs


_GROUP_BYTES = 4 << 20  # CPU histograms: tensors whose moments are read back together, then bucketed
_BATCH_NUMEL = 1 << 14  # CPU: histograms of tensors up to this many entries are bucketed many at a time


def _batched_histograms(
    xs: list[torch.Tensor], bins: int, counts: torch.Tensor, moments: torch.Tensor, flips: list[bool] | None = None
) -> list[bool]:
    """Small tensors of one size and dtype, many at a time (stacked into a cache-sized block): a dozen
    torch calls per block instead of eight per tensor, which dominated a model of 5,000 small tensors.
    Writes the rows (`host_histograms` layout) of the tensors whose values are all finite straight into
    `counts` and `moments` and returns which it wrote; the rest are left to `_host_histograms`' one-by-one path (NaN/Inf
    masking, ranges or scales that overflow). `flips[i]`: the row of `-xs[i]` (the block is a copy, negated in
    place)."""
    done = [False] * len(xs)
    groups: dict[tuple[int, torch.dtype], list[int]] = {}
    for i, x in enumerate(xs):
        if 0 < x.numel() <= _BATCH_NUMEL:
            groups.setdefault((x.numel(), x.dtype), []).append(i)
    for (n, dtype), idx in groups.items():
        if len(idx) < 2:
            continue
        per_block = max(2, _CACHE_BYTES // (n * xs[idx[0]].element_size()))
        for start in range(0, len(idx), per_block):
            part = idx[start : start + per_block]
            block = torch.stack([xs[i] for i in part])  # [k, n], a copy of small tensors
            if flips is not None:
                neg = [flips[i] for i in part]
                if all(neg):
                    block.neg_()
                elif any(neg):
                    block[torch.tensor(neg)] *= -1
            lo, hi = block.aminmax(dim=1)
            stats = torch.stack([lo, hi, block.sum(1), (block * block).sum(1)], dim=1).double()
            span, top = stats[:, 1] - stats[:, 0], torch.finfo(dtype).max
            # a range that overflows the dtype, or so narrow (subnormal) that its scale does: one by one
            ok = torch.isfinite(stats).all(1) & (span <= top) & ((span == 0) | (bins / span <= top))
            if not bool(ok.all()):
                keep = ok.tolist()
                part = [i for i, k in zip(part, keep) if k]
                block, stats, lo = block[ok], stats[ok], lo[ok]
                if not part:
                    continue
            width = stats[:, 1] - stats[:, 0]
            scale = torch.where(width > 0, bins / torch.where(width > 0, width, 1), 0).to(dtype)
            pos = torch.sub(block, lo.unsqueeze(1)).mul_(scale.unsqueeze(1))
            del block
            pos = pos.to(torch.uint8 if bins < 255 else torch.int16).to(torch.int64)
            pos += torch.arange(len(part)).unsqueeze(1) * (bins + 1)  # each row its own bucket range
            found = torch.bincount(pos.reshape(-1), minlength=len(part) * (bins + 1)).view(len(part), bins + 1)
            del pos
            at = torch.tensor(part)
            found[:, bins - 1] += found[:, bins]  # the maximum itself sits on the closed right edge
            counts[at] = found[:, :bins].to(counts.dtype)
            moments[at, :4] = stats
            moments[at, 4] = 0.0
            for i in part:
                done[i] = True
    return done


def _host_histograms(
    xs: list[torch.Tensor],
    bins: int,
    counts: torch.Tensor,
    moments: torch.Tensor,
    flips: list[bool] | None = None,
    sample: int | None = None,
    known: Sequence[Known | None] | None = None,
) -> None:
    """CPU: small tensors in batches (`_batched_histograms`); the others one by one: min/max, sum and
    sum of squares, then the buckets, a cache-sized piece at a time (see `_bucket_counts`); the rare
    tensor with NaN/Inf is masked first. Rows (`host_histograms` layout) are written into `counts`
    [len(xs), bins] and `moments` [len(xs), 5] as they are made: no per-tensor results are kept and stacked.

    `flips[i]`: the row of `-xs[i]`, without making `-xs[i]` (contiguous floating tensors only: see
    `histogram_partials`). `sample`: see `histogram_partials`; `known`: see `host_histograms`."""
    done = _batched_histograms(xs, bins, counts, moments, flips)
    rest = [xs[i] for i, d in enumerate(done) if not d]
    at = [i for i, d in enumerate(done) if not d]
    # numpy views: a numpy row write costs a fraction of torch's
    rows = (counts.numpy(), moments.numpy())
    scratch = _bucket_scratch()
    # numpy's floating-point error settings are the user's (np.seterr): a subnormal product must not raise here
    with np.errstate(all="ignore"):
        # a few MB of tensors at a time: their moments in one stack and one read-back, then their buckets
        # while they are still in the last-level cache (all moments first read every tensor from memory twice)
        for run in _slices(rest, _GROUP_BYTES):
            squares: dict[int, float] = {}  # by j: a tensor counted in full whose sum of squares the step's norm gave
            parts: list[torch.Tensor] = []
            for j in run:
                x, kn = rest[j], known[at[j]] if known is not None else None
                if not x.numel():
                    continue
                if _is_sampled(x, sample):
                    parts += _sampled_moments(x, kn)
                    continue
                s2 = _known_squares(x, kn)
                if s2 is not None:
                    squares[j] = s2
                parts += _moments(x, squares=s2 is None)
            host = iter(torch.stack(parts).double().tolist() if parts else [])  # stack promotes fp32 + fp64
            deferred: list[_Sampled] = []
            for j in run:
                i = at[j]
                flip = flips is not None and flips[i]
                _host_row(
                    xs[i], i, bins, (counts, moments), rows, flip, host, scratch, sample, deferred, squares.get(j)
                )
            if deferred:
                assert sample is not None
                _sampled_rows(deferred, bins, rows, sample)


def _is_sampled(x: torch.Tensor, sample: int | None) -> bool:
    """Whether flat `x`'s histogram is counted on a sample (`sampled`)."""
    return sample is not None and x.numel() > sample


@dataclass
class _Sampled:
    """A row `_host_row` left to `_sampled_rows`: flat `x` (finite, counted on a sample), its exact range and sum of
    squares (as the row will hold them: of `-x` where `flip`), and the scale of its bucket positions."""

    i: int
    x: torch.Tensor
    lo: float
    hi: float
    s2: float
    flip: bool
    scale: float


def _host_row(
    x: torch.Tensor,
    i: int,
    bins: int,
    out: tuple[torch.Tensor, torch.Tensor],
    rows: Any,
    flip: bool,
    host: Iterator[float],
    scratch: _Scratch,
    sample: int | None = None,
    deferred: list[_Sampled] | None = None,
    squares: float | None = None,
) -> None:
    """Row `i` of `out` (counts, moments; written through `rows`, their numpy views) for the
    flat tensor `x`, whose min, max, sum and sum of squares `host` yields next (`squares`: the sum of squares
    is that, and `host` yields the other three). `flip`: the row of `-x`,
    counted from x: its min is -max(x), its sum -sum(x) (rounding is symmetric) and its positions
    `(max(x) - x) * scale`. `sample`: the buckets are counted on that many entries (`sampled`) and scaled to x's
    finite values; min, max and the sum of squares stay exact, and the sum is the sample's scaled to x's size
    (`_sampled_moments` left it out: a full read for a number no verdict uses). `deferred`: a finite tensor counted
    on a sample is appended there instead, for `_sampled_rows` to count with the others of its run."""
    counts, moments = out
    if x.numel() == 0:
        counts[i] = 0
        moments[i] = 0.0
        return
    lo, hi, s = next(host), next(host), next(host)
    s2 = next(host) if squares is None else squares
    if flip:
        lo, hi, s = -hi, -lo, -s
    nonfinite = 0
    estimate = _is_sampled(x, sample)  # `_sampled_moments`: the sum is the sample's
    if not all(math.isfinite(v) for v in (lo, hi, s, s2)):  # NaN/Inf inside (or an overflowed sum)
        z = x[torch.isfinite(x)]
        z = z.float() if _low(z) else z  # the masked copy, in fp32 (a kept fp16/bf16 tensor's)
        if flip:
            z.neg_()  # a masked copy already: negated in place, then bucketed as it is
            flip = False
        nonfinite = x.numel() - z.numel()
        if z.numel() == 0:
            counts[i] = 0
            moments[i] = 0.0
            moments[i, 4] = float(nonfinite)
            return
        lo, hi, s, s2 = torch.stack([*torch.aminmax(z), z.sum(), torch.dot(z, z)]).double().tolist()
        lo, hi = min(lo, 0.0), max(hi, 0.0)  # NaN/Inf stand at 0 for the range, as on accelerators
        x = z
        estimate = False  # the masked copy's sum was read in full, above
    scale = bins / (hi - lo) if hi > lo else 0.0
    counted = torch.float32 if _low(x) else x.dtype  # the dtype x's values are bucketed in
    if hi - lo > torch.finfo(counted).max or not _finite_in(scale, counted):
        x = x.double()  # x - lo would overflow x's dtype, or the scale of a subnormal range would: float64 holds both
    if not math.isfinite(scale):
        scale = 0.0  # a float64 range below ~1e-306 (or above its max): every value in the first bucket
    if deferred is not None and estimate and (x.dtype == counted or _low(x)):
        deferred.append(_Sampled(i, x, lo, hi, s2, flip, scale))
        return
    part = sampled(x, sample)
    if part is not None and _low(part):
        part = part.float()  # only the sample is converted (`_hist_input`)
    count = _bucket_counts(x if part is None else part, lo, scale, bins, flip, scratch)
    c = count.numpy()  # numpy: a torch op costs ~3 us, per tensor
    if part is not None:  # the maximum folded first: the last bucket is the one that holds it
        c[bins - 1] += c[bins]
        c[bins] = 0
        c[:bins] = _scale_host_counts(c[:bins], x.numel(), hi > lo)
        if estimate:
            s = float(part.sum(dtype=torch.float64)) * (x.numel() / part.numel())
            s = -s if flip else s
    c[bins - 1] += c[bins]  # the maximum itself sits on the closed right edge
    rows[0][i] = c[:bins]
    rows[1][i] = (lo, hi, s, s2, nonfinite)


_SAMPLE_BLOCK_BYTES = 1 << 20  # CPU: samples counted together (4 rows of the default 65,536 float32 entries)


def _sampled_rows(items: list[_Sampled], bins: int, rows: Any, sample: int) -> None:
    """The rows of tensors counted on a sample (`_host_row` deferred them), a block of samples at a time: each
    sample gathered into a row of one reused block (fp16/bf16 converted there), then the positions of the whole
    block in four numpy calls and one bincount (each row's buckets offset by its row), and the counts scaled to
    each tensor (`_scale_host_counts`). The same numbers as `_bucket_counts` row by row (the same float
    operations, `-x`'s row counted from the negated sample: `(-x) - lo == (-lo) - x` exactly), with a few calls
    per block instead of some twenty per tensor, which were most of a small model's sampled histograms."""
    by_dtype: dict[torch.dtype, list[_Sampled]] = {}
    for item in items:
        by_dtype.setdefault(torch.float32 if _low(item.x) else item.x.dtype, []).append(item)
    width = bins + 1
    for dtype, group in by_dtype.items():
        per = max(1, _SAMPLE_BLOCK_BYTES // (sample * dtype.itemsize))
        if width <= 256:  # bincount counts uint8 positions ~2x faster than wider ones: as many rows as fit
            per = min(per, 256 // width)
        values, positions = _sample_scratch(dtype, per, sample, torch.uint8 if per * width <= 256 else torch.int64)
        for start in range(0, len(group), per):
            part = group[start : start + per]
            block = values[: len(part)]
            for r, item in enumerate(part):
                sampled(item.x, sample, out=block[r])  # only the sample is converted
            sums = block.sum(1).tolist()  # the sample's sum, in its dtype: an estimate to ~0.4% (see `_host_row`)
            a = block.numpy()
            flip = np.array([item.flip for item in part])
            if flip.any():
                a[flip] *= -1  # exact: -x's positions, from the range of -x the row holds
            edges = np.array([item.lo for item in part], dtype=a.dtype)  # rounded as `_bucket_counts` rounds them
            scales = np.array([item.scale for item in part], dtype=a.dtype)
            np.subtract(a, edges[:, None], out=a)
            np.multiply(a, scales[:, None], out=a)
            pos = positions[: len(part)].numpy()
            np.copyto(pos, a, casting="unsafe")  # truncation, as `_bucket_counts`; 0 <= a <= bins (+ rounding)
            pos += (np.arange(len(part), dtype=pos.dtype) * width)[:, None]
            got = torch.bincount(torch.from_numpy(pos.reshape(-1)), minlength=len(part) * width).numpy()
            for r, item in enumerate(part):
                c = got[r * width : (r + 1) * width].copy()
                c[bins - 1] += c[bins]  # the maximum folded first: the last bucket is the one that holds it
                c[bins] = 0
                n = item.x.numel()
                c[:bins] = _scale_host_counts(c[:bins], n, item.hi > item.lo)
                total = sums[r] * (n / sample)
                rows[0][item.i] = c[:bins]
                rows[1][item.i] = (item.lo, item.hi, -total if item.flip else total, item.s2, 0)


def _sample_scratch(dtype: torch.dtype, per: int, sample: int, small: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """This thread's block of `per` samples of `sample` values, and their positions (`small`), kept from one
    measured step to the next (~1 MB at the default sample) instead of a fresh allocation on every step."""
    kept: dict[tuple[torch.dtype, int, int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = (
        _LOCAL.__dict__.setdefault("samples", {})
    )
    key = (dtype, per, sample, small)
    if key not in kept:
        for other in [k for k in kept if k[2] != sample]:  # another `HistogramOptions.sample` replaces the old size
            del kept[other]
        kept[key] = (torch.empty(per, sample, dtype=dtype), torch.empty(per, sample, dtype=small))
    return kept[key]


def _bucket_counts(
    x: torch.Tensor,
    lo: float,
    scale: float,
    bins: int,
    flip: bool,
    scratch: _Scratch,
) -> torch.Tensor:
    """[bins + 1] counts of a flat float32/float64 tensor's bucket positions `(x - lo) * scale` in x's dtype
    (`flip`: of `(-lo - x) * scale`, which are -x's positions when `lo` is -x's minimum), truncated to
    integers; `scale` is finite in x's dtype (`_host_row` sees to both).

    Each cache-sized piece goes through one reused scratch buffer: subtract, multiply and the integer
    conversion are numpy's vectorised loops (torch's float->uint8 conversion alone cost more than all three,
    and every torch temporary was a fresh allocation), then `torch.bincount` counts the small integers.
    """
    small = torch.uint8 if bins < 255 else torch.int16
    a = x.detach().resolve_neg().numpy()
    step = max(1, _BUCKET_BYTES // a.itemsize)
    key = (x.dtype, small)
    if key not in scratch:
        scratch[key] = (torch.empty(step, dtype=x.dtype), torch.empty(step, dtype=small))
    fbuf, pbuf = (t.numpy() for t in scratch[key])
    edge, mul = a.dtype.type(-lo if flip else lo), a.dtype.type(scale)  # rounded as torch rounds its scalars
    width = bins + 1
    # bincount's increments of one bucket wait on each other: a piece crowded into a few buckets (a gradient
    # of mostly zeros, an embedding's unseen rows) counted ~2 ns a value against ~0.45 spread out. After a
    # crowded piece, the next are counted on _LANES interleaved sets of counters (value i on set i % _LANES,
    # folded after): ~0.6 ns a value either way. Exact; the choice only changes the speed.
    lanes = _LANES if width * _LANES <= 2**15 else 1
    # a crowded tensor is often followed by another (Adam's updates, ReLU gradients): the first piece of this
    # one is counted as the last piece of the previous one was, on this thread (a tensor of one piece, like
    # a Linear(256, 256), would otherwise never leave the slow count)
    crowded = lanes > 1 and bool(getattr(_LOCAL, "crowded", False))
    if a.size <= step and not crowded:  # one piece, spread out (most tensors): its counts are the total
        pos = _positions(a, edge, mul, flip, fbuf, pbuf)
        one = torch.bincount(torch.from_numpy(pos), minlength=width)
        _LOCAL.crowded = lanes > 1 and int(np.maximum.reduce(one.numpy())) * 4 > a.size
        return one
    total = np.zeros(width, dtype=np.int64)  # numpy: each torch op here cost ~3 us, per piece and per tensor
    for start in range(0, a.size, step):
        part = a[start : start + step]
        pos = _positions(part, edge, mul, flip, fbuf, pbuf)
        if crowded:
            q = fbuf.view(np.int16)[: part.size]  # the float scratch is free again: int16 fits in it
            np.add(_lane_offsets(step, lanes, width)[: part.size], pos, out=q, dtype=np.int16)
            got = torch.bincount(torch.from_numpy(q), minlength=lanes * width).numpy().reshape(lanes, width).sum(0)
        else:
            got = torch.bincount(torch.from_numpy(pos), minlength=width).numpy()
        total += got
        crowded = lanes > 1 and int(got.max()) * 4 > part.size  # a quarter of the piece in one bucket
    _LOCAL.crowded = crowded
    return torch.from_numpy(total)


def _positions(
    part: np.ndarray[Any, Any], edge: Any, mul: Any, flip: bool, fbuf: np.ndarray[Any, Any], pbuf: np.ndarray[Any, Any]
) -> np.ndarray[Any, Any]:
    """The bucket positions of a piece (`_bucket_counts`), in the scratch: `(part - edge) * mul` (`flip`:
    `(edge - part) * mul`) truncated to the positions' integers, as torch's conversion truncates; 0 <= f <= bins
    (+ rounding)."""
    f, pos = fbuf[: part.size], pbuf[: part.size]
    if flip:
        np.subtract(edge, part, out=f)
    else:
        np.subtract(part, edge, out=f)
    np.multiply(f, mul, out=f)
    np.copyto(pos, f, casting="unsafe")
    return pos


def _lane_offsets(step: int, lanes: int, width: int) -> np.ndarray[Any, Any]:
    """`(i % lanes) * width` for i < step, int16: where value i of a crowded piece is counted (`_bucket_counts`);
    made once per thread and shape, not once per tensor (~65,000 values each time)."""
    cache: dict[tuple[int, int, int], np.ndarray[Any, Any]] = _LOCAL.__dict__.setdefault("lanes", {})
    key = (step, lanes, width)
    if key not in cache:
        cache[key] = (np.arange(step, dtype=np.int16) % lanes) * np.int16(width)
    return cache[key]


def _finite_in(v: float, dtype: torch.dtype) -> bool:
    return math.isfinite(v) and abs(v) <= torch.finfo(dtype).max


#: the default `HistogramOptions.sample`: histograms of tensors with more entries are counted on this many
DEFAULT_SAMPLE = 1 << 16
_SAMPLE_SEED = 0x6A09E667  # fixed: the same positions on every step, in every run
_SAMPLE_CACHE = 32  # distinct (size, device) index sets kept (256 kB each at the default sample)
_samples: dict[tuple[int, int, str], torch.Tensor] = {}
_samples_lock = threading.Lock()


def sample_index(n: int, k: int, device: torch.device) -> torch.Tensor:
    """`k` positions in `range(n)`, uniform and independent (drawn with replacement, sorted for locality), int32,
    on `device`: the entries a sampled histogram counts. Fixed for a size (a seeded generator), so a tensor is
    sampled at the same positions on every step; random, not a stride, so no column of a matrix is favoured.
    Kept per (n, k, device): the layers of a model share a few sizes, so a few index sets serve every tensor."""
    key = (n, k, str(device))
    with _samples_lock:
        got = _samples.get(key)
        if got is None:
            gen = torch.Generator().manual_seed(_SAMPLE_SEED ^ n)
            pos = torch.randint(0, n, (k,), generator=gen, dtype=torch.int64).sort().values
            got = pos.to(torch.int32 if n <= 2**31 - 1 else torch.int64).to(device)
            if len(_samples) >= _SAMPLE_CACHE:
                _samples.pop(next(iter(_samples)))
            _samples[key] = got
        return got


def sampled(x: torch.Tensor, sample: int | None, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """The entries of flat `x` a histogram with `sample` counts (None: count them all); `out`: gathered into that
    row (converted to its dtype: an fp16/bf16 sample into an fp32 block, `_sampled_rows`)."""
    if sample is None or x.numel() <= sample:
        return None
    at = sample_index(x.numel(), sample, x.device)
    if out is not None and out.dtype == x.dtype:
        return torch.index_select(x, 0, at, out=out)
    got = x.index_select(0, at)
    return got if out is None else out.copy_(got)


def scale_counts(counts: torch.Tensor, total: torch.Tensor | int, ends: bool) -> torch.Tensor:
    """Bucket counts of a sample [bins] scaled to `total` values: integers that add up to `total` exactly
    (rounded on the running sum, so no bucket is off by more than one from its share), with the first and last
    bucket holding at least one value each where `ends` (the range's min and max are exact and are values of the
    tensor). No host read: the same ops serve accelerators."""
    c = counts.to(torch.float64)
    k = c.sum()
    total_t = torch.as_tensor(total, dtype=torch.float64, device=c.device)
    cum = torch.round(torch.cumsum(c, 0) * (total_t / k.clamp(min=1)))
    out = torch.diff(cum, prepend=cum.new_zeros(1))
    if ends and out.numel() > 1:
        for end in (0, out.numel() - 1):
            need = ((out[end] == 0) & (k > 0)).to(out.dtype)
            out[out.argmax()] -= need
            out[end] += need
    return out.to(counts.dtype)


def _scale_host_counts(counts: np.ndarray[Any, Any], total: int, ends: bool) -> np.ndarray[Any, Any]:
    """`scale_counts` in numpy, for the CPU path: the same float64 operations in the same order (cumulative sum,
    times total / sample, rounded half to even, differences), so the same integers; a dozen torch calls on 64
    numbers cost ~15x more than the bucketing they finish, on every sampled tensor of a measured step."""
    c = counts.astype(np.float64)
    k = float(c.sum())
    cum = np.rint(np.cumsum(c) * (float(total) / max(k, 1.0)))
    out = np.diff(cum, prepend=0.0)
    if ends and out.size > 1 and k > 0:
        for end in (0, out.size - 1):
            if out[end] == 0:
                out[int(out.argmax())] -= 1
                out[end] += 1
    return out.astype(counts.dtype)


def _device_histogram(x: torch.Tensor, bins: int, sample: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Accelerators: the same numbers without reading anything back (NaN/Inf masked with `where`). `sample`: the
    buckets of that many entries (`sampled`), scaled to the finite values; the range and moments stay exact.
    An fp16/bf16 `x` (kept so for a sample, `_histogram_inputs`): range in its own dtype (exact), sums
    accumulated in fp32, only the sample converted."""
    if x.numel() == 0:
        return torch.zeros(bins + 1, dtype=torch.int64, device=x.device), torch.zeros(5, device=x.device)
    fin = torch.isfinite(x)
    nonfinite = x.numel() - fin.sum()
    zf = torch.where(fin, x, 0)  # NaN/Inf stand at 0 for the range and the moments
    lo, hi = torch.aminmax(zf)
    if _low(zf):
        lo, hi = lo.float(), hi.float()
        norm = torch.linalg.vector_norm(zf, dtype=torch.float32)
        sums = (zf.sum(dtype=torch.float32), norm * norm)
    else:
        sums = (zf.sum(), torch.dot(zf, zf))
    part = sampled(x, sample)
    if part is not None and _low(part):
        part = part.float()
    elif _low(x):
        x = x.float()  # counted in full: bucketed in fp32
    if part is not None:  # only the sample is bucketed: its own NaN/Inf are parked and taken out as below
        fin, nonfinite_all, nonfinite = torch.isfinite(part), nonfinite, part.numel() - torch.isfinite(part).sum()
        x = part
    z = torch.where(fin, x, lo)  # ... and are parked in bucket 0 for counting, then taken out of it
    wide = stat_dtype(x.device)  # float64 where the device has it (not MPS)
    width = hi.to(wide) - lo.to(wide)
    scale = torch.where(width > 0, bins / torch.where(width > 0, width, 1), 0).to(x.dtype)
    pos = torch.sub(z, lo).mul_(scale).clamp_(0, bins)  # clamp: x - lo may overflow near the dtype's max
    if pos.numel() > 2**24:  # float32 counts stop being exact
        pos = pos.to(wide)
    # bincount would read its maximum back to size its output; histc with fixed edges does not.
    counts = torch.histc(pos, bins + 1, 0, bins + 1).to(torch.int64)
    counts[0] -= nonfinite
    if part is not None:
        counts[bins - 1] += counts[bins]
        counts[bins] = 0
        counts[:bins] = scale_counts(counts[:bins], zf.numel() - nonfinite_all, True)
        nonfinite = nonfinite_all
    moments = torch.stack([lo, hi, *sums, nonfinite.to(lo.dtype)])
    return counts, moments


def _histogram_inputs(
    xs: Sequence[torch.Tensor], negate: bool, sample: int | None = None
) -> tuple[list[torch.Tensor], list[bool] | None]:
    """Flat values to bucket, and (`negate`) which are counted as their negation where they are bucketed.

    Floating tensors are negated where they are bucketed; a contiguous copy of a strided one keeps its sums
    in the order of the copy `-x` was. |-z| = |z|: a complex tensor's magnitudes need nothing; other values
    (integers, read as float64) are negated here. `sample` (CPU): fp16/bf16 tensors counted on a sample (past
    the batched path's size too) stay in their dtype (`_hist_input`)."""
    flat = [_hist_input(x, keep_low=_is_sampled(x, sample) and x.numel() > _BATCH_NUMEL) for x in xs]
    if not negate:
        return flat, None
    flips = [x.is_floating_point() for x in xs]
    flat = [f.contiguous() if flip else f if x.is_complex() else f.neg() for x, f, flip in zip(xs, flat, flips)]
    return flat, flips


def on_host(xs: Sequence[torch.Tensor], device: torch.device) -> bool:
    """Whether `host_histograms` applies: every tensor on the CPU, where reading values back is free."""
    return host_reads_free(device) and all(x.device == device for x in xs)


def host_histograms(
    xs: Sequence[torch.Tensor],
    bins: int,
    negate: bool = False,
    sample: int | None = None,
    known: Sequence[Known | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU tensors (`on_host`): the `histogram_partials` numbers as bucket counts [n, bins] and moments
    [n, 5] (min, max, sum, sum of squares, NaN/Inf count; float64).

    `known[i]`: what the measured step already knows of `xs[i]` (as it is, before `negate`): its exact (min, max),
    taken in a pass the step made anyway (`stats.Ranges`), and its sum of squares (the norm's). Used for the
    tensors counted on a sample, whose histograms then read none of their entries but the sample's; a NaN or
    Inf in them sends the tensor to the exact masked path, as before.

    Why apart: the counts are integers, int32 (int64 from 2^31 values in one tensor), half the memory of
    float64 rows. A measured step holds the gradient and update histograms beside the weight snapshot,
    which on a 5,000-tensor model was its peak (2.8 MB per kind as float64 rows)."""
    flat, flips = _histogram_inputs(xs, negate, sample)
    wide = any(x.numel() >= 2**31 for x in flat)
    counts = torch.empty(len(flat), bins, dtype=torch.int64 if wide else torch.int32)
    moments = torch.empty(len(flat), 5, dtype=torch.float64)
    if flat:
        _host_histograms(flat, bins, counts, moments, flips, sample, known)
    return counts, moments


def histogram_partials(
    xs: Sequence[torch.Tensor], bins: int, device: torch.device, negate: bool = False, sample: int | None = None
) -> torch.Tensor:
    """[n, bins + 5]: bucket counts of the finite values, then min, max, sum, sum of squares, NaN/Inf count.

    Buckets are fixed-width between each tensor's own min and max; NaN/Inf are counted and never
    reach the buckets or the sums, but stand at 0 for the range (so a tensor with any NaN/Inf has
    0 inside [min, max], as the sharded two-phase path has it). A constant tensor puts everything
    in bucket 0. On the CPU values are read back to skip work (`host_histograms`); elsewhere nothing
    is read back.

    `negate`: the rows of `-x` for each x (the update histogram from the negated update the meter holds).
    On the CPU, x is not touched: -x's min is -max(x), its sum -sum(x) and its bucket positions
    `(max(x) - x) * scale`, the same rounded numbers as negating first, without a pass that writes.

    `sample`: a tensor of more entries than that has its buckets counted on `sample` of them (`sample_index`:
    fixed, uniform positions) and scaled to its number of finite values (`scale_counts`); min, max, sum of
    squares and the NaN/Inf count stay exact (the sum too on accelerators; on the CPU it is the sample's, scaled:
    see `_sampled_moments`). A bucket holding a share q of the values is then off by about
    sqrt(q (1 - q) / sample) of the total (docs/metrics.md). None: every entry is counted.
    """
    dt = stat_dtype(device)
    if not xs:
        return torch.zeros(0, bins + 5, dtype=dt, device=device)
    by_device: dict[torch.device, list[int]] = {}
    for i, x in enumerate(xs):
        by_device.setdefault(x.device, []).append(i)
    counts: list[torch.Tensor] = [torch.empty(0)] * len(xs)
    moments: list[torch.Tensor] = [torch.empty(0)] * len(xs)
    for dev, idx in by_device.items():
        if host_reads_free(dev):
            c, m = host_histograms([xs[i] for i in idx], bins, negate, sample)
            part = torch.cat([c.to(dt), m.to(dt)], dim=1)
            if len(by_device) == 1:
                return part.to(device)
            for j, i in enumerate(idx):  # already folded: bucket `bins` is empty
                counts[i] = torch.cat([part[j, :bins], part.new_zeros(1)])
                moments[i] = part[j, bins:]
        else:
            flat, flips = _histogram_inputs([xs[i] for i in idx], negate, sample)
            for j, i in enumerate(idx):
                x = flat[j].neg() if flips and flips[j] else flat[j]
                counts[i], moments[i] = _device_histogram(x, bins, sample)
    if len(by_device) == 1:
        c_all = torch.stack(counts).to(device, dt)
        m_all = torch.stack(moments).to(device, dt)
    else:
        c_all = torch.stack([c.to(device, dt) for c in counts])
        m_all = torch.stack([m.to(device, dt) for m in moments])
    c_all[:, bins - 1] += c_all[:, bins]  # the maximum itself sits on the closed right edge
    return torch.cat([c_all[:, :bins], m_all], dim=1)


# --- two-phase histograms, for tensors sharded across ranks -------------------------------------
# A shard cannot pick its own bucket edges: every rank first reports its range (`histogram_ranges`),
# the ranges are reduced to the global one, then each rank buckets its shard with that range
# (`histogram_bucket`) and the bucket counts are summed. `histogram_partials` stays the one-pass
# single-process path.


def histogram_ranges(xs: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[n, 2]: min and max of each tensor with NaN/Inf read as 0 (as `histogram_partials` does).

    An empty tensor (a rank's empty shard) gives (+inf, -inf), the neutral element of MIN/MAX.
    """
    dt = stat_dtype(device)
    out = torch.empty(len(xs), 2, dtype=dt, device=device)
    out[:, 0] = math.inf
    out[:, 1] = -math.inf
    for i, x in enumerate(xs):
        x = _hist_input(x)
        if x.numel() == 0:
            continue
        lo, hi = torch.aminmax(torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0))
        out[i, 0] = lo.to(device, dt)
        out[i, 1] = hi.to(device, dt)
    return out


def histogram_bucket(xs: Sequence[torch.Tensor], bins: int, ranges: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[n, bins + 5] like `histogram_partials`, but bucketed over the given (global) `ranges` [n, 2].

    Every column but min/max is a sum over shards; min/max are copied from `ranges`. A range with
    min > max (no element anywhere) is read as [0, 0].
    """
    dt = stat_dtype(device)
    out = torch.zeros(len(xs), bins + 5, dtype=dt, device=device)
    if not len(xs):
        return out
    ranges = ranges.to(device, dt)
    empty = ranges[:, 0] > ranges[:, 1]
    ranges = torch.where(empty.unsqueeze(1), torch.zeros_like(ranges), ranges)
    out[:, bins : bins + 2] = ranges
    for i, x in enumerate(xs):
        x = _hist_input(x)
        if x.numel() == 0:
            continue
        z = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
        nonfinite = x.numel() - torch.isfinite(x).sum()
        lo = ranges[i, 0].to(z.dtype)  # the value each rank's own min would have had
        width = ranges[i, 1] - ranges[i, 0]
        scale = torch.where(width > 0, bins / torch.where(width > 0, width, 1), 0)
        pos = (z - lo).mul_(scale).nan_to_num_(nan=0.0).clamp_(0, bins - 1)
        counts = torch.bincount(pos.to(torch.int64), minlength=bins).to(dt)
        zero_bin = ((0 - lo) * scale).clamp(0, bins - 1).to(torch.int64).reshape(1)
        counts.index_add_(0, zero_bin, -nonfinite.to(dt).reshape(1))
        out[i, :bins] = counts
        out[i, bins + 2] = z.sum().to(dt)
        out[i, bins + 3] = torch.dot(z, z).to(dt)
        out[i, bins + 4] = nonfinite.to(dt)
    return out
