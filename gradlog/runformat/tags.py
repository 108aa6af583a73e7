"""The names gradlog's series are written under.

Every per-tensor series lives under one prefix, `weights/<metric>/<tensor name>` (scalars such as
`weights/update_ratio/fc.weight`, histograms such as `weights/grad/fc.weight`); run-level series under
`gradlog/`. Why one prefix, and why `weights/`: TensorBoard's Scalars, Time Series and Histograms
dashboards group tags by the text before the first `/` and order the groups by their tags, compared
character by character in code-unit order except that `/` and digits (and `_` in Scalars/Histograms)
sort before every other character. Time Series opens only its first two groups. With one group per
metric (`grad_norm/`, `update_ratio/`, ...), each holding hundreds of cards, the run-level `gradlog/`
group and the user's own tags (`loss`, `train/loss`, `val/acc`) came after four of them. `weights` sorts
after every group starting with a to v (`eval`, `gradlog`, `loss`, `lr`, `train`, `train_loss`, `val`)
and after upper case (`Loss/train`), in code-unit order as in a locale's alphabetical order (W&B's
section order is one of the two; a symbol such as `~` would sort last in one and first in the other),
and it reads as what the series are about. Checked in a real browser by
tests/test_tensorboard_plugin.py::test_time_series_lists_run_level_and_user_groups_first.
"""

from __future__ import annotations

import functools

from gradlog.runformat.names import RUN, TENSORS

#: Per-tensor scalar metrics, in the order the meter writes them for one tensor.
SCALAR_METRICS = (
    "weight_norm",
    "grad_norm",
    "grad_zero_frac",
    "grad_nonfinite",
    "update_ratio",
    "dead_frac",
    "frozen_frac",
)
#: Per-tensor histogram kinds.
HISTOGRAM_KINDS = ("grad", "weight", "update")


def prefix(metric: str) -> str:
    """`weights/<metric>/`: what a tag of that metric starts with, the tensor's name following."""
    return f"{TENSORS}{metric}/"


def tag(metric: str, name: str) -> str:
    """The tag of one tensor's `metric` series: `weights/update_ratio/fc.weight`."""
    return f"{TENSORS}{metric}/{name}"


#: The metrics of `row_tags`: what the meter writes for each tensor at a measured step (`frozen_frac` only
#: where it is non-zero, through `tag`).
ROW_METRICS = ("weight_norm", "grad_norm", "grad_zero_frac", "grad_nonfinite", "update_ratio", "dead_frac")


@functools.lru_cache(maxsize=1 << 16)
def row_tags(name: str) -> tuple[str, str, str, str, str, str]:
    """One tensor's scalar tags (`ROW_METRICS`), built once: a 5,000-tensor step made 25,000 new strings (2 MB)
    each time."""
    return tuple(prefix(m) + name for m in ROW_METRICS)  # type: ignore[return-value]


#: `weights/<metric>/` for every scalar metric, as accepted by `str.startswith`.
SCALAR_PREFIXES = tuple(prefix(m) for m in SCALAR_METRICS)


def split(tag_: str) -> tuple[str, str] | None:
    """`(metric, tensor name)` of a per-tensor scalar tag (`weights/grad_norm/fc.weight`), else None."""
    if not tag_.startswith(TENSORS):
        return None
    metric, sep, name = tag_[len(TENSORS) :].partition("/")
    return (metric, name) if sep and metric in SCALAR_METRICS else None


__all__ = [
    "HISTOGRAM_KINDS",
    "ROW_METRICS",
    "RUN",
    "SCALAR_METRICS",
    "SCALAR_PREFIXES",
    "TENSORS",
    "prefix",
    "row_tags",
    "split",
    "tag",
]
