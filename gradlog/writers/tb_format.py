"""gradlog values -> serialized TensorBoard messages (scalars, raw histograms, text, images, the tensor order,
custom-scalars layout).

Importing this module imports the `tensorboard` package's protobufs; `TensorBoardWriter` does so only
when it is constructed, so `import gradlog` stays light.
"""

from __future__ import annotations

import math
import struct
import textwrap
from collections.abc import Sequence
from typing import Any

from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2
from tensorboard.plugins.custom_scalar import layout_pb2

from gradlog.measure.histogram import Histogram
from gradlog.measure.tags import prefix

#: The custom-scalars tab: a few charts of run-level series, each with a handful of lines (a chart with
#: one line per tensor, 400 in one colour, shows nothing).
CHARTS = (
    ("tensors with no update / no gradient / zero gradient / NaN-Inf", r"^gradlog/\w+_tensors$"),
    ("update ratio: min, median, max over tensors", r"^gradlog/update_ratio_(min|median|max)$"),
    ("global gradient norm", r"^gradlog/grad_norm_total$"),
    ("skipped steps, alerts", r"^gradlog/(skipped_steps|alerts)$"),
)
LAYOUT_TAG = "custom_scalars__config__"
#: Tensor names in model order, for the gradlog TensorBoard tab (its own plugin name: no other tab shows it).
ORDER_TAG = "gradlog/tensor_order"
PLUGIN_NAME = "gradlog"
#: Values per Event record: few records, yet no single record so large that a torn write loses much.
MAX_VALUES_PER_EVENT = 1024

Value = summary_pb2.Summary.Value
_TEXT_METADATA = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text"))
_LAYOUT_METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="custom_scalars")
)
_ORDER_METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name=PLUGIN_NAME, content=b"tensor_order"),
    data_class=summary_pb2.DATA_CLASS_TENSOR,  # without it TensorBoard's data provider does not list the tag
)


# --- the hot path, encoded by hand ---------------------------------------------------------------------
# Scalars and histograms are most of every step. Building protobuf objects for them costs ~15 us per
# histogram; their wire format is small and fixed, so it is written directly with `struct` (tests parse
# it back with the protobuf classes). Field numbers: tensorboard/compat/proto/{event,summary}.proto.
_F64 = struct.Struct("<d")
_F32 = struct.Struct("<f")
_MOMENTS = struct.Struct("<BdBdBdBdBd")  # HistogramProto fields 1-5: min, max, num, sum, sum_squares


_ONE_BYTE = [bytes((i,)) for i in range(128)]


def _varint(n: int) -> bytes:
    if 0 <= n < 128:
        return _ONE_BYTE[n]
    n &= 0xFFFFFFFFFFFFFFFF  # negative int64 -> ten bytes, as protobuf does
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(key: int, payload: bytes) -> bytes:
    """A length-delimited field: key byte, varint length, payload."""
    return b"".join((bytes((key,)), _varint(len(payload)), payload))


def _float32(value: float) -> bytes:
    """TensorBoard's `simple_value` is float32; beyond its range a value becomes +-inf (as protobuf casts it)."""
    try:
        return _F32.pack(value)
    except OverflowError:
        return _F32.pack(math.copysign(math.inf, value))


_SCALAR_HEADS: dict[str, bytes] = {}  # tag -> encoded bytes before the float: the same tags come every step
_MAX_CACHED = 100_000


def scalar_value(tag: str, value: float) -> bytes:
    """One `Summary.value` entry with `simple_value`, the legacy form every reader understands."""
    head = _SCALAR_HEADS.get(tag)
    if head is None:
        inner = _field(0x0A, tag.encode("utf-8")) + b"\x15"
        head = b"\x0a" + _varint(len(inner) + 4) + inner  # entry key, length (the float adds 4 bytes), tag
        if len(_SCALAR_HEADS) < _MAX_CACHED:
            _SCALAR_HEADS[tag] = head
    return head + _float32(value)


def _packed(key: int, values: Sequence[float]) -> bytes:
    return _field(key, struct.pack(f"<{len(values)}d", *values))


def histogram(h: Histogram) -> bytes:
    """A serialized raw `HistogramProto`: `bucket[i]` counts values up to `bucket_limit[i]`, starting at `min`.

    Only finite values are counted (`num == sum(bucket)`). Degenerate tensors follow what TensorBoard's own
    histogram op writes: no finite value (all NaN/Inf, or empty) -> one empty bucket at 0, which readers
    turn into an empty histogram; a constant tensor -> one zero-width bucket at its value.
    """
    if h.count == 0:
        lo = hi = total = squares = 0.0
        limits: Sequence[float] = [0.0]
        counts: Sequence[float] = [0.0]
    else:
        lo, hi, total, squares = h.min, h.max, h.sum, h.sum_squares
        if hi > lo:
            limits, counts = list(h.edges[1:]), h.counts
            limits[-1] = hi  # exact, whatever the rounding of the computed edges
        else:
            limits, counts = [hi], [float(h.count)]
    moments = _MOMENTS.pack(0x09, lo, 0x11, hi, 0x19, float(h.count), 0x21, total, 0x29, squares)
    return moments + _packed(0x32, limits) + _packed(0x3A, counts)


def histogram_value(tag: str, h: Histogram) -> bytes:
    """One `Summary.value` entry with `histo`."""
    return _field(0x0A, _field(0x0A, tag.encode("utf-8")) + _field(0x2A, histogram(h)))


def event(wall_time: float, step: int, values: Sequence[bytes]) -> bytes:
    """A serialized `Event` whose `Summary` holds the given `Summary.value` entries."""
    summary = b"".join(values)
    return b"".join((b"\x09", _F64.pack(wall_time), b"\x10", _varint(step), _field(0x2A, summary)))


def summary_events(wall_time: float, step: int, values: Sequence[bytes]) -> list[bytes]:
    """Serialized Events carrying `values`, at most MAX_VALUES_PER_EVENT each."""
    return [
        event(wall_time, step, values[at : at + MAX_VALUES_PER_EVENT])
        for at in range(0, len(values), MAX_VALUES_PER_EVENT)
    ]


# --- once per run: built with the protobuf classes ---------------------------------------------------


def _string_tensor(data: bytes) -> Any:
    return tensor_pb2.TensorProto(
        dtype="DT_STRING", string_val=[data], tensor_shape=tensor_shape_pb2.TensorShapeProto()
    )


#: Tables for gradlog's readers only (a resumed run's per-tensor record, gradlog/resume.py): written under
#: gradlog's plugin, so TensorBoard's Text tab does not show a card of every tensor name.
HIDDEN_TABLES = ("gradlog/segment", "gradlog/provisional/segment")
_HIDDEN_METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name=PLUGIN_NAME, content=b"table")
)


def text_value(tag: str, markdown: str) -> bytes:
    """One text-plugin `Summary.value` entry; TensorBoard renders the string as markdown (tables included)."""
    metadata = _HIDDEN_METADATA if tag in HIDDEN_TABLES else _TEXT_METADATA
    value = Value(tag=tag, metadata=metadata, tensor=_string_tensor(markdown.encode("utf-8")))
    return _field(0x0A, value.SerializeToString())


def order_value(names: Sequence[str]) -> bytes:
    """The tensor names in model order, one per line, under ORDER_TAG (read by the gradlog tab)."""
    data = "\n".join(names).encode("utf-8")
    value = Value(tag=ORDER_TAG, metadata=_ORDER_METADATA, tensor=_string_tensor(data))
    return _field(0x0A, value.SerializeToString())


#: Per-step packed rows for the gradlog tab: one float32 tensor [len(PACKED), tensors] per published step, under
#: `gradlog/heatmap/<block>`, PACK_BLOCK steps per tag (TensorBoard keeps 10 points of a tag of an unknown
#: plugin, so a block is never sampled down). Reading 1,000 of these is ~1,000x faster than 1,000,000 scalars.
PACKED = ("update_ratio", "grad_norm", "grad_zero_frac", "grad_nonfinite")
PACK_BLOCK = 10
PACK_TAG = "gradlog/heatmap/"
PACK_MISSING = -1.0  # no value (real values are >= 0, NaN or +Inf)
_PACK_METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name=PLUGIN_NAME, content=b"heatmap"),
    data_class=summary_pb2.DATA_CLASS_TENSOR,
)


def packed_value(tag: str, names: Sequence[str], scalars: dict[str, float]) -> bytes:
    """One step's per-tensor metrics (rows PACKED, columns `names` in model order) as a float32 tensor."""
    n = len(names)
    out: list[float] = []
    for metric in PACKED:
        get = scalars.get
        head = prefix(metric)
        out += [get(head + name, PACK_MISSING) for name in names]
    shape = tensor_shape_pb2.TensorShapeProto(
        dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=len(PACKED)), tensor_shape_pb2.TensorShapeProto.Dim(size=n)]
    )
    content = struct.pack(f"<{len(out)}f", *(_clamp32(v) for v in out))
    tensor = tensor_pb2.TensorProto(dtype="DT_FLOAT", tensor_shape=shape, tensor_content=content)
    return _field(0x0A, Value(tag=tag, metadata=_PACK_METADATA, tensor=tensor).SerializeToString())


def _clamp32(v: float) -> float:
    """float32 range: beyond it a value is +-inf, as TensorBoard's own scalars store it."""
    return v if -3.4e38 < v < 3.4e38 or v != v else math.copysign(math.inf, v)


def png_size(png: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    if png[:8] != b"\x89PNG\r\n\x1a\n" or png[12:16] != b"IHDR":
        raise ValueError("log_image expects PNG bytes")
    width, height = struct.unpack(">II", png[16:24])
    return width, height


IMAGE_DESCRIPTION = (
    "gradlog overview: update ratio per tensor (rows, in model order) and published step (columns), log "
    "colour scale from dark blue to yellow. Dark purple: no update (0); grey: no gradient; black: all-zero "
    "gradient; red: NaN/Inf; white: not measured. Left strip: red never updated, orange stalled or no update "
    "now, yellow partly updated, magenta NaN/Inf. The gradlog tab shows the same, with names."
)


def image_value(tag: str, png: bytes) -> bytes:
    """One `Summary.value` entry with an encoded image (TensorBoard's Images tab), with its legend as the
    card's description (the image itself has no text)."""
    width, height = png_size(png)
    image = summary_pb2.Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=png)
    meta = summary_pb2.SummaryMetadata(summary_description=IMAGE_DESCRIPTION)
    return _field(0x0A, Value(tag=tag, image=image, metadata=meta).SerializeToString())


#: Long cells are wrapped at this many characters with <br>: TensorBoard's Text tab lets a table fill the
#: page and breaks words anywhere, so one long "detail" column squeezed the short ones to "shap|e", "nume|l".
WRAP_AT = 48


def _wrap(cell: str) -> str:
    if len(cell) <= WRAP_AT:
        return cell
    return "<br>".join(textwrap.wrap(cell, WRAP_AT, break_long_words=False, break_on_hyphens=False)) or cell


def escape_markdown(text: str) -> str:
    """Plain text inside markdown emphasis: characters markdown would act on are backslash-escaped."""
    return "".join("\\" + ch if ch in "\\`*_[]<>|#" else ch for ch in " ".join(text.split()))


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("\\", "\\\\").replace("|", "\\|") or " "


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[str]], wrap: bool = True) -> str:
    """A GitHub-style markdown table; cells are escaped so a `|` or newline in a name cannot break it, and
    long cells are wrapped (see WRAP_AT, unless `wrap=False`) so that short columns keep their words whole."""
    fit = _wrap if wrap else (lambda c: c)
    lines = ["| " + " | ".join(_cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fit(_cell(c)) for c in row) + " |" for row in rows]
    if not rows:
        lines += ["", "_(no rows)_"]
    return "\n".join(lines)


def layout_value() -> Any:
    """The custom-scalars layout: category "gradlog", the run-level charts."""
    charts = [layout_pb2.Chart(title=t, multiline=layout_pb2.MultilineChartContent(tag=[rx])) for t, rx in CHARTS]
    layout = layout_pb2.Layout(category=[layout_pb2.Category(title="gradlog", chart=charts)])
    return Value(tag=LAYOUT_TAG, metadata=_LAYOUT_METADATA, tensor=_string_tensor(layout.SerializeToString()))


def header_events(wall_time: float) -> list[bytes]:
    """What every new event file starts with: the format version, then the layout."""
    version = event_pb2.Event(wall_time=wall_time, step=0, file_version="brain.Event:2")
    layout = event_pb2.Event(wall_time=wall_time, step=0, summary=summary_pb2.Summary(value=[layout_value()]))
    return [version.SerializeToString(), layout.SerializeToString()]
