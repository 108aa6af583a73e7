"""Unusual tensors, the hook lifecycle, the cost of unmeasured steps, and bad input."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
import threading
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.optimizer import _global_optimizer_pre_hooks

import gradlog
import gradlog.run.diagnosing
import gradlog.run.lifecycle
from gradlog import Reason
from gradlog.measure.params import clean_name
from gradlog.verdict.report import PARTLY_COLUMNS


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    out = model(x)
    (out.abs() if out.is_complex() else out).pow(2).mean().backward()
    opt.step()


def test_sparse_embedding_gradient() -> None:
    torch.manual_seed(0)
    emb = nn.Embedding(50, 4, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(emb, opt, writer=mem, every=1, print_report=False)
    tokens = torch.tensor([[1, 2, 2, 7]])
    emb(tokens).pow(2).sum().backward()
    dense = emb.weight.grad.to_dense()
    opt.step()
    gl.log(0)
    report = gl.close()
    assert mem.last("weights/grad_norm/weight") == pytest.approx(torch.linalg.vector_norm(dense).item(), rel=1e-6)
    # implicit zeros of the sparse gradient are zeros: 47 of 50 rows untouched
    assert mem.last("weights/grad_zero_frac/weight") == pytest.approx((dense == 0).sum().item() / dense.numel())
    assert mem.histograms["weights/grad/weight"][0][1].count == 12  # the explicit values only
    assert report.never_updated == []


def test_complex_parameters() -> None:
    torch.manual_seed(0)

    class C(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, 3, dtype=torch.complex64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.to(torch.complex64) @ self.w

    model = C()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=1, print_report=False)
    before = model.w.detach().clone()
    model(torch.randn(2, 3)).abs().pow(2).sum().backward()
    gnorm = torch.linalg.vector_norm(model.w.grad).item()
    opt.step()
    gl.log(0)
    gl.close()
    assert mem.last("weights/grad_norm/w") == pytest.approx(gnorm, rel=1e-5)
    ratio = (torch.linalg.vector_norm(model.w.detach() - before) / torch.linalg.vector_norm(before)).item()
    assert mem.last("weights/update_ratio/w") == pytest.approx(ratio, rel=1e-4)
    h = mem.histograms["weights/weight/w"][0][1]
    assert h.count == 9 and h.min >= 0  # described by magnitude


def test_lazy_parameters_are_skipped_until_materialised() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=1, print_report=False)
    for step in range(3):
        _step(model, opt, torch.randn(5, 3))
        gl.log(step)
        opt.zero_grad()
    report = gl.close()
    assert len(mem.scalars["weights/grad_norm/0.weight"]) == 3
    assert report.never_updated == []


def test_lazy_layer_never_run_is_shown_as_not_materialised(tmp_path: object) -> None:
    """A lazy layer that never ran has no shape: its row says so instead of "scalar" with 0 entries,
    and the TensorBoard table reads back the same."""
    from gradlog.readers.run import closed_report, load

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(3, 2)
            self.unused = nn.LazyLinear(2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.used(x)
            return out

    torch.manual_seed(0)
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gl = gradlog.GradLogger(model, opt, writer="tensorboard", log_dir=str(tmp_path), every=1, print_report=False)
    for step in range(2):
        _step(model, opt, torch.randn(5, 3))
        gl.log(step)
        opt.zero_grad()
    report = gl.close()
    rows = {r.name: r.row() for r in report.never_updated}
    assert rows["unused.weight"][1:3] == ["not materialised", "0"]
    assert "scalar" not in str(rows)
    back_report = closed_report(load(str(tmp_path)))
    assert back_report is not None
    back = {r.name: r.row() for r in back_report.never_updated}
    assert back["unused.weight"][1:3] == ["not materialised", "0"]


def test_meta_model_materialised_with_to_empty_is_rescanned() -> None:
    with torch.device("meta"):
        model = nn.Linear(3, 2)
    gl = gradlog.GradLogger(model, None, writer="memory", every=1, print_report=False)
    model.to_empty(device="cpu")
    nn.init.normal_(model.weight)
    nn.init.zeros_(model.bias)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 3)).sum().backward()
    gl.log(0)
    opt.step()
    report = gl.close()
    names = {r.name: r.reason for r in report.never_updated}
    assert "weight" not in names and "bias" not in names


def test_names_are_cleaned_of_wrapper_prefixes() -> None:
    assert clean_name("module._orig_mod.layers.0._checkpoint_wrapped_module.mlp.weight") == "layers.0.mlp.weight"
    assert clean_name("_fsdp_wrapped_module.head.bias") == "head.bias"
    assert clean_name("module") == "module"


def test_unmeasured_steps_do_no_tensor_work() -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gl = gradlog.GradLogger(model, opt, writer="memory", every=10, print_report=False)
    for step in range(25):
        _step(model, opt, torch.randn(2, 3))
        gl.log(step)
        opt.zero_grad()
    assert gl.optimizer_steps == 25
    assert gl.meter.tensor_work == 3  # steps 0, 10, 20 only
    gl.close()


def test_close_removes_every_hook_and_sets_nothing_on_user_objects() -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model_attrs, opt_attrs = set(vars(model)), set(vars(opt))
    n_pre, n_post = len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)
    gl = gradlog.GradLogger(model, opt, writer="memory", every=1, print_report=False)
    assert len(opt._optimizer_step_pre_hooks) == n_pre + 1
    _step(model, opt, torch.randn(2, 3))
    gl.log(0)
    gl.close()
    assert (len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)) == (n_pre, n_post)
    assert set(vars(model)) == model_attrs and set(vars(opt)) == opt_attrs
    assert gl.close() is gl.close()  # idempotent


def test_a_second_logger_on_one_optimizer_replaces_the_first() -> None:
    """Two loggers on one model and optimizer would hook every step twice: the second replaces the first
    (a notebook cell run again); the first keeps what it measured until then (tests/test_replace.py)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    m1, m2 = gradlog.MemoryWriter(), gradlog.MemoryWriter()
    g1 = gradlog.GradLogger(model, opt, writer=m1, every=1, print_report=False)
    for step in range(2):
        _step(model, opt, torch.randn(2, 3))
        g1.log(step)
        opt.zero_grad()
    with pytest.warns(RuntimeWarning, match="already open"):
        g2 = gradlog.GradLogger(model, opt, writer=m2, every=2, print_report=False)
    assert g1.closed and m1.closed
    assert [s for s, _ in m1.scalars["weights/grad_norm/weight"]] == [0, 1]
    for step in range(4):
        _step(model, opt, torch.randn(2, 3))
        g2.log(step)
        opt.zero_grad()
    assert [s for s, _ in m2.scalars["weights/grad_norm/weight"]] == [0, 2]
    assert (g1.optimizer_steps, g2.optimizer_steps) == (2, 4)
    g2.close()


def test_module_level_watch_log_close() -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mem = gradlog.MemoryWriter()
    gradlog.watch(model, opt, writer=mem, every=1, print_report=False)
    for step in range(2):
        _step(model, opt, torch.randn(2, 3))
        gradlog.log(step)
        opt.zero_grad()
    report = gradlog.close()
    assert report is not None and report.never_updated == []
    assert len(mem.scalars["weights/grad_norm/weight"]) == 2
    assert mem.closed and "gradlog/never_updated" in mem.tables
    with pytest.raises(RuntimeError, match=r"gradlog\.watch"):
        gradlog.log(3)


def test_report_table_reaches_the_writer() -> None:
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    model[0].requires_grad_(False)  # a frozen first layer, left out of the optimizer: intentional
    opt = torch.optim.SGD(model[1].parameters(), lr=0.1)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=1, print_report=False)
    _step(model, opt, torch.randn(2, 3))
    gl.log(0)
    report = gl.close()
    cols, rows = mem.tables["gradlog/never_updated"]
    assert cols == ["name", "shape", "numel", "reason", "detail", "suspect"]
    assert [r[:4] for r in rows] == [["0.weight", "2x3", "6", "frozen"], ["0.bias", "2", "2", "frozen"]]
    assert [r[5] for r in rows] == ["False", "False"]  # intentionally frozen: not a suspect freeze
    assert mem.tables["gradlog/partly_updated"] == (PARTLY_COLUMNS, []) and mem.tables["gradlog/stalled"][1] == []
    summary = dict(mem.tables["gradlog/summary"][1])
    assert summary["verdict"] == report.verdict
    assert mem.last("gradlog/never_updated/frozen") == 2


def test_bad_input_errors_name_the_value_and_the_fix() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"nn.Module, got dict"):
        gradlog.GradLogger({"w": 1}, opt)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"every must be an integer >= 1.*got 0"):
        gradlog.GradLogger(model, opt, every=0)
    with pytest.raises(ValueError, match=r"bins must be an integer in 1\.\.512, got 513"):
        gradlog.GradLogger(model, opt, histograms=gradlog.HistogramOptions(bins=513))
    hooks = set(_global_optimizer_pre_hooks)
    with pytest.raises(ValueError, match=r"unknown writer 'tensorbored'; valid names are .*'memory'"):
        gradlog.GradLogger(model, opt, writer="tensorbored")
    # a constructor that failed leaves no hook behind: its global step pre-hook ran at every optimizer step of
    # the process afterwards (and changed a later test's count of frames dynamo compiled for a compiled step)
    assert set(_global_optimizer_pre_hooks) == hooks and not opt._optimizer_step_pre_hooks
    with pytest.raises(TypeError, match="one GradLogger per optimizer"):
        gradlog.GradLogger(model, [opt])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"HistogramOptions\(every=7\) must be a positive multiple of every=5"):
        gradlog.GradLogger(model, opt, every=5, histograms=gradlog.HistogramOptions(every=7))
    gl = gradlog.GradLogger(model, opt, writer="memory", print_report=False)
    gl.close()
    with pytest.raises(RuntimeError, match=r"log\(\) called after close\(\)"):
        gl.log(1)


def test_optimizer_with_a_foreign_parameter_warns_and_tracks_it() -> None:
    model = nn.Linear(2, 2)
    stray = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([*model.parameters(), stray], lr=0.1)
    with pytest.warns(UserWarning, match=r"optimizer holds a parameter the model does not have \(shape \(3,\)"):
        gl = gradlog.GradLogger(model, opt, writer="memory", every=1, print_report=False)
    _step(model, opt, torch.randn(2, 2))
    gl.log(0)
    report = gl.close()
    assert {r.name: r.reason for r in report.never_updated} == {
        "optimizer.param_groups.0.params.2": Reason.NOT_IN_MODEL
    }


class Exploding(gradlog.Writer):
    def __init__(self) -> None:
        self.calls = 0

    def log_scalars(self, scalars, step):  # type: ignore[no-untyped-def]
        self.calls += 1
        raise OSError("No space left on device")

    def log_histogram(self, tag, hist, step):  # type: ignore[no-untyped-def]
        raise OSError("No space left on device")

    def log_table(self, name, columns, rows):  # type: ignore[no-untyped-def]
        raise OSError("No space left on device")


def test_a_failing_writer_warns_once_and_training_continues() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    bad, mem = Exploding(), gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=[bad, mem], every=1, print_report=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            _step(model, opt, torch.randn(2, 2))
            gl.log(step)
            opt.zero_grad()
        report = gl.close()
    scalar_warnings = [w for w in caught if "Exploding.log_scalars failed" in str(w.message)]
    assert len(scalar_warnings) == 1 and "No space left" in str(scalar_warnings[0].message)
    assert bad.calls == 4  # three steps and the final counts: it kept being called
    assert len(mem.scalars["weights/grad_norm/weight"]) == 3  # the healthy writer got everything
    assert report.never_updated == []


def test_strict_mode_raises_writer_errors() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gl = gradlog.GradLogger(
        model, opt, every=1, print_report=False, writer=gradlog.Output(writer=Exploding(), strict=True)
    )
    _step(model, opt, torch.randn(2, 2))
    with pytest.raises(OSError, match="No space left"):
        gl.log(0)


def test_a_failing_diagnosis_warns_and_close_still_cleans_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug inside the diagnosis must not turn the end of a training run into a traceback."""
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=1, print_report=False)
    _step(model, opt, torch.randn(2, 2))
    gl.log(0)

    def broken(*args: object, **kwargs: object) -> None:
        raise KeyError("planted")

    monkeypatch.setattr(gradlog.run.diagnosing, "diagnose", broken)
    with pytest.warns(RuntimeWarning, match="diagnosis failed at close.*KeyError"):
        report = gl.close()
    assert report.error is not None and "planted" in report.error
    assert not report.healthy and "diagnosis failed" in report.verdict
    assert (report.optimizer_steps, report.measured_steps, report.tracked_tensors) == (1, 1, 2)
    assert mem.closed and not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert "diagnosis failed" in mem.tables["gradlog/summary"][1][0][1]
    assert gl.close() is report  # idempotent


def test_a_failing_diagnosis_raises_in_strict_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Linear(2, 2)
    gl = gradlog.GradLogger(
        model, torch.optim.SGD(model.parameters(), lr=0.1), writer=gradlog.Output(writer="memory", strict=True)
    )

    def broken(*args: object, **kwargs: object) -> None:
        raise KeyError("planted")

    monkeypatch.setattr(gradlog.run.diagnosing, "diagnose", broken)
    with pytest.raises(KeyError, match="planted"):
        gl.close()


def test_report_printed_at_interpreter_exit_when_close_is_forgotten(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = textwrap.dedent(
        """
        import torch, gradlog
        from torch import nn
        model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
        model[0].requires_grad_(False)
        opt = torch.optim.SGD(model[1].parameters(), lr=0.1)
        gl = gradlog.GradLogger(model, opt, writer="memory", every=1)
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        gl.log(0)
        print("training done")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.index("training done") < out.stdout.index("0.*")  # the frozen layer, one line
    assert "frozen" in out.stdout and "gradlog OK" in out.stdout


def test_a_failure_inside_measurement_never_reaches_the_training_loop() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gl = gradlog.GradLogger(model, opt, writer="memory", every=1, print_report=False)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access")

    gl.meter.start = broken  # type: ignore[method-assign]
    with pytest.warns(RuntimeWarning, match="measuring step 0 failed.*illegal memory access.*training continues"):
        _step(model, opt, torch.randn(2, 2))
    _step(model, opt, torch.randn(2, 2))  # warned once only, and the optimizer still stepped
    assert gl.optimizer_steps == 2
    gl.close()


def test_frozen_tensors_are_never_copied_for_the_update_snapshot() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 2))
    model[0].requires_grad_(False)  # a frozen backbone, even if the optimizer holds it
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=1, print_report=False)
    seen: list[list[tuple[int, ...]]] = []

    def spy(*args: object) -> None:  # runs after gradlog's pre-hook, while its snapshot is held
        assert gl.meter._open is not None and gl.meter._open.snapshot is not None
        seen.append([tuple(t.shape) for t in gl.meter._open.snapshot])

    handle = opt.register_step_pre_hook(spy)
    _step(model, opt, torch.randn(4, 64))
    gl.log(0)
    handle.remove()
    gl.close()
    assert seen == [[(2, 64), (2,)]]
    # frozen: not read at all on a measured step (no update ratio, no weight norm)
    assert "weights/update_ratio/0.weight" not in mem.scalars and "weights/weight_norm/0.weight" not in mem.scalars
    assert mem.last("weights/update_ratio/1.weight") > 0


def test_tensors_added_replaced_or_swapped_between_measured_steps_are_measured() -> None:
    """The rescan before each measured step compares identities only (no names built), and an unchanged
    model is not rebuilt; a layer added with its own param group, a weight replaced by assignment and a
    bias swapped straight into `_parameters` are each measured at the next step, against norms by hand."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=1, histograms=False, print_report=False)
    x = torch.randn(5, 4)

    def step(i: int) -> None:
        model(x).pow(2).mean().backward()
        grads = {n: torch.linalg.vector_norm(p.grad).item() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        gl.log(i)
        opt.zero_grad()
        for name, want in grads.items():
            assert mem.last(f"weights/grad_norm/{name}") == pytest.approx(want, rel=1e-6), (i, name)

    step(0)
    generation = gl.table.generation
    step(1)
    assert gl.table.generation == generation  # nothing changed: no rebuild
    model.append(nn.Linear(3, 2))
    opt.add_param_group({"params": list(model[2].parameters())})
    step(2)
    model[0].weight = nn.Parameter(torch.randn(4, 4))  # replaced; not in the optimizer (no update, a gradient)
    step(3)
    model[1]._parameters["bias"] = nn.Parameter(torch.zeros(3))  # swapped in without __setattr__
    step(4)
    assert gl.table.generation == generation + 3
    for name in ("2.weight", "2.bias", "0.weight", "1.bias"):
        assert len(mem.scalars[f"weights/grad_norm/{name}"]) >= 1, name
    assert gl.table.get(model[0].weight) is not None and gl.table.get(model[1].bias) is not None
    gl.close()


def test_log_step_must_be_a_whole_number_and_whole_numbers_of_any_kind_land_at_that_x() -> None:
    import numpy as np

    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=1, histograms=False, print_report=False)

    def step_and_log(step: object) -> None:
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
        gl.log(step)  # type: ignore[arg-type]

    for bad, shown in [(2.5, "2.5"), ("8", "'8'"), (float("nan"), "nan"), (True, "True"), (torch.tensor([1, 2]), "")]:
        with pytest.raises(ValueError, match=r"log\(step=" + shown.replace("(", r"\(") + r".*must be a whole number"):
            step_and_log(bad)
    good = [torch.tensor(40), np.int32(41), 42.0, -3, torch.tensor(44.0)]
    for s in good:
        step_and_log(s)
    gl.close()
    xs = [x for x, _ in mem.scalars["gradlog/grad_norm_total"]]
    assert xs[-len(good) :] == [40, 41, 42, -3, 44] and all(type(x) is int for x in xs)


@pytest.mark.parametrize(("flag", "inline"), [({}, False), ({"inline": True}, True)])
def test_writers_asking_to_be_called_inline_are_called_on_the_training_thread(
    flag: dict[str, bool], inline: bool
) -> None:
    """`Writer.inline = True` is called on the training thread; any other writer from its own background
    thread."""
    threads: set[str] = set()

    class Where(gradlog.MemoryWriter):
        def log_scalars(self, scalars: Any, step: int) -> None:
            threads.add(threading.current_thread().name)
            super().log_scalars(scalars, step)

    Where.inline = False
    for key, value in flag.items():
        setattr(Where, key, value)
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gl = gradlog.GradLogger(model, opt, writer=Where(), every=1, print_report=False)
    _step(model, opt, torch.randn(2, 2))
    gl.log(0)
    gl.close()
    assert (threads == {threading.main_thread().name}) is inline, threads


def test_the_constructor_takes_thirteen_parameters_and_names_a_misspelt_one() -> None:
    params = list(inspect.signature(gradlog.GradLogger).parameters)
    assert params == [
        "model",
        "optimizer",
        "writer",
        "every",
        "log_dir",
        "include",
        "exclude",
        "histograms",
        "alerts",
        "scaler",
        "print_report",
        "policy",
        "snapshot_budget",
    ]
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        gradlog.GradLogger(model, opt, writer="memory", bogus=1)
    with pytest.raises(ValueError, match=r"histograms must be True, False or a gradlog\.HistogramOptions"):
        gradlog.GradLogger(model, opt, writer="memory", histograms="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Output: timeout must be a number of seconds > 0, got 0"):
        gradlog.Output("memory", timeout=0)


# --- issue 41: mistakes a first hour makes, each named at once --------------------------------------------
def test_log_dir_that_is_a_file_is_refused(tmp_path):
    """A file as log_dir was accepted with a warning; close() then named it as the run's folder."""
    afile = tmp_path / "afile.txt"
    afile.write_text("notes")
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"log_dir=.*afile\.txt' is a file, not a folder"):
        gradlog.GradLogger(model, torch.optim.SGD(model.parameters(), lr=0.1), log_dir=str(afile))
    assert afile.read_text() == "notes"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda m: gradlog.GradLogger(m, None, writer="memory", histogram=False), "did you mean `histograms=`"),
        (lambda m: gradlog.watch(m, None, writer="memory", evrey=5), "did you mean `every=`"),
        (lambda m: gradlog.HistogramOptions(bin=32), "HistogramOptions.*did you mean `bins=`"),
        (lambda m: gradlog.AlertOptions(spike_factr=5.0), "AlertOptions.*did you mean `spike_factor=`"),
        (lambda m: gradlog.Output("memory", timout=3), "Output.*did you mean `timeout=`"),
        (lambda m: gradlog.GradLogger(m, None, writer="memory", zzz=1), "'zzz': it takes model=, optimizer="),
    ],
)
def test_misspelt_keyword_names_the_right_one(make, message):
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=message):
        make(model)
    assert not gradlog.run.lifecycle.ACTIVE


def test_never_calling_log_is_said_once_at_close():
    """Measured steps, no gl.log: the writers got no series. close() says so, once; a loop that logs hears nothing."""
    for logs in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mem = gradlog.MemoryWriter()
        gl = gradlog.GradLogger(model, opt, writer=mem, every=2, print_report=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(6):
                model(torch.randn(3, 4)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                if logs:
                    gl.log(step)
            gl.close()
        said = [w for w in caught if "never called" in str(w.message)]
        assert len(said) == (0 if logs else 1)
        assert ("weights/grad_norm/weight" in mem.scalars) == logs  # the per-step series; counts come at close
        if not logs:
            assert "3 measured steps, but" in str(said[0].message) and "gl.log(step)" in str(said[0].message)
