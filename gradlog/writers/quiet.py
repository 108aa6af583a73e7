"""Fewer, more useful series for dashboards that draw one chart per tag (TensorBoard, W&B).

`weights/grad_nonfinite/<name>` is 0 for almost every tensor on almost every step: 400 flat charts that bury
the user's own. The run-level `gradlog/nonfinite_tensors` already counts them, so a tensor's own
series is written only from the first step its count is non-zero (then on every step, so the chart
shows when it recovered). `MemoryWriter` keeps everything: it has no screen to fill.
"""

from __future__ import annotations

from collections.abc import Mapping

from gradlog.runformat.tags import TENSORS, prefix

PREFIX = prefix("grad_nonfinite")


class QuietNonfinite:
    """Filters one writer's scalars; remembers which tensors have gone non-finite."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def __call__(self, scalars: Mapping[str, float]) -> dict[str, float]:
        out: dict[str, float] = {}
        for tag, value in scalars.items():
            if tag.startswith(PREFIX) and tag not in self.seen:
                if value == 0:  # NaN compares unequal: a NaN count (never expected) is kept
                    continue
                self.seen.add(tag)
            out[tag] = value
        return out


#: Prefixes whose tags carry one tensor's name after them, in the order the logger writes them.
PER_TENSOR = tuple(prefix(m) for m in ("weight_norm", "grad_norm", "grad_zero_frac", "grad_nonfinite", "update_ratio"))


def tensor_names(scalars: Mapping[str, float]) -> list[str]:
    """Tensor names in the order their tags arrive: the model order (the logger writes rows in order)."""
    seen: dict[str, None] = {}
    for tag in scalars:
        if not tag.startswith(TENSORS):
            continue
        for head in PER_TENSOR:
            if tag.startswith(head):
                seen.setdefault(tag[len(head) :], None)
                break
    return list(seen)


__all__ = ["PER_TENSOR", "QuietNonfinite", "tensor_names"]
