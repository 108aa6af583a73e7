"""DeepSpeed ZeRO-1, -2 and -3, measured through the engine, equal a plain-PyTorch run (issue 43).

Two real gloo ranks on DeepSpeed's CPU accelerator (tests/zero_worker.py) train `catalogue.ZeroPlanted`
(a frozen layer, a dead layer whose gradient is exactly zero, a layer left out of the optimizer, two
param groups, gradient clipping) with `GradLogger(engine)`; the reference is the same model, groups,
clipping and global batch trained in plain PyTorch with gradlog (its clipping through
`gradlog.clip_grad_norm_`). Before, gradlog measured rank 0's flat fp32 slice as the model's (a total
norm of 0.13 for 0.58), counted one step per param group, and named the dead layer not_in_optimizer;
then it refused ZeRO altogether. ZeRO-3 (`-k stage3`) runs with DeepSpeed's default persistence threshold
(every tensor of this model stays whole on every rank: before, "gradlog OK" while a frozen and a dead layer
never changed) and with threshold 0 (every tensor shape (0,) outside forward/backward: before, 8 false
not_in_optimizer alarms); then it was refused.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import pytest
import torch
from catalogue import two_ranks, untraced

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
STEPS, EVERY = 12, 2
pytestmark = [
    pytest.mark.heavy,
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed"),
    pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed not installed (pip install 'gradlog[deepspeed]')"),
    pytest.mark.timeout(1200),
]


ENV = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0"}


@pytest.fixture(scope="module")
def runs12(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    return two_ranks("zero_worker.py", tmp_path_factory.mktemp("zero"), "zero", 900, ENV)


@pytest.fixture(scope="module")
def runs3(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    return two_ranks("zero_worker.py", tmp_path_factory.mktemp("zero3"), "zero3", 900, ENV)


@pytest.fixture
def runs(request: pytest.FixtureRequest) -> dict[str, list[Any]]:
    """The suite the test's `case` belongs to: ZeRO-3's runs apart, so that `-k stage3` starts only those."""
    case = str(request.node.callspec.params.get("case", ""))
    runs: dict[str, list[Any]] = request.getfixturevalue("runs3" if case.startswith("zero3") else "runs12")
    return runs


def _series(run: dict[str, Any], tag: str) -> list[tuple[int, float]]:
    return [(int(s), float(v)) for s, v in run["scalars"][tag]]


def _close(a: float, b: float, rel: float = 2e-6) -> bool:
    return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= rel * max(abs(b), 1e-12)


# the third: 2 micro-batches per rank and engine step; ZeRO-3 at DeepSpeed's default persistence threshold (every
# tensor here whole on every rank) and at threshold 0 (every tensor shape (0,) outside forward/backward), the
# last with 2 micro-batches and each param group split in sub-groups
CASES = [
    "zero1",
    "zero2",
    "zero2-accumulate2",
    pytest.param("zero3", id="stage3-default-threshold"),
    pytest.param("zero3-threshold0", id="stage3-threshold0"),
    pytest.param("zero3-accumulate2-threshold0-subgroup100", id="stage3-accumulate2-subgroups"),
]


@pytest.mark.parametrize("case", CASES)
def test_zero_measures_every_tensor_as_the_single_process_replica(runs: Any, case: str) -> None:
    ds, ref = runs[case][0], runs["replica"][0]
    # the weights themselves agree: the replica is the same training
    for name, values in ref["weights"].items():
        assert max(abs(a - b) for a, b in zip(ds["weights"][name], values)) < 1e-6, name
    tags = list(ref["scalars"])  # gradlog/clip_coef too: DeepSpeed's (inside its step) is the replica's
    per_tensor = [t for t in tags if t.startswith(("weights/grad_norm/", "weights/update_ratio/"))]
    assert len(per_tensor) >= 10  # inp, dead, out (weight, bias): grad norms and update ratios
    assert all([s for s, _ in _series(ds, t)] == list(range(0, STEPS, EVERY)) for t in per_tensor)
    for tag in tags:
        mine, theirs = _series(ds, tag), _series(ref, tag)
        assert [s for s, _ in mine] == [s for s, _ in theirs], tag
        bad = [(s, a, b) for (s, a), (_, b) in zip(mine, theirs) if not _close(a, b)]
        assert not bad, (tag, bad)
    assert _series(ds, "weights/grad_norm/out.weight")[0][1] > 0  # not a vacuous comparison
    assert all(v == 0 for _, v in _series(ds, "weights/grad_norm/dead.weight"))


@pytest.mark.parametrize("case", CASES)
def test_zero_total_norm_is_the_engines_before_clipping(runs: Any, case: str) -> None:
    ds, ref = runs[case][0], runs["replica"][0]
    total = _series(ds, "gradlog/grad_norm_total")
    assert [s for s, _ in total] == list(range(0, STEPS, EVERY))
    for step, value in total:
        assert _close(value, ds["norms"][step]), (step, value, ds["norms"][step])  # engine.get_global_grad_norm()
        assert _close(value, ref["norms"][step]), step  # the replica's norm before clipping
    assert max(v for _, v in total) > 0.1 * 5  # far above the clip threshold: clipping took place


@pytest.mark.parametrize("case", CASES)
def test_zero_counts_one_step_per_engine_step_and_judges_as_the_replica(runs: Any, case: str) -> None:
    ref = runs["replica"][0]
    for ds in runs[case]:  # both ranks reach the same verdict
        assert ds["steps"] == ds["engine_steps"] == ref["steps"] == STEPS  # two param groups, one step
        assert ds["released"]  # close() put the ZeRO optimizer's own step back: a later step trains, uncounted
        assert ds["after_close"] == {"gradlog": STEPS, "engine": 1}
        assert ds["verdict"] == ref["verdict"]
        assert ds["verdict"].startswith("gradlog PROBLEM: 6 of 10 tensors never updated")
        reasons = {r["name"]: r["reason"] for r in ds["report"]["never_updated"]}
        assert reasons == {r["name"]: r["reason"] for r in ref["report"]["never_updated"]}
        assert reasons == {
            "frozen.weight": "frozen",
            "frozen.bias": "frozen",
            "dead.weight": "zero_grad",
            "dead.bias": "zero_grad",
            "extra.weight": "not_in_optimizer",
            "extra.bias": "not_in_optimizer",
        }
        assert untraced(ds["report"]) == untraced(ref["report"])  # the replica also names the `* 0` (traced)


@pytest.mark.parametrize("case", CASES)
def test_zero_histograms_are_the_replicas(runs: Any, case: str) -> None:
    """Gradient histograms under ZeRO are of the gradients before clipping (ZeRO clips inside its step); the
    replica's, after `gradlog.clip_grad_norm_`, of the clipped ones: the same counts, the range and sum scaled
    by the step's clip coefficient. Weight and update histograms are the replica's."""
    ds, ref = runs[case][0], runs["replica"][0]
    coef = dict(_series(ref, "gradlog/clip_coef"))
    assert ref["histograms"] and set(ds["histograms"]) == set(ref["histograms"])
    assert any(t.startswith("weights/grad/") for t in ref["histograms"])
    for tag, theirs in ref["histograms"].items():
        mine = ds["histograms"][tag]
        assert [h[0] for h in mine] == [h[0] for h in theirs], tag
        for (step, counts, lo, hi, total, n, nonfinite), other in zip(mine, theirs):
            assert (counts, n, nonfinite) == (other[1], other[5], other[6]), (tag, step)
            scale = coef[step] if tag.startswith("weights/grad/") else 1.0
            width = max(abs(lo), abs(hi), 1e-30)
            for a, b in ((lo, other[2]), (hi, other[3]), (total, other[4])):
                assert abs(a * scale - b) <= 1e-5 * width * max(1, n), (tag, step, a * scale, b)


def test_zero_stage3_really_partitioned_the_tensors(runs3: Any) -> None:
    """The two ZeRO-3 runs are the cases they claim: at DeepSpeed's default threshold every tensor of the model
    stays whole on every rank (persistent), at threshold 0 every one is shape (0,) outside forward/backward."""
    whole = runs3["replica"][0]["weights"]
    for rank in (0, 1):
        assert all(math.prod(s) == len(whole[n]) for n, s in runs3["zero3"][rank]["shapes"].items())
        assert all(s == [0] for s in runs3["zero3-threshold0"][rank]["shapes"].values())
    # sub_group_size 100: each param group stepped as several flat fp32 partitions (one per tensor here)
    assert runs3["zero3-accumulate2-threshold0-subgroup100"][0]["sub_groups"] > 2 == runs3["zero3"][0]["sub_groups"]


@pytest.mark.parametrize("stage", [2, pytest.param(3, id="stage3")])
def test_zero_bf16_measures_the_fp32_masters(request: pytest.FixtureRequest, stage: int) -> None:
    """bf16 weights under ZeRO-2 and ZeRO-3 (threshold 0): update ratios from the fp32 masters DeepSpeed steps
    (its bf16 copies would be 2% off here: 0.0477 for 0.0486), gradient norms from the averaged gradients,
    against DeepSpeed's own `safe_get_full_fp32_param` / `safe_get_full_grad`."""
    run = request.getfixturevalue("runs3" if stage == 3 else "runs12")[f"zero{stage}-bf16"][0]
    assert run["dtype"] == "torch.bfloat16"
    for name, truth in run["truth"].items():
        grads = [v for _, v in _series(run, f"weights/grad_norm/{name}")]
        ratios = [v for _, v in _series(run, f"weights/update_ratio/{name}")]
        assert len(grads) == len(ratios) == len(truth) == 4
        for (grad, ratio), g, r in zip(truth, grads, ratios):
            assert _close(g, grad, 1e-6) and _close(r, ratio, 1e-6), (name, g, grad, r, ratio)
        assert min(r for _, r in truth) > 0


def test_zero_stage3_slices_and_tables_equal_the_replica(runs3: Any) -> None:
    """tests/dist_worker.py's planted `Net` under ZeRO-3, every tensor partitioned (threshold 0; `gate`, one row
    of 16, is cut between the ranks): dead units (partly updated), units silenced from step 7 (stopped slices),
    dead_frac, zero and non-finite fractions and the tables come out of each rank's part as out of the replica's
    whole tensors. Its per-tensor norms are checked against DeepSpeed's own `safe_get_full_grad` /
    `safe_get_full_fp32_param` at every step rather than the replica: Adam turns the replica's different float
    rounding of tiny gradients into updates of a whole learning rate within 2 steps (the weights part by 3e-3)."""
    replica, ds = runs3["net-replica"][0], runs3["net-zero3"]
    assert replica["partly"] and replica["stopped"]  # not a vacuous comparison
    flags = [t for t in replica["scalars"] if t.startswith(("weights/dead_frac/", "weights/grad_zero_frac/"))]
    assert any(v > 0 for t in flags for _, v in replica["scalars"][t])
    flags += [t for t in replica["scalars"] if t.startswith("weights/grad_nonfinite/")]
    for rank in ds:
        assert rank["partly"] == replica["partly"]
        assert rank["stopped"] == replica["stopped"]
        never = {r["name"]: r["reason"] for r in rank["report"]["never_updated"]}
        # DeepSpeed hands a trained tensor never used in forward a zero gradient (its partition), not None
        unused = dict.fromkeys(("unused.weight", "unused.bias"), "zero_grad")
        assert never == {r["name"]: r["reason"] for r in replica["report"]["never_updated"]} | unused
        assert rank["report"]["stalled"] == replica["report"]["stalled"]
    run = ds[0]  # rank 0 writes
    assert all(run["scalars"][t] == replica["scalars"][t] for t in flags)
    assert len(run["truth"]) == 14  # every trained tensor but `unused`
    for name, truth in run["truth"].items():
        series = [
            [v for _, v in run["scalars"][f"weights/{k}/{name}"]] for k in ("grad_norm", "update_ratio", "weight_norm")
        ]
        assert all(len(s) == len(truth) for s in series), name
        for i, (grad, ratio, weight) in enumerate(truth):
            assert _close(series[0][i], grad, 1e-6), (name, i, series[0][i], grad)
            assert math.isnan(ratio) or _close(series[1][i], ratio, 1e-5), (name, i, series[1][i], ratio)
            assert _close(series[2][i], weight, 1e-6), (name, i, series[2][i], weight)


@pytest.mark.parametrize("stage", [2, pytest.param(3, id="stage3")])
def test_zero_step_deepspeed_skips_is_counted_skipped(request: pytest.FixtureRequest, stage: int) -> None:
    """A step whose gradients are not finite is skipped by DeepSpeed (fp16 overflow takes the same path): gradlog
    counts it as DeepSpeed does, with no update, and the next step as a normal one. Before, it was a step with an
    update ratio of 0 and `gradlog/skipped_steps` was never written."""
    run = request.getfixturevalue("runs3" if stage == 3 else "runs12")[f"zero{stage}-skip"][0]
    assert run["skipped"] == run["engine_skipped"] == 1 and run["steps"] == 4
    assert _series(run, "gradlog/skipped_steps") == [(0, 0.0), (1, 0.0), (2, 1.0), (3, 1.0)]
    ratios = [v for _, v in _series(run, "weights/update_ratio/inp.weight")]
    assert ratios[2] == 0 and min(ratios[:2] + ratios[3:]) > 0


def test_zero_stage3_collectives_per_measured_step(runs3: Any) -> None:
    """ZeRO-3 adds FSDP2's collectives of statistics, never of tensors: one MAX (step check + gradient ranges)
    and one SUM per measured step, one more MAX of the weight/update ranges on histogram steps (every 2nd); at
    close one MAX for the never-updated table and two for the per-slice tables. Once, before the first measured
    step, one MAX compares the ranks' settings."""
    run = runs3["net-zero3"][0]
    calls = [tuple(c) for c in run["collectives"]]
    assert calls[0] == ("max", -1)  # once: the ranks' settings and table size compared, before the first step
    assert {i for _, i in calls[1:]} == set(range(14))
    per_step = {s: [op for op, i in calls if i == s] for s in range(14)}
    assert per_step == {s: ["max", "max", "sum"] if s % 2 == 0 else ["max", "sum"] for s in range(14)}
    assert run["at_close"] == ["max", "max", "max"]


@pytest.fixture(scope="module")
def runs3_budget(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    return two_ranks("zero_worker.py", tmp_path_factory.mktemp("zero3b"), "zero3-budget", 900, ENV)


def test_zero_stage3_snapshot_budget_rotates_as_the_replica(runs3_budget: Any) -> None:
    """ZeRO-3, every tensor partitioned, under a snapshot_budget (600 bytes) below a third of the trained fp32
    masters' bytes: each measured step copies the same tensors on both ranks as the replica copies whole (chosen
    from the whole tensors' bytes, not a rank's part), a round of 3 measured steps covers every trained tensor,
    and every number, the update ratios at the steps they are measured included, and the report are the
    replica's. Before, each rank copied its part of every master on every measured step (rotation 1)."""
    ref = runs3_budget["replica-budget600"][0]
    ranks = runs3_budget["zero3-threshold0-budget600"]
    assert ref["rotation"] == 3
    trained = {n for step in ref["copied"] for n in step}
    assert trained == {f"{m}.{k}" for m in ("inp", "dead", "out") for k in ("weight", "bias")}
    for rank in ranks:
        assert rank["rotation"] == 3 and rank["copied"] == ref["copied"]
        assert untraced(rank["report"]) == untraced(ref["report"])
    for at in range(len(ref["copied"]) - 2):
        assert {n for step in ref["copied"][at : at + 3] for n in step} == trained
    ds = ranks[0]  # rank 0 writes
    assert sorted(ds["scalars"]) == sorted(ref["scalars"])
    for tag in ref["scalars"]:
        mine, theirs = _series(ds, tag), _series(ref, tag)
        assert [s for s, _ in mine] == [s for s, _ in theirs], tag
        assert all(_close(a, b) for (_, a), (_, b) in zip(mine, theirs)), tag
    for name in ("inp.weight", "dead.weight", "out.weight"):  # measured once a round: every 3rd measured step
        steps = [s for s, _ in _series(ds, f"weights/update_ratio/{name}")]
        assert steps and max(b - a for a, b in zip([-EVERY, *steps], [*steps, STEPS])) <= 3 * EVERY, name
