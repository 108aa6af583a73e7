"""Exact "never changed" without a copy of the weights: per-slice signatures of the raw bits.

A tensor's values are read as integers (their raw bits) and summed per slice: per row (dim 0)
and per column (dim 1) of tensors with 2+ dims, two sums each (plain, and weighted by a hash of
the position), kept modulo 2**32 (modulo 2**16 for 2-byte dtypes). A 1-D or 0-D tensor keeps
its raw bits, which are an exact fingerprint of each element. Any change of one value changes
its row's and its column's plain sum (the difference of two bit patterns is never a multiple of
the modulus); two changes that cancel in both sums are a 1-in-2**32 accident.

One pass does it all: the tensor is cut into slabs of whole rows small enough for the cache,
and each slab gives its rows' sums and adds to every column's sums. On the CPU the sums are
integer reductions and integer matrix-vector products (modular, so exact in any order); elsewhere
int64 sums, reduced to the same modulus, so a fingerprint taken on one device compares with one
taken on another. The whole-tensor answer is "any slice changed".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gradlog.measure.params import local_tensor

_SLAB_BYTES = 1 << 22  # rows read at a time (a view, no copy): the second and third read of a slab hit the cache
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MULT, _ADD = 2654435761, 40503  # Knuth's multiplicative hash of a position


@dataclass
class Fingerprint:
    """Signatures of one tensor's slices (int32, on the tensor's device).

    `rows` [R, 2] and `cols` [C, 2] for tensors with 2+ dims; `elems` (the raw bits, one row per
    element) for 1-D and 0-D tensors. `shape` guards against comparing different tensors.
    """

    shape: tuple[int, ...]
    rows: torch.Tensor | None = None
    cols: torch.Tensor | None = None
    elems: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.rows, self.cols, self.elems) if t is not None)

    @property
    def slices(self) -> int:
        """Rows plus columns (2+ dims), or elements (1-D)."""
        if self.elems is not None:
            return self.elems.shape[0]
        return sum(t.shape[0] for t in (self.rows, self.cols) if t is not None)


@dataclass
class Changes:
    """Which slices differ between two fingerprints of the same tensor (bool, on the device)."""

    rows: torch.Tensor | None = None
    cols: torch.Tensor | None = None
    elems: torch.Tensor | None = None

    def any(self) -> torch.Tensor:
        """One bool tensor (no host read): whether anything changed."""
        parts = [t.any().reshape(1) for t in (self.rows, self.elems) if t is not None]
        if not parts:
            return torch.zeros((), dtype=torch.bool)
        return parts[0][0] if len(parts) == 1 else torch.cat(parts).any()


def _hash(start: int, n: int, device: torch.device, modulus: int) -> torch.Tensor:
    """Odd weights for positions start..start+n (odd: multiplying by one is a bijection mod 2**k)."""
    pos = torch.arange(start, start + n, device=device, dtype=torch.int64)
    return ((pos * _MULT + _ADD) % modulus) | 1


def _wrap(z: torch.Tensor, modulus: int) -> torch.Tensor:
    """Exact integers (any int dtype, possibly already wrapped mod 2**32 or 2**16) -> int32 in [0, modulus)."""
    return (z.to(torch.int64) & (modulus - 1)).to(torch.int32)


def _lanes(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The raw bits of `t` as integers with a trailing lane dim, and the sums' modulus.

    4- and 8-byte values become int32 lanes (a change in the high half of a double is then never a
    multiple of 2**32); 2-byte values stay int16 (summed mod 2**16); 1-byte values and bools become int32.
    """
    t = local_tensor(t.detach())
    if t.is_complex():
        t = torch.view_as_real(t)
    t = t.contiguous()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    size = t.element_size()
    if size == 2:
        return t.view(torch.int16).unsqueeze(-1), 1 << 16
    if size == 1:
        return t.view(torch.uint8).to(torch.int32).unsqueeze(-1), 1 << 32
    return t.view(_INT_OF_SIZE[size]).unsqueeze(-1).view(torch.int32), 1 << 32


def _slab_rows(row_bytes: int) -> int:
    return max(1, _SLAB_BYTES // max(1, row_bytes))


def _sums_cpu(
    x: torch.Tensor, c: int, row0: int, w: torch.Tensor, modulus: int, scratch: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One slab [r, C*S] of int32/int16 bits: its rows' sums [r, 2] and its columns' sums [2, C].

    The weighted row sums are a multiply into a reused scratch and a row sum (twice as fast as an
    integer `mv`); both wrap in the bits' own width, which is exact modulo 2**32 / 2**16.
    """
    r = x.shape[0]
    itype = x.dtype
    weighted = torch.mul(x, w, out=scratch[: x.numel()].view(x.shape))
    rows = torch.stack([x.sum(1, dtype=torch.int32), weighted.sum(1, dtype=torch.int32)], dim=1)
    v = torch.stack([torch.ones(r, dtype=torch.int64), _hash(row0, r, x.device, modulus)]).to(itype)
    cols = torch.mm(v, x)  # [2, C*S], wrapped in the bits' own width: exact mod 2**32 / 2**16
    if cols.shape[1] != c:
        cols = cols.view(2, c, -1).sum(2, dtype=torch.int32)
    return rows, cols


def _sums_any(
    x: torch.Tensor, c: int, row0: int, w: torch.Tensor, modulus: int, scratch: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same sums with int64 elementwise ops (accelerators have no integer matmul)."""
    r = x.shape[0]
    x = x.to(torch.int64)
    rows = torch.stack([x.sum(1), (x * w).sum(1)], dim=1)
    v = _hash(row0, r, x.device, modulus).unsqueeze(1)
    cols = torch.stack([x.sum(0), (x * v).sum(0)])
    if cols.shape[1] != c:
        cols = cols.view(2, c, -1).sum(2)
    return rows, cols


@torch.no_grad()
def take(t: torch.Tensor, row_offset: int = 0, col_offset: int = 0, generic: bool = False) -> Fingerprint:
    """The fingerprint of `t` (its local shard under DTensor; offsets give its global position).

    `generic=True` forces the int64 path that accelerators use (tests compare the two).
    """
    shape = tuple(local_tensor(t).shape)
    bits, modulus = _lanes(t)
    if len(shape) < 2:
        n = shape[0] if shape else 1
        flat = bits.reshape(n, -1) if n else bits.new_zeros((0, 1))
        return Fingerprint(shape, elems=flat.clone())
    r, c = shape[0], shape[1]
    dev = bits.device
    k = bits.numel() // r if r else 0
    x = bits.reshape(r, k)
    s = k // c if c else 0
    rows = torch.zeros(r, 2, dtype=torch.int32, device=dev)
    cols = torch.zeros(2, c, dtype=torch.int64, device=dev)
    if x.numel():
        # weight of each position in a row: its global column, then its place inside that column
        w = _hash(col_offset * s, k, dev, modulus)
        cpu = dev.type == "cpu" and not generic
        sums = _sums_cpu if cpu else _sums_any
        step = _slab_rows(k * x.element_size())
        scratch = torch.empty(min(r, step) * k if cpu else 0, dtype=x.dtype, device=dev)
        w = w.to(x.dtype) if cpu else w
        for start in range(0, r, step):
            part_rows, part_cols = sums(x[start : start + step], c, row_offset + start, w, modulus, scratch)
            rows[start : start + step] = _wrap(part_rows, modulus)
            cols += part_cols.to(torch.int64) & (modulus - 1)
    return Fingerprint(shape, rows=_wrap(rows, modulus), cols=_wrap(cols.t(), modulus).contiguous())


def changes_since(first: Fingerprint, t: torch.Tensor) -> Changes | None:
    """Which slices of `t` changed since `first` was taken; None when `t` has another shape now.

    1-D and 0-D tensors are compared with their kept bits directly (no second copy at close).
    """
    if tuple(local_tensor(t).shape) != first.shape:
        return None
    if first.elems is None:
        return compare(first, take(t))
    bits, _ = _lanes(t)
    now = bits.reshape(first.elems.shape)
    diff = now != first.elems.to(now.device)
    return Changes(elems=diff[:, 0] if diff.shape[1] == 1 else diff.any(1))


def compare(first: Fingerprint, now: Fingerprint) -> Changes:
    """Which slices changed from `first` to `now` (device tensors; moved to `now`'s device)."""
    if first.shape != now.shape:
        raise ValueError(f"fingerprints of different shapes {first.shape} and {now.shape}; the tensor was replaced")

    def diff(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
        if a is None or b is None:
            return None
        d = a.to(b.device) != b  # [n, k] signatures -> [n]
        return d[:, 0] if d.shape[1] == 1 else d.any(1)

    return Changes(diff(first.rows, now.rows), diff(first.cols, now.cols), diff(first.elems, now.elems))
