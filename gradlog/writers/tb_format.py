"""gradlog values -> serialized TensorBoard Events (scalars, raw histograms, text, images, the tensor order,
custom-scalars layout), built with TensorBoard's own protobuf classes.

Importing this module imports the `tensorboard` package's protobufs; `TensorBoardWriter` does so only
when it is constructed, so `import gradlog` stays light.
"""

from __future__ import annotations

import array
import functools
import struct
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2
from tensorboard.plugins.custom_scalar import layout_pb2

from gradlog.measure.histogram import Histogram, Histograms

# the writer's tables, in the run format's markdown (the readers parse it back): `format.markdown_table`
from gradlog.runformat.markdown import escape_markdown as escape_markdown
from gradlog.runformat.markdown import markdown_table as markdown_table
from gradlog.runformat.names import HIDDEN_TABLES, ORDER_TAG, PACK_MISSING, PACKED, PLUGIN_NAME

# the packed rows' tag and block, read by the writer as `format.PACK_TAG`, `format.PACK_BLOCK`
from gradlog.runformat.names import PACK_BLOCK as PACK_BLOCK
from gradlog.runformat.names import PACK_TAG as PACK_TAG
from gradlog.runformat.tags import prefix

#: The custom-scalars tab: a few charts of run-level series, each with a handful of lines (a chart with
#: one line per tensor, 400 in one colour, shows nothing).
CHARTS = (
    ("tensors with no update / no gradient / zero gradient / NaN-Inf", r"^gradlog/\w+_tensors$"),
    ("update ratio: min, median, max over tensors", r"^gradlog/update_ratio_(min|median|max)$"),
    ("global gradient norm", r"^gradlog/grad_norm_total$"),
    ("skipped steps, alerts", r"^gradlog/(skipped_steps|alerts)$"),
)
LAYOUT_TAG = "custom_scalars__config__"
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


# --- the hot path: a step's values encoded straight into Event records -------------------------------------
# Scalars and histograms are most of every step. They are written as protobuf wire bytes here, a step's histogram
# block at a time with numpy (bucket limits and counts of every row in two array operations): building them as
# protobuf messages cost ~9 us a 64-bucket histogram, most of the TensorBoard thread's time on a model of 150
# histograms a step. The bytes are what protobuf itself writes (`tests/test_tensorboard.py` compares them with
# `SerializeToString`): fields in number order, a proto3 scalar left out when its bits are all zero, a negative
# int64 as ten bytes. The few other values (text, images, the order, packed rows) are protobuf messages.

_MASK64 = (1 << 64) - 1
_F64 = np.dtype("<f8")
_F32 = np.dtype("<f4")


def _varint(n: int) -> bytes:
    """A protobuf varint; a negative number as its 64-bit two's complement (ten bytes), as protobuf writes int64."""
    if 0 <= n < 0x80:
        return _SMALL[n]
    if 0 < n < 0x4000:
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    n &= _MASK64
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL = [bytes((i,)) for i in range(0x80)]


def _delimited(key: int, payload: bytes) -> bytes:
    """A length-delimited field (`key`: field number << 3 | 2)."""
    return _SMALL[key] + _varint(len(payload)) + payload


def _entry(value: bytes) -> bytes:
    """An encoded `Summary.Value` as an entry of `Summary.value` (field 1): what an Event's summary is made of."""
    return b"\x0a" + _varint(len(value)) + value


@functools.lru_cache(maxsize=1 << 16)
def _tag_field(tag: str) -> bytes:
    """`Summary.Value.tag` (field 1), kept: the same tags come back on every measured step. An empty tag is
    left out, as proto3 leaves out an empty string."""
    return _delimited(0x0A, tag.encode("utf-8")) if tag else b""


@functools.lru_cache(maxsize=1 << 16)
def _scalar_head(tag: str) -> bytes:
    """A scalar's `Summary.value` entry up to its 4 bytes of float32 `simple_value` (field 2, always written: it is
    in a oneof)."""
    field = _tag_field(tag)
    return b"\x0a" + _varint(len(field) + 5) + field + b"\x15"


def _doubles(fields: Sequence[tuple[int, float]]) -> bytes:
    """Proto3 double fields (`key`: field number << 3 | 1), each left out when its bits are all zero (-0.0 stays)."""
    out = b""
    for key, v in fields:
        b = struct.pack("<d", v)
        if b != _ZERO8:
            out += _SMALL[key] + b
    return out


_ZERO8 = bytes(8)


def _event(step: int, wall_time: float, entries: Sequence[bytes]) -> bytes:
    """An `Event` record: wall_time (1), step (2), summary (5) of `Summary.value` entries (`_entry`)."""
    summary = b"".join(entries)
    head = _doubles(((0x09, wall_time),)) + (b"\x10" + _varint(step) if step else b"")
    return head + b"\x2a" + _varint(len(summary)) + summary


_EMPTY_HISTO = b"\x32\x08" + _ZERO8 + b"\x3a\x08" + _ZERO8  # no finite value: one empty bucket at 0
_HEAD_KEYS = (0x09, 0x11, 0x19, 0x21, 0x29)  # HistogramProto min, max, num, sum, sum_squares (doubles)


def histogram_entries(tags: Sequence[str], counts: np.ndarray[Any, Any], moments: np.ndarray[Any, Any]) -> list[bytes]:
    """`Summary.value` entries (`_entry`) with a raw `HistogramProto` each, from a block of rows: `counts` [n, bins]
    and `moments` [n, 5] (min, max, sum, sum of squares, NaN/Inf count), as `Histogram` reads a row (negative
    counts read as 0, the count is the counts' sum in order). `bucket[i]` counts values up to `bucket_limit[i]`,
    starting at `min`. Only finite values are counted (`num == sum(bucket)`). Degenerate rows follow what
    TensorBoard's own histogram op writes: no finite value (all NaN/Inf, or empty) -> one empty bucket at 0, which
    readers turn into an empty histogram; a constant tensor -> one zero-width bucket at its value.

    The rows with buckets and no zero among their five numbers (nearly all) are laid out in one numpy record array,
    header, limits and counts side by side, and cut out of its bytes: a few us a row."""
    c = np.maximum(np.asarray(counts, dtype=np.float64), 0.0)
    m = np.asarray(moments, dtype=np.float64)
    n, bins = c.shape
    # the count as `Histogram._of` takes it: a sum in order (cumsum is sequential), rounded
    total = np.rint(np.cumsum(c, axis=1)[:, -1]) if bins else np.zeros(n)
    lo, hi = m[:, 0], m[:, 1]
    five = np.stack([lo, hi, total, m[:, 2], m[:, 3]], axis=1)
    spread = (total > 0) & (hi > lo)
    fast = spread & (five.view(np.uint64) != 0).all(axis=1)
    packed = _varint(8 * bins)
    layout: list[tuple[Any, ...]] = [(f"k{j}", "u1") if j % 2 == 0 else (f"v{j}", _F64) for j in range(10)]
    layout += [("limits_key", "u1"), ("limits_size", f"V{len(packed)}"), ("limits", _F64, (bins,))]
    layout += [("counts_key", "u1"), ("counts_size", f"V{len(packed)}"), ("counts", _F64, (bins,))]
    rec = np.zeros(int(fast.sum()), dtype=np.dtype(layout))  # packed: no padding between fields
    if len(rec):
        for j, key in enumerate(_HEAD_KEYS):
            rec[f"k{2 * j}"] = key
            rec[f"v{2 * j + 1}"] = five[fast, j]
        rec["limits_key"], rec["counts_key"] = 0x32, 0x3A  # HistogramProto bucket_limit, bucket (packed doubles)
        rec["limits_size"] = rec["counts_size"] = np.frombuffer(packed, dtype=f"V{len(packed)}")[0]
        lo_f, hi_f = lo[fast], hi[fast]
        with np.errstate(all="ignore"):
            width = (hi_f - lo_f) / bins
            rec["limits"][:, :-1] = lo_f[:, None] + np.arange(1, bins, dtype=np.float64)[None, :] * width[:, None]
        rec["limits"][:, -1] = hi_f  # exact, whatever the rounding of the computed edges
        rec["counts"] = c[fast]
    blob, size = rec.tobytes(), rec.dtype.itemsize
    histo_head = b"\x2a" + _varint(size)
    out: list[bytes] = []
    k = 0
    for i, tag in enumerate(tags):
        if fast[i]:
            value = _tag_field(tag) + histo_head + blob[k * size : (k + 1) * size]
            k += 1
        elif total[i] == 0:
            value = _tag_field(tag) + _delimited(0x2A, _EMPTY_HISTO)
        else:
            head = _doubles(tuple(zip(_HEAD_KEYS, five[i].tolist())))
            if spread[i]:
                step = (hi[i] - lo[i]) / bins
                limits = [lo[i] + j * step for j in range(1, bins)] + [hi[i]]
                body = (
                    b"\x32" + packed + np.array(limits, _F64).tobytes() + b"\x3a" + packed + c[i].astype(_F64).tobytes()
                )
            else:
                body = b"\x32\x08" + struct.pack("<d", hi[i]) + b"\x3a\x08" + struct.pack("<d", total[i])
            value = _tag_field(tag) + _delimited(0x2A, head + body)
        out.append(_entry(value))
    return out


class Events:
    """Serialized `Event` records of consecutive values: values of one step share an Event, at most
    MAX_VALUES_PER_EVENT each; `end()` closes the open one (a text table gets an Event of its own)."""

    def __init__(self) -> None:
        self.records: list[bytes] = []
        self._values: list[bytes] = []  # `Summary.value` entries of the open Event
        self._step: int | None = None
        self._wall = 0.0

    def _room(self, step: int, wall_time: float) -> int:
        """Values the open Event still takes, after opening a new one when the step differs or it is full (one
        step's Events all carry the wall time of its first value)."""
        if self._step != step or len(self._values) >= MAX_VALUES_PER_EVENT:
            if self._step == step:
                wall_time = self._wall
            self.end()
            self._step, self._wall = step, wall_time
        return MAX_VALUES_PER_EVENT - len(self._values)

    def _add(self, step: int, wall_time: float, values: Sequence[bytes]) -> None:
        at = 0
        while at < len(values):
            room = self._room(step, wall_time)
            self._values += values[at : at + room]
            at += room

    def end(self) -> None:
        if self._step is not None:
            self.records.append(_event(self._step, self._wall, self._values))
            self._values = []
            self._step = None

    def scalars(self, step: int, wall_time: float, pairs: Sequence[tuple[str, float]]) -> None:
        """`simple_value` entries, the legacy form every reader understands (float32: beyond its range a value
        becomes +-inf, as protobuf casts it)."""
        if not pairs:
            return
        with np.errstate(over="ignore"):
            f32 = np.array([v for _, v in pairs], dtype=np.float64).astype(_F32).tobytes()
        head = _scalar_head
        self._add(step, wall_time, [head(t) + f32[4 * i : 4 * i + 4] for i, (t, _) in enumerate(pairs)])

    def histograms(self, step: int, wall_time: float, tags: Sequence[str], hists: Histograms) -> None:
        """A block of histograms (`histogram_entries`)."""
        self._add(step, wall_time, histogram_entries(tags, hists.counts.numpy(), hists.moments.numpy()))

    def histogram(self, step: int, wall_time: float, tag: str, h: Histogram) -> None:
        """One histogram (`histogram_entries`)."""
        counts = np.array([h.counts], dtype=np.float64).reshape(1, len(h.counts))
        moments = np.array([[h.min, h.max, h.sum, h.sum_squares, h.nonfinite]], dtype=np.float64)
        self._add(step, wall_time, histogram_entries([tag], counts, moments))

    def value(self, step: int, wall_time: float, value: Any) -> None:
        """A `Summary.Value` built elsewhere (text, image, tensor order, packed rows: a few per step at most)."""
        self._add(step, wall_time, [_entry(value.SerializeToString())])


# --- the rest, a few per step at most: built as `Summary.Value` objects ---------------------------------


def _string_tensor(data: bytes) -> Any:
    return tensor_pb2.TensorProto(
        dtype="DT_STRING", string_val=[data], tensor_shape=tensor_shape_pb2.TensorShapeProto()
    )


#: Tables for gradlog's readers only (`HIDDEN_TABLES`: a resumed run's per-tensor record, gradlog/run/resume.py):
#: written under gradlog's plugin, so TensorBoard's Text tab does not show a card of every tensor name.
_HIDDEN_METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name=PLUGIN_NAME, content=b"table")
)


def text_value(tag: str, markdown: str) -> Any:
    """A text-plugin `Summary.Value`; TensorBoard renders the string as markdown (tables included)."""
    metadata = _HIDDEN_METADATA if tag in HIDDEN_TABLES else _TEXT_METADATA
    return Value(tag=tag, metadata=metadata, tensor=_string_tensor(markdown.encode("utf-8")))


def order_value(names: Sequence[str]) -> Any:
    """The tensor names in model order, one per line, under ORDER_TAG (read by the gradlog tab)."""
    data = "\n".join(names).encode("utf-8")
    return Value(tag=ORDER_TAG, metadata=_ORDER_METADATA, tensor=_string_tensor(data))


#: Per-step packed rows for the gradlog tab: one float32 tensor [len(PACKED), tensors] per published step, under
#: `PACK_TAG<block>`, PACK_BLOCK steps per tag (TensorBoard keeps 10 points of a tag of an unknown plugin, so a
#: block is never sampled down). Reading 1,000 of these is ~1,000x faster than 1,000,000 scalars.
_PACK_METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name=PLUGIN_NAME, content=b"heatmap"),
    data_class=summary_pb2.DATA_CLASS_TENSOR,
)


def packed_value(tag: str, names: Sequence[str], scalars: dict[str, float]) -> Any:
    """One step's per-tensor metrics (rows PACKED, columns `names` in model order) as a float32 tensor."""
    n = len(names)
    out = array.array("f")  # float32: beyond its range a value is +-inf, as TensorBoard's own scalars store it
    for metric in PACKED:
        get = scalars.get
        head = prefix(metric)
        out.extend([get(head + name, PACK_MISSING) for name in names])
    if sys.byteorder == "big":  # tensor_content is little-endian
        out.byteswap()
    shape = tensor_shape_pb2.TensorShapeProto(
        dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=len(PACKED)), tensor_shape_pb2.TensorShapeProto.Dim(size=n)]
    )
    tensor = tensor_pb2.TensorProto(dtype="DT_FLOAT", tensor_shape=shape, tensor_content=out.tobytes())
    return Value(tag=tag, metadata=_PACK_METADATA, tensor=tensor)


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


def image_value(tag: str, png: bytes) -> Any:
    """A `Summary.Value` with an encoded image (TensorBoard's Images tab), with its legend as the
    card's description (the image itself has no text)."""
    width, height = png_size(png)
    image = summary_pb2.Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=png)
    meta = summary_pb2.SummaryMetadata(summary_description=IMAGE_DESCRIPTION)
    return Value(tag=tag, image=image, metadata=meta)


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
