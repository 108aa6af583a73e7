"""In-process A/B of the CPU histogram code: this checkout's `histogram_partials` against another copy of
`gradlog/measure/bucketing.py` (e.g. main's), patched in turn into the meter of GradLoggers that train their own
copies of a benchmark model with histograms every step, interleaved step by step.

    git show main:gradlog/measure/bucketing.py > /tmp/old_bucketing.py
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/histogram_ab.py /tmp/old_bucketing.py --model mlp --writer wandb

Prints, per variant, the window (optimizer step + gl.log) and the time inside `histogram_partials` per step
(min and median), and first checks that both give the same rows bit for bit on the model's own tensors.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead

import gradlog
from gradlog.measure import meter

Partials = Callable[..., torch.Tensor]


def load_old(path: str) -> Partials:
    spec = importlib.util.spec_from_file_location("old_stats", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fn: Partials = mod.histogram_partials

    def old(xs: list[torch.Tensor], bins: int, device: torch.device, negate: bool = False) -> torch.Tensor:
        if negate:  # what the meter did before `negate=`: negate in place, then bucket
            torch._foreach_neg_(list(xs))
        return fn(xs, bins, device)

    return old


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", help="path of the other bucketing.py (stats.py before the split)")
    ap.add_argument("--model", default="mlp", help="a model of benchmarks/overhead.py (mlp, gpt, ...)")
    ap.add_argument("--writer", default="memory", help="memory, tensorboard or wandb (offline)")
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    new, old = meter.histogram_partials, load_old(args.old)
    spec = overhead.model_specs()[args.model]
    cpu = torch.device("cpu")

    model, _ = spec.build(cpu)
    xs = [p.detach() for p in model.parameters()]
    for negate in (False, True):
        a = new([x.clone() for x in xs], 64, cpu, negate=negate)
        b = old([x.clone() for x in xs], 64, cpu, negate=negate)
        assert torch.equal(a, b), f"rows differ (negate={negate})"

    acc: list[float] = []
    runs: dict[str, dict[str, Any]] = {}
    for name, fn in (("scalars only", None), ("other", old), ("this checkout", new)):
        net, loss_fn = spec.build(cpu)
        opt = spec.optimizer(net)
        kw: dict[str, Any] = {"histograms": False, "writer": "memory"} if fn is None else {"writer": args.writer}
        if kw["writer"] in ("wandb", "tensorboard"):
            kw["log_dir"] = tempfile.mkdtemp()
        if kw["writer"] == "wandb":
            kw["writer"] = gradlog.Output("wandb", options={"mode": "offline"})

        def timed(*a: Any, fn: Partials | None = fn, **k: Any) -> torch.Tensor:
            assert fn is not None
            t = time.perf_counter()
            out = fn(*a, **k)
            acc.append(time.perf_counter() - t)
            return out

        gl = gradlog.GradLogger(net, opt, every=1, print_report=False, **kw)
        runs[name] = {"net": net, "loss": loss_fn, "opt": opt, "gl": gl, "hp": timed if fn else new, "w": [], "h": []}
    names = list(runs)
    for i in range(args.steps + 2):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            r = runs[name]
            meter.histogram_partials = r["hp"]
            acc.clear()
            r["loss"](r["net"]).backward()
            t0 = time.perf_counter()
            r["opt"].step()
            r["gl"].log(i)
            window = time.perf_counter() - t0
            r["opt"].zero_grad(set_to_none=True)
            if i >= 2:
                r["w"].append(window)
                r["h"].append(sum(acc))
    meter.histogram_partials = new
    for name, r in runs.items():
        r["gl"].close()
        w, h = r["w"], r["h"]
        print(
            f"{args.model} {args.writer} {name:14s} window ms min {min(w) * 1e3:7.1f}"
            f" median {statistics.median(w) * 1e3:7.1f} | histogram_partials ms/step"
            f" min {min(h) * 1e3:6.1f} median {statistics.median(h) * 1e3:6.1f}"
        )


if __name__ == "__main__":
    main()
