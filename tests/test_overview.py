"""Run-level series, the overview image (pixels drawn by gradlog, encoded by Pillow, off the training thread) and its
cadence."""

from __future__ import annotations

import io
import math
import os
import statistics
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import catalogue
import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

import gradlog
from gradlog.writers import png


def test_png_encoder_is_read_back_by_pillow() -> None:
    pixels = bytes([255, 0, 0, 0, 255, 0, 0, 0, 255, 9, 9, 9, 1, 2, 3, 250, 251, 252])  # 3 x 2
    with Image.open(io.BytesIO(png.encode_png(3, 2, pixels))) as im:
        assert im.size == (3, 2) and im.mode == "RGB"
        assert im.tobytes() == pixels
    with pytest.raises(ValueError, match="expected 18 bytes of RGB for 3x2, got 3"):
        png.encode_png(3, 2, b"abc")


def _arrays(
    values: list[list[float | None]], states: list[list[str | None]] | None = None
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """`png.heatmap_png`'s arrays from rows of Python values (None: not measured; ragged rows padded) and
    gradient states ("none", "zero", anything else)."""
    cols = max(len(r) for r in values)
    v = np.full((len(values), cols), np.nan)
    given = np.zeros((len(values), cols), dtype=bool)
    g = np.zeros((len(values), cols), dtype=np.uint8)
    for r, row in enumerate(values):
        for c, x in enumerate(row):
            v[r, c], given[r, c] = (np.nan, False) if x is None else (x, True)
        for c, state in enumerate((states or [[]] * len(values))[r][:cols]):
            g[r, c] = {"none": 1, "zero": 2}.get(state or "", 0)
    return v, given, g


def _colour_by_hand(v: float | None, state: str | None, lo: float, span: float) -> tuple[int, int, int]:
    """One cell's colour as the overview's legend defines it, a Python float at a time."""
    if v is None:
        return png.NO_GRAD if state == "none" else png.MISSING
    if math.isnan(v) or math.isinf(v):
        return png.NONFINITE
    if v <= 0:
        return png.NO_GRAD if state == "none" else png.ZERO_GRAD if state == "zero" else png.NO_UPDATE
    return png.scale_colour((math.log10(v) - lo) / span)


def _range_by_hand(values: list[list[float | None]]) -> tuple[float, float]:
    """log10 of the smallest and largest finite positive value, at least one decade wide."""
    positive = [v for row in values for v in row if v is not None and 0 < v < math.inf]
    if not positive:
        return 0.0, 1.0
    a, b = math.log10(min(positive)), math.log10(max(positive))
    return (a, b) if b > a else (a - 0.5, a + 0.5)


def test_heatmap_cells_marks_and_log_scale() -> None:
    values = [[1e-4, 1e-2, 0.0], [float("nan"), None, 1e-3]]
    grad: list[list[str | None]] = [[None, None, None], [None, "none", None]]
    with Image.open(io.BytesIO(png.heatmap_png(*_arrays(values, grad), {1: "stalled"}))) as im:
        im = im.convert("RGB")
        cw = (im.width - 8) // 3
        ch = im.height // 2
        at = lambda r, c: im.getpixel((8 + c * cw + cw // 2, r * ch + ch // 2))  # noqa: E731
        assert at(0, 0) == png.scale_colour(0.0) and at(0, 1) == png.scale_colour(1.0)  # log10 range -4..-2
        assert at(0, 2) == png.NO_UPDATE and at(1, 0) == png.NONFINITE and at(1, 1) == png.NO_GRAD
        assert at(1, 2) == png.scale_colour(0.5)
        assert im.getpixel((2, ch + ch // 2)) == png.MARKS["stalled"] and im.getpixel((2, ch // 2)) == png.MISSING


def test_heatmap_draws_every_cell_as_the_legend_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every cell of the whole-array drawing against its colour worked out by hand, one Python float at a time:
    every special cell, ragged rows, unknown states, marks (one of an unknown kind, one past the last row), and
    values across 9 decades, coloured in several row blocks."""
    gen = torch.Generator().manual_seed(0)
    specials: list[float | None] = [None, 0.0, -1.0, float("nan"), float("inf"), float("-inf"), 1e-300, 5e-324]
    values: list[list[float | None]] = []
    states: list[list[str | None]] = []
    for r in range(40):
        n = int(torch.randint(1, 13, (1,), generator=gen))
        row: list[float | None] = [float(10 ** (torch.rand(1, generator=gen) * 9 - 8)) for _ in range(n)]
        for c in range(0, n, 3):
            row[c] = specials[(r + c) % len(specials)]
        values.append(row)
        states.append([("none", "zero", None, "other")[(r * c) % 4] for c in range(int(n * 0.7))])
    marks = {0: "stalled", 3: "never_updated", 7: "unknown kind", 99: "stalled"}
    monkeypatch.setattr(png, "_ROW_BLOCK", 7)  # rows coloured in several blocks, the last one short
    lo, hi = _range_by_hand(values)
    cols = max(len(r) for r in values)
    with Image.open(io.BytesIO(png.heatmap_png(*_arrays(values, states), marks))) as im:
        im = im.convert("RGB")
        cw, ch = (im.width - 8) // cols, im.height // len(values)
        for r, row in enumerate(values):
            strip = png.MARKS["stalled"] if r == 0 else png.MARKS["never_updated"] if r == 3 else png.MISSING
            assert im.getpixel((0, r * ch)) == strip and im.getpixel((7, r * ch)) == png.MISSING
            for c in range(cols):
                v = row[c] if c < len(row) else None
                state = states[r][c] if c < len(states[r]) else None
                want = _colour_by_hand(v, state, lo, hi - lo)
                assert im.getpixel((8 + c * cw + cw - 1, r * ch + ch - 1)) == want, (r, c, v, state)


def train(steps: int, **kw: object) -> tuple[gradlog.MemoryWriter, gradlog.Report]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=1, print_report=False, **kw)  # type: ignore[arg-type]
    return mem, catalogue.train(opt, gl, steps, lambda step: model(torch.randn(5, 3)).sum())


def test_images_are_rate_limited_and_the_last_comes_at_close() -> None:
    # default min interval (20 s): the first image, then only the final one
    mem, _ = train(8)
    steps = [s for s, _ in mem.images["gradlog/overview"]]
    assert steps[-1] == 7 and len(steps) <= 3
    with Image.open(io.BytesIO(mem.images["gradlog/overview"][-1][1])) as im:
        assert im.height % 4 == 0  # one band of rows per tensor (4 tensors)
    mem, _ = train(4, histograms=gradlog.HistogramOptions(overview_every=0))
    assert "gradlog/overview" not in mem.images


def test_drawing_happens_off_the_training_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []
    real = png.heatmap_rgb

    def spy(*args: object, **kw: object) -> tuple[int, int, bytes | memoryview]:
        threads.append(threading.current_thread().name)
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr("gradlog.writers.overview.heatmap_rgb", spy)
    mem, _ = train(3, histograms=gradlog.HistogramOptions(overview_every=1))
    # during training: the background thread (once: the 20 s limit); at close: the final one, in close()
    assert threads == ["gradlog-overview", threading.current_thread().name]
    steps = [s for s, _ in mem.images["gradlog/overview"]]
    assert steps in ([0, 2], [2])  # step 0's image if it was ready at a later log(); else superseded at close


def test_bad_overview_every_is_named() -> None:
    with pytest.raises(ValueError, match=r"overview_every must be None \(on histogram steps\), an integer >= 1"):
        train(1, histograms=gradlog.HistogramOptions(overview_every=-1))


def test_run_level_series_count_by_hand() -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(2, 2), "dead": nn.Linear(2, 2), "unused": nn.Linear(2, 2)})
    lrs = {"a": 0.1, "dead": 0.0, "unused": 0.1}
    groups = [{"params": model[k].parameters(), "lr": lr} for k, lr in lrs.items()]
    opt = torch.optim.SGD(groups, lr=0.1)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=1, print_report=False)
    x = torch.randn(4, 2)
    (model["a"](x).sum() + (model["dead"](x) * 0).sum()).backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    gl.log(0)
    gl.close()
    ratios = [
        (torch.linalg.vector_norm(p.detach() - before[n]) / torch.linalg.vector_norm(before[n])).item()
        for n, p in model.named_parameters()
        if p.grad is not None
    ]
    got = {k: v[0][1] for k, v in mem.scalars.items() if k.startswith("gradlog/")}
    assert got["gradlog/no_grad_tensors"] == 2  # unused.weight, unused.bias
    assert got["gradlog/zero_grad_tensors"] == 2  # dead.*: multiplied by 0
    assert got["gradlog/no_update_tensors"] == 2  # dead.*: lr 0 (and a zero gradient)
    assert got["gradlog/nonfinite_tensors"] == 0
    assert got["gradlog/update_ratio_min"] == 0.0
    assert got["gradlog/update_ratio_max"] == pytest.approx(max(ratios), rel=1e-5)
    assert got["gradlog/update_ratio_median"] == pytest.approx(statistics.median(ratios), rel=1e-5, abs=1e-12)


def test_overview_cells_are_the_recorded_steps_transposed() -> None:
    """The overview turns the per-step records (ratios, gradient states) into one row per tensor and one column
    per step; every cell must be the colour worked out by hand from the record: steps recorded before later
    tensors existed (unmeasured), gradient states shorter than their step, NaN/Inf, zeros with each gradient
    state, values across decades; and the marks by tensor name (one for a tensor that is not there)."""
    import array

    from gradlog.writers import overview

    gen = torch.Generator().manual_seed(1)
    n, k = 23, 9
    names = [f"t{i}" for i in range(n)]
    specials = [overview._NONE, 0.0, -2.0, float("nan"), float("inf"), 1e-12]
    ratios: list[array.array[float]] = []
    grads: list[bytes] = []
    for j in range(k):
        m = n - 2 * (k - 1 - j) if j < k - 1 else n  # early steps know fewer tensors
        vals = [float(10 ** (torch.rand(1, generator=gen) * 8 - 7)) for _ in range(m)]
        for i in range(0, m, 4):
            vals[i] = specials[(i + j) % len(specials)]
        ratios.append(array.array("d", vals))
        grads.append(bytes(int(x) for x in torch.randint(0, 3, (m - (j % 2),), generator=gen)))
    marks = {"t0": "stalled", "t5": "never_updated", "absent": "stalled"}
    words = {overview._NO_GRAD: "none", overview._ZERO_GRAD: "zero"}
    cells: list[list[float | None]] = [
        [ratios[j][i] if i < len(ratios[j]) and ratios[j][i] != overview._NONE else None for j in range(k)]
        for i in range(n)
    ]
    states = [[words.get(grads[j][i]) if i < len(grads[j]) else None for j in range(k)] for i in range(n)]
    lo, hi = _range_by_hand(cells)
    with Image.open(io.BytesIO(overview._draw(names, ratios, grads, marks))) as im:
        ch = min(8, 800 // n)
        grow = -(-12 // ch) if n * ch * -(-12 // ch) <= 800 else 1  # rows made tall enough for a name each
        cw = min(8, 320 // k)
        assert im.info["gradlog-cells"] == f"{8 + k * cw}x{n * ch * grow}"
        im = im.convert("RGB")
        for i in range(n):
            y = i * ch * grow
            assert im.getpixel((0, y)) == (png.MARKS[marks[names[i]]] if names[i] in marks else png.MISSING)
            for j in range(k):
                assert im.getpixel((8 + j * cw, y)) == _colour_by_hand(cells[i][j], states[i][j], lo, hi - lo), (i, j)


def test_long_runs_merge_overview_columns_and_each_shows_the_largest_ratio_of_its_steps() -> None:
    """Past `MAX_COLUMNS` published steps, columns merge in pairs (memory and the image stay bounded). Every
    column must show, per tensor, the largest ratio of the steps it spans, from ratios computed by hand; a
    tensor whose lr goes to 0 at step 300 must read "no update" exactly in the columns wholly after it."""
    from gradlog.writers import overview

    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(3, 3), "b": nn.Linear(3, 3)})
    opt = torch.optim.SGD([{"params": model["a"].parameters()}, {"params": model["b"].parameters()}], lr=0.05)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=1, histograms=False, print_report=False)
    names = [n for n, _ in model.named_parameters()]
    by_hand: list[list[float]] = []  # per step, per tensor (named_parameters order)
    steps = 700
    for step in range(steps):
        if step == 300:
            opt.param_groups[1]["lr"] = 0.0
        x = torch.randn(4, 3)
        y = x.flip(1) + 1.0 + 0.1 * torch.randn(4, 3)  # noisy: the weights never settle, nor reach zero
        ((model["a"](x) - y).square().sum() + (model["b"](x) - y).square().sum()).backward()
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        by_hand.append(
            [
                (torch.linalg.vector_norm(p.detach() - b) / torch.linalg.vector_norm(b)).item()
                for p, b in zip(model.parameters(), before)
            ]
        )
        gl.log(step)
        opt.zero_grad()
    ov = gl.overview
    cols = len(ov._ratios)
    assert overview.MAX_COLUMNS // 2 < cols <= overview.MAX_COLUMNS
    ends = ov.steps
    assert ends == sorted(ends) and ends[-1] == steps - 1
    starts = [0] + [e + 1 for e in ends[:-1]]
    rows = [ov.names.index(n) for n in names]
    for j, (lo, hi) in enumerate(zip(starts, ends)):
        for t, r in enumerate(rows):
            want = max(by_hand[s][t] for s in range(lo, hi + 1))
            assert ov._ratios[j][r] == pytest.approx(want, rel=1e-4, abs=1e-12), (names[t], lo, hi)
        stopped = [ov._ratios[j][ov.names.index(n)] for n in ("b.weight", "b.bias")]
        if lo >= 300:
            assert stopped == [0.0, 0.0]
        if hi < 300:
            assert min(stopped) > 0
    gl.close()
    with Image.open(io.BytesIO(mem.images["gradlog/overview"][-1][1])) as im:
        cells_w = int(im.info["gradlog-cells"].split("x")[0])
        assert cells_w <= 8 + overview.MAX_COLUMNS  # marker strip and gap, then at most one pixel per column


def test_merged_overview_cells_keep_blow_ups_and_agree_with_and_without_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    import array

    from gradlog.writers import overview

    none, ok, no_grad, zero = overview._NONE, overview._OK, overview._NO_GRAD, overview._ZERO_GRAD
    nan, inf = float("nan"), float("inf")
    # (a, b) -> merged value; gradient states (a, b) -> merged state. The second column is one row longer.
    cases = [(1e-3, 2e-3, 2e-3), (0.0, 1e-4, 1e-4), (0.0, 0.0, 0.0), (none, 3e-3, 3e-3), (none, none, none)]
    cases += [(nan, 1e-3, nan), (1e-3, inf, inf), (inf, nan, nan), (none, nan, nan), (0.0, -inf, -inf)]
    states = [(ok, ok, ok), (no_grad, no_grad, no_grad), (zero, zero, zero), (no_grad, ok, ok), (zero, no_grad, zero)]
    states += [(ok, zero, ok)] * 5
    ra = array.array("d", [a for a, _, _ in cases])
    rb = array.array("d", [b for _, b, _ in cases] + [5e-3])
    ga = bytes(a for a, _, _ in states)
    gb = bytes([b for _, b, _ in states] + [no_grad])
    monkeypatch.setattr(overview, "_NUMPY_FROM", 0)  # these few rows through numpy too
    for use_numpy in (True, False):
        if not use_numpy:
            monkeypatch.setattr(overview, "_NUMPY_FROM", 1 << 30)  # and through the loop
        values, grads = overview._merge(ra, ga, rb, gb)
        got = list(values)
        want = [w for _, _, w in cases] + [5e-3]  # the row the first column lacks: the second's value
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert (g != g and w != w) or g == w
        assert list(grads) == [w for _, _, w in states] + [no_grad]


NO_PILLOW = """
import sys, importlib.abc, warnings
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "PIL":
            raise ImportError("PIL is not installed")
        return None
sys.meta_path.insert(0, Block())
import importlib.util
importlib.util.find_spec = lambda name, *a: None if name.split(".")[0] == "PIL" else _find(name, *a)
"""


def test_without_pillow_a_memory_run_has_no_overview_image_and_no_warning(tmp_path: Any) -> None:
    """A core install (`pip install gradlog`, writer="memory") has no Pillow: the run goes on without images."""
    code = (
        "import importlib.util\n_find = importlib.util.find_spec\n"
        + NO_PILLOW
        + """
warnings.simplefilter("error")
import torch, gradlog
model = torch.nn.Linear(3, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
mem = gradlog.MemoryWriter()
gl = gradlog.GradLogger(model, opt, writer=mem, every=1, print_report=False)
for step in range(3):
    model(torch.randn(4, 3)).sum().backward(); opt.step(); gl.log(step); opt.zero_grad()
gl.close()
assert "PIL" not in sys.modules
assert not mem.images and len(mem.scalars["weights/grad_norm/weight"]) == 3, (mem.images, mem.scalars)
print("ok")
"""
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_the_overview_image_reads_on_its_own_names_steps_legend_and_no_update_outside_the_optimizer() -> None:
    """TensorBoard's Images tab shows the image alone: each tensor's row has its name (a tick at the row and
    ink right of it), the steps are under the columns, the colour scale and every special colour are in a
    legend; a tensor left out of the optimizer reads 'no update' (it has a gradient, the optimizer never moves
    it), not 'not measured'."""
    from gradlog.writers import overview_labels

    torch.manual_seed(0)
    model = nn.ModuleDict({"kept": nn.Linear(6, 6), "left_out": nn.Linear(6, 6)})
    opt = torch.optim.AdamW(model["kept"].parameters(), lr=1e-2)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=1, print_report=False)
    for step in range(12):
        x = torch.randn(8, 6)
        (model["kept"](x).square().mean() + model["left_out"](x).square().mean()).backward()
        opt.step()
        gl.log(step)
        opt.zero_grad()
    gl.close()
    names = [n for n, _ in model.named_parameters()]
    with Image.open(io.BytesIO(mem.images["gradlog/overview"][-1][1])) as im:
        img = im.convert("RGB")
        cells_w, cells_h = (int(v) for v in im.info[overview_labels.CELLS_KEY].split("x"))
    row_h = cells_h // len(names)
    assert row_h >= 12  # four tensors: rows tall enough for a line of text each
    ink = (40, 40, 40)
    for r, name in enumerate(names):
        mid = r * row_h + row_h // 2
        assert img.getpixel((cells_w + 5, mid)) == ink, name  # the tick joining the name to its row
        text = [img.getpixel((x, mid + dy)) for x in range(cells_w + 10, img.width) for dy in range(-4, 5)]
        assert sum(p != png.MISSING for p in text) > 10, name  # the name's letters
        cell = img.getpixel((cells_w - 2, mid))
        if name.startswith("left_out"):
            assert cell == png.NO_UPDATE, name
        else:
            assert cell not in (png.NO_UPDATE, png.MISSING, png.NO_GRAD), name
    below = [img.getpixel((x, y)) for y in range(cells_h, img.height) for x in range(img.width)]
    assert png.scale_colour(0.0) in below and png.scale_colour(1.0) in below  # the colour bar's ends
    for special in (png.NO_UPDATE, png.NO_GRAD, png.ZERO_GRAD, png.NONFINITE, *png.MARKS.values()):
        assert special in below, special  # each special colour has its swatch
    assert overview_labels.short_name("a" * 50) == "..." + "a" * 37


def test_kept_text_renderings_draw_the_pixels_pillow_draws() -> None:
    """The labels paste each string's rendering kept from an earlier drawing (names repeat on every overview of a
    run): the pixels must be the ones Pillow's own `ImageDraw.text` gives, at every position and twice over."""
    from PIL import Image, ImageDraw, ImageFont

    from gradlog.writers import overview_labels

    font = ImageFont.load_default()
    for text in ("blocks.3.attn.c_proj.weight", "1e-4.2 .. 1e-1.0", "0", "...h.11.mlp.c_fc.bias"):
        for xy in ((0, 0), (7, 3), (31, 17)):
            want = Image.new("RGB", (260, 40), (255, 255, 255))
            ImageDraw.Draw(want).text(xy, text, fill=overview_labels._INK, font=font)
            for _ in range(2):  # the first call renders, the second pastes the kept rendering
                got = Image.new("RGB", (260, 40), (255, 255, 255))
                overview_labels._text(got, xy, text)
                assert got.tobytes() == want.tobytes(), (text, xy)
        assert overview_labels._length(text) == ImageDraw.Draw(want).textlength(text, font=font)
