"""Run-level series: a handful of numbers per measured step that say whether anything is wrong.

A user cannot watch 400 per-tensor charts; they can watch "how many tensors got no update" and the
spread of the update ratio. Everything here is computed from the host-side `Measurement` (no device
work), once per published step.
"""

from __future__ import annotations

import math
import statistics

from gradlog.measure.meter import Measurement
from gradlog.runformat import names


def run_level(m: Measurement) -> dict[str, float]:
    """Counts of tensors with no update / no gradient / an all-zero gradient / NaN-Inf gradient entries, and
    the min, median and max update ratio over the tensors that had a gradient and sit in the optimizer.

    The names are the run format's (`gradlog.runformat.names`); `Measurement.scalars()` writes the per-tensor
    series and none of these. A tensor without a gradient is not counted in `no_update_tensors` (it is in
    `no_grad_tensors`); NaN ratios stay out of the spread (they are in `nonfinite_tensors`).
    """
    host = m.lists
    nonzero, nonfinite, ratios, numel = host.nonzero, host.nonfinite, host.ratio, host.numel
    no_update = no_grad = zero_grad = bad = 0
    spread: list[float] = []
    for i, row in enumerate(m.rows):
        if not m.has_grad[i]:
            no_grad += int(bool(row.param.requires_grad))
            continue
        if nonfinite[i] > 0:
            bad += 1
        elif numel[i] > 0 and nonzero[i] == 0:
            zero_grad += 1
        if ratios is not None and row.group is not None and host.has_ratio(i):
            r = ratios[i]
            if r == 0.0:
                no_update += 1
            if math.isfinite(r):
                spread.append(r)
    out = {
        names.NO_UPDATE_TENSORS: float(no_update),
        names.NO_GRAD_TENSORS: float(no_grad),
        names.ZERO_GRAD_TENSORS: float(zero_grad),
        names.NONFINITE_TENSORS: float(bad),
    }
    if spread:
        out[names.UPDATE_RATIO_MIN] = min(spread)
        out[names.UPDATE_RATIO_MEDIAN] = float(statistics.median(spread))
        out[names.UPDATE_RATIO_MAX] = max(spread)
    return out


__all__ = ["run_level"]
