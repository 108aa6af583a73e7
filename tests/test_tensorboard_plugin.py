"""The gradlog tab in TensorBoard: its data (without a server), then a real `tensorboard` process serving a
planted run (a layer whose lr goes to 0, a NaN gradient), then headless Chromium rendering the tab."""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import json
import math
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from catalogue import free_port, train
from tb_plugin_run import NAN_STEP, NAN_TENSOR, STALL_STEP, STALLED, STEPS, write_run

import gradlog
from gradlog import Reason
from gradlog.verdict.records import format_ranges
from gradlog.views.tensorboard_plugin import data

ROOT = Path(__file__).resolve().parent.parent
ENTRY = "gradlog.views.tensorboard_plugin.plugin:GradlogPlugin"


# --- the data, without TensorBoard ------------------------------------------------------------------------


def test_heatmap_cells_name_every_special_case() -> None:
    names = ["a", "b", "c", "d"]
    ratio = {"a": [(0, 0.5), (1, 0.0)], "b": [(0, 0.0), (1, 0.0)], "c": [(0, math.nan), (1, math.inf)]}
    grad = {"a": [(0, 1.0), (1, 2.0)], "b": [(0, 0.0), (1, 0.0)], "c": [(0, 1.0), (1, 1.0)]}
    steps, cells = data.heatmap(names, "update_ratio", ratio, grad)
    assert steps == [0, 1]
    rows = [list(cells[i * 2 : i * 2 + 2]) for i in range(4)]
    assert rows[0] == [0.5, 0.0]  # 0 with a gradient: no update
    assert rows[1] == [data.ZERO_GRAD, data.ZERO_GRAD]  # 0 because the gradient was all zero
    assert math.isnan(rows[2][0]) and rows[2][1] == math.inf
    assert rows[3] == [data.NO_GRAD, data.NO_GRAD]  # nothing written for d: it never had a gradient


def test_heatmap_marks_steps_without_a_gradient_and_fills_quiet_nonfinite_counts() -> None:
    grad = {"a": [(0, 1.0), (1, 1.0), (2, 1.0)], "b": [(0, 1.0), (2, 3.0)]}
    nonfinite = {"b": [(2, 4.0)]}  # written only once non-zero (writers/quiet.py)
    steps, cells = data.heatmap(["a", "b"], "grad_nonfinite", nonfinite, grad)
    assert steps == [0, 1, 2]
    assert list(cells) == [0.0, 0.0, 0.0, 0.0, data.NO_GRAD, 4.0]
    _, norms = data.heatmap(["a", "b"], "grad_norm", grad, grad)
    assert list(norms) == [1.0, 1.0, 1.0, 1.0, data.NO_GRAD, 3.0]


def test_heatmap_payload_round_trips() -> None:
    steps, cells = data.heatmap(["x.weight"], "grad_norm", {"x.weight": [(3, 0.25)]}, {"x.weight": [(3, 0.25)]})
    header, values = data.decode(data.encode({"names": ["x.weight"], "steps": steps}, cells))
    assert header == {"names": ["x.weight"], "steps": [3]} and values == [0.25]


def test_unknown_metric_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown metric 'loss'; choose from update_ratio"):
        data.heatmap([], "loss", {}, {})


def test_names_follow_the_written_model_order_then_the_rest() -> None:
    tags = ["weights/update_ratio/b", "weights/grad_norm/a", "weights/weight_norm/c", "train/loss", "grad_norm/x"]
    assert data.tensor_names(tags, ["c", "a", "gone"]) == ["c", "a", "b"]  # grad_norm/x: the user's own
    assert data.metric_prefix("grad_norm") == "weights/grad_norm/"
    assert data.has_tensor_series(tags) and not data.has_tensor_series(["train/loss", "grad_norm/x"])


def test_marks_keep_the_strongest_finding() -> None:
    tables = {
        "stalled": (["name", "since_step"], [["s", "5"]]),
        "never_updated": (["name", "shape"], [["w (= tied.w)", "2"]]),
    }
    got = data.marks(tables, {"first_nonfinite_tensor": "s"}, {"s": "no_update", "n": "nonfinite"})
    assert got == {"s": "stalled", "n": "nonfinite", "w": "never_updated"}


def test_provisional_verdict_reads_the_run_level_series() -> None:
    line, final = data.verdict({}, {"gradlog/no_update_tensors": [(0, 0.0), (7, 2.0)], "gradlog/nonfinite_tensors": []})
    assert not final and "at step 7: 2 with no update" in line and "close()" in line
    assert data.verdict({"verdict": "gradlog OK: x"}, {}) == ("gradlog OK: x", True)
    line, final = data.verdict({}, {}, {"a": "no_update", "b": "nonfinite", "c": "nonfinite"}, 41)
    assert not final and "at step 41: 1 with no update; 2 with NaN/Inf" in line  # a run without run-level series


def test_the_entry_point_is_declared_and_loads_the_plugin() -> None:
    from tensorboard.plugins import base_plugin

    text = (ROOT / "pyproject.toml").read_text()
    assert f'[project.entry-points."tensorboard_plugins"]\ngradlog = "{ENTRY}"' in text
    module, _, cls = ENTRY.partition(":")
    plugin = getattr(importlib.import_module(module), cls)
    assert issubclass(plugin, base_plugin.TBPlugin) and plugin.plugin_name == "gradlog"
    static = ROOT / "gradlog" / "views" / "tensorboard_plugin" / "static" / "index.js"
    assert "export async function render()" in static.read_text()  # what plugin_entry.html calls


def test_import_gradlog_does_not_import_the_plugin_or_tensorboard() -> None:
    code = (
        "import sys, gradlog; print(sorted(m for m in sys.modules if m.startswith(('tensorboard', 'gradlog.views'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=_env(None))
    assert out.stdout.strip() == "[]"


# --- a real TensorBoard --------------------------------------------------------------------------------------


def _env(shim: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(ROOT)] + ([str(shim)] if shim is not None else []) + [env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _entry_point_shim(tmp: Path) -> Path | None:
    """CI installs the package (`pip install -e .`), so TensorBoard finds the entry point in its metadata.
    A development venv installed before the entry point existed lacks it: then a folder holding only that
    metadata (the same line as pyproject.toml) is put on PYTHONPATH, so the real entry-point loading runs."""
    if any(ep.name == "gradlog" for ep in importlib.metadata.entry_points(group="tensorboard_plugins")):
        return None
    info = tmp / "shim" / "gradlog_tensorboard_entry-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: gradlog-tensorboard-entry\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[tensorboard_plugins]\ngradlog = {ENTRY}\n")
    return tmp / "shim"


def _get(base: str, path: str, timeout: float = 30.0) -> bytes:
    with urllib.request.urlopen(base + path, timeout=timeout) as r:
        body: bytes = r.read()
        return body


class Server:
    def __init__(
        self, base: str, logdir: Path, expected: dict[str, list[float]], proc: subprocess.Popen[bytes]
    ) -> None:
        self.base, self.logdir, self.expected, self.proc = base, logdir, expected, proc

    def json(self, path: str) -> Any:
        return json.loads(_get(self.base, path))


@contextlib.contextmanager
def _tensorboard(logdir: Path, tmp: Path, runs: set[str]) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A real `tensorboard` process on 127.0.0.1 serving `logdir`, up once gradlog's tab lists `runs`."""
    port = free_port()
    cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--reload_interval", "1"]
    log_path = tmp / f"tensorboard-{port}.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(_entry_point_shim(tmp)))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:  # bounded wait: the server is up and has loaded every run
            assert proc.poll() is None, log_path.read_text()
            try:
                if set(json.loads(_get(base, "/data/plugin/gradlog/runs", 5))) == runs:
                    break
            except (urllib.error.URLError, OSError, ValueError):
                pass
            assert time.monotonic() < deadline, f"tensorboard did not serve {sorted(runs)} within 120 s"
            time.sleep(0.5)
        yield base, proc
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(15)
        log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("tbplugin")
    logdir = tmp / "runs"
    _, expected = write_run(str(logdir / "planted"))
    training = [sys.executable, str(ROOT / "tests" / "tb_plugin_run.py"), "--training", str(logdir / "training")]
    subprocess.run(training, check=True, env=_env(None), timeout=120, capture_output=True)  # no close(): no tables
    _write_moe_run(logdir / "moe")
    _write_ids_run(logdir / "ids")
    with _tensorboard(logdir, tmp, {"planted", "training", "moe", "ids"}) as (base, proc):
        yield Server(base, logdir, expected, proc)


@pytest.mark.slow
def test_plugin_is_listed_and_loads_as_a_module(server: Server) -> None:
    listing = server.json("/data/plugins_listing")
    assert listing["gradlog"]["enabled"] is True
    assert listing["gradlog"]["tab_name"] == "gradlog"
    assert listing["gradlog"]["loading_mechanism"] == {"type": "IFRAME", "module_path": "/data/plugin/gradlog/index.js"}
    assert b"export async function render()" in _get(server.base, "/data/plugin/gradlog/index.js")


@pytest.mark.slow
def test_overview_names_the_planted_findings(server: Server) -> None:
    ov = server.json("/data/plugin/gradlog/overview?run=planted")
    assert ov["final"] is True and ov["verdict"].startswith("gradlog PROBLEM")
    assert f"first non-finite gradient at step {NAN_STEP} in {NAN_TENSOR}" in ov["verdict"]
    assert ov["names"] == [
        "inp.weight", "inp.bias", "stall.weight", "stall.bias", "out.weight", "out.bias",
        "aux.weight", "aux.bias", "unused.weight", "unused.bias",
    ]  # fmt: skip
    assert ov["marks"][STALLED] == "stalled"
    assert ov["marks"][NAN_TENSOR] in ("nonfinite", "stalled")  # NaN weights from step 9: a stall, if close() says so
    assert ov["marks"]["unused.weight"] == "never_updated"
    assert "inp.weight" not in ov["marks"]
    # the tab shows one row per cause: the param group cut to lr 0 is one `stall` row naming its two tensors
    stalled = {r[0]: r for r in ov["tables"]["stalled"]["rows"]}
    assert stalled["stall"][1] == str(STALL_STEP) and stalled["stall"][3] == "zero_lr"
    assert stalled["stall"][4].startswith(f"2 tensors ({STALLED}, stall.bias): ")
    never = ov["tables"]["never_updated"]["rows"]
    assert [r[0] for r in never] == ["unused"] and never[0][4].startswith("2 tensors (unused.weight, unused.bias): ")
    found = {(f["table"], f["label"]): f["tensors"] for f in ov["findings"]}
    assert found[("stalled", "stall")] == [STALLED, "stall.bias"]
    assert found[("never_updated", "unused")] == ["unused.weight", "unused.bias"]
    assert ov["run_level"]["gradlog/no_update_tensors"] == [STEPS - 1, 2.0]  # stall.weight and stall.bias


@pytest.mark.slow
def test_heatmap_values_match_ratios_computed_by_hand(server: Server) -> None:
    header, cells = data.decode(_get(server.base, "/data/plugin/gradlog/heatmap?run=planted&metric=update_ratio"))
    assert header["steps"] == list(range(STEPS))
    n = len(header["steps"])
    row = {name: cells[i * n : (i + 1) * n] for i, name in enumerate(header["names"])}
    for name in ("inp.weight", STALLED, NAN_TENSOR):
        for step, (got, want) in enumerate(zip(row[name], server.expected[name])):
            if math.isnan(want):
                assert math.isnan(got), (name, step)
            else:
                assert got == pytest.approx(want, rel=1e-5, abs=1e-12), (name, step)
    assert all(v == 0.0 for v in row[STALLED][STALL_STEP:]) and all(v > 0 for v in row[STALLED][:STALL_STEP])
    assert all(math.isnan(v) for v in row[NAN_TENSOR][NAN_STEP:])
    assert row["unused.weight"] == [data.NO_GRAD] * STEPS
    _, nf = data.decode(_get(server.base, "/data/plugin/gradlog/heatmap?run=planted&metric=grad_nonfinite"))
    nf_row = nf[header["names"].index(NAN_TENSOR) * n :][:n]
    assert nf_row == [1.0 if s == NAN_STEP else 0.0 for s in range(STEPS)]


@pytest.mark.slow
def test_series_and_a_run_still_training(server: Server) -> None:
    series = server.json(f"/data/plugin/gradlog/series?run=planted&name={STALLED}")
    assert [s for s, _ in series["update_ratio"]] == list(range(STEPS))
    assert set(series) >= {"update_ratio", "grad_norm", "weight_norm"}
    ov = server.json("/data/plugin/gradlog/overview?run=training")
    assert ov["final"] is False and "provisional" in ov["verdict"] and "2 with no update" in ov["verdict"]
    assert ov["marks"][STALLED] == "no_update" and ov["marks"][NAN_TENSOR] == "nonfinite"
    with pytest.raises(urllib.error.HTTPError, match="400"):
        _get(server.base, "/data/plugin/gradlog/heatmap?run=planted&metric=loss")


# --- a real browser ------------------------------------------------------------------------------------------


def _chromium() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


@contextlib.contextmanager
def _browser(tmp_path: Path, width: int = 1600) -> Iterator[Any]:
    """Headless Chromium through chromedriver; skipped where they are missing, except in CI (.ci/run installs
    them), where a missing browser fails the test."""
    found = _chromium()
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("CI must install chromium and chromium-driver (.ci/run does)")
        pytest.skip("headless chromium and chromedriver are not installed (apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = found[0]
    for flag in (
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={width},1000",
    ):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(found[1]), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.mark.slow
def test_the_tab_renders_the_planted_rows_in_chromium(server: Server, tmp_path: Path) -> None:
    with _browser(tmp_path) as driver:
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support.ui import WebDriverWait

        driver.get(server.base + "/#gradlog")
        frame = WebDriverWait(driver, 60).until(lambda d: d.find_element(By.CSS_SELECTOR, "iframe"))
        driver.switch_to.frame(frame)
        WebDriverWait(driver, 60).until(
            lambda d: (
                d.find_elements(By.CSS_SELECTOR, "#gl-canvas[data-first-paint-ms]")
                or d.find_elements(By.ID, "gl-error")
            )
        )
        assert not driver.find_elements(By.ID, "gl-error"), driver.find_element(By.ID, "gl-error").text
        driver.find_element(By.CSS_SELECTOR, "#gl-run").send_keys("planted")
        WebDriverWait(driver, 30).until(lambda d: "PROBLEM" in d.find_element(By.ID, "gl-verdict").text)
        # the run's own findings (the run shown first is another one, also a PROBLEM)
        WebDriverWait(driver, 30).until(
            lambda d: d.find_elements(By.CSS_SELECTOR, f'#gl-marked li[data-name="{STALLED}"]')
        )
        marked: dict[str, set[str]] = {}  # one line per cause: a tensor may be in two (partly, then stalled)
        for e in driver.find_elements(By.CSS_SELECTOR, "#gl-marked li"):
            marked.setdefault(e.get_attribute("data-name"), set()).add(e.get_attribute("data-kind"))
        assert "stalled" in marked[STALLED] and marked[NAN_TENSOR] & {"nonfinite", "stalled"}
        item = driver.find_element(By.CSS_SELECTOR, f'#gl-marked li[data-name="{STALLED}"][data-kind="stalled"]')
        assert STALLED in item.text and "stopped learning" in item.text  # the name is shown, not only an attribute
        # the canvas: the stalled row's marker strip is drawn in the "stalled" colour
        rgba = driver.execute_script(
            "const t = window.gradlog; const r = t.rows.indexOf(t.heat.names.indexOf(arguments[0]));"
            "return Array.from(t.canvas.getContext('2d').getImageData(300 - 5, r * t.rh + t.rh / 2, 1, 1).data);",
            STALLED,
        )
        assert rgba[:3] == [255, 140, 0]
        item.click()  # the tensor's own series
        WebDriverWait(driver, 30).until(lambda d: STALLED in d.find_element(By.ID, "gl-series").text)
        assert driver.find_elements(By.CSS_SELECTOR, '#gl-series canvas[data-metric="update_ratio"]')
        driver.switch_to.default_content()
        driver.save_screenshot(str(tmp_path / "gradlog-tab.png"))
        assert (tmp_path / "gradlog-tab.png").stat().st_size > 10_000
        if os.environ.get("GRADLOG_TAB_PICTURE"):  # how docs/gradlog-tab.png is made: README's picture
            shutil.copyfile(tmp_path / "gradlog-tab.png", os.environ["GRADLOG_TAB_PICTURE"])


def _write_moe_run(log_dir: Path) -> None:
    """A small Mixtral-shaped model (Hugging Face's parameter names: `model.layers.N.block_sparse_moe...`)
    whose router never picks expert 3: its tensors and an unused `lm_head` land in the never-updated
    table with long names and long details."""
    import torch
    from torch import nn

    class Expert(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1, self.w2, self.w3 = nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False), nn.Linear(8, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))

    class Moe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(8, 4, bias=False)
            self.experts = nn.ModuleList(Expert() for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            pick = self.gate(x).softmax(-1)[..., :3]  # the planted bug: expert 3 is never routed to
            return sum(pick[..., i : i + 1] * self.experts[i](x) for i in range(3)) + x

    class Mixtral(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Module()
            self.model.layers = nn.ModuleList(nn.ModuleDict({"block_sparse_moe": Moe()}) for _ in range(2))
            self.lm_head = nn.Linear(8, 8)  # never called

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.model.layers:  # type: ignore[union-attr]
                x = layer["block_sparse_moe"](x)
            return x.pow(2).mean()

    torch.manual_seed(0)
    model = Mixtral()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gl = gradlog.GradLogger(model, opt, writer=gradlog.TensorBoardWriter(str(log_dir)), every=1, print_report=False)
    report = train(opt, gl, 6, lambda step: model(torch.randn(4, 8)))  # Mixtral returns its own loss
    assert {r.name for r in report.never_updated} == {
        f"model.layers.{i}.block_sparse_moe.experts.3.{w}"
        for i in (0, 1)
        for w in ("w1.weight", "w2.weight", "w3.weight", "w3.bias")
    } | {"lm_head.weight", "lm_head.bias"}


#: The ids of `_write_ids_run`'s embedding that no batch holds: every odd one, each its own range.
UNSEEN_IDS = list(range(1, 4000, 2))


def _write_ids_run(log_dir: Path) -> None:
    """An embedding of 4,000 ids fed only the even ones: its partly-updated row lists 2,000 single ids
    (~10,000 characters of indices), the longest cell a real run writes."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(4000, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gl = gradlog.GradLogger(model, opt, writer=gradlog.TensorBoardWriter(str(log_dir)), every=1, print_report=False)
    ids = torch.arange(0, 4000, 2)
    report = train(opt, gl, 3, lambda step: model(ids).pow(2).mean())
    unseen = [r for r in report.partly_updated if r.reason is Reason.NOT_IN_BATCH]
    assert [(r.name, r.indices) for r in unseen] == [("0.weight", tuple(UNSEEN_IDS))]
    assert report.partly_updated[0] is unseen[0]  # the first row of the table


#: Where the tab overflows, at the page, its right-hand pane and each table; every series panel's title.
LAYOUT = """
const pane = document.getElementById('gl-right').getBoundingClientRect();
const doc = document.documentElement;
return {
  page: [doc.scrollWidth, doc.clientWidth], pane: [pane.left, pane.right],
  tables: [...document.querySelectorAll('table.gl')].map((t) => ({
    id: t.id, right: t.getBoundingClientRect().right,
    lastColumnRight: t.querySelector('tr').lastElementChild.getBoundingClientRect().right,
    box: [t.parentElement.scrollWidth, t.parentElement.clientWidth, t.parentElement.getBoundingClientRect().right],
  })),
  panels: [...document.querySelectorAll('#gl-series canvas')].map((c) => {
    const fig = c.closest('figure'), cap = fig && fig.querySelector('figcaption');
    return [c.dataset.metric, cap ? cap.textContent.trim() : null, cap ? cap.getBoundingClientRect().height : 0];
  }),
};"""


#: the Mixtral-shaped run's expert that no token is routed to (in its second layer)
MOE_EXPERT = "model.layers.1.block_sparse_moe.experts.3"


@pytest.mark.slow
def test_the_tab_fits_its_pane_at_1500_px_and_titles_every_series_panel(server: Server, tmp_path: Path) -> None:
    """At a 1500 px wide window, the findings tables of the planted run and of a Mixtral-shaped run (long
    names, long details) end inside the tab's right-hand pane: no column cut at the window's edge, no
    page-wide horizontal scroll; and each series panel of a stalled tensor has a title of its own."""
    with _browser(tmp_path, width=1500) as driver:
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support.ui import WebDriverWait

        driver.get(server.base + "/#gradlog")
        driver.switch_to.frame(WebDriverWait(driver, 60).until(lambda d: d.find_element(By.CSS_SELECTOR, "iframe")))
        WebDriverWait(driver, 60).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#gl-canvas[data-first-paint-ms]"))
        for run, tensor, kind, tables in (
            ("planted", STALLED, "stalled", ["never_updated", "partly_updated", "stalled", "alerts"]),
            # expert 3's w3 (weight and bias) is one finding, listed by (and linked to) its first tensor
            ("moe", f"{MOE_EXPERT}.w3.weight", "never_updated", ["never_updated", "alerts"]),
        ):
            driver.find_element(By.CSS_SELECTOR, "#gl-run").send_keys(run)
            item = f'#gl-marked li[data-name="{tensor}"][data-kind="{kind}"]'  # this run's findings, not the last's
            WebDriverWait(driver, 30).until(lambda d, item=item: d.find_elements(By.CSS_SELECTOR, item))
            if run == "moe":
                assert tensor.replace(".weight", ".bias") in driver.find_element(By.CSS_SELECTOR, item).text
            driver.find_element(By.CSS_SELECTOR, item).click()
            WebDriverWait(driver, 30).until(
                lambda d, tensor=tensor: (
                    tensor in d.find_element(By.ID, "gl-series-title").text
                    and d.find_elements(By.CSS_SELECTOR, "#gl-series canvas")
                )
            )
            got = driver.execute_script(LAYOUT)
            assert got["page"][1] >= 1400 and got["page"][0] <= got["page"][1], (run, got["page"])
            left, right = got["pane"]
            assert left > 300 and right <= got["page"][1], (run, got["pane"])
            ids = [t["id"] for t in got["tables"]]
            assert all(f"gl-table-{k}" in ids for k in tables), (run, ids)
            for t in got["tables"]:  # the whole table is visible in the pane: wrapped, not cut, not scrolled
                assert t["lastColumnRight"] <= right + 0.5 and t["right"] <= right + 0.5, (run, t, right)
                assert t["box"][0] <= t["box"][1] and t["box"][2] <= right + 0.5, (run, t, right)
            panels = got["panels"]
            metrics = [m for m, _, _ in panels]
            assert metrics and metrics[0] in ("update_ratio", "grad_norm", "weight_norm"), (run, panels)
            if run == "planted":  # a stalled tensor: four panels, the fourth (its weight norm) had no title
                assert metrics == ["update_ratio", "grad_norm", "grad_zero_frac", "weight_norm"], panels
            titles = [title for _, title, _ in panels]
            assert all(title and height > 0 for _, title, height in panels), (run, panels)
            assert len(set(titles)) == len(titles) and not any("_" in t for t in titles), titles  # words, not keys
        driver.switch_to.default_content()
        driver.save_screenshot(str(tmp_path / "gradlog-tab-1500.png"))


#: The user's own tags in the wide run: PyTorch's tutorial style, a bare one, Hugging Face / Lightning style.
USER_TAGS = ("Loss/train", "lr", "train/loss", "val/acc")


def _write_wide_run(log_dir: Path, blocks: int = 150) -> int:
    """A run of `2 * blocks` tensors written by gradlog's TensorBoard writer, with the user's own tags
    (USER_TAGS) written beside it by torch's SummaryWriter, as a training script would. Returns the tensor count."""
    import torch
    from torch import nn
    from torch.utils.tensorboard import SummaryWriter

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(blocks)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gl = gradlog.GradLogger(model, opt, log_dir=str(log_dir), every=1, print_report=False)
    own = SummaryWriter(str(log_dir))
    for step in range(3):
        loss = model(torch.randn(4, 2)).pow(2).mean()
        loss.backward()
        opt.step()
        gl.log(step)
        opt.zero_grad()
        for tag in USER_TAGS:
            own.add_scalar(tag, loss.item(), step)
    own.close()
    gl.close()
    return 2 * blocks


@pytest.mark.slow
def test_time_series_lists_run_level_and_user_groups_first(tmp_path: Path) -> None:
    """TensorBoard's own Time Series and Scalars pages, rendered in Chromium for a 300-tensor run plus the
    user's tags: the run-level `gradlog` group and the user's groups come before the per-tensor group
    (`weights`, every per-tensor series), and the two groups Time Series opens are not per-tensor ones."""
    n = _write_wide_run(tmp_path / "runs" / "wide")
    with _browser(tmp_path) as driver, _tensorboard(tmp_path / "runs", tmp_path, {"wide"}) as (base, _):
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support.ui import WebDriverWait

        assert len(json.loads(_get(base, "/data/plugin/gradlog/overview?run=wide"))["names"]) == n
        driver.get(base + "/#timeseries")
        groups = "metrics-card-groups .card-group"
        WebDriverWait(driver, 60).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, groups)) >= 6)
        order = [e.get_attribute("title") for e in driver.find_elements(By.CSS_SELECTOR, groups + " .group-title")]
        opened = [
            e.find_element(By.CSS_SELECTOR, ".group-title").get_attribute("title")
            for e in driver.find_elements(By.CSS_SELECTOR, groups)
            if e.find_elements(By.CSS_SELECTOR, '.expand-group-icon mat-icon[svgicon="expand_less_24px"]')
        ]
        driver.save_screenshot(str(tmp_path / "time-series.png"))
        # Scalars (Polymer, inside shadow roots): its prefix groups, skipping the tag-filter results group
        driver.get(base + "/#scalars")
        script = """
            const out = [];
            const walk = (root) => root.querySelectorAll('*').forEach((el) => {
              if (el.localName === 'tf-category-paginated-view' && el.category && el.category.metadata.type === 1)
                out.push(el.category.name);
              if (el.shadowRoot) walk(el.shadowRoot);
            });
            walk(document);
            return out;"""
        WebDriverWait(driver, 60).until(lambda d: len(d.execute_script(script)) >= 6)
        scalars = driver.execute_script(script)
    assert order.index("gradlog") < order.index("weights") and order.index("train") < order.index("weights")
    assert order == ["Loss", "gradlog", "lr", "train", "val", "weights"]  # TensorBoard's order: code units
    assert opened == ["Loss", "gradlog"]  # Time Series opens the first two groups only
    assert scalars == order


def test_gradient_norms_are_read_only_where_they_change_a_cell() -> None:
    assert not data.needs_gradient("update_ratio", [(0, 0.1), (1, 0.2)], 2)
    assert data.needs_gradient("update_ratio", [(0, 0.1), (1, 0.0)], 2)  # no update, or no gradient?
    assert data.needs_gradient("update_ratio", [(0, 0.1)], 2)  # a missing step
    assert data.needs_gradient("grad_nonfinite", [(0, 1.0)], 1)
    ratio = {"a": [(0, 0.5), (1, 0.0)], "b": [(0, 0.1), (1, 0.2)]}
    full = data.heatmap(["a", "b"], "update_ratio", ratio, {"a": [(0, 1.0), (1, 0.0)], "b": [(0, 1.0), (1, 1.0)]})
    part = data.heatmap(["a", "b"], "update_ratio", ratio, {"a": [(0, 1.0), (1, 0.0)]}, {"a"})
    assert full == part and list(part[1]) == [0.5, data.ZERO_GRAD, pytest.approx(0.1), pytest.approx(0.2)]


@pytest.mark.parametrize("metric", list(data.METRICS))
def test_packed_rows_give_the_same_cells_as_the_scalars(tmp_path: Path, metric: str) -> None:
    """The writer's per-step packed rows (the fast path at 1,000 x 1,000) against the per-tensor scalars,
    both read back with TensorBoard's own EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    write_run(str(tmp_path / "run"))
    acc = EventAccumulator(str(tmp_path / "run"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    order = acc.Tensors("gradlog/tensor_order")[-1].tensor_proto.string_val[0].decode().split("\n")
    blocks = [t for t in acc.Tags()["tensors"] if t.startswith("gradlog/heatmap/")]
    assert len(blocks) == math.ceil(STEPS / 10)  # 10 steps per tag: never sampled down
    points = [(e.step, tensor_util.make_ndarray(e.tensor_proto)) for t in blocks for e in acc.Tensors(t)]
    steps, mats = data.packed_matrices(points, len(order))
    packed = data.packed_heatmap(metric, mats).reshape(-1).tolist()

    def series(family: str) -> dict[str, list[tuple[int, float]]]:
        return {
            n: [(e.step, e.value) for e in acc.Scalars(f"weights/{family}/{n}")]
            for n in order
            if f"weights/{family}/{n}" in acc.Tags()["scalars"]
        }

    ref_steps, ref = data.heatmap(order, metric, series(metric), series("grad_norm"))
    assert steps == ref_steps == list(range(STEPS))
    assert len(packed) == len(ref)
    for i, (a, b) in enumerate(zip(packed, ref)):
        assert (math.isnan(a) and math.isnan(b)) or a == b, (order[i // STEPS], i % STEPS, a, b)
    assert data.packed_live_marks(order, mats) == {
        STALLED: "no_update",
        "stall.bias": "no_update",
        NAN_TENSOR: "nonfinite",
    }


@pytest.mark.slow
def test_a_cell_of_thousands_of_ids_is_folded_until_clicked(server: Server, tmp_path: Path) -> None:
    """The partly-updated row of 2,000 unseen ids shows its first ids and "show all", a few lines high (it was
    a wall of ~10,000 characters); a click on it shows every id, the same list the test fed around."""
    with _browser(tmp_path, width=1500) as driver:
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support.ui import WebDriverWait

        driver.get(server.base + "/#gradlog")
        driver.switch_to.frame(WebDriverWait(driver, 60).until(lambda d: d.find_element(By.CSS_SELECTOR, "iframe")))
        WebDriverWait(driver, 60).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#gl-canvas[data-first-paint-ms]"))
        driver.find_element(By.CSS_SELECTOR, "#gl-run").send_keys("ids")
        cell_css = "#gl-table-partly_updated td.long details.fold"
        WebDriverWait(driver, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, cell_css))
        fold = driver.find_element(By.CSS_SELECTOR, cell_css)
        summary = fold.find_element(By.TAG_NAME, "summary")
        assert summary.text.startswith("1, 3, 5, 7, 9") and "show all" in summary.text
        assert fold.rect["height"] < 150, fold.rect  # a few lines, not the whole list
        summary.click()
        WebDriverWait(driver, 10).until(lambda d: fold.get_attribute("open") is not None)
        shown = fold.find_element(By.CSS_SELECTOR, "span.all").text
        assert shown == ", ".join(str(i) for i in UNSEEN_IDS)
        assert fold.rect["height"] > 300, fold.rect


# --- one finding per cause (issue 41) ---------------------------------------------------------------------------

#: the tab's colours (index.js COLOURS) a test reads back from the heatmap's pixels
NOT_MEASURED_RGB, NO_UPDATE_RGB = [243, 243, 243], [68, 1, 84]


@pytest.mark.slow
def test_the_tab_shows_one_finding_per_cause_and_no_update_for_a_layer_out_of_the_optimizer(tmp_path: Path) -> None:
    """The issue's run (a CNN with `extra` left out of the optimizer, fc1's units killed at two steps) in a real
    TensorBoard and headless Chromium: the Findings list and the Stopped slices table hold one entry per cause
    (the stop steps read from the run's own gradients), each naming the three tensors; no "stalled" word and no
    True/False; `extra`'s update-ratio cells are "no update", not "not measured", and no measured tensor has a
    "not measured" cell; the last step's label lies inside the canvas."""
    from test_causes import TOUCHED, dying_run

    report, stopped = dying_run("tensorboard", tmp_path / "runs" / "dying")
    with _tensorboard(tmp_path / "runs", tmp_path, {"dying"}) as (base, _), _browser(tmp_path, width=1600) as driver:
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support.ui import WebDriverWait

        driver.get(base + "/#gradlog")
        driver.switch_to.frame(WebDriverWait(driver, 60).until(lambda d: d.find_element(By.CSS_SELECTOR, "iframe")))
        WebDriverWait(driver, 60).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#gl-canvas[data-first-paint-ms]"))
        WebDriverWait(driver, 30).until(lambda d: "PROBLEM" in d.find_element(By.ID, "gl-verdict").text)
        assert driver.find_element(By.ID, "gl-verdict").text == report.verdict
        items = [(e.get_attribute("data-kind"), e.text) for e in driver.find_elements(By.CSS_SELECTOR, "#gl-marked li")]
        assert [k for k, _ in items] == ["never_updated"] + ["stopped_slices"] * len(stopped), items
        assert items[0][1].startswith("never updated") and items[0][1].endswith("extra — extra.weight, extra.bias")
        each = " — " + ", ".join(TOUCHED)
        assert all(t.startswith("slices stopped") and t.endswith(each) for _, t in items[1:]), items
        # each cause says which units and from when: three causes of one layer are not three identical lines
        lines = sorted(t.removeprefix("slices stopped").strip().removesuffix(each) for _, t in items[1:])
        assert lines == sorted(f"fc1 {cause_where(units, since)}" for since, units in stopped.items()), items
        table = driver.find_element(By.ID, "gl-table-stopped_slices")
        trs = table.find_elements(By.TAG_NAME, "tr")
        rows = [[td.text for td in tr.find_elements(By.TAG_NAME, "td")] for tr in trs]
        heads = [th.text for th in table.find_elements(By.TAG_NAME, "th")]
        since = heads.index("since_step")
        assert sorted(int(r[since]) for r in rows[1:]) == sorted(stopped)  # one row per cause
        # the table fits its pane, wrapped rather than scrolled (it was 828 px wide in a 645 px pane: nine
        # columns, headings such as last_grad_step and dims such as "rows, elements, columns" kept on one line)
        wide = driver.execute_script(
            "const t = document.getElementById('gl-table-stopped_slices');"
            "return [t.scrollWidth, document.getElementById('gl-right').clientWidth,"
            " [...t.querySelectorAll('th')].map((th) => [th.textContent, th.getBoundingClientRect().width])];"
        )
        assert 0 < wide[0] <= wide[1], str(wide)
        text = driver.find_element(By.ID, "gl-right").text
        assert "stalled" not in text.lower() and "True" not in text and "False" not in text, text
        never = driver.find_element(By.ID, "gl-table-never_updated").text
        assert "extra.weight" in never and never.count("not_in_optimizer") == 1
        cells = driver.execute_script(
            """const t = window.gradlog, ctx = t.canvas.getContext('2d'), out = {};
            t.heat.names.forEach((n, i) => { const r = t.rows.indexOf(i), row = [];
              for (let c = 0; c < t.heat.steps.length; c++)
                row.push(Array.from(
                  ctx.getImageData(300 + c * t.cw + t.cw / 2, r * t.rh + t.rh / 2, 1, 1).data).slice(0, 3));
              out[n] = row; });
            return [out, t.axisLabels, t.canvas.width];"""
        )
        colours, labels, width = cells
        assert all(c == NO_UPDATE_RGB for c in colours["extra.weight"]), colours["extra.weight"][:3]
        assert not [n for n, row in colours.items() if NOT_MEASURED_RGB in row]  # every tensor was measured
        assert labels[-1][0] == str(STEPS_DYING - 1) and labels[-1][2] <= width, labels
        driver.switch_to.default_content()
        driver.save_screenshot(str(tmp_path / "causes.png"))
        if os.environ.get("GRADLOG_CAUSES_PICTURE"):
            shutil.copyfile(tmp_path / "causes.png", os.environ["GRADLOG_CAUSES_PICTURE"])


#: the steps `test_causes.dying_run` trains
STEPS_DYING = 40


def cause_where(units: list[int], since: int) -> str:
    """What the Findings list says of units of fc1 (32) that stopped at `since`, written out here."""
    return f"unit{'s' * (len(units) > 1)} {format_ranges(units, 4)} ({len(units)} of 32) from step {since}"


def test_each_finding_names_its_units_and_step() -> None:
    """The overview's findings (what the tab's Findings list shows): the never-updated layer with no slices,
    each stopped cause with its units and stop step read from the run's own gradients (`dying_run`)."""
    from test_causes import dying_run

    report, stopped = dying_run(gradlog.MemoryWriter())
    got = data.findings(report)
    assert [(f["table"], f["where"]) for f in got[:1]] == [("never_updated", "")]
    assert sorted(f["where"] for f in got[1:]) == sorted(cause_where(u, s) for s, u in stopped.items())
