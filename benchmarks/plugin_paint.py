"""Time to first paint of the gradlog TensorBoard tab at N tensors x S measured steps.

Writes a synthetic run (update ratio and gradient norm per tensor per step, through gradlog's
TensorBoardWriter, one tensor stalled from the middle on and one with NaN at the end), starts
`tensorboard` on 127.0.0.1, waits until it has loaded every point, then:

- times the `/heatmap` data route (server side: reading what TensorBoard loaded, building the payload),
  from the writer's packed per-step rows (the default) and, with `--scalars-only`, from the per-tensor
  scalars alone (runs written by other tools);
- opens the tab in headless Chromium and reads `data-first-paint-ms` from the canvas: from the
  module's render() call to the heatmap drawn (fetching the overview and the heatmap included).

    python benchmarks/plugin_paint.py                 # 1,000 x 1,000
    python benchmarks/plugin_paint.py --tensors 400 --steps 200

Needs tensorboard, selenium, chromium and chromedriver (Debian: apt-get install chromium chromium-driver).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ENTRY = "gradlog.views.tensorboard_plugin.plugin:GradlogPlugin"


def write_run(log_dir: str, tensors: int, steps: int, packed: bool = True) -> str:
    """Write the run; returns the last tensor's name (the run is loaded when its series is)."""
    from gradlog.writers.tensorboard import TensorBoardWriter

    rng = random.Random(0)
    names = [f"blocks.{i // 2}.{'weight' if i % 2 == 0 else 'bias'}" for i in range(tensors)]
    stalled, nan = names[tensors // 3], names[2 * tensors // 3]
    base = {n: 10 ** rng.uniform(-4, -2) for n in names}
    w = TensorBoardWriter(log_dir)
    for s in range(steps):
        scalars: dict[str, float] = {}
        for n in names:
            scalars[f"weights/grad_norm/{n}"] = base[n] * 100 * (1 + 0.1 * rng.random())
        for n in names:
            r = base[n] * (1 + 0.2 * rng.random())
            if n == stalled and s >= steps // 2:
                r = 0.0
            if n == nan and s >= steps - steps // 10:
                r = math.nan
            scalars[f"weights/update_ratio/{n}"] = r
        if packed:
            scalars["gradlog/grad_norm_total"] = 1.0  # marks a measured step: the writer adds its packed row
        w.log_scalars(scalars, s)
        if s % 100 == 0:
            w.flush()
    w.close()
    return names[-1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--screenshot", default=None, help="save the tab as this PNG")
    ap.add_argument("--scalars-only", action="store_true", help="no packed rows: the tab reads the scalars")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gradlog-paint-"))
    t = time.perf_counter()
    last_name = write_run(str(tmp / "runs" / "big"), args.tensors, args.steps, packed=not args.scalars_only)
    print(f"wrote {args.tensors} x {args.steps} (x2 metrics) in {time.perf_counter() - t:.1f} s")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    if not any(ep.name == "gradlog" for ep in importlib.metadata.entry_points(group="tensorboard_plugins")):
        info = tmp / "shim" / "gradlog_tensorboard_entry-0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: gradlog-tensorboard-entry\nVersion: 0\n")
        (info / "entry_points.txt").write_text(f"[tensorboard_plugins]\ngradlog = {ENTRY}\n")
        env["PYTHONPATH"] += os.pathsep + str(tmp / "shim")
    port = free_port()
    cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", str(tmp / "runs"), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--samples_per_plugin", f"scalars={max(1000, args.steps)}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        t = time.perf_counter()
        while True:  # loaded: the last tensor's series has every step
            try:
                with urllib.request.urlopen(f"{base}/data/plugin/scalars/tags", timeout=10) as r:
                    tags = json.loads(r.read()).get("big", {})
                last = tags.get(f"weights/update_ratio/{last_name}")
                if len(tags) >= 2 * args.tensors and last is not None:
                    with urllib.request.urlopen(f"{base}/data/plugin/gradlog/overview?run=big", timeout=120) as r:
                        ov = json.loads(r.read())
                    if len(ov["names"]) == args.tensors:
                        with urllib.request.urlopen(f"{base}/data/plugin/gradlog/heatmap?run=big", timeout=300) as r:
                            n = int.from_bytes(r.read(4), "little")
                            header = json.loads(r.read(n))
                        if len(header["steps"]) == args.steps:
                            break
            except (OSError, ValueError):
                pass
            if time.perf_counter() - t > 1800:
                raise SystemExit("tensorboard did not load the run in 30 minutes")
            time.sleep(2)
        print(f"tensorboard loaded it in {time.perf_counter() - t:.1f} s")
        times = []
        for _ in range(3):
            t = time.perf_counter()
            with urllib.request.urlopen(
                f"{base}/data/plugin/gradlog/heatmap?run=big&metric=update_ratio", timeout=300
            ) as r:
                size = len(r.read())
            times.append(time.perf_counter() - t)
        print(f"/heatmap: {size / 1e6:.1f} MB, {min(times):.2f} s (best of 3; {', '.join(f'{x:.2f}' for x in times)})")
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support.ui import WebDriverWait

        options = webdriver.ChromeOptions()
        options.binary_location = "/usr/bin/chromium"
        for flag in (
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={tmp / 'profile'}", "--window-size=1600,1000",
        ):  # fmt: skip
            options.add_argument(flag)
        driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
        try:
            paints = []
            for _ in range(3):
                driver.get("about:blank")  # a fresh page load each time (same-URL navigation keeps the page)
                driver.get(base + "/#gradlog")
                frame = WebDriverWait(driver, 60).until(lambda d: d.find_element(By.CSS_SELECTOR, "iframe"))
                driver.switch_to.frame(frame)
                canvas = WebDriverWait(driver, 600).until(
                    lambda d: d.find_element(By.CSS_SELECTOR, "#gl-canvas[data-first-paint-ms]")
                )
                paints.append(float(canvas.get_attribute("data-first-paint-ms")))
                redraw = driver.execute_script(
                    "const t = window.gradlog; const a = performance.now(); t.draw(); return performance.now() - a;"
                )
                driver.switch_to.default_content()
            print(
                f"first paint: {min(paints):.0f} ms (best of 3; {', '.join(f'{p:.0f}' for p in paints)}); "
                f"a redraw (filter, selection) {redraw:.0f} ms"
            )
            if args.screenshot:
                driver.save_screenshot(args.screenshot)
        finally:
            driver.quit()
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
