"""gradlog values -> TensorBoard's protobuf messages (scalars, raw histograms, text, custom-scalars layout).

Importing this module imports the `tensorboard` package's protobufs; `TensorBoardWriter` does so only
when it is constructed, so `import gradlog` stays light.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2
from tensorboard.plugins.custom_scalar import layout_pb2

from gradlog.histogram import Histogram

#: One multi-line chart per metric family, each showing every parameter (the custom-scalars tab).
METRICS = ("grad_norm", "update_ratio", "grad_zero_frac", "grad_nonfinite", "weight_norm", "gradlog")
LAYOUT_TAG = "custom_scalars__config__"
#: Values per Event record: few records, yet no single record so large that a torn write loses much.
MAX_VALUES_PER_EVENT = 1024

Value = summary_pb2.Summary.Value
_TEXT_METADATA = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text"))
_LAYOUT_METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="custom_scalars")
)


def scalar_values(scalars: Iterable[tuple[str, float]]) -> list[Any]:
    """Legacy `simple_value` (float32), which every TensorBoard reader understands; NaN/Inf stay as they are."""
    return [Value(tag=tag, simple_value=value) for tag, value in scalars]


def histogram_proto(h: Histogram) -> Any:
    """TensorBoard's raw histogram: `bucket[i]` counts values up to `bucket_limit[i]`, the first starting at `min`.

    Only finite values are counted (`num == sum(bucket)`). Degenerate tensors follow what TensorBoard's own
    histogram op writes: no finite value (all NaN, or empty) -> one empty bucket at 0, which the reader turns
    into an empty histogram; a constant tensor -> a single zero-width bucket at its value.
    """
    if h.count == 0:
        return summary_pb2.HistogramProto(bucket_limit=[0.0], bucket=[0.0])
    moments = {"min": h.min, "max": h.max, "num": float(h.count), "sum": h.sum, "sum_squares": h.sum_squares}
    if not h.max > h.min:
        return summary_pb2.HistogramProto(bucket_limit=[h.max], bucket=[float(h.count)], **moments)
    limits = list(h.edges[1:])
    limits[-1] = h.max  # exact, whatever the rounding of the computed edges
    return summary_pb2.HistogramProto(bucket_limit=limits, bucket=h.counts, **moments)


def histogram_value(tag: str, h: Histogram) -> Any:
    return Value(tag=tag, histo=histogram_proto(h))


def _string_tensor(data: bytes) -> Any:
    return tensor_pb2.TensorProto(
        dtype="DT_STRING", string_val=[data], tensor_shape=tensor_shape_pb2.TensorShapeProto()
    )


def text_value(tag: str, markdown: str) -> Any:
    """A text-plugin summary; TensorBoard renders the string as markdown (tables included)."""
    return Value(tag=tag, metadata=_TEXT_METADATA, tensor=_string_tensor(markdown.encode("utf-8")))


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("\\", "\\\\").replace("|", "\\|") or " "


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-style markdown table; cells are escaped so a `|` or newline in a name cannot break it."""
    lines = ["| " + " | ".join(_cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    if not rows:
        lines += ["", "_(no rows)_"]
    return "\n".join(lines)


def layout_value() -> Any:
    """The custom-scalars layout: category "gradlog", one multi-line chart per metric."""
    charts = [layout_pb2.Chart(title=m, multiline=layout_pb2.MultilineChartContent(tag=[f"^{m}/"])) for m in METRICS]
    layout = layout_pb2.Layout(category=[layout_pb2.Category(title="gradlog", chart=charts)])
    return Value(tag=LAYOUT_TAG, metadata=_LAYOUT_METADATA, tensor=_string_tensor(layout.SerializeToString()))


def header_events(wall_time: float) -> list[bytes]:
    """What every new event file starts with: the format version, then the layout."""
    version = event_pb2.Event(wall_time=wall_time, step=0, file_version="brain.Event:2")
    layout = event_pb2.Event(wall_time=wall_time, step=0, summary=summary_pb2.Summary(value=[layout_value()]))
    return [version.SerializeToString(), layout.SerializeToString()]


def summary_events(wall_time: float, step: int, values: Sequence[Any]) -> list[bytes]:
    """Serialized Events carrying `values`, at most MAX_VALUES_PER_EVENT each."""
    out = []
    for at in range(0, len(values), MAX_VALUES_PER_EVENT):
        summary = summary_pb2.Summary(value=values[at : at + MAX_VALUES_PER_EVENT])
        out.append(event_pb2.Event(wall_time=wall_time, step=step, summary=summary).SerializeToString())
    return out
