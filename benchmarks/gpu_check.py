"""GPU check (issue 30): host syncs per step and the default configuration's overhead, one short run.

    PYTHONPATH=$PWD python benchmarks/gpu_check.py --out /tmp/gpu_check.md            # on a GPU, < 5 minutes
    PYTHONPATH=$PWD python benchmarks/gpu_check.py --device cpu --quick --out /tmp/x.md  # smoke test on a CPU

What it measures, on one model from `overhead.py` (default `gpt`: 6 layers, d 256; `--model gpt350m` for the
~350M-parameter GPT on a large GPU):

1. **Host syncs per step.** Under `torch.cuda.set_sync_debug_mode("warn")` every operation that makes the
   host wait for the device (`.item()`, `.cpu()`, `nonzero`, a blocking copy) warns; the warnings are counted
   per step, for the training loop alone and with gradlog at its default cadence (every 50) and every step.
   gradlog's promise: no sync on an unmeasured step, one on a measured step (the measurement's single copy to
   the host). A second witness, from `torch.profiler`: the CUDA runtime's synchronising calls
   (`cudaStreamSynchronize`, `cudaDeviceSynchronize`, `cudaEventSynchronize`) and blocking device-to-host
   copies per step. The training loop here never reads a value back itself, so what is counted is gradlog's.
2. **Default overhead.** `GradLogger(model, opt)` (every 50, histograms, TensorBoard writer) against no
   monitoring: both train their own copy of the model, in rounds of alternating order, each step timed with
   `torch.cuda.synchronize()` around it; a round's steps are divided by that round's baseline median; the
   amortised ratio is ((every - 1) x unlogged + logged) / every from the medians, as in `overhead.py`.
   Also every step with histograms (`every=1`), the TensorBoard and W&B writers (offline), for the cost of a
   measured step on this device.

3. **A measured step's peak device memory** (issue 40): `torch.cuda.max_memory_allocated()` over one step,
   less what was allocated when it began, for an unmeasured and a measured step, training alone and under
   gradlog (default snapshot budget, and `snapshot_budget=None`, which copies every tensor); the measured step's
   excess over training alone's step as a share of the weights' bytes, and the bytes gradlog's snapshot copied.
   On a CPU only the copied bytes are reported (the allocator's peak is a CUDA counter).

On a CPU (`--device cpu`) the sync count has no meaning (nothing is asynchronous) and is reported as n/a;
the rest runs, so the script is tested without a GPU. It writes one markdown table (`--out`) and prints it.
"""

from __future__ import annotations

import argparse
import math
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

SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


_sync = overhead._sync


class Trainer:
    """One copy of the model, its optimizer and (optionally) a GradLogger; `step()` trains once, reads nothing."""

    def __init__(self, spec: overhead.ModelSpec, device: torch.device, tmp: str, **gradlog_kwargs: Any) -> None:
        self.model, self.loss_fn = spec.build(device)
        self.opt = spec.optimizer(self.model)
        self.gl = None
        self.every = None
        if gradlog_kwargs.pop("monitor", True) is not False:  # overhead.py's own gradlog monitor builds it
            writer = gradlog_kwargs.get("writer", "tensorboard")
            if writer != "memory":
                gradlog_kwargs.setdefault("log_dir", os.path.join(tmp, f"gradlog-{writer}-{id(self)}"))
            if writer == "wandb":
                gradlog_kwargs["writer_options"] = {"settings": overhead._gradlog_wandb_settings()}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.gl = overhead.Gradlog(self.model, self.opt, tmp, **gradlog_kwargs).gl
            self.every = self.gl.every
        self.i = 0

    def step(self) -> None:
        loss = self.loss_fn(self.model)
        loss.backward()
        self.opt.step()
        if self.gl is not None:
            self.gl.log(self.i)
        self.opt.zero_grad(set_to_none=True)
        self.i += 1

    def measured(self, i: int) -> bool:
        return self.every is not None and i % self.every == 0

    def close(self) -> None:
        if self.gl is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.gl.close()


def count_syncs(t: Trainer, steps: int, device: torch.device) -> tuple[list[int], list[int]]:
    """Sync warnings per step under torch's sync debug mode: (unmeasured steps, measured steps)."""
    plain: list[int] = []
    measured: list[int] = []
    for _ in range(steps):
        i = t.i
        _sync(device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                t.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        n = sum("synchroniz" in str(w.message).lower() for w in caught)
        (measured if t.measured(i) else plain).append(n)
    return plain, measured


def profiled_syncs(t: Trainer, steps: int, device: torch.device) -> tuple[list[int], list[int]]:
    """Synchronising CUDA runtime calls and blocking device-to-host copies per step, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    plain: list[int] = []
    measured: list[int] = []
    for _ in range(steps):
        i = t.i
        _sync(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t.step()
            _sync(device)
        n = 0
        for ev in prof.events():
            name = ev.name
            if any(s in name for s in SYNC_EVENTS) or (name.startswith("cudaMemcpy") and "Async" not in name):
                n += 1
        n -= 1  # the profiler's own synchronize at the end of the block
        (measured if t.measured(i) else plain).append(max(n, 0))
    return plain, measured


def timed(trainers: dict[str, Trainer], rounds: int, steps: int, device: torch.device) -> dict[str, list[float]]:
    """Per-step times divided by the same round's baseline median, each step synchronised."""
    out: dict[str, list[tuple[int, float]]] = {k: [] for k in trainers}
    keys = list(trainers)
    for rnd in range(rounds):
        for key in keys[rnd % len(keys) :] + keys[: rnd % len(keys)]:
            t = trainers[key]
            for _ in range(steps):
                i = t.i
                _sync(device)
                a = time.perf_counter()
                t.step()
                _sync(device)
                out[key].append(
                    (rnd, time.perf_counter() - a) if not t.measured(i) else (-1 - rnd, time.perf_counter() - a)
                )
    base = {rnd: statistics.median(s for r, s in out["baseline"] if r == rnd) for rnd in range(rounds)}
    norm: dict[str, list[float]] = {}
    for key, got in out.items():
        norm[key + "/plain"] = [s / base[r] for r, s in got if r >= 0]
        norm[key + "/logged"] = [s / base[-1 - r] for r, s in got if r < 0]
    norm["baseline_ms"] = [statistics.median(base.values()) * 1e3]
    return norm


def ratio(norm: dict[str, list[float]], key: str, every: int | None) -> tuple[float, float]:
    """(amortised ratio over the baseline, logged-step ratio)."""
    plain = norm.get(key + "/plain") or []
    logged = norm.get(key + "/logged") or []
    pl = statistics.median(plain) if plain else math.nan
    lg = statistics.median(logged) if logged else pl
    if not every:
        return pl, math.nan
    return ((every - 1) * (pl if plain else lg) + lg) / every, lg


def step_peak_mb(t: Trainer, device: torch.device) -> float:
    """Peak device memory over one step, less what was allocated when it began (MB; NaN off CUDA)."""
    if device.type != "cuda":
        t.step()
        return math.nan
    _sync(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    t.step()
    _sync(device)
    return (torch.cuda.max_memory_allocated(device) - start) / 2**20


def peak_memory(spec: overhead.ModelSpec, device: torch.device, tmp: str) -> list[str]:
    """Section 3: an unmeasured and a measured step's peak, training alone and under gradlog (every 2)."""
    lines = [
        "",
        "| peak device memory of a step | unmeasured MB | measured MB | measured over training alone "
        "(share of weights) | snapshot copied MB |",
        "|---|---:|---:|---:|---:|",
    ]
    configs: list[tuple[str, dict[str, Any]]] = [
        ("training alone", {"monitor": False}),
        ("gradlog default budget, every 2", {"every": 2, "writer": "memory"}),
        ("gradlog snapshot_budget=None, every 2", {"every": 2, "writer": "memory", "snapshot_budget": None}),
    ]
    alone = math.nan
    for label, kw in configs:
        t = Trainer(spec, device, tmp, **kw)
        weights = sum(p.numel() * p.element_size() for p in t.model.parameters()) / 2**20
        for _ in range(3):  # warm-up: optimizer state, the allocator's pools
            t.step()
        if t.every:
            while t.i % t.every == 0:  # the next step unmeasured, the one after measured
                t.step()
        plain = step_peak_mb(t, device)
        measured = step_peak_mb(t, device)
        copied = t.gl.pipeline.meter.snapshot_bytes / 2**20 if t.gl is not None else 0.0
        if t.gl is None:
            alone = max(plain, measured)
        over = measured - alone
        t.close()
        del t
        if device.type == "cuda":
            torch.cuda.empty_cache()
        share = f"{over:.0f} MB ({over / weights:.0%})" if math.isfinite(over) else "n/a"
        lines.append(f"| {label} | {plain:.0f} | {measured:.0f} | {share} | {copied:.1f} of {weights:.0f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="gpt", help="a model of overhead.py (gpt, mlp, mlp100, gpt350m, ...)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=60, help="timed steps per configuration per round (>= 50)")
    p.add_argument("--sync-steps", type=int, default=12, help="steps per sync count")
    p.add_argument("--quick", action="store_true", help="CPU smoke test: the small mlp100, few steps")
    p.add_argument("--out", default=None, help="write the markdown table here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here (use --device cpu for the smoke test)")
    if args.quick:
        args.model, args.rounds, args.steps, args.sync_steps = "mlp100", 2, 50, 3
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    tmp = tempfile.mkdtemp(prefix="gradlog-gpu-check-")
    os.environ.setdefault("WANDB_DIR", tmp)
    spec = overhead.model_specs()[args.model]
    t_start = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    lines = [
        f"### gpu_check: {spec.name} on {name} (torch {torch.__version__})",
        "",
        f"`python benchmarks/gpu_check.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
        "",
    ]

    # 1. host syncs per step
    lines += ["| host syncs per step | unmeasured steps | measured steps |", "|---|---|---|"]
    configs: list[tuple[str, dict[str, Any]]] = [
        ("training alone", {"monitor": False}),
        ("gradlog default (every 50)", {}),
        ("gradlog every step, histograms, MemoryWriter", {"every": 1, "writer": "memory"}),
    ]
    for label, kw in configs:
        if device.type != "cuda":
            lines.append(f"| {label}: sync debug mode | n/a on {device.type} | n/a |")
            continue
        t = Trainer(spec, device, tmp, **kw)
        for _ in range(2):  # warm-up: the first measured step builds its buffers
            t.step()
        if t.every:  # start the count one step before a measured step, so both kinds are seen
            while (t.i + 1) % t.every:
                t.step()
        steps = max(args.sync_steps, 2)
        plain, measured = count_syncs(t, steps, device)
        pplain, pmeasured = profiled_syncs(t, min(steps, 4), device)
        t.close()
        lines.append(f"| {label}: sync debug mode | {sorted(set(plain)) or '-'} | {sorted(set(measured)) or '-'} |")
        lines.append(
            f"| {label}: profiler (sync calls + blocking copies) | {sorted(set(pplain)) or '-'} | "
            f"{sorted(set(pmeasured)) or '-'} |"
        )
        print(f"  syncs: {label} done, {time.perf_counter() - t_start:.0f} s", file=sys.stderr)

    # 3. a measured step's peak device memory (before the timing: its trainers are freed first)
    lines += peak_memory(spec, device, tmp)
    print(f"  peak memory done, {time.perf_counter() - t_start:.0f} s", file=sys.stderr)

    # 2. overhead
    build: dict[str, Callable[[], Trainer]] = {
        "baseline": lambda: Trainer(spec, device, tmp, monitor=False),
        "default": lambda: Trainer(spec, device, tmp),
        "every-1 memory": lambda: Trainer(spec, device, tmp, every=1, writer="memory"),
        "every-1 tensorboard": lambda: Trainer(spec, device, tmp, every=1, writer="tensorboard"),
        "every-1 wandb": lambda: Trainer(spec, device, tmp, every=1, writer="wandb"),
    }
    trainers: dict[str, Trainer] = {}
    for key, make in build.items():
        try:
            trainers[key] = make()
        except (ImportError, overhead.Skip) as exc:
            print(f"  {key}: skipped ({exc})", file=sys.stderr)
    for t in trainers.values():
        for _ in range(3):
            t.step()
    norm = timed(trainers, args.rounds, args.steps, device)
    for t in trainers.values():
        t.close()
    lines += [
        "",
        f"baseline step {norm['baseline_ms'][0]:.1f} ms; {args.rounds} rounds x {args.steps} steps per configuration.",
        "",
        "| configuration | every | step / baseline (amortised) | measured step / baseline |",
        "|---|---:|---:|---:|",
    ]
    for key, t in trainers.items():
        if key == "baseline":
            continue
        amortised, logged = ratio(norm, key, t.every)
        lines.append(f"| {key} | {t.every} | {amortised:.3f}x | {logged:.3f}x |")
    lines.append("")
    lines.append(
        f"target: default configuration <= 1.03x on the GPT (overhead.py's); "
        f"wall time {time.perf_counter() - t_start:.0f} s"
    )
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
