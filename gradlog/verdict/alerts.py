"""Alerts during training: say so the moment a tensor looks wrong, not only in the table at close.

Everything here works on the host-side `Measurement` the logger already fetched, so alerts cost no
device work. Each tensor alerts at most once per kind; one log record per measured step and kind
names every tensor that newly alerted, so a NaN loss that hits 400 tensors is one line, not 400.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from gradlog.measure.meter import Measurement

log = logging.getLogger("gradlog")

#: Alert kinds, in the order a user should look at them.
NONFINITE = "nonfinite_grad"
RATIO_HIGH = "update_ratio_high"
RATIO_LOW = "update_ratio_low"
NO_GRAD = "no_grad"
KINDS = (NONFINITE, RATIO_HIGH, RATIO_LOW, NO_GRAD)

#: Columns of the `gradlog/alerts` table written at close.
ALERT_COLUMNS = ["step", "kind", "name", "detail"]

DEFAULT_RATIO_BAND = (1e-4, 1e-2)
DEFAULT_RATIO_PATIENCE = 3
DEFAULT_NO_GRAD_PATIENCE = 5
_NAMES_SHOWN = 5


@dataclass(frozen=True)
class Alert:
    """One tensor that crossed a threshold: `step` is the optimizer step it was measured at."""

    step: int
    kind: str
    name: str
    detail: str

    def row(self) -> list[str]:
        return [str(self.step), self.kind, self.name, self.detail]


def check_band(band: Sequence[float]) -> tuple[float, float]:
    """Validate a healthy update-ratio band; used by the logger and the report command alike."""
    try:
        lo, hi = (float(x) for x in band)
    except (TypeError, ValueError):
        raise ValueError(f"ratio_band must be two numbers (low, high), got {band!r}") from None
    if not (0 < lo < hi and math.isfinite(hi)):
        raise ValueError(f"ratio_band must satisfy 0 < low < high < inf, got ({lo!r}, {hi!r}); e.g. (1e-4, 1e-2)")
    return lo, hi


def _check_patience(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1 (measured steps in a row), got {value!r}")
    return value


class Alerts:
    """Watches each measured step for three things that rarely fix themselves.

    - a gradient went NaN/Inf (steps the optimizer skipped, as GradScaler does on overflow, are ignored:
      the scaler already handled them);
    - the update ratio ‖Δw‖/‖w‖ stayed outside `ratio_band` for `ratio_patience` measured steps in a row
      (steps without a usable gradient neither count nor break the streak);
    - a trainable tensor had no gradient (`.grad is None`) for `no_grad_patience` measured steps in a row.
    """

    def __init__(
        self,
        ratio_band: Sequence[float] = DEFAULT_RATIO_BAND,
        ratio_patience: int = DEFAULT_RATIO_PATIENCE,
        no_grad_patience: int = DEFAULT_NO_GRAD_PATIENCE,
    ) -> None:
        self.ratio_band = check_band(ratio_band)
        self.ratio_patience = _check_patience("ratio_patience", ratio_patience)
        self.no_grad_patience = _check_patience("no_grad_patience", no_grad_patience)
        self.fired: list[Alert] = []
        self._seen: set[tuple[int, str]] = set()  # (tensor index, kind)
        self._high: dict[int, int] = {}
        self._low: dict[int, int] = {}
        self._no_grad: dict[int, int] = {}

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for a in self.fired:
            out[a.kind] = out.get(a.kind, 0) + 1
        return out

    def rows(self) -> list[list[str]]:
        return [a.row() for a in self.fired]

    def observe(self, m: Measurement) -> list[Alert]:
        """Update the streaks with one measured step; log and return the alerts it newly raised."""
        new: list[Alert] = []

        def fire(index: int, kind: str, name: str, detail: str) -> None:
            if (index, kind) not in self._seen:
                self._seen.add((index, kind))
                new.append(Alert(m.index, kind, name, detail))

        lo, hi = self.ratio_band
        nonfinite = m.nonfinite.tolist()
        ratio = m.update_ratio
        ratios = ratio.tolist() if ratio is not None and not m.skipped else None
        for i, row in enumerate(m.rows):
            key = row.index
            if not m.has_grad[i]:
                if row.param.requires_grad:
                    n = self._no_grad[key] = self._no_grad.get(key, 0) + 1
                    if n >= self.no_grad_patience:
                        fire(key, NO_GRAD, row.name, f".grad was None on {n} measured steps in a row")
                continue
            self._no_grad[key] = 0
            if m.skipped:
                continue
            if nonfinite[i] > 0:
                fire(key, NONFINITE, row.name, f"{int(nonfinite[i])} NaN/Inf gradient entries")
                continue
            if ratios is None or row.group is None:
                continue
            r = ratios[i]
            self._high[key] = self._high.get(key, 0) + 1 if r > hi else 0
            self._low[key] = self._low.get(key, 0) + 1 if r < lo else 0
            if self._high[key] >= self.ratio_patience:
                fire(key, RATIO_HIGH, row.name, f"update ratio {r:.3g} > {hi:g} for {self._high[key]} measured steps")
            if self._low[key] >= self.ratio_patience:
                fire(key, RATIO_LOW, row.name, f"update ratio {r:.3g} < {lo:g} for {self._low[key]} measured steps")
        self.fired.extend(new)
        for kind in KINDS:
            group = [a for a in new if a.kind == kind]
            if group:
                log.warning("%s", _message(m.index, kind, group))
        return new


_HEADLINES = {
    NONFINITE: "non-finite gradient",
    RATIO_HIGH: "update ratio above the healthy band",
    RATIO_LOW: "update ratio below the healthy band",
    NO_GRAD: "no gradient",
}


def _message(step: int, kind: str, alerts: list[Alert]) -> str:
    shown = "; ".join(f"{a.name} ({a.detail})" for a in alerts[:_NAMES_SHOWN])
    more = f"; and {len(alerts) - _NAMES_SHOWN} more" if len(alerts) > _NAMES_SHOWN else ""
    n = len(alerts)
    return f"gradlog alert at optimizer step {step}: {_HEADLINES[kind]} in {n} tensor{'s' * (n != 1)}: {shown}{more}"
