"""One figure a user can read at a glance: are the update ratios healthy, where are the gradients, what never learned.

Input is plain per-step series (``tag -> [(step, value), ...]``, as `MemoryWriter.scalars` holds and
`gradlog report` reads back) plus the never-updated tensors (name -> reason). The figure is built on
matplotlib's object API with the Agg canvas, so it never touches a GUI backend or pyplot's global state.

Readable from 1 to 1,000+ tensors: with many tensors the ratio panel colours only the tensors that stray
furthest from the band (the rest are grey), and the heatmap thins its row labels so none overlap while
always naming the never-updated tensors on the right.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Union

from gradlog.runformat import tags
from gradlog.verdict.alerts import DEFAULT_RATIO_BAND

if TYPE_CHECKING:
    from matplotlib.figure import Figure

Series = Mapping[str, Sequence[tuple[int, float]]]
NeverUpdatedSpec = Union[Mapping[str, str], Sequence[str]]

_LEGEND_MAX = 12  # up to this many tensors every line gets a legend entry
_HIGHLIGHT = 8  # above it, only this many (the furthest out of band) are coloured
_MAX_COLUMNS = 600  # heatmap columns; longer runs are sampled evenly
_LABEL_PT = 7.0
_ROW_LABEL_IN = 0.13  # vertical space one row label needs (7 pt text plus a gap)


def _require_matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError(
            "gradlog's plots need matplotlib: pip install 'gradlog[plot]' (quote the brackets for zsh)"
        ) from exc
    return matplotlib


def _names(series: Series, prefix: str) -> list[str]:
    return [tag[len(prefix) :] for tag in series if tag.startswith(prefix) and len(tag) > len(prefix)]


def _never(never_updated: NeverUpdatedSpec | None) -> dict[str, str]:
    if never_updated is None:
        return {}
    if isinstance(never_updated, Mapping):
        return {str(k): str(v) for k, v in never_updated.items()}
    return {str(n): "" for n in never_updated}


def _out_of_band_score(values: list[float], lo: float, hi: float) -> float:
    """How far, in decades summed over steps, a tensor's ratios sit outside the band (0 = always inside)."""
    score = 0.0
    for v in values:
        if not math.isfinite(v) or v <= 0:
            score += 3.0  # no update at all, or a NaN/Inf one, counts as far out
        elif v > hi:
            score += math.log10(v / hi)
        elif v < lo:
            score += math.log10(lo / v)
    return score


def thin_positions(positions: Sequence[int], n: int, capacity: int) -> list[int]:
    """The subset of `positions` (rows 0..n-1) whose labels fit: no two closer than n/capacity rows apart.

    Tick labels drawn at the returned rows never overlap, whatever n is.
    """
    if n <= 0 or capacity <= 0:
        return []
    gap = n / capacity if n > capacity else 1.0
    out: list[int] = []
    for p in sorted(set(positions)):
        if not out or p - out[-1] >= gap - 1e-9:
            out.append(p)
    return out


def figure(
    series: Series,
    never_updated: NeverUpdatedSpec | None = None,
    band: Sequence[float] = DEFAULT_RATIO_BAND,
    title: str | None = None,
    first_nonfinite: tuple[int, str] | None = None,
) -> Figure:
    """Update-ratio lines (band shaded) over a gradient-norm heatmap, never-updated tensors marked.

    `first_nonfinite` (step, tensor) draws a red line where the first NaN/Inf gradient was seen. Tags are
    today's (`weights/update_ratio/<name>`, ...) or those of runs written before (`update_ratio/<name>`).
    """
    _require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    lo, hi = float(band[0]), float(band[1])
    never = _never(never_updated)
    rows = _rows(series, never)
    heat_h = min(max(max(len(rows), 1) * 0.16, 2.5), 12.0)
    ratio_h = 4.0
    fig = Figure(figsize=(13.0, ratio_h + heat_h + 1.6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax_r, ax_h = fig.subplots(2, 1, height_ratios=[ratio_h, heat_h])
    heading = title or "gradlog: update ratio and gradient norm per tensor"
    fig.suptitle(f"{heading}\n{len(rows)} tensor{'s' * (len(rows) != 1)}, {len(never)} never updated", fontsize=11)
    _ratio_panel(ax_r, series, never, lo, hi)
    if first_nonfinite is not None:
        _mark_nonfinite(ax_r, ax_h, *first_nonfinite)
    x_edges = _grad_heatmap(fig, ax_h, series, rows)
    if x_edges is not None:  # one x range for both panels, so a step lines up across them
        ax_r.set_xlim(x_edges[0], x_edges[-1])
    _label_rows(ax_h, rows, never, heat_h)
    return fig


def _rows(series: Series, never: Mapping[str, str]) -> list[str]:
    """The heatmap's tensors, in model order (the order the series were first written), never-updated ones too."""
    rows: list[str] = []
    for prefix in ("weight_norm", "grad_norm", "update_ratio"):
        for name in _names(series, tags.prefix(prefix)):
            if name not in rows:
                rows.append(name)
    rows += [name for name in never if name not in rows]
    return rows


def _ratio_panel(ax_r: Any, series: Series, never: Mapping[str, str], lo: float, hi: float) -> None:
    """Top: log10 update ratio per tensor, healthy band shaded; many tensors: the furthest out of band in
    colour, the rest grey; never-updated tensors dashed red."""
    from matplotlib.collections import LineCollection
    from matplotlib.lines import Line2D

    ratio = tags.prefix("update_ratio")
    ratio_names = _names(series, ratio)
    ax_r.axhspan(math.log10(lo), math.log10(hi), color="#2ca02c", alpha=0.12, lw=0)
    ax_r.axhline(math.log10(lo), color="#2ca02c", lw=0.8, ls=":")
    ax_r.axhline(math.log10(hi), color="#2ca02c", lw=0.8, ls=":")
    curves: dict[str, tuple[list[float], list[float]]] = {}
    positives = [v for n in ratio_names for _, v in series[ratio + n] if math.isfinite(v) and v > 0]
    floor = math.floor(math.log10(min([*positives, lo]))) - 1  # where "no update at all" is drawn
    for name in ratio_names:
        pts = sorted(series[ratio + name])
        xs = [float(s) for s, _ in pts]
        # ratio 0 (no update) sits on the floor line; NaN/Inf leaves a gap in the line
        ys = [math.log10(v) if math.isfinite(v) and v > 0 else (float(floor) if v == 0 else math.nan) for _, v in pts]
        curves[name] = (xs, ys)
    scores = {n: _out_of_band_score([v for _, v in series[ratio + n]], lo, hi) for n in ratio_names}
    # a tensor in no param group has no update-ratio series, yet the optimizer never moved it: drawn on the
    # "no update" line at the steps its gradient was measured, and always among the highlighted
    grad = tags.prefix("grad_norm")
    for name in never:
        if name not in curves and grad + name in series:
            curves[name] = (
                [float(s) for s, _ in sorted(series[grad + name])],
                [float(floor)] * len(series[grad + name]),
            )
            scores[name] = math.inf
            ratio_names.append(name)
    if len(ratio_names) <= _LEGEND_MAX:
        highlighted = list(ratio_names)
    else:
        ranked = sorted(ratio_names, key=lambda n: -scores[n])
        highlighted = [n for n in ranked[:_HIGHLIGHT] if scores[n] > 0]
        grey = [list(zip(*curves[n])) for n in ratio_names if n not in highlighted and len(curves[n][0]) > 0]
        ax_r.add_collection(LineCollection(grey, colors="#999999", linewidths=0.5, alpha=0.35, zorder=1))
    handles = _ratio_lines(ax_r, highlighted, curves, never, floor)
    if len(ratio_names) > _LEGEND_MAX:
        handles.append(Line2D([], [], color="#999999", lw=0.8, label=f"{len(ratio_names) - len(highlighted)} others"))
    handles.append(Line2D([], [], color="#2ca02c", lw=6, alpha=0.25, label=f"healthy band {lo:g}..{hi:g}"))
    ax_r.axhline(floor, color="#444444", lw=0.6, ls="--")
    ax_r.text(0.002, floor, " no update (ratio 0)", transform=ax_r.get_yaxis_transform(), va="bottom", fontsize=7)
    if not ratio_names:
        ax_r.text(
            0.5,
            0.5,
            "no update_ratio data (no optimizer, or nothing measured)",
            ha="center",
            va="center",
            transform=ax_r.transAxes,
            fontsize=10,
            color="#555555",
        )
    ax_r.autoscale_view()
    ax_r.set_ylabel("log10 update ratio\n‖Δw‖ / ‖w‖")
    ax_r.set_xlabel("step")
    ax_r.grid(True, lw=0.3, alpha=0.5)
    title_txt = None if len(ratio_names) <= _LEGEND_MAX else f"furthest out of band ({len(highlighted)} shown)"
    ax_r.legend(
        handles=handles,
        loc="center left",  # outside the axes: a legend must never hide a line
        bbox_to_anchor=(1.01, 0.5),
        fontsize=7.5,
        title=title_txt,
        title_fontsize=7.5,
        frameon=True,
        framealpha=0.85,
    )


def _ratio_lines(
    ax_r: Any,
    highlighted: list[str],
    curves: Mapping[str, tuple[list[float], list[float]]],
    never: Mapping[str, str],
    floor: float,
) -> list[Any]:
    """One coloured line per highlighted tensor; never-updated ones last and dashed, so a line they
    overlap still shows through the gaps."""
    palette = ["#1f77b4", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"]
    handles: list[Any] = []
    for k, name in enumerate(sorted(highlighted, key=lambda n: n in never)):
        xs, ys = curves[name]
        bad = name in never
        marker = "o" if len(xs) <= 30 and not bad else None
        label = f"{name}  (never updated: {never[name]})" if bad else name
        zeros = sum(1 for y in ys if y == floor)
        if zeros and not bad:
            label = f"{_short(name, 40)}  [no update at {zeros} of {len(ys)}]"
        color = "#d62728" if bad else palette[k % len(palette)]
        (line,) = ax_r.plot(
            xs,
            ys,
            color=color,
            ls="--" if bad else "-",
            lw=1.6 if bad else 1.3,
            marker=marker,
            ms=3,
            label=_short(label, 64),
            zorder=4 if bad else 3,
        )
        handles.append(line)
    return handles


def _mark_nonfinite(ax_r: Any, ax_h: Any, step: int, name: str) -> None:
    """A red line in both panels where the first NaN/Inf gradient was seen."""
    for ax in (ax_r, ax_h):
        ax.axvline(step, color="#d62728", lw=1.0, ls="-.", zorder=5)
    ax_r.text(
        step,
        0.98,
        f" first NaN/Inf gradient: step {step}, {_short(name, 40)}",
        color="#d62728",
        fontsize=8,
        va="top",
        transform=ax_r.get_xaxis_transform(),
    )


def _grad_heatmap(fig: Figure, ax_h: Any, series: Series, rows: list[str]) -> list[float] | None:
    """Bottom: gradient norm, tensors x steps (log colour; zero black, NaN/Inf red, missing grey).
    Returns the x edges of its columns (None when nothing was measured)."""
    mpl = _require_matplotlib()
    from matplotlib import colors
    from matplotlib.ticker import MaxNLocator

    grad = tags.prefix("grad_norm")
    n_rows = max(len(rows), 1)
    steps = sorted({s for n in _names(series, grad) for s, _ in series[grad + n]})
    if len(steps) > _MAX_COLUMNS:
        steps = [steps[int(i * len(steps) / _MAX_COLUMNS)] for i in range(_MAX_COLUMNS)]
    col = {s: j for j, s in enumerate(steps)}
    nan = float("nan")
    matrix = [[nan] * max(len(steps), 1) for _ in range(n_rows)]
    finite: list[float] = []
    for i, name in enumerate(rows):
        for s, v in series.get(grad + name, ()):
            j = col.get(s)
            if j is None:
                continue
            matrix[i][j] = v
            if math.isfinite(v) and v > 0:
                finite.append(v)
    vmin = min(finite) if finite else 1e-8
    vmax = max(finite) if finite else 1.0
    if vmax <= vmin:
        vmax = vmin * 10
    for i, name in enumerate(rows):  # zero -> under colour, NaN/Inf -> over colour, missing stays NaN (bad colour)
        for s, v in series.get(grad + name, ()):
            j = col.get(s)
            if j is not None and (v == 0 or not math.isfinite(v)):
                matrix[i][j] = vmin / 10 if v == 0 else vmax * 10
    cmap = mpl.colormaps["viridis"].with_extremes(bad="#e6e6e6", under="#000000", over="#d62728")
    x_edges = _edges([float(s) for s in steps]) if steps else [0.0, 1.0]
    y_edges = [i - 0.5 for i in range(n_rows + 1)]
    mesh = ax_h.pcolormesh(
        x_edges, y_edges, matrix, cmap=cmap, norm=colors.LogNorm(vmin=vmin, vmax=vmax), shading="flat"
    )
    ax_h.set_ylim(n_rows - 0.5, -0.5)
    for ax in fig.axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax_h.set_xlabel("step")
    ax_h.set_title(
        "gradient norm per tensor (log colour)   grey: no gradient   black: exactly zero   red: NaN/Inf",
        fontsize=9,
        loc="left",
    )
    cbar = fig.colorbar(mesh, ax=ax_h, extend="both", fraction=0.025, pad=0.01)
    cbar.set_label("‖grad‖")
    return x_edges if steps else None


def _label_rows(ax_h: Any, rows: list[str], never: Mapping[str, str], heat_h: float) -> None:
    """Tensor names on the left (thinned to what fits), never-updated ones in red and, with their reason,
    on the right; a red bar at the left edge marks every never-updated row, labelled or not."""
    capacity = max(int(heat_h / _ROW_LABEL_IN), 2)
    bad_rows = [i for i, n in enumerate(rows) if n in never]
    left = thin_positions(range(len(rows)), len(rows), capacity)
    ax_h.set_yticks(left, [_short(rows[i], 48) for i in left], fontsize=_LABEL_PT)
    for tick, i in zip(ax_h.get_yticklabels(), left):
        if rows[i] in never:
            tick.set_color("#d62728")
    if len(left) < len(rows):
        ax_h.set_ylabel(f"tensor ({len(left)} of {len(rows)} labelled)")
    else:
        ax_h.set_ylabel("tensor")
    if not bad_rows:
        return
    right = ax_h.secondary_yaxis("right")
    shown = thin_positions(bad_rows, len(rows), capacity)
    right.set_yticks(
        shown,
        [_short(f"✗ {rows[i]}: {never[rows[i]]}".rstrip(": "), 52) for i in shown],
        fontsize=_LABEL_PT,
        color="#d62728",
    )
    right.tick_params(axis="y", colors="#d62728", length=3)
    if len(shown) < len(bad_rows):
        right.set_ylabel(f"never updated ({len(shown)} of {len(bad_rows)} labelled)", color="#d62728")
    else:
        right.set_ylabel("never updated", color="#d62728")
    for i in bad_rows:
        ax_h.axhspan(i - 0.5, i + 0.5, xmin=0.0, xmax=0.006, color="#d62728", lw=0, zorder=4)


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else "…" + text[-(width - 1) :]


def _edges(xs: list[float]) -> list[float]:
    """Cell edges around sorted step values: halfway between neighbours."""
    if len(xs) == 1:
        return [xs[0] - 0.5, xs[0] + 0.5]
    mids = [(a + b) / 2 for a, b in zip(xs, xs[1:])]
    return [xs[0] - (mids[0] - xs[0]), *mids, xs[-1] + (xs[-1] - mids[-1])]


def save(
    path: str,
    series: Series,
    never_updated: NeverUpdatedSpec | None = None,
    band: Sequence[float] = DEFAULT_RATIO_BAND,
    title: str | None = None,
    first_nonfinite: tuple[int, str] | None = None,
) -> str:
    """Write the figure as a PNG (or whatever the suffix says) and return the path."""
    fig = figure(series, never_updated, band, title, first_nonfinite)
    fig.savefig(path)
    return path
