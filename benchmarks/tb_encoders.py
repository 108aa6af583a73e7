"""Library encoders vs gradlog's hand encoders, on what a measured step really writes.

A real `GradLogger(model, opt, every=1, writer="tensorboard")` on the overhead benchmark's GPT (77 tensors)
and MLP (400 tensors) trains a few steps; the TensorBoard writer's queue items of the last measured step
are captured (scalars, the packed heatmap row, the grad/weight/update histogram blocks) and encoded:

- Event records: `gradlog.writers.tb_format` (wire bytes: a step's scalars and each histogram block laid out
  with numpy, the few other values as protobuf messages) against the same records from `Summary.Value`
  objects copied into a `Summary`, and, with `--old-format`, from an earlier `tb_format` module file (such as
  the per-value `struct` encoder of 1aac06c, or the protobuf-in-place one before 0fd7337); all decode to equal
  `Event` messages (checked here).
- TFRecord framing: `gradlog.writers.tfrecord.frames` (the `crc32c` package) against TensorBoard's own
  `RecordWriter` (its `masked_crc32c`, pure Python when TensorFlow is not installed).
- The overview PNG: gradlog's zlib encoder (`gradlog.writers.png.encode_png`) against Pillow's, on the same
  pixels of overview heatmaps of 77 to 5,000 tensors.

Best of `--repeat` timings, in one process. Run:
    git show 0fd7337^:gradlog/writers/tb_format.py > /tmp/old_tb_format.py
    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/tb_encoders.py --old-format /tmp/old_tb_format.py
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import os
import sys
import tempfile
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import MODELS

from gradlog import GradLogger, HistogramOptions
from gradlog.measure.histogram import Histogram
from gradlog.writers import tb_format, tfrecord
from gradlog.writers.tensorboard import TensorBoardWriter, _encode


class Capture(TensorBoardWriter):
    """The TensorBoard writer with its queue replaced by a list: the exact items its thread would encode."""

    def __init__(self, log_dir: str) -> None:
        super().__init__(log_dir)
        self.items: list[Any] = []

    def _put(self, item: Any) -> None:
        self.items.append(item)


def load(path: str, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def grouped(fmt: Any, items: list[Any], value: Callable[[Any, Any], list[Any]]) -> list[bytes]:
    """The records of `items` from per-value encoders (`value(fmt, item)`): consecutive items of one step
    share Events, a text table gets its own (as `gradlog.writers.tensorboard._encode`)."""
    records: list[bytes] = []
    group: list[Any] = []
    step, wall = 0, 0.0
    for item in items:
        if group and (item[1] != step or item[0] == "t"):
            records += fmt.summary_events(wall, step, group)
            group = []
        if not group:
            step, wall = item[1], item[2]
        group += value(fmt, item)
        if item[0] == "t":
            records += fmt.summary_events(wall, step, group)
            group = []
    if group:
        records += fmt.summary_events(wall, step, group)
    return records


def per_value(fmt: Any, item: Any) -> list[Any]:
    kind, _, _, payload = item
    if kind == "s":
        return [fmt.scalar_value(tag, v) for tag, v in payload]
    if kind == "H":
        return [fmt.histogram_value(tag, h) for tag, h in zip(payload[0], payload[1].values())]
    if kind == "h":
        return [fmt.histogram_value(*payload)]
    if kind == "p":
        return [fmt.packed_value(payload[0], payload[1], dict(payload[2]))]
    if kind == "o":
        return [fmt.order_value(payload)]
    return [fmt.image_value(*payload)] if kind == "i" else [fmt.text_value(*payload)]


def value_objects() -> types.SimpleNamespace:
    """Protobuf the plain way: a `Summary.Value` object per value, copied into `Summary(value=[...])`."""
    from tensorboard.compat.proto import event_pb2, summary_pb2

    value_cls, hist_cls, summary_cls = summary_pb2.Summary.Value, summary_pb2.HistogramProto, summary_pb2.Summary

    def histogram_value(tag: str, h: Histogram) -> Any:
        if h.count == 0:
            return value_cls(tag=tag, histo=hist_cls(bucket_limit=[0.0], bucket=[0.0]))
        limits, counts = ([*h.edges[1:-1], h.max], h.counts) if h.max > h.min else ([h.max], [float(h.count)])
        histo = hist_cls(
            min=h.min, max=h.max, num=h.count, sum=h.sum, sum_squares=h.sum_squares, bucket_limit=limits, bucket=counts
        )
        return value_cls(tag=tag, histo=histo)

    def summary_events(wall_time: float, step: int, values: Sequence[Any]) -> list[bytes]:
        n = tb_format.MAX_VALUES_PER_EVENT
        summaries = [summary_cls(value=values[at : at + n]) for at in range(0, len(values), n)]
        return [event_pb2.Event(wall_time=wall_time, step=step, summary=s).SerializeToString() for s in summaries]

    return types.SimpleNamespace(
        scalar_value=lambda tag, v: value_cls(tag=tag, simple_value=v),
        histogram_value=histogram_value,
        summary_events=summary_events,
        packed_value=tb_format.packed_value,
        order_value=tb_format.order_value,
        text_value=tb_format.text_value,
        image_value=tb_format.image_value,
    )


def interleaved(fns: Sequence[Callable[[], object]], repeat: int) -> list[float]:
    """Best of `repeat` of each, in ms, taking turns (a busy machine's drift lands on all alike)."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, out in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return [1e3 * min(t) for t in times]


def best(fn: Callable[[], object], repeat: int) -> float:
    return interleaved([fn], repeat)[0]


def step_items(name: str, tmp: str, steps: int = 3) -> list[Any]:
    model, loss_fn = MODELS[name].build(torch.device("cpu"))
    opt = MODELS[name].optimizer(model)
    writer = Capture(os.path.join(tmp, name))
    gl = GradLogger(
        model, opt, every=1, writer=writer, print_report=False, histograms=HistogramOptions(overview_every=0)
    )
    for i in range(steps):
        loss_fn(model).backward()
        opt.step()
        gl.log(i)
        opt.zero_grad()
    last = writer.items[-1][1]
    items = [it for it in writer.items if it[1] == last]
    gl.close()
    return items


def records_table(repeat: int, tmp: str, old_format: str | None) -> None:
    from tensorboard.compat.proto import event_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    hand = load(old_format, "old_tb_format") if old_format else None
    events_cls = getattr(hand, "Events", None)
    if events_cls is not None and not hasattr(events_cls, "histograms"):  # before histogram blocks were encoded whole

        def histograms(self: Any, step: int, wall: float, tags: Sequence[str], hists: Any) -> None:
            for tag, h in zip(tags, hists.values()):
                self.histogram(step, wall, tag, h)

        events_cls.histograms = histograms
    objects = value_objects()
    print("| model | values (scalars / histograms) | --old-format encoder ms | `Summary.Value` objects ms |", end="")
    print(" gradlog ms | gradlog / old | bytes | frames (crc32c) ms | TB RecordWriter ms | x |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in ("gpt", "mlp"):
        items = step_items(name, tmp)
        n_scalars = sum(len(it[3]) for it in items if it[0] == "s")
        n_hists = sum(len(it[3][0]) for it in items if it[0] == "H")
        records = _encode(tb_format, items)
        events = [event_pb2.Event.FromString(r) for r in records]
        assert [event_pb2.Event.FromString(r) for r in grouped(objects, items, per_value)] == events
        fns: list[Callable[[], object]] = [
            lambda: _encode(tb_format, items),  # noqa: B023
            lambda: grouped(objects, items, per_value),  # noqa: B023
        ]
        if hand is not None:  # an `Events` module is driven as gradlog's, a per-value one through `grouped`
            old: Callable[[], list[bytes]] = (
                (lambda: _encode(hand, items))  # noqa: B023
                if hasattr(hand, "Events")
                else (lambda: grouped(hand, items, per_value))  # noqa: B023
            )
            assert [event_pb2.Event.FromString(r) for r in old()] == events
            fns.append(old)
        t_new, t_objects, *t_hand = interleaved(fns, repeat)
        hand_ms, ratio = (f"{t_hand[0]:.2f}", f"{t_new / t_hand[0]:.2f}x") if t_hand else ("-", "-")
        t_frames = best(lambda: tfrecord.frames(records), repeat)  # noqa: B023
        rw = RecordWriter(io.BytesIO())
        t_rw = best(lambda: [rw.write(r) for r in records], max(1, repeat // 5))  # noqa: B023
        size = sum(map(len, records))
        print(
            f"| {name} | {n_scalars} / {n_hists} | {hand_ms} | {t_objects:.2f} | {t_new:.2f} | {ratio} | {size:,} |"
            f" {t_frames:.3f} | {t_rw:.1f} | {t_rw / t_frames:.0f}x |"
        )


def png_table(repeat: int) -> None:
    """gradlog's PNG encoder (filter type 0, zlib level 6) against Pillow's (level 6; Pillow picks a filter
    per row for RGB and has no option to turn that off) on the same overview pixels."""
    import numpy as np
    from PIL import Image

    from gradlog.writers import png

    print("| heatmap (tensors x columns) | pixels | gradlog encoder ms | bytes | Pillow ms | bytes |")
    print("|---|---:|---:|---:|---:|---:|")
    gen = np.random.default_rng(0)
    for rows, cols in ((77, 256), (400, 256), (5000, 42), (5000, 256)):
        values = 10 ** gen.uniform(-6, -2, (rows, cols))
        values[::7] = 0.0  # a few tensors that never moved
        cw, ch = png._cell_size(rows, cols, 320, 800)
        colours = png._colour(values, np.ones((rows, cols), dtype=bool), np.zeros((rows, cols), np.uint8), -6.0, 4.0)
        pixels = bytes(png._frame(colours, {r: "stalled" for r in range(0, rows, 13)}, cw, ch, png._STRIP))
        w, h = png._STRIP + 2 + cols * cw, rows * ch

        def pillow(w: int = w, h: int = h, pixels: bytes = pixels) -> bytes:
            buf = io.BytesIO()
            Image.frombuffer("RGB", (w, h), pixels, "raw", "RGB", 0, 1).save(buf, format="PNG", compress_level=6)
            return buf.getvalue()

        ours, theirs = png.encode_png(w, h, pixels), pillow()
        with Image.open(io.BytesIO(ours)) as a, Image.open(io.BytesIO(theirs)) as b:
            assert a.tobytes() == b.tobytes() == pixels  # the same picture
        t_ours, t_pillow = interleaved([lambda: png.encode_png(w, h, pixels), pillow], repeat)  # noqa: B023
        print(f"| {rows} x {cols} | {w}x{h} | {t_ours:.1f} | {len(ours):,} | {t_pillow:.1f} | {len(theirs):,} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--old-format", default=None, help="the hand-encoding tb_format module file (git show ...)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        records_table(args.repeat, tmp, args.old_format)
    print()
    png_table(args.repeat)


if __name__ == "__main__":
    main()
