"""FSDP1 with `use_orig_params=True` is measured globally; FSDP1 without it, or reached through `.module`, is refused.

Two real gloo ranks (torchrun, see tests/fsdp1_worker.py) train `catalogue.FrozenDeadLeftOut` (a frozen layer, a
dead layer whose gradient is exactly zero, a layer left out of the optimizer) under FSDP1 FULL_SHARD (and,
heavy, SHARD_GRAD_OP and NO_SHARD); the same worker trains a plain-PyTorch replica on the whole global batch with
gradlog on one process. Rank 0's numbers (per-tensor gradient norms, update ratios, weight norms, zero
fractions, the total gradient norm, histograms) and the verdict's tables must equal the replica's. Before
issue 43 gradlog refused FSDP1 outright, and `fsdp.module` with use_orig_params=True was measured shard-locally
(a total norm of 0.094 for a true 0.742).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from catalogue import two_ranks, untraced
from test_distributed import assert_budget_rotates

from gradlog.measure.flat_shards import FlatShard

needs_dist = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")

SHARDED = ("FULL_SHARD", "SHARD_GRAD_OP")


def _launch(tmp: pytest.TempPathFactory, suite: str) -> dict[str, list[Any]]:
    out: Path = tmp.mktemp(f"fsdp1-{suite}")
    return two_ranks("fsdp1_worker.py", out, suite, timeout=300, env={"OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("shape", [(5, 3), (4, 2, 3), (7,)])
def test_a_slice_read_as_whole_rows_gives_the_tensors_slices_for_every_cut(shape: tuple[int, ...]) -> None:
    """`FlatShard.rows` (what each rank's per-slice evidence is taken on), for every way two ranks can cut the
    flattened tensor: OR-ing each rank's per-row and per-column "non-zero" at its global rows gives the whole
    tensor's, a zero row and a zero column planted."""
    w = torch.randn(shape)
    w[1] = 0.0
    if len(shape) > 1:
        w[:, 0] = 0.0
    flat, n = w.reshape(-1), w.numel()
    for cut in range(n + 1):
        rows = torch.zeros(shape[0], dtype=torch.bool)
        cols = torch.zeros(shape[1] if len(shape) > 1 else 1, dtype=torch.bool)
        for start, end in ((0, cut), (cut, n)):
            shard = FlatShard(shape, start, end - start)
            view = shard.rows(flat[start:end].clone())
            size, first = shard.span(0)
            assert size == shape[0] and tuple(view.shape) == shard.view_shape
            if not view.shape[0]:  # this rank holds none of it
                continue
            rows[first : first + view.shape[0]] |= view.reshape(view.shape[0], -1).ne(0).any(1)
            if len(shape) > 1:
                cols |= view.ne(0).transpose(0, 1).reshape(shape[1], -1).any(1)
        assert torch.equal(rows, w.reshape(shape[0], -1).ne(0).any(1)), cut
        if len(shape) > 1:
            assert torch.equal(cols, w.transpose(0, 1).reshape(shape[1], -1).ne(0).any(1)), cut


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """FULL_SHARD and the refusals (about 20 s: the default run)."""
    return _launch(tmp_path_factory, "main")


@pytest.fixture(scope="module")
def more_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """SHARD_GRAD_OP and NO_SHARD (a second launch: heavy)."""
    return _launch(tmp_path_factory, "more")


def _close(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= 1e-5 * max(abs(a), abs(b)) + 1e-7


def _differences(got: dict[str, Any], want: dict[str, Any]) -> list[Any]:
    bad: list[Any] = []
    for tag, series in want["scalars"].items():
        mine = got["scalars"].get(tag)
        if mine is None or [s for s, _ in mine] != [s for s, _ in series]:
            bad.append((tag, "missing or other steps"))
            continue
        bad += [(tag, s, a, b) for (s, a), (_, b) in zip(mine, series) if not _close(a, b)]
    return bad


@pytest.mark.slow
@needs_dist
def test_fsdp1_full_shard_equals_the_replica(runs: Any) -> None:
    assert_equals_the_replica(runs, "FULL_SHARD")


@pytest.mark.heavy
@pytest.mark.slow
@needs_dist
@pytest.mark.parametrize("strategy", ["SHARD_GRAD_OP", "NO_SHARD"])
def test_fsdp1_other_strategies_equal_the_replica(more_runs: Any, strategy: str) -> None:
    assert_equals_the_replica(more_runs, strategy)
    calls = more_runs[f"fsdp1-{strategy}"][0]["collectives"]
    if strategy == "NO_SHARD":  # replicated, as under DDP: no collective
        assert calls == []
    else:
        assert len([c for c in calls if c[0] == "sum"]) == 6  # one SUM per measured step


def assert_equals_the_replica(runs: Any, strategy: str) -> None:
    (replica, _), (rank0, rank1) = runs["replica"], runs[f"fsdp1-{strategy}"]
    if strategy in SHARDED:  # really sharded: 1-D slices, rank 0 holding none of head.bias
        shapes = rank0["local_shapes"]
        assert shapes["_fsdp_wrapped_module.head._fsdp_wrapped_module.bias"] == [0]
        assert all(len(s) == 1 for s in shapes.values())
        assert rank1["local_shapes"]["_fsdp_wrapped_module.head._fsdp_wrapped_module.bias"] == [4]
    total = replica["scalars"]["gradlog/grad_norm_total"]
    # the replica's own total gradient norm, by hand: gradlog's single-process number is the truth
    assert all(_close(v, h) for (_, v), h in zip(total, replica["by_hand"])) and total[0][1] > 0
    # names as the user wrote them, every number global (dead_frac too: per-row flags combined over ranks)
    assert not _differences(rank0, replica)
    assert set(rank0["scalars"]) == set(replica["scalars"])
    assert "weights/update_ratio/inp.weight" in rank0["scalars"] and "weights/grad_norm/head.bias" in rank0["scalars"]
    assert sorted(rank0["histograms"]) == sorted(replica["histograms"])
    for tag, series in replica["histograms"].items():
        for (s1, c1, lo1, hi1, _, sq1, n1), (s2, c2, lo2, hi2, _, sq2, n2) in zip(rank0["histograms"][tag], series):
            assert (s1, n1) == (s2, n2) and all(_close(a, b) for a, b in [(lo1, lo2), (hi1, hi2), (sq1, sq2)]), tag
            assert sum(abs(a - b) for a, b in zip(c1, c2)) <= 2, tag  # a value on a bucket edge may move one over
    # the verdict and its tables, on both ranks
    for rank in (rank0, rank1):
        assert rank["verdict"] == replica["verdict"]
        # every record field by field (the console tables are drawn from them); the replica's details also name
        # the traced `* 0`, which FSDP1's flat gradients do not show the trace (docs/distributed.md)
        assert untraced(rank["report"]) == untraced(replica["report"])
        assert rank["tables"].splitlines()[0] == replica["tables"].splitlines()[0]
    reasons = {r["name"]: r["reason"] for r in replica["report"]["never_updated"]}
    assert reasons == {
        "frozen.weight": "frozen",
        "frozen.bias": "frozen",
        "dead.weight": "zero_grad",
        "dead.bias": "zero_grad",
        "left.weight": "not_in_optimizer",
        "left.bias": "not_in_optimizer",
    }


@pytest.mark.slow
@needs_dist
def test_fsdp1_collectives_per_measured_step(runs: Any) -> None:
    """FSDP2's pattern: one MAX (step check + gradient ranges) and one SUM per measured step, one more MAX of the
    weight/update ranges on histogram steps (every 2nd)."""
    calls = [tuple(c) for c in runs["fsdp1-FULL_SHARD"][0]["collectives"]]
    per_step = {s: [op for op, i in calls if i == s] for s in range(6)}
    assert per_step == {s: ["max", "max", "sum"] if s % 2 == 0 else ["max", "sum"] for s in range(6)}


@pytest.mark.slow
@needs_dist
def test_fsdp1_run_gets_no_gradlog_warning(runs: Any) -> None:
    assert [rank["said"] for rank in runs["fsdp1-FULL_SHARD"]] == [[], []]


#: `unused` is never called in forward: FSDP1 hands it a zero gradient (its part of the flat gradient), not None
UNUSED = ("unused.weight", "unused.bias")


@pytest.mark.slow
@needs_dist
def test_fsdp1_slices_equal_the_replica(runs: Any) -> None:
    """tests/dist_worker.py's planted `Net`: dead units (partly updated), units silenced from step 7 (stopped
    slices) and dead_frac come out of FSDP1's 1-D slices as out of the replica's whole tensors: each rank's
    slice is read as the whole rows it touches and combined over ranks (rows cut between ranks included)."""
    (replica, _), (rank0, rank1) = runs["net-replica"], runs["net-fsdp1"]
    inp = "_fsdp_wrapped_module.inp._fsdp_wrapped_module.weight"  # dead units 1 | 9, 10; stopped 4 | 12
    assert (rank0["local_shapes"][inp], rank1["local_shapes"][inp]) == ([72], [56])
    fc = "_fsdp_wrapped_module.blocks.0._fsdp_wrapped_module.fc.weight"  # 16x16, cut inside row 7, with dead rows
    assert rank0["local_shapes"][fc][0] % 16 and any(
        v > 0 for _, v in replica["scalars"]["weights/dead_frac/blocks.0.fc.weight"]
    )
    assert replica["partly"] and replica["stopped"]  # not a vacuous comparison
    for rank in (rank0, rank1):
        assert rank["partly"] == replica["partly"]
        assert rank["stopped"] == replica["stopped"]
    per_tensor = {t for t in replica["scalars"] if t.startswith("weights/") and not t.endswith(UNUSED)}
    assert any(t.startswith("weights/dead_frac/") for t in per_tensor)
    assert not _differences({"scalars": rank0["scalars"]}, {"scalars": {t: replica["scalars"][t] for t in per_tensor}})
    never = {r["name"]: r["reason"] for r in rank0["report"]["never_updated"]}
    assert never == {r["name"]: r["reason"] for r in replica["report"]["never_updated"]} | dict.fromkeys(
        UNUSED, "zero_grad"
    )
    assert rank0["report"]["stalled"] == replica["report"]["stalled"]


@pytest.mark.slow
@needs_dist
def test_gradlog_check_on_fsdp1_equals_the_replica(runs: Any) -> None:
    """`gradlog.check` (one step, then the weights and optimizer put back) on FSDP1: the replica's verdict."""
    for rank in runs["check"]:
        assert rank["fsdp1"] == rank["replica"] and rank["fsdp1"]["kept"]
        assert "zero_grad 2, not_in_optimizer 2" in rank["fsdp1"]["verdict"]
        # the in-batch slice table (dead units of one batch) is left out for FSDP1's slices, as for FSDP2's
        # shards, never read off a rank's 1-D slice as if its elements were the tensor's
        assert rank["net-replica"]["in_batch"] and rank["net-fsdp1"]["in_batch"] == []


def _refused(runs: Any, case: str, *patterns: str) -> None:
    assert len(runs[case]) == 2
    for payload in runs[case]:
        assert payload["type"] == "NotImplementedError", payload
        for pattern in patterns:
            assert re.search(pattern, payload["error"]), (pattern, payload["error"])


@pytest.mark.slow
@needs_dist
def test_fsdp1_without_use_orig_params_is_refused(runs: Any) -> None:
    _refused(runs, "flat", r"FSDP1 \(FullyShardedDataParallel\) without use_orig_params=True", "fully_shard")
    _refused(runs, "flat-check", "without use_orig_params=True", "fully_shard")
    _refused(runs, "module-origFalse", "without use_orig_params=True")


@pytest.mark.slow
@needs_dist
def test_fsdp1_reached_through_dot_module_is_refused(runs: Any) -> None:
    _refused(
        runs, "module-origTrue", "FSDP1-managed parameters", r"fsdp\.module", "use_orig_params=True", "fully_shard"
    )


@pytest.mark.slow
@needs_dist
def test_fsdp1_hybrid_shard_is_refused(runs: Any) -> None:
    _refused(runs, "hybrid", "sharding_strategy HYBRID_SHARD", "once per replica", "fully_shard")


@pytest.mark.slow
@needs_dist
def test_fsdp1_snapshot_budget_rotates_the_same_rows_on_every_rank(runs: Any) -> None:
    """FSDP1's slices under a snapshot_budget far below the weights' bytes: chosen from the whole tensors' bytes
    (a rank's slice may be empty), the same tensors copied on both ranks, each in its turn, with the one process's
    numbers and report (`test_distributed.assert_budget_rotates`)."""
    (rank0, rank1), replica = runs["net-fsdp1-budget"], runs["net-replica-budget"][0]
    # FSDP1 gives `unused` a zero gradient, not None (see test_fsdp1_slices_equal_the_replica): no no_grad alert
    apart = (
        *UNUSED,
        "never_updated/no_grad",
        "never_updated/zero_grad",
        "alerts",
        "no_grad_tensors",
        "zero_grad_tensors",
    )
    assert_budget_rotates(rank0, rank1, replica, apart=apart)
    for rank in (rank0, rank1):
        never = {r["name"]: r["reason"] for r in rank["report"]["never_updated"]}
        assert never == {r["name"]: r["reason"] for r in replica["report"]["never_updated"]} | dict.fromkeys(
            UNUSED, "zero_grad"
        )
        assert rank["report"]["stalled"] == replica["report"]["stalled"]
        assert rank["partly"] == replica["partly"] and rank["stopped"] == replica["stopped"]
