"""Per-slice gradient evidence: which rows, columns and elements ever had a non-zero gradient.

On a measured step each watched gradient gives, per row (dim 0) and per column (dim 1) of a
tensor with 2+ dims, or per element of a 1-D tensor, "some entry is non-zero" (NaN counts as
non-zero), OR-accumulated into one bool tensor per slice kind on the gradient's device. Nothing
is read back until close, except one flag per tensor riding in the step's single host copy (on
the CPU, where a read is free, it is read at once): once every slice of a tensor has had a non-zero
gradient there is nothing left to learn about it, and later measured steps skip it. A healthy model
therefore pays on its first measured step only.

"Non-zero" is exact: a sum of magnitudes is zero only when every entry is (no square to underflow);
on the CPU the values' bits are OR-ed with the sign bit masked (see `_host_slices`).
Sparse gradients (`nn.Embedding(sparse=True)`) mark the rows present in `coalesce().indices()`
with a non-zero value; absent rows stay zero.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gradlog.measure.params import Tracked, local_tensor
from gradlog.measure.stats import _compiling


def slice_nonzero(g: torch.Tensor, rows_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rows or elements [dim 0], columns [dim 1] or None) of "some entry non-zero" for one gradient (bool)."""
    g = local_tensor(g.detach() if g.requires_grad else g)
    if g.dim() == 0:
        return (g != 0).reshape(1), None
    r = g.shape[0]
    if g.is_sparse and g.sparse_dim() == 1:
        g = g.coalesce()
        idx, vals = g.indices()[0], g.values()
        rows = torch.zeros(r, dtype=torch.uint8, device=g.device)
        if vals.numel():
            hit = (_magnitude(vals).reshape(vals.shape[0], -1).sum(1) != 0).to(torch.uint8)
            rows.scatter_reduce_(0, idx, hit, "amax")  # on the device: no boolean indexing, no sync
        if g.dim() < 2 or rows_only:
            return rows.bool(), None
        c = g.shape[1]
        if vals.numel():
            cols = _magnitude(vals).reshape(vals.shape[0], c, -1).sum((0, 2)) != 0
        else:
            cols = torch.zeros(c, dtype=torch.bool, device=g.device)
        return rows.bool(), cols
    if g.layout != torch.strided:
        g = g.to_dense()
    if g.dim() == 1 or g.numel() == 0:
        nz = g != 0 if g.dim() == 1 else torch.zeros(r, dtype=torch.bool, device=g.device)
        no_cols = g.dim() == 1 or rows_only
        return nz, None if no_cols else torch.zeros(g.shape[1], dtype=torch.bool, device=g.device)
    if rows_only:
        return _rows_nonzero(g.reshape(r, -1)), None
    a = _magnitude(g)  # one temporary |g|, read twice from cache
    return a.reshape(r, -1).sum(1) != 0, a.reshape(r, g.shape[1], -1).sum((0, 2)) != 0


#: numpy integer view of each float dtype, and the mask that drops its sign bit.
_BITS: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.float64: (torch.int64, 0x7FFF_FFFF_FFFF_FFFF),
    torch.float32: (torch.int32, 0x7FFF_FFFF),
    torch.float16: (torch.int16, 0x7FFF),
    torch.bfloat16: (torch.int16, 0x7FFF),
}
_NUMPY_FLOATS = tuple(_BITS)  # the float dtypes numpy has a view of (bf16: its int16 bits)


def _probe_views(g: torch.Tensor) -> list[Any] | None:
    """numpy views of a few entries of a dense CPU float gradient that hit every row and every column
    of it at least once (a 1-D gradient: all of it); None when `g` is not such a gradient.

    The entries are the wrapped diagonals of the first [rows, columns] plane: (b*C + i, i) when there
    are more rows than columns (R >= C), (i, b*R + i) otherwise, max(R, C) entries in all. If none of
    them is zero, every row and every column has a non-zero entry: the tensor's evidence is complete
    without reading the rest of it. bf16 comes as its int16 bits (the caller masks the sign bit).
    """
    if g.layout != torch.strided or not g.dim() or g.dtype not in _NUMPY_FLOATS or g.is_neg():
        return None
    if not g.is_contiguous() or not g.numel():
        return None
    a = g.numpy() if g.dtype != torch.bfloat16 else g.view(torch.int16).numpy()
    if g.dim() == 1:  # elements are the slices: every one must be non-zero
        return [a]
    r, c = g.shape[0], g.shape[1]
    item = a.itemsize
    s_r, s_c = g.stride(0) * item, g.stride(1) * item
    big, small, s_big, s_small = (r, c, s_r, s_c) if r >= c else (c, r, s_c, s_r)
    q, rem = divmod(big, small)
    if q == 1:  # a square plane (the common case): its diagonal
        views = [np.ndarray((small,), a.dtype, a, 0, (s_big + s_small,))]
    else:
        views = [np.ndarray((q, small), a.dtype, a, 0, (small * s_big, s_big + s_small))]
    if rem:
        views.append(np.ndarray((rem,), a.dtype, a, q * small * s_big, (s_big + s_small,)))
    return views


def _probe_complete(grads: dict[int, torch.Tensor]) -> set[int]:
    """The keys of the gradients whose probe entries (`_probe_views`) are all non-zero: every row and
    column of those is non-zero. One concatenation and one `!=` per dtype for all of them, so a healthy
    model's first measured step reads a few entries per tensor instead of every gradient."""
    by_dtype: dict[Any, tuple[list[int], list[Any], list[int]]] = {}
    for key, g in grads.items():
        views = _probe_views(g)
        if views is None:
            continue
        keys, parts, sizes = by_dtype.setdefault(views[0].dtype, ([], [], []))
        keys.append(key)
        parts.extend(views)
        sizes.append(sum(v.size for v in views))
    done: set[int] = set()
    for dtype, (keys, parts, sizes) in by_dtype.items():
        flat = np.concatenate(parts, axis=None)
        if dtype == np.int16:
            flat &= 0x7FFF  # bf16 bits: the sign bit alone is -0.0
        nz = flat != 0  # NaN is non-zero here, as in `_host_slices`
        if nz.all():
            done.update(keys)
            continue
        starts = np.cumsum([0, *sizes[:-1]])
        done.update(k for k, ok in zip(keys, np.logical_and.reduceat(nz, starts)) if ok)
    return done


def _host_slices(g: torch.Tensor, need_cols: bool, need_rows: bool = True) -> tuple[Any, Any] | None:
    """(rows or None, columns or None) of "some entry non-zero" of a dense CPU float gradient as numpy
    bool vectors (a 1-D gradient: its elements, no columns). None where numpy has no view of `g`.

    Rows and columns are OR-reductions of the values' bits with the sign bit masked off afterwards:
    exact (-0.0 is zero; NaN, Inf and denormals are non-zero), one read of the gradient with no
    gradient-sized temporary, ~5x cheaper than comparing every entry into a boolean scratch."""
    if g.device.type != "cpu" or g.layout != torch.strided or not g.numel() or g.is_conj() or g.is_neg():
        return None
    bits = _BITS.get(g.dtype)
    if bits is None:
        return None
    view, mask = bits
    if g.dim() == 1:
        a = g.numpy() if g.dtype != torch.bfloat16 else g.view(torch.int16).numpy()
        return ((a & 0x7FFF) != 0 if g.dtype == torch.bfloat16 else a != 0), None  # NaN != 0: non-zero
    a = g.view(view).numpy()
    a = a.reshape(a.shape[0], a.shape[1], -1)
    r, c, k = a.shape
    rows = np.empty(r, dtype=bool) if need_rows else None
    cols = np.zeros(c, dtype=bool) if need_cols else None
    per = max(1, _BLOCK // (c * k))  # a block of rows at a time: each reduction's output stays small
    for at in range(0, r, per):
        part = a[at : at + per]
        plane = part[:, :, 0] if k == 1 else np.bitwise_or.reduce(part, axis=2)
        if rows is not None:
            np.not_equal(np.bitwise_or.reduce(plane, axis=1) & mask, 0, out=rows[at : at + plane.shape[0]])
        if cols is not None:
            cols |= (np.bitwise_or.reduce(plane, axis=0) & mask) != 0
    return rows, cols


#: entries reduced at a time by `_host_slices`: a 200M-entry table's per-row outputs were 6 MB of temporaries
_BLOCK = 1 << 20


def _host_cols(g: torch.Tensor) -> torch.Tensor | None:
    """Per column (dim 1) of a dense CPU gradient, "some entry non-zero" (see `_host_slices`)."""
    hs = _host_slices(g, need_cols=True, need_rows=False)
    return None if hs is None or hs[1] is None else torch.from_numpy(hs[1])


def _magnitude(g: torch.Tensor) -> torch.Tensor:
    """|g| in a dtype whose sums never cancel: a sum of magnitudes is 0 only when every entry is."""
    if g.is_complex():
        return g.abs()
    if not g.is_floating_point():
        return g.abs().to(torch.float32)
    return g.abs()


def _rows_nonzero(g: torch.Tensor) -> torch.Tensor:
    """Per row of a 2-D view, some entry non-zero. On the CPU a fused L2 norm per row (4x cheaper than
    a max or |g|.sum there), with the rows it calls zero rechecked exactly (tiny squares underflow);
    elsewhere the sum of magnitudes, exact and branch-free."""
    if g.device.type != "cpu" or not g.is_floating_point():
        return _magnitude(g).sum(1) != 0
    nz: torch.Tensor = torch.linalg.vector_norm(g, 2, dim=1) != 0  # NaN != 0: a NaN row counts as non-zero
    if not _compiling() and not bool(nz.all()):  # a host read, free on the CPU (not while compiling: a break)
        zero = (~nz).nonzero().flatten()
        nz[zero] = (g[zero] != 0).any(1)
    return nz


def _zero_fractions(flags: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Fraction of False in each bool vector, in a few batched ops (one segment sum), not a few per tensor."""
    lengths = [f.numel() for f in flags]
    # output_size: the segment ids' length is known on the host (no data-dependent shape under torch.compile)
    seg = torch.repeat_interleave(torch.arange(len(flags)), torch.tensor(lengths), output_size=sum(lengths))
    ones = torch.cat([f if f.device == device else f.to(device) for f in flags]).to(torch.float64)
    nz = torch.zeros(len(flags), dtype=torch.float64, device=device)
    nz.index_add_(0, seg.to(device, non_blocking=True), ones)
    n = torch.tensor(lengths, dtype=torch.float64).to(device, non_blocking=True)
    return (n - nz) / n.clamp(min=1)


@dataclass
class Observed:
    """What one measured step added: the tensors (`Tracked.index`) whose evidence was updated, with a
    device flag each (1.0: now complete); on zero-count steps the fraction of all-zero gradient rows per
    step position ([n], NaN where none) and each position's per-row "non-zero" vector (this rank's rows)."""

    keys: list[int]
    done: torch.Tensor | None
    dead_frac: torch.Tensor | None
    rows: dict[int, torch.Tensor] = field(default_factory=dict)


_TRUE = torch.ones(1, dtype=torch.bool)


@functools.lru_cache(maxsize=256)
def _all_true(n: int) -> torch.Tensor:
    """Every slice non-zero, known on the host (CPU): a shared expanded view (read-only: never OR-ed into,
    a complete tensor is skipped from then on; an in-place op on it would raise, not corrupt)."""
    return _TRUE.expand(n)


@dataclass
class _Gathered:
    """One `SliceGrads.observe` call: its options, and what it gathers for the `Observed` it returns."""

    dead: bool  # a zero-count step: each position's all-zero-row fraction (and rows) too
    step: int | None  # the optimizer step when last steps are kept (`SliceGrads.last_rows`), else None
    keep_rows: bool
    device: torch.device
    host: bool  # numpy on the CPU, and not compiling
    local: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> this step's rows
    fresh: list[int] = field(default_factory=list)  # tensors with a device "complete" flag
    flags: list[torch.Tensor] = field(default_factory=list)
    fracs: list[torch.Tensor] = field(default_factory=list)  # per-row "non-zero" of the positions `frac_pos`
    frac_pos: list[int] = field(default_factory=list)
    dense_pos: list[int] = field(default_factory=list)  # zero-count steps: gradients with no all-zero row

    def result(self, n: int) -> Observed:
        """The `Observed` of `n` step positions."""
        dead_frac = None
        if self.dead:
            dead_frac = torch.full((n,), math.nan, dtype=torch.float64, device=self.device)
            if self.fracs:
                at = torch.tensor(self.frac_pos).to(self.device, non_blocking=True)
                dead_frac[at] = _zero_fractions(self.fracs, self.device)
            if self.dense_pos:
                dead_frac[torch.tensor(self.dense_pos).to(self.device, non_blocking=True)] = 0.0
        done_t = torch.cat(self.flags).to(torch.float64) if self.flags else None
        return Observed(self.fresh, done_t, dead_frac, self.local)


class SliceGrads:
    """The OR-accumulated evidence of every watched tensor, keyed by its `Tracked.index`."""

    def __init__(self) -> None:
        self.rows: dict[int, torch.Tensor] = {}  # bool [dim 0] (elements of a 1-D tensor)
        self.cols: dict[int, torch.Tensor] = {}  # bool [dim 1], tensors with 2+ dims
        self.full: set[int] = set()  # every slice seen non-zero: skipped from now on
        #: CPU tensors whose every row has had a non-zero gradient (known from a host read): only their
        #: columns are looked at from then on (a trained head over dead inputs never completes its columns)
        self.rows_full: set[int] = set()
        #: stopped slices (`gradlog.verdict.stopped_slices`): per slice, the last measured step (optimizer step)
        #: whose gradient was non-zero there, -1 for none (int32, on the gradient's device). Kept lazily: a
        #: tensor whose every slice was non-zero at a step, known on the host (its zero count, or the probe),
        #: only moves `all_at` (the last such step); its vectors are made at its first step with a zero slice.
        #: The slice's last step is max(vector, all_at).
        self.last_rows: dict[int, torch.Tensor] = {}
        self.last_cols: dict[int, torch.Tensor] = {}
        self.all_at: dict[int, int] = {}
        #: the evidence behind a stop (`gradlog.verdict.stopped_slices`), kept beside `last_rows` and as lazily:
        #: per tensor, how many measured steps it had a gradient at (`seen`); per slice, the ordinal (1-based,
        #: in `seen`) of its last non-zero one (`ord_rows`/`ord_cols`, 0 for none) and on how many of them it
        #: was non-zero (`hits_rows`/`hits_cols`, int32 on the gradient's device). A step at which every slice was
        #: non-zero, known on the host, only moves `all_seen` (its ordinal) and `all_hits` (their count): a
        #: slice's ordinal is max(vector, all_seen), its count vector + all_hits.
        self.seen: dict[int, int] = {}
        self.ord_rows: dict[int, torch.Tensor] = {}
        self.ord_cols: dict[int, torch.Tensor] = {}
        self.hits_rows: dict[int, torch.Tensor] = {}
        self.hits_cols: dict[int, torch.Tensor] = {}
        self.all_seen: dict[int, int] = {}
        self.all_hits: dict[int, int] = {}
        self.track_last = True  # False: only the never-had-a-gradient evidence (benchmarks' A/B)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in self._vectors() for t in d.values())

    def _vectors(self) -> tuple[dict[int, torch.Tensor], ...]:
        return (
            self.rows,
            self.cols,
            self.last_rows,
            self.last_cols,
            self.ord_rows,
            self.ord_cols,
            self.hits_rows,
            self.hits_cols,
        )

    def forget(self, key: int) -> None:
        """A tensor was freed (replaced): its evidence goes."""
        for d in self._vectors():
            d.pop(key, None)
        self.full.discard(key)
        self.rows_full.discard(key)
        for n in (self.all_at, self.seen, self.all_seen, self.all_hits):
            n.pop(key, None)

    def _mark_last(self, key: int, step: int, r_nz: torch.Tensor, c_nz: torch.Tensor | None) -> None:
        """This step's per-slice "non-zero" into the last-step, last-ordinal and count vectors (in place on the
        device, no sync)."""
        at = self.seen[key]
        for stores, nz in (
            ((self.last_rows, self.ord_rows, self.hits_rows), r_nz),
            ((self.last_cols, self.ord_cols, self.hits_cols), c_nz),
        ):
            if nz is None:
                continue
            last_s, ord_s, hits_s = stores
            last = last_s.get(key)
            if last is None or last.shape != nz.shape or last.device != nz.device:
                last = last_s[key] = torch.full(nz.shape, self.all_at.get(key, -1), dtype=torch.int32, device=nz.device)
                ord_s[key] = torch.full(nz.shape, self.all_seen.get(key, 0), dtype=torch.int32, device=nz.device)
                hits_s[key] = torch.zeros(nz.shape, dtype=torch.int32, device=nz.device)
            last.masked_fill_(nz, step)
            ord_s[key].masked_fill_(nz, at)
            hits_s[key].add_(nz)

    def observe(
        self,
        rows: list[Tracked],
        grads: list[torch.Tensor | None],
        dead: bool,
        device: torch.device,
        keep_rows: bool = True,
        dense: list[bool] | None = None,
        step: int | None = None,
    ) -> Observed:
        """OR this step's gradients into the evidence; see `Observed` for what comes back (`Observed.rows`
        only with `keep_rows`: sharded tensors need them, the others only their `dead_frac`). `dense[i]`:
        the caller knows gradient i has no zero entry (its zero count), so every slice of it is non-zero.
        `step` (the optimizer step): also keep each slice's last step with a non-zero gradient (`last_rows`),
        which needs this step's slices of every tensor, complete or not (on the CPU most are proven non-zero
        everywhere by their zero count or the probe, which costs a few reads)."""
        host = not _compiling()  # numpy on the CPU, except while torch.compile traces (looked up once)
        s = _Gathered(dead, step if self.track_last else None, keep_rows, device, host)
        probed = self._probed(s, rows, grads, dense) if host else set()
        for i, (row, g) in enumerate(zip(rows, grads)):
            if g is None or g.dim() == 0:  # a 0-D tensor has no slices: the whole-tensor report covers it
                continue
            track = row.index not in self.full
            if not track and not dead and s.step is None:
                continue
            g = local_tensor(g.detach() if g.requires_grad else g)
            if s.step is not None and g.numel():
                self.seen[row.index] = self.seen.get(row.index, 0) + 1
            known = host and g.device.type == "cpu" and ((dense is not None and dense[i]) or i in probed)
            self._observe_one(s, i, row.index, g, track, known)
        return s.result(len(rows))

    def _probed(
        self, s: _Gathered, rows: list[Tracked], grads: list[torch.Tensor | None], dense: list[bool] | None
    ) -> set[int]:
        """Positions of the tensors not yet complete whose few probe entries already prove every slice
        non-zero (not those whose rows are complete and columns not: dead inputs stay dead, a probe would
        fail)."""
        last = s.step is not None
        return _probe_complete(
            {
                i: local_tensor(g.detach() if g.requires_grad else g)
                for i, (row, g) in enumerate(zip(rows, grads))
                if g is not None
                and (s.dead or last or row.index not in self.full)
                and (last or row.index not in self.rows_full)
                and not (dense is not None and dense[i])
            }
        )

    def _observe_one(self, s: _Gathered, i: int, key: int, g: torch.Tensor, track: bool, known: bool) -> None:
        """One gradient (step position `i`, tensor `key`); `known`: every slice of it is non-zero, known on
        the host already; `track`: its never-had-a-gradient evidence is not complete yet."""
        last = s.step is not None
        if not known and track and not s.dead and not last and key in self.rows_full and g.dim() >= 2 and s.host:
            if self._columns_only(key, g):
                return
        hs = None if known or not s.host else _host_slices(g, need_cols=(track or last) and g.dim() >= 2)
        if hs is not None and hs[0].all() and (hs[1] is None or hs[1].all()):
            known = True  # every slice non-zero (columns too where tracked)
        if known:
            self._complete(s, i, key, g, track)
            return
        if hs is not None:
            r_nz = torch.from_numpy(hs[0])
            c_nz = torch.from_numpy(hs[1]) if hs[1] is not None else None
        else:
            r_nz, c_nz = slice_nonzero(g, rows_only=not (track or last))
        if s.step is not None and g.numel():
            self._mark_last(key, s.step, r_nz, c_nz)
        if s.dead:
            if s.keep_rows:
                s.local[i] = r_nz
            s.frac_pos.append(i)
            s.fracs.append(r_nz)
        if track:
            self._accumulate(s, key, r_nz, c_nz, host_read=hs is not None)

    def _columns_only(self, key: int, g: torch.Tensor) -> bool:
        """A CPU tensor whose every row has had a non-zero gradient: OR in its columns alone. False where
        that cannot be done (no columns kept yet, a new shape, no numpy view): the caller does it all."""
        acc = self.cols.get(key)
        c_nz = _host_cols(g) if acc is not None and self.rows[key].shape[0] == g.shape[0] else None
        if c_nz is None:
            return False
        self.cols[key] = c_nz if acc is None or acc.shape != c_nz.shape else acc.logical_or_(c_nz)
        if bool(self.cols[key].all()):  # a host read, free on this (CPU) path
            self.full.add(key)
        return True

    def _complete(self, s: _Gathered, i: int, key: int, g: torch.Tensor, track: bool) -> None:
        """Every slice of the gradient is non-zero, known on the host: complete from now on, no device flag."""
        if s.step is not None and g.numel():
            self.all_at[key] = s.step
            self.all_seen[key] = self.seen[key]
            self.all_hits[key] = self.all_hits.get(key, 0) + 1
        if s.dead:
            s.dense_pos.append(i)
            if s.keep_rows:
                s.local[i] = _all_true(g.shape[0])
        if track:  # complete, known on the host: skipped from now on, no device flag needed
            self.rows[key] = _all_true(g.shape[0])
            if g.dim() >= 2:
                self.cols[key] = _all_true(g.shape[1])
            self.full.add(key)

    def _accumulate(
        self, s: _Gathered, key: int, r_nz: torch.Tensor, c_nz: torch.Tensor | None, host_read: bool
    ) -> None:
        """OR this step's rows and columns into the tensor's evidence; whether it is now complete is known on
        the host for free on the CPU, else it rides as a device flag in the step's host copy."""
        acc = self.rows.get(key)
        fresh_rows = r_nz.clone() if s.dead and s.keep_rows else r_nz  # `local` keeps this step's own
        self.rows[key] = fresh_rows if acc is None or acc.shape != r_nz.shape else acc.logical_or_(r_nz)
        done = self.rows[key].all()
        if host_read:  # a free host read on this (CPU) path
            (self.rows_full.add if bool(done) else self.rows_full.discard)(key)
        if c_nz is not None:
            acc = self.cols.get(key)
            self.cols[key] = c_nz if acc is None or acc.shape != c_nz.shape else acc.logical_or_(c_nz)
            done = done & self.cols[key].all()
        if s.host and s.device.type == "cpu" and done.device.type == "cpu":
            if bool(done):  # known now, for free: no flag through the step's host copy
                self.full.add(key)
            return
        s.fresh.append(key)
        s.flags.append(done.reshape(1).to(s.device))

    def mark_done(self, keys: list[int], done: list[float]) -> None:
        """Host side, from the step's one copy: tensors whose every slice has had a non-zero gradient."""
        self.full.update(k for k, d in zip(keys, done) if d)
