"""Two real ranks (torchrun, gloo, CPU): rank 0's numbers must equal one process on the same global batch.

One torchrun launch per suite (see tests/dist_worker.py) covers DDP, FSDP2 and tensor parallel; the
reference runs in this process with the same model, initialisation and data.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import dist_worker as W
import pytest
import torch
from catalogue import two_ranks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed"),
]


def same_report(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Reports equal, alert values up to float rounding (reduced sums differ in the last bits across ranks)."""

    def plain(r: dict[str, Any]) -> dict[str, Any]:
        alerts = [{k: v for k, v in al.items() if k not in ("value", "reference")} for al in r.get("alerts", [])]
        return {**r, "alerts": alerts}

    values = [(x.get("value"), y.get("value")) for x, y in zip(a.get("alerts", []), b.get("alerts", []))]
    close = all(x == y or (x is not None and y is not None and abs(x - y) <= 1e-6 * abs(y)) for x, y in values)
    return plain(a) == plain(b) and close


def _launch(out: Path, suite: str) -> dict[str, list[dict[str, Any]]]:
    return two_ranks("dist_worker.py", out, suite)


@pytest.fixture(scope="module")
def main_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[dict[str, Any]]]]:
    out = tmp_path_factory.mktemp("dist")
    return out, _launch(out, "main")


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    torch.manual_seed(0)
    mem, report, n = W.train(W.Net())
    return W.dump(mem, report, n)


@pytest.fixture(scope="module")
def reference_accumulated() -> dict[str, Any]:
    torch.manual_seed(0)
    mem, report, n = W.train(W.Net(), accumulate=2)
    return W.dump(mem, report, n)


def _close(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= 1e-5 * max(abs(a), abs(b)) + 1e-7


def assert_same_metrics(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert sorted(got["scalars"]) == sorted(want["scalars"])
    bad = []
    for tag, series in want["scalars"].items():
        mine = got["scalars"][tag]
        assert [s for s, _ in mine] == [s for s, _ in series], tag
        bad += [(tag, s, a, b) for (s, a), (_, b) in zip(mine, series) if not _close(a, b)]
    assert not bad, bad[:10]
    assert sorted(got["histograms"]) == sorted(want["histograms"])
    for tag, series in want["histograms"].items():
        mine = got["histograms"][tag]
        assert len(mine) == len(series), tag
        for (s1, c1, lo1, hi1, sm1, sq1, n1, nf1), (s2, c2, lo2, hi2, sm2, sq2, n2, nf2) in zip(mine, series):
            assert (s1, n1, nf1) == (s2, n2, nf2), tag
            assert all(_close(a, b) for a, b in [(lo1, lo2), (hi1, hi2), (sq1, sq2)]), (tag, s1)
            assert abs(sm1 - sm2) <= 1e-5 * math.sqrt(sq2 * n2) + 1e-7, (tag, s1)
            # the same values up to float rounding: a value on a bucket edge may move one bucket over
            assert sum(abs(a - b) for a, b in zip(c1, c2)) <= 2, (tag, s1, c1, c2)


def _reasons(payload: dict[str, Any]) -> dict[str, str]:
    return {r["name"]: r["reason"] for r in payload["report"]["never_updated"]}


def _stalled(payload: dict[str, Any]) -> set[tuple[str, int, int, str]]:
    return {(r["name"], r["since_step"], r["last_update_step"], r["reason"]) for r in payload["report"]["stalled"]}


#: the group whose lr `dist_worker.stop` cuts to 0 after step 0
HEAD_STALLED = {("head.weight", 1, 0, "zero_lr"), ("head.bias", 1, 0, "zero_lr")}


def test_ddp_with_no_sync_accumulation_equals_one_process(main_run: Any, reference_accumulated: Any) -> None:
    _, runs = main_run
    rank0, rank1 = runs["ddp"]
    assert all(n.startswith("module.") for n in rank0["raw_names"])  # DDP's prefix, cleaned by gradlog
    assert_same_metrics(rank0, reference_accumulated)
    assert rank0["scalars"]["weights/grad_norm/gate"][0][1] > 0  # not a vacuous comparison
    assert same_report(rank0["report"], reference_accumulated["report"])
    assert same_report(rank1["report"], reference_accumulated["report"])
    assert _reasons(rank0) == {
        "frozen.weight": "frozen",
        "frozen.bias": "frozen",
        "still.weight": "zero_lr",
        "unused.weight": "no_grad",
        "unused.bias": "no_grad",
    }
    assert _stalled(rank0) == _stalled(rank1) == _stalled(reference_accumulated) == HEAD_STALLED


def test_fsdp2_global_numbers_equal_one_process(main_run: Any, reference: Any) -> None:
    _, runs = main_run
    rank0, rank1 = runs["fsdp2"]
    # really sharded, with an empty shard on rank 1, and wrapped in activation checkpointing
    assert rank0["local_rows"]["gate"] == 1 and rank1["local_rows"]["gate"] == 0
    assert rank0["local_rows"]["inp.weight"] == 8 and rank1["local_rows"]["inp.weight"] == 8
    assert any("_checkpoint_wrapped_module" in n for n in rank0["raw_names"])
    assert_same_metrics(rank0, reference)
    assert same_report(rank0["report"], reference["report"])
    assert same_report(rank1["report"], reference["report"])  # every rank's report is the global one
    assert _stalled(rank0) == _stalled(reference) == HEAD_STALLED  # head is sharded (dim 0) across the ranks


def test_fsdp2_collectives_per_measured_step(main_run: Any) -> None:
    """Per measured step one MAX (step check + gradient ranges) and one SUM; histogram steps (every 2nd
    here) add one MAX for the weight/update ranges. Settings are checked once (index -1) before the
    first step; at close the changed flags take one more MAX, the per-slice flags one more, and the
    per-slice last steps (stopped slices) one more."""
    _, runs = main_run
    calls = [tuple(c) for c in runs["fsdp2"][0]["collectives"]]
    want = [("max", -1)]
    for step in range(W.STEPS):
        want += [("max", step), ("max", step), ("sum", step)] if step % 2 == 0 else [("max", step), ("sum", step)]
    want += [("max", -1), ("max", -1), ("max", -1)]
    assert calls == want


def test_tensor_parallel_dtensors_count_replicas_once(main_run: Any) -> None:
    _, runs = main_run
    rank0, _ = runs["tp"]
    assert "Replicate" in rank0["placements"]["down.bias"] and "Shard" in rank0["placements"]["up.weight"]
    torch.manual_seed(0)
    want, _ = W.train_tp(W.TPNet())
    assert_same_metrics(rank0, want)
    assert same_report(rank0["report"], want["report"])
    assert _reasons(rank0) == {"unused.weight": "no_grad", "unused.bias": "no_grad"}
    # down.weight is Shard(1), down.bias Replicate: both stalled once, as in one process
    assert _stalled(rank0) == _stalled(want) == {("down.weight", 1, 0, "zero_lr"), ("down.bias", 1, 0, "zero_lr")}


def test_only_rank_zero_writes(main_run: Any) -> None:
    out, runs = main_run
    for name in ("ddp", "fsdp2", "tp"):
        assert runs[name][0]["writers"] >= 1 and runs[name][1]["writers"] == 0, name
    assert (out / "events-rank0.jsonl").exists()
    assert not (out / "events-rank1.jsonl").exists()
    lines = [json.loads(x) for x in (out / "events-rank0.jsonl").read_text().splitlines()]
    assert sum("scalars" in x for x in lines) == W.STEPS + 1  # one batch per step, one at close


def test_fsdp1_is_refused_clearly(main_run: Any) -> None:
    _, runs = main_run
    for payload in runs["fsdp1"]:
        assert payload["error"] is not None and "fully_shard" in payload["error"]
        assert "use_orig_params=True" in payload["error"]


def test_close_after_destroy_process_group_warns_that_the_report_is_local(main_run: Any) -> None:
    _, runs = main_run
    for payload in runs["late_close"]:
        assert any("before torch.distributed.destroy_process_group()" in w for w in payload["warnings"])


def test_disagreeing_ranks_get_an_error_not_a_hang(tmp_path: Path) -> None:
    runs = _launch(tmp_path, "mismatch")
    r0, r1 = (p["results"] for p in runs["mismatch"])
    for r in (r0, r1):
        assert r["layout"] is not None and "every 1..2 across ranks" in r["layout"] and "same settings" in r["layout"]
        assert r["budget"] is not None and "snapshot_budget (bytes; auto -1, None 0) 1000..1001" in r["budget"]
        assert r["index"] is not None and "step index 0 to 1" in r["index"]
    assert r0["timeout"] is not None and "never joined" in r0["timeout"]
    assert r1["timeout"] is None
    for r in (r0, r1):  # a skipped log() without an optimizer: both ranks, at the first call after the skip
        assert r["skipped_log"] is not None and "log() calls for different steps (0 to 1" in r["skipped_log"]


def _partly(payload: dict[str, Any]) -> set[tuple[str, Any, tuple[int, ...], str]]:
    return {(name, dim, tuple(idx), reason) for name, dim, idx, reason, _ in payload["partly"]}


def test_partly_updated_is_global_and_equals_one_process(
    main_run: Any, reference: Any, reference_accumulated: Any
) -> None:
    """Dead units split over both ranks' shards: rank 0 reports them at their global indices under FSDP2
    (Shard(0)), DDP, and tensor parallel (Shard(0) rows, Shard(1) columns, a sharded 1-D bias)."""
    _, runs = main_run
    dead = tuple(W.DEAD)
    assert _partly(reference) == {("inp.weight", 0, dead, "zero_grad"), ("inp.bias", None, dead, "zero_grad")}
    for name, want in (("fsdp2", reference), ("ddp", reference_accumulated)):
        for payload in runs[name]:
            assert payload["partly"] == want["partly"], name
    torch.manual_seed(0)
    tp_want, _ = W.train_tp(W.TPNet())
    assert _partly(tp_want) == {
        ("up.weight", 0, dead, "zero_grad"),
        ("up.bias", None, dead, "zero_grad"),
        ("down.weight", 1, dead, "zero_grad"),
    }
    for payload in runs["tp"]:
        assert payload["partly"] == tp_want["partly"]


def test_stopped_slices_are_global_and_equal_one_process(
    main_run: Any, reference: Any, reference_accumulated: Any
) -> None:
    """Units zeroed from step 1 on, one in each rank's shard of `inp` (rows 0-7 and 8-15 under FSDP2):
    rank 0 reports them at their global indices, stopped from step STOP_AT, as one process does."""
    _, runs = main_run
    planted = {(n, d, tuple(W.STOPPED), W.STOP_AT) for n, d in (("inp.weight", 0), ("inp.bias", None))}
    assert planted <= {(n, d, tuple(i), s) for n, d, i, s, _ in reference["stopped"]}
    for name, want in (("fsdp2", reference), ("ddp", reference_accumulated)):
        for payload in runs[name]:
            assert payload["stopped"] == want["stopped"], name


def test_dead_frac_of_sharded_tensors_is_global(main_run: Any, reference: Any) -> None:
    _, runs = main_run
    got = runs["fsdp2"][0]["scalars"]["weights/dead_frac/inp.weight"]
    assert [tuple(x) for x in got] == reference["scalars"]["weights/dead_frac/inp.weight"]
    # rank 0 holds only 1 of the 3 dead rows (and 1 of the 2 stopped from step STOP_AT on)
    dead = [len(W.DEAD) + (len(W.STOPPED) if step >= W.STOP_AT else 0) for step in range(0, W.STEPS, 2)]
    assert [v for _, v in got] == [n / 16 for n in dead]


def test_a_resumed_fsdp2_run_continues_on_every_rank(tmp_path: Path) -> None:
    """Preempted after 30 steps, resumed from a torch.distributed.checkpoint in a new launch: every rank
    counts on from step 30 (gradlog's collectives compare the measured step) and judges both segments."""
    _launch(tmp_path, "resume_first")
    runs = _launch(tmp_path, "resume_second")
    assert len(runs["resume_second"]) == 2
    for payload in runs["resume_second"]:  # the same answer on every rank
        report = payload["report"]
        assert payload["optimizer_steps"] == 60 and report["optimizer_steps"] == 60 and report["measured_steps"] == 12
        assert {r["name"] for r in report["never_updated"]} == {"frozen.weight", "frozen.bias"}
        stalled = {r["name"]: r for r in report["stalled"]}
        assert set(stalled) == {"slow.weight", "slow.bias"}
        assert all(r["since_step"] == 30 and r["reason"] == "zero_lr" for r in stalled.values())
    r0, r1 = (p["report"] for p in runs["resume_second"])
    assert r0["verdict"] == r1["verdict"]

    from gradlog.readers.run import closed_report, load

    run = load(str(tmp_path / "run"))  # rank 0 wrote both segments as one run
    assert len(run.files) == 2
    written = closed_report(run)
    assert written is not None and written.verdict == r0["verdict"]
    assert [s for s, _ in run.scalars["weights/grad_norm/main.weight"]] == list(range(0, 60, 5))
    assert [s for s, _ in run.scalars["weights/grad_norm/late.weight"]] == list(range(30, 60, 5))


@pytest.fixture(scope="module")
def reference_budget() -> dict[str, Any]:
    torch.manual_seed(0)
    copied: list[list[str]] = []
    mem, report, n = W.train(W.Net(), budget=W.BUDGET, copied=copied)
    return {**W.dump(mem, report, n), "copied": copied}


def test_fsdp2_snapshot_budget_rotates_the_same_rows_on_every_rank(main_run: Any, reference_budget: Any) -> None:
    """A snapshot_budget far below the weights' bytes under FSDP2 (`assert_budget_rotates`), with no collective of
    its own: the step's usual MAX and SUM."""
    _, runs = main_run
    rank0, rank1 = runs["fsdp2-budget"]
    assert_budget_rotates(rank0, rank1, reference_budget)
    assert [tuple(c) for c in rank0["collectives"]] == [tuple(c) for c in runs["fsdp2"][0]["collectives"]]


def test_fsdp2_snapshot_budget_copies_no_tensor_without_a_gradient(main_run: Any, reference_budget: Any) -> None:
    """`Net.unused` (never in forward: no gradient on any rank) and `Net.frozen` are never copied under FSDP2: the
    ranks learn which tensors have a gradient somewhere in the pre-hook's one all_reduce(MAX), so they copy what
    the one process copies, byte for byte on every step, and every scalar series (update ratios included, at the
    same steps) and the report are the one process's. Before, each rank copied `unused` on its turn (it could not
    tell that no other rank had its gradient): its 272 bytes on every fifth measured step (the 5th and 10th
    copied 272 bytes in the one process, 544 on the ranks)."""
    _, runs = main_run
    size = {n: p.numel() * p.element_size() for n, p in W.Net().named_parameters()}
    never = {"unused.weight", "unused.bias", "frozen.weight", "frozen.bias"}
    want = [sum(size[n] for n in step) for step in reference_budget["copied"]]
    assert not never & {n for step in reference_budget["copied"] for n in step}
    for rank in runs["fsdp2-budget"]:
        assert not never & {n for step in rank["copied"] for n in step}
        assert [sum(size[n] for n in step) for step in rank["copied"]] == want
        assert rank["copied"] == reference_budget["copied"] and rank["rotation"] == reference_budget["rotation"]
    rank0 = runs["fsdp2-budget"][0]
    assert sorted(rank0["scalars"]) == sorted(reference_budget["scalars"])
    for tag, series in reference_budget["scalars"].items():
        assert [s for s, _ in rank0["scalars"][tag]] == [s for s, _ in series], tag
        assert all(_close(a, b) for (_, a), (_, b) in zip(rank0["scalars"][tag], series)), tag
    assert same_report(rank0["report"], reference_budget["report"])


def assert_budget_rotates(
    rank0: dict[str, Any], rank1: dict[str, Any], reference: dict[str, Any], apart: tuple[str, ...] = ()
) -> None:
    """`dist_worker.train(budget=BUDGET)` on two ranks: both ranks copy the same tensors on every step (chosen from
    the whole tensors' sizes), a round covers every tensor the optimizer moves, and each update ratio equals the
    one process's (`reference`) at the steps both measured it (where the engine gives a tensor the one process
    leaves without a gradient a zero one, FSDP1's unused tensor, the ranks copy it on its turn). The tensors not
    copied keep their exact "moved"
    evidence: every other number is the one process's, and (without `apart`) the report. `apart`: tags left out,
    where the engine itself differs from the one process (FSDP1 gives an unused tensor a zero gradient)."""
    assert rank0["copied"] == rank1["copied"]
    rotation = rank0["rotation"]
    assert rotation > 1 and rank1["rotation"] == rotation
    moving = {n for step in rank0["copied"] for n in step}
    assert "head.weight" in moving and "frozen.weight" not in moving
    for at in range(W.STEPS - rotation + 1):  # every tensor copied within any `rotation` consecutive steps
        assert {n for step in rank0["copied"][at : at + rotation] for n in step} == moving, at
    assert all(0 < len(step) < len(moving) for step in rank0["copied"])
    # the budget holds the whole tensors' bytes (the ranks' pieces together), a larger tensor alone
    size = {n: p.numel() * p.element_size() for n, p in W.Net().named_parameters()}
    assert all(sum(size[n] for n in step) <= W.BUDGET or len(step) == 1 for step in rank0["copied"])
    assert max(sum(size[n] for n in step) for step in rank0["copied"]) > W.BUDGET / 2  # not a vacuous bound
    tags = sorted(t for t in rank0["scalars"] if not t.endswith(apart))
    assert tags == sorted(t for t in reference["scalars"] if not t.endswith(apart))
    compared = 0
    for tag in tags:
        series, want = rank0["scalars"][tag], reference["scalars"][tag]
        if tag.startswith("weights/update_ratio/"):
            mine, theirs = dict(series), dict(want)
            assert max(b - a for a, b in zip([-1, *mine], [*mine, W.STEPS])) <= rotation, tag
            both = set(mine) & set(theirs)
            assert all(_close(mine[s], theirs[s]) for s in both), tag
            compared += len(both)
        elif not tag.startswith("gradlog/update"):
            assert [s for s, _ in series] == [s for s, _ in want], tag
            assert all(_close(a, b) for (_, a), (_, b) in zip(series, want)), tag
    assert compared >= W.STEPS
    if not apart:
        assert same_report(rank0["report"], reference["report"])
        assert same_report(rank1["report"], reference["report"])
