"""The picture of a checkpoint comparison (`gradlog diff --plot`): relative change per tensor and interval."""

from __future__ import annotations

import math

import torch

from gradlog.compare.checkpoints import DiffResult
from gradlog.views.plot import _require_matplotlib


def plot(result: DiffResult, out: str) -> None:
    """A heatmap of log10 relative change, tensor x checkpoint interval: light grey where nothing changed,
    red cells where the change is NaN/Inf, never-changed tensors' names in red."""
    _require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    names = list(result.relative_change)
    n, k = len(names), max(result.intervals, 1)
    data = torch.full((max(n, 1), k), math.nan, dtype=torch.float64)
    bad: list[tuple[int, int]] = []
    for i, name in enumerate(names):
        for j, v in enumerate(result.relative_change[name]):
            if not math.isfinite(v):
                bad.append((i, j))
            elif v > 0:
                data[i, j] = math.log10(v)
    never = {r.name for r in result.report.never_updated}
    fig = Figure(figsize=(min(16.0, 5 + 0.6 * k), min(60.0, 1.8 + 0.18 * max(n, 1))))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    import matplotlib

    base = matplotlib.colormaps["viridis"]
    cmap = base.with_extremes(bad=(0.88, 0.88, 0.88))  # no change at all: light grey, apart from viridis
    finite = data[torch.isfinite(data)]
    lo = float(finite.min()) if finite.numel() else -6.0
    hi = float(finite.max()) if finite.numel() else 0.0
    im = ax.imshow(data.numpy(), aspect="auto", cmap=cmap, vmin=lo, vmax=max(hi, lo + 1e-9), interpolation="nearest")
    for i, j in bad:
        ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, color=(0.85, 0.1, 0.1)))
        ax.text(j, i, "NaN/Inf", color="white", fontsize=6, ha="center", va="center")
    fig.colorbar(im, ax=ax, label="log10 ‖B−A‖/‖A‖ (light grey: unchanged)")
    ax.set_xticks(range(k))
    ax.set_xticklabels([f"{j}->{j + 1}" for j in range(k)], fontsize=7)
    step = max(1, n // 80)
    shown = sorted(set(range(0, n, step)) | {i for i, name in enumerate(names) if name in never})
    ax.set_yticks(shown)
    ax.set_yticklabels([names[i] for i in shown], fontsize=6)
    for label, i in zip(ax.get_yticklabels(), shown):
        if names[i] in never:
            label.set_color("red")
    ax.set_xlabel("checkpoint interval")
    ax.set_title("gradlog diff: relative change per tensor (red names: never changed)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
