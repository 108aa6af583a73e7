"""What does monitoring cost? gradlog against the baseline, the device-work floor and other tools.

    PYTHONPATH=$PWD python benchmarks/overhead.py            # full run (< 15 min on 2 CPU cores)
    PYTHONPATH=$PWD python benchmarks/overhead.py --quick    # about 2-3 minutes
    PYTHONPATH=$PWD python benchmarks/overhead.py --device cuda   # on a GPU, with a ~350M-parameter GPT

Everything runs in ONE process. Every configuration trains its own copy of the model (same seed,
same batch) and they take turns in rounds, in a rotating order, so machine drift (other jobs,
thermal, turbo) lands on all of them alike. Each step is timed alone; each round's times are
divided by that round's baseline median before any statistic is taken.

Columns:
- median step ms: median over all timed steps (logged or not).
- ratio: amortised step time over the baseline, ((every-1) * unlogged + logged) / every, from the
  medians of the normalised unlogged and logged step times (robust to stray slow steps). A
  configuration that logs less often than once per round is fast-forwarded at the start of each
  round (gradlog's step counter is advanced; nothing else changes) so that every round times
  one of its logged steps.
- ms per logged step: what a logged step costs over a baseline step, timed around the optimizer
  step and the monitor's work before and after it (the median of that window on logged steps
  minus the baseline's), which leaves forward/backward's noise out; for wandb.watch, whose hooks
  work inside forward/backward, from whole steps instead.
- peak MB over baseline: memory growth during one logged step minus the same for a baseline
  step, in two windows, the larger reported: the whole step, and the optimizer step with the
  monitor's work around it (activations are gone by then, so a parameter snapshot shows there
  even when it does not raise the step's overall peak). CPU: measured after all timing, with
  glibc told to serve every block above 64 KiB by mmap (so freed memory leaves RSS at once) and
  trimmed first; a thread samples RSS from /proc/self/statm every 0.2 ms. CUDA:
  torch.cuda.max_memory_allocated.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import inspect
import math
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# --------------------------------------------------------------------------- models


class ResidualMLP(nn.Module):
    """`x + 0.1 * gelu(Linear(layer_norm(x)))`, repeated: many mid-sized tensors (2 per block)."""

    def __init__(self, blocks: int = 200, width: int = 256) -> None:
        super().__init__()
        self.width = width
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + 0.1 * F.gelu(layer(F.layer_norm(x, (self.width,))))
        return x


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """A small GPT: token + position embeddings, pre-norm blocks, untied head."""

    def __init__(self, layers: int, d: int, heads: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        out: torch.Tensor = self.head(self.ln(x))
        return out


@dataclass
class ModelSpec:
    """A model, its batch and its loss; `build` returns a fresh (model, loss_fn) with a fixed seed."""

    name: str
    describe: str
    build: Callable[[torch.device], tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]]


def _mlp(device: torch.device, blocks: int = 200, width: int = 256, batch: int = 64) -> Any:
    torch.manual_seed(0)
    model = ResidualMLP(blocks, width).to(device)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, width, generator=gen).to(device)
    y = torch.randn(batch, width, generator=gen).to(device)
    return model, lambda m: F.mse_loss(m(x), y)


def _gpt(device: torch.device, layers: int, d: int, heads: int, vocab: int, seq: int, batch: int) -> Any:
    torch.manual_seed(0)
    model = GPT(layers, d, heads, vocab, seq).to(device)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(vocab, (batch, seq + 1), generator=gen).to(device)
    inp, tgt = idx[:, :-1], idx[:, 1:]
    return model, lambda m: F.cross_entropy(m(inp).reshape(-1, vocab), tgt.reshape(-1))


MODELS: dict[str, ModelSpec] = {
    "gpt": ModelSpec(
        "gpt",
        "GPT-like: 6 layers, d 256, vocab 4096, seq 128, batch 8, AdamW",
        lambda dev: _gpt(dev, layers=6, d=256, heads=4, vocab=4096, seq=128, batch=8),
    ),
    "mlp": ModelSpec(
        "mlp",
        "residual pre-norm MLP: 200 blocks x + 0.1*gelu(Linear(256,256)(layer_norm(x))), batch 64, AdamW",
        lambda dev: _mlp(dev),
    ),
    "gpt350m": ModelSpec(
        "gpt350m",
        "GPT: 24 layers, d 1024, vocab 50304, seq 1024, batch 8, AdamW (for --device cuda)",
        lambda dev: _gpt(dev, layers=24, d=1024, heads=16, vocab=50304, seq=1024, batch=8),
    ),
}

# --------------------------------------------------------------------------- monitors


class Skip(Exception):
    """A configuration that cannot run here (a writer not merged yet, a package missing)."""


class Monitor:
    """One way of watching training. `logged(i)` says which optimizer steps do the work."""

    every: int | None = None  # None: never logs (the baseline)
    offset: int = 0
    works_in_backward = False  # True: its cost is in forward/backward hooks, outside the optimizer window

    def logged(self, i: int) -> bool:
        return self.every is not None and (i - self.offset) % self.every == 0

    def before_step(self, i: int) -> None:
        pass

    def after_step(self, i: int, loss: torch.Tensor) -> None:
        pass

    def fast_forward(self, i: int) -> int:
        """Jump the schedule to the next logged step (memory phase only); returns the new step index."""
        return i

    def close(self) -> None:
        pass


class Baseline(Monitor):
    pass


class Floor(Monitor):
    """The unavoidable tensor math of scalars + update ratio, as plain torch: no bookkeeping, no writing.

    One copy of the parameters before the step; after it, fused norms of the gradients, the
    weights and the update (computed in place in the copy), and one device-to-host copy.
    """

    every = 1

    def __init__(self, model: nn.Module) -> None:
        self.raw = list(model.parameters())
        self.params = [p.detach() for p in self.raw]
        self.snap: list[torch.Tensor] = []
        self.host: torch.Tensor | None = None

    def before_step(self, i: int) -> None:
        self.snap = [p.clone() for p in self.params]

    def after_step(self, i: int, loss: torch.Tensor) -> None:
        grads = [p.grad for p in self.raw if p.grad is not None]
        g = torch._foreach_norm(grads, 2)
        w = torch._foreach_norm(self.params, 2)
        torch._foreach_sub_(self.snap, self.params)
        u = torch._foreach_norm(self.snap, 2)
        self.snap = []
        self.host = torch.stack([*g, *w, *u]).cpu()


class Lightning(Monitor):
    """What Lightning's `grad_norm` + TensorBoardLogger do when asked to log every step."""

    every = 1

    def __init__(self, model: nn.Module, tmp: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.named = [(n, p) for n, p in model.named_parameters()]
        self.writer = SummaryWriter(os.path.join(tmp, "lightning"))

    def before_step(self, i: int) -> None:
        norms = {f"grad_2.0_norm/{n}": p.grad.detach().norm(2) for n, p in self.named if p.grad is not None}
        norms["grad_2.0_norm_total"] = torch.stack(list(norms.values())).norm(2)
        for tag, v in norms.items():
            self.writer.add_scalar(tag, v.item(), i)

    def close(self) -> None:
        self.writer.close()


class Gradlog(Monitor):
    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, tmp: str, **kwargs: Any) -> None:
        import gradlog
        from gradlog.logger import DEFAULT_EVERY
        from gradlog.writers import REGISTRY

        writer = kwargs.get("writer", inspect.signature(gradlog.GradLogger).parameters["writer"].default)
        if isinstance(writer, str) and writer not in REGISTRY:
            raise Skip(f"gradlog.writers.REGISTRY has no {writer!r} writer yet (its branch is not merged)")
        self.every = kwargs.get("every", DEFAULT_EVERY)
        if writer != "memory":
            kwargs.setdefault("log_dir", os.path.join(tmp, f"gradlog-{writer}"))
        try:
            self.gl = gradlog.GradLogger(model, opt, print_report=False, **kwargs)
        except ImportError as exc:
            raise Skip(f"{writer} writer needs a package: {exc}") from exc

    def after_step(self, i: int, loss: torch.Tensor) -> None:
        self.gl.log(i)

    def fast_forward(self, i: int) -> int:
        assert self.every is not None
        ahead = -i % self.every
        self.gl.optimizer_steps += ahead  # gradlog measures when its own step counter hits a multiple
        return i + ahead

    def close(self) -> None:
        self.gl.close()


class WandbWatch(Monitor):
    """`wandb.watch(model, log="all", log_freq=k)` in offline mode, with the loss logged every step.

    wandb's hooks write to the global `wandb.run`, so every watched model shares one offline run.
    """

    _run: Any = None
    _users = 0
    _owned = False

    def __init__(self, model: nn.Module, k: int, tmp: str) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise Skip("wandb is not installed") from exc
        self.every, self.offset = k, k - 1  # wandb's hooks fire on the k-th, 2k-th, ... call
        self.works_in_backward = True
        if WandbWatch._run is None and wandb.run is not None:  # e.g. the one gradlog's W&B writer started
            WandbWatch._run, WandbWatch._owned = wandb.run, False
        if WandbWatch._run is None:
            WandbWatch._owned = True
            WandbWatch._run = wandb.init(
                project="gradlog-bench",
                dir=tmp,
                mode="offline",
                settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
            )
        WandbWatch._users += 1
        self.run = WandbWatch._run
        self.run.watch(model, log="all", log_freq=k)

    def after_step(self, i: int, loss: torch.Tensor) -> None:
        self.run.log({"loss": float(loss)})

    def close(self) -> None:
        WandbWatch._users -= 1
        if WandbWatch._users == 0:
            if WandbWatch._owned:  # a run gradlog's writer started is finished by that writer
                self.run.finish()
            WandbWatch._run = None


@dataclass
class ConfigSpec:
    key: str
    label: str
    make: Callable[[nn.Module, torch.optim.Optimizer, str], Monitor]


def _gl(**kw: Any) -> Callable[[nn.Module, torch.optim.Optimizer, str], Monitor]:
    return lambda m, o, tmp: Gradlog(m, o, tmp, **kw)


CONFIGS: list[ConfigSpec] = [
    ConfigSpec("baseline", "baseline (no monitoring)", lambda m, o, tmp: Baseline()),
    ConfigSpec("floor", "device-work floor (plain torch)", lambda m, o, tmp: Floor(m)),
    ConfigSpec(
        "scalars-1", "gradlog scalars, flags, ratio (histograms=False)", _gl(every=1, histograms=False, writer="memory")
    ),
    ConfigSpec(
        "zeros-1",
        "gradlog scalars + grad_zero_frac (histograms=False, count_zeros=True)",
        _gl(every=1, histograms=False, count_zeros=True, writer="memory"),
    ),
    ConfigSpec(
        "scalars-10",
        "gradlog scalars, flags, ratio (histograms=False)",
        _gl(every=10, histograms=False, writer="memory"),
    ),
    ConfigSpec(
        "scalars-100",
        "gradlog scalars, flags, ratio (histograms=False)",
        _gl(every=100, histograms=False, writer="memory"),
    ),
    ConfigSpec("hist-1", "gradlog + grad/weight/update histograms, MemoryWriter", _gl(every=1, writer="memory")),
    ConfigSpec("hist-10", "gradlog + grad/weight/update histograms, MemoryWriter", _gl(every=10, writer="memory")),
    ConfigSpec("default", "gradlog default: GradLogger(model, opt)", _gl()),
    ConfigSpec("tb-1", "gradlog full metrics -> TensorBoard writer", _gl(every=1, writer="tensorboard")),
    ConfigSpec("wandb-1", "gradlog full metrics -> W&B writer (offline)", _gl(every=1, writer="wandb")),
    ConfigSpec("watch-1", 'wandb.watch(log="all") offline', lambda m, o, tmp: WandbWatch(m, 1, tmp)),
    ConfigSpec("watch-10", 'wandb.watch(log="all") offline', lambda m, o, tmp: WandbWatch(m, 10, tmp)),
    ConfigSpec(
        "lightning", "Lightning-style: p.grad.norm() + SummaryWriter.add_scalar", lambda m, o, tmp: Lightning(m, tmp)
    ),
]

# --------------------------------------------------------------------------- timing


@dataclass
class Run:
    spec: ConfigSpec
    model: nn.Module
    opt: torch.optim.Optimizer
    loss_fn: Callable[[nn.Module], torch.Tensor]
    mon: Monitor
    step: int = 0
    times: list[tuple[int, int, float, float]] = field(default_factory=list)  # (round, step, step s, window s)
    peak_mb: float | None = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(run: Run, device: torch.device | None = None) -> float:
    """One step; returns the seconds spent from just before the monitor's pre-step work to the end
    of its post-step work (the optimizer step included), synchronised when `device` is given."""
    loss = run.loss_fn(run.model)
    loss.backward()
    if device is not None:
        _sync(device)
    t0 = time.perf_counter()
    run.mon.before_step(run.step)
    run.opt.step()
    run.mon.after_step(run.step, loss.detach())
    if device is not None:
        _sync(device)
    window = time.perf_counter() - t0
    run.opt.zero_grad(set_to_none=True)
    run.step += 1
    return window


def timed_step(run: Run, rnd: int, device: torch.device) -> None:
    _sync(device)
    t0 = time.perf_counter()
    window = train_step(run, device)
    _sync(device)
    run.times.append((rnd, run.step - 1, time.perf_counter() - t0, window))


# --------------------------------------------------------------------------- memory


class RssSampler:
    """Peak resident memory while a block runs, sampled from /proc/self/statm by a thread."""

    def __init__(self, period_s: float = 0.0002) -> None:
        self.period = period_s
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.peak = self.window_peak = 0
        self._stop = threading.Event()

    def rss(self) -> int:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * self.page

    def _loop(self) -> None:
        while not self._stop.is_set():
            r = self.rss()
            self.peak = max(self.peak, r)
            self.window_peak = max(self.window_peak, r)
            time.sleep(self.period)

    def mark(self) -> int:
        """Start a sub-window (its peak is `window_peak`); returns the RSS now."""
        r = self.rss()
        self.window_peak = r
        return r

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        self.peak = self.rss()
        self._stop.clear()
        th = threading.Thread(target=self._loop, daemon=True)
        th.start()
        try:
            yield
        finally:
            self._stop.set()
            th.join()
            self.peak = max(self.peak, self.rss())


def _glibc() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc only
        return libc
    except (OSError, AttributeError):
        return None


def peak_growth_mb(run: Run, device: torch.device, sampler: RssSampler, libc: Any) -> tuple[float, float]:
    """Peak memory growth during one step (the next logged one, or any step for the baseline).

    Two windows: the whole step, and optimizer-step-plus-monitor only (where activations are gone,
    so a snapshot of the parameters shows even when it does not raise the step's overall peak).
    """
    if run.mon.every is not None:
        run.step = run.mon.fast_forward(run.step)
        while not run.mon.logged(run.step):
            train_step(run)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        loss = run.loss_fn(run.model)
        loss.backward()
        whole = torch.cuda.max_memory_allocated(device) - start
        torch.cuda.reset_peak_memory_stats(device)
        window_start = torch.cuda.memory_allocated(device)
        run.mon.before_step(run.step)
        run.opt.step()
        run.mon.after_step(run.step, loss.detach())
        torch.cuda.synchronize(device)
        window = torch.cuda.max_memory_allocated(device) - window_start
        whole = max(whole, torch.cuda.max_memory_allocated(device) - start)
        run.opt.zero_grad(set_to_none=True)
        run.step += 1
        return whole / 2**20, window / 2**20
    if libc is not None:
        libc.malloc_trim(0)
    start = sampler.rss()
    with sampler.measure():
        loss = run.loss_fn(run.model)
        loss.backward()
        window_start = sampler.mark()
        run.mon.before_step(run.step)
        run.opt.step()
        run.mon.after_step(run.step, loss.detach())
        window = sampler.window_peak - window_start
        run.opt.zero_grad(set_to_none=True)
        run.step += 1
    return (sampler.peak - start) / 2**20, window / 2**20


def check_sync(model: ModelSpec, device: torch.device, steps: int = 20) -> str:
    """CUDA only: host syncs per step under gradlog full metrics every 10, from torch's sync debug mode."""
    import gradlog

    net, loss_fn = model.build(device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    gl = gradlog.GradLogger(net, opt, every=10, print_report=False)
    run = Run(CONFIGS[0], net, opt, loss_fn, Baseline())
    measured: list[int] = []
    unmeasured: list[int] = []
    for i in range(steps):
        torch.cuda.synchronize(device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                train_step(run)
                gl.log(i)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        n = sum("synchroniz" in str(w.message) for w in caught)
        (measured if i % 10 == 0 else unmeasured).append(n)
    gl.close()
    return (
        f"host syncs per step ({model.name}, gradlog full metrics every 10, torch.cuda.set_sync_debug_mode): "
        f"unmeasured steps {sorted(set(unmeasured))}, measured steps {sorted(set(measured))} "
        "(training itself, without gradlog, is included in both)"
    )


# --------------------------------------------------------------------------- statistics


@dataclass
class Row:
    label: str
    every: str
    median_ms: float
    ratio: float
    logged_ms: float | None
    peak_mb: float | None


def summarise(runs: list[Run], base: Run) -> list[Row]:
    by_round: dict[int, list[float]] = {}
    for rnd, _, t, _ in base.times:
        by_round.setdefault(rnd, []).append(t)
    base_med = {r: statistics.median(ts) for r, ts in by_round.items()}
    base_ms = statistics.median(t for _, _, t, _ in base.times) * 1e3
    base_window_ms = statistics.median(w for _, _, _, w in base.times) * 1e3
    rows = []
    for run in runs:
        norm_logged = [t / base_med[r] for r, i, t, _ in run.times if run.mon.logged(i)]
        norm_plain = [t / base_med[r] for r, i, t, _ in run.times if not run.mon.logged(i)]
        every = run.mon.every
        if every is None:
            ratio, logged = statistics.median(norm_plain), None
        else:
            lg = statistics.median(norm_logged) if norm_logged else math.nan
            pl = statistics.median(norm_plain) if norm_plain else lg
            ratio = ((every - 1) * pl + lg) / every
            if run.mon.works_in_backward:
                logged = (lg - 1) * base_ms
            else:  # the optimizer window alone: the same cost without forward/backward's noise
                windows = [w for _, i, _, w in run.times if run.mon.logged(i)]
                logged = statistics.median(windows) * 1e3 - base_window_ms if windows else math.nan
        rows.append(
            Row(
                run.spec.label,
                "-" if every is None else str(every),
                statistics.median(t for _, _, t, _ in run.times) * 1e3,
                ratio,
                logged,
                run.peak_mb,
            )
        )
    return rows


def table(model: ModelSpec, n_params: int, n_tensors: int, rows: list[Row], skipped: list[str]) -> str:
    out = [
        f"### {model.name}: {model.describe}",
        "",
        f"{n_params / 1e6:.1f}M parameters in {n_tensors} tensors; one fp32 copy of them is "
        f"{n_params * 4 / 2**20:.0f} MB.",
        "",
        "| configuration | every | median step ms | ratio | ms per logged step | peak MB over baseline |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        logged = "-" if r.logged_ms is None else f"{r.logged_ms:.1f}"
        peak = "-" if r.peak_mb is None else f"{r.peak_mb:.0f}"
        out.append(f"| {r.label} | {r.every} | {r.median_ms:.1f} | {r.ratio:.3f}x | {logged} | {peak} |")
    for s in skipped:
        out.append(f"\nskipped: {s}")
    return "\n".join(out)


# --------------------------------------------------------------------------- main


@dataclass
class Bench:
    model: ModelSpec
    runs: list[Run]
    base: Run
    skipped: list[str]
    n_params: int
    n_tensors: int


def bench_model(model: ModelSpec, args: argparse.Namespace, device: torch.device, tmp: str) -> Bench:
    runs: list[Run] = []
    skipped: list[str] = []
    n_params = n_tensors = 0
    for spec in CONFIGS:
        if spec.key not in args.configs:
            continue
        net, loss_fn = model.build(device)
        n_params = sum(p.numel() for p in net.parameters())
        n_tensors = len(list(net.parameters()))
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mon = spec.make(net, opt, tmp)
        except Skip as exc:
            skipped.append(f"{spec.label}: {exc}")
            continue
        except Exception as exc:  # a backend that fails to start is reported, not fatal
            skipped.append(f"{spec.label}: {type(exc).__name__}: {exc}")
            continue
        runs.append(Run(spec, net, opt, loss_fn, mon))
    base = next((r for r in runs if r.spec.key == "baseline"), None)
    if base is None:
        raise SystemExit("the baseline configuration is required (it is what every ratio divides by)")
    t0 = time.perf_counter()
    for run in runs:
        for _ in range(args.warmup):
            train_step(run)
    for rnd in range(args.rounds):
        order = runs[rnd % len(runs) :] + runs[: rnd % len(runs)]
        for run in order:
            if run.mon.every is not None and run.mon.every > args.steps:
                run.step = run.mon.fast_forward(run.step)  # so that every round times one logged step
            for _ in range(args.steps):
                timed_step(run, rnd, device)
        print(f"  {model.name}: round {rnd + 1}/{args.rounds} done, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return Bench(model, runs, base, skipped, n_params, n_tensors)


def measure_memory(bench: Bench, args: argparse.Namespace, device: torch.device) -> None:
    """After all timing: it changes glibc's malloc settings for the rest of the process."""
    sampler, libc = RssSampler(), _glibc()
    if libc is not None and device.type == "cpu":
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD fixed at 64 KiB: big blocks go back to the OS on free
        libc.mallopt(-1, 0)  # M_TRIM_THRESHOLD 0
    growth: dict[str, tuple[float, float]] = {}
    for run in bench.runs:
        samples = [peak_growth_mb(run, device, sampler, libc) for _ in range(args.memory_repeats)]
        growth[run.spec.key] = (min(w for w, _ in samples), min(o for _, o in samples))
    base_whole, base_window = growth["baseline"]
    for run in bench.runs:
        whole, window = growth[run.spec.key]
        run.peak_mb = max(whole - base_whole, window - base_window)


def finish(bench: Bench) -> str:
    for run in bench.runs:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run.mon.close()
    rows = summarise(bench.runs, bench.base)
    return table(bench.model, bench.n_params, bench.n_tensors, rows, bench.skipped)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    keys = [c.key for c in CONFIGS]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--models", default=None, help="comma-separated, from: " + ", ".join(MODELS))
    p.add_argument("--configs", default=",".join(keys), help="comma-separated, from: " + ", ".join(keys))
    p.add_argument("--rounds", type=int, default=None, help="rounds of interleaved configurations")
    p.add_argument("--steps", type=int, default=None, help="timed steps per configuration per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration first")
    p.add_argument("--memory-repeats", type=int, default=2, help="logged steps sampled for memory (min taken)")
    p.add_argument("--no-memory", dest="memory", action="store_false", help="skip the memory measurement")
    p.add_argument("--quick", action="store_true", help="fewer rounds and steps (about 2-3 minutes on 2 cores)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--no-check-sync", dest="check_sync", action="store_false", help="cuda: skip the sync count")
    p.add_argument("--out", default=None, help="also write the tables to this markdown file")
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in args.configs if c not in keys]
    if bad:
        p.error(f"unknown configurations {bad}; choose from {keys}")
    if "baseline" not in args.configs:
        args.configs.insert(0, "baseline")
    default_models = "gpt350m,mlp" if args.device.startswith("cuda") else "gpt,mlp"
    args.models = [m.strip() for m in (args.models or default_models).split(",") if m.strip()]
    bad = [m for m in args.models if m not in MODELS]
    if bad:
        p.error(f"unknown models {bad}; choose from {list(MODELS)}")
    if args.rounds is None:
        args.rounds = 4 if args.quick else 8
    if args.steps is None:
        args.steps = 4 if args.quick else 10
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    if args.threads:
        torch.set_num_threads(args.threads)
    command = "python benchmarks/overhead.py " + " ".join(sys.argv[1:] if argv is None else argv)
    tmp = tempfile.mkdtemp(prefix="gradlog-bench-")
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_DIR", tmp)
    os.environ.setdefault("WANDB_SILENT", "true")
    import gradlog

    header = (
        f"`{command.strip()}` - gradlog {gradlog.__version__}, torch {torch.__version__}, {args.device}, "
        f"{torch.get_num_threads()} threads, {args.rounds} rounds x {args.steps} steps (+{args.warmup} warm-up)"
    )
    print(header, file=sys.stderr)
    parts = [header]
    if device.type == "cuda" and args.check_sync:
        for name in args.models:
            line = check_sync(MODELS[name], device)
            print(line, flush=True)
            parts.append(line)
    benches = [bench_model(MODELS[name], args, device, tmp) for name in args.models]
    if args.memory:
        for bench in benches:
            measure_memory(bench, args, device)
    # Close in reverse: monitors of several models may share one W&B run, owned by the first.
    texts = [finish(bench) for bench in reversed(benches)][::-1]
    for text in texts:
        print(text + "\n", flush=True)
        parts.append(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n\n".join(parts) + "\n")


if __name__ == "__main__":
    main()
