"""Words around the overview's cells, so the image reads on its own in TensorBoard's Images tab or W&B:
tensor names right of the rows, the steps under the columns, a title and a legend of every colour.

The cells keep their place (top-left at 0, 0; `png.heatmap_rgb`'s pixels unchanged): the labels go right
of and below them, so a reader that knows the cell size still finds each cell where it was.
"""

from __future__ import annotations

import io
import math
import threading
from collections.abc import Sequence
from typing import Any

from gradlog.writers.png import MARKS, MISSING, NO_GRAD, NO_UPDATE, NONFINITE, ZERO_GRAD, scale_colour

#: The PNG text chunk that says where the cells end ("WIDTHxHEIGHT" from the top-left corner), for readers
#: that look up a cell by its position.
CELLS_KEY = "gradlog-cells"
#: A name longer than this is shortened from the left (its last parts say the most: "...3.attn.weight").
NAME_CHARS = 40
#: Rows are made taller (whole pixels, nearest neighbour) to fit a name each while the cells stay this high.
MAX_HEIGHT = 800
_LINE = 12  # px per text line of Pillow's default font
_GAP = 4
_INK = (40, 40, 40)
_BAR = 160  # colour bar width, px
_KEYS: list[tuple[tuple[int, int, int], str]] = [
    (NO_UPDATE, "no update"),
    (ZERO_GRAD, "gradient exactly 0"),
    (NO_GRAD, "no gradient"),
    (NONFINITE, "NaN/Inf"),
    (MISSING, "not measured"),
]
_MARK_WORDS = {  # the row marks (MARKS): "no_update" shares "stalled"'s colour
    "never_updated": "never updated",
    "stalled": "stopped / no update",
    "partly_updated": "partly updated",
    "nonfinite": "NaN/Inf",
}


def short_name(name: str, limit: int = NAME_CHARS) -> str:
    """`name`, or its last `limit - 3` characters after '...'."""
    return name if len(name) <= limit else "..." + name[-(limit - 3) :]


_TEXT_CACHE = 4096  # rendered strings kept (tensor names, step numbers, the legend's words): a few MB at most
_texts: dict[str, tuple[Any, int, int, float]] = {}
_texts_lock = threading.Lock()
_fonts: list[Any] = []


def _font() -> Any:
    """Pillow's default font, loaded once (loading it cost about a millisecond a drawing)."""
    if not _fonts:
        from PIL import ImageFont

        _fonts.append(ImageFont.load_default())
    return _fonts[0]


def _rendered(text: str) -> tuple[Any, int, int, float]:
    """`text` drawn once in the default font, as (coverage mask, left, top, advance width): a tensor's name
    is drawn again on every overview of the run, and rendering it was most of a drawing (~1 ms a name;
    pasting the kept mask costs a few microseconds)."""
    with _texts_lock:
        got = _texts.get(text)
    if got is not None:
        return got
    from PIL import Image, ImageDraw

    font = _font()
    left, top, right, bottom = font.getbbox(text)
    mask = Image.new("L", (max(1, right - left), max(1, bottom - top)), 0)
    ImageDraw.Draw(mask).text((-left, -top), text, fill=255, font=font)
    got = (mask, int(left), int(top), float(font.getlength(text)))
    with _texts_lock:
        if len(_texts) >= _TEXT_CACHE:
            _texts.pop(next(iter(_texts)))
        _texts[text] = got
    return got


def _text(out: Any, xy: tuple[int, int], text: str) -> None:
    """`text` in ink at `xy` (its top-left, as `ImageDraw.text` places it), from the kept rendering."""
    mask, left, top, _ = _rendered(text)
    out.paste(_INK, (xy[0] + left, xy[1] + top, xy[0] + left + mask.width, xy[1] + top + mask.height), mask)


def _length(text: str) -> float:
    return _rendered(text)[3]


def label(
    cells_rgb: tuple[int, int, bytes | memoryview], names: Sequence[str], steps: Sequence[int], lo: float, hi: float
) -> bytes:
    """The cells (`png.heatmap_rgb`'s width, height and RGB bytes: one row of cells per name, one column per
    entry of `steps`) with the words added, as one PNG.

    `lo`, `hi`: log10 of the colour scale's ends. Rows too thin for a line of text get a name every few
    rows, each at its row (a tick joins the name to it)."""
    from PIL import Image, ImageDraw
    from PIL.PngImagePlugin import PngInfo

    width0, height0, rgb = cells_rgb
    cells = Image.frombuffer("RGB", (width0, height0), bytes(rgb), "raw", "RGB", 0, 1)
    rows = max(1, len(names))
    grow = math.ceil(_LINE / (cells.height / rows))  # few tensors: rows tall enough for a name each
    if grow > 1 and cells.height * grow <= MAX_HEIGHT:
        cells = cells.resize((cells.width, cells.height * grow), Image.Resampling.NEAREST)
    shown = [short_name(n) for n in names]
    text_w = int(max((_length(s) for s in shown), default=0))
    row_h = cells.height / rows
    legend_w = 2 * _GAP + _BAR + 80
    width = max(cells.width + _GAP + 6 + text_w + _GAP, legend_w + 120)
    foot = 2 + _LINE + _GAP + 2 * _LINE + _GAP + 10 + _LINE + _GAP + (len(_KEYS) + len(_MARK_WORDS) + 1) // 2 * _LINE
    out = Image.new("RGB", (width, cells.height + foot), MISSING)
    out.paste(cells, (0, 0))
    draw = ImageDraw.Draw(out)
    _names(draw, out, shown, cells.width, row_h)
    y = _steps(draw, out, steps, cells.width, cells.height)
    _legend(draw, out, lo, hi, y)
    info = PngInfo()
    info.add_text(CELLS_KEY, f"{cells.width}x{cells.height}")
    buf = io.BytesIO()
    out.save(buf, format="PNG", pnginfo=info)
    return buf.getvalue()


def _names(draw: Any, out: Any, shown: Sequence[str], left: int, row_h: float) -> None:
    every = max(1, math.ceil(_LINE / max(row_h, 1e-9)))  # rows per printed name
    x = left + _GAP
    for r in range(0, len(shown), every):
        mid = int((r + 0.5) * row_h)
        draw.line([(x, mid), (x + 3, mid)], fill=_INK)
        _text(out, (x + 6, mid - _LINE // 2), shown[r])


def _steps(draw: Any, out: Any, steps: Sequence[int], right: int, top: int) -> int:
    """The step axis under the columns (first, middle and last column's step); returns the next free y."""
    strip = 8  # the marker strip and its gap (png._STRIP + 2)
    y = top + 2
    draw.line([(strip, y), (max(strip, right - 1), y)], fill=_INK)
    if steps:
        cols = len(steps)
        cw = max(1, (right - strip) // cols)
        picks = sorted({0, cols // 2, cols - 1})
        last_end = -1
        for c in picks:
            text = str(steps[c])
            w = int(_length(text))
            x = min(max(strip + c * cw + cw // 2 - w // 2, 0), right + 40 - w)
            if x <= last_end + 4:
                continue
            draw.line([(strip + c * cw + cw // 2, y), (strip + c * cw + cw // 2, y + 3)], fill=_INK)
            _text(out, (x, y + 3), text)
            last_end = x + w
    y += 3 + _LINE + _GAP
    _text(out, (0, y), "gradlog overview: update ratio |dw|/|w| per tensor (rows, model order)")
    _text(out, (0, y + _LINE), "and logged step (columns; the numbers are steps)")
    return y + 2 * _LINE + _GAP


def _legend(draw: Any, out: Any, lo: float, hi: float, y: int) -> None:
    """A colour bar labelled with its ends, then a swatch for each special colour and row mark."""
    for i in range(_BAR):
        draw.line([(i, y), (i, y + 8)], fill=scale_colour(i / (_BAR - 1)))
    _text(out, (_BAR + _GAP, y - 2), f"1e{lo:.1f} .. 1e{hi:.1f}")
    y += 10 + _GAP
    keys = [*_KEYS, *((MARKS[k], f"mark: {w}") for k, w in _MARK_WORDS.items())]
    for i, (rgb, words) in enumerate(keys):
        x, yy = (i % 2) * 150, y + (i // 2) * _LINE
        draw.rectangle([(x, yy + 2), (x + 8, yy + 10)], fill=rgb, outline=_INK)
        _text(out, (x + 12, yy), words)
