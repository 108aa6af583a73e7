"""Per-tensor evidence gathered over the whole run, for the diagnosis at close.

The starting values of every tensor are kept as per-slice fingerprints (`measure/fingerprint.py`):
at most 8 bytes per row and per column, or the raw bits of each element of a 1-D tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gradlog.measure.fingerprint import Changes, Fingerprint, changes_since, take
from gradlog.measure.meter import Measurement
from gradlog.measure.params import Tracked, is_materialized
from gradlog.verdict.report import NonFinite


@dataclass
class Evidence:
    """What the measured steps showed about one tensor."""

    measured: int = 0
    grad_none: int = 0
    grad_zero: int = 0
    grad_nonfinite: int = 0
    grad_ok: int = 0  # finite, not all zero, on a step the optimizer did not skip
    lr_zero: int = 0  # measured steps whose param group had lr 0
    skipped: int = 0  # steps with a gradient that the optimizer skipped
    stalled: int = 0  # finite non-zero grad, lr > 0, not skipped, yet a zero update
    updated: int = 0  # measured steps with a non-zero update
    first_fp: Fingerprint | None = None  # per-slice signatures of the values when first seen
    dtype: str = ""


class Ledger:
    """Feeds on each `Measurement`; holds only counters and fingerprints, never tensor copies."""

    def __init__(self) -> None:
        self.evidence: dict[int, Evidence] = {}
        self.measured_steps = 0
        self.skipped_steps = 0
        self.first_nonfinite: NonFinite | None = None
        #: filled by `changed`: per tensor, which rows/columns/elements differ from their first values (host)
        self.slice_changes: dict[int, Changes] = {}

    def _ev(self, row: Tracked) -> Evidence:
        ev = self.evidence.get(row.index)
        if ev is None:
            ev = self.evidence[row.index] = Evidence(dtype=str(row.param.dtype).replace("torch.", ""))
        return ev

    def fingerprint_new(self, rows: list[Tracked]) -> None:
        """Remember the starting values of tensors seen materialised for the first time."""
        for r in rows:
            ev = self._ev(r)
            if ev.first_fp is None and is_materialized(r.param):
                ev.first_fp = take(r.param)

    @property
    def nbytes(self) -> int:
        """Bytes held for the fingerprints (tests check the per-slice budget)."""
        return sum(ev.first_fp.nbytes for ev in self.evidence.values() if ev.first_fp is not None)

    def observe(self, m: Measurement) -> None:
        self.measured_steps += 1
        # GradScaler skips that fired no hook are only known through the running total
        self.skipped_steps = m.skipped_total if m.skipped_total is not None else self.skipped_steps + m.skipped
        nonzero = m.grad[:, 1].tolist()
        nonfinite = m.grad[:, 2].tolist()
        upd = m.update_sumsq.tolist() if m.update_sumsq is not None else None
        for i, row in enumerate(m.rows):
            ev = self._ev(row)
            ev.measured += 1
            if upd is not None and upd[i] > 0 and not m.skipped:
                ev.updated += 1
            if row.group is not None and m.lr[i] == 0:
                ev.lr_zero += 1
            if not m.has_grad[i]:
                ev.grad_none += 1
                continue
            if nonfinite[i] > 0:
                ev.grad_nonfinite += 1
                if self.first_nonfinite is None and not m.skipped:  # a GradScaler overflow skip is routine
                    self.first_nonfinite = NonFinite(step=m.index, name=row.name, count=int(nonfinite[i]))
            if m.skipped:
                ev.skipped += 1
                continue
            if nonfinite[i] > 0:
                continue
            if nonzero[i] == 0:
                ev.grad_zero += 1
                continue
            ev.grad_ok += 1
            lr = m.lr[i]
            if upd is not None and row.group is not None and lr is not None and lr > 0 and upd[i] == 0:
                ev.stalled += 1

    def changed(self, rows: list[Tracked]) -> dict[int, bool]:
        """Whether each tensor's value differs from its first fingerprint; keeps which slices did in
        `slice_changes`. One host copy of all the flags together."""
        live: list[Tracked] = []
        diffs: list[Changes] = []
        out: dict[int, bool] = {}
        for r in rows:
            first = self._ev(r).first_fp
            if first is None or not is_materialized(r.param):
                continue
            ch = changes_since(first, r.param)
            if ch is None:  # resized in place (resize_, a new vocabulary): it changed
                out[r.index] = True
                continue
            live.append(r)
            diffs.append(ch)
        parts = [t for ch in diffs for t in (ch.rows, ch.cols, ch.elems) if t is not None]
        host = torch.cat([p.to(parts[0].device) for p in parts]).cpu() if parts else torch.zeros(0, dtype=torch.bool)
        at = 0
        self.slice_changes = {}
        for r, ch in zip(live, diffs):
            got: list[torch.Tensor | None] = []
            for t in (ch.rows, ch.cols, ch.elems):
                if t is None:
                    got.append(None)
                    continue
                got.append(host[at : at + t.numel()])
                at += t.numel()
            host_ch = Changes(*got)
            self.slice_changes[r.index] = host_ch
            out[r.index] = bool(host_ch.any())
        for r in rows:
            if self._ev(r).updated:
                out[r.index] = True
        return out
