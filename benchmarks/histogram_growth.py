"""gradlog's own CPU time on a measured step against the parameter count, split into the scalars, the zero count
and the histograms: the growth table's question (issue 40 point 3) in a reading a loaded machine leaves steady.

    python benchmarks/histogram_growth.py [--widths 512,1024,2048,2896] [--steps 5] [--rounds 2] [--llama-layers 20]

The growth table's residual MLPs (`overhead.py`: 8 blocks of `width`, 16 tensors, AdamW(foreach=True), batch
16), gradlog every step with the MemoryWriter in three configurations: `scalars` (histograms=False), `zeros`
(scalars and the gradients' zero count a histogram step makes, `count_zeros=True`) and `hist` (the default
histograms: zero count and three sampled histograms a tensor). What is timed is gradlog's own work on the
training thread, by CPU time (`time.thread_time`): `Meter.start` (the optimizer's pre-hook), `Meter.finish`
(its post-hook) and `GradLogger.log`; median of the measured steps, the configurations in turns, best round.
Wall-clock step ratios (`overhead.py`) swing with other jobs on a shared machine; a thread's CPU time
swings far less (only through the caches it shares). Prints one markdown table, with the slopes between the
smallest and the largest width (ms per M parameters). `--llama-layers N` adds a row for `overhead.py`'s
Llama-shaped decoder (N layers: 20 is its ~322M parameters; 16 tokens a step, SGD as there), last.

Run it against another checkout's gradlog with `PYTHONPATH=/that/checkout:$PWD` (the models come from this
folder's `overhead.py`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from overhead import _llama, _mlp, adamw_foreach, sgd

import gradlog
from gradlog.measure import meter as meter_mod

CONFIGS: dict[str, dict[str, Any]] = {
    "scalars": {"histograms": False},
    "zeros": {"histograms": gradlog.HistogramOptions(kinds=(), count_zeros=True)},
    "hist": {},
}
_spent = [0.0]


def _timed(f: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        t = time.thread_time()
        try:
            return f(*args, **kwargs)
        finally:
            _spent[0] += time.thread_time() - t

    return run


def _build(width: int) -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor], torch.optim.Optimizer]:
    """The MLP of `width` with AdamW, or (width < 0) the Llama of -width layers with SGD."""
    if width < 0:
        model, loss_fn = _llama(torch.device("cpu"), -width, 1024, 2816, 16, 32000, 16, 1)
        return model, loss_fn, sgd(model)
    model, loss_fn = _mlp(torch.device("cpu"), blocks=8, width=width, batch=16)
    return model, loss_fn, adamw_foreach(model)


def _measure(width: int, config: str, steps: int) -> float:
    """Median ms of gradlog's CPU time per measured step, one fresh model and logger."""
    model, loss_fn, opt = _build(width)
    gl = gradlog.GradLogger(model, opt, every=1, writer="memory", print_report=False, **CONFIGS[config])
    log = _timed(gl.log)
    out: list[float] = []
    for i in range(steps + 1):  # the first step warms up (allocations, index sets)
        loss = loss_fn(model)
        opt.zero_grad()
        loss.backward()
        _spent[0] = 0.0
        opt.step()
        log(i)
        if i:
            out.append(_spent[0] * 1e3)
    gl.close()
    return statistics.median(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--widths", default="512,1024,2048,2896", help="MLP widths (8 blocks each)")
    p.add_argument("--steps", type=int, default=5, help="measured steps per configuration and round")
    p.add_argument("--rounds", type=int, default=2, help="rounds of the configurations in turn (best kept)")
    p.add_argument("--llama-layers", type=int, default=0, help="add overhead.py's Llama of this many layers (0: none)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    for name in ("start", "finish"):
        setattr(meter_mod.Meter, name, _timed(getattr(meter_mod.Meter, name)))
    widths = [int(w) for w in args.widths.split(",") if w] + ([-args.llama_layers] if args.llama_layers else [])
    rows: list[tuple[float, float, float, float]] = []
    for w in widths:
        best = {c: float("inf") for c in CONFIGS}
        for r in range(args.rounds):
            for c in list(CONFIGS)[r % 3 :] + list(CONFIGS)[: r % 3]:
                best[c] = min(best[c], _measure(w, c, args.steps))
        n = sum(p.numel() for p in _build(w)[0].parameters()) / 1e6
        rows.append((n, best["scalars"], best["zeros"] - best["scalars"], best["hist"] - best["zeros"]))
        print(f"  width {w} done", file=sys.stderr, flush=True)
    print(f"gradlog {gradlog.__file__}")
    print("| width | parameters | scalars ms | zero count ms | histograms alone ms | hist - scalars ms |")
    print("|---:|---:|---:|---:|---:|---:|")
    for w, (n, s, z, h) in zip(widths, rows):
        label = str(w) if w > 0 else f"llama {-w}"
        print(f"| {label} | {n:.1f}M | {s:.1f} | {z:.1f} | {h:.1f} | {z + h:.1f} |")
    mlps = [r for w, r in zip(widths, rows) if w > 0]
    if len(mlps) < 2:
        return
    (n0, s0, z0, h0), (n1, s1, z1, h1) = mlps[0], mlps[-1]
    d = n1 - n0
    print(
        f"\nslopes, ms per M parameters ({n0:.1f}M -> {n1:.1f}M): scalars {(s1 - s0) / d:.3f}, zero count "
        f"{(z1 - z0) / d:.3f}, histograms alone {(h1 - h0) / d:.3f}, histogram part {(z1 + h1 - z0 - h0) / d:.3f}"
    )


if __name__ == "__main__":
    main()
