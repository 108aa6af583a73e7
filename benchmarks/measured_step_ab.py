"""In-process A/B of gradlog's measured step: another copy of gradlog (e.g. main's) against this checkout's,
each watching its own copy of a model of `overhead.py` (every=1, histograms on, a writer), interleaved step by
step with a plain baseline, in one process. Reports the training thread's CPU time (`time.thread_time`, steadier
than the wall clock on a shared machine) per step: `optimizer.step()`, in whose hooks gradlog measures, and
`gl.log`.

    mkdir -p /tmp/old && git archive main gradlog | tar -x -C /tmp/old
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/measured_step_ab.py /tmp/old --model gpt --steps 8 --rounds 3

Both copies are imported under the name `gradlog`: each variant's modules are put back in `sys.modules` before
its steps, so the imports gradlog makes inside functions find its own copy.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
Modules = dict[str, ModuleType]


def _drop_gradlog() -> None:
    for key in [k for k in sys.modules if k == "gradlog" or k.startswith("gradlog.")]:
        del sys.modules[key]


def load(root: str) -> Modules:
    """The `gradlog` package under `root`, imported afresh; its modules, to put back before its steps."""
    _drop_gradlog()
    sys.path.insert(0, root)
    try:
        import gradlog
        import gradlog.run.logger
        import gradlog.writers
    finally:
        sys.path.remove(root)
    if not os.path.abspath(gradlog.__file__).startswith(os.path.abspath(root)):
        raise SystemExit(f"gradlog came from {gradlog.__file__}, not {root}: is it installed elsewhere first?")
    return {k: v for k, v in sys.modules.items() if k == "gradlog" or k.startswith("gradlog.")}


def use(mods: Modules) -> None:
    _drop_gradlog()
    sys.modules.update(mods)


@dataclass
class Variant:
    name: str
    mods: Modules | None  # None: the baseline, no gradlog
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    loss_fn: Any
    gl: Any = None


def make(name: str, mods: Modules | None, spec: overhead.ModelSpec, writer: str, tmp: str) -> Variant:
    model, loss_fn = spec.build(torch.device("cpu"))
    v = Variant(name, mods, model, spec.optimizer(model), loss_fn)
    if mods is not None:
        use(mods)
        kw: dict[str, Any] = {} if writer == "memory" else {"log_dir": os.path.join(tmp, name)}
        v.gl = mods["gradlog"].GradLogger(model, v.opt, writer=writer, every=1, print_report=False, **kw)
    return v


def step(v: Variant, i: int) -> float:
    """One training step; the training thread's CPU seconds in optimizer.step() + gl.log."""
    if v.mods is not None:
        use(v.mods)
    v.loss_fn(v.model).backward()
    t0 = time.thread_time()
    v.opt.step()
    if v.gl is not None:
        v.gl.log(i)
    cpu = time.thread_time() - t0
    v.opt.zero_grad(set_to_none=True)
    return cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", help="a folder holding the other gradlog package (e.g. git archive main gradlog)")
    ap.add_argument("--new", default=HERE, help="the folder holding this gradlog package (default: this checkout)")
    ap.add_argument("--model", default="gpt", help="a model of benchmarks/overhead.py")
    ap.add_argument("--writer", default="memory", help="memory, tensorboard or wandb (set WANDB_MODE=offline)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per round (after 2 warm-up steps)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each with fresh models and loggers")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    sets: dict[str, Modules | None] = {"baseline": None, "old": load(args.old), "new": load(args.new)}
    spec = overhead.model_specs()[args.model]
    cpu: dict[str, list[float]] = {k: [] for k in sets}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            runs = [make(f"{k}{rnd}", m, spec, args.writer, tmp) for k, m in sets.items()]
            for i in range(args.steps + 2):
                for k, v in zip(sets, runs):
                    t = step(v, i)
                    if i >= 2:
                        cpu[k].append(t * 1e3)
            for v in runs:
                if v.mods is not None:
                    use(v.mods)
                    v.gl.close()
    med = {k: statistics.median(v) for k, v in cpu.items()}
    print(f"{args.model}, writer {args.writer}: {args.rounds} rounds x {args.steps} steps, training thread CPU ms")
    print("| variant | median step | overhead |\n|---|---:|---:|")
    for k, m in med.items():
        extra = "-" if k == "baseline" else f"{m - med['baseline']:.1f}"
        print(f"| {k} | {m:.1f} | {extra} |")
    print(f"new / old overhead: {(med['new'] - med['baseline']) / (med['old'] - med['baseline']):.3f}")


if __name__ == "__main__":
    main()
