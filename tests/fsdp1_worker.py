"""Runs under `torchrun --nproc_per_node 2` (gloo, CPU) for tests/test_fsdp1.py.

Usage: python -m torch.distributed.run --nproc_per_node 2 tests/fsdp1_worker.py OUT_DIR SUITE
Trains `catalogue.FrozenDeadLeftOut` under FSDP1 with use_orig_params=True (SUITE "main": FULL_SHARD;
"more": SHARD_GRAD_OP and NO_SHARD), and in the same process a plain-PyTorch replica (same seed, the whole
global batch, gradlog on one process: no collective, no shard), and saves to OUT_DIR/<case>-rank<r>.json
what gradlog wrote and reported for each, plus the replica's own gradient norms, computed by hand. "main" also
records the errors gradlog raises for FSDP1 without use_orig_params, FSDP1 reached through `.module`, and HYBRID_SHARD.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from catalogue import FrozenDeadLeftOut
from dist_worker import count_collectives
from torch import nn

import gradlog

STEPS = 6
GLOBAL_BATCH = 8


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)


def train(model: nn.Module, rank: int, world: int, calls: list[tuple[str, int]] | None = None) -> dict[str, Any]:
    """STEPS AdamW steps on this rank's share of the global batch; what gradlog wrote and reported, and the
    total gradient norm by hand (plain tensors only: the replica)."""
    opt = FrozenDeadLeftOut.optimizer_without_left(model)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(
        model, opt, writer=mem, every=1, print_report=False, histograms=gradlog.HistogramOptions(every=2, bins=16)
    )
    if calls is not None:  # every collective gradlog makes, with its measured step
        count_collectives(gl, calls)
    per = GLOBAL_BATCH // world
    by_hand: list[float] = []
    for step in range(STEPS):
        x, y = data(step)
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        nn.functional.mse_loss(model(x), y).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        by_hand.append(math.sqrt(sum(float(g.double().square().sum()) for g in grads)))
        opt.step()
        gl.log(step)
        opt.zero_grad()
    report = gl.close()
    hists = {
        tag: [(s, list(h.counts), h.min, h.max, h.sum, h.sum_squares, h.count) for s, h in vals]
        for tag, vals in mem.histograms.items()
    }
    return {
        "scalars": mem.scalars,
        "histograms": hists,
        "report": report.to_dict(),
        "verdict": report.verdict,
        "tables": report.table(),
        "by_hand": by_hand,
    }


def _save(out: Path, case: str, rank: int, payload: dict[str, Any]) -> None:
    (out / f"{case}-rank{rank}.json").write_text(json.dumps(payload))


def _error(make: Callable[[], object]) -> dict[str, Any]:
    try:
        make()
    except Exception as exc:  # recorded for the test: type and message
        return {"type": type(exc).__name__, "error": str(exc)}
    return {"type": None, "error": None}


def fsdp1(strategy: str, orig: bool = True) -> nn.Module:
    """The catalogue model under FSDP1: `inp` and `head` wrapped on their own, the rest in the root."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    torch.manual_seed(0)
    model = FrozenDeadLeftOut()
    if not orig:  # FSDP1 flattens only tensors that agree on requires_grad without use_orig_params
        model.frozen.requires_grad_(True)
    kw: dict[str, Any] = {
        "use_orig_params": orig,
        "device_id": torch.device("cpu"),
        "sharding_strategy": ShardingStrategy[strategy],
    }
    if strategy == "HYBRID_SHARD":  # replicated over 1 group, sharded over 2 ranks: a mesh says which
        from torch.distributed.device_mesh import init_device_mesh

        kw["device_mesh"] = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
    model.inp = FSDP(model.inp, **kw)  # type: ignore[assignment]
    model.head = FSDP(model.head, **kw)  # type: ignore[assignment]
    return FSDP(model, **kw)


def local_shapes(model: nn.Module) -> dict[str, list[int]]:
    return {n: list(p.shape) for n, p in model.named_parameters()}


def planted(out: Path, rank: int, world: int) -> None:
    """tests/dist_worker.py's `Net` (dead units, units stopped mid-run, a frozen, an unused, a zero-lr layer, a
    stalled head) under FSDP1 FULL_SHARD, `blocks` and `inp` wrapped on their own (the planted units of `inp` lie
    on both ranks), and its replica on one process."""
    import dist_worker as W
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    mem, report, n = W.train(W.Net())
    _save(out, "net-replica", rank, W.dump(mem, report, n))

    def wrap(net: nn.Module) -> nn.Module:
        kw: dict[str, Any] = {"use_orig_params": True, "device_id": torch.device("cpu")}
        for i, b in enumerate(net.blocks):
            net.blocks[i] = FSDP(b, **kw)
        net.inp = FSDP(net.inp, **kw)  # rows 0-8 on rank 0, 9-15 on rank 1
        return FSDP(net, **kw)

    torch.manual_seed(0)
    model = wrap(W.Net())
    shapes = local_shapes(model)
    mem, report, n = W.train(model, rank, world)
    _save(out, "net-fsdp1", rank, {**W.dump(mem, report, n), "local_shapes": shapes})
    # under a snapshot budget far below the weights' bytes (test_distributed.assert_budget_rotates)
    for name, make in (("net-replica-budget", W.Net), ("net-fsdp1-budget", lambda: wrap(W.Net()))):
        torch.manual_seed(0)
        copied: list[list[str]] = []
        mem, report, n = W.train(make(), rank, world if "fsdp1" in name else 1, budget=W.BUDGET, copied=copied)
        _save(out, name, rank, {**W.dump(mem, report, n), "copied": copied})


def main(out: Path, suite: str) -> None:
    """SUITE "main": the replica, FULL_SHARD and the refusals; "more": the replica, SHARD_GRAD_OP and NO_SHARD."""
    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

    torch.manual_seed(0)
    _save(out, "replica", rank, train(FrozenDeadLeftOut(), 0, 1))

    for strategy in ("FULL_SHARD",) if suite == "main" else ("SHARD_GRAD_OP", "NO_SHARD"):
        model = fsdp1(strategy)
        shapes = local_shapes(model)
        calls: list[tuple[str, int]] = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            payload = train(model, rank, world, calls)
        said = [str(w.message) for w in caught if str(w.message).startswith("gradlog")]
        _save(out, f"fsdp1-{strategy}", rank, {**payload, "local_shapes": shapes, "collectives": calls, "said": said})

    if suite == "main":
        planted(out, rank, world)
        checked(out, rank, world)
        refusals(out, rank)
    torch.distributed.destroy_process_group()


def checked(out: Path, rank: int, world: int) -> None:
    """`gradlog.check` on FSDP1 (its share of one batch) and on the replica (the whole batch): the verdicts, and
    whether the check left every weight as it found it."""
    verdicts: dict[str, Any] = {}
    for name, model, lo, n in (
        ("replica", FrozenDeadLeftOut(), 0, GLOBAL_BATCH),
        ("fsdp1", fsdp1("FULL_SHARD"), rank * GLOBAL_BATCH // world, GLOBAL_BATCH // world),
    ):
        torch.manual_seed(0)
        opt = FrozenDeadLeftOut.optimizer_without_left(model)
        before = [p.detach().clone() for p in model.parameters()]
        result = gradlog.check(model, opt, data(0)[0][lo : lo + n], print_report=False)
        kept = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        verdicts[name] = {"verdict": result.verdict, "kept": kept}
    import dist_worker as W
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    for name, make in (
        ("net-replica", W.Net),
        ("net-fsdp1", lambda: FSDP(W.Net(), use_orig_params=True, device_id=torch.device("cpu"))),
    ):
        torch.manual_seed(0)
        model = make()
        x, y = W.data(0)
        lo, n = (0, len(x)) if name == "net-replica" else (rank * len(x) // world, len(x) // world)
        loss = lambda m, b: nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
        result = gradlog.check(model, W.make_optimizer(model), (x[lo : lo + n], y[lo : lo + n]), loss_fn=loss)
        verdicts[name] = {"in_batch": result.to_dict()["in_batch"]}
    _save(out, "check", rank, verdicts)


def refusals(out: Path, rank: int) -> None:
    """FSDP1 without use_orig_params, reached through `.module`, and HYBRID_SHARD: what gradlog raises."""

    def logger(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[], object]:
        return lambda: gradlog.GradLogger(model, opt, writer="memory", print_report=False)

    for orig in (True, False):
        model = fsdp1("FULL_SHARD", orig)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _save(out, f"module-orig{orig}", rank, _error(logger(model.module, opt)))
        if not orig:
            _save(out, "flat", rank, _error(logger(model, opt)))
            batch = data(0)[0][:4]
            _save(out, "flat-check", rank, _error(lambda: gradlog.check(model, opt, batch, print_report=False)))  # noqa: B023
    model = fsdp1("HYBRID_SHARD")
    _save(out, "hybrid", rank, _error(logger(model, torch.optim.SGD(model.parameters(), lr=0.1))))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(Path(sys.argv[1]), sys.argv[2])
