"""Per-tensor statistics computed on the tensors' own device, batched, with no host sync: norms, non-zero and
NaN/Inf counts, the weight snapshot and the update, and the `Packer` that brings a step to the host in one copy.

Everything here returns device tensors; the caller stacks them and copies to the host once.
Statistics are kept as *partials* (sums of squares, counts) so that a distributed reducer can
combine shards before the final norms and ratios are taken. Histograms: `gradlog.measure.bucketing`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Union

import numpy as np
import torch

from gradlog.measure.hostmem import MIN_BYTES, host_copy
from gradlog.measure.params import local_tensor

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


class Ranges:
    """Exact (min, max) of some of a measured step's tensors, taken inside a pass the step makes anyway (the
    gradients' zero count, the update's subtraction) on each cache-sized piece just after that pass read it:
    the range of a sampled histogram (`bucketing.host_histograms`' `known`) without a read of its own from
    memory. CPU only (`wants`): contiguous floating tensors; positions are the caller's.

    Why not from the norms' pass: `_foreach_norm` reads a whole tensor in one call, and cutting it into pieces
    would change the norms' rounding, which the verdict reads."""

    def __init__(self, want: Sequence[bool]) -> None:
        self.want = list(want)
        self._parts: dict[int, list[torch.Tensor]] = {}

    def wants(self, i: int, x: torch.Tensor) -> bool:
        """Whether tensor i's range is taken here (else the histogram reads it)."""
        return self.want[i] and x.is_floating_point() and x.is_contiguous() and x.device.type == "cpu"

    def add(self, i: int, piece: torch.Tensor) -> None:
        """One piece of tensor i; every piece of it must come here."""
        self._parts.setdefault(i, []).append(torch.stack(torch.aminmax(piece)))

    def found(self) -> list[tuple[float, float] | None]:
        """Per position, (min, max) of the tensors whose pieces came (NaN where any entry was NaN), else None."""
        out: list[tuple[float, float] | None] = [None] * len(self.want)
        if not self._parts:
            return out
        keys = list(self._parts)
        per = [torch.stack(self._parts[i]).double() for i in keys]
        both = torch.stack([torch.stack([p[:, 0].min(), p[:, 1].max()]) for p in per]).tolist()  # NaN stays NaN
        for i, (lo, hi) in zip(keys, both):
            out[i] = (lo, hi)
        return out


class Reads(Ranges):
    """`Ranges`, and the sums of squares, of the weights a measured step did not copy (`Meter._pick`), taken in
    the one pass the step makes over them after the optimizer: the fingerprint compare
    (`fingerprint.changes_all`), a cache-sized slab at a time. Without it each such weight was read three times
    after the step: the compare, its norm (`norm_partials`) and its histogram's range (`torch.aminmax`).

    `want[i]`: tensor i's range is wanted (its histogram is sampled); `square[i]`: its sum of squares (the
    weight norm). A tensor's pieces must all come here or none (`sumsq`/`found` then leave it out: the caller
    reads it as before). The sum of squares is the pieces' own (a dot product in the weights' dtype; fp16/bf16
    accumulated in fp32, as `_l2`), added in float64: the weight norm to fp32 rounding, not bit for bit the
    whole tensor's `_foreach_norm` (another summation order; measured closer to a float64 norm: 4e-7 against
    9e-5 relative on a 4M-entry fp32 weight)."""

    def __init__(self, want: Sequence[bool], square: Sequence[bool]) -> None:
        super().__init__(want)
        self.square = list(square)
        self._squares: dict[int, list[torch.Tensor]] = {}

    def takes(self, i: int, x: torch.Tensor) -> bool:
        """Whether tensor i's pieces are wanted here: a contiguous CPU float of 2+ bytes (aminmax and the norm
        of its own dtype; 8-bit floats are left to the passes they had)."""
        return (
            (self.want[i] or self.square[i])
            and x.is_floating_point()
            and x.element_size() >= 2
            and x.is_contiguous()
            and x.device.type == "cpu"
        )

    def add(self, i: int, piece: torch.Tensor) -> None:
        if self.want[i]:
            super().add(i, piece)
        if self.square[i]:
            if piece.element_size() < 4:  # fp16/bf16: accumulated in fp32, as `_l2` does
                norm = torch.linalg.vector_norm(piece, dtype=torch.float32)
                square = norm * norm
            else:
                square = torch.dot(piece, piece)
            self._squares.setdefault(i, []).append(square)

    def sumsq(self) -> dict[int, float]:
        """Position -> sum of squares, of the tensors whose pieces came (NaN/Inf stay: a NaN weight's norm)."""
        if not self._squares:
            return {}
        keys = list(self._squares)
        sums = torch.stack([torch.stack(self._squares[i]).double().sum() for i in keys]).tolist()  # one read-back
        return dict(zip(keys, sums))


PieceFn = Callable[[torch.Tensor], None]


def _nonzero_counts(group: list[torch.Tensor], pieces: Sequence[PieceFn | None] | None = None) -> torch.Tensor:
    """Non-zero entries per tensor (NaN/Inf count as non-zero, -0.0 as zero).

    A fused `_foreach_norm(x, 0)` on accelerators. On the CPU both that op and `count_nonzero`
    branch per entry and slow down ~10x on gradients with many zeros (ReLU), to ~2 ns per entry;
    see `_host_nonzero` for the branch-free count used there. `pieces[i]` (CPU): called on each cache-sized
    piece of tensor i once it is counted (`Ranges.add`).
    """
    if not host_reads_free(group[0].device):
        return torch.stack(torch._foreach_norm(group, 0, dtype=_count_dtype(group[0])))
    fns = pieces if pieces is not None else [None] * len(group)
    return torch.tensor([_host_nonzero(g, fn) for g, fn in zip(group, fns)], dtype=torch.float64)


_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16, torch.complex64, torch.complex128)
_COUNT_SLICE = 1 << 16  # entries compared at a time: the boolean scratch stays at 64 kB (a step's peak)


def _host_nonzero(g: torch.Tensor, piece: PieceFn | None = None) -> int:
    """`x != 0` into a small boolean scratch, then a count of the booleans: both passes are
    branch-free, so the cost (~1.3 norm passes) does not depend on how many zeros there are.
    `piece`: called on each cache-sized piece of `g` (flat) once it is counted, while it is in cache."""
    flat = g.resolve_conj().resolve_neg().reshape(-1)
    if piece is None:
        return _count_nonzero(flat)
    step = max(1, _CACHE_BYTES // flat.element_size())
    total = 0
    for at in range(0, flat.numel(), step):
        part = flat[at : at + step]
        total += _count_nonzero(part)
        piece(part)
    return total


def _count_nonzero(flat: torch.Tensor) -> int:
    """`_host_nonzero` of a flat tensor."""
    if flat.dtype in _NUMPY_DTYPES:
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
    snapshot: list[torch.Tensor],
    after: list[torch.Tensor],
    device: torch.device,
    ranges: tuple[Ranges, Ranges] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`snapshot -= after` in place (the update, negated); returns the sums of squares of `after`
    and of the difference, each [n].

    On the CPU a cache-sized slice at a time: each weight is read once from memory for its norm
    and the subtraction, and the difference's norm reads from cache. `ranges` (CPU): (of the differences, of
    `after`), by position: the tensors they want are subtracted a cache-sized piece at a time, each piece's
    range taken while it is in cache (the same differences, bit for bit).
    """

    def work(idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        w_l2: list[torch.Tensor] = []
        u_l2: list[torch.Tensor] = []
        for run in _slices([after[i] for i in idx], _slice_limit(device)):
            a = [after[idx[j]] for j in run]
            s = [snapshot[idx[j]] for j in run]
            w_l2 += _l2(a)
            fused = [k for k in range(len(run)) if ranges is not None and _fusable(ranges, idx[run[k]], s[k], a[k])]
            if fused:
                assert ranges is not None
                taken = set(fused)
                rest = [k for k in range(len(run)) if k not in taken]
                if rest:
                    torch._foreach_sub_([s[k] for k in rest], [a[k] for k in rest])
                for k in fused:
                    _subtract_pieces(s[k], a[k], idx[run[k]], ranges)
            else:
                torch._foreach_sub_(s, a)
            u_l2 += _l2(s)
        both = _squares(w_l2 + u_l2, device)
        return both[: len(w_l2)], both[len(w_l2) :]

    weight, update = _by_group(after, device, (1, 1), work)
    return weight, update


def _fusable(ranges: tuple[Ranges, Ranges], i: int, s: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether `subtract_with_sumsq` takes position i's ranges: wanted, both tensors plain and alike."""
    return (ranges[0].wants(i, s) or ranges[1].wants(i, a)) and (
        s.is_contiguous() and a.is_contiguous() and s.dtype == a.dtype and s.is_floating_point()
    )


def _subtract_pieces(s: torch.Tensor, a: torch.Tensor, i: int, ranges: tuple[Ranges, Ranges]) -> None:
    """`s -= a` a cache-sized piece at a time, each piece's range (difference, `a`) taken from cache."""
    sf, af = s.view(-1), a.view(-1)
    step = max(1, _CACHE_BYTES // s.element_size())
    diff, weight = ranges[0].want[i], ranges[1].want[i]
    for at in range(0, sf.numel(), step):
        sp, ap = sf[at : at + step], af[at : at + step]
        sp.sub_(ap)
        if diff:
            ranges[0].add(i, sp)
        if weight:
            ranges[1].add(i, ap)


def norm_partials(
    xs: Sequence[torch.Tensor],
    device: torch.device,
    counts: bool = True,
    zero_counts: bool = True,
    ranges: Ranges | None = None,
) -> torch.Tensor:
    """[n, 3]: sum of squares, count of non-zero entries (NaN/Inf included), count of NaN/Inf entries.

    With `counts=False` only the sum of squares is computed (the count columns stay 0). With
    `zero_counts=False` the non-zero column only says whether a tensor is all zero (0) or not
    (> 0; see `_zero_flags`): counting is a full extra pass, dearer on the CPU than the norms.

    One fused `_foreach_norm` per (device, dtype) group for the sums of squares (fp16/bf16
    accumulated in fp32), one more for the non-zero counts; see `_nonfinite_counts`. `ranges` (CPU, with the
    zero counts): the wanted tensors' ranges are taken in the count's pass (`Ranges`).
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
                fns = [_adder(ranges, idx[j], group[j]) for j in run] if ranges is not None else None
                found.append(_nonzero_counts(chunk, fns))
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


def _adder(ranges: Ranges, i: int, x: torch.Tensor) -> PieceFn | None:
    """`ranges.add` for position i where its range is wanted, else None."""
    return functools.partial(ranges.add, i) if ranges.wants(i, x) else None


#: The named parts of a measured step's host copy (each a field of `HostStep`). A Literal, so that mypy refuses
#: a misspelt part where one is queued (`Packer.add`, `distributed.DistStep.add`).
Part = Literal[
    "grad",  # [n, 3] gradient partials (`norm_partials`' columns)
    "weight",  # [n] weights' sums of squares after the step
    "before",  # [n] ... before it (snapshot steps)
    "update",  # [n] updates' sums of squares
    "changed",  # [fingerprinted rows] 1 where the row changed
    "frozen",  # [n] elements with a gradient that kept their value
    "frozen_of",  # [n] elements with a gradient
    "skipped",  # [1] non-zero when the optimizer skipped the step
    "skipped_total",  # [1] the optimizer's own count of skipped steps
    "clip_coef",  # [1] the smallest gradient-clipping factor
    "slices_done",  # [tensors observed] 1 where every slice has now been seen non-zero
    "dead",  # [n] share of all-zero slices
    "dead_rows",  # sharded: per-rank all-zero rows, summed
    "has_grad",  # sharded: per-rank "has a gradient", summed
]
#: A histogram kind's partials block (`hist_key`).
HistKey = tuple[Literal["hist"], str]
#: Where a tensor goes in the step's host copy: a named part, or a histogram kind's block.
Key = Union[Part, HistKey]


def hist_key(kind: str) -> HistKey:
    """The key of a histogram kind's partials block ("grad", "update", "weight")."""
    return ("hist", kind)


@dataclass
class HostStep:
    """One measured step's host copy, unpacked (`Packer.fetch`): each field the part of that name, None where
    the step did not queue it; `hist`, the histogram partials blocks by kind. Read by attribute, so a
    misspelt part is a type error (mypy), not a field silently missing."""

    grad: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    before: torch.Tensor | None = None
    update: torch.Tensor | None = None
    changed: torch.Tensor | None = None
    frozen: torch.Tensor | None = None
    frozen_of: torch.Tensor | None = None
    skipped: torch.Tensor | None = None
    skipped_total: torch.Tensor | None = None
    clip_coef: torch.Tensor | None = None
    slices_done: torch.Tensor | None = None
    dead: torch.Tensor | None = None
    dead_rows: torch.Tensor | None = None
    has_grad: torch.Tensor | None = None
    hist: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, parts: Sequence[tuple[Key, torch.Tensor]]) -> HostStep:
        """From (key, host tensor) pairs; a name that is not a field raises (TypeError), never dropped."""
        named: dict[str, torch.Tensor] = {}
        hist: dict[str, torch.Tensor] = {}
        for key, t in parts:
            if isinstance(key, tuple):
                hist[key[1]] = t
            else:
                named[key] = t
        return cls(**named, hist=hist)


class Packer:
    """Collects device tensors for one measured step and brings them to the host in ONE copy."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._parts: list[tuple[Key, torch.Tensor, bool]] = []

    def add(self, key: Key, t: torch.Tensor, owned: bool = False) -> None:
        """`owned`: nobody else holds or changes `t` (a fresh result), so on the CPU it is handed out as it is."""
        self._parts.append((key, t, owned))

    def __bool__(self) -> bool:
        return bool(self._parts)

    def fetch(self) -> HostStep:
        """The single device-to-host transfer of the step."""
        parts, self._parts = self._parts, []
        if not parts:
            return HostStep()
        dt = stat_dtype(self.device)
        if self.device.type == "cpu":
            # Already on the host: no concatenated copy, so a step of 15,000 histograms (8 MB of partials)
            # is never held twice. Parts another object may change later are copied.
            return HostStep.of(
                [
                    (key, t if owned and t.dtype == dt and not t.requires_grad else t.detach().to(dt, copy=not owned))
                    for key, t, owned in parts
                ]
            )
        flat = torch.cat([t.detach().reshape(-1).to(self.device, dt) for _, t, _ in parts])
        host = flat.cpu()
        out: list[tuple[Key, torch.Tensor]] = []
        at = 0
        for key, t, _ in parts:
            n = t.numel()
            out.append((key, host[at : at + n].reshape(t.shape)))
            at += n
        return HostStep.of(out)
