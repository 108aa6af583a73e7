"""Per-tensor statistics computed on the tensors' own device, batched, with no host sync.

Everything here returns device tensors; the caller stacks them and copies to the host once.
Statistics are kept as *partials* (sums of squares, counts, min/max) so that a distributed
reducer can combine shards before the final norms and ratios are taken.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from gradlog.measure.hostmem import MIN_BYTES, host_copy
from gradlog.measure.params import local_tensor

try:  # optional: torch runs without numpy, gradlog too (a little slower on the CPU)
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]

#: Columns of `norm_partials`.
SUMSQ, NONZERO, NONFINITE = 0, 1, 2


def stat_dtype(device: torch.device) -> torch.dtype:
    """float64 keeps counts exact past 2**24 elements; MPS has no float64."""
    return torch.float32 if device.type == "mps" else torch.float64


def dense_values(t: torch.Tensor) -> torch.Tensor:
    """The stored values of `t` on this rank: sparse gradients keep only their explicit entries.

    Implicit zeros of a sparse tensor are zeros, so counts still divide by the full numel.
    """
    t = local_tensor(t if not t.requires_grad else t.detach())
    if t.layout != torch.strided:
        t = t.coalesce().values() if t.is_sparse else t.to_dense()
    return t


def _real(t: torch.Tensor) -> torch.Tensor:
    """Histograms and min/max need an order: complex tensors are described by their magnitude."""
    if t.is_complex():
        return t.abs()
    if not t.is_floating_point():
        return t.double()
    return t


def _groups(xs: Sequence[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    out: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, x in enumerate(xs):
        out.setdefault((x.device, x.dtype), []).append(i)
    return out


def host_reads_free(device: torch.device) -> bool:
    """On the CPU a value can be read back for free, so work can be skipped after a look.

    Elsewhere a read is a host sync, so those paths stay branch-free on the device. So does code that dynamo
    traces, where a read is a graph break (a safety net: the logger's step hooks are skipped by dynamo, so a
    compiled ``optimizer.step()`` runs them eagerly).
    """
    return device.type == "cpu" and not _compiling()


def _compiling() -> bool:
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling()) if callable(is_compiling) else False


def _count_dtype(t: torch.Tensor) -> torch.dtype:
    """Counts accumulated in the input's own dtype stop being exact at 2**8 (bf16) or 2**24 (fp32)."""
    wide = stat_dtype(t.device)
    if t.is_complex():
        return torch.complex128 if wide == torch.float64 else torch.complex64
    return wide


def _nonzero_counts(group: list[torch.Tensor]) -> torch.Tensor:
    """Non-zero entries per tensor (NaN/Inf count as non-zero, -0.0 as zero).

    A fused `_foreach_norm(x, 0)` on accelerators. On the CPU both that op and `count_nonzero`
    branch per entry and slow down ~10x on gradients with many zeros (ReLU), to ~2 ns per entry;
    see `_host_nonzero` for the branch-free count used there.
    """
    if not host_reads_free(group[0].device):
        return torch.stack(torch._foreach_norm(group, 0, dtype=_count_dtype(group[0])))
    return torch.tensor([_host_nonzero(g) for g in group], dtype=torch.float64)


_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16, torch.complex64, torch.complex128)
_COUNT_SLICE = 1 << 16  # entries compared at a time: the boolean scratch stays at 64 kB (a step's peak)


def _host_nonzero(g: torch.Tensor) -> int:
    """`x != 0` into a small boolean scratch, then a count of the booleans: both passes are
    branch-free, so the cost (~1.3 norm passes) does not depend on how many zeros there are."""
    flat = g.resolve_conj().resolve_neg().reshape(-1)
    if np is not None and flat.dtype in _NUMPY_DTYPES:
        a = flat.numpy()
        if a.size <= _COUNT_SLICE:
            return int(np.count_nonzero(a != 0))
        buf = np.empty(_COUNT_SLICE, dtype=bool)  # one scratch for every slice
        return sum(
            int(np.count_nonzero(np.not_equal(a[i : i + _COUNT_SLICE], 0, out=buf[: min(_COUNT_SLICE, a.size - i)])))
            for i in range(0, a.size, _COUNT_SLICE)
        )
    return sum(
        int(torch.count_nonzero(torch.ne(flat[i : i + _COUNT_SLICE], 0))) for i in range(0, flat.numel(), _COUNT_SLICE)
    )


def _flags_from_norms(group: list[torch.Tensor], l2: torch.Tensor) -> torch.Tensor:
    """CPU, without zero counting: the [n, 3] partials from the norms alone, read back once. Every tensor
    is non-zero (flag 1) and finite (0 NaN/Inf) unless its norm says otherwise, and only those few are
    counted exactly (as `_zero_flags` and `_nonfinite_counts` do): ~6 small ops instead of ~15, the
    fixed cost of a measured step on a model with few trainable tensors."""
    vals = l2.tolist()
    # squared as Python floats (float64): a norm above ~1.8e19 does not overflow its square; one torch op
    # at the end instead of seven small ones
    rows = [[v * v, 1.0, 0.0] for v in vals]
    if 0.0 in vals or not math.isfinite(sum(vals)):  # norms are >= 0 or NaN: a finite sum means all finite
        for i, v in enumerate(vals):
            if v == 0.0:  # squares may have underflowed: count
                rows[i][NONZERO] = _exact_nonzero(group[i])
            elif not math.isfinite(v):  # NaN/Inf inside, or a sum of squares that overflowed (count 0)
                rows[i][NONFINITE] = _exact_nonfinite(group[i])
    return torch.tensor(rows, dtype=torch.float64).reshape(len(vals), 3)


def _exact_nonzero(g: torch.Tensor) -> float:
    """Non-zero entries of a tensor whose norm read 0 (its squares may have underflowed)."""
    return float(torch.count_nonzero(g))


def _exact_nonfinite(g: torch.Tensor) -> float:
    """NaN/Inf entries of a tensor whose norm read non-finite (0 when only its sum of squares overflowed)."""
    return float(g.numel() - torch.isfinite(g).sum())


def _nonfinite_counts(group: list[torch.Tensor], l2: torch.Tensor) -> torch.Tensor:
    """NaN/Inf entries per tensor of one (device, dtype) group, given its stacked L2 norms.

    A tensor with any NaN/Inf has a non-finite norm, so on the CPU only those few are counted.
    On accelerators: the non-zeros of `x * 0`, which is NaN exactly where x is not finite, built a
    slice of the group at a time so the scratch stays small (never a copy of every gradient).
    """
    if not host_reads_free(l2.device):
        out: list[torch.Tensor] = []
        for part in _slices(group, _SCRATCH_BYTES):
            chunk = [group[i] for i in part]
            out += torch._foreach_norm(torch._foreach_mul(chunk, 0), 0, dtype=_count_dtype(group[0]))
        return torch.stack(out)
    out_host = torch.zeros(len(group), dtype=torch.float64, device=l2.device)
    for i, bad in enumerate((~torch.isfinite(l2)).tolist()):
        if bad:
            out_host[i] = _exact_nonfinite(group[i])
    return out_host


_SCRATCH_BYTES = 32 << 20  # accelerators: the most scratch a statistic may allocate at once
_CACHE_BYTES = 1 << 20  # CPU: a slice of tensors small enough that a second pass over it hits the cache


def _slices(group: Sequence[torch.Tensor], limit: float) -> list[list[int]]:
    """Positions in `group`, cut into consecutive runs of at most `limit` bytes (a bigger tensor stands alone)."""
    out: list[list[int]] = [[]]
    size = 0
    for i, t in enumerate(group):
        nbytes = t.numel() * t.element_size()
        if out[-1] and size + nbytes > limit:
            out.append([])
            size = 0
        out[-1].append(i)
        size += nbytes
    return out


def _l2(group: list[torch.Tensor]) -> list[torch.Tensor]:
    """L2 norms of one dtype's tensors, one fused call (fp16/bf16 accumulated in fp32)."""
    dtype = group[0].dtype
    if not (dtype.is_floating_point or dtype.is_complex):  # integer "parameters"
        return [g.double().norm() for g in group]
    if dtype in (torch.float16, torch.bfloat16):
        return list(torch._foreach_norm(group, 2, dtype=torch.float32))
    return list(torch._foreach_norm(group, 2))


def _squares(norms: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Norms stacked and squared in the statistics' dtype (float64 but on MPS): a norm above ~1.8e19 does
    not overflow, and `_by_group` has no conversion left to make."""
    out = torch.stack(norms).to(device, stat_dtype(device))
    return out.mul_(out)


def _by_group(
    xs: Sequence[torch.Tensor],
    device: torch.device,
    widths: tuple[int, ...],
    work: Callable[[list[int]], tuple[torch.Tensor, ...]],
) -> tuple[torch.Tensor, ...]:
    """Runs `work` on the positions of each (device, dtype) group of `xs` (fused calls need one dtype)
    and puts its per-tensor results back in `xs`' order: one [n] (width 1) or [n, width] tensor each."""
    dt = stat_dtype(device)
    groups = _groups(xs)
    if len(groups) == 1:
        return tuple(
            p if p.dtype == dt and p.device == device else p.to(device, dt) for p in work(next(iter(groups.values())))
        )
    outs = tuple(torch.zeros((len(xs),) if w == 1 else (len(xs), w), dtype=dt, device=device) for w in widths)
    for idx in groups.values():
        at = torch.tensor(idx).to(device, non_blocking=True)  # built on the host, sent without a wait
        for out, part in zip(outs, work(idx)):
            out[at] = part.to(device, dt)
    return outs


def _slice_limit(device: torch.device) -> float:
    """CPU: work a cache-sized slice at a time so a second read of the same values hits the cache.
    Accelerators: one fused call over everything."""
    return _CACHE_BYTES if host_reads_free(device) else math.inf


def _copy_into(x: torch.Tensor, buf: torch.Tensor | None) -> torch.Tensor:
    """`x` copied into `buf` when it fits exactly (same shape, dtype, device, strides), else a fresh copy."""
    if (
        buf is not None
        and buf.shape == x.shape
        and buf.dtype == x.dtype
        and buf.device == x.device
        and buf.stride() == x.stride()
        and type(x) in _PLAIN_TYPES
    ):
        return buf.copy_(x)
    return _fresh_copy(x)


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _fresh_copy(x: torch.Tensor) -> torch.Tensor:
    """`x.clone()`; a big dense CPU tensor goes into huge-page memory (`hostmem`): the snapshot is fresh memory
    on every measured step, and its 4 KiB page faults cost the frozen backbone's 4 MB head 2-3 ms a step,
    several times the copy itself (0.65 ms with huge pages)."""
    if type(x) in _PLAIN_TYPES and x.device.type == "cpu" and x.numel() * x.element_size() >= MIN_BYTES:
        if x.is_contiguous():
            return host_copy(x)
    return x.clone()


def copy_with_sumsq(
    xs: Sequence[torch.Tensor], device: torch.device, into: Sequence[torch.Tensor | None] | None = None
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Copies of `xs` (in their own dtype) and the sum of squares of each, [n].

    `into[i]`: a buffer from an earlier step to copy `xs[i]` into when its shape, dtype, device and
    strides match (else a fresh copy). On the CPU a cache-sized slice at a time: the norm reads the
    copy it just wrote from cache, so it costs a fraction of a pass over the weights.
    """
    copies: list[torch.Tensor] = [torch.empty(0)] * len(xs)

    def work(idx: list[int]) -> tuple[torch.Tensor]:
        norms: list[torch.Tensor] = []
        for run in _slices([xs[i] for i in idx], _slice_limit(device)):
            fresh = [_copy_into(xs[idx[j]], into[idx[j]] if into is not None else None) for j in run]
            for j, c in zip(run, fresh):
                copies[idx[j]] = c
            norms += _l2(fresh)
        return (_squares(norms, device),)

    (sumsq,) = _by_group(xs, device, (1,), work)
    return copies, sumsq


def _zero_flags(group: list[torch.Tensor], l2: torch.Tensor) -> torch.Tensor:
    """0 for a tensor whose entries are all zero, else a positive number: the non-zero test without counting.

    A non-zero norm settles it. On the CPU the tensors whose fp32 norm is 0 are counted exactly
    (their squares may have underflowed); on accelerators, where reading the norms back is a sync,
    a tensor whose every entry is below ~1e-23 in magnitude reads as zero.
    """
    flags = (l2 != 0).to(stat_dtype(l2.device))  # NaN is non-zero
    if host_reads_free(l2.device):
        for i, zero in enumerate((l2 == 0).tolist()):
            if zero:
                flags[i] = _exact_nonzero(group[i])
    return flags


def subtract_with_sumsq(
    snapshot: list[torch.Tensor], after: list[torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """`snapshot -= after` in place (the update, negated); returns the sums of squares of `after`
    and of the difference, each [n].

    On the CPU a cache-sized slice at a time: each weight is read once from memory for its norm
    and the subtraction, and the difference's norm reads from cache.
    """

    def work(idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        w_l2: list[torch.Tensor] = []
        u_l2: list[torch.Tensor] = []
        for run in _slices([after[i] for i in idx], _slice_limit(device)):
            a = [after[idx[j]] for j in run]
            s = [snapshot[idx[j]] for j in run]
            w_l2 += _l2(a)
            torch._foreach_sub_(s, a)
            u_l2 += _l2(s)
        both = _squares(w_l2 + u_l2, device)
        return both[: len(w_l2)], both[len(w_l2) :]

    weight, update = _by_group(after, device, (1, 1), work)
    return weight, update


def norm_partials(
    xs: Sequence[torch.Tensor], device: torch.device, counts: bool = True, zero_counts: bool = True
) -> torch.Tensor:
    """[n, 3]: sum of squares, count of non-zero entries (NaN/Inf included), count of NaN/Inf entries.

    With `counts=False` only the sum of squares is computed (the count columns stay 0). With
    `zero_counts=False` the non-zero column only says whether a tensor is all zero (0) or not
    (> 0; see `_zero_flags`): counting is a full extra pass, dearer on the CPU than the norms.

    One fused `_foreach_norm` per (device, dtype) group for the sums of squares (fp16/bf16
    accumulated in fp32), one more for the non-zero counts; see `_nonfinite_counts`.
    """

    def work(idx: list[int]) -> tuple[torch.Tensor]:
        group = [xs[i] for i in idx]
        numeric = group[0].is_floating_point() or group[0].is_complex()  # else integers: never NaN
        counting = counts and zero_counts and numeric
        l2: list[torch.Tensor] = []
        found: list[torch.Tensor] = []
        # counting: a cache-sized slice at a time, so the count reads what the norm just brought into cache
        for run in _slices(group, _slice_limit(group[0].device)) if counting else [range(len(group))]:
            chunk = [group[j] for j in run]
            l2 += _l2(chunk)
            if counting:
                found.append(_nonzero_counts(chunk))
        l2s = torch.stack(l2)
        if counts and numeric and not counting and host_reads_free(device) and l2s.device == device:
            return (_flags_from_norms(group, l2s),)
        nonzero: torch.Tensor | None = None
        nonfinite: torch.Tensor | None = None
        if counts and not numeric:
            nonzero = torch.stack([torch.count_nonzero(g) for g in group])
        elif counts:
            nonzero = torch.cat(found) if counting else _zero_flags(group, l2s)
            nonfinite = _nonfinite_counts(group, l2s)
        zeros = torch.zeros(len(group), dtype=stat_dtype(device), device=device)
        cols = [l2s * l2s, zeros if nonzero is None else nonzero, zeros if nonfinite is None else nonfinite]
        return (torch.stack([c.to(device, stat_dtype(device)) for c in cols], dim=1),)

    (out,) = _by_group(xs, device, (3,), work)
    return out


def _hist_input(x: torch.Tensor) -> torch.Tensor:
    x = _real(x).reshape(-1)
    return x.float() if x.element_size() < 4 else x  # fp16/bf16: bucket and sum in fp32


def _positions(z: torch.Tensor, lo: float | torch.Tensor, scale: float | torch.Tensor, bins: int) -> torch.Tensor:
    """Bucket of each value as a small integer in [0, bins]; `bins` (only the maximum, by rounding) is folded later.

    `z >= lo` always, so no clamp is needed below; a narrow integer type keeps the pass cheap.
    """
    pos = torch.sub(z, lo).mul_(scale)
    return pos.to(torch.uint8 if bins < 255 else torch.int16)


def _host_chunks(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A flat tensor in cache-sized pieces (views): the passes over one piece then read it from cache,
    and bucketing's temporaries stay piece-sized instead of the size of a huge tensor (a 200M-element
    tensor's positions were an 800 MB float temporary). Measured on 50M floats: 0.8 s -> 0.3 s."""
    step = max(1, _CACHE_BYTES // x.element_size())
    n = x.numel()
    return (x,) if n <= step else tuple(x[i : i + step] for i in range(0, n, step))


def _moments(x: torch.Tensor) -> list[torch.Tensor]:
    """min, max, sum and sum of squares of a flat tensor (four 0-dim tensors), a cache-sized piece at a time.

    Left unstacked: the caller stacks every tensor's at once (a stack per tensor cost more than the sums)."""
    pieces = _host_chunks(x)
    if len(pieces) == 1:
        return [*torch.aminmax(x), x.sum(), torch.dot(x, x)]
    p = torch.stack([torch.stack([*torch.aminmax(c), c.sum(), torch.dot(c, c)]) for c in pieces]).double()
    return [p[:, 0].min(), p[:, 1].max(), p[:, 2].sum(), p[:, 3].sum()]


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
    masking, ranges that overflow). `flips[i]`: the row of `-xs[i]` (the block is a copy, negated in place)."""
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
            ok = torch.isfinite(stats).all(1) & (stats[:, 1] - stats[:, 0] <= torch.finfo(dtype).max)
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
    xs: list[torch.Tensor], bins: int, counts: torch.Tensor, moments: torch.Tensor, flips: list[bool] | None = None
) -> None:
    """CPU: small tensors in batches (`_batched_histograms`); the others one by one: min/max, sum and
    sum of squares, then the buckets, a cache-sized piece at a time (see `_bucket_counts`); the rare
    tensor with NaN/Inf is masked first. Rows (`host_histograms` layout) are written into `counts`
    [len(xs), bins] and `moments` [len(xs), 5] as they are made: no per-tensor results are kept and stacked.

    `flips[i]`: the row of `-xs[i]`, without making `-xs[i]` (contiguous floating tensors only: see
    `histogram_partials`)."""
    done = _batched_histograms(xs, bins, counts, moments, flips)
    rest = [xs[i] for i, d in enumerate(done) if not d]
    at = [i for i, d in enumerate(done) if not d]
    # numpy views: a numpy row write costs a fraction of torch's
    rows = (counts.numpy(), moments.numpy()) if np is not None else None
    scratch = _bucket_scratch()
    # numpy's floating-point error settings are the user's (np.seterr): a subnormal product must not raise here
    with np.errstate(all="ignore") if np is not None else contextlib.nullcontext():
        # a few MB of tensors at a time: their moments in one stack and one read-back, then their buckets
        # while they are still in the last-level cache (all moments first read every tensor from memory twice)
        for run in _slices(rest, _GROUP_BYTES):
            parts = [m for j in run if rest[j].numel() for m in _moments(rest[j])]
            host = iter(torch.stack(parts).double().tolist() if parts else [])  # stack promotes fp32 + fp64
            for j in run:
                i = at[j]
                _host_row(xs[i], i, bins, (counts, moments), rows, flips is not None and flips[i], host, scratch)


def _host_row(
    x: torch.Tensor,
    i: int,
    bins: int,
    out: tuple[torch.Tensor, torch.Tensor],
    rows: Any,
    flip: bool,
    host: Iterator[float],
    scratch: _Scratch,
) -> None:
    """Row `i` of `out` (counts, moments; through `rows`, their numpy views, where numpy is there) for the
    flat tensor `x`, whose min, max, sum and sum of squares `host` yields next. `flip`: the row of `-x`,
    counted from x: its min is -max(x), its sum -sum(x) (rounding is symmetric) and its positions
    `(max(x) - x) * scale`."""
    counts, moments = out
    if x.numel() == 0:
        counts[i] = 0
        moments[i] = 0.0
        return
    lo, hi, s, s2 = (next(host) for _ in range(4))
    if flip:
        lo, hi, s = -hi, -lo, -s
    nonfinite = 0
    if not all(math.isfinite(v) for v in (lo, hi, s, s2)):  # NaN/Inf inside (or an overflowed sum)
        z = x[torch.isfinite(x)]
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
    if hi - lo > torch.finfo(x.dtype).max:  # x - lo would overflow in x's dtype
        x = x.double()
    scale = bins / (hi - lo) if hi > lo else 0.0
    count = _bucket_counts(x, lo, scale, bins, flip, scratch)
    count[bins - 1] += count[bins]  # the maximum itself sits on the closed right edge
    if rows is not None:
        rows[0][i] = count.numpy()[:bins]
        rows[1][i] = (lo, hi, s, s2, nonfinite)
    else:
        counts[i] = count[:bins]
        moments[i] = torch.tensor([lo, hi, s, s2, float(nonfinite)], dtype=moments.dtype)


def _bucket_counts(
    x: torch.Tensor,
    lo: float,
    scale: float,
    bins: int,
    flip: bool,
    scratch: _Scratch,
) -> torch.Tensor:
    """[bins + 1] counts of a flat tensor's bucket positions `(x - lo) * scale` in x's dtype (`flip`: of
    `(-lo - x) * scale`, which are -x's positions when `lo` is -x's minimum), truncated to integers.

    With numpy, each cache-sized piece goes through one reused scratch buffer: subtract, multiply and the
    integer conversion are numpy's vectorised loops (torch's float->uint8 conversion alone cost more than
    all three, and every torch temporary was a fresh allocation), then `torch.bincount` counts the small
    integers. The arithmetic is the same IEEE operations on the same rounded scalars, so the buckets are
    those of `_positions`, which remains the path without numpy.
    """
    # a range so narrow (subnormal) that the scale overflows x's dtype: positions are NaN/Inf and their
    # integer conversion is torch's own business; torch's path keeps its answer
    if np is None or x.dtype not in (torch.float32, torch.float64) or not _finite_in(scale, x.dtype):
        pieces = _host_chunks(x.neg() if flip else x)
        count = torch.bincount(_positions(pieces[0], lo, scale, bins), minlength=bins + 1)
        for piece in pieces[1:]:
            count += torch.bincount(_positions(piece, lo, scale, bins), minlength=bins + 1)
        return count
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
    crowded = False
    spread: np.ndarray[Any, Any] | None = None
    total = torch.zeros(width, dtype=torch.int64)
    for start in range(0, a.size, step):
        part = a[start : start + step]
        f, pos = fbuf[: part.size], pbuf[: part.size]
        if flip:
            np.subtract(edge, part, out=f)
        else:
            np.subtract(part, edge, out=f)
        np.multiply(f, mul, out=f)
        np.copyto(pos, f, casting="unsafe")  # truncation, as torch's conversion; 0 <= f <= bins (+ rounding)
        if crowded:
            if spread is None:
                spread = (np.arange(step, dtype=np.int16) % lanes) * np.int16(width)
            q = fbuf.view(np.int16)[: part.size]  # the float scratch is free again: int16 fits in it
            np.add(spread[: part.size], pos, out=q, dtype=np.int16)
            got = torch.bincount(torch.from_numpy(q), minlength=lanes * width).view(lanes, width).sum(0)
        else:
            got = torch.bincount(torch.from_numpy(pos), minlength=width)
        total += got
        crowded = lanes > 1 and int(got.max()) * 4 > part.size  # a quarter of the piece in one bucket
    return total


def _finite_in(v: float, dtype: torch.dtype) -> bool:
    return math.isfinite(v) and abs(v) <= torch.finfo(dtype).max


def _device_histogram(x: torch.Tensor, bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Accelerators: the same numbers without reading anything back (NaN/Inf masked with `where`)."""
    if x.numel() == 0:
        return torch.zeros(bins + 1, dtype=torch.int64, device=x.device), torch.zeros(5, device=x.device)
    fin = torch.isfinite(x)
    nonfinite = x.numel() - fin.sum()
    zf = torch.where(fin, x, 0)  # NaN/Inf stand at 0 for the range and the moments
    lo, hi = torch.aminmax(zf)
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
    moments = torch.stack([lo, hi, zf.sum(), torch.dot(zf, zf), nonfinite.to(x.dtype)])
    return counts, moments


def _histogram_inputs(xs: Sequence[torch.Tensor], negate: bool) -> tuple[list[torch.Tensor], list[bool] | None]:
    """Flat values to bucket, and (`negate`) which are counted as their negation where they are bucketed.

    Floating tensors are negated where they are bucketed; a contiguous copy of a strided one keeps its sums
    in the order of the copy `-x` was. |-z| = |z|: a complex tensor's magnitudes need nothing; other values
    (integers, read as float64) are negated here."""
    flat = [_hist_input(x) for x in xs]
    if not negate:
        return flat, None
    flips = [x.is_floating_point() for x in xs]
    flat = [f.contiguous() if flip else f if x.is_complex() else f.neg() for x, f, flip in zip(xs, flat, flips)]
    return flat, flips


def on_host(xs: Sequence[torch.Tensor], device: torch.device) -> bool:
    """Whether `host_histograms` applies: every tensor on the CPU, where reading values back is free."""
    return host_reads_free(device) and all(x.device == device for x in xs)


def host_histograms(xs: Sequence[torch.Tensor], bins: int, negate: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU tensors (`on_host`): the `histogram_partials` numbers as bucket counts [n, bins] and moments
    [n, 5] (min, max, sum, sum of squares, NaN/Inf count; float64).

    Why apart: the counts are integers, int32 (int64 from 2^31 values in one tensor), half the memory of
    float64 rows. A measured step holds the gradient and update histograms beside the weight snapshot,
    which on a 5,000-tensor model was its peak (2.8 MB per kind as float64 rows)."""
    flat, flips = _histogram_inputs(xs, negate)
    wide = any(x.numel() >= 2**31 for x in flat)
    counts = torch.empty(len(flat), bins, dtype=torch.int64 if wide else torch.int32)
    moments = torch.empty(len(flat), 5, dtype=torch.float64)
    if flat:
        _host_histograms(flat, bins, counts, moments, flips)
    return counts, moments


def histogram_partials(
    xs: Sequence[torch.Tensor], bins: int, device: torch.device, negate: bool = False
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
            c, m = host_histograms([xs[i] for i in idx], bins, negate)
            part = torch.cat([c.to(dt), m.to(dt)], dim=1)
            if len(by_device) == 1:
                return part.to(device)
            for j, i in enumerate(idx):  # already folded: bucket `bins` is empty
                counts[i] = torch.cat([part[j, :bins], part.new_zeros(1)])
                moments[i] = part[j, bins:]
        else:
            flat, flips = _histogram_inputs([xs[i] for i in idx], negate)
            for j, i in enumerate(idx):
                counts[i], moments[i] = _device_histogram(flat[j].neg() if flips and flips[j] else flat[j], bins)
    if len(by_device) == 1:
        c_all = torch.stack(counts).to(device, dt)
        m_all = torch.stack(moments).to(device, dt)
    else:
        c_all = torch.stack([c.to(device, dt) for c in counts])
        m_all = torch.stack([m.to(device, dt) for m in moments])
    c_all[:, bins - 1] += c_all[:, bins]  # the maximum itself sits on the closed right edge
    return torch.cat([c_all[:, :bins], m_all], dim=1)


class Packer:
    """Collects device tensors for one measured step and brings them to the host in ONE copy."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._parts: list[tuple[str, torch.Tensor, bool]] = []

    def add(self, key: str, t: torch.Tensor, owned: bool = False) -> None:
        """`owned`: nobody else holds or changes `t` (a fresh result), so on the CPU it is handed out as it is."""
        self._parts.append((key, t, owned))

    def __bool__(self) -> bool:
        return bool(self._parts)

    def fetch(self) -> dict[str, torch.Tensor]:
        """The single device-to-host transfer of the step."""
        if not self._parts:
            return {}
        dt = stat_dtype(self.device)
        if self.device.type == "cpu":
            # Already on the host: no concatenated copy, so a step of 15,000 histograms (8 MB of partials)
            # is never held twice. Parts another object may change later are copied.
            out = {
                key: t if owned and t.dtype == dt and not t.requires_grad else t.detach().to(dt, copy=not owned)
                for key, t, owned in self._parts
            }
            self._parts = []
            return out
        flat = torch.cat([t.detach().reshape(-1).to(self.device, dt) for _, t, _ in self._parts])
        host = flat.cpu()
        out = {}
        at = 0
        for key, t, _ in self._parts:
            n = t.numel()
            out[key] = host[at : at + n].reshape(t.shape)
            at += n
        self._parts = []
        return out


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
