"""include= / exclude=: which tensors gradlog watches."""

from __future__ import annotations

import pytest
import torch
from catalogue import EncoderHead, random_mse, train
from torch import nn

import gradlog
from gradlog import Reason


def _train(**kw: object) -> tuple[gradlog.MemoryWriter, gradlog.Report, EncoderHead, list[float]]:
    torch.manual_seed(0)
    model = EncoderHead()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=1, print_report=False, **kw)  # type: ignore[arg-type]
    totals = []

    def total_norm(step: int) -> None:
        watched = [p.grad for n, p in model.named_parameters() if n.startswith("encoder.") and p.grad is not None]
        totals.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in watched])).item())

    report = train(opt, gl, 3, random_mse(model, 4, 6), after_backward=total_norm)
    return mem, report, model, totals


def _tensors(mem: gradlog.MemoryWriter, metric: str) -> set[str]:
    head = f"weights/{metric}/"
    return {t[len(head) :] for t in mem.scalars if t.startswith(head)}


def test_include_glob_measures_writes_and_diagnoses_only_matching_tensors() -> None:
    mem, report, model, totals = _train(include="encoder.*")
    encoder = {n for n, _ in model.named_parameters() if n.startswith("encoder.")}
    for metric in ("grad_norm", "weight_norm", "update_ratio", "grad_nonfinite"):
        assert _tensors(mem, metric) == encoder, metric
    assert {t.split("/", 2)[2] for t in mem.histograms if t.startswith("weights/grad/")} == encoder
    assert [v for _, v in mem.scalars["gradlog/grad_norm_total"]] == pytest.approx(totals, rel=1e-6)
    assert report.never_updated == [] and report.tracked_tensors == len(encoder)  # the unused layer is not watched


def test_exclude_drops_tensors_and_they_are_not_reported() -> None:
    mem, report, model, _ = _train(exclude=["unused.*", "*.bias"])
    kept = {n for n, _ in model.named_parameters() if not n.startswith("unused.") and not n.endswith(".bias")}
    assert _tensors(mem, "grad_norm") == kept
    assert report.never_updated == []


def test_without_a_filter_the_unused_layer_is_reported() -> None:
    _, report, _, _ = _train()
    assert {r.name: r.reason for r in report.never_updated} == {
        "unused.weight": Reason.NO_GRAD,
        "unused.bias": Reason.NO_GRAD,
    }


def test_a_callable_selects_by_name() -> None:
    mem, report, _, _ = _train(include=lambda name: name.endswith("weight"))
    assert _tensors(mem, "grad_norm") == {"encoder.0.weight", "encoder.2.weight", "head.weight"}
    assert [r.name for r in report.never_updated] == ["unused.weight"]


def test_tied_weights_match_through_any_alias() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.out = nn.Linear(4, 10, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.out(self.emb(idx))

    model = Tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=1, include="out.*", print_report=False)
    model(torch.randint(0, 10, (5,))).sum().backward()
    opt.step()
    gl.log(0)
    gl.close()
    assert _tensors(mem, "grad_norm") == {"emb.weight"}  # listed under its first name


def test_a_filter_that_matches_nothing_names_what_names_look_like() -> None:
    model = EncoderHead()
    with pytest.raises(ValueError, match=r"include='enc\.\*'.*none of the model's 8 tensors.*'encoder\.0\.weight'"):
        gradlog.GradLogger(model, writer="memory", include="enc.*")


@pytest.mark.parametrize("bad", [[], [3], 5])
def test_a_filter_of_the_wrong_type_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="include must be a glob"):
        gradlog.GradLogger(EncoderHead(), writer="memory", include=bad)  # type: ignore[arg-type]
