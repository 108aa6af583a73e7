"""Exact "never changed" without a copy of the weights: per-slice signatures of the raw bits.

A tensor's values are read as integers (their raw bits) and summed per slice: per row (dim 0)
and per column (dim 1) of tensors with 2+ dims, two sums each (plain, and weighted by a hash of
the position), kept modulo 2**32 (modulo 2**16 for 2-byte dtypes). A 1-D or 0-D tensor keeps
its raw bits, which are an exact fingerprint of each element. Any change of one value changes
its row's and its column's plain sum (the difference of two bit patterns is never a multiple of
the modulus), and a swap inside a row or column changes its weighted sum; two changes that cancel
in both sums are a 1-in-2**32 accident for arbitrary values. One structured exception: changes of
the top bit only (x -> -x) in an even number of entries of one row cancel in both of that row's sums
(2**31 times an even number); each of their columns still sees its single change.

One pass does it all: the tensor is cut into slabs of whole rows that fit in L2, and each slab
gives its rows' sums (`slab @ [1, w]^T`) and adds to every column's sums (`[1, v] @ slab`): two
integer matrix products, which wrap in the bits' own width (exact modulo 2**32 / 2**16 in any
order). Elsewhere int64 sums, reduced to the same modulus, so a fingerprint taken on one device
compares with one taken on another. The whole-tensor answer is "any slice changed". Measured
against `tensor.sum()` in benchmarks/fingerprint.py.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gradlog.measure.hostmem import host_copy
from gradlog.measure.params import local_tensor
from gradlog.measure.stats import _compiling

_SLAB_BYTES = 1 << 20  # rows read at a time (a view, no copy): L2-sized, so the second read of a slab hits it
_MULT, _ADD = 2654435761, 40503  # Knuth's multiplicative hash of a position
_CACHED_WEIGHTS = 1 << 16  # positions; longer weight vectors are built per call (O(n), against O(n * k) sums)
_SMALL = 1 << 12  # elements: below this, one plain op beats a faster kernel that takes several
_CHUNK = 1 << 18  # elements compared at a time at close (1-D): the mask lands in L2, not in fresh memory


@dataclass
class Fingerprint:
    """Signatures of one tensor's slices (int32; int16 for 2-byte dtypes, on the tensor's device).

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
        parts = [t for t in (self.rows, self.elems) if t is not None]
        if not parts:
            return torch.zeros((), dtype=torch.bool)
        if len(parts) == 1:
            return _any(parts[0])
        return torch.stack([_any(t) for t in parts]).any()


def _any(t: torch.Tensor) -> torch.Tensor:
    """`t.any()` for a bool vector, fast on the CPU: torch's bool `any` is ~5x a float sum per element
    there, the max of its bytes is vectorised; an expanded vector (stride 0) is one value."""
    if t.dim() == 1 and t.numel() and t.stride(0) == 0:
        t = t[:1]
    if t.numel() > _SMALL and t.device.type == "cpu" and t.dtype == torch.bool:
        return t.view(torch.uint8).amax().bool()
    return t.any()


def _hash(start: int, n: int, device: torch.device, modulus: int) -> torch.Tensor:
    """Odd weights for positions start..start+n (odd: multiplying by one is a bijection mod 2**k)."""
    pos = torch.arange(start, start + n, device=device, dtype=torch.int64)
    return ((pos * _MULT + _ADD) % modulus) | 1


def _wrap(z: torch.Tensor, modulus: int) -> torch.Tensor:
    """Exact integers (any int dtype, possibly already wrapped mod 2**32 or 2**16) -> their residue in the
    modulus' own width: int32 for 2**32, int16 for 2**16 (two's complement, so sums already wrapped in that
    width are returned as they are, and every device's path gives the same bits)."""
    itype = torch.int32 if modulus == 1 << 32 else torch.int16
    if z.dtype == itype:
        return z
    return (z.to(torch.int64) & (modulus - 1)).to(itype)


def _bits(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The raw bits of `t` (a local tensor) as a flat int tensor, and the sums' modulus.

    4- and 8-byte values become int32 lanes (a change in the high half of a double is then never a
    multiple of 2**32); 2-byte values stay int16 (summed mod 2**16); 1-byte values and bools become int32.
    """
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if not t.is_contiguous():
        t = t.contiguous()
    size = t.element_size()
    if size == 4:
        return t.view(torch.int32).view(-1), 1 << 32
    if size == 2:
        return t.view(torch.int16).view(-1), 1 << 16
    if size == 1:
        return t.view(torch.uint8).view(-1).to(torch.int32), 1 << 32
    return t.view(-1).view(torch.int32), 1 << 32  # 8 bytes: two int32 lanes each


def _slab_rows(row_bytes: int) -> int:
    return max(1, _SLAB_BYTES // max(1, row_bytes))


def _weights(
    start: int, n: int, itype: torch.dtype, device: torch.device, modulus: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[2, n] in the bits' own int type (ones, and the position hashes) and its transposed view. Short ones
    are cached (a model repeats its shapes, and for a small tensor building them costs more than the sums)."""
    if n <= _CACHED_WEIGHTS:
        return _weights_cached(start, n, itype, device, modulus)
    return _weights_new(start, n, itype, device, modulus)


def _weights_new(
    start: int, n: int, itype: torch.dtype, device: torch.device, modulus: int
) -> tuple[torch.Tensor, torch.Tensor]:
    ones = torch.ones(n, dtype=torch.int64, device=device)
    w = torch.stack([ones, _hash(start, n, device, modulus)]).to(itype)
    return w, w.t()  # [n, 2] as a view: an integer `mm` with a contiguous [n, 2] operand is ~50x slower


_weights_cached = functools.lru_cache(maxsize=64)(_weights_new)  # at most 64 x 512 KiB


#: Called on each piece of a tensor's values (flat views) while the fingerprint compare has it in cache
#: (`stats.Reads.add`): every piece of the tensor, in order, or none.
PieceFn = Callable[[torch.Tensor], None]


def _sums_cpu(
    x: torch.Tensor, row0: int, col0: int, modulus: int, piece: tuple[PieceFn, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """All four sums of [R, K] int32/int16 bits as two integer matrix products per slab of rows.

    Rows: `slab @ [1, w]^T` gives each row's plain and weighted sum in one read of the slab; columns:
    `[1, v] @ slab` both column sums in a second read, from L2. Integer products wrap in the bits' own
    width, which is exact modulo 2**32 / 2**16 in any order. (The previous scheme, a row sum, a
    multiply into a scratch and a second row sum, then the column product, read each slab four times.)
    `piece`: (fn, the values [R, ...] whose bits x is): fn gets each slab's values, flat, after its sums,
    from L2 (`changes_all`).
    """
    r, k = x.shape
    itype = x.dtype
    w = _weights(col0, k, itype, x.device, modulus)[1]
    v = _weights(row0, r, itype, x.device, modulus)[0]
    step = _slab_rows(k * x.element_size())
    if step >= r:
        out = torch.mm(x, w), torch.mm(v, x)
        if piece is not None:
            piece[0](piece[1].reshape(-1))
        return out
    rows = torch.empty(r, 2, dtype=itype, device=x.device)
    cols = torch.zeros(2, k, dtype=itype, device=x.device)
    for start in range(0, r, step):
        slab = x[start : start + step]
        torch.mm(slab, w, out=rows[start : start + step])
        cols.add_(torch.mm(v[:, start : start + step], slab))
        if piece is not None:
            piece[0](piece[1][start : start + step].reshape(-1))
    return rows, cols


def _sums_any(x: torch.Tensor, row0: int, col0: int, modulus: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same sums with int64 elementwise ops (accelerators have no integer matmul), by slabs."""
    r, k = x.shape
    rows = torch.zeros(r, 2, dtype=torch.int64, device=x.device)
    cols = torch.zeros(2, k, dtype=torch.int64, device=x.device)
    w = _hash(col0, k, x.device, modulus)
    step = _slab_rows(k * 8)
    for start in range(0, r, step):
        slab = x[start : start + step].to(torch.int64)
        v = _hash(row0 + start, slab.shape[0], x.device, modulus).unsqueeze(1)
        rows[start : start + step] = torch.stack([slab.sum(1), (slab * w).sum(1)], dim=1) & (modulus - 1)
        cols += torch.stack([slab.sum(0), (slab * v).sum(0)]) & (modulus - 1)
    return rows, cols


def take(t: torch.Tensor, row_offset: int = 0, col_offset: int = 0, generic: bool = False) -> Fingerprint:
    """The fingerprint of `t` (its local shard under DTensor; offsets give its global position).

    `generic=True` forces the int64 path that accelerators use (tests compare the two).
    """
    t = local_tensor(t)
    shape = tuple(t.shape)
    bits, modulus = _bits(t)
    if len(shape) < 2:
        n = shape[0] if shape else 1
        if not n:
            return Fingerprint(shape, elems=bits.new_zeros((0, 1)))
        kept = bits.view(n, -1)
        return Fingerprint(shape, elems=host_copy(kept) if kept.device.type == "cpu" else kept.clone())
    r, c = shape[0], shape[1]
    if not bits.numel():
        zeros = torch.zeros(r, 2, dtype=torch.int32, device=bits.device)
        return Fingerprint(shape, rows=zeros, cols=torch.zeros(c, 2, dtype=torch.int32, device=bits.device))
    rows, cols = _signatures(t, row_offset, col_offset, generic, (bits, modulus))
    return Fingerprint(shape, rows=rows, cols=cols.t().contiguous())


_BATCH_BYTES = 1 << 16  # take_all: tensors up to this size are fingerprinted many of one shape at a time
_STACK_BYTES = 1 << 20  # ... in stacks of at most this many bytes


def take_all(ts: Sequence[torch.Tensor]) -> list[Fingerprint]:
    """`take` of each tensor; plain CPU tensors of one shape and dtype up to 64 kB are taken many at a time.

    Why: a model of thousands of small layers spent its construction on per-tensor calls (five torch calls
    and their views for each 32x32 weight cost ~3x its `sum()`). A stack of same-shape bits gives every
    tensor's row and column sums in two batched integer products, which wrap exactly as `take`'s per-tensor
    products do: the same bits. The fingerprints are views of the stack's results."""
    out: list[Fingerprint | None] = [None] * len(ts)
    for shape, part in _stacks(ts, [_stackable(t) for t in ts]):
        for i, fp in zip(part, _take_stacked([ts[i] for i in part], shape)):
            out[i] = fp
    return [fp if fp is not None else take(t) for fp, t in zip(out, ts)]


def _stacks(ts: Sequence[torch.Tensor], eligible: list[bool]) -> Iterator[tuple[tuple[int, ...], list[int]]]:
    """Positions of the eligible tensors, by shape and dtype, in stacks of at most `_STACK_BYTES` (a shape
    and dtype only one tensor has is left to the per-tensor path)."""
    groups: dict[tuple[tuple[int, ...], torch.dtype], list[int]] = {}
    if not _compiling():
        for i, (t, ok) in enumerate(zip(ts, eligible)):
            if ok:
                groups.setdefault((tuple(t.shape), t.dtype), []).append(i)
    for (shape, _), idx in groups.items():
        if len(idx) < 2:
            continue
        per = max(2, _STACK_BYTES // (ts[idx[0]].numel() * ts[idx[0]].element_size()))
        for start in range(0, len(idx), per):
            yield shape, idx[start : start + per]


def _stacked(ts: list[torch.Tensor], shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """Signatures of same-shape, same-dtype CPU tensors (each one slab: at most 64 kB) from one stack of
    their bits: (elems [g, n, lanes],) for 1-D, else (rows [g, R, 2], cols [g, C, 2])."""
    lanes = [_bits(t) for t in ts]
    modulus = lanes[0][1]
    stack = torch.stack([b for b, _ in lanes])  # [g, numel] (x lanes): one copy
    if len(shape) < 2:
        return (stack.view(len(ts), shape[0], -1),)
    r, c = shape[0], shape[1]
    x = stack.view(len(ts), r, -1)
    k = x.shape[2]
    w = _weights(0, k, x.dtype, x.device, modulus)[1]
    v = _weights(0, r, x.dtype, x.device, modulus)[0]
    rows = torch.matmul(x, w)  # [g, r, 2]
    cols = torch.matmul(v, x)  # [g, 2, k]
    if k != c:
        cols = cols.view(len(ts), 2, c, -1).sum(3, dtype=cols.dtype)
    return _wrap(rows, modulus), _wrap(cols, modulus).transpose(1, 2).contiguous()


def _take_stacked(ts: list[torch.Tensor], shape: tuple[int, ...]) -> list[Fingerprint]:
    """`take` of same-shape, same-dtype CPU tensors; the fingerprints are views of `_stacked`'s results."""
    got = _stacked(ts, shape)
    if len(got) == 1:
        return [Fingerprint(shape, elems=e) for e in got[0].unbind(0)]
    rows, cols = got
    return [Fingerprint(shape, rows=a, cols=b) for a, b in zip(rows.unbind(0), cols.unbind(0))]


def _changed_stacked(firsts: list[Fingerprint], ts: list[torch.Tensor], shape: tuple[int, ...]) -> list[Changes]:
    """`changes_since` of same-shape, same-dtype CPU tensors: their signatures and the first ones stacked,
    compared in one `!=` per kind (a slice changed where either of its two sums, or any lane, differs)."""

    def differ(kept: list[torch.Tensor | None], now: torch.Tensor) -> list[torch.Tensor]:
        d = torch.ne(torch.stack(kept), now)  # type: ignore[arg-type]
        flat = d[..., 0] if d.shape[-1] == 1 else torch.logical_or(d[..., 0], d[..., 1])
        return list(flat.unbind(0))

    got = _stacked(ts, shape)
    if len(got) == 1:
        return [Changes(elems=e) for e in differ([f.elems for f in firsts], got[0])]
    rows = differ([f.rows for f in firsts], got[0])
    cols = differ([f.cols for f in firsts], got[1])
    return [Changes(rows=a, cols=b) for a, b in zip(rows, cols)]


def _signatures(
    t: torch.Tensor,
    row_offset: int = 0,
    col_offset: int = 0,
    generic: bool = False,
    lanes: tuple[torch.Tensor, int] | None = None,
    piece: PieceFn | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [R, 2] and columns [2, C] (residues in the modulus' width) of a non-empty local tensor with 2+ dims.
    `piece`: called on every slab of `t`'s values (contiguous `t`, CPU path only; see `changes_all`)."""
    bits, modulus = lanes or _bits(t)
    r, c = t.shape[0], t.shape[1]
    x = bits.view(r, -1)
    k = x.shape[1]
    # weight of each position in a row: its global column, then its place inside that column
    cpu = bits.device.type == "cpu" and not generic
    if cpu:
        values = (piece, t.view(r, -1)) if piece is not None and t.is_contiguous() else None
        rows, cols = _sums_cpu(x, row_offset, col_offset * (k // c), modulus, values)
    else:
        rows, cols = _sums_any(x, row_offset, col_offset * (k // c), modulus)
    if k != c:
        cols = cols.view(2, c, -1).sum(2, dtype=cols.dtype)  # wraps in the same width: still exact
    return _wrap(rows, modulus), _wrap(cols, modulus)


def _differ(a: torch.Tensor, b: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Per slice, whether its two signatures differ ([n, 2] with dim 1, [2, n] with dim 0); a contiguous
    [n, 2] pair of int32 (int16) is compared at once as one int64 (int32)."""
    a = a if a.device == b.device else a.to(b.device)
    pair = {torch.int32: torch.int64, torch.int16: torch.int32}.get(a.dtype)
    if dim == 1 and pair is not None and a.dtype == b.dtype and a.stride() == b.stride() == (2, 1):  # one row: (1, 1)
        return torch.ne(a.view(pair), b.view(pair)).view(-1)
    d = torch.ne(a, b)
    return torch.logical_or(d[0], d[1]) if dim == 0 else torch.logical_or(d[:, 0], d[:, 1])  # bool any is slow


_LOCAL = threading.local()


def _scratch(dtype: torch.dtype) -> torch.Tensor:
    """A reused 1 MiB-ish buffer per thread and dtype: fresh memory costs its page faults (~10x a read)."""
    bufs: dict[torch.dtype, torch.Tensor] = _LOCAL.__dict__.setdefault("bufs", {})
    buf = bufs.get(dtype)
    if buf is None:
        buf = bufs[dtype] = torch.empty(_CHUNK, dtype=dtype)
    return buf


def changes_since(first: Fingerprint, t: torch.Tensor, piece: PieceFn | None = None) -> Changes | None:
    """Which slices of `t` changed since `first` was taken; None when `t` has another shape now.

    1-D and 0-D tensors are compared with their kept bits directly (no second copy at close). `piece`: see
    `changes_all`.
    """
    t = local_tensor(t)
    if tuple(t.shape) != first.shape:
        return None
    if first.elems is None:
        if first.rows is None or first.cols is None or not t.numel():
            return compare(first, take(t))
        rows, cols = _signatures(t, piece=piece)  # compared as they come out: no [C, 2] copy of the columns
        return Changes(_differ(first.rows, rows), _differ(first.cols.t(), cols, dim=0))
    bits, _ = _bits(t)
    kept = first.elems if first.elems.device == bits.device else first.elems.to(bits.device)
    if bits.device.type == "cpu" and bits.numel() and not _compiling():
        if kept.shape[1] == 1:
            found = Changes(elems=_elems_changed(bits, kept.view(-1)))
        else:
            found = Changes(elems=_elems_changed(_one_lane(bits.view(kept.shape)), _one_lane(kept)))
        if piece is not None and t.is_contiguous():  # a vector: most fit in L2, and were just compared
            flat = t.view(-1)
            for start in range(0, flat.numel(), _CHUNK):
                piece(flat[start : start + _CHUNK])
        return found
    diff = bits.view(kept.shape) != kept
    return Changes(elems=diff[:, 0] if diff.shape[1] == 1 else diff.any(1))


def _stackable(t: torch.Tensor) -> bool:
    """A plain CPU tensor of 1+ dims and at most 64 kB: `_stacked` takes it with others of its shape."""
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.device.type == "cpu"
        and t.dim() >= 1
        and 0 < t.numel() * t.element_size() <= _BATCH_BYTES
    )


def _comparable(f: Fingerprint, t: torch.Tensor) -> bool:
    """`f` has the parts `_stacked` gives for `t` (same shape, kind and integer type), on the CPU."""
    kept = f.elems if t.dim() == 1 else f.rows
    if tuple(t.shape) != f.shape or kept is None or (t.dim() > 1 and f.cols is None):
        return False
    if kept.dtype != (torch.int16 if t.element_size() == 2 else torch.int32):
        return False
    return all(x is None or x.device.type == "cpu" for x in (f.rows, f.cols, f.elems))


def changes_all(
    firsts: Sequence[Fingerprint], ts: Sequence[torch.Tensor], pieces: Sequence[PieceFn | None] | None = None
) -> list[Changes | None]:
    """`changes_since` of each pair; plain CPU tensors of one shape and dtype up to 64 kB are compared many
    at a time, their signatures taken from one stack (as `take_all` does at construction): a model of
    thousands of small layers spent close() on per-tensor calls. Same answers, slice for slice.

    `pieces[i]` (CPU, contiguous tensors compared one by one): called on every cache-sized piece of `ts[i]`'s
    values (flat views, in order) right after the compare read it, so that a measured step reads a weight it
    did not copy once (`stats.Reads`: its range and norm); a tensor compared another way gets no call."""
    out: list[Changes | None] = [None] * len(ts)
    for shape, part in _stacks(ts, [_stackable(t) and _comparable(f, t) for f, t in zip(firsts, ts)]):
        for i, ch in zip(part, _changed_stacked([firsts[i] for i in part], [ts[i] for i in part], shape)):
            out[i] = ch
    fns = pieces if pieces is not None else [None] * len(ts)
    return [ch if ch is not None else changes_since(f, t, fn) for ch, f, t, fn in zip(out, firsts, ts, fns)]


def _one_lane(bits: torch.Tensor) -> torch.Tensor:
    """[n, 2] int32 lanes (8-byte values) -> [n] int64, one integer per element."""
    return bits.contiguous().view(torch.int64).view(-1)


def _elems_changed(now: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Per element of a 1-D CPU tensor, whether its bits differ from the kept ones (exact: integer `!=`).

    numpy's integer `!=` writes the bool mask in one vectorised pass (torch's int16/int32 `!=` is not
    vectorised on the CPU: ~10x a sum), into a reused cache-sized scratch, a chunk at a time. A tensor
    whose every element changed (or none did) answers with one expanded bool and no fresh memory: a
    fresh n-byte mask costs its page faults, ~2.5x a sum of fp32 values on its own.
    """
    n = now.shape[0]
    a, b = now.numpy(), kept.numpy()
    if n <= _CHUNK:  # one pass; below this size the fixed cost per call rules
        mask = np.not_equal(a, b)
        changed = int(np.count_nonzero(mask))  # one vectorised call: none, all, or some changed
        if changed in (0, n):
            return torch.full((1,), changed > 0, dtype=torch.bool).expand(n)
        return torch.from_numpy(mask)
    flags = _scratch(torch.bool).numpy()
    dense: torch.Tensor | None = None
    dense_np = flags
    uniform: bool | None = None  # every element so far changed (True), none did (False)
    for start in range(0, n, _CHUNK):
        m = min(_CHUNK, n - start)
        if dense is not None:  # past the first mixed chunk: straight into the result
            np.not_equal(a[start : start + m], b[start : start + m], out=dense_np[start : start + m])
            continue
        f = np.not_equal(a[start : start + m], b[start : start + m], out=flags[:m])
        changed = int(np.count_nonzero(f))
        same = changed > 0 if changed in (0, m) else None
        if dense is None and same is not None and uniform in (None, same):
            uniform = same
            continue
        dense = torch.empty(n, dtype=torch.bool)  # the first mixed chunk: write out what the earlier ones were
        dense_np = dense.numpy()
        dense_np[:start] = bool(uniform)
        dense_np[start : start + m] = f
    if dense is not None:
        return dense
    return torch.full((1,), bool(uniform), dtype=torch.bool).expand(n)


def compare(first: Fingerprint, now: Fingerprint) -> Changes:
    """Which slices changed from `first` to `now` (device tensors; moved to `now`'s device)."""
    if first.shape != now.shape:
        raise ValueError(f"fingerprints of different shapes {first.shape} and {now.shape}; the tensor was replaced")

    def diff(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
        if a is None or b is None:
            return None
        if a.shape[1] == 1:
            return torch.ne(a if a.device == b.device else a.to(b.device), b)[:, 0]
        return _differ(a, b)

    return Changes(diff(first.rows, now.rows), diff(first.cols, now.cols), diff(first.elems, now.elems))
