"""Runs under `torchrun --nproc_per_node 2` (gloo, CPU) for tests/test_zero.py.

Usage: python -m torch.distributed.run --nproc_per_node 2 tests/zero_worker.py OUT_DIR SUITE
SUITE "zero": DeepSpeed ZeRO-1 and ZeRO-2 (and ZeRO-2 accumulating 2 micro-batches) on its CPU accelerator
(DS_ACCELERATOR=cpu) train `catalogue.ZeroPlanted` (a frozen layer, a dead layer, a layer left out of the
optimizer, two param groups, gradient clipping) with gradlog attached through the engine, and a plain-PyTorch
replica trains the same model on the same global batch; each records to OUT_DIR/<case>-rank<r>.json what gradlog wrote
and reported, the engine's global gradient norms and step counts, and the final weights.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from catalogue import ZeroPlanted
from dist_worker import count_collectives
from torch import nn

import gradlog

STEPS, EVERY, CLIP = 12, 2, 0.1
#: a snapshot_budget (bytes) below a third of `ZeroPlanted`'s 1,936 trained bytes: its copies rotate over 3 steps
BUDGET = 600


def config(stage: int, clip: float = CLIP, threshold: int | None = None) -> dict[str, Any]:
    """`threshold`: ZeRO-3's `stage3_param_persistence_threshold` (None: DeepSpeed's default, 1e5 elements,
    under which every tensor of `ZeroPlanted` stays whole on every rank; 0: every tensor is shape (0,))."""
    zero: dict[str, Any] = {"stage": stage}
    if threshold is not None:
        zero["stage3_param_persistence_threshold"] = threshold
    return {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": zero,
        "gradient_clipping": clip,
    }


def save(out: Path, case: str, payload: dict[str, Any]) -> None:
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    (out / f"{case}-rank{rank}.json").write_text(json.dumps(payload))


def whole_weights(model: nn.Module) -> dict[str, list[float]]:
    """Every tensor's values, whole (under ZeRO-3 gathered from the ranks' partitions first)."""
    params = list(model.named_parameters())
    if not any(hasattr(p, "ds_id") for _, p in params):
        return {n: p.detach().reshape(-1).tolist() for n, p in params}
    import deepspeed

    with deepspeed.zero.GatheredParameters([p for _, p in params]):
        return {n: p.detach().reshape(-1).tolist() for n, p in params}


def result(mem: gradlog.MemoryWriter, report: gradlog.Report, model: nn.Module, **extra: Any) -> dict[str, Any]:
    weights = whole_weights(model)
    hists = {
        tag: [(s, list(h.counts), h.min, h.max, h.sum, h.count, h.nonfinite) for s, h in vals]
        for tag, vals in mem.histograms.items()
    }
    return {
        "scalars": mem.scalars,
        "histograms": hists,
        "report": report.to_dict(),
        "verdict": report.verdict,
        "weights": weights,
        **extra,
    }


def engine_run(
    out: Path,
    stage: int,
    accumulate: int = 1,
    threshold: int | None = None,
    sub_group: int | None = None,
    budget: int | None = None,
) -> None:
    """`accumulate` > 1: each rank's share of the global batch in that many micro-batches (one engine.step()
    each; DeepSpeed steps its optimizer at the last). `threshold`: see `config`. `sub_group`: ZeRO-3's
    `sub_group_size` (elements per flat fp32 partition it steps at a time: small, each group is split in many).
    `budget`: a snapshot_budget in bytes (`BUDGET`), the tensors each measured step copied saved as `copied`."""
    import deepspeed

    model = ZeroPlanted()
    size = 4 // accumulate
    cfg = {**config(stage, threshold=threshold), "train_micro_batch_size_per_gpu": size}
    cfg["gradient_accumulation_steps"] = accumulate
    if sub_group is not None:
        cfg["zero_optimization"]["sub_group_size"] = sub_group
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.groups(), config=cfg)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(engine, writer=mem, every=EVERY, print_report=False, **_budget(budget))
    rank = torch.distributed.get_rank()
    norms = []
    copied: list[list[str]] = []
    for step in range(STEPS):
        x, y = ZeroPlanted.batch(step)
        for micro in range(accumulate):
            mine = slice(4 * rank + size * micro, 4 * rank + size * (micro + 1))
            engine.backward(nn.functional.mse_loss(engine(x[mine]), y[mine]))
            engine.step()
        if step % EVERY == 0:
            copied.append(list(gl.meter.copied))
        gl.log(step)
        norms.append(float(engine.get_global_grad_norm()))
    report = gl.close()
    released = "step" not in vars(engine.optimizer)  # close() gave the ZeRO optimizer its own step back
    extra = {"norms": norms, "steps": gl.optimizer_steps, "engine_steps": engine.global_steps, "released": released}
    payload = result(mem, report, engine.module, **extra)  # the weights before the step below
    for _ in range(accumulate):  # training goes on without gradlog
        engine.backward(nn.functional.mse_loss(engine(x[:size]), y[:size]))
        engine.step()
    payload["after_close"] = {"gradlog": gl.optimizer_steps, "engine": engine.global_steps - extra["engine_steps"]}
    shapes = {n: list(p.shape) for n, p in engine.module.named_parameters()}  # ZeRO-3: (0,) unless persistent
    payload["shapes"] = shapes
    payload["sub_groups"] = len(getattr(engine.optimizer, "fp16_groups", []))
    payload |= {"copied": copied, "rotation": report.update_rotation}
    case = f"zero{stage}" + (f"-accumulate{accumulate}" if accumulate > 1 else "")
    case += f"-threshold{threshold}" if threshold is not None else ""
    case += f"-budget{budget}" if budget is not None else ""
    save(out, case + (f"-subgroup{sub_group}" if sub_group is not None else ""), payload)


def bf16_run(out: Path, stage: int, threshold: int | None = None) -> None:
    """bf16 weights: gradlog's numbers against the fp32 masters and gradients DeepSpeed assembles itself
    (`deepspeed.utils.safe_get_full_fp32_param` / `safe_get_full_grad`, one collective per tensor), every step."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    model = ZeroPlanted()
    cfg = {**config(stage, threshold=threshold), "bf16": {"enabled": True}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.groups(), config=cfg)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(engine, writer=mem, every=1, print_report=False)
    rank = torch.distributed.get_rank()
    trained = {n: p for n, p in engine.module.named_parameters() if n.startswith(("inp.", "out."))}
    truth: dict[str, list[tuple[float, float]]] = {n: [] for n in trained}
    for step in range(4):
        x, y = ZeroPlanted.batch(step)
        mine = slice(4 * rank, 4 * rank + 4)
        engine.backward(nn.functional.mse_loss(engine(x[mine].bfloat16()).float(), y[mine]))
        grads = {n: float(safe_get_full_grad(p).float().norm()) for n, p in trained.items()}
        before = {n: safe_get_full_fp32_param(p).clone() for n, p in trained.items()}
        engine.step()
        gl.log(step)
        for n, p in trained.items():
            after = safe_get_full_fp32_param(p)
            truth[n].append((grads[n], float((after - before[n]).norm() / before[n].norm())))
    gl.close()
    save(out, f"zero{stage}-bf16", {"scalars": mem.scalars, "truth": truth, "dtype": str(trained["inp.weight"].dtype)})


def skip_run(out: Path, stage: int, threshold: int | None = None) -> None:
    """Step 2's loss times inf: its gradients are not finite, so DeepSpeed skips that step (the weights stay,
    `engine.skipped_steps` counts it); gradlog measures every step."""
    import deepspeed

    model = ZeroPlanted()
    cfg = config(stage, threshold=threshold)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.groups(), config=cfg)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(engine, writer=mem, every=1, print_report=False)
    rank = torch.distributed.get_rank()
    for step in range(4):
        x, y = ZeroPlanted.batch(step)
        loss = nn.functional.mse_loss(engine(x[4 * rank : 4 * rank + 4]), y[4 * rank : 4 * rank + 4])
        engine.backward(loss * math.inf if step == 2 else loss)
        engine.step()
        gl.log(step)
    report = gl.close()
    payload = {"scalars": mem.scalars, "skipped": report.skipped_steps, "steps": gl.optimizer_steps}
    save(out, f"zero{stage}-skip", {**payload, "engine_skipped": engine.skipped_steps})


def _budget(budget: int | None) -> dict[str, Any]:
    return {"snapshot_budget": budget} if budget is not None else {}


def replica(out: Path, budget: int | None = None) -> None:
    """The same model, optimizer groups, clipping and global batch in plain PyTorch, in one process."""
    model = ZeroPlanted()
    groups = model.groups()
    opt = torch.optim.AdamW(groups)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=EVERY, print_report=False, **_budget(budget))
    trained = [p for g in groups for p in g["params"]]
    norms = []
    copied: list[list[str]] = []
    for step in range(STEPS):
        x, y = ZeroPlanted.batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        norms.append(float(gradlog.clip_grad_norm_(trained, CLIP)))
        # DeepSpeed never averages the gradient of a tensor its optimizer does not hold (each rank keeps its
        # own), and gradlog measures none there: the replica's left-out layer has none either
        model.extra.zero_grad(set_to_none=True)
        opt.step()
        if step % EVERY == 0:
            copied.append(list(gl.meter.copied))
        gl.log(step)
    report = gl.close()
    extra = {"norms": norms, "steps": gl.optimizer_steps, "copied": copied, "rotation": report.update_rotation}
    save(out, "replica" + (f"-budget{budget}" if budget is not None else ""), result(mem, report, model, **extra))


def cost(out: Path, stage: int = 2, steps: int = 20, width: int = 512) -> None:
    """Seconds per step of a 4-layer MLP (width 512: 1.05M parameters) under ZeRO-`stage`, un-monitored and
    with gradlog measuring every step (every=1), alternated twice; then the same model in plain PyTorch on
    this rank alone (AdamW), for gradlog's own measured-step cost without ZeRO. Rank 0's wall clock. ZeRO-3 at
    DeepSpeed's default persistence threshold: the 512x512 weights partitioned, the biases whole on every rank."""
    import deepspeed

    rank = torch.distributed.get_rank()
    times: dict[str, float] = {}
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(rank))
    for mode in ("off", "every1", "off2", "every1b", "plain-off", "plain-every1"):
        torch.manual_seed(0)
        model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(width, width), nn.ReLU())])
        if mode.startswith("plain"):
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            engine: Any = None
        else:
            engine, opt, _, _ = deepspeed.initialize(
                model=model, model_parameters=model.parameters(), config=config(stage)
            )
        watched = engine if engine is not None else model
        on = "every" in mode
        gl = (
            gradlog.GradLogger(watched, opt if engine is None else None, writer="memory", every=1, print_report=False)
            if on
            else None
        )
        for i in range(steps + 3):
            if i == 3:
                torch.distributed.barrier()
                start = time.perf_counter()
            if engine is not None:
                engine.backward(engine(x).pow(2).mean())
                engine.step()
            else:
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                opt.step()
            if gl is not None:
                gl.log(i)
        times[mode] = (time.perf_counter() - start) / steps
        if gl is not None:
            gl.close()
    save(out, "cost", times)


def zero_suite(out: Path) -> None:
    import deepspeed
    import deepspeed.ops

    # on CPU DeepSpeed JIT-builds a shared-memory all-reduce (minutes of C++ compile); gloo does without it
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    if os.environ.get("ZERO_COST"):  # the measured-step cost alone (a timing: not part of the tests)
        cost(out, stage=3 if os.environ["ZERO_COST"] == "3" else 2)  # ZERO_COST=3: under ZeRO-3
        return
    for stage in (1, 2):
        engine_run(out, stage)
    engine_run(out, 2, accumulate=2)
    bf16_run(out, 2)
    skip_run(out, 2)
    replica(out)


def planted_net(out: Path) -> None:
    """tests/dist_worker.py's planted `Net` (dead units of `inp`, units silenced from step 7, a frozen, an unused
    and a zero-lr layer, a 1-row `gate` cut between the ranks, a head stopped after step 0) under ZeRO-3 with
    every tensor partitioned (threshold 0), its three param groups through a client AdamW; and its replica."""
    import deepspeed
    import dist_worker as W
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    torch.manual_seed(0)
    mem, report, n = W.train(W.Net())
    save(out, "net-replica", W.dump(mem, report, n))
    torch.manual_seed(0)
    net = W.Net()
    cfg = {**config(3, threshold=0), "zero_allow_untested_optimizer": True}
    cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"] = W.GLOBAL_BATCH, W.GLOBAL_BATCH // 2
    del cfg["optimizer"], cfg["gradient_clipping"]
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=W.make_optimizer(net), config=cfg)
    mem = gradlog.MemoryWriter()
    hist = gradlog.HistogramOptions(every=2, bins=16)
    gl = gradlog.GradLogger(engine, writer=mem, every=1, print_report=False, histograms=hist)
    calls: list[tuple[str, int]] = []  # every collective gradlog makes: (op, measured step)
    count_collectives(gl, calls)
    rank, per = torch.distributed.get_rank(), W.GLOBAL_BATCH // 2
    keep = torch.ones(16)
    keep[list(W.STOPPED)] = 0.0
    now = [0]
    hook = engine.module.inp.register_forward_hook(lambda m, a, o: o * keep if now[0] >= W.STOP_AT else None)
    trained = {n: p for n, p in engine.module.named_parameters() if p.requires_grad and "unused" not in n}
    truth: dict[str, list[tuple[float, float, float]]] = {n: [] for n in trained}  # grad, ratio, weight after
    for step in range(W.STEPS):
        now[0] = step
        x, y = W.data(step)
        mine = slice(rank * per, (rank + 1) * per)
        engine.backward(nn.functional.mse_loss(engine(x[mine]), y[mine]))
        grads = {n: float(safe_get_full_grad(p).norm()) for n, p in trained.items()}
        before = {n: safe_get_full_fp32_param(p).clone() for n, p in trained.items()}
        engine.step()
        gl.log(step)
        W.stop(engine.optimizer.optimizer, step)  # the inner optimizer's groups: the view reads their lr
        for n, p in trained.items():
            after = safe_get_full_fp32_param(p)
            moved, weight = float((after - before[n]).norm()), float(before[n].norm())
            # nan: a zero-initialised bias; gradlog's weight norm is the weights' after the step
            truth[n].append((grads[n], moved / weight if weight else math.nan, float(after.norm())))
    hook.remove()
    during = len(calls)
    payload = {**W.dump(mem, gl.close(), 1), "truth": truth}
    save(out, "net-zero3", {**payload, "collectives": calls[:during], "at_close": [op for op, _ in calls[during:]]})


def zero3_suite(out: Path) -> None:
    """ZeRO-3 with DeepSpeed's default persistence threshold (every tensor of the model stays whole on every
    rank) and with threshold 0 (every tensor shape (0,) outside forward/backward), and the replica."""
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    engine_run(out, 3)
    engine_run(out, 3, threshold=0)
    engine_run(out, 3, accumulate=2, threshold=0, sub_group=100)
    bf16_run(out, 3, threshold=0)
    skip_run(out, 3, threshold=0)
    replica(out)
    planted_net(out)


def zero3_budget_suite(out: Path) -> None:
    """ZeRO-3 (threshold 0: every tensor partitioned) under a snapshot_budget of `BUDGET` bytes, and its replica."""
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    engine_run(out, 3, threshold=0, budget=BUDGET)
    replica(out, budget=BUDGET)


if __name__ == "__main__":
    out_dir, suite = Path(sys.argv[1]), sys.argv[2]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    {"zero": zero_suite, "zero3": zero3_suite, "zero3-budget": zero3_budget_suite}[suite](out_dir)
