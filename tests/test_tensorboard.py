"""TensorBoardWriter, checked with TensorBoard's own reader and a real `tensorboard` server.

References: `EventAccumulator` (TensorBoard's Python reader), the `tensorboard` server's HTTP data API
(its Rust data server when installed), TensorBoard's markdown renderer, and tensors recorded by hand
in the training loop (finite counts, min, max).
"""

from __future__ import annotations

import html
import io
import json
import math
import os
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from catalogue import NonfinitePlanted, free_port, mse, plant_nonfinite, train
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from torch import nn

import gradlog
from gradlog.writers.tb_format import CHARTS, markdown_table

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVERY = 10, 3  # measured (and logged) at steps 0, 3, 6, 9
MEASURED = [s for s in range(STEPS) if s % EVERY == 0]


@dataclass
class Run:
    log_dir: Path
    mem: gradlog.MemoryWriter
    report: gradlog.Report
    refs: dict[str, dict[int, dict[str, torch.Tensor]]]  # kind -> step -> name -> tensor recorded by hand


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    torch.manual_seed(0)
    model = NonfinitePlanted()
    const = [model.const]
    opt = torch.optim.SGD(
        [{"params": [p for p in model.parameters() if p is not model.const]}, {"params": const, "lr": 0.0}], lr=0.05
    )
    log_dir = tmp_path_factory.mktemp("tb") / "run"
    mem = gradlog.MemoryWriter()
    tb = gradlog.TensorBoardWriter(log_dir)
    gl = gradlog.GradLogger(
        model, opt, every=EVERY, print_report=False, writer=gradlog.Output(writer=[mem, tb], strict=True)
    )
    refs: dict[str, dict[int, dict[str, torch.Tensor]]] = {"grad": {}, "weight": {}, "update": {}}
    x = torch.randn(16, 6)
    named = dict(model.named_parameters())
    before: dict[str, torch.Tensor] = {}

    def plant_and_record(step: int) -> None:
        plant_nonfinite(model)
        if step in MEASURED:
            refs["grad"][step] = {n: p.grad.clone() for n, p in named.items() if p.grad is not None}
            before.update({n: p.detach().clone() for n, p in named.items()})

    def record_step(step: int) -> None:
        if step in MEASURED:
            refs["weight"][step] = {n: p.detach().clone() for n, p in named.items()}
            refs["update"][step] = {n: p.detach() - before[n] for n, p in named.items()}

    report = train(opt, gl, STEPS, lambda step: mse(model, x), after_backward=plant_and_record, after_step=record_step)
    assert tb.closed and tb.dropped == 0 and len(tb.files) == 1
    return Run(log_dir, mem, report, refs)


def accumulate(path: Path) -> EventAccumulator:
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


def f32(v: float) -> float:
    """TensorBoard stores scalars as float32."""
    return float(np.float32(v))


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == f32(b)


def finite(t: torch.Tensor) -> torch.Tensor:
    return t[torch.isfinite(t)].double()


# --- read back with EventAccumulator ----------------------------------------------------------------


def quiet(tag: str, series: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """What TensorBoard gets of a series: a `grad_nonfinite/` one only from its first non-zero value on."""
    if not tag.startswith("weights/grad_nonfinite/"):
        return series
    first = next((i for i, (_, v) in enumerate(series) if v != 0), len(series))
    return series[first:]


def tb_scalars(run: Run) -> dict[str, list[tuple[int, float]]]:
    """The memory writer's series as the TensorBoard writer writes them (quiet NaN/Inf counts)."""
    expected = {tag: quiet(tag, series) for tag, series in run.mem.scalars.items()}
    return {tag: series for tag, series in expected.items() if series}


def test_every_scalar_equals_what_the_memory_writer_got(run: Run) -> None:
    acc = accumulate(run.log_dir)
    expected = tb_scalars(run)
    assert set(acc.Tags()["scalars"]) == set(expected)
    assert {"weights/grad_norm/lin.weight", "weights/update_ratio/head.bias", "gradlog/grad_norm_total"} <= set(
        run.mem.scalars
    )
    # per-tensor NaN/Inf counts only for the tensors that had some: 400 flat-zero charts are noise
    assert {t for t in expected if t.startswith("weights/grad_nonfinite/")} == {
        "weights/grad_nonfinite/nan_part",
        "weights/grad_nonfinite/nan_all",
        "weights/grad_nonfinite/inf_part",
    }
    for tag, series in expected.items():
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in series], tag
        assert all(same(a, b) for (_, a), (_, b) in zip(got, series)), (tag, got, series)
    # NaN and Inf are written as they are
    assert math.isnan(acc.Scalars("weights/grad_norm/nan_all")[0].value)
    assert acc.Scalars("weights/grad_norm/inf_part")[0].value == math.inf


def test_histograms_count_exactly_the_finite_entries(run: Run) -> None:
    acc = accumulate(run.log_dir)
    assert set(acc.Tags()["histograms"]) == set(run.mem.histograms)
    checked = 0
    for kind, by_step in run.refs.items():
        for name in by_step[0]:
            tag = f"weights/{kind}/{name}"
            events = acc.Histograms(tag)
            assert [e.step for e in events] == MEASURED, tag
            for e in events:
                h, ref = e.histogram_value, finite(by_step[e.step][name])
                assert sum(h.bucket) == h.num == ref.numel(), (tag, e.step)
                assert len(h.bucket) == len(h.bucket_limit)
                assert all(a <= b for a, b in zip(h.bucket_limit, h.bucket_limit[1:])), tag
                if ref.numel():
                    assert h.sum == pytest.approx(ref.sum().item(), rel=1e-5, abs=1e-5)
                    assert h.bucket_limit[-1] == h.max
                    if ref.numel() == by_step[e.step][name].numel():  # no NaN/Inf: the range is the data's
                        assert (h.min, h.max) == pytest.approx((ref.min().item(), ref.max().item()), rel=1e-6)
                checked += 1
    assert checked == 3 * len(MEASURED) * len(run.refs["grad"][0])


def test_degenerate_histograms_are_well_formed(run: Run) -> None:
    acc = accumulate(run.log_dir)
    for tag in (
        "weights/grad/nan_all",
        "weights/weight/nan_all",
        "weights/grad/empty",
        "weights/weight/empty",
    ):  # no finite value at all
        for e in acc.Histograms(tag):
            h = e.histogram_value
            assert (h.num, h.min, h.max, sum(h.bucket)) == (0, 0, 0, 0), tag
    for tag, value in (
        ("weights/weight/const", 2.5),
        ("weights/grad/const", 0.0),
        ("weights/update/const", 0.0),
    ):  # min == max
        for e in acc.Histograms(tag):
            h = e.histogram_value
            assert (h.min, h.max, list(h.bucket_limit), list(h.bucket)) == (value, value, [value], [7.0]), tag
    partial = acc.Histograms("weights/grad/nan_part")[0].histogram_value
    assert partial.num == 5 and all(math.isfinite(v) for v in (partial.min, partial.max, partial.sum))


def test_tables_and_layout(run: Run) -> None:
    acc = accumulate(run.log_dir)
    # gradlog/alerts/table: the alerts the planted bugs raised during training (gradlog/alerts.py)
    assert set(acc.Tags()["tensors"]) == {
        "gradlog/never_updated/table",
        "gradlog/partly_updated/table",
        "gradlog/stalled/table",
        "gradlog/summary",
        "gradlog/alerts/table",
        "custom_scalars__config__",
        "gradlog/tensor_order",  # the model order, read by the gradlog tab
        "gradlog/heatmap/000000",  # the measured steps' packed rows (10 per tag), read by the gradlog tab
        # the answer so far, written on the first histogram step (for a run that never reaches close())
        "gradlog/provisional/never_updated",
        "gradlog/provisional/partly_updated",
        "gradlog/provisional/stalled",
        "gradlog/provisional/summary",
        "gradlog/provisional/alerts",
        # every tracked tensor's name, shape and last update, for a resumed run (gradlog/run/resume.py); not in
        # the Text tab (gradlog's plugin)
        "gradlog/segment",
        "gradlog/provisional/segment",
    }
    summary = acc.Tensors("gradlog/summary")[-1].tensor_proto.string_val[0].decode()
    assert f"| verdict | {run.report.verdict} |" in summary
    table = acc.Tensors("gradlog/never_updated/table")[-1].tensor_proto.string_val[0].decode()
    assert run.report.never_updated, "the planted run has never-updated tensors"
    for rec in run.report.never_updated:
        assert f"| {rec.name} |" in table and str(rec.reason) in table
    layout = layout_pb2.Layout.FromString(acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    charts = [(c.title, list(c.multiline.tag)) for cat in layout.category for c in cat.chart]
    assert charts == [(title, [rx]) for title, rx in CHARTS]


def test_run_level_series_match_the_weights_recorded_by_hand(run: Run) -> None:
    acc = accumulate(run.log_dir)
    tags = [t for t in acc.Tags()["scalars"] if t.startswith("gradlog/")]
    got = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in tags}
    for step in MEASURED:
        grads, updates, after = run.refs["grad"][step], run.refs["update"][step], run.refs["weight"][step]
        ratios, no_update, zero_grad, bad = [], 0, 0, 0
        for name, g in grads.items():
            if not bool(torch.isfinite(g).all()):
                bad += 1
            elif g.numel() and not bool(g.count_nonzero()):
                zero_grad += 1
            before = after[name] - updates[name]
            norm = torch.linalg.vector_norm
            den = norm(before.double()).item() or norm(after[name].double()).item()  # all-zero before: after
            r = torch.linalg.vector_norm(updates[name].double()).item() / den if den else 0.0
            if r == 0.0:
                no_update += 1
            if math.isfinite(r):
                ratios.append(r)
        assert got["gradlog/nonfinite_tensors"][step] == bad == 3  # nan_part, nan_all, inf_part
        assert got["gradlog/zero_grad_tensors"][step] == zero_grad == 1  # const: multiplied by 0
        assert got["gradlog/no_update_tensors"][step] == no_update
        assert got["gradlog/no_grad_tensors"][step] == 0
        assert got["gradlog/update_ratio_min"][step] == pytest.approx(min(ratios), rel=1e-5)
        assert got["gradlog/update_ratio_median"][step] == pytest.approx(float(np.median(ratios)), rel=1e-5)
        assert got["gradlog/update_ratio_max"][step] == pytest.approx(max(ratios), rel=1e-5)


def test_overview_image_in_the_images_tab(run: Run) -> None:
    from PIL import Image

    acc = accumulate(run.log_dir)
    assert acc.Tags()["images"] == ["gradlog/overview"]
    images = acc.Images("gradlog/overview")
    assert images[-1].step == MEASURED[-1]  # the final one, at close, with the findings marked
    final = Image.open(io.BytesIO(images[-1].encoded_image_string)).convert("RGB")
    assert (final.width, final.height) == (images[-1].width, images[-1].height)
    order = acc.Tensors("gradlog/tensor_order")[-1].tensor_proto.string_val[0].decode().split("\n")
    assert order == [n for n, _ in NonfinitePlanted().named_parameters()]  # model order
    cells_w, cells_h = (int(v) for v in final.info["gradlog-cells"].split("x"))  # the words sit right and below
    row_h = cells_h // len(order)
    assert row_h * len(order) == cells_h and final.height > cells_h and final.width > cells_w
    never = {r.name for r in run.report.never_updated}
    assert never, "the planted run has a never-updated tensor"
    for i, name in enumerate(order):
        strip = final.getpixel((2, i * row_h + row_h // 2))
        if name in never:
            assert strip == (230, 0, 0), name  # marked red
        elif name != run.report.first_nonfinite.name:  # type: ignore[union-attr]
            assert strip == (255, 255, 255), name
    # the all-NaN tensor's cells are red (NaN/Inf), the zero-gradient const's cells black
    nan_row = order.index("nan_all") * row_h + row_h // 2
    assert final.getpixel((cells_w - 2, nan_row)) == (230, 0, 0)
    const_row = order.index("const") * row_h + row_h // 2
    assert final.getpixel((cells_w - 2, const_row)) == (0, 0, 0)


def test_markdown_tables_render_as_tables_in_tensorboard() -> None:
    from tensorboard.plugin_util import markdown_to_safe_html

    out = markdown_to_safe_html(markdown_table(["name", "detail"], [["a|b", "two\nlines"], ["c", ""]]))
    assert out.count("<tr>") == 3 and out.count("<td>") == 4
    assert "<td>a|b</td>" in out and "<td>two lines</td>" in out
    assert "no rows" in markdown_to_safe_html(markdown_table(["k"], []))


def test_step_records_hold_tensorboard_histograms_and_float32_scalars() -> None:
    from tensorboard.compat.proto import event_pb2, summary_pb2

    from gradlog.writers import tb_format

    spread = gradlog.Histogram((3.0, 0.0, 2.0), -1.5, 4.5, 7.0, 30.0, 5, 2)
    const = gradlog.Histogram((4.0, 0.0), 2.5, 2.5, 10.0, 25.0, 4, 0)
    empty = gradlog.Histogram((0.0, 0.0), 0.0, 0.0, 0.0, 0.0, 0, 3)
    long_tag = "weights/grad_norm/" + "é" * 200  # multi-byte length prefix and UTF-8
    scalars = [("a", 1.25), ("b", math.nan), ("c", -math.inf), ("d", 1e39), (long_tag, 3.0)]
    for step in (0, 7, 300, 2**40, -3):
        out = tb_format.Events()
        out.scalars(step, 12.5, scalars)
        for tag, h in (("h/spread", spread), ("h/c", const), ("h/e", empty)):
            out.histogram(step, 12.5, tag, h)
        out.end()
        (record,) = out.records
        got = event_pb2.Event.FromString(record)
        assert (got.wall_time, got.step) == (12.5, step)
        simple = [(v.tag, v.simple_value) for v in got.summary.value[:5]]
        with np.errstate(over="ignore"):  # 1e39 is inf in float32, as in TensorBoard
            expected = [(t, float(np.float32(v))) for t, v in scalars]
        assert [t for t, _ in simple] == [t for t, _ in expected]
        assert all(same(a, b) for (_, a), (_, b) in zip(simple, expected))
        hists = [v.histo for v in got.summary.value[5:]]
        assert hists[0] == summary_pb2.HistogramProto(
            min=-1.5, max=4.5, num=5, sum=7.0, sum_squares=30.0, bucket_limit=[0.5, 2.5, 4.5], bucket=[3, 0, 2]
        )
        assert hists[1] == summary_pb2.HistogramProto(
            min=2.5, max=2.5, num=4, sum=10.0, sum_squares=25.0, bucket_limit=[2.5], bucket=[4]
        )
        assert hists[2] == summary_pb2.HistogramProto(bucket_limit=[0.0], bucket=[0.0])
    # at most MAX_VALUES_PER_EVENT values an Event, one wall time a step; a new step starts a new Event
    out = tb_format.Events()
    out.scalars(4, 1.0, [("x", 0.5)])
    out.scalars(4, 2.0, [(f"s/{i}", float(i)) for i in range(2500)])
    out.histogram(5, 3.0, "h", spread)
    out.end()
    events = [event_pb2.Event.FromString(r) for r in out.records]
    assert [(e.step, e.wall_time, len(e.summary.value)) for e in events] == [
        (4, 1.0, 1024),
        (4, 1.0, 1024),
        (4, 1.0, 453),
        (5, 3.0, 1),
    ]
    assert [v.simple_value for e in events[:3] for v in e.summary.value] == [0.5] + [float(i) for i in range(2500)]


def _proto_histogram(h: gradlog.Histogram) -> Any:
    """What a `Histogram` is as a `HistogramProto`, built with protobuf's own classes (the reference the hand
    encoder is checked against): TensorBoard's bucket convention, degenerate rows as its histogram op writes them."""
    from tensorboard.compat.proto import summary_pb2

    if h.count == 0:
        return summary_pb2.HistogramProto(bucket_limit=[0.0], bucket=[0.0])
    out = summary_pb2.HistogramProto(min=h.min, max=h.max, num=h.count, sum=h.sum, sum_squares=h.sum_squares)
    if h.max > h.min:
        out.bucket_limit.extend([*h.edges[1:-1], h.max])
        out.bucket.extend(h.counts)
    else:
        out.bucket_limit.append(h.max)
        out.bucket.append(float(h.count))
    return out


def test_hand_encoded_events_are_the_bytes_protobuf_writes() -> None:
    """The step's scalars and histogram blocks are encoded by hand (numpy, wire bytes): every record parses
    with TensorBoard's protobuf classes and serializes back to the same bytes (canonical: field order, proto3
    zero omission, -0.0 kept, negative steps), and each value equals what protobuf builds from the same numbers."""
    from tensorboard.compat.proto import event_pb2, summary_pb2

    from gradlog.measure.histogram import Histograms
    from gradlog.writers import tb_format

    rng = np.random.default_rng(5)
    specials = [0.0, -0.0, math.nan, math.inf, -math.inf, 1e-320, 1e308]
    for bins in (1, 2, 15, 16, 64, 512):
        n = 40
        counts = rng.integers(0, 1000, (n, bins)).astype(np.int32)
        counts[3] = 0  # no finite value
        counts[4, 1:] = 0  # a constant tensor's one bucket (max == min below)
        moments = np.sort(rng.normal(size=(n, 2)), axis=1)
        moments = np.concatenate([moments, rng.normal(size=(n, 2)) * 10, rng.integers(0, 3, (n, 1))], axis=1)
        moments[4, 1] = moments[4, 0]
        for i in range(5, n):  # zeros and odd values in every field of some rows
            if rng.random() < 0.4:
                moments[i, rng.integers(0, 4)] = specials[rng.integers(0, len(specials))]
        as_float = rng.random() < 0.5  # counts that come as floats, some fractional or negative (read as 0)
        block = torch.from_numpy(counts.astype(np.float64) + (rng.random((n, bins)) - 0.3 if as_float else 0))
        hists = Histograms.of(block if as_float else torch.from_numpy(counts), torch.from_numpy(moments), range(n))
        tags = [("" if i == 7 else f"gradlog/grad/layer{i}.weight" + "é" * (i * 3)) for i in range(n)]
        for step, wall in ((0, 0.0), (7, -0.0), (-3, 12.5), (2**40, 1.5e9)):
            out = tb_format.Events()
            out.scalars(step, wall, [("a", 1.25), ("b", -0.0), ("", 3.0)])
            out.histograms(step, wall, tags, hists)
            out.value(step, wall, tb_format.text_value("t", "| a |"))
            out.histogram(step, wall, "one", next(iter(hists.values())))
            out.end()
            (record,) = out.records
            got = event_pb2.Event.FromString(record)
            assert got.SerializeToString() == record
            assert (got.step, got.wall_time) == (step, wall)
            values = list(got.summary.value)
            assert [v.tag for v in values] == ["a", "b", "", *tags, "t", "one"]
            expected = [_proto_histogram(h) for h in hists.values()]
            for v, want in zip(values[3 : 3 + n], expected):
                assert v.WhichOneof("value") == "histo"
                assert v.histo.SerializeToString() == want.SerializeToString()
            assert values[-1].histo.SerializeToString() == expected[0].SerializeToString()
            reference = summary_pb2.Summary.Value(tag="t")
            reference.CopyFrom(tb_format.text_value("t", "| a |"))
            assert values[-2] == reference


# --- the real server ----------------------------------------------------------------------------------


@pytest.fixture
def server(run: Run) -> Iterator[str]:
    port = free_port()
    cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", str(run.log_dir.parent)]
    cmd += ["--port", str(port), "--host", "127.0.0.1", "--reload_interval", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "tensorboard exited"
            try:  # up, and every scalar and text tag loaded
                tags = get(url, "/data/plugin/scalars/tags").get("run", {})
                if set(tags) >= set(tb_scalars(run)) and len(get(url, "/data/plugin/text/tags").get("run", [])) == 10:
                    break
            except (urllib.error.URLError, ConnectionError, json.JSONDecodeError):
                pass
            assert time.monotonic() < deadline, "tensorboard did not serve the run within 60 s"
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def get(url: str, path: str, **query: str) -> Any:
    full = url + path + ("?" + urllib.parse.urlencode(query) if query else "")
    with urllib.request.urlopen(full, timeout=10) as r:
        return json.loads(r.read())


@pytest.mark.slow
def test_tensorboard_server_serves_scalars_histograms_text_and_layout(run: Run, server: str) -> None:
    tags = get(server, "/data/plugin/scalars/tags")
    assert set(tags["run"]) == set(tb_scalars(run))
    for tag in ("weights/grad_norm/lin.weight", "weights/update_ratio/head.bias", "weights/grad_norm/nan_all"):
        got = [
            (step, float(value)) for _, step, value in get(server, "/data/plugin/scalars/scalars", run="run", tag=tag)
        ]
        assert len(got) == len(run.mem.scalars[tag])
        assert all(s == t and same(a, b) for (s, a), (t, b) in zip(got, run.mem.scalars[tag])), (tag, got)

    assert set(get(server, "/data/plugin/histograms/tags")["run"]) == set(run.mem.histograms)
    for name in ("lin.weight", "nan_part", "nan_all", "empty", "const"):
        series = get(server, "/data/plugin/histograms/histograms", run="run", tag=f"weights/grad/{name}")
        assert [step for _, step, _ in series] == MEASURED
        for _, step, buckets in series:
            assert sum(c for _, _, c in buckets) == finite(run.refs["grad"][step][name]).numel(), name
            assert all(left <= right for left, right, _ in buckets), name
    const = get(server, "/data/plugin/histograms/histograms", run="run", tag="weights/weight/const")
    assert all(buckets == [[2.5, 2.5, 7.0]] for _, _, buckets in const)

    text = get(server, "/data/plugin/text/text", run="run", tag="gradlog/summary")
    rendered = html.unescape(text[-1]["text"])
    assert "<table>" in rendered and run.report.verdict in rendered
    assert sorted(get(server, "/data/plugin/text/tags")["run"]) == [
        "gradlog/alerts/table",
        "gradlog/never_updated/table",
        "gradlog/partly_updated/table",
        "gradlog/provisional/alerts",  # issue 15: the answer so far, from the first histogram step
        "gradlog/provisional/never_updated",
        "gradlog/provisional/partly_updated",
        "gradlog/provisional/stalled",
        "gradlog/provisional/summary",
        "gradlog/stalled/table",
        "gradlog/summary",
    ]
    text = get(server, "/data/plugin/text/text", run="run", tag="gradlog/never_updated/table")
    assert all(r.name in text[-1]["text"] for r in run.report.never_updated)

    layout = get(server, "/data/plugin/custom_scalars/layout")
    assert [c["title"] for c in layout["category"][0]["chart"]] == [title for title, _ in CHARTS]


# --- durability and failures ---------------------------------------------------------------------------


def child(mode: str, log_dir: Path) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, str(ROOT / "tests" / "tb_child.py"), mode, str(log_dir)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)


@pytest.mark.slow
def test_kill_9_loses_no_logged_step(tmp_path: Path) -> None:
    proc = child("kill", tmp_path)
    last, deadline = -1, time.monotonic() + 60
    try:
        assert proc.stdout is not None
        while last < 12:
            assert time.monotonic() < deadline, f"the child logged only {last + 1} steps in 60 s"
            if select.select([proc.stdout], [], [], 1.0)[0]:
                line = proc.stdout.readline()
                assert line, f"the child exited early with {proc.poll()}"
                last = int(line.split()[1])
        os.kill(proc.pid, signal.SIGKILL)  # the child now hangs right after log(12) returned
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    acc = accumulate(tmp_path / "run")
    assert last == 12
    for tag in ("weights/grad_norm/0.weight", "weights/update_ratio/15.bias", "gradlog/grad_norm_total"):
        assert [e.step for e in acc.Scalars(tag)] == list(range(13)), tag
    for tag in ("weights/grad/0.weight", "weights/weight/15.bias", "weights/update/15.bias"):
        assert [e.step for e in acc.Histograms(tag)] == list(range(13)), tag


@pytest.mark.slow
def test_closed_at_interpreter_exit_when_forgotten(tmp_path: Path) -> None:
    proc = child("exit", tmp_path)
    proc.communicate(timeout=120)
    assert proc.returncode == 0
    acc = accumulate(tmp_path / "run")
    assert [e.step for e in acc.Scalars("weights/grad_norm/0.weight")] == [0, 1, 2, 3, 4]
    assert {"gradlog/never_updated/table", "gradlog/summary"} <= set(acc.Tags()["tensors"])
    bare = accumulate(tmp_path / "bare")
    assert [(e.step, e.value) for e in bare.Scalars("bare/y")] == [(7, -2.0)]


def tiny_training(writer: Any, steps: int = 6, **kw: Any) -> gradlog.Report:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = gradlog.Output(writer, options=kw.pop("writer_options", {}), strict=kw.pop("strict", False))
    gl = gradlog.GradLogger(model, opt, writer=out, every=1, print_report=False, **kw)
    return train(opt, gl, steps, lambda step: model(torch.randn(4, 3)).sum())


def gradlog_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("gradlog:")]


def test_unwritable_log_dir_warns_once_and_training_completes(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    mem = gradlog.MemoryWriter()
    tb = gradlog.TensorBoardWriter(blocker / "run", retry_secs=0)  # retry (and fail) at every step
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = tiny_training([mem, tb])
    messages = gradlog_warnings(caught)
    assert len(messages) == 1 and "cannot write" in messages[0] and "a_file" in messages[0], messages
    assert report.measured_steps == 6 and [s for s, _ in mem.scalars["weights/grad_norm/weight"]] == list(range(6))
    assert tb.files == [] and tb.dropped > 0


def test_unwritable_log_dir_by_name(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.warns(RuntimeWarning, match="TensorBoard cannot write"):
        report = tiny_training(["memory", "tensorboard"], log_dir=str(tmp_path / "f" / "run"))
    assert report.measured_steps == 6


def test_strict_mode_raises_instead(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(RuntimeError, match=r"TensorBoard cannot write to .*NotADirectoryError"):
        tiny_training("tensorboard", log_dir=str(tmp_path / "f" / "run"), strict=True, writer_options={"strict": True})


def test_the_loggers_strict_mode_reaches_the_writer(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(RuntimeError, match=r"TensorBoard cannot write to .*NotADirectoryError"):
        tiny_training("tensorboard", log_dir=str(tmp_path / "f" / "run"), strict=True)


def test_vanished_log_dir_warns_once_and_continues_in_a_new_file(tmp_path: Path) -> None:
    import shutil

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tb = gradlog.TensorBoardWriter(tmp_path / "run")
    gl = gradlog.GradLogger(model, opt, writer=tb, every=1, print_report=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        def loss(step: int) -> torch.Tensor:
            if step in (3, 6):
                shutil.rmtree(tmp_path / "run")
            return model(torch.randn(4, 3)).sum()

        train(opt, gl, 8, loss)
    messages = gradlog_warnings(caught)
    assert len(messages) == 1 and "deleted" in messages[0], messages
    assert len(tb.files) == 3 and [Path(f).exists() for f in tb.files] == [False, False, True]
    acc = accumulate(tmp_path / "run")
    assert [e.step for e in acc.Scalars("weights/grad_norm/weight")] == [6, 7]
    assert "gradlog/summary" in acc.Tags()["tensors"] and "custom_scalars__config__" in acc.Tags()["tensors"]


def test_restart_writes_a_new_file_and_never_touches_the_old(tmp_path: Path) -> None:
    first = gradlog.TensorBoardWriter(tmp_path)
    tiny_training(first, steps=3)
    old = Path(first.files[0])
    size = old.stat().st_size
    with old.open("ab") as f:
        f.write(b"\x13\x00torn")  # a crash left a torn record at the end of the old file
    second = gradlog.TensorBoardWriter(tmp_path)
    tiny_training(second, steps=5)
    assert len(second.files) == 1 and second.files[0] != first.files[0]
    assert old.stat().st_size == size + 6
    acc = accumulate(tmp_path)  # the reader sees both runs' files
    assert sorted(e.step for e in acc.Scalars("weights/grad_norm/weight")) == [0, 0, 1, 1, 2, 2, 3, 4]


def test_default_writer_is_tensorboard_in_one_new_run_folder_per_logger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    tiny_training("tensorboard", steps=2)
    tiny_training("tensorboard", steps=2)
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2 and all(socket.gethostname() in r.name for r in runs)
    for r in runs:
        assert [e.step for e in accumulate(r).Scalars("weights/grad_norm/weight")] == [0, 1]
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    gl = gradlog.GradLogger(model, torch.optim.SGD(model.parameters(), lr=0.1), print_report=False)
    assert [type(w).__name__ for w in gl.writers.writers] == ["TensorBoardWriter"]
    gl.close()
    assert len(list((tmp_path / "runs").iterdir())) == 3


def test_nothing_is_created_until_something_is_logged_and_close_is_idempotent(tmp_path: Path) -> None:
    tb = gradlog.TensorBoardWriter(tmp_path / "run")
    tb.flush()
    tb.close()
    tb.close()
    assert not (tmp_path / "run").exists()
    with pytest.raises(RuntimeError, match="TensorBoardWriter is closed"):
        tb.log_scalars({"a": 1.0}, 0)


def test_bad_options_are_named() -> None:
    with pytest.raises(ValueError, match="max_queue must be >= 1, got 0"):
        gradlog.TensorBoardWriter("x", max_queue=0)
    with pytest.raises(ValueError, match="flush_timeout must be > 0 seconds, got -1"):
        gradlog.TensorBoardWriter("x", flush_timeout=-1)


def test_import_gradlog_does_not_import_tensorboard() -> None:
    code = "import sys, gradlog; print(sorted({m.split('.')[0] for m in sys.modules} & {'tensorboard', 'crc32c'}))"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_demo_writes_under_runs_and_prints_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gradlog.cli.entry import main

    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--steps", "20", "--every", "5"]) == 0
    out = capsys.readouterr().out
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert f"runs/{run_dir.name}" in out and "tensorboard --logdir runs" in out
    assert [e.step for e in accumulate(run_dir).Scalars("weights/grad_norm/head.weight")] == [0, 5, 10, 15]
    assert main(["demo", "--steps", "5", "--writer", "memory"]) == 0
    assert "tensorboard --logdir" not in capsys.readouterr().out
    assert len(list((tmp_path / "runs").iterdir())) == 1


def test_missing_tensorboard_names_the_extra() -> None:
    script = (
        "import sys; sys.modules['tensorboard'] = None\n"
        "import torch, gradlog\n"
        "try:\n"
        "    gradlog.GradLogger(torch.nn.Linear(2, 2), None, print_report=False)\n"
        "except ImportError as e:\n"
        "    print('ERR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert "pip install 'gradlog[tensorboard]'" in out.stdout and "writer='memory'" in out.stdout


def test_reader_keeps_model_order(run: Run) -> None:
    from gradlog.readers.run import load

    data = load(str(run.log_dir))
    order = [n for n, _ in NonfinitePlanted().named_parameters()]
    assert [t.split("/", 2)[2] for t in data.scalars if t.startswith("weights/weight_norm/")] == order


def test_a_step_with_more_histograms_than_one_queue_block_is_written_whole(tmp_path: Path) -> None:
    """300 tensors: a step's weight histograms travel as several blocks of rows (issue 17's memory
    fix); every one reaches the file, counted and summed like the weights recorded by hand."""
    from gradlog.writers import tensorboard as tb_module

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(150)])
    assert len(list(model.parameters())) > tb_module._BLOCK_ROWS
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gl = gradlog.GradLogger(model, opt, writer="tensorboard", log_dir=str(tmp_path), every=1, print_report=False)
    weights: list[dict[str, torch.Tensor]] = []
    for step in range(2):
        model(torch.randn(4, 3)).pow(2).mean().backward()
        opt.step()
        gl.log(step)
        weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
        opt.zero_grad()
    gl.close()
    acc = accumulate(tmp_path)
    for name in weights[0]:
        for kind in ("grad", "weight", "update"):
            assert [e.step for e in acc.Histograms(f"weights/{kind}/{name}")] == [0, 1], (kind, name)
        for e in acc.Histograms(f"weights/weight/{name}"):
            w = weights[e.step][name].double()
            h = e.histogram_value
            assert sum(h.bucket) == h.num == w.numel()
            assert h.sum == pytest.approx(w.sum().item(), abs=1e-6 * w.abs().sum().item())  # summed in float32
            assert (h.min, h.max) == (w.min().item(), w.max().item())
