"""A heatmap as PNG bytes: the pixels are drawn here (numpy, or plain Python), the file is Pillow's.

The overview image (one row per tensor in model order, one column per measured step) is drawn here:
the training loop may import this module (it sits at the writers stage; Pillow is imported only when an
image is encoded), and it is cheap enough to run on a background thread every few measured steps.
"""

from __future__ import annotations

import importlib.util
import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

try:  # optional: without numpy the pure-Python loop below draws the same pixels
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]

RGB = tuple[int, int, int]

#: Special cells, drawn in colours the log scale never uses (the same meaning as the TensorBoard tab).
NO_UPDATE: RGB = (68, 1, 84)  # value exactly 0: the optimizer moved nothing (dark purple, below the scale)
NO_GRAD: RGB = (150, 150, 150)  # the tensor had no gradient at that step (grey)
ZERO_GRAD: RGB = (0, 0, 0)  # the gradient was exactly zero (black)
NONFINITE: RGB = (230, 0, 0)  # NaN or Inf (red)
MISSING: RGB = (255, 255, 255)  # not measured at that step (white)
#: Row markers, left of the row: what the findings say about the tensor.
MARKS: dict[str, RGB] = {
    "never_updated": (230, 0, 0),
    "stalled": (255, 140, 0),
    "partly_updated": (255, 200, 0),
    "nonfinite": (200, 0, 200),
    "no_update": (255, 140, 0),
}
#: Stops of a perceptual map (viridis without its darkest end, which NO_UPDATE uses), low to high.
_STOPS: list[RGB] = [(59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37)]


def scale_colour(t: float) -> RGB:
    """t in [0, 1] -> a colour on the map."""
    t = min(1.0, max(0.0, t)) * (len(_STOPS) - 1)
    i = min(int(t), len(_STOPS) - 2)
    f = t - i
    a, b = _STOPS[i], _STOPS[i + 1]
    return (round(a[0] + (b[0] - a[0]) * f), round(a[1] + (b[1] - a[1]) * f), round(a[2] + (b[2] - a[2]) * f))


def encode_png(width: int, height: int, rgb: bytes | memoryview) -> bytes:
    """An 8-bit RGB PNG from `height` rows of `width * 3` bytes, encoded by Pillow (installed with the
    tensorboard and wandb extras; `gradlog.writers.overview` turns images off where it is missing)."""
    if len(rgb) != width * height * 3:
        raise ValueError(f"expected {width * height * 3} bytes of RGB for {width}x{height}, got {len(rgb)}")
    try:
        from PIL import Image
    except ImportError as exc:  # pragma: no cover - the overview checks first
        raise ImportError(f"gradlog's overview image needs Pillow: {PILLOW_HINT}") from exc
    out = io.BytesIO()
    Image.frombuffer("RGB", (width, height), bytes(rgb), "raw", "RGB", 0, 1).save(out, format="PNG")
    return out.getvalue()


#: how to get Pillow, in the messages that need it
PILLOW_HINT = "pip install pillow (the gradlog[tensorboard] and gradlog[wandb] extras install it)"


def has_pillow() -> bool:
    """Whether PNGs can be encoded here, without importing Pillow."""
    return importlib.util.find_spec("PIL") is not None


def log_range(values: Sequence[Sequence[float | None]]) -> tuple[float, float]:
    """log10 of the smallest and largest finite positive value (a 1-decade span when there is one value)."""
    lo, hi = math.inf, -math.inf
    for row in values:
        positive = [v for v in row if v is not None and 0 < v < math.inf]  # NaN fails both comparisons
        if positive:
            lo, hi = min(lo, min(positive)), max(hi, max(positive))
    return decades(lo, hi)


def decades(lo: float, hi: float) -> tuple[float, float]:
    """log10 of the range [lo, hi] of positive values, at least one decade wide; (0, 1) when empty (lo > hi)."""
    if lo > hi:
        return 0.0, 1.0
    a, b = math.log10(lo), math.log10(hi)
    return (a, b) if b > a else (a - 0.5, a + 0.5)


_STRIP = 6  # marker strip width, px (then 2 px of gap)


def _cell_size(rows: int, cols: int, max_width: int, max_height: int) -> tuple[int, int]:
    """Pixels per cell (width, height): the cells fit max_width x max_height where they can, 1-8 px each."""
    return max(1, min(8, max_width // cols)), max(1, min(8, max_height // rows))


def cell_colour(v: float | None, lo: float, span: float, grad: str | None = None) -> RGB:
    """The colour of one cell. `grad` says why a 0 is 0: "none" (no gradient), "zero" (all-zero gradient)."""
    if v is None:
        return NO_GRAD if grad == "none" else MISSING
    if math.isnan(v) or math.isinf(v):
        return NONFINITE
    if v <= 0:
        return NO_GRAD if grad == "none" else ZERO_GRAD if grad == "zero" else NO_UPDATE
    return scale_colour((math.log10(v) - lo) / span)


def heatmap_png(
    values: Sequence[Sequence[float | None]],
    marks: Mapping[int, str] | None = None,
    grad_state: Sequence[Sequence[str | None]] | None = None,
    max_width: int = 320,
    max_height: int = 800,
) -> bytes:
    """`values[row][col]` (None: not measured) as a PNG: a marker strip for the rows in `marks`
    (row -> kind in MARKS), then the cells on a log colour scale, each cell a few pixels wide and high.
    The cells fit `max_width` x `max_height` where they can (TensorBoard's image card is ~350 px wide and
    crops wider images); past that one pixel per cell."""
    rows = len(values)
    cols = max((len(r) for r in values), default=0)
    if rows == 0 or cols == 0:
        return encode_png(1, 1, bytes(MISSING))
    if np is not None:
        return heatmap_png_arrays(*_as_arrays(values, grad_state, cols), marks, max_width, max_height)
    cw, ch = _cell_size(rows, cols, max_width, max_height)
    strip = _STRIP
    lo, hi = log_range(values)
    span = hi - lo
    marks = marks or {}
    width = strip + 2 + cols * cw
    out = bytearray()
    # `cell_colour` inlined, with each colour's pixels made once: a 5,000-tensor x 50-step image at close
    # was ~1 s of per-cell calls. The arithmetic is the same, so every pixel is too.
    pixels: dict[RGB, bytes] = {}
    last = len(_STOPS) - 1
    inf = math.inf
    for r, row in enumerate(values):
        line = [bytes(MARKS.get(marks.get(r, ""), MISSING)) * strip + bytes(MISSING) * 2]
        states = grad_state[r] if grad_state is not None else None
        n_row, n_states = len(row), len(states) if states is not None else 0
        for c in range(cols):
            v = row[c] if c < n_row else None
            g = states[c] if states is not None and c < n_states else None
            if v is None:
                rgb = NO_GRAD if g == "none" else MISSING
            elif v != v or v == inf or v == -inf:
                rgb = NONFINITE
            elif v <= 0:
                rgb = NO_GRAD if g == "none" else ZERO_GRAD if g == "zero" else NO_UPDATE
            else:  # scale_colour((log10(v) - lo) / span)
                t = min(1.0, max(0.0, (math.log10(v) - lo) / span)) * last
                i = min(int(t), last - 1)
                f = t - i
                a, b = _STOPS[i], _STOPS[i + 1]
                rgb = (
                    round(a[0] + (b[0] - a[0]) * f),
                    round(a[1] + (b[1] - a[1]) * f),
                    round(a[2] + (b[2] - a[2]) * f),
                )
            px = pixels.get(rgb)
            if px is None:
                px = pixels[rgb] = bytes(rgb) * cw
            line.append(px)
        out += b"".join(line) * ch
    return encode_png(width, rows * ch, bytes(out))


_ROW_BLOCK = 256  # heatmap rows coloured at a time (a 5,000-tensor image's float64 temporaries were ~5 MB)


def _as_arrays(
    values: Sequence[Sequence[float | None]], grad_state: Sequence[Sequence[str | None]] | None, cols: int
) -> tuple[Any, Any, Any]:
    """`heatmap_png`'s rows as `heatmap_png_arrays`' arrays: values (ragged rows padded), measured, states."""
    rows = len(values)
    flat: list[float] = []
    known: list[bool] = []
    for row in values:
        pad = cols - len(row)
        flat += [math.nan if v is None else v for v in row]
        known += [v is not None for v in row]
        if pad:
            flat += [math.nan] * pad
            known += [False] * pad
    v = np.asarray(flat, dtype=np.float64).reshape(rows, cols)
    given = np.asarray(known, dtype=bool).reshape(rows, cols)
    code = {"none": 1, "zero": 2}
    g = np.zeros((rows, cols), dtype=np.uint8)
    if grad_state is not None:
        for r, states in enumerate(grad_state[:rows]):
            if any(x is not None for x in states):
                g[r, : min(len(states), cols)] = [code.get(x, 0) for x in states[:cols]]  # type: ignore[arg-type]
    return v, given, g


def _colour(v: Any, given: Any, g: Any, lo: float, span: float) -> Any:
    """[rows, cols, 3] uint8 colours of value / measured / gradient-state arrays ([rows, cols]; states 0, 1
    "none", 2 "zero"): `cell_colour`'s arithmetic, whole-array."""
    rows, cols = v.shape
    with np.errstate(invalid="ignore"):
        finite = given & np.isfinite(v)
        positive = finite & (v > 0)
    last = len(_STOPS) - 1
    logs = np.zeros((rows, cols), dtype=np.float64)
    logs[positive] = [math.log10(x) for x in v[positive].tolist()]
    t = np.minimum(1.0, np.maximum(0.0, (logs - lo) / span)) * last
    i = np.minimum(t.astype(np.int64), last - 1)
    f = t - i
    stops = np.asarray(_STOPS, dtype=np.int64)
    a, b = stops[i], stops[i + 1]
    scaled = np.rint(a + (b - a) * f[..., None]).astype(np.uint8)
    out = np.empty((rows, cols, 3), dtype=np.uint8)
    out[...] = MISSING
    out[~given & (g == 1)] = NO_GRAD
    out[given & ~finite] = NONFINITE
    low = finite & ~positive
    out[low] = NO_UPDATE
    out[low & (g == 2)] = ZERO_GRAD
    out[low & (g == 1)] = NO_GRAD
    out[positive] = scaled[positive]
    return out


def heatmap_png_arrays(
    values: Any,
    measured: Any,
    grad_state: Any,
    marks: Mapping[int, str] | None = None,
    max_width: int = 320,
    max_height: int = 800,
) -> bytes:
    """`heatmap_png` from numpy arrays ([rows, cols]: float64 values, bool "measured", uint8 gradient states
    0 / 1 "none" / 2 "zero"), the same pixels without a Python float per cell (a 5,000-tensor overview's
    lists were most of a measured step's extra memory). Every pixel equals `cell_colour`'s: log10 is
    Python's own, the rest the same IEEE arithmetic in float64 (numpy's rint rounds half to even, as
    Python's round does). Needs numpy."""
    rows, cols = values.shape
    if rows == 0 or cols == 0:
        return encode_png(1, 1, bytes(MISSING))
    cw, ch = _cell_size(rows, cols, max_width, max_height)
    with np.errstate(invalid="ignore"):
        positive = values[measured & (values > 0) & (values < math.inf)]
    lo, hi = decades(float(positive.min()), float(positive.max())) if positive.size else (0.0, 1.0)
    out = np.empty((rows, cols, 3), dtype=np.uint8)
    for start in range(0, rows, _ROW_BLOCK):  # a block of rows at a time: the float temporaries stay small
        stop = min(rows, start + _ROW_BLOCK)
        out[start:stop] = _colour(values[start:stop], measured[start:stop], grad_state[start:stop], lo, hi - lo)
    return encode_png(_STRIP + 2 + cols * cw, rows * ch, _frame(out, marks or {}, cw, ch, _STRIP))


def _frame(out: Any, marks: Mapping[int, str], cw: int, ch: int, strip: int) -> memoryview:
    """The marker strip beside the cells, each cell `cw` x `ch` pixels: the image's RGB bytes, written once
    into one array (a 5,000-tensor overview is ~4.5 MB of pixels; repeat, concatenate and a bytes copy
    held three of them at once)."""
    rows, cols = out.shape[0], out.shape[1]
    img = np.empty((rows, strip + 2 + cols * cw, 3), dtype=np.uint8)
    img[:, : strip + 2] = MISSING
    for r, kind in marks.items():
        if 0 <= r < rows:
            img[r, :strip] = MARKS.get(kind, MISSING)
    img[:, strip + 2 :].reshape(rows, cols, cw, 3)[...] = out[:, :, None, :]
    if ch > 1:  # at most 800 image rows: the cells are that tall only when there are few tensors
        img = np.repeat(img, ch, axis=0)
    return memoryview(img).cast("B")  # type: ignore[arg-type]


__all__ = ["MARKS", "encode_png", "heatmap_png", "heatmap_png_arrays", "scale_colour"]
