"""Per-slice update evidence: which rows, columns and elements the optimizer itself moved.

A slice whose values at close equal its first ones (the ledger's per-slice fingerprints) either never got
an update that registered (a gradient of rounding noise: `tiny_update`, `below_precision`), or got one and
something outside the optimizer put the old values back: a mask re-applied to some rows of the saved
weights after each step (`w.data[mask] = w0[mask]`). Only the second is a bug, and only what the step
itself did tells them apart: the weights before the step minus those after it, which the measured step
already holds (`Meter.finish`: the snapshot becomes that difference in place).

Per slice, "some entry of the difference is non-zero" is OR-accumulated on the device (one sum of
magnitudes per tensor, exact: a difference of two floats is zero only when they are equal), read at close
with the other slice facts. It is gathered at a tensor's first `WATCHED` measured steps with a copy only,
and no more once every slice of it has moved (known on the host for free on the CPU): a bounded cost, paid
at the start of the run, never on the steady measured-step path. A mask that sets rows back from the first
step shows there; rows the optimizer first moves later are judged as before (`tiny_update`).

Slices set back to a value that is not their first one (``w.data.mul_(mask)`` after every step: the masked
rows are zero from the first mask on, the optimizer moves them, the mask zeroes them again) are found at the
same steps (the second and third: a slice set back to its first value is the first step's to find): the
signature of a slice's values before one watched step equal to the one before the previous watched step,
which moved it (`back`, `Signature`). Only something outside the optimizer puts a slice back bit for bit:
for rows and columns of many values at any two watched steps, for the elements of a 1-D tensor only at two
consecutive optimizer steps (an element moved by rounding noise may come back by itself over several).
A bounded start-of-run cost: a signature and the moved slices at those two steps, ~40 us each per small
tensor on one CPU thread (a 64x64 weight's copy is ~5 us).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from gradlog.measure.slice_grads import slice_nonzero

#: measured steps (with a copy of the weights) per tensor at which its per-slice moves are gathered
WATCHED = 3


@dataclass
class Signature:
    """One tensor's values, per slice: float64 sums weighted by fixed pseudo-random weights of its rows (or
    its elements, as they are, for a 1-D tensor) and columns. The same values give the same sums, bit for bit
    (the same ops in the same order), -0.0 and 0.0 alike; changed values, different sums but by chance (the
    weights are not in arithmetic progression: a move of +d, -d, -d, +d along a row, as Adam's first step
    makes, cancels in position-linear weights, as in `measure.fingerprint`'s row signatures)."""

    shape: tuple[int, ...]
    rows: torch.Tensor
    cols: torch.Tensor | None = None


@functools.lru_cache(maxsize=64)  # a model repeats its shapes: built once per length (64 x <= 8 bytes each)
def _weights(n: int, salt: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(0x5E7B4C + salt)
    return (torch.rand(n, generator=g, dtype=torch.float64) + 1.0).to(device)


def _signature(w: torch.Tensor) -> Signature:
    shape = tuple(w.shape)
    if w.dim() == 1:
        return Signature(shape, w.detach().clone())
    x = w.detach().reshape(shape[0], shape[1], -1).to(torch.float64)
    r, c, k = x.shape
    wr, wc, wk = _weights(r, 0, x.device), _weights(c, 1, x.device), _weights(k, 2, x.device)
    inner = x @ wk  # [R, C]
    return Signature(shape, inner @ wc, wr @ inner)


class SliceMoves:
    """The OR-accumulated "the optimizer moved this slice" of every watched tensor, keyed by `Tracked.index`,
    and the slices it moved that were set back to their values before that step (`back`)."""

    def __init__(self) -> None:
        self.rows: dict[int, torch.Tensor] = {}  # bool [dim 0] (elements of a 1-D tensor)
        self.cols: dict[int, torch.Tensor] = {}  # bool [dim 1], tensors with 2+ dims
        self.steps: dict[int, list[int]] = {}  # per tensor, the optimizer steps it was watched at, until full
        self._watched: dict[int, int] = {}  # per tensor, its watched steps (those after full included)
        self.full: set[int] = set()  # every slice moved (known on the host): nothing left to learn
        #: per tensor and pair of consecutive watched steps (k, k'), the slices moved at k whose values before k'
        #: are those before k (rows or elements, and columns; bool, on the device)
        self.back: dict[int, list[tuple[int, int, torch.Tensor, torch.Tensor | None]]] = {}
        #: per tensor, the rows (elements) and the columns moved at one watched step and still moved before the
        #: next (their values before it differ from those before that step): they kept an update, they learned
        self.kept_rows: dict[int, torch.Tensor] = {}
        self.kept_cols: dict[int, torch.Tensor] = {}
        #: per tensor, its last watched step, the signature of its values before it (`_signature`), what it moved
        self._last: dict[int, tuple[int, Signature, tuple[torch.Tensor, torch.Tensor | None] | None]] = {}

    def wanted(self, key: int) -> bool:
        """Whether tensor `key`'s update is still looked at per slice (its first `WATCHED` watched steps)."""
        return self._watched.get(key, 0) < WATCHED

    def before(self, step: int, keys: list[int], weights: list[torch.Tensor]) -> None:
        """The values before optimizer step `step` (the snapshot, before it becomes the difference): slices the
        previous watched step moved whose values are the same again were set back. On the device; what is
        kept between two watched steps is one float64 a row and a column (a 1-D tensor's values, as they are)."""
        for key, w in zip(keys, weights):
            if w.dim() == 0 or not w.numel() or not self._watched.get(key) or not w.is_floating_point():
                continue  # from the second watched step on: a slice set back to its first value is the
                # first step's to find (moved, and at close as it started), one set back to a later one is not
            if not self.wanted(key):
                continue
            sig = _signature(w)
            last = self._last.get(key)
            if last is not None and last[2] is not None and last[1].shape == sig.shape:
                self._set_back(key, last[0], step, last[1], sig, last[2])
            self._last[key] = (step, sig, None)

    def _set_back(
        self, key: int, was: int, step: int, a: Signature, b: Signature, moved: tuple[torch.Tensor, torch.Tensor | None]
    ) -> None:
        """Keep the slices moved at watched step `was` and the same before `step` (no host read: on the device)."""
        if len(a.shape) == 1 and step != was + 1:
            return  # elements: at consecutive steps only (see the module docstring)
        if a.rows.shape != moved[0].shape:
            return
        same = a.rows == b.rows
        _or_in(self.kept_rows, key, moved[0] & ~same)  # moved, and not back before the next watched step
        cols = None
        if moved[1] is not None and a.cols is not None and b.cols is not None and a.cols.shape == moved[1].shape:
            cols_same = a.cols == b.cols
            _or_in(self.kept_cols, key, moved[1] & ~cols_same)
            cols = moved[1] & cols_same
        # some slice the step moved stayed moved: a part was set back while the rest learned. Every moved one
        # back is the whole tensor put back (a checkpoint restored once, an LR finder's weights): the ledger's
        # streak, proven by fingerprints, judges that, not one pair of steps here (a device flag: no host read)
        partial = (moved[0] & ~same).any()
        cols = None if cols is None else cols & partial
        self.back.setdefault(key, []).append((was, step, moved[0] & same & partial, cols))

    def observe(self, step: int, keys: list[int], diffs: list[torch.Tensor]) -> None:
        """OR in the slices of `diffs` (before - after of each tensor `keys[i]`, on its device) that moved at
        optimizer step `step`; no host read except on the CPU, where it is free."""
        for key, d in zip(keys, diffs):
            if d.dim() == 0 or not d.numel() or not self.wanted(key):
                continue
            r_nz, c_nz = slice_nonzero(d)
            self._watched[key] = self._watched.get(key, 0) + 1
            last = self._last.get(key)
            if last is not None and last[0] == step:
                self._last[key] = (step, last[1], (r_nz, c_nz))
            if not self.wanted(key):
                self._last.pop(key, None)  # no later watched step to compare with
            if key in self.full:
                continue
            self.steps.setdefault(key, []).append(step)
            for store, nz in ((self.rows, r_nz), (self.cols, c_nz)):
                if nz is None:
                    continue
                acc = store.get(key)
                store[key] = nz if acc is None or acc.shape != nz.shape else acc.logical_or_(nz)
            if d.device.type == "cpu" and bool(self.rows[key].all()) and (c_nz is None or bool(self.cols[key].all())):
                self.full.add(key)

    def forget(self, key: int) -> None:
        """A tensor was freed (replaced): its evidence goes."""
        for store in (self.rows, self.cols, self.back, self._last, self.kept_rows, self.kept_cols):
            store.pop(key, None)
        self.steps.pop(key, None)
        self._watched.pop(key, None)
        self.full.discard(key)

    def kept(self, key: int, dim: int | None) -> torch.Tensor | None:
        """The slices of kind `dim` seen to keep an update from one watched step to the next, or None."""
        return (self.kept_cols if dim == 1 else self.kept_rows).get(key)

    def get(self, key: int, dim: int | None) -> torch.Tensor | None:
        """The slices of kind `dim` (0 rows or elements, 1 columns; None: elements) seen moved, or None
        where the tensor was never watched."""
        return (self.cols if dim == 1 else self.rows).get(key)

    def set_back(self, key: int) -> list[tuple[int, int, torch.Tensor, torch.Tensor | None]]:
        """Per pair of watched steps (k, k'), the slices (rows or elements, columns) moved at k and the same
        before k' as before k: set back outside the optimizer between them."""
        return self.back.get(key, [])


def _or_in(store: dict[int, torch.Tensor], key: int, flags: torch.Tensor) -> None:
    """OR `flags` into `store[key]` (a fresh start where the shape changed)."""
    was = store.get(key)
    store[key] = flags if was is None or was.shape != flags.shape else was | flags
