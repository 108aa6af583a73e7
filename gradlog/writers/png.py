"""A heatmap as PNG bytes: the pixels are drawn here (numpy, whole-array), the file is Pillow's.

The overview image (one row per tensor in model order, one column per measured step) is drawn here:
the training loop may import this module (it sits at the writers stage; Pillow is imported only when an
image is encoded), and it is cheap enough to run on a background thread every few measured steps.
"""

from __future__ import annotations

import importlib.util
import io
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

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


def decades(lo: float, hi: float) -> tuple[float, float]:
    """log10 of the range [lo, hi] of positive values, at least one decade wide; (0, 1) when empty (lo > hi)."""
    if lo > hi:
        return 0.0, 1.0
    a, b = math.log10(lo), math.log10(hi)
    return (a, b) if b > a else (a - 0.5, a + 0.5)


def log_range(values: Any, measured: Any) -> tuple[float, float]:
    """`decades` of the measured finite positive values of a float64 array (the colour scale's ends)."""
    with np.errstate(invalid="ignore"):
        positive = values[measured & (values > 0) & (values < math.inf)]
    return decades(float(positive.min()), float(positive.max())) if positive.size else (0.0, 1.0)


_STRIP = 6  # marker strip width, px (then 2 px of gap)
_ROW_BLOCK = 256  # heatmap rows coloured at a time (a 5,000-tensor image's float64 temporaries were ~5 MB)


def _cell_size(rows: int, cols: int, max_width: int, max_height: int) -> tuple[int, int]:
    """Pixels per cell (width, height): the cells fit max_width x max_height where they can, 1-8 px each."""
    return max(1, min(8, max_width // cols)), max(1, min(8, max_height // rows))


def _colour(v: Any, given: Any, g: Any, lo: float, span: float) -> Any:
    """[rows, cols, 3] uint8 colours of value / measured / gradient-state arrays ([rows, cols]; states 0, 1
    "none", 2 "zero"). A cell with no value is MISSING (NO_GRAD where the tensor had no gradient); NaN/Inf is
    NONFINITE; <= 0 is NO_UPDATE (ZERO_GRAD / NO_GRAD by its gradient state); a positive value is
    `scale_colour((log10(v) - lo) / span)`, with the same float64 arithmetic."""
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


def heatmap_png(*args: Any, **kwargs: Any) -> bytes:
    """`heatmap_rgb`'s image as PNG bytes (the same arguments)."""
    return encode_png(*heatmap_rgb(*args, **kwargs))


def heatmap_rgb(
    values: Any,
    measured: Any,
    grad_state: Any,
    marks: Mapping[int, str] | None = None,
    max_width: int = 320,
    max_height: int = 800,
) -> tuple[int, int, bytes | memoryview]:
    """The heatmap of numpy arrays ([rows, cols]: float64 values, bool "measured", uint8 gradient states
    0 / 1 "none" / 2 "zero") as (width, height, RGB bytes): a marker strip for the rows in `marks` (row -> kind in
    MARKS), then the cells on a log colour scale (`_colour`), each cell a few pixels wide and high. The cells fit
    `max_width` x `max_height` where they can (TensorBoard's image card is ~350 px wide and crops wider
    images); past that one pixel per cell. No Python float per cell (a 5,000-tensor overview's lists were
    most of a measured step's extra memory): log10 is Python's own, the rest IEEE float64 whole-array
    (numpy's rint rounds half to even, as Python's round does). The overview labels these pixels and encodes
    once (encoding the cells, then decoding them to add the labels, cost a third of a drawing)."""
    rows, cols = values.shape
    if rows == 0 or cols == 0:
        return 1, 1, bytes(MISSING)
    cw, ch = _cell_size(rows, cols, max_width, max_height)
    lo, hi = log_range(values, measured)
    out = np.empty((rows, cols, 3), dtype=np.uint8)
    for start in range(0, rows, _ROW_BLOCK):  # a block of rows at a time: the float temporaries stay small
        stop = min(rows, start + _ROW_BLOCK)
        out[start:stop] = _colour(values[start:stop], measured[start:stop], grad_state[start:stop], lo, hi - lo)
    return _STRIP + 2 + cols * cw, rows * ch, _frame(out, marks or {}, cw, ch, _STRIP)


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


__all__ = ["MARKS", "encode_png", "heatmap_png", "heatmap_rgb", "log_range", "scale_colour"]
