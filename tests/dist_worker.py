"""Runs under `torchrun --nproc_per_node 2` (gloo, CPU) for tests/test_distributed.py.

Usage: python -m torch.distributed.run --nproc_per_node 2 tests/dist_worker.py OUT_DIR SUITE
SUITE "main" trains the same model under DDP, FSDP2 and tensor parallel and dumps, per rank and
scenario, what gradlog wrote and reported to OUT_DIR/<scenario>-rank<r>.json. SUITE "mismatch"
makes the ranks disagree on purpose and records the errors. SUITEs "resume_first" and
"resume_second" are the two launches of a preempted FSDP2 run resumed from its checkpoint. The
single-process reference runs the same `train` in the test process (`wrap=None`).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from catalogue import FrozenMainLateSlow
from torch import nn

import gradlog
from gradlog.measure.histogram import Histogram

STEPS = 14  # 7 active then 7 quiet measured steps around STOP_AT: evidence of a stop (chance 1 / C(14, 7) < 1e-3)
GLOBAL_BATCH = 8
#: a snapshot_budget (bytes) of about a quarter of `Net`'s 4,640 trainable bytes: its copies rotate
BUDGET = 1200


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(self.norm(x)))


#: units of the first layer planted dead (bias -100 before a ReLU), on both ranks' shards of 16 rows
DEAD = (1, 9, 10)
#: units of the first layer whose output is zeroed from step `STOP_AT` on (a forward hook): stopped slices
STOPPED, STOP_AT = (4, 12), 7


class Net(nn.Module):
    """Healthy layers plus a frozen one, an unused one, a zero-lr one, a 1-row parameter (its shard
    on rank 1 is empty under fully_shard across 2 ranks) and dead units `DEAD` in `inp`."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        with torch.no_grad():
            self.inp.bias[list(DEAD)] = -100.0
        self.blocks = nn.ModuleList([Block(width) for _ in range(2)])
        self.gate = nn.Parameter(torch.randn(1, width))
        self.frozen = nn.Linear(width, width)
        self.frozen.requires_grad_(False)
        self.still = nn.Linear(width, width, bias=False)  # in a param group with lr 0
        self.unused = nn.Linear(width, 4)
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        for b in self.blocks:
            h = h + b(h)
        h = self.frozen(h * self.gate)
        h = h + self.still(h)
        out: torch.Tensor = self.head(h)
        return out


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """Group 1 (`still`) has lr 0 from the start; group 2 (`head`) gets lr 0 after step 0 (see `stop`)."""
    still = {id(p) for n, p in model.named_parameters() if "still" in n}
    head = {id(p) for n, p in model.named_parameters() if "head" in n}
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if id(p) not in still | head]},
            {"params": [p for p in params if id(p) in still], "lr": 0.0, "weight_decay": 0.0},
            {"params": [p for p in params if id(p) in head]},
        ],
        lr=1e-2,
    )


def stop(opt: torch.optim.Optimizer, step: int) -> None:
    """A scheduler bug: the last param group's lr goes to 0 after step 0, so its tensors stop learning
    (4 quiet measured steps of 5: stalled since step 1, last update at step 0)."""
    if step == 0:
        opt.param_groups[-1]["lr"] = 0.0


def data(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)


class RankFileWriter(gradlog.Writer):
    """Appends every call to OUT/events-rank<r>.jsonl: a file that exists only where a writer wrote."""

    def __init__(self, out: str, rank: int) -> None:
        self.path = os.path.join(out, f"events-rank{rank}.jsonl")

    def _emit(self, rec: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def log_scalars(self, scalars: Mapping[str, float], step: int) -> None:
        self._emit({"scalars": len(scalars), "step": step})

    def log_histogram(self, tag: str, hist: Histogram, step: int) -> None:
        self._emit({"histogram": tag, "step": step})

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
        self._emit({"table": name})


def dump(mem: gradlog.MemoryWriter, report: gradlog.Report, writers: int) -> dict[str, Any]:
    hists = {
        tag: [(s, list(h.counts), h.min, h.max, h.sum, h.sum_squares, h.count, h.nonfinite) for s, h in vals]
        for tag, vals in mem.histograms.items()
    }
    partly = [[r.name, r.dim, list(r.indices), r.reason.value, r.detail] for r in report.partly_updated]
    stopped = [[r.name, r.dim, list(r.indices), r.since_step, r.reason.value] for r in report.stopped_slices]
    return {
        "stopped": stopped,
        "writers": writers,
        "scalars": mem.scalars,
        "histograms": hists,
        "report": report.to_dict(),
        "partly": partly,
        "rotation": report.update_rotation,
    }


def count_collectives(gl: gradlog.GradLogger, calls: list[tuple[str, int]]) -> None:
    """Have `calls` receive (op, measured step) for every all_reduce gradlog makes, which still runs."""
    reducer = gl.meter.reducer
    assert reducer is not None
    real = reducer.all_reduce

    def counted(t: torch.Tensor, op: str, index: int, **kw: Any) -> None:
        calls.append((op, index))
        real(t, op, index, **kw)

    reducer.all_reduce = counted  # type: ignore[method-assign]


def train(
    model: nn.Module,
    rank: int = 0,
    world: int = 1,
    accumulate: int = 1,
    no_sync: Callable[[], Any] | None = None,
    writers: list[gradlog.Writer] | None = None,
    shard_batch: bool = True,
    collectives: list[tuple[str, int]] | None = None,
    budget: int | None = None,
    copied: list[list[str]] | None = None,
) -> tuple[gradlog.MemoryWriter, gradlog.Report, int]:
    """STEPS optimizer steps on the global batch (this rank's slice of it when shard_batch).

    `collectives` receives (op, measured step) for every all_reduce gradlog makes. `budget`: a snapshot_budget
    in bytes (default "auto"); `copied` receives, per step, the tensors its snapshot copied (`Meter.copied`)."""
    opt = make_optimizer(model)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(
        model,
        opt,
        writer=[mem, *(writers or [])],
        every=1,
        print_report=False,
        histograms=gradlog.HistogramOptions(every=2, bins=16),
        **({"snapshot_budget": budget} if budget is not None else {}),
    )
    if collectives is not None:
        count_collectives(gl, collectives)
    per = GLOBAL_BATCH // world if shard_batch else GLOBAL_BATCH
    lo = rank * per if shard_batch else 0
    now = [0]
    keep = torch.ones(16)
    keep[list(STOPPED)] = 0.0

    def stop_units(mod: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        return out * keep if now[0] >= STOP_AT else None

    inner = getattr(model, "module", model)  # DDP wraps it
    hooks = [inner.inp.register_forward_hook(stop_units)] if hasattr(inner, "inp") else []
    for step in range(STEPS):
        now[0] = step
        for micro in range(accumulate):
            x, y = data(step, micro)
            x, y = x[lo : lo + per], y[lo : lo + per]
            ctx = no_sync() if no_sync is not None and micro < accumulate - 1 else None
            if ctx is not None:
                with ctx:
                    nn.functional.mse_loss(model(x), y).backward()
            else:
                nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if copied is not None:
            copied.append(list(gl.meter.copied))
        gl.log(step)
        opt.zero_grad()
        stop(opt, step)
    n_writers = len(gl.writers.writers)
    for h in hooks:
        h.remove()
    return mem, gl.close(), n_writers


class TPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 4)
        self.unused = nn.Linear(4, 4)
        with torch.no_grad():
            self.up.bias[list(DEAD)] = -100.0  # rows of up (Shard(0)), columns of down (Shard(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(torch.relu(self.up(x)))
        return out


def tp_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """`down` (a Shard(1) weight and a replicated bias) in its own group, stopped after step 0 (`stop`)."""
    down = {id(p) for p in model.down.parameters()}
    rest = [p for p in model.parameters() if id(p) not in down]
    return torch.optim.SGD([{"params": rest}, {"params": list(model.down.parameters())}], lr=0.05, momentum=0.9)


def train_tp(model: nn.Module, writers: list[gradlog.Writer] | None = None) -> tuple[dict[str, Any], int]:
    opt = tp_optimizer(model)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(
        model,
        opt,
        writer=[mem, *(writers or [])],
        every=1,
        print_report=False,
        histograms=gradlog.HistogramOptions(bins=16),
    )
    for step in range(STEPS):
        x, y = data(step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        gl.log(step)
        opt.zero_grad()
        stop(opt, step)
    n = len(gl.writers.writers)
    return dump(mem, gl.close(), n), n


# --- the multi-process side -------------------------------------------------------------------


def _save(out: str, name: str, rank: int, payload: dict[str, Any]) -> None:
    with open(os.path.join(out, f"{name}-rank{rank}.json"), "w") as f:
        json.dump(payload, f)


def main_suite(out: str, rank: int, world: int) -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = init_device_mesh("cpu", (world,))

    # DDP, with no_sync gradient accumulation over 2 micro-batches
    torch.manual_seed(0)
    ddp = DDP(Net(), find_unused_parameters=True)
    names = [n for n, _ in ddp.named_parameters()]
    mem, report, n = train(ddp, rank, world, accumulate=2, no_sync=ddp.no_sync, writers=[RankFileWriter(out, rank)])
    _save(out, "ddp", rank, {**dump(mem, report, n), "raw_names": names})

    # FSDP2, blocks wrapped in activation checkpointing and sharded on their own
    torch.manual_seed(0)
    model = Net()
    for i, b in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(b)
        fully_shard(model.blocks[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    names = [n for n, _ in model.named_parameters()]
    local_rows = {n: int(p.to_local().shape[0]) for n, p in model.named_parameters()}
    calls: list[tuple[str, int]] = []
    mem, report, n = train(model, rank, world, collectives=calls)
    extra = {"raw_names": names, "local_rows": local_rows, "collectives": calls}
    _save(out, "fsdp2", rank, {**dump(mem, report, n), **extra})

    # FSDP2 under a snapshot budget far below the weights' bytes: the copies rotate, the same rows on every rank
    torch.manual_seed(0)
    model = Net()
    fully_shard(model, mesh=mesh)
    copied: list[list[str]] = []
    calls = []
    mem, report, n = train(model, rank, world, collectives=calls, budget=BUDGET, copied=copied)
    _save(out, "fsdp2-budget", rank, {**dump(mem, report, n), "copied": copied, "collectives": calls})

    # tensor parallel: plain DTensor parameters, sharded and replicated (the row-wise bias)
    torch.manual_seed(0)
    tp = parallelize_module(TPNet(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    payload, _ = train_tp(tp)
    payload["placements"] = {n: str(p.placements) for n, p in tp.named_parameters() if hasattr(p, "placements")}
    _save(out, "tp", rank, payload)

    # FSDP1 without use_orig_params must be refused with a clear error, never measured shard-locally
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    try:
        net = Net()
        net.frozen.requires_grad_(True)  # without use_orig_params FSDP1 flattens only tensors that agree on it
        fsdp1 = FSDP(net, use_orig_params=False, device_id=torch.device("cpu"))
        gradlog.GradLogger(fsdp1, torch.optim.SGD(fsdp1.parameters(), lr=0.1), writer="memory", print_report=False)
        _save(out, "fsdp1", rank, {"error": None})
    except NotImplementedError as exc:
        _save(out, "fsdp1", rank, {"error": str(exc)})
    dist.barrier()

    # a logger still open when the process group is destroyed: its report is rank-local, and says so
    import warnings

    torch.manual_seed(0)
    model = Net()
    fully_shard(model, mesh=mesh)
    gl = gradlog.GradLogger(model, make_optimizer(model), writer="memory", print_report=False)
    x, y = data(0)
    nn.functional.mse_loss(model(x[:4]), y[:4]).backward()
    gl.optimizer.step()  # type: ignore[union-attr]
    dist.barrier()
    dist.destroy_process_group()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gl.close()
    _save(out, "late_close", rank, {"warnings": [str(w.message) for w in caught]})


def mismatch_suite(out: str, rank: int, world: int) -> None:
    """Ranks that disagree must get a clear error, not a hang. Gradients are set by hand: no collective
    of the training itself can pair with gradlog's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    results: dict[str, str | None] = {}

    def sharded() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = nn.Linear(4, 4, bias=False)
        m.weight = nn.Parameter(distribute_tensor(m.weight.detach(), mesh, [Shard(0)]))
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    def step(m: nn.Module, opt: torch.optim.Optimizer) -> None:
        w = m.weight
        m.weight.grad = DTensor.from_local(torch.ones_like(w.to_local()), mesh, [Shard(0)])
        opt.step()

    # 1. different settings (every) on the two ranks: caught by the layout check on both
    m, opt = sharded()
    gl = gradlog.GradLogger(m, opt, every=1 + rank, writer="memory", print_report=False)
    try:
        step(m, opt)
        results["layout"] = None
    except gradlog.DistributedMismatchError as exc:
        results["layout"] = str(exc)
    gl.pipeline.handles[0].remove()
    gl.pipeline.handles[1].remove()
    gradlog.run.lifecycle.ACTIVE.remove(gl)

    # 1b. different snapshot budgets: the ranks would copy different rows (`Meter._pick`), caught the same way
    m, opt = sharded()
    gl = gradlog.GradLogger(m, opt, snapshot_budget=1000 + rank, writer="memory", print_report=False)
    try:
        step(m, opt)
        results["budget"] = None
    except gradlog.DistributedMismatchError as exc:
        results["budget"] = str(exc)
    gl.pipeline.handles[0].remove()
    gl.pipeline.handles[1].remove()
    gradlog.run.lifecycle.ACTIVE.remove(gl)

    # 2. rank 1 drops its first measurement (a failure before its collective): the next exchange pairs
    # rank 0's step 0 with rank 1's step 1, and both ranks raise
    m, opt = sharded()
    gl = gradlog.GradLogger(m, opt, every=1, histograms=False, writer="memory", print_report=False)
    if rank == 1:
        real = gl.meter.start
        calls = {"n": 0}

        def flaky(*a: Any, **k: Any) -> None:
            calls["n"] += 1
            if calls["n"] == 1:
                raise ValueError("injected failure on rank 1")
            real(*a, **k)

        gl.meter.start = flaky  # type: ignore[method-assign]
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step(m, opt)
            if rank == 1:
                step(m, opt)
        results["index"] = None
    except gradlog.DistributedMismatchError as exc:
        results["index"] = str(exc)
    for h in gl.pipeline.handles:
        h.remove()
    gradlog.run.lifecycle.ACTIVE.remove(gl)

    # 4. without an optimizer, rank 1 skips the log() call for step 0: its log(1) meets rank 0's log(0) in the
    # collective, and the step passed to log() travels in it, so both ranks raise at once (issue 15)
    m, _ = sharded()
    m.weight.grad = DTensor.from_local(torch.ones_like(m.weight.to_local()), mesh, [Shard(0)])
    gl = gradlog.GradLogger(
        m, None, every=1, print_report=False, writer=gradlog.Output(writer="memory", sync_timeout=60)
    )
    results["skipped_log"] = None
    try:
        for s in (0, 1) if rank == 0 else (1,):
            gl.log(s)
    except gradlog.DistributedMismatchError as exc:
        results["skipped_log"] = str(exc)
    gradlog.run.lifecycle.ACTIVE.remove(gl)

    # 3. only rank 0 measures (log() without an optimizer, called on rank 0 alone): it times out with
    # a clear error instead of hanging; rank 1 never enters a gradlog collective
    m, _ = sharded()
    m.weight.grad = DTensor.from_local(torch.ones_like(m.weight.to_local()), mesh, [Shard(0)])
    gl = gradlog.GradLogger(
        m, None, every=1, print_report=False, writer=gradlog.Output(writer="memory", sync_timeout=3)
    )
    results["timeout"] = None
    if rank == 0:
        try:
            gl.log(0)
        except gradlog.DistributedMismatchError as exc:
            results["timeout"] = str(exc)
    gradlog.run.lifecycle.ACTIVE.remove(gl)

    _save(out, "mismatch", rank, {"results": results})


def resume_suite(out: str, rank: int, world: int, second: bool) -> None:
    """One launch of the resumed FSDP2 run: steps 0..29 then a checkpoint, or (`second`) the checkpoint
    loaded and steps 30..59 with `late` unfrozen and `slow`'s lr at 0, resumed into the same log_dir."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = FrozenMainLateSlow()  # `frozen` frozen throughout; `late` until the resume; `slow`'s lr to 0 then
    model.frozen.requires_grad_(False)
    model.late.requires_grad_(False)
    fully_shard(model, mesh=mesh)
    groups = [
        {"params": [*model.main.parameters(), *model.late.parameters()]},
        {"params": list(model.slow.parameters())},
    ]
    opt = torch.optim.Adam(groups, lr=1e-2)
    log_dir, ckpt = os.path.join(out, "run"), os.path.join(out, "ckpt")
    output = gradlog.Output("tensorboard", resume=second)
    if second:  # load first: gradlog fingerprints the weights it starts from
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=ckpt)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        model.late.requires_grad_(True)
        opt.param_groups[1]["lr"] = 0.0
    gl = gradlog.GradLogger(model, opt, writer=output, every=5, log_dir=log_dir, print_report=False)
    for step in range(30, 60) if second else range(30):
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(8, 4, generator=g)[rank * 4 : rank * 4 + 4]
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        gl.log()
    if not second:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    report = gl.close()
    steps = {"optimizer_steps": gl.optimizer_steps}
    _save(out, "resume_second" if second else "resume_first", rank, {"report": report.to_dict(), **steps})


if __name__ == "__main__":
    out_dir, suite = sys.argv[1], sys.argv[2]
    import torch.distributed as dist

    dist.init_process_group("gloo")
    r, w = dist.get_rank(), dist.get_world_size()
    try:
        if suite.startswith("resume_"):
            resume_suite(out_dir, r, w, second=suite == "resume_second")
        else:
            (main_suite if suite == "main" else mismatch_suite)(out_dir, r, w)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    # a broken gloo pair (the timeout case) can make a clean shutdown hang: leave without it
    os._exit(0)
