"""Per-tensor evidence gathered over the whole run, for the diagnosis at close."""

from __future__ import annotations

from dataclasses import dataclass

from gradlog.measure.fingerprint import fingerprints
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
    first_fp: tuple[int, int] | None = None
    trainable_at_start: bool | None = None  # requires_grad when first fingerprinted
    dtype: str = ""


class Ledger:
    """Feeds on each `Measurement`; holds only counters and fingerprints, never tensor copies."""

    def __init__(self) -> None:
        self.evidence: dict[int, Evidence] = {}
        self.measured_steps = 0
        self.skipped_steps = 0
        self.first_nonfinite: NonFinite | None = None

    def _ev(self, row: Tracked) -> Evidence:
        ev = self.evidence.get(row.index)
        if ev is None:
            ev = self.evidence[row.index] = Evidence(dtype=str(row.param.dtype).replace("torch.", ""))
        return ev

    def fingerprint_new(self, rows: list[Tracked]) -> None:
        """Remember the starting values of tensors seen materialised for the first time."""
        new = [r for r in rows if self._ev(r).first_fp is None and is_materialized(r.param)]
        for r, fp in zip(new, fingerprints([r.param for r in new])):
            ev = self._ev(r)
            ev.first_fp = fp
            ev.trainable_at_start = bool(r.param.requires_grad)

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
        """Whether each tensor's value differs from its first fingerprint (one host copy)."""
        live = [r for r in rows if is_materialized(r.param) and self._ev(r).first_fp is not None]
        now = fingerprints([r.param for r in live])
        out = {r.index: fp != self._ev(r).first_fp for r, fp in zip(live, now)}
        for r in rows:
            if self._ev(r).updated:
                out[r.index] = True
        return out
