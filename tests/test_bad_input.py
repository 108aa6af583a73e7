"""Wrong values a user plausibly passes are refused where they are passed, with a message that names the value
and the fix (not "'int' object is not iterable" from deep inside, not a silent run that does nothing).

tests/test_edge_cases.py covers the first-hour mistakes found earlier (issue 41); these are the ones a sweep of
the public API (`gradlog.__all__`, `gradlog report`, `gradlog diff`) found still unnamed on 2026-12-07.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradlog
from gradlog.cli.entry import main


@pytest.mark.parametrize(
    ("writer", "error", "match"),
    [
        (5, TypeError, r"writer=5: must be a writer name \('memory', 'tensorboard', 'wandb'\), a gradlog\.Writer"),
        (None, TypeError, r"writer=None: must be a writer name"),
        ({"wandb": {}}, TypeError, r"writer=\{'wandb': \{\}\}: must be a writer name"),
        (
            gradlog.MemoryWriter,
            TypeError,
            r"writer=MemoryWriter: pass an instance, MemoryWriter\(\.\.\.\), not the class",
        ),
        ("tb", ValueError, r"unknown writer 'tb'; valid names are 'memory', 'tensorboard', 'wandb'"),
        (["memory", "wanb"], ValueError, r"unknown writer 'wanb'; .* \(did you mean 'wandb'\?\)"),
    ],
)
def test_a_bad_writer_is_named_where_it_is_passed(writer: Any, error: type[Exception], match: str) -> None:
    """`writer=5` or `None` raised "'int' object is not iterable"; `Output("tb")` was accepted and failed only when
    a GradLogger was built from it; a writer class (not an instance) was "not iterable" too."""
    with pytest.raises(error, match=match):
        gradlog.Output(writer)
    model = nn.Linear(2, 2)
    with pytest.raises(error, match=match):
        gradlog.GradLogger(model, torch.optim.SGD(model.parameters(), lr=0.1), writer=writer, print_report=False)


def test_a_log_dir_that_is_not_a_path_is_named() -> None:
    """`log_dir=5` raised os.fspath's "expected str, bytes or os.PathLike object, not int"."""
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"log_dir=5: must be a folder path \(a str or pathlib\.Path\)"):
        gradlog.GradLogger(model, writer="tensorboard", log_dir=5, print_report=False)  # type: ignore[arg-type]


@pytest.mark.parametrize("with_optimizer", [False, True])
def test_a_model_without_parameters_is_refused(with_optimizer: bool) -> None:
    """`GradLogger(nn.ReLU())` (a parameter-free part passed for the model) was accepted in silence and closed
    with "nothing measured, so no answer on the 0 tracked tensors"; with the real model's optimizer beside it,
    every tensor was reported never updated (not_in_model)."""
    real = nn.Linear(3, 2)
    opt = torch.optim.SGD(real.parameters(), lr=0.1) if with_optimizer else None
    with pytest.raises(ValueError, match=r"model ReLU has no parameters, so gradlog has nothing to watch; pass the"):
        gradlog.GradLogger(nn.ReLU(), opt, writer="memory", print_report=False)
    if opt is not None:
        with pytest.raises(ValueError, match=r"model ReLU has no parameters"):
            gradlog.check(nn.ReLU(), opt, torch.randn(4, 3), print_report=False)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((5,), {}, r"a policy is a mapping \{'KIND\[:PATTERN\]': severity\} or \(spec, severity\) pairs, got 5"),
        ((), {"ignore": 5}, r"Policy\(ignore=\.\.\.\) takes 'KIND\[:PATTERN\]' specs \(a string or a list\), got 5"),
    ],
)
def test_a_policy_that_is_not_rules_is_named(args: tuple[Any, ...], kwargs: dict[str, Any], match: str) -> None:
    """`Policy(5)`, `GradLogger(policy=5)` and `Policy(ignore=5)` raised "'int' object is not iterable"."""
    with pytest.raises(ValueError, match=match):
        gradlog.Policy(*args, **kwargs)
    if args:
        model = nn.Linear(2, 2)
        with pytest.raises(ValueError, match=match):
            gradlog.GradLogger(model, writer="memory", policy=args[0], print_report=False)


@pytest.mark.parametrize("max_norm", [-1.0, math.nan, "1.0"])
def test_clip_grad_norm_refuses_a_max_norm_that_corrupts_the_gradients(max_norm: Any) -> None:
    """torch's clip_grad_norm_ takes max_norm=-1 and multiplies every gradient by a negative factor (the update
    goes uphill; measured: grads of 10 became -0.577), and NaN makes every gradient NaN. gradlog's drop-in
    refuses both before touching a gradient."""
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 10.0)
    with pytest.raises(ValueError, match=r"clip_grad_norm_\(max_norm=.*\): must be a number >= 0"):
        gradlog.clip_grad_norm_([p], max_norm)
    assert torch.equal(p.grad, torch.full((3,), 10.0))
    total = gradlog.clip_grad_norm_([p], 1.0)  # the ordinary call is unchanged: torch's own result
    assert total.item() == pytest.approx(math.sqrt(300.0)) and p.grad.norm().item() == pytest.approx(1.0, rel=1e-5)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gl = gradlog.GradLogger(model, opt, writer="tensorboard", log_dir=str(tmp_path / "run"), print_report=False)
    for step in range(3):
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
        gl.log(step)
    gl.close()
    return tmp_path / "run"


@pytest.mark.parametrize(
    ("where", "match"),
    [
        ("folder", r"--plot '.*plots' is a folder; pass a file name such as '.*plots/gradlog\.png'"),
        ("missing", r"--plot '.*nowhere/out\.png': '.*nowhere' does not exist; create the folder"),
        ("format", r"--plot '.*out\.docx': 'docx' is not an image format; end the name with \.png, \.pdf or \.svg"),
    ],
)
@pytest.mark.parametrize("command", ["report", "diff"])
def test_a_bad_plot_path_is_named_before_reading(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str, match: str, command: str
) -> None:
    """`--plot runs/plots` (a folder) printed "plot written to runs/plots" while matplotlib wrote
    `runs/plots.png` beside the folder; a missing folder or an unknown suffix failed only after the whole run was
    read and reported. Now each is exit 2 with the reason, before anything is read."""
    (tmp_path / "plots").mkdir()
    target = {
        "folder": tmp_path / "plots",
        "missing": tmp_path / "nowhere" / "out.png",
        "format": tmp_path / "out.docx",
    }
    paths = [str(run_dir)] if command == "report" else [str(tmp_path / "a.pt"), str(tmp_path / "b.pt")]
    code = main([command, *paths, "--plot", str(target[where])])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (out, err)
    assert re.search(match, err), err
    assert not (tmp_path / "plots.png").exists() and list((tmp_path / "plots").iterdir()) == []


def test_a_plot_name_without_a_suffix_says_where_it_went(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """matplotlib adds `.png` to a name without a suffix; the message named the path without it."""
    pytest.importorskip("matplotlib")
    code = main(["report", str(run_dir), "--plot", str(tmp_path / "curves")])
    err = capsys.readouterr().err
    assert code == 0 and f"plot written to {tmp_path / 'curves.png'}" in err, err
    assert (tmp_path / "curves.png").stat().st_size > 1000


@pytest.mark.parametrize("arg", ["include", "exclude"])
def test_a_filter_that_does_not_take_a_name_is_named(arg: str) -> None:
    """`include=lambda: True` failed at the first scan with "<lambda>() takes 0 positional arguments but 1 was
    given", which names neither the argument nor what the callable is given."""
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=rf"{arg}=<function .*: a callable filter is called with one argument"):
        gradlog.GradLogger(model, writer="memory", print_report=False, **{arg: lambda: True})
    gl = gradlog.GradLogger(model, writer="memory", print_report=False, **{arg: lambda name: name == "bias"})
    assert gl.close().tracked_tensors == 1  # bias only, or weight only


def test_a_scaler_class_is_named() -> None:
    """`scaler=torch.amp.GradScaler` (the class, not the loop's instance) raised "GradScaler.is_enabled() missing
    1 required positional argument: 'self'"."""
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"scaler=GradScaler: pass the instance your loop uses, not the class"):
        gradlog.GradLogger(model, writer="memory", scaler=torch.amp.GradScaler, print_report=False)
