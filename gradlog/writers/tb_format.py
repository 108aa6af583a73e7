"""gradlog values -> serialized TensorBoard Events (scalars, raw histograms, text, images, the tensor order,
custom-scalars layout), built with TensorBoard's own protobuf classes.

Importing this module imports the `tensorboard` package's protobufs; `TensorBoardWriter` does so only
when it is constructed, so `import gradlog` stays light.
"""

from __future__ import annotations

import array
import struct
import sys
from collections.abc import Sequence
from typing import Any

from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2
from tensorboard.plugins.custom_scalar import layout_pb2

from gradlog.measure.histogram import Histogram

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


# --- the hot path: a step's values added straight into Events ------------------------------------------
# Scalars and histograms are most of every step. Each is added in place to the open Event's repeated field
# (`values.add(...)`): building `Summary.Value` objects first and copying them into a `Summary` cost 1.25x a
# hand encoder with `struct`; adding in place costs the same as that (benchmarks/README.md).


class Events:
    """Serialized `Event` records of consecutive values: values of one step share an Event, at most
    MAX_VALUES_PER_EVENT each; `end()` closes the open one (a text table gets an Event of its own)."""

    def __init__(self) -> None:
        self.records: list[bytes] = []
        self._event: Any = None

    def values(self, step: int, wall_time: float) -> Any:
        """The open Event's `Summary.value` list, or a new Event's when the step differs or it is full (one
        step's Events all carry the wall time of its first value)."""
        e = self._event
        if e is None or e.step != step or len(e.summary.value) >= MAX_VALUES_PER_EVENT:
            if e is not None and e.step == step:
                wall_time = e.wall_time
            self.end()
            e = self._event = event_pb2.Event(wall_time=wall_time, step=step)
        return e.summary.value

    def end(self) -> None:
        if self._event is not None:
            self.records.append(self._event.SerializeToString())
            self._event = None

    def scalars(self, step: int, wall_time: float, pairs: Sequence[tuple[str, float]]) -> None:
        """`simple_value` entries, the legacy form every reader understands (float32: beyond its range a value
        becomes +-inf, as protobuf casts it)."""
        at = 0
        while at < len(pairs):
            values = self.values(step, wall_time)
            room = MAX_VALUES_PER_EVENT - len(values)
            add = values.add
            for tag, v in pairs[at : at + room]:
                add(tag=tag, simple_value=v)
            at += room

    def histogram(self, step: int, wall_time: float, tag: str, h: Histogram) -> None:
        """A raw `HistogramProto`: `bucket[i]` counts values up to `bucket_limit[i]`, starting at `min`.

        Only finite values are counted (`num == sum(bucket)`). Degenerate tensors follow what TensorBoard's
        own histogram op writes: no finite value (all NaN/Inf, or empty) -> one empty bucket at 0, which
        readers turn into an empty histogram; a constant tensor -> one zero-width bucket at its value.
        """
        out = self.values(step, wall_time).add(tag=tag).histo
        if h.count == 0:
            out.bucket_limit.append(0.0)
            out.bucket.append(0.0)
            return
        out.min, out.max, out.num, out.sum, out.sum_squares = h.min, h.max, h.count, h.sum, h.sum_squares
        if h.max > h.min:
            limits = list(h.edges[1:])
            limits[-1] = h.max  # exact, whatever the rounding of the computed edges
            out.bucket_limit.extend(limits)
            out.bucket.extend(h.counts)
        else:
            out.bucket_limit.append(h.max)
            out.bucket.append(float(h.count))

    def value(self, step: int, wall_time: float, value: Any) -> None:
        """A `Summary.Value` built elsewhere (text, image, tensor order, packed rows: a few per step at most)."""
        self.values(step, wall_time).append(value)


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
