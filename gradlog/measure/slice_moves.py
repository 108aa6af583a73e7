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
"""

from __future__ import annotations

import torch

from gradlog.measure.slice_grads import slice_nonzero

#: measured steps (with a copy of the weights) per tensor at which its per-slice moves are gathered
WATCHED = 3


class SliceMoves:
    """The OR-accumulated "the optimizer moved this slice" of every watched tensor, keyed by `Tracked.index`."""

    def __init__(self) -> None:
        self.rows: dict[int, torch.Tensor] = {}  # bool [dim 0] (elements of a 1-D tensor)
        self.cols: dict[int, torch.Tensor] = {}  # bool [dim 1], tensors with 2+ dims
        self.steps: dict[int, list[int]] = {}  # per tensor, the optimizer steps it was watched at
        self.full: set[int] = set()  # every slice moved (known on the host): nothing left to learn

    def wanted(self, key: int) -> bool:
        """Whether tensor `key`'s update is still looked at per slice."""
        return key not in self.full and len(self.steps.get(key, ())) < WATCHED

    def observe(self, step: int, keys: list[int], diffs: list[torch.Tensor]) -> None:
        """OR in the slices of `diffs` (before - after of each tensor `keys[i]`, on its device) that moved at
        optimizer step `step`; no host read except on the CPU, where it is free."""
        for key, d in zip(keys, diffs):
            if d.dim() == 0 or not d.numel() or not self.wanted(key):
                continue
            r_nz, c_nz = slice_nonzero(d)
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
        for store in (self.rows, self.cols):
            store.pop(key, None)
        self.steps.pop(key, None)
        self.full.discard(key)

    def get(self, key: int, dim: int | None) -> torch.Tensor | None:
        """The slices of kind `dim` (0 rows or elements, 1 columns; None: elements) seen moved, or None
        where the tensor was never watched."""
        return (self.cols if dim == 1 else self.rows).get(key)
