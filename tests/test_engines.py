"""Engines gradlog cannot measure exactly are refused before training, never reported on wrongly.

Two real gloo ranks (torchrun, see tests/engines_worker.py): FSDP1 reached through `.module` (with and
without `use_orig_params`), a parameter left as a shape-(0,) stand-in by an unknown partitioning engine,
and DeepSpeed ZeRO-1, -2 and -3 on its CPU accelerator (the engine, its optimizer, the inner torch
optimizer, gradlog.check, the Hugging Face Trainer with a DeepSpeed config). Before these refusals
gradlog measured rank 0's flat slices and reported them as the model's (issue 43). ZeRO-1/2 handed over
as the engine or with its optimizer are measured (tests/test_zero.py checks the numbers); the rest stays
refused. A wrapper holding flat copies of the parameters is refused in-process (no distribution needed).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from catalogue import two_ranks
from torch import nn

import gradlog

needs_dist = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")


def _launch(out: Path, suite: str, timeout: float, env: dict[str, str] | None = None) -> dict[str, list[Any]]:
    return two_ranks("engines_worker.py", out, suite, timeout, {"OMP_NUM_THREADS": "1", **(env or {})})


def assert_refused(runs: dict[str, list[Any]], case: str, *patterns: str) -> None:
    """Both ranks raised NotImplementedError with a message matching every pattern (as pytest's match=)."""
    assert len(runs[case]) == 2, case
    for payload in runs[case]:
        assert payload["type"] == "NotImplementedError", (case, payload)
        for pattern in patterns:
            assert re.search(pattern, payload["error"]), (case, pattern, payload["error"])


@pytest.fixture(scope="module")
def fsdp1_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    return _launch(tmp_path_factory.mktemp("fsdp1"), "fsdp1", timeout=180)


@pytest.mark.slow
@needs_dist
@pytest.mark.parametrize("orig", [True, False])
def test_fsdp1_module_reached_through_dot_module_is_refused(fsdp1_run: Any, orig: bool) -> None:
    # `fsdp.module` is a plain module: only the marks FSDP1 leaves on its parameters tell
    assert_refused(fsdp1_run, f"fsdp1-module-orig{orig}", r"FSDP1-managed parameters", r"fsdp\.module", "fully_shard")
    if not orig:  # with use_orig_params=True the wrapper itself is measured (tests/test_fsdp1.py)
        assert_refused(fsdp1_run, "fsdp1-wrapper-origFalse", r"FSDP1 \(FullyShardedDataParallel\)", "fully_shard")


@pytest.mark.slow
@needs_dist
def test_a_parameter_partitioned_to_shape_zero_is_refused(fsdp1_run: Any) -> None:
    assert_refused(fsdp1_run, "empty-param", r"'2\.bias' is shape \(0,\) on rank [01] of 2", "never updated")


class FlatCopies:
    """A ZeRO-like wrapper gradlog does not know: it steps an Adam over flat copies of the parameters."""

    def __init__(self, model: nn.Module) -> None:
        self.flat = nn.Parameter(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        self.optimizer = torch.optim.Adam([self.flat], lr=1e-3)


def test_an_unknown_wrapper_over_flat_copies_is_refused() -> None:
    model = nn.Linear(4, 2)
    with pytest.raises(NotImplementedError, match=r"wrapper FlatCopies: the Adam it steps holds none of the model"):
        gradlog.GradLogger(model, FlatCopies(model), writer="memory", print_report=False)
    with pytest.raises(NotImplementedError, match=r"wrapper FlatCopies"):
        gradlog.check(model, FlatCopies(model), torch.randn(3, 4), print_report=False)


def test_a_wrapper_over_the_models_own_parameters_is_still_measured() -> None:
    class Holder:
        def __init__(self, opt: torch.optim.Optimizer) -> None:
            self.optimizer = opt

    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gl = gradlog.GradLogger(model, Holder(opt), writer="memory", print_report=False, every=1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    gl.log(0)
    assert gl.close().verdict.startswith("gradlog OK")


def test_a_deepspeed_release_without_what_gradlog_reads_is_refused() -> None:
    # the ZeRO-1/2 optimizer of a DeepSpeed release that renamed its internals (gradlog knows DeepSpeed's classes
    # by module and name only): refused before anything is hooked, not failing inside training
    zero_cls = type("DeepSpeedZeroOptimizer", (), {"__module__": "deepspeed.runtime.zero.stage_1_and_2"})
    model = nn.Linear(4, 2)
    zero = zero_cls()
    zero.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NotImplementedError, match=r"DeepSpeedZeroOptimizer: the ZeRO optimizer has no bit16_groups"):
        gradlog.GradLogger(model, zero, writer="memory", print_report=False)


def test_a_zero3_optimizer_gradlog_cannot_read_is_refused() -> None:
    # ZeRO-3 of a release that renamed its internals, or with its gradients and fp32 masters offloaded where
    # gradlog does not read them: refused before anything is hooked, naming what is missing or on
    zero_cls = type("DeepSpeedZeroOptimizer_Stage3", (), {"__module__": "deepspeed.runtime.zero.stage3"})
    model = nn.Linear(4, 2)
    zero = zero_cls()
    zero.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NotImplementedError, match=r"Stage3: the ZeRO-3 optimizer has no fp16_groups, "):
        gradlog.GradLogger(model, zero, writer="memory", print_report=False)
    for name in ("fp16_groups", "sub_group_to_group_id", "fp32_partitioned_groups_flat", "averaged_gradients"):
        setattr(zero, name, [])
    zero.grad_position, zero.dp_process_group, zero.offload_optimizer = {}, None, True
    with pytest.raises(NotImplementedError, match=r"offload_optimizer is on \(its gradients and fp32 masters"):
        gradlog.GradLogger(model, zero, writer="memory", print_report=False)
    zero.offload_optimizer = False
    with pytest.raises(NotImplementedError, match=r"a parameter has no ds_id, ds_shape"):  # not ZeRO-3's
        gradlog.GradLogger(model, zero, writer="memory", print_report=False)
    assert "step" not in vars(zero)  # nothing was hooked


HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


@pytest.fixture(scope="module")
def deepspeed_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    return _launch(tmp_path_factory.mktemp("deepspeed"), "deepspeed", timeout=900, env={"DS_ACCELERATOR": "cpu"})


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.heavy
@needs_dist
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed not installed (pip install 'gradlog[deepspeed]')")
@pytest.mark.timeout(1200)
def test_deepspeed_zero_is_measured_or_refused_however_it_is_handed_over(deepspeed_run: Any, stage: int) -> None:
    runs = deepspeed_run
    # measured (tests/test_zero.py compares the numbers with a plain-PyTorch replica); ZeRO-3 was refused before
    assert [p["type"] for p in runs[f"zero{stage}-engine"] + runs[f"zero{stage}-engine-module"]] == [None] * 4
    assert_refused(runs, f"zero{stage}-check", r"gradlog\.check \(check_first=True\) on a DeepSpeed ZeRO engine")
    mark = "ds_id" if stage == 3 else "_hp_mapping"
    # the inner torch optimizer steps flat partitions: refused, naming what to pass instead
    inner = f"DeepSpeed-managed parameters .* DeepSpeed's '{mark}'"
    assert_refused(runs, f"zero{stage}-inner", inner, r"GradLogger\(engine\)")
    # the refusals touched nothing: the engine still trains
    assert [p["steps"] for p in runs[f"zero{stage}-trained"]] == [1, 1]


@pytest.mark.heavy
@needs_dist
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed not installed (pip install 'gradlog[deepspeed]')")
@pytest.mark.timeout(1200)
def test_deepspeed_pipeline_parallelism_is_refused(deepspeed_run: Any) -> None:
    assert_refused(deepspeed_run, "pipeline-engine", "DeepSpeed PipelineEngine passed as the model", "different layers")


@pytest.mark.parametrize("check_first", [False, True])
@pytest.mark.parametrize("stage", [2, pytest.param(3, id="stage3")])
@pytest.mark.heavy
@needs_dist
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed not installed (pip install 'gradlog[deepspeed]')")
@pytest.mark.timeout(1200)
def test_hf_trainer_with_a_deepspeed_config_trains_and_its_check_is_refused_before_the_first_step(
    deepspeed_run: Any, stage: int, check_first: bool
) -> None:
    """Before, the callback's grad_norm_total was 0.089 for the Trainer's 0.901, 20 steps were counted for 10,
    and check_first=True crashed the first real step ("has already been reduced"; at ZeRO-3 the check's
    restore: "size 8 vs 0")."""
    case = f"hf-zero{stage}-check{check_first}"
    if check_first:  # refused before training starts, never a crash inside it
        assert_refused(deepspeed_run, case, r"gradlog\.check \(check_first=True\) on a DeepSpeed ZeRO")
        assert [p["global_step"] for p in deepspeed_run[f"{case}-steps"]] == [0, 0]
    else:  # through the callback: measured, one step per Trainer step (GPT-2 has two param groups)
        assert [p["type"] for p in deepspeed_run[case]] == [None, None]
        steps = deepspeed_run[f"{case}-steps"]
        assert [(p["global_step"], p["gradlog_steps"]) for p in steps] == [(2, 2), (2, 2)]
        # rank 0 writes: its total gradient norm is the Trainer's grad_norm (the engine's, before clipping)
        ours, theirs = [v for _, v in steps[0]["grad_norm_total"]], steps[0]["trainer_grad_norm"]
        assert len(ours) == len(theirs) == 2
        assert all(abs(a - b) <= 1e-6 * b for a, b in zip(ours, theirs)), (ours, theirs)


@pytest.mark.parametrize("stage", [2, pytest.param(3, id="stage3")])
@pytest.mark.heavy
@needs_dist
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed not installed (pip install 'gradlog[deepspeed]')")
@pytest.mark.timeout(1200)
def test_lightning_callback_measures_what_lightnings_deepspeed_strategy_hands_it(
    deepspeed_run: Any, stage: int
) -> None:
    """Lightning's DeepSpeed strategy gives the callback the LightningModule and the ZeRO optimizer. Before, the
    callback refused them ("a DeepSpeed DeepSpeedZeroOptimizer optimizer", its fix naming `GradLogger(engine)`,
    which a callback user cannot pass); now it measures them as `GradLogger(engine.module, engine.optimizer)`:
    the total gradient norm is the engine's, before its clipping (Lightning's strategy needs CUDA: a stand-in
    Trainer carries the real module and optimizer, tests/engines_worker.py)."""
    assert [p["type"] for p in deepspeed_run[f"lightning-zero{stage}"]] == [None, None]
    run = deepspeed_run[f"lightning-zero{stage}-steps"][0]  # rank 0 writes
    ours = [v for _, v in run["grad_norm_total"]]
    assert len(ours) == len(run["norms"]) == 3 and min(ours) > 0.01  # clipped by the engine, measured before
    assert all(abs(a - b) <= 1e-6 * b for a, b in zip(ours, run["norms"])), (ours, run["norms"])
    assert run["verdict"].startswith("gradlog OK")
